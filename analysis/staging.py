"""Write a report so that a kill never leaves a half-written file in it.

``python -m analysis.report`` builds the whole report in a staging directory beside its output
(``.<out name>.partial-<pid>``), then moves each finished file into the output with
``os.replace`` (atomic per file), ``report.md`` last, and removes the staging directory. A report
killed while it builds leaves its output as it was (absent, or the previous report, every file
whole) and a staging directory, which the next report removes. A kill during the moves (a few
milliseconds) leaves some files of the new report beside the rest of the previous one, each file
whole; the next report replaces them all.

Two reports into one ``--out`` at once: each holds an exclusive ``flock`` on its own lock file
(``.<out name>.partial-<pid>.lock``, beside its staging directory) while it builds, and removes
only staging directories whose lock nobody holds (their report was killed: the kernel released
its lock). Each report then moves in whole files; the one that finishes last is what ``--out``
holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

#: Written last: it links the figures and tables, so it appears only when they are in place.
LAST = "report.md"


def staging_dir(out: Path) -> Path:
    """The staging directory of this process's report into ``out``."""
    return out.parent / f".{out.name}.partial-{os.getpid()}"


def _lock_path(staging: Path) -> Path:
    return staging.with_name(staging.name + ".lock")


def _held(lock: Path) -> bool:
    """Whether a live report holds ``lock`` (False when absent: a staging left by a kill)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the lock if we got it
    return False


def remove_stale(out: Path) -> list[Path]:
    """Remove staging directories that killed reports into ``out`` left behind (never one a
    running report holds); returns them."""
    stale = sorted(out.parent.glob(f".{out.name}.partial-*[0-9]")) if out.parent.exists() else []
    stale = [d for d in stale if not _held(_lock_path(d))]
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)
    locks = sorted(out.parent.glob(f".{out.name}.partial-*.lock")) if out.parent.exists() else []
    for lock in locks:  # of reports killed before their staging existed, or of those removed above
        if not lock.with_suffix("").exists() and not _held(lock):
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
    return stale


def _take(lock: Path) -> int:
    """An fd holding the exclusive lock on ``lock`` (re-created if a clean-up unlinked it while
    it was being taken)."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def write_staged(out: Path, build: Callable[[Path], Path]) -> Path:
    """Run ``build(staging) -> path of its main file``, then move every file into ``out``.

    Returns the main file's path inside ``out``. ``build`` must write only inside the directory
    it is given. Nothing of ``out`` is removed: files a previous report wrote and this one did
    not (a figure without data this time) stay."""
    staging = staging_dir(out)
    staging.parent.mkdir(parents=True, exist_ok=True)
    lock = _lock_path(staging)
    fd = _take(lock)  # ours until this report ends (or is killed)
    try:
        remove_stale(out)
        staging.mkdir()
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
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        os.close(fd)
