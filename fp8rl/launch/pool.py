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

Stopping (``run(tasks, stopping=...)``, ``fp8rl.launch.interrupt``): the workers ignore SIGINT
(they start with it ignored, so a terminal's Ctrl-C, which reaches the whole process group, does
not interrupt them mid-step); once ``stopping()`` is true every worker gets
``fp8rl.runs.stop.STOP_SIGNAL``: its cell stops at its next safe point (the mini trainer
checkpoints and records PREEMPTED), the outcome is ``stopped``, and the worker takes no further
task. ``run`` returns when every worker has ended; tasks never started yield nothing. On
``KeyboardInterrupt`` in the parent (a second Ctrl-C) the workers are killed at once (their runs
resume from their last checkpoint) and the interrupt propagates. A worker that dies mid-task
(out of memory, killed) fails that task with its signal or exit code; the others go on. When
every worker has died, each task not yet run fails as ``not started`` and ``run`` returns, so the
launcher can say what happened and how to resume instead of ending in a traceback.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fp8rl.runs.stop import STOP_SIGNAL

_SENTINEL = None


@dataclass
class Outcome:
    """How one task ended: ``ok`` with its ``value``, or not with an ``error`` text; ``stopped``:
    it stopped on a stop request (or an interrupt) and is resumable, not failed."""

    key: Any
    ok: bool
    value: Any = None
    error: str | None = None
    stopped: bool = False


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _worker(tasks, results) -> None:  # pragma: no cover - runs in the child process
    _die_with_parent()
    from fp8rl.runs.stop import install_stop_signal, stop_requested

    install_stop_signal()
    from fp8rl.launch.backends import load_object

    while True:
        item = tasks.get()
        if item is _SENTINEL:
            return
        key, path, args = item
        if stop_requested():  # stopping: start nothing more
            return
        results.put(("start", key, os.getpid()))
        try:
            value = load_object(path)(*args)
        except KeyboardInterrupt as e:  # a stop request (RunStopped) or an interrupt
            results.put(("stopped", key, str(e) or "interrupted"))
            return
        except BaseException as e:
            results.put(("error", key, f"{type(e).__name__}: {e}"))
        else:
            results.put(("ok", key, value))


def died(exitcode: int | None) -> str:
    """How a worker process ended, for a task's error: killed by a signal (SIGKILL: the
    out-of-memory killer's) or its exit code."""
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            name = signal.Signals(-exitcode).name
            oom = " (what the out-of-memory killer sends)" if name == "SIGKILL" else ""
            return f"was killed by {name}{oom}"
    return f"died (exit code {exitcode})"


def _forget(keys: list, key: Any) -> None:
    with contextlib.suppress(ValueError):
        keys.remove(key)


def _signal_all(procs, sig: int) -> None:
    for p in procs:
        if p.is_alive() and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)


class WorkerPool:
    """``n`` spawned worker processes (see the module docstring)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {n}")
        self.n = n

    def run(self, tasks: Sequence[tuple[Any, str, tuple]],
            stopping: Callable[[], bool] | None = None) -> Iterator[Outcome]:
        """Run ``tasks`` (``(key, "module:function", args)``); yield an :class:`Outcome` per task
        that ran (module docstring for ``stopping``)."""
        ctx = mp.get_context("spawn")
        task_q, result_q = ctx.Queue(), ctx.Queue()
        for t in tasks:
            task_q.put(t)
        n = min(self.n, len(tasks)) or 1
        for _ in range(n):
            task_q.put(_SENTINEL)
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned workers only
        # the workers start with SIGINT ignored (Python then installs no KeyboardInterrupt handler),
        # so a Ctrl-C while they import cannot print a traceback from them
        main = threading.current_thread() is threading.main_thread()
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            procs = [ctx.Process(target=_worker, args=(task_q, result_q), daemon=True) for _ in range(n)]
            for p in procs:
                p.start()
        finally:
            if main:
                signal.signal(signal.SIGINT, old_int)
            if old is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = old
        running: dict[int, Any] = {}  # pid -> key of its current task
        unfinished = [key for key, _, _ in tasks]  # in order: what is left when every worker dies
        remaining = len(tasks)
        asked = False
        try:
            while remaining:
                if not asked and stopping is not None and stopping():
                    asked = True
                    _signal_all(procs, STOP_SIGNAL)
                try:
                    kind, key, value = result_q.get(timeout=0.2 if asked else 0.5)
                except queue.Empty:
                    for p in procs:  # a worker that died mid-task fails its task
                        if not p.is_alive() and p.pid in running:
                            remaining -= 1
                            key = running.pop(p.pid)
                            _forget(unfinished, key)
                            yield Outcome(key, False, error=f"its worker process {died(p.exitcode)}")
                    if remaining and not any(p.is_alive() for p in procs):
                        if asked:  # stopped: the tasks left were never started
                            return
                        for key in unfinished:  # nobody is left to run them: each fails, none is lost
                            yield Outcome(key, False, error="not started: every worker process died before "
                                                            "it could run it")
                        return
                    continue
                if kind == "start":
                    running[value] = key
                    continue
                for pid, k in list(running.items()):
                    if k == key:
                        del running[pid]
                _forget(unfinished, key)
                remaining -= 1
                ok = kind == "ok"
                yield Outcome(key, ok, value if ok else None, None if ok else value, stopped=kind == "stopped")
        except BaseException:
            _signal_all(procs, signal.SIGKILL)  # a second Ctrl-C: at once (runs resume from their checkpoint)
            raise
        finally:
            deadline = time.monotonic() + 60
            for p in procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.terminate()
                    p.join(5)
            task_q.cancel_join_thread()  # tasks left after a stop: nobody will read them
            task_q.close()
            result_q.close()
