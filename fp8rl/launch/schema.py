"""Typed config schema of ``python -m experiments.launch``, registered in Hydra's ConfigStore.

The schema is not a new set of dataclasses: it is the default backend's run config
(``MiniRunConfig``, i.e. ``fp8rl.config.RunConfig`` -- the four axes ``algorithm/ model/ fp8/
clip/`` as ``AlgorithmConfig``, ``ModelConfig``, ``Fp8Config``, ``ClipConfig``, schedule and
optimiser fields -- plus its ``mini: MiniSettings`` block), the settings blocks of the other
registered backends, and :class:`LaunchFields` (where and how to run). Hydra checks every
YAML file and command-line override against it while composing (unknown keys and values of the
wrong type fail there, naming the key); the cross-field checks run when each cell is built
into its backend's config class (``fp8rl.launch.grid``).

``register_configs()`` stores the schema as ``fp8rl_launch_schema`` (the first entry of
``sweeps/config.yaml``'s defaults list) and the sweeper's config as ``hydra/sweeper: fp8rl``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SCHEMA_NAME = "fp8rl_launch_schema"


@dataclass
class LaunchFields:
    """Where and how the cells run (none of these enter a run's identity).

    Attributes:
        scale: ``mini`` or ``paper`` (set by ``scale/*.yaml``; checked against the backend).
        backend: key of ``fp8rl.launch.backends.BACKENDS``.
        launcher: key of ``fp8rl.launch.launchers.LAUNCHERS`` (``local``, ``local_parallel``,
            ``slurm``).
        data: the data set; each backend lists what it can run.
        cluster: cluster profile for ``launcher=slurm``: a name in ``slurm/profiles/`` or a path
            to a YAML file (``fp8rl.launch.profiles``); a ``scheduler: local`` profile
            (``cluster=workstation``) runs the cells on this machine with the ``local`` launcher.
        sweep_name: the sweep's directory under ``output_dir``.
        seeds: seeds per cell: ``seed, seed+1, ..., seed+seeds-1`` (an axis of the grid).
        dry_run: expand, validate and print every cell; run and write nothing.
        wait: block until every cell ends; ``None`` = the launcher's default (local launchers
            block, ``slurm`` submits and returns).
        array_parallelism: most array tasks running at once on Slurm, or the most local
            processes for ``local_parallel`` (``None`` = the profile's value, or 2 locally).
        workers: cells the ``local`` launcher runs at once, each in a worker process with one
            torch thread (``None`` = one per CPU core this process may use; 1 = one after
            another in this process).
        progress: show the sweep-level progress display (local launchers).
        gpus_per_node: GPUs per node of every cell, replacing the cluster profile's for every
            model slot (``None`` = the profile's); e.g. ``cluster=workstation gpus_per_node=4``.
    """

    scale: str = "mini"
    backend: str = "mini"
    launcher: str = "local"
    data: str = "arith"
    cluster: str | None = None
    sweep_name: str = "default"
    seeds: int = 1
    dry_run: bool = False
    wait: bool | None = None
    array_parallelism: int | None = None
    workers: int | None = None
    progress: bool = True
    gpus_per_node: int | None = None


#: Top-level keys that belong to launching, not to a backend's run config.
LAUNCH_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LaunchFields))


@dataclass
class SweeperConf:
    """``hydra/sweeper: fp8rl``: the grid, as Hydra's basic sweeper spells it.

    ``params`` maps a key or config group to a comma-separated sweep (``fp8: bf16,tensorwise``).
    """

    _target_: str = "hydra_plugins.fp8rl_launch.fp8rl_sweeper.Fp8rlSweeper"
    params: dict[str, str] = field(default_factory=dict)


def build_schema() -> type:
    """``LaunchConfig``: ``LaunchFields`` + the default backend's run config + other backends' blocks.

    The run fields and their defaults come from the config class of the default backend
    (``LaunchFields.backend``, i.e. ``mini``: ``MiniRunConfig``, a ``RunConfig``), so a field
    that no YAML file sets keeps exactly the default that backend chose. Another backend adds
    its settings block here and sets the defaults it needs in its ``backend/<name>.yaml``.
    """
    from fp8rl.config import RunConfig
    from fp8rl.launch.backends import BACKENDS

    base = BACKENDS[LaunchFields.backend].load_config_class()
    if not issubclass(base, RunConfig):
        raise TypeError(f"the default backend's config class {base.__name__} must extend RunConfig")
    have = {f.name for f in dataclasses.fields(base)}
    blocks: list[tuple[str, Any, Any]] = []
    for b in BACKENDS.values():
        cls = b.load_settings_class()
        if b.settings_key and cls is not None and b.settings_key not in have:
            blocks.append((b.settings_key, cls, field(default_factory=cls)))
    return dataclasses.make_dataclass("LaunchConfig", blocks, bases=(LaunchFields, base))


def register_configs() -> None:
    """Store the schema and the sweeper config in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name=SCHEMA_NAME, node=build_schema())
    cs.store(group="hydra/sweeper", name="fp8rl", node=SweeperConf, provider="fp8rl")
