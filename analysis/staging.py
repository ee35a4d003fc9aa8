"""Write a report so that a kill never leaves a half-written file in it.

``python -m analysis.report`` builds the whole report in a staging directory beside its output
(``.<out name>.partial-<pid>``), then moves each finished file into the output with
``os.replace`` (atomic per file), ``report.md`` last, and removes the staging directory. A report
killed while it builds leaves its output as it was (absent, or the previous report, every file
whole) and a staging directory, which the next report removes. A kill during the moves (a few
milliseconds) leaves some files of the new report beside the rest of the previous one, each file
whole; the next report replaces them all.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

#: Written last: it links the figures and tables, so it appears only when they are in place.
LAST = "report.md"


def staging_dir(out: Path) -> Path:
    """The staging directory of this process's report into ``out``."""
    return out.parent / f".{out.name}.partial-{os.getpid()}"


def remove_stale(out: Path) -> list[Path]:
    """Remove staging directories that killed reports into ``out`` left behind; returns them."""
    stale = sorted(out.parent.glob(f".{out.name}.partial-*")) if out.parent.exists() else []
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)
    return stale


def write_staged(out: Path, build: Callable[[Path], Path]) -> Path:
    """Run ``build(staging) -> path of its main file``, then move every file into ``out``.

    Returns the main file's path inside ``out``. ``build`` must write only inside the directory
    it is given. Nothing of ``out`` is removed: files a previous report wrote and this one did
    not (a figure without data this time) stay."""
    remove_stale(out)
    staging = staging_dir(out)
    staging.mkdir(parents=True)
    try:
        main = build(staging)
        files = sorted((f for f in staging.rglob("*") if f.is_file()),
                       key=lambda f: (f.relative_to(staging).as_posix() == LAST, f.as_posix()))
        for f in files:
            dest = out / f.relative_to(staging)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(f, dest)
        return out / Path(main).relative_to(staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
