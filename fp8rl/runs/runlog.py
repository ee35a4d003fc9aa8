"""``<run-dir>/run.log``: what a cell printed, kept with its run, across every attempt.

:func:`capture` sends everything the process writes to standard output and standard error while
a cell runs (Python's ``print``, warnings and tracebacks, and what C code, torch or a child
process writes to file descriptors 1 and 2) to the end of the run's ``run.log``. Each attempt
starts with one header line (``=== attempt N, <UTC time>, host H pid P ===``), so a run resumed
three times holds its four attempts in order. An exception that ends the cell is written into the
log (its traceback) before it propagates, so the log holds the cell's error. When the log cannot
be written (the disk is full) what would go into it goes to the standard error instead, and the
cell's own error, not the log's, is the one that propagates.

The log is an append stream, not an atomic file: it is opened with ``O_APPEND | O_NOFOLLOW``
(``fp8rl.runs.safe_io.open_nofollow``), so a symlink in its place is refused
(:class:`~fp8rl.runs.safe_io.RunDirSymlink`) and its target left untouched, and anything but a
regular file there (a directory, a FIFO) is refused too. Only the run's owner
(``fp8rl.runs.lock.own``) captures into it.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import stat
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

from fp8rl.runs.safe_io import open_nofollow, writing

#: The log file in a run directory.
RUN_LOG = "run.log"
#: Start of the header line of each attempt.
HEADER = "=== attempt"


class _LogStream(io.TextIOWrapper):
    """``sys.stdout`` / ``sys.stderr`` while a cell runs: ``run.log``; a write the log refuses
    (the disk is full, the stream already closed by the time a thread writes) goes to the
    console instead (``console``, the standard error before the capture), or nowhere, but never
    raises: a traceback written on the way out must not replace the error it reports."""

    console: io.FileIO | None = None

    def write(self, s: str) -> int:
        try:
            return super().write(s)
        except (OSError, ValueError):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                self.console.write(s.encode("utf-8", "replace"))
            return len(s)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            super().flush()


def log_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / RUN_LOG


def _open(path: Path) -> int:
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file; move it away and relaunch")
    return fd


def attempts(run_dir: str | os.PathLike) -> int:
    """How many attempts ``run.log`` records (0 when there is none)."""
    path = log_path(run_dir)
    if not path.is_file() or path.is_symlink():
        return 0
    with open(path, "rb") as f:
        return sum(line.startswith(HEADER.encode()) for line in f)


@contextlib.contextmanager
def capture(run_dir: str | os.PathLike, *, note: str = "") -> Iterator[Path]:
    """Append what this process prints during the block to ``<run_dir>/run.log`` (module
    docstring); yields the log's path. File descriptors 1 and 2, ``sys.stdout`` and
    ``sys.stderr`` are restored afterwards, whatever happened."""
    from fp8rl.runs.rundir import utc_now

    path = log_path(run_dir)
    n = attempts(run_dir) + 1
    fd = _open(path)
    saved: list[tuple[int, int]] = []
    old_out, old_err = sys.stdout, sys.stderr
    try:
        header = f"{HEADER} {n}, {utc_now()}, host {socket.gethostname()} pid {os.getpid()}"
        with writing(path):
            os.write(fd, ((header + (f", {note}" if note else "") + " ===\n").encode()))
        for stream in (old_out, old_err):
            with contextlib.suppress(Exception):
                stream.flush()
        for target in (1, 2):
            saved.append((target, os.dup(target)))
            os.dup2(fd, target)
        # Python-level writes go to the log too (also when sys.stdout is not fd 1, e.g. a test's capture)
        out = _LogStream(io.FileIO(os.dup(fd), "w"), encoding="utf-8", errors="replace",
                         line_buffering=True, write_through=True)
        out.console = io.FileIO(os.dup(saved[1][1]), "w")  # the standard error before the capture
        sys.stdout = sys.stderr = out
        try:
            yield path
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                out.write(f"interrupted: {type(e).__name__}{f': {e}' if str(e) else ''}\n")
            else:
                traceback.print_exc(file=out)
            raise
        finally:
            with contextlib.suppress(Exception):
                out.flush()
            sys.stdout, sys.stderr = old_out, old_err
            with contextlib.suppress(Exception):
                out.close()
            with contextlib.suppress(Exception):
                out.console.close()
    finally:
        sys.stdout, sys.stderr = old_out, old_err
        for target, copy in reversed(saved):
            os.dup2(copy, target)
            os.close(copy)
        os.close(fd)


__all__ = ["HEADER", "RUN_LOG", "attempts", "capture", "log_path"]
