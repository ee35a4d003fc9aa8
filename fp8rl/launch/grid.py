"""Expand a sweep into its cells and validate every one of them before anything runs.

``plan_sweep`` turns the composed primary config (Hydra, multirun mode), the sweep's grid
(``hydra.sweeper.params`` of a ``sweeps/sweep/*.yaml`` file) and the command-line overrides
into a :class:`SweepPlan`: one :class:`CellPlan` per grid point and seed, each holding the
backend's fully validated run config, its run directory (name + hash, ``fp8rl.runs.identity``
through the backend's ``resolve_run_dir``), its Slurm resources and its state on disk.

Expansion follows Hydra's basic sweeper exactly (``BasicSweeper.split_arguments``: the
cartesian product of every comma-separated axis, command-line values replacing the sweep
file's for the same key), then multiplies by the seed axis ``seeds=N`` (``seed, seed+1, ...``).
Each grid point is composed by Hydra's own config loader (``load_sweep_config``), so a cell's
config is exactly what ``python -m experiments.launch <its overrides>`` would compose.

Validation happens for *every* cell before the caller runs or submits anything, and nothing
is written while validating. Checks, in order:

0. every override's key or config group against the schema and ``sweeps/``
   (``fp8rl.launch.keys``: ``+stepz=3``, ``hydra/launcher=...``; exit status 2, alone);
1. config-group values (``algorithm=dapoo``) against the group's options;
2. Hydra composition (unknown keys, values of the wrong type, against the typed schema);
3. launch fields: backend registered, scale and data supported by the backend, launcher
   registered, a cluster profile for launchers that need one (loaded and validated, with the
   ``gpus_per_node`` override applied), the launch fields the same for all cells, ``run_dir``
   unset when there is more than one cell; a ``scheduler: local`` profile (``cluster=workstation``)
   makes the launcher ``local`` with one cell at a time (``local_parallel`` or ``workers`` > 1
   are refused) and needs a backend that lays out GPUs (a ``check_cell`` hook);
4. the backend's config class (``__post_init__``: ranges, registry names, cross-field rules
   such as dynamic sampling with one sample per prompt);
5. the runs root not empty and writable (nearest existing ancestor is a directory we can create
   files in); the number of cells (grid points x ``seeds``) at most :data:`MAX_CELLS`, checked
   before expanding;
6. no two cells resolving to the same run directory.

All problems are collected and reported together (:class:`SweepError`), each naming the cell
(index and overrides), the field, and the valid values where there is a list.

The pieces live by concern: ``fp8rl.launch.compose`` (expansion and composition),
``fp8rl.launch.validate`` (launch fields, profiles, paths, the error report) and this module
(the cell and sweep plans, and the order of the checks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from fp8rl.launch.checks import cell_value_errors
from fp8rl.launch.compose import compose_cells, expand_overrides, get_dotted, set_dotted
from fp8rl.launch.configs import build_dataclass
from fp8rl.launch.errors import SweepError
from fp8rl.launch.keys import override_key_errors, raise_unknown, unknown_composed_keys
from fp8rl.launch.profiles import ClusterProfile, Resources
from fp8rl.launch.schema import LAUNCH_KEYS
from fp8rl.launch.validate import (
    cell_label,
    check_writable,
    exception_text,
    group_errors,
    launch_field_errors,
    raise_errors,
)

#: Cells one sweep may hold (the paper's largest grid has a few hundred): a bound that stops a
#: typo's ``seeds=100000000`` before it expands for minutes while memory grows.
MAX_CELLS = 10_000

__all__ = ["MAX_CELLS", "CellPlan", "SweepError", "SweepPlan", "check_writable", "compose_cells", "expand_overrides",
           "plan_sweep"]


@dataclass(frozen=True)
class CellPlan:
    """One validated cell: what runs, where it lands, what it asks for."""

    index: int
    total: int
    overrides: tuple[str, ...]
    seed: int
    backend: str
    config: dict
    run_dir: Path
    name: str
    hash: str
    axes: dict
    steps: int
    resources: Resources | None = None
    state: str | None = None

    @property
    def label(self) -> str:
        return f"cell {self.index}/{self.total} {self.run_dir.name}"

    def payload(self, *, progress: bool = False) -> dict:
        """What a job needs to run this cell (plain, picklable containers)."""
        return {
            "backend": self.backend,
            "config": self.config,
            "overrides": list(self.overrides),
            "run_dir": str(self.run_dir),
            "progress": progress,
        }


@dataclass
class SweepPlan:
    """Every cell of a sweep plus the launch settings shared by all cells."""

    sweep_name: str
    root: Path
    sweep_dir: Path
    launcher: str
    cells: list[CellPlan]
    profile: ClusterProfile | None = None
    dry_run: bool = False
    wait: bool | None = None
    array_parallelism: int | None = None
    workers: int | None = None
    progress: bool = True
    base_overrides: tuple[str, ...] = field(default_factory=tuple)


def _plan_point(overrides: list[str], container: dict, launch: dict, first_index: int, total: int, seeds: int,
                profiles: dict[str, ClusterProfile]) -> tuple[list[CellPlan], list[str], Path | None]:
    """The cells of one grid point (one per seed), built into its backend's config and checked:
    ``(cells, errors, runs root)``; the root is None when the point's launch fields are wrong."""
    label = cell_label(first_index, total, overrides)
    cell_errors, backend, profile = launch_field_errors(launch, profiles)
    if cell_errors or backend is None:
        return [], [f"{label}: {m}" for m in cell_errors], None
    if not str(container.get("output_dir", "runs")).strip():  # Path("") is the current directory
        return [], [f"{label}: output_dir is empty: give the runs root (default runs); an empty path "
                    "would write the sweep into the current directory"], None
    root = Path(str(container.get("output_dir", "runs"))).expanduser().absolute()
    sweep_dir = root / launch["sweep_name"]
    cls = backend.load_config_class()
    names = {f.name for f in dataclasses.fields(cls)}
    sub = {k: v for k, v in container.items() if k in names}
    sub["output_dir"] = str(sweep_dir)
    if total > 1 and sub.get("run_dir"):
        return [], [f"{label}: run_dir: set to {sub['run_dir']!r} but the sweep has {total} cells; leave "
                    "run_dir=null so each cell gets its own directory"], root
    if backend.shared_cache and get_dotted(sub, backend.shared_cache[0]) is None:
        set_dotted(sub, backend.shared_cache[0], str(root / backend.shared_cache[1]))
    base_seed = int(sub.get("seed", 0))
    resolve = backend.load_resolve_run_dir()
    cells: list[CellPlan] = []
    for s in range(seeds):  # other seeds of a point fail the same way: the first error ends it
        index = first_index + s
        cell_overrides = [*overrides, f"seed={base_seed + s}"] if seeds > 1 else list(overrides)
        seed_label = cell_label(index, total, cell_overrides)
        try:
            run_cfg = build_dataclass(cls, {**sub, "seed": base_seed + s})
        except Exception as e:  # __post_init__ ValueError, or OmegaConf's own errors
            return cells, [f"{seed_label}: {exception_text(e)}"], root
        resources = profile.resources_for(run_cfg.model.slot) if profile else None
        if resources is not None and backend.resources is not None:  # what this cell needs
            resources = backend.load_resources()(run_cfg, resources)
        check_cell = backend.load_check_cell()
        if check_cell is not None:
            try:
                check_cell(run_cfg, resources)
            except ValueError as e:
                return cells, [f"{seed_label}: {exception_text(e)}"], root
        value_errors = cell_value_errors(run_cfg, launch["launcher"])
        if value_errors:
            return cells, [f"{seed_label}: {m}" for m in value_errors], root
        run_dir = Path(resolve(run_cfg))
        from fp8rl.runs.identity import parse_run_name

        parts = parse_run_name(run_dir.name)
        cells.append(CellPlan(
            index=index, total=total, overrides=tuple(cell_overrides), seed=base_seed + s, backend=backend.name,
            config=dataclasses.asdict(run_cfg), run_dir=run_dir,
            name=run_dir.name[: -len(parts["hash"]) - 1] if parts["hash"] else run_dir.name,
            hash=parts["hash"] or "", steps=int(getattr(run_cfg, "steps", 0)),
            axes={"algorithm": parts["algorithm"], "model": parts["model"], "fp8": parts["fp8"],
                  "clip": parts["clip"], "seed": base_seed + s, "scale": launch["scale"]},
            resources=resources, state=_state_of(run_dir)))
    return cells, [], root


