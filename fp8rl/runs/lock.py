"""One owner per run directory: a lock held by the live process that writes the run.

Two launches of one sweep (two terminals, a relaunch while the first still runs, a requeued
Slurm task next to a duplicate submission) must not both run a cell: each would append every
step to the same ``metrics.jsonl``. A process that writes a run directory first takes
:func:`own` on it:

- **The lock** is an exclusive ``flock`` on ``<run-dir>/owner.json``, held for as long as the
  process writes the run. The kernel (or, on NFS, the lock manager) drops it when the process
  ends, however it ends (``kill -9`` included), so liveness needs no heartbeat: a lock that
  cannot be taken has a live owner; one that can be taken has none. ``flock`` works across the
  machines of a cluster on NFS (Linux emulates it with POSIX locks), GPFS and Lustre mounted
  with ``-o flock``; a file system without locks raises :class:`LockUnsupported`, naming the fix.
- **The owner's name** is written into the locked file after taking it: host, pid, process
  start time, Slurm job / array task / restart count, time. :func:`probe` reports it for a held
  lock (``RunOwned`` and ``experiments.status`` name the owner).
- **Taking over** a run whose previous owner died (its ``owner.json`` names an owner that never
  released) prints one line naming that owner; a clean exit marks the file ``released``.
- **A requeued Slurm task** may start on another node before the lock of its previous
  incarnation is dropped there (NFS lease expiry): a lock held by the *same* Slurm job id is
  waited for (``wait_same_job_s``) instead of being reported as a duplicate.
- **Re-entrant** within a process: ``fp8rl.launch.job.run_cell`` and a backend's run function
  may both take it (``flock`` locks belong to an open file, so a second ``open`` + ``flock`` in
  the same process would deadlock against the first; a per-process count avoids that).

The file is never deleted or replaced (a new inode would let two processes hold "the" lock),
and never followed when it is a symlink: :func:`own` refuses one (``RunDirSymlink`` naming it),
so a link planted in a run directory cannot make the lock write over its target. A damaged
``owner.json`` (truncated, emptied, garbage) names no owner; the next owner rewrites it.
:func:`exclusive` is the same mechanism as a plain blocking lock for shared caches (the mini
backend's SFT warm starts).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from fp8rl.runs.safe_io import open_nofollow, writing

OWNER_FILE = "owner.json"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
# path -> (fd, depth) of the locks this process holds (see "Re-entrant" above)
_HELD: dict[str, list[int]] = {}


class RunOwned(RuntimeError):
    """Another live process owns the run directory; ``owner`` says which (None: unknown)."""

    def __init__(self, run_dir: Path, owner: OwnerInfo | None) -> None:
        self.run_dir, self.owner = Path(run_dir), owner
        who = owner.describe() if owner else "another process (owner.json unreadable)"
        super().__init__(f"{self.run_dir.name} is running elsewhere: owned by {who}")


class LockUnsupported(RuntimeError):
    """The file system of the run directory does not support ``flock``."""


def _proc_start(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (Linux ``/proc``), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


@dataclass(frozen=True)
class OwnerInfo:
    """Who holds a run directory (what ``owner.json`` says)."""

    host: str
    pid: int
    pid_start: str | None
    slurm_job_id: str | None
    slurm_array: str | None
    slurm_restart: str | None
    since: str
    released: str | None = None

    @classmethod
    def current(cls) -> OwnerInfo:
        from fp8rl.runs.rundir import utc_now

        env = os.environ
        array = (f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
                 if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env else None)
        return cls(host=socket.gethostname(), pid=os.getpid(), pid_start=_proc_start(os.getpid()),
                   slurm_job_id=env.get("SLURM_JOB_ID"), slurm_array=array,
                   slurm_restart=env.get("SLURM_RESTART_COUNT"), since=utc_now())

    def describe(self) -> str:
        job = ""
        if self.slurm_job_id:
            job = f", Slurm job {self.slurm_array or self.slurm_job_id}"
            job += f" (restart {self.slurm_restart})" if self.slurm_restart else ""
        return f"host {self.host} pid {self.pid}{job}, since {self.since}"


def read_owner(run_dir: str | os.PathLike) -> OwnerInfo | None:
    """The owner named in ``owner.json`` (live or not), or None (no file, or unreadable)."""
    try:
        data = json.loads((Path(run_dir) / OWNER_FILE).read_text(encoding="utf-8"))
        return OwnerInfo(**data)
    except (OSError, ValueError, TypeError):
        return None


def _flock(fd: int, flags: int, path: Path) -> bool:
    """``flock``; False if it would block; raises :class:`LockUnsupported` on a lock-less FS."""
    try:
        fcntl.flock(fd, flags)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _UNSUPPORTED:
            raise LockUnsupported(
                f"cannot lock {path}: the file system does not support flock ({os.strerror(e.errno)}); "
                "put the runs root (output_dir) on a file system with locks (local disk, NFS, "
                "GPFS, or Lustre mounted with -o flock)") from e
        raise


def probe(run_dir: str | os.PathLike) -> tuple[bool, OwnerInfo | None]:
    """``(held, owner)``: whether a live process holds the run directory, and who is named.

    Takes and drops a shared lock; an owner trying to take the lock at that very moment
    retries (:func:`own`), so probing never makes a launch fail. Held by this process: True.
    """
    path = Path(run_dir) / OWNER_FILE
    if not path.exists():
        return False, None
    if str(path.resolve()) in _HELD:
        return True, read_owner(run_dir)
    fd = os.open(path, os.O_RDONLY)
    try:
        free = _flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, path)
        if free:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    return not free, read_owner(run_dir)


def _take(fd: int, path: Path, tries: int = 5, pause_s: float = 0.1) -> bool:
    for i in range(tries):  # a prober's shared lock lasts microseconds
        if _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, path):
            return True
        if i + 1 < tries:
            time.sleep(pause_s)
    return False


def _write(fd: int, path: Path, info: OwnerInfo) -> None:
    """Rewrite the locked file in place (it is never replaced: see the module docstring)."""
    data = (json.dumps(asdict(info), indent=1) + "\n").encode()
    with writing(path):
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)


@contextlib.contextmanager
def own(run_dir: str | os.PathLike, *, wait_same_job_s: float = 600.0,
        log: Callable[[str], None] | None = None) -> Iterator[OwnerInfo]:
    """Hold ``run_dir`` for the duration of the block (creates the directory).

    Raises :class:`RunOwned` when a live process of another job holds it. ``log`` (default:
    a line on stderr) is told when a dead owner's run is taken over.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / OWNER_FILE
    key = str(path.resolve())
    if key in _HELD:  # re-entrant
        _HELD[key][1] += 1
        try:
            yield read_owner(run_dir) or OwnerInfo.current()
        finally:
            _HELD[key][1] -= 1
        return
    me = OwnerInfo.current()
    fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)  # a symlink here is refused, never followed
    try:
        if not _take(fd, path):
            holder = read_owner(run_dir)
            same_job = holder is not None and me.slurm_job_id is not None and holder.slurm_job_id == me.slurm_job_id
            deadline = time.monotonic() + (wait_same_job_s if same_job else 0.0)
            while not _take(fd, path, tries=1):
                if time.monotonic() >= deadline:
                    raise RunOwned(run_dir, read_owner(run_dir))
                time.sleep(2.0)
        before = read_owner(run_dir)
        if before is not None and before.released is None and before != me:
            (log or _stderr)(f"{run_dir.name}: its previous owner ({before.describe()}) ended without "
                             f"releasing it; taking over")
        _write(fd, path, me)
        _HELD[key] = [fd, 1]
        try:
            yield me
        finally:
            del _HELD[key]
            from fp8rl.runs.rundir import utc_now

            with contextlib.suppress(OSError):
                _write(fd, path, OwnerInfo(**{**asdict(me), "released": utc_now()}))
    finally:
        os.close(fd)  # drops the lock


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def exclusive(path: str | os.PathLike) -> Iterator[None]:
    """A blocking exclusive ``flock`` on ``path`` (created if missing) for the block."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)
    try:
        _flock(fd, fcntl.LOCK_EX, path)
        yield
    finally:
        os.close(fd)
