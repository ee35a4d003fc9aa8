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
5. the runs root writable (nearest existing ancestor is a directory we can create files in);
6. no two cells resolving to the same run directory.

All problems are collected and reported together (:class:`SweepError`), each naming the cell
(index and overrides), the field, and the valid values where there is a list.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8rl.launch.checks import cell_value_errors, launch_value_errors
from fp8rl.launch.configs import build_dataclass
from fp8rl.launch.errors import SweepError
from fp8rl.launch.profiles import ClusterProfile, ProfileError, Resources, load_profile
from fp8rl.launch.schema import LAUNCH_KEYS

_SWEEP_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
MAX_REPORTED = 25



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


def _label(index: int, total: int, overrides: Sequence[str]) -> str:
    shown = " ".join(overrides) if overrides else "(defaults)"
    return f"cell {index}/{total} [{shown}]"


def expand_overrides(params: Mapping[str, str], arguments: Sequence[str], config_loader) -> list[list[str]]:
    """The grid as lists of ``key=value`` overrides, one list per grid point (Hydra semantics)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params_conf = [f"{k}={v}" for k, v in (params or {}).items()]
    parser = OverridesParser.create(config_loader=config_loader)
    parsed = parser.parse_overrides([*params_conf, *arguments])
    return BasicSweeper.split_arguments(parsed, None)[0]


def _group_errors(grid: list[list[str]], config_loader, total_of) -> list[str]:
    """Unknown config-group values, one message per distinct bad value (naming the first cell)."""
    errors, seen = [], set()
    options_of: dict[str, list[str]] = {}
    for i, overrides in enumerate(grid):
        for ov in overrides:
            key, _, value = ov.partition("=")
            key = key.lstrip("+~")
            if "@" in key or "." in key or key + "=" + value in seen:
                continue
            if key not in options_of:
                options_of[key] = config_loader.get_group_options(key)
            options = options_of[key]
            if not options:
                continue
            if value not in options:
                seen.add(key + "=" + value)
                errors.append(
                    f"{_label(i + 1, total_of(i), overrides)}: {key}: unknown value {value!r}; "
                    f"valid values: {', '.join(sorted(options))}"
                )
    return errors


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    node = d
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def _get_dotted(d: Mapping, dotted: str) -> Any:
    node: Any = d
    for p in dotted.split("."):
        if not isinstance(node, Mapping) or p not in node:
            return None
        node = node[p]
    return node


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{dotted.path: leaf}`` (lists and scalars are leaves; ``{}`` is a leaf)."""
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


_REMOVED = object()


def _delta(base: dict, other: dict) -> dict[str, Any]:
    """Dotted paths where ``other`` differs from ``base`` (``_REMOVED`` where it lacks a path)."""
    fb, fo = _flatten(base), _flatten(other)
    out = {k: v for k, v in fo.items() if k not in fb or fb[k] != v}
    out.update({k: _REMOVED for k in fb if k not in fo})
    return out


def _overlap(paths_a: set[str], paths_b: set[str]) -> bool:
    for a in paths_a:
        for b in paths_b:
            if a == b or a.startswith(b + ".") or b.startswith(a + "."):
                return True
    return False


def _apply(base: dict, delta: dict[str, Any]) -> None:
    for path, value in delta.items():
        parts = path.split(".")
        node = base
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        if value is _REMOVED:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = copy.deepcopy(value)


def _compose(master_cfg, config_loader, overrides: list[str]) -> dict:
    """Hydra's composition of ``overrides`` (resolved, ``hydra`` node dropped)."""
    from omegaconf import OmegaConf

    cfg = config_loader.load_sweep_config(master_cfg, list(overrides))
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    return container