def plan_sweep(master_cfg, config_loader, params: Mapping[str, str], arguments: Sequence[str], *,
               exact: bool = False) -> SweepPlan:
    """Expand and validate the whole sweep; raises :class:`SweepError` listing every problem.

    ``exact``: compose every grid point with Hydra in full (see :func:`compose_cells`).
    """
    from fp8rl.launch.launchers import LAUNCHERS

    grid = expand_overrides(params, arguments, config_loader)
    groups = [g for g in config_loader.list_groups("") if g != "hydra"]
    hydra_overrides = list(OmegaConf.select(master_cfg, "hydra.overrides.hydra", default=None) or [])
    raise_unknown(override_key_errors([*hydra_overrides, *dict.fromkeys(ov for g in grid for ov in g)], groups))
    seeds = master_cfg.get("seeds", 1)
    errors: list[str] = []
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        raise SweepError(f"seeds must be an integer >= 1 (the number of seeds per cell), got {seeds!r}")
    if len(grid) * seeds > MAX_CELLS:  # checked before expanding: 10^8 seeds would expand for minutes
        raise SweepError(f"seeds={seeds}: the sweep would have {len(grid) * seeds:,} cells ({len(grid)} grid "
                         f"point(s) x {seeds} seeds), each a training run and a run directory; a sweep holds at "
                         f"most {MAX_CELLS:,} cells, so give seeds <= {max(1, MAX_CELLS // len(grid))}")
    seed_keys = {ov.split("=", 1)[1] for g in grid for ov in g if ov.split("=", 1)[0] == "seed"}
    if seeds > 1 and len(seed_keys) > 1:
        raise SweepError(f"seeds={seeds} and a seed sweep ({sorted(seed_keys)}) were both given; "
                         "use seeds=N (seeds seed..seed+N-1) or seed=a,b,c, not both")
    total = len(grid) * seeds

    def total_of(_i: int) -> int:
        return total

    errors += group_errors(grid, config_loader, total_of)
    errors += type_errors(grid, total_of)
    if errors:
        raise_errors(errors, total)

    cells: list[CellPlan] = []
    launch_values: dict[str, set] = {}
    profiles: dict[str, ClusterProfile] = {}
    roots: set[Path] = set()
    first_launch: dict | None = None
    composed = compose_cells(master_cfg, config_loader, grid, exact=exact)
    for gi, (overrides, container) in enumerate(zip(grid, composed, strict=True)):
        label = cell_label(gi * seeds + 1, total, overrides)
        if isinstance(container, Exception):  # Hydra/OmegaConf composition errors name the key
            errors.append(f"{label}: {exception_text(container)}")
            continue
        unknown = unknown_composed_keys(container)
        if unknown:  # every override was checked above; this is what else composed in
            raise_unknown([f"{label}: the composed config has key(s) {', '.join(unknown)} that no backend "
                           "or launcher reads; remove them"])
        launch = {k: container.pop(k, None) for k in LAUNCH_KEYS}
        first_launch = first_launch or launch
        for k, v in launch.items():
            launch_values.setdefault(k, set()).add(repr(v))
        point_cells, point_errors, root = _plan_point(overrides, container, launch, gi * seeds + 1, total, seeds,
                                                      profiles)
        cells += point_cells
        errors += point_errors
        if root is not None:
            roots.add(root)

    for key in ("launcher", "cluster", "sweep_name", "output_dir", "dry_run", "wait",
                "array_parallelism", "workers", "progress", "gpus_per_node"):
        vals = launch_values.get(key, set())
        if len(vals) > 1:
            errors.append(f"{key}: the cells disagree ({', '.join(sorted(vals))}); it applies to the "
                          "whole sweep, so it cannot be a sweep axis")
    for root in sorted(roots):
        reason = check_writable(root)
        if reason:
            errors.append(reason)
    by_dir: dict[Path, CellPlan] = {}
    for c in cells:
        if c.run_dir in by_dir:
            errors.append(
                f"{c.label} and cell {by_dir[c.run_dir].index} resolve to the same run directory "
                f"{c.run_dir.name}: they differ only in fields excluded from the run identity "
                f"({' '.join(c.overrides)} vs {' '.join(by_dir[c.run_dir].overrides)})")
        by_dir[c.run_dir] = c
    if errors:
        raise_errors(errors, total)
    if not cells:
        raise SweepError("the sweep has no cells")
    launch0 = first_launch or {k: master_cfg.get(k) for k in LAUNCH_KEYS}
    root = next(iter(roots))
    profile = next(iter(profiles.values()), None)
    local = profile is not None and profile.local
    if not local and profile is not None and not LAUNCHERS[str(launch0["launcher"])].needs_cluster:
        profile = None
    return SweepPlan(
        sweep_name=str(launch0["sweep_name"]), root=root, sweep_dir=root / str(launch0["sweep_name"]),
        launcher="local" if local else str(launch0["launcher"]), cells=cells,
        profile=profile, dry_run=bool(launch0["dry_run"]),
        wait=launch0["wait"], array_parallelism=launch0["array_parallelism"],
        workers=1 if local else launch0["workers"],
        progress=bool(launch0["progress"]),
        base_overrides=tuple(a for a in arguments),
    )


