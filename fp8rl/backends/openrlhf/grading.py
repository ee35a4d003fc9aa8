"""Grading math answers off the main thread with a deadline (used by ``reward_func.py``).

``GradingPool``: a process pool (spawn) whose calls have a deadline; a worker that misses it is
killed and the pool replaced, because a hung sympy call cannot be interrupted otherwise and
math-verify's own timeout (``signal.alarm``) only works in the main thread. ``last_boxed`` and
``response_of`` extract the answer. Lives in the package (not in the file OpenRLHF loads by
path) so that the pool's worker processes can import the grading function by name.
"""

from __future__ import annotations

import multiprocessing as mp
import re
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

#: Seconds one grading may take before it scores 0.
DEFAULT_TIMEOUT_S = 10.0
#: Worker processes of the grading pool.
DEFAULT_WORKERS = 4
#: Environment variables that override the defaults (the CPU job sets them: on a loaded 2-core
#: machine a fresh pool's first grading, which starts its processes, can take longer than 10 s).
TIMEOUT_ENV, WORKERS_ENV = "FP8RL_GRADING_TIMEOUT_S", "FP8RL_GRADING_WORKERS"


def default_timeout_s() -> float:
    import os

    return float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)


def default_workers() -> int:
    import os

    return int(os.environ.get(WORKERS_ENV) or DEFAULT_WORKERS)

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{}``) with balanced braces, else None."""
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
            i += 1
    return None


def response_of(query: str, prompt: str) -> str:
    """The generated part of ``query`` (after ``prompt``), cut after the last ``</think>``."""
    resp = query[len(prompt):] if prompt and query.startswith(prompt) else query
    if "</think>" in resp:
        resp = resp.rsplit("</think>", 1)[1]
    return resp


def _grade(answer: str, label: str) -> tuple[bool, bool]:
    """Runs in a pool process: ``(correct, garbled)``."""
    from fp8rl.rewards.math_grader import grade_math

    g = grade_math(f"\\boxed{{{answer}}}", label)
    return g.correct, g.garbled


class GradingPool:
    """A process pool whose calls have a deadline; a hung worker is killed and replaced.

    Thread-safe: many threads may call :meth:`grade` concurrently; a timeout in one thread
    replaces the pool for everyone (calls in flight in the old pool fail and are retried once
    in the new one).
    """

    def __init__(self, workers: int | None = None, timeout_s: float | None = None,
                 grade_fn=_grade) -> None:
        workers = default_workers() if workers is None else workers
        timeout_s = default_timeout_s() if timeout_s is None else timeout_s
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"GradingPool needs workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.workers, self.timeout_s, self.grade_fn = workers, timeout_s, grade_fn
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self.timeouts = 0

    def _get(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"))
            return self._pool

    def _replace(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is not pool:
                return
            self._pool = None
        for p in list((pool._processes or {}).values()):  # a hung sympy call ignores everything else
            p.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def grade(self, answer: str, label: str) -> tuple[bool, bool, bool]:
        """``(correct, garbled, timed_out)``; never raises for bad input."""
        for _attempt in range(2):
            pool = self._get()
            try:
                fut = pool.submit(self.grade_fn, answer, label)
                correct, garbled = fut.result(timeout=self.timeout_s)
                return bool(correct), bool(garbled), False
            except FutureTimeout:
                self.timeouts += 1
                self._replace(pool)
                return False, False, True
            except Exception:  # BrokenProcessPool from a concurrent replace: retry once
                self._replace(pool)
        return False, False, True

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            for p in list((pool._processes or {}).values()):
                p.kill()
            pool.shutdown(wait=False, cancel_futures=True)