def compose_cells(master_cfg, config_loader, grid: list[list[str]], *, exact: bool = False
                  ) -> list[dict | Exception]:
    """The composed config of every grid point (an exception where composition failed).

    ``exact=True`` runs Hydra's full composition per grid point (about 0.1 s each). The default
    composes once per *axis value* instead: the base (every single-valued override) and, for
    each value of each multi-valued axis, the base with that one value; a grid point is the
    base plus the changes of its axis values. That equals the full composition whenever the
    axes change disjoint keys, which is checked: a grid point whose axes touch a common key is
    composed in full. (``tests/launch`` compares both for every shipped sweep.)
    """
    if exact or len(grid) <= 1:
        out: list[dict | Exception] = []
        for overrides in grid:
            try:
                out.append(_compose(master_cfg, config_loader, overrides))
            except Exception as e:
                out.append(e)
        return out
    keys = [[ov.split("=", 1)[0] for ov in g] for g in grid]
    values: dict[str, set[str]] = {}
    for g in grid:
        for ov in g:
            values.setdefault(ov.split("=", 1)[0], set()).add(ov)
    singles = [next(iter(v)) for k, v in values.items() if len(v) == 1]
    try:
        base = _compose(master_cfg, config_loader, singles)
    except Exception as e:
        return [e] * len(grid)
    deltas: dict[str, dict | Exception] = {}
    for k, vals in values.items():
        if len(vals) == 1:
            continue
        rest = [s for s in singles if s.split("=", 1)[0] != k]
        for ov in vals:
            try:
                deltas[ov] = _delta(base, _compose(master_cfg, config_loader, [*rest, ov]))
            except Exception as e:
                deltas[ov] = e
    out = []
    for g, ks in zip(grid, keys, strict=True):
        ds = [deltas[ov] for ov, k in zip(g, ks, strict=True) if len(values[k]) > 1]
        err = next((d for d in ds if isinstance(d, Exception)), None)
        if err is not None:
            out.append(err)
            continue
        paths = [set(d) for d in ds]
        if any(_overlap(paths[i], paths[j]) for i in range(len(paths)) for j in range(i + 1, len(paths))):
            try:
                out.append(_compose(master_cfg, config_loader, g))
            except Exception as e:
                out.append(e)
            continue
        cell = copy.deepcopy(base)
        for d in ds:
            _apply(cell, d)
        out.append(cell)
    return out


def check_writable(root: Path) -> str | None:
    """``None`` if run directories can be created under ``root``, else the reason."""
    p = root
    while not p.exists():
        if p.parent == p:
            return f"output_dir={root}: no existing ancestor directory"
        p = p.parent
    if not p.is_dir():
        return (f"output_dir={root}: {p} exists and is not a directory; choose another runs root "
                "with output_dir=PATH")
    if not os.access(p, os.W_OK | os.X_OK):
        return f"output_dir={root}: {p} is not writable; choose another runs root with output_dir=PATH"
    try:  # root ignores permission bits; read-only file systems do not
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        return f"output_dir={root}: cannot create files in {p} ({e.strerror}); choose another runs root"
    return None


def _exception_text(e: BaseException) -> str:
    text = str(e).strip()
    cause = e.__cause__
    if cause is not None and str(cause).strip() and str(cause).strip() not in text:
        text += f" ({str(cause).strip()})"
    return " ".join(line.strip() for line in text.splitlines() if line.strip() and
                    not line.strip().startswith(("Config search path", "provider=", "path=")))