def type_errors(grid: list[list[str]], total_of) -> list[str]:
    """Values of the wrong type for a typed key (``steps=abc`` in an axis), one message per distinct
    override naming the first cell (``fp8rl.launch.values``), instead of Hydra's merge error per cell."""
    from fp8rl.launch.values import override_value_errors

    errors, seen = [], set()
    for i, overrides in enumerate(grid):
        for ov in overrides:
            if ov in seen:
                continue
            seen.add(ov)
            errors += [f"{cell_label(i + 1, total_of(i), overrides)}: {m}"
                       for m in override_value_errors([ov], groups=False)]
    return errors


def _state_of(run_dir: Path) -> str | None:
    from fp8rl.runs import RunDir

    try:
        return RunDir(run_dir).state
    except (OSError, ValueError):
        return None


def plan_command(arguments: Sequence[str]) -> SweepPlan:
    """The validated plan of an ``experiments.launch`` command line, composed by Hydra in this
    process from ``sweeps/`` as the launcher composes it, without running or writing anything
    (``SweepPlan.cells`` carry each cell's payload and run directory). Raises :class:`SweepError`
    as the launcher would. For callers that need the cells of a sweep (cost models, tests)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from fp8rl.launch.keys import SWEEPS_DIR
    from fp8rl.launch.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(SWEEPS_DIR), version_base=None):
            loader = GlobalHydra.instance().config_loader()
            master = loader.load_configuration("config", overrides=list(arguments), run_mode=RunMode.MULTIRUN)
            return plan_sweep(master, loader, dict(master.hydra.sweeper.params), list(arguments))
    finally:
        GlobalHydra.instance().clear()
