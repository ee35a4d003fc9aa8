"""Writing run-directory files safely: atomic, never through a symlink, clear when the disk fails.

Every file a run writes goes through one of three ways, each kept here:

- **Atomic replace** (:func:`atomic_write_bytes`, used for ``config.yaml``, ``status.json``,
  ``summary.json``, ``provenance.json``, ``manifest.json`` and checkpoints): a temporary file
  in the same directory, written, flushed and fsynced, then ``os.replace``-d over the final
  name and the directory fsynced. A reader sees the old file or the new one, never half of
  one; a failed write removes its temporary and leaves the old file as it was. The file gets
  the mode a plain ``open`` would give it (``0666`` less the umask, e.g. ``0644``), not
  ``mkstemp``'s ``0600``: a lab shares run directories.
- **Append** (:func:`append_bytes`, ``metrics.jsonl`` / ``eval.jsonl``): one ``os.write`` of
  whole lines on a file opened with ``O_APPEND``, fsynced; when it fails the file is truncated
  back to its size before the write, so no torn last line is left behind.
- **In-place update of a locked file** (``owner.json``, ``fp8rl.runs.lock``): opened with
  ``O_NOFOLLOW`` (:func:`open_nofollow`).

**Symlinks**: the final path is never followed. A symlink where a run file should be (someone
linked ``owner.json`` to a file elsewhere, or copied a run directory with its links) is refused
with :class:`RunDirSymlink` naming it, and the link's target is left untouched.

**Disk full, read-only, no permission** (``ENOSPC``, ``EDQUOT``, ``EROFS``, ``EACCES``,
``EPERM``): raised as :class:`RunDirWriteError`, one line naming the path and what to do. Both
are ``OSError`` subclasses (``errno`` kept), so code that tolerates an ``OSError`` still does.
The run stays resumable: the checkpoint and the logged rows are whole, so relaunching resumes
from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "RunDirSymlink",
    "RunDirWriteError",
    "append_bytes",
    "atomic_write_bytes",
    "atomic_write_with",
    "current_umask",
    "open_nofollow",
    "refuse_symlink",
    "writing",
]

#: errno -> (what happened, what to do)
_FIXES = {
    errno.ENOSPC: ("no space left on device", "free space and relaunch"),
    errno.EDQUOT: ("disk quota exceeded", "free space (or raise the quota) and relaunch"),
    errno.EROFS: ("read-only file system", "make the run directory writable (or set output_dir "
                  "to a writable disk) and relaunch"),
    errno.EACCES: ("permission denied", "make the run directory writable by this user and relaunch"),
    errno.EPERM: ("operation not permitted", "make the run directory writable by this user and relaunch"),
}


class RunDirWriteError(OSError):
    """A run-directory file could not be written (disk full, read-only, no permission)."""

    def __init__(self, path: str | os.PathLike, err: int) -> None:
        what, fix = _FIXES[err]
        super().__init__(f"{what} writing {path}: {fix}; the run resumes from its last checkpoint")
        self.errno, self.path = err, Path(path)
        self.cause = f"{what} writing {path}: {fix}"  # without the run's part (a sweep's own files)


class RunDirSymlink(OSError):
    """A symlink stands where a run-directory file should be."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(
            f"{path} is a symlink, not a file of this run: refusing to read or write through it (its target "
            "is left untouched); remove the link (copy the file in its place if it is the run's) "
            "and relaunch")
        self.errno, self.path = errno.ELOOP, Path(path)


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Turn a disk-full / read-only / permission ``OSError`` in the block into
    :class:`RunDirWriteError` naming ``path`` (other errors pass unchanged)."""
    try:
        yield
    except (RunDirWriteError, RunDirSymlink):
        raise
    except OSError as e:
        if e.errno in _FIXES:
            raise RunDirWriteError(path, e.errno) from e
        raise


def refuse_symlink(path: str | os.PathLike) -> None:
    """Raise :class:`RunDirSymlink` if ``path`` is a symlink (a missing path is fine)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise RunDirSymlink(path)


def open_nofollow(path: str | os.PathLike, flags: int, mode: int = 0o666) -> int:
    """``os.open`` that refuses a symlink at ``path`` with :class:`RunDirSymlink`; a new file gets
    ``mode`` less the umask (the user's mode for a plain file)."""
    with writing(path):
        try:
            return os.open(path, flags | os.O_NOFOLLOW, mode)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RunDirSymlink(path) from e
            raise


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system can fsync a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_with(path: str | os.PathLike, write: Callable[[BinaryIO], object], *,
                      prefix: str | None = None, suffix: str = ".tmp") -> None:
    """Atomically replace ``path`` with what ``write(f)`` writes to a binary file object.

    The temporary is ``<prefix>XXXX<suffix>`` in the same directory (default prefix
    ``.<name>.``); it is fsynced before the rename and removed when anything fails.
    """
    path = Path(path)
    with writing(path):
        refuse_symlink(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=prefix or f".{path.name}.", suffix=suffix, dir=path.parent)
        try:
            os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp's 0600 would hide it from the lab
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            refuse_symlink(path)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(path.parent)


def current_umask() -> int:
    """This process's umask, read without changing it (Linux: ``/proc/self/status``; elsewhere
    set and restored at once)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status", encoding="ascii") as f:
            return int(next(ln for ln in f if ln.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Atomically replace ``path`` with ``data`` (see :func:`atomic_write_with`)."""
    atomic_write_with(path, lambda f: f.write(data))


def append_bytes(fd: int, path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> None:
    """Append ``data`` to the ``O_APPEND`` file ``fd`` (``path`` names it in errors) and fsync
    (unless ``fsync=False``: fabricated data that need not survive a machine crash).

    All or nothing: when a write or the fsync fails, the file is truncated back to the size it
    had, so a reader never meets a torn line.
    """
    with writing(path):
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