def plan_sweep(master_cfg, config_loader, params: Mapping[str, str], arguments: Sequence[str], *,
               exact: bool = False) -> SweepPlan:
    """Expand and validate the whole sweep; raises :class:`SweepError` listing every problem.

    ``exact``: compose every grid point with Hydra in full (see :func:`compose_cells`).
    """
    from fp8rl.launch.backends import BACKENDS
    from fp8rl.launch.launchers import LAUNCHERS

    grid = expand_overrides(params, arguments, config_loader)
    seeds = master_cfg.get("seeds", 1)
    errors: list[str] = []
    if not isinstance(seeds, int) or seeds < 1:
        raise SweepError(f"seeds must be an integer >= 1 (the number of seeds per cell), got {seeds!r}")
    seed_keys = {ov.split("=", 1)[1] for g in grid for ov in g if ov.split("=", 1)[0] == "seed"}
    if seeds > 1 and len(seed_keys) > 1:
        raise SweepError(f"seeds={seeds} and a seed sweep ({sorted(seed_keys)}) were both given; "
                         "use seeds=N (seeds seed..seed+N-1) or seed=a,b,c, not both")
    total = len(grid) * seeds

    def total_of(_i: int) -> int:
        return total

    errors += _group_errors(grid, config_loader, total_of)
    if errors:
        _raise(errors, total)

    cells: list[CellPlan] = []
    launch_values: dict[str, set] = {}
    profiles: dict[str, ClusterProfile] = {}
    roots: set[Path] = set()
    first_launch: dict | None = None
    composed = compose_cells(master_cfg, config_loader, grid, exact=exact)
    for gi, (overrides, container) in enumerate(zip(grid, composed, strict=True)):
        first_index = gi * seeds + 1
        label = _label(first_index, total, overrides)
        if isinstance(container, Exception):  # Hydra/OmegaConf composition errors name the key
            errors.append(f"{label}: {_exception_text(container)}")
            continue
        launch = {k: container.pop(k, None) for k in LAUNCH_KEYS}
        first_launch = first_launch or launch
        for k, v in launch.items():
            launch_values.setdefault(k, set()).add(repr(v))

        cell_errors: list[str] = []
        backend = None
        if launch["backend"] not in BACKENDS:
            cell_errors.append(
                f"backend: {launch['backend']!r} is not registered; registered backends: "
                f"{', '.join(BACKENDS.names())}"
            )
        else:
            backend = BACKENDS[launch["backend"]]
            if launch["scale"] not in backend.scales:
                cell_errors.append(f"scale: {launch['scale']!r} is not served by backend "
                                   f"{backend.name!r}; valid values: {', '.join(backend.scales)}")
            if launch["data"] not in backend.data:
                cell_errors.append(f"data: {launch['data']!r} is not supported by backend "
                                   f"{backend.name!r}; valid values: {', '.join(backend.data)}")
        launcher = LAUNCHERS.get(launch["launcher"]) if launch["launcher"] in LAUNCHERS else None
        if launcher is None:
            cell_errors.append(f"launcher: unknown value {launch['launcher']!r}; valid values: "
                               f"{', '.join(LAUNCHERS.names())}")
        profile = None
        if launcher is not None and (launcher.needs_cluster or launch["cluster"]):
            if not launch["cluster"]:
                cell_errors.append(
                    f"cluster: launcher={launch['launcher']} (scale={launch['scale']}) needs a cluster "
                    "profile: add cluster=NAME (a file in slurm/profiles/, e.g. cluster=example, or "
                    "cluster=workstation for one GPU machine without Slurm) or cluster=/path/to/profile.yaml"
                )
            else:
                try:
                    profile = _profile(profiles, launch["cluster"], launch["gpus_per_node"])
                except ProfileError as e:
                    cell_errors.append(f"cluster: {e}")
            if profile is not None and not profile.local and not launcher.needs_cluster:
                profile = None  # a Slurm profile means nothing to a local launcher (as before)
        if launch["gpus_per_node"] is not None and profile is None and not cell_errors:
            cell_errors.append(f"gpus_per_node={launch['gpus_per_node']!r} replaces a cluster profile's GPUs, "
                               f"but launcher={launch['launcher']} uses no profile here; give cluster=NAME "
                               "(e.g. cluster=workstation) or drop gpus_per_node")
        workers = launch["workers"]
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            cell_errors.append(f"workers: {workers!r} is not a number of worker processes; give an "
                               "integer >= 1, or null for one per CPU core")
        cell_errors += launch_value_errors(launch)
        if profile is not None and profile.local:
            cell_errors += _local_profile_errors(profile, launch, backend)
        sweep_name = launch["sweep_name"]
        if not isinstance(sweep_name, str) or not _SWEEP_NAME_RE.match(sweep_name) or sweep_name in (".", ".."):
            cell_errors.append(f"sweep_name: {sweep_name!r} must be a plain directory name "
                               "(letters, digits, '_', '.', '-')")
        if cell_errors or backend is None:
            errors += [f"{label}: {m}" for m in cell_errors]
            continue

        root = Path(str(container.get("output_dir", "runs"))).expanduser().absolute()
        roots.add(root)
        sweep_dir = root / sweep_name
        cls = backend.load_config_class()
        names = {f.name for f in dataclasses.fields(cls)}
        sub = {k: v for k, v in container.items() if k in names}
        sub["output_dir"] = str(sweep_dir)
        if total > 1 and sub.get("run_dir"):
            errors.append(f"{label}: run_dir: set to {sub['run_dir']!r} but the sweep has {total} "
                          "cells; leave run_dir=null so each cell gets its own directory")
            continue
        if backend.shared_cache and _get_dotted(sub, backend.shared_cache[0]) is None:
            _set_dotted(sub, backend.shared_cache[0], str(root / backend.shared_cache[1]))
        base_seed = int(sub.get("seed", 0))
        resolve = backend.load_resolve_run_dir()
        for s in range(seeds):
            index = first_index + s
            seed_label = _label(index, total, [*overrides, f"seed={base_seed + s}"] if seeds > 1 else overrides)
            sub_s = {**sub, "seed": base_seed + s}
            try:
                run_cfg = build_dataclass(cls, sub_s)
            except Exception as e:  # __post_init__ ValueError, or OmegaConf's own errors
                errors.append(f"{seed_label}: {_exception_text(e)}")
                break  # other seeds of this grid point fail the same way
            resources = profile.resources_for(run_cfg.model.slot) if profile else None
            if resources is not None and backend.resources is not None:  # what this cell needs
                resources = backend.load_resources()(run_cfg, resources)
            check_cell = backend.load_check_cell()
            if check_cell is not None:
                try:
                    check_cell(run_cfg, resources)
                except ValueError as e:
                    errors.append(f"{seed_label}: {_exception_text(e)}")
                    break
            value_errors = cell_value_errors(run_cfg, launch["launcher"])
            if value_errors:
                errors += [f"{seed_label}: {m}" for m in value_errors]
                break
            run_dir = Path(resolve(run_cfg))
            from fp8rl.runs.identity import parse_run_name

            parts = parse_run_name(run_dir.name)
            cells.append(CellPlan(
                index=index, total=total,
                overrides=tuple([*overrides, f"seed={base_seed + s}"] if seeds > 1 else overrides),
                seed=base_seed + s, backend=backend.name, config=dataclasses.asdict(run_cfg),
                run_dir=run_dir, name=run_dir.name[: -len(parts["hash"]) - 1] if parts["hash"] else run_dir.name,
                hash=parts["hash"] or "", steps=int(getattr(run_cfg, "steps", 0)),
                axes={"algorithm": parts["algorithm"], "model": parts["model"], "fp8": parts["fp8"],
                      "clip": parts["clip"], "seed": base_seed + s, "scale": launch["scale"]},
                resources=resources,
                state=_state_of(run_dir),
            ))

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
        _raise(errors, total)
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


