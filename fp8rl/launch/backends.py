"""The backend registry: which code runs one validated cell into its run directory.

A backend is registered once, by name, with *import paths* (``"module:attr"``) rather than
objects, so that ``fp8rl.launch`` imports without torch and a backend's heavy dependencies
load only when a cell of that backend is validated or run.

Registered: ``mini`` (the embedded backend) and ``openrlhf`` (paper scale: OpenRLHF 0.11.2 +
our plugin on a Slurm cluster; ``fp8rl.backends.openrlhf``).

Contract of a backend (what the launcher relies on):

- ``config_class``: a dataclass extending ``fp8rl.config.RunConfig`` whose constructor
  validates (``__post_init__``) and whose extra block lives under ``settings_key``;
- ``run``: ``run(cfg, overrides, *, progress) -> summary dict``; it resumes from the run
  directory's checkpoint when there is one and returns the stored summary (with
  ``"skipped": True``) when the run is DONE;
- ``resolve_run_dir``: ``resolve_run_dir(cfg) -> Path``, the run directory of a config
  (``<cfg.output_dir>/<name>-<hash8>``), so the launcher knows every cell's directory before
  anything runs;
- ``data``: the data set names (``data=...``) the backend can run; ``scales``: the scales
  (``scale=...``) it serves;
- ``shared_cache``: ``(dotted key, subdirectory)``: when that key is null the launcher sets it
  to ``<output_dir>/<subdirectory>`` so every sweep under one runs root shares one cache (the
  mini backend's SFT warm starts); the key must be excluded from the run identity.
- ``describe`` (optional): ``describe(cfg, resources, run_dir) -> list[str]``, extra lines a dry
  run prints for a cell (the OpenRLHF backend prints the sbatch request and its full command).
- ``check_cell`` (optional): ``check_cell(cfg, resources) -> None``, raises ``ValueError`` when a
  validated config cannot run on the cell's resources (OpenRLHF's start-up assertions); called
  for every cell before anything is submitted.
- ``resources`` (optional): ``resources(cfg, requested) -> Resources``, what one cell asks the
  scheduler for, given the cluster profile's request for its model slot (``requested``); without
  it a cell asks for the profile's request as it is. The mini backend asks for CPUs and memory
  only (``fp8rl.backends.mini.run.cell_resources``): a tiny CPU cell must not hold a GPU node.
- ``prepare`` (optional): ``(key_path, prepare_path)``: ``key(cfg) -> hashable`` names one-time,
  idempotent work that cells share and ``prepare(cfg) -> None`` does it (the mini backend's SFT
  warm start); the local launcher queues one ``prepare`` per distinct key before the cells, so
  parallel workers do different preparations instead of waiting for one another. A cell must
  still work without it (it is an optimisation of the order, not a precondition).
- ``prepare_progress`` (optional): ``progress(cfg) -> Path``, the file in which the ``prepare``
  work reports its progress while it runs (``fp8rl.runs.prep_progress``; the mini backend's warm
  start); the local launchers' display draws a bar from it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from fp8rl.registry import Registry


def load_object(path: str) -> Any:
    """``"package.module:attr"`` -> the attribute (raises ``ImportError`` naming the path)."""
    if ":" not in path:
        raise ValueError(f"import path {path!r} must look like 'package.module:attr'")
    module, attr = path.split(":", 1)
    try:
        return getattr(importlib.import_module(module), attr)
    except AttributeError as e:
        raise ImportError(f"{module} has no attribute {attr!r} (import path {path!r})") from e


@dataclass(frozen=True)
class Backend:
    """A registered backend (see the module docstring for the contract)."""

    name: str
    config_class: str
    run: str
    resolve_run_dir: str
    settings_key: str | None
    settings_class: str | None
    data: tuple[str, ...]
    scales: tuple[str, ...]
    shared_cache: tuple[str, str] | None = None
    description: str = ""
    describe: str | None = None
    check_cell: str | None = None
    prepare: tuple[str, str] | None = None
    resources: str | None = None
    prepare_progress: str | None = None

    def load_config_class(self) -> type:
        return load_object(self.config_class)

    def load_settings_class(self) -> type | None:
        return None if self.settings_class is None else load_object(self.settings_class)

    def load_run(self):
        return load_object(self.run)

    def load_resolve_run_dir(self):
        return load_object(self.resolve_run_dir)

    def load_describe(self):
        return None if self.describe is None else load_object(self.describe)

    def load_check_cell(self):
        return None if self.check_cell is None else load_object(self.check_cell)

    def load_resources(self):
        return None if self.resources is None else load_object(self.resources)

    def load_prepare(self):
        """``(key, prepare)`` functions (see the module docstring); None without the hook."""
        return None if self.prepare is None else (load_object(self.prepare[0]), load_object(self.prepare[1]))

    def load_prepare_progress(self):
        return None if self.prepare_progress is None else load_object(self.prepare_progress)


BACKENDS: Registry[Backend] = Registry("backend")

BACKENDS.add(
    "mini",
    Backend(
        name="mini",
        config_class="fp8rl.backends.mini.config:MiniRunConfig",
        run="fp8rl.backends.mini.run:run_mini",
        resolve_run_dir="fp8rl.backends.mini.run:resolve_run_dir",
        settings_key="mini",
        settings_class="fp8rl.backends.mini.config:MiniSettings",
        data=("arith",),
        scales=("mini", "long"),
        shared_cache=("mini.cache_dir", ".cache/sft"),
        prepare=("fp8rl.backends.mini.run:warm_start_key", "fp8rl.backends.mini.run:prepare_warm_start"),
        prepare_progress="fp8rl.backends.mini.run:warm_start_progress",
        resources="fp8rl.backends.mini.run:cell_resources",
        description="the embedded backend: tiny Qwen3 models, our own RL loop, CPU or one GPU",
    ),
)

BACKENDS.add(
    "openrlhf",
    Backend(
        name="openrlhf",
        config_class="fp8rl.backends.openrlhf.config:OpenRLHFRunConfig",
        run="fp8rl.backends.openrlhf.run:run_openrlhf",
        resolve_run_dir="fp8rl.backends.openrlhf.run:resolve_run_dir",
        settings_key="openrlhf",
        settings_class="fp8rl.backends.openrlhf.config:OpenRLHFSettings",
        data=("paper",),
        scales=("paper",),
        description="paper scale: OpenRLHF 0.11.2 + vLLM + DeepSpeed with the fp8rl plugin, on Slurm",
        describe="fp8rl.backends.openrlhf.run:describe",
        check_cell="fp8rl.backends.openrlhf.run:check_cell",
    ),
)
