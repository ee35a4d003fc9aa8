"""A sweep directory's ``manifest.json``: the list of grid cells a sweep asked for.

::

    runs/<sweep>/
      manifest.json
      grpo-8b-bf16-vanilla-s0-1a2b3c4d/      one run directory per cell (fp8rl.runs.rundir)
      ...

The launcher writes the manifest *before* the runs start, so analysis can report every cell
that is missing (never started), FAILED, or incomplete rather than silently plotting the ones
that happen to exist. Layout::

    {
      "sweep": "fig_entropy_grpo_8b",
      "created": "2026-11-30T12:00:00Z",
      "updated": "2026-11-30T12:05:00Z",
      "cells": [
        {"name": "grpo-8b-bf16-vanilla-s0", "hash": "1a2b3c4d",
         "run_dir": "grpo-8b-bf16-vanilla-s0-1a2b3c4d",
         "axes": {"algorithm": "grpo", "model": "8b", "fp8": "bf16", "clip": "vanilla",
                  "seed": 0, "scale": "mini"},
         "overrides": ["algorithm=grpo", "fp8=bf16"], "job_id": null}
      ]
    }

Choices: ``run_dir`` is relative to the sweep directory (a sweep directory can be copied or
moved); it may not be absolute nor contain ``..``. ``axes`` must hold the six grid axes
(:data:`AXES`) and may hold more (a future axis such as ``lr``). ``job_id`` is a string
(Slurm ids such as ``1234_7`` are not ints). Re-writing a manifest keeps its ``created`` time
and stamps ``updated``; cell names (run dirs) must be unique.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath

from fp8rl.runs.rundir import atomic_write_json, utc_now

MANIFEST_FILE = "manifest.json"
#: The grid axes every cell names.
AXES: tuple[str, ...] = ("algorithm", "model", "fp8", "clip", "seed", "scale")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One grid cell of a sweep: which run directory it should produce and how."""

    name: str
    hash: str
    run_dir: str
    axes: Mapping[str, object]
    overrides: tuple[str, ...] = ()
    job_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"cell name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.hash, str) or not self.hash:
            raise ValueError(f"cell {self.name}: hash must be a non-empty string")
        rd = PurePosixPath(str(self.run_dir))
        if not str(self.run_dir) or rd.is_absolute() or ".." in rd.parts:
            raise ValueError(
                f"cell {self.name}: run_dir {self.run_dir!r} must be a path relative to the sweep "
                "directory without '..' (e.g. the run directory's basename)"
            )
        missing = [a for a in AXES if a not in self.axes]
        if missing:
            raise ValueError(f"cell {self.name}: axes lack {missing}; every cell names {AXES}")
        object.__setattr__(self, "axes", dict(self.axes))
        if isinstance(self.overrides, str):
            raise TypeError(f"cell {self.name}: overrides must be a list of strings, not a string")
        object.__setattr__(self, "overrides", tuple(str(o) for o in self.overrides))
        if self.job_id is not None:
            object.__setattr__(self, "job_id", str(self.job_id))

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "hash": self.hash,
            "run_dir": str(self.run_dir),
            "axes": dict(self.axes),
            "overrides": list(self.overrides),
            "job_id": self.job_id,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Cell:
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"manifest cell has unknown keys {sorted(unknown)}: {dict(d)}")
        return cls(
            name=d["name"],
            hash=d["hash"],
            run_dir=d["run_dir"],
            axes=d["axes"],
            overrides=tuple(d.get("overrides") or ()),
            job_id=d.get("job_id"),
        )


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A parsed ``manifest.json``; ``path`` is the sweep directory it was read from."""

    sweep: str
    created: str
    cells: tuple[Cell, ...]
    path: Path
    updated: str | None = None

    def run_path(self, cell: Cell) -> Path:
        """Absolute path of a cell's run directory."""
        return self.path / cell.run_dir


def write_manifest(sweep_dir: str | os.PathLike, sweep: str, cells: Iterable[Cell | Mapping]) -> Path:
    """Atomically write ``<sweep_dir>/manifest.json``; returns its path.

    ``cells`` are :class:`Cell` objects or dicts with the same keys. An existing manifest's
    ``created`` time is kept.
    """
    if not isinstance(sweep, str) or not sweep:
        raise ValueError(f"sweep name must be a non-empty string, got {sweep!r}")
    cells = [c if isinstance(c, Cell) else Cell.from_dict(c) for c in cells]
    seen: set[str] = set()
    for c in cells:
        key = str(PurePosixPath(c.run_dir))
        if key in seen:
            raise ValueError(f"two manifest cells share the run directory {key!r}")
        seen.add(key)
    sweep_dir = Path(sweep_dir)
    path = sweep_dir / MANIFEST_FILE
    now = utc_now()
    created = now
    if path.exists():
        try:
            created = json.loads(path.read_text(encoding="utf-8")).get("created", now)
        except ValueError:
            created = now
    atomic_write_json(
        path,
        {"sweep": sweep, "created": created, "updated": now, "cells": [c.to_dict() for c in cells]},
    )
    return path


class ManifestDamaged(ValueError):
    """``manifest.json`` is not a manifest (the message names it and the fix, on one line)."""


def _damaged(path: Path, detail: object) -> ManifestDamaged:
    detail = " ".join(str(detail).split())
    return ManifestDamaged(f"{path} is damaged (not a manifest: {detail}); delete it and relaunch the sweep, "
                           "which writes it again (the run directories are kept and resumed)")


def read_manifest(sweep_dir: str | os.PathLike) -> Manifest:
    """Read ``<sweep_dir>/manifest.json``; FileNotFoundError names the missing file,
    :class:`ManifestDamaged` a damaged one (one line: the file and the fix)."""
    sweep_dir = Path(sweep_dir)
    path = sweep_dir / MANIFEST_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: the launcher writes it when it creates the sweep; "
            "without it missing cells cannot be reported"
        )
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except ValueError as e:  # not UTF-8 or not JSON
        raise _damaged(path, e) from e
    if not isinstance(d, dict):
        raise _damaged(path, f"it holds a JSON {type(d).__name__}, not an object")
    for key in ("sweep", "cells"):
        if key not in d:
            raise _damaged(path, f"it lacks the {key!r} field")
    try:
        cells = tuple(Cell.from_dict(c) for c in d["cells"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _damaged(path, f"a cell is not a manifest cell: {type(e).__name__}: {e}") from e
    return Manifest(
        sweep=d["sweep"],
        created=d.get("created", ""),
        cells=cells,
        path=sweep_dir,
        updated=d.get("updated"),
    )
