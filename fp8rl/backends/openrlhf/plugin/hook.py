"""The Ray worker setup hook: bind the plugin lazily, in the processes that import OpenRLHF's trainer.

The driver starts Ray with ``runtime_env={"worker_process_setup_hook":
"fp8rl.backends.openrlhf.plugin.hook.install_from_env", "env_vars": {SPEC_ENV: <spec JSON>}}``,
so Ray runs :func:`install_from_env` in **every** worker process of the job when it starts --
PPO actors, the PPO trainer, vLLM engine actors -- before Ray has assigned the process a task
and before it has set ``CUDA_VISIBLE_DEVICES`` for it. Importing OpenRLHF's actor stack there
(DeepSpeed, vLLM, transformers, CUDA initialisation) would happen in every worker and before its
devices are known. So the hook does no binding itself: it puts an import hook (a
``sys.meta_path`` finder) in front of the import system, and when -- and only if -- the process
imports one of the :data:`TARGETS`, the module executes normally and the plugin then binds into
it (``binding.bind_module``). A PPO actor imports them while Ray unpickles the
``PolicyModelActor`` class (after ``CUDA_VISIBLE_DEVICES`` is set); a vLLM engine actor imports
only ``openrlhf.utils.agent`` of them (its response builder, bound for Score Centering cells only,
``binding.agent``). A target already imported when the hook runs is bound at once.

Why these modules: Ray ships ``@ray.remote`` classes (``PolicyModelActor``) by value, so their
methods see private copies of module globals; what reaches them is what they resolve *by
reference* -- classes such as ``ActorPPOTrainer`` and ``DeepspeedStrategy``, whose methods the
binding wraps, and the module dict of ``openrlhf.trainer.ray.ppo_actor`` that
``ActorPPOTrainer.__init__`` reads ``PolicyLoss`` from.

This module imports the standard library only (on a CPU job, ``PluginSpec.device == "cpu"``, the
hook also makes OpenRLHF's direct ``torch.cuda`` calls CPU-valid -- ``cpu_support.apply_torch_cuda``
-- when the process imports torch, not before: Ray's idle workers never do); binding errors propagate as import errors of
the target module (the worker fails loudly instead of training without the plugin).
"""

from __future__ import annotations

import importlib.abc
import os
import sys

from fp8rl.backends.openrlhf.plugin.spec import SPEC_ENV, TARGETS


def install_from_env() -> None:
    """Ray ``worker_process_setup_hook``: read the spec from :data:`SPEC_ENV`, install the import hook."""
    text = os.environ.get(SPEC_ENV)
    if not text:
        raise RuntimeError(f"{SPEC_ENV} is not set: the fp8rl driver sets it in the Ray runtime env")
    install_lazy(text)
    if '"device": "cpu"' in text:  # the CPU job: OpenRLHF's torch.cuda calls made CPU-valid on import
        after_import("torch", _apply_torch_cuda)


def _apply_torch_cuda(_torch) -> None:
    from fp8rl.backends.openrlhf.plugin.cpu_support import apply_torch_cuda

    apply_torch_cuda()


def after_import(name: str, callback) -> None:
    """Run ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImportFinder)), None)
    if finder is None:
        finder = _AfterImportFinder()
        sys.meta_path.insert(0, finder)
    finder.callbacks[name] = callback


def install_lazy(spec_json: str) -> None:
    """Bind into the :data:`TARGETS` when they are imported (now, for those already imported)."""
    finder = next((f for f in sys.meta_path if isinstance(f, _BindingFinder)), None)
    if finder is None:
        finder = _BindingFinder()
        sys.meta_path.insert(0, finder)
    finder.spec_json = spec_json
    for name in TARGETS:
        module = sys.modules.get(name)
        if module is not None:
            _bind(name, module, spec_json)


def installed_spec_json() -> str | None:
    """The spec JSON the import hook of this process binds with (None: no hook installed)."""
    finder = next((f for f in sys.meta_path if isinstance(f, _BindingFinder)), None)
    return None if finder is None else finder.spec_json


def _bind(name: str, module, spec_json: str) -> None:
    from fp8rl.backends.openrlhf.plugin.binding import bind_module

    bind_module(name, module, spec_json)


class _BindingLoader(importlib.abc.Loader):
    """Wraps a target's loader: execute the module as usual, then bind the plugin into it."""

    def __init__(self, loader, spec_json: str) -> None:
        self._loader, self._spec_json = loader, spec_json

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _bind(module.__name__, module, self._spec_json)

    def __getattr__(self, name):  # get_source, is_package, ... of the wrapped loader
        return getattr(self._loader, name)


class _CallbackLoader(importlib.abc.Loader):
    """Wraps a loader: execute the module as usual, then run a callback on it."""

    def __init__(self, loader, callback) -> None:
        self._loader, self._callback = loader, callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds modules with a pending :func:`after_import` callback and wraps their loaders."""

    def __init__(self) -> None:
        self.callbacks: dict = {}

    def find_spec(self, fullname, path, target=None):
        callback = self.callbacks.pop(fullname, None)
        if callback is None:
            return None
        return _spec_with_loader(self, fullname, path, target, lambda loader: _CallbackLoader(loader, callback))


class _BindingFinder(importlib.abc.MetaPathFinder):
    """Finds the :data:`TARGETS` through the other finders and wraps their loaders."""

    spec_json: str = ""

    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        return _spec_with_loader(self, fullname, path, target, lambda loader: _BindingLoader(loader, self.spec_json))


def _spec_with_loader(me, fullname, path, target, wrap):
    """The spec the other finders give for ``fullname``, its loader wrapped by ``wrap``."""
    for finder in sys.meta_path:
        if finder is me or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
            if spec.loader is not None:
                spec.loader = wrap(spec.loader)
            return spec
    return None
