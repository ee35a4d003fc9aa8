"""Checks of a sweep's cells that are not the backend config's own: launch fields, profiles, paths.

``fp8rl.launch.grid.plan_sweep`` runs them for every cell before anything runs or is written;
each returns messages (naming the field, the bad value and the valid values) that the plan
collects and reports together (:func:`raise_errors`).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp8rl.launch.checks import launch_value_errors
from fp8rl.launch.errors import SweepError
from fp8rl.launch.profiles import ClusterProfile, ProfileError, load_profile

_SWEEP_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
MAX_REPORTED = 25


def cell_label(index: int, total: int, overrides: Sequence[str]) -> str:
    shown = " ".join(overrides) if overrides else "(defaults)"
    return f"cell {index}/{total} [{shown}]"


def group_errors(grid: list[list[str]], config_loader, total_of) -> list[str]:
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
                    f"{cell_label(i + 1, total_of(i), overrides)}: {key}: unknown value {value!r}; "
                    f"valid values: {', '.join(sorted(options))}"
                )
    return errors


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


def exception_text(e: BaseException) -> str:
    text = str(e).strip()
    cause = e.__cause__
    if cause is not None and str(cause).strip() and str(cause).strip() not in text:
        text += f" ({str(cause).strip()})"
    return " ".join(line.strip() for line in text.splitlines() if line.strip() and
                    not line.strip().startswith(("Config search path", "provider=", "path=")))


def launch_field_errors(launch: dict, profiles: dict) -> tuple[list[str], Any, ClusterProfile | None]:
    """Problems of one cell's launch fields, its backend (``None`` if not registered) and profile.

    ``profiles`` caches loaded profiles by (name, ``gpus_per_node``) across cells.
    """
    from fp8rl.launch.backends import BACKENDS
    from fp8rl.launch.launchers import LAUNCHERS

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
    return cell_errors, backend, profile


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


def raise_errors(errors: list[str], total: int) -> None:
    shown = errors[:MAX_REPORTED]
    more = f"\n  ... and {len(errors) - MAX_REPORTED} more" if len(errors) > MAX_REPORTED else ""
    raise SweepError(
        f"invalid sweep ({len(errors)} problem(s) in {total} cell(s)); nothing was run, submitted "
        "or written:\n  " + "\n  ".join(shown) + more
    )