def _profile(cache: dict, name: str, gpus_per_node) -> ClusterProfile:
    """The validated profile ``name`` with the ``gpus_per_node`` override applied (cached)."""
    key = (name, gpus_per_node)
    if key not in cache:
        profile = load_profile(name)
        cache[key] = profile if gpus_per_node is None else profile.with_gpus_per_node(gpus_per_node)
    return cache[key]


def _local_profile_errors(profile: ClusterProfile, launch: dict, backend) -> list[str]:
    """What a ``scheduler: local`` profile refuses: parallel cells, a backend without GPU layout."""
    errors = []
    where = f"cluster={launch['cluster']} (scheduler: local, {profile.path})"
    if launch["launcher"] == "local_parallel":
        errors.append(f"launcher: {where} runs one cell at a time on this machine's GPUs; launcher=local_parallel "
                      "would start several cells on the same GPUs; drop launcher= (the local launcher is used)")
    if launch["workers"] not in (None, 1):
        errors.append(f"workers: {where} runs one cell at a time (each takes every GPU it names), got "
                      f"workers={launch['workers']}; drop workers or set workers=1")
    if backend is not None and backend.check_cell is None:
        errors.append(f"cluster: {where} lays out GPUs for backends that use them (scale=paper); backend "
                      f"{backend.name!r} (scale={launch['scale']}) runs on this machine without a profile: "
                      "drop cluster=")
    return errors


def _state_of(run_dir: Path) -> str | None:
    from fp8rl.runs import RunDir

    try:
        return RunDir(run_dir).state
    except (OSError, ValueError):
        return None


def _raise(errors: list[str], total: int) -> None:
    shown = errors[:MAX_REPORTED]
    more = f"\n  ... and {len(errors) - MAX_REPORTED} more" if len(errors) > MAX_REPORTED else ""
    raise SweepError(
        f"invalid sweep ({len(errors)} problem(s) in {total} cell(s)); nothing was run, submitted "
        "or written:\n  " + "\n  ".join(shown) + more
    )
