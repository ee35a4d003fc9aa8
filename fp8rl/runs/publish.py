"""Publish a sweep: copy its run directories without the heavy, machine-specific parts.

``publish_sweep(src, dest)`` copies ``manifest.json`` and, for every run directory of the
sweep, what analysis reads and what a reader wants to inspect (``config.yaml``,
``overrides.txt``, ``provenance.json``, ``status.json``, ``metrics.jsonl``, ``eval.jsonl``,
``summary.json``, ``samples/``). It leaves out ``checkpoint/`` (model and optimizer state, ~1 MB
a run at mini scale, nothing analysis needs) and hidden entries (``.cache`` and the like).
A copy is what ``docs/results/`` commits, and ``python -m analysis.report`` on the copy writes
the same tables as on the original (tested).

Machine paths: the launcher resolves ``output_dir`` and the SFT cache directory to absolute
paths, and ``provenance.json`` records ``argv``. In the text files copied, every occurrence of
the absolute path of ``root`` (default: the current directory, i.e. the repository the sweep
was run from) followed by ``/`` is replaced by ``./``, so a published ``config.yaml`` says
``output_dir: ./runs/main_table``. Nothing else is changed, and the original is only read.

Bad input raises before anything is written: ``src`` must be a sweep directory (holding
``manifest.json``), ``dest`` must not exist or be empty (``replace=True`` deletes an earlier
copy first, but only one that holds a ``manifest.json``, so a wrong ``dest`` cannot wipe
unrelated files).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from fp8rl.runs.manifest import MANIFEST_FILE
from fp8rl.runs.rundir import (
    CONFIG_FILE,
    EVAL_FILE,
    METRICS_FILE,
    OVERRIDES_FILE,
    PROVENANCE_FILE,
    STATUS_FILE,
    SUMMARY_FILE,
)

#: What a published run directory keeps (files, then directories).
KEEP_FILES: tuple[str, ...] = (CONFIG_FILE, OVERRIDES_FILE, PROVENANCE_FILE, STATUS_FILE, METRICS_FILE,
                               EVAL_FILE, SUMMARY_FILE)
KEEP_DIRS: tuple[str, ...] = ("samples",)
#: Files whose text is rewritten to drop the root's absolute path.
TEXT_FILES: tuple[str, ...] = (CONFIG_FILE, OVERRIDES_FILE, PROVENANCE_FILE, MANIFEST_FILE)


@dataclass(frozen=True)
class PublishResult:
    dest: Path
    runs: int
    files: int
    bytes: int
    rewritten: int  # files in which the root's path was replaced


def _check(src: Path, dest: Path, replace: bool) -> None:
    if not (src / MANIFEST_FILE).is_file():
        raise ValueError(f"{src} is not a sweep directory (no {MANIFEST_FILE}); pass the directory "
                         "a sweep wrote, e.g. runs/main_table")
    if dest.resolve() == src.resolve() or src.resolve() in dest.resolve().parents:
        raise ValueError(f"destination {dest} is inside the sweep {src}; publish to another directory")
    if dest.exists():
        if not dest.is_dir():
            raise ValueError(f"destination {dest} exists and is not a directory")
        if any(dest.iterdir()):
            if not replace:
                raise FileExistsError(f"destination {dest} is not empty; pass replace=True (--replace) "
                                      "to overwrite an earlier published copy")
            if not (dest / MANIFEST_FILE).is_file():
                raise FileExistsError(f"destination {dest} is not empty and is not a published sweep "
                                      f"(no {MANIFEST_FILE}); refusing to delete it")


def _copy_text(src: Path, dest: Path, prefix: str) -> bool:
    text = src.read_text(encoding="utf-8")
    new = text.replace(prefix, "./")
    dest.write_text(new, encoding="utf-8")
    return new != text


def publish_sweep(src: str | os.PathLike, dest: str | os.PathLike, *,
                  root: str | os.PathLike | None = None, replace: bool = False) -> PublishResult:
    """Copy the sweep ``src`` to ``dest`` as described in the module docstring."""
    src, dest = Path(src), Path(dest)
    _check(src, dest, replace)
    root_abs = Path(root if root is not None else os.getcwd()).resolve()
    prefix = str(root_abs).rstrip("/") + "/"
    if dest.exists() and any(dest.iterdir()):
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)
    n_runs = n_files = n_bytes = n_rewritten = 0

    def copy(a: Path, b: Path) -> None:
        nonlocal n_files, n_bytes, n_rewritten
        if a.name in TEXT_FILES:
            n_rewritten += _copy_text(a, b, prefix)
        else:
            shutil.copyfile(a, b)
        n_files += 1
        n_bytes += b.stat().st_size

    copy(src / MANIFEST_FILE, dest / MANIFEST_FILE)
    for run in sorted(p for p in src.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if not any((run / f).exists() for f in (CONFIG_FILE, STATUS_FILE, METRICS_FILE)):
            continue  # not a run directory (a report folder, say)
        out = dest / run.name
        out.mkdir()
        n_runs += 1
        for f in KEEP_FILES:
            if (run / f).is_file():
                copy(run / f, out / f)
        for d in KEEP_DIRS:
            if (run / d).is_dir():
                (out / d).mkdir()
                for f in sorted((run / d).iterdir()):
                    if f.is_file() and not f.name.startswith("."):
                        copy(f, out / d / f.name)
    return PublishResult(dest, n_runs, n_files, n_bytes, n_rewritten)
