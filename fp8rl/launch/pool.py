"""A pool of worker processes for the local launcher: every core busy, cells unchanged.

``WorkerPool(n).run(tasks)`` starts ``n`` processes (``spawn``: a fresh interpreter, no forked
torch state), feeds them ``tasks`` in order from one queue and yields each task's outcome as it
ends. A worker runs task after task, so torch, transformers and a backend's per-process caches
are imported and built once per worker, not once per cell. Tasks are ``(key, "module:function",
args)``: the function is imported by path in the worker, so nothing but plain data is pickled.

Each worker process

- starts with ``OMP_NUM_THREADS=1`` (one intra-op thread per worker; a run's own thread
  setting, ``mini.num_threads``, still applies inside it, so a cell computes what it computes
  when run alone with the same setting);
- dies with its parent (Linux ``PR_SET_PDEATHSIG``): a launcher killed with ``kill -9`` does
  not leave workers training behind it; their runs stay resumable (``fp8rl.runs.lock`` shows
  them as owned by nobody).

On ``KeyboardInterrupt`` in the parent every worker gets ``SIGINT`` (a run then records
PREEMPTED and stops at its next step), the pool waits for them, and the interrupt propagates.
A worker that dies mid-task (out of memory, killed) fails that task with its exit code; the
others go on.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

_SENTINEL = None


@dataclass
class Outcome:
    """How one task ended: ``ok`` with its ``value``, or not with an ``error`` text."""

    key: Any
    ok: bool
    value: Any = None
    error: str | None = None


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _worker(tasks, results) -> None:  # pragma: no cover - runs in the child process
    _die_with_parent()
    from fp8rl.launch.backends import load_object

    while True:
        item = tasks.get()
        if item is _SENTINEL:
            return
        key, path, args = item
        results.put(("start", key, os.getpid()))
        try:
            value = load_object(path)(*args)
        except KeyboardInterrupt:
            results.put(("error", key, "interrupted"))
            return
        except BaseException as e:
            results.put(("error", key, f"{type(e).__name__}: {e}"))
        else:
            results.put(("ok", key, value))


class WorkerPool:
    """``n`` spawned worker processes (see the module docstring)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {n}")
        self.n = n

    def run(self, tasks: Sequence[tuple[Any, str, tuple]]) -> Iterator[Outcome]:
        """Run ``tasks`` (``(key, "module:function", args)``); yield an :class:`Outcome` per task."""
        ctx = mp.get_context("spawn")
        task_q, result_q = ctx.Queue(), ctx.Queue()
        for t in tasks:
            task_q.put(t)
        n = min(self.n, len(tasks)) or 1
        for _ in range(n):
            task_q.put(_SENTINEL)
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned workers only
        try:
            procs = [ctx.Process(target=_worker, args=(task_q, result_q), daemon=True) for _ in range(n)]
            for p in procs:
                p.start()
        finally:
            if old is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = old
        running: dict[int, Any] = {}  # pid -> key of its current task
        remaining = len(tasks)
        try:
            while remaining:
                try:
                    kind, key, value = result_q.get(timeout=0.5)
                except queue.Empty:
                    for p in procs:  # a worker that died mid-task fails its task
                        if not p.is_alive() and p.pid in running:
                            remaining -= 1
                            yield Outcome(running.pop(p.pid), False,
                                          error=f"worker process died (exit code {p.exitcode})")
                    if remaining and not any(p.is_alive() for p in procs):
                        raise RuntimeError(f"every worker process died with {remaining} task(s) left") from None
                    continue
                if kind == "start":
                    running[value] = key
                    continue
                for pid, k in list(running.items()):
                    if k == key:
                        del running[pid]
                remaining -= 1
                yield Outcome(key, kind == "ok", value if kind == "ok" else None,
                              None if kind == "ok" else value)
        except BaseException:
            for p in procs:  # a run records PREEMPTED on SIGINT and stops at its next step
                if p.is_alive() and p.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGINT)
            raise
        finally:
            deadline = time.monotonic() + 60
            for p in procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.terminate()
                    p.join(5)
            task_q.close()
            result_q.close()
