"""The binding in the driver process: FP8 engine kwargs (and Score Centering's logprobs settings),
and no training unless every policy actor runs the plugin as the cell asks."""

from __future__ import annotations

import os
import sys

from fp8rl.backends.openrlhf.plugin.binding.common import PluginNotActiveError, _originals
from fp8rl.backends.openrlhf.plugin.fp8_training import count_fp8_layers, require_conversion
from fp8rl.backends.openrlhf.plugin.spec import PluginSpec, check_version


def attest(actor) -> dict:
    """Run inside a ``PolicyModelActor`` (``handle.__ray_call__.remote(attest)``): what is bound there."""
    from fp8rl.backends.openrlhf.plugin.hook import TARGETS, installed_spec_json

    trainer = getattr(actor, "trainer", None)
    return {
        "pid": os.getpid(),
        "hook_spec": installed_spec_json(),
        "bound": {n: getattr(sys.modules.get(n), "_fp8rl_spec_json", None) for n in TARGETS[:2]},
        "loss": type(trainer.actor_loss_fn).__name__ if trainer is not None else None,
        "fp8_layers": count_fp8_layers(trainer.actor) if trainer is not None else None,
        "step": getattr(trainer, "_fp8rl_step", None),
    }


def check_attestations(spec: PluginSpec, reports: list[dict]) -> None:
    """Raise :class:`PluginNotActiveError` / ``Fp8ConversionError`` unless every actor runs ``spec``."""
    want = spec.to_json()
    for rank, r in enumerate(reports):
        where = f"policy actor rank {rank} (pid {r.get('pid')})"
        if r.get("hook_spec") is None:
            raise PluginNotActiveError(f"{where}: the fp8rl worker setup hook did not run (no import hook); "
                                       "was the driver's Ray runtime env replaced?")
        unbound = [n for n, s in r["bound"].items() if s != want]
        if unbound:
            raise PluginNotActiveError(f"{where}: the plugin is not bound into {unbound} with this cell's spec")
        if r.get("loss") != "Fp8rlPolicyLoss":
            raise PluginNotActiveError(f"{where}: the trainer uses {r.get('loss')}, not fp8rl's loss")
        require_conversion(spec, int(r["fp8_layers"]), where)


def install_driver(spec: PluginSpec, modules: dict | None = None, record: str | None = None) -> None:
    """Driver process: FP8 engines (``RolloutRayActor`` kwargs) and the pre-training attestation.

    ``modules``: ``{"vllm_engine", "launcher", "ppo_actor"}`` module objects (default: imported).
    ``record``: a JSON file the start-up check writes after it passed (the reports of every policy
    actor; the driver puts it at ``<run>/openrlhf/attestation.json``).
    """
    import importlib

    from fp8rl.backends.openrlhf.plugin.fp8_rollout import (
        check_node_hardware,
        rollout_engine_kwargs,
    )

    check_node_hardware(spec)  # refuse GPUs the cell's FP8 recipes cannot run on, before any engine
    check_version()
    names = {"vllm_engine": "openrlhf.trainer.ray.vllm_engine", "launcher": "openrlhf.trainer.ray.launcher",
             "ppo_actor": "openrlhf.trainer.ray.ppo_actor"}
    modules = dict(modules or {})
    for key, name in names.items():
        if key not in modules:
            modules[key] = importlib.import_module(name)
    from fp8rl.backends.openrlhf.plugin.score_centering import engine_kwargs

    # Score Centering: the processed top-k log-probs (plugin.score_centering), over upstream's max_logprobs=1
    extra = {**rollout_engine_kwargs(spec), **engine_kwargs(spec.score_centering)}
    vllm_engine = modules["vllm_engine"]
    actor = vllm_engine.RolloutRayActor
    if isinstance(actor, _InjectingActorClass):
        actor = actor._cls
    vllm_engine.RolloutRayActor = _InjectingActorClass(actor, extra) if extra else actor

    group_cls, policy_cls = modules["launcher"].RayActorGroup, modules["ppo_actor"].PolicyModelActor
    orig = _originals(group_cls, ("async_init_model_from_pretrained",))["async_init_model_from_pretrained"]

    def async_init_model_from_pretrained(self, *args, **kwargs):
        refs = orig(self, *args, **kwargs)
        if getattr(self, "ray_actor_type", None) is policy_cls:
            import ray

            ray.get(refs)
            reports = ray.get([h.__ray_call__.remote(attest) for h in self._actor_handlers])
            check_attestations(spec, reports)
            if record:
                import json

                with open(record, "w", encoding="utf-8") as f:
                    json.dump({"spec": json.loads(spec.to_json()), "checked": True, "actors": reports}, f,
                              indent=1, sort_keys=True)
        return refs

    group_cls.async_init_model_from_pretrained = async_init_model_from_pretrained


class _InjectingActorClass:
    """Stands in for ``RolloutRayActor`` in the driver: ``.options(...).remote(**kw)`` adds kwargs."""

    def __init__(self, actor_class, extra: dict) -> None:
        self._cls, self._extra = actor_class, dict(extra)

    def options(self, **opts):
        handle = self._cls.options(**opts)
        extra = self._extra

        class _Remote:
            @staticmethod
            def remote(*args, **kwargs):
                return handle.remote(*args, **{**kwargs, **extra})

        return _Remote()

    def __getattr__(self, name):
        return getattr(self._cls, name)
