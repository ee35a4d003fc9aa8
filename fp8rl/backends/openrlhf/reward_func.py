"""Math reward for OpenRLHF's ``--reward.remote_url path/to/reward_func.py``.

OpenRLHF 0.11.2 loads this *file* (``importlib`` by path, inside the vLLM Ray actors) and calls
``reward_func(queries, prompts, labels)`` once per sample from a worker thread
(``asyncio.to_thread``). For each query we

1. take the response (the query minus its prompt; the whole query if the prompt is not a prefix),
   cut at the last ``</think>`` if present;
2. extract the **last** ``\\boxed{...}`` (balanced braces); no box = reward 0;
3. grade it against the label with ``fp8rl.rewards.math_grader.grade_math`` (math-verify) in a
   **process pool with a deadline** (:class:`GradingPool`): math-verify's own timeout uses
   ``signal.alarm``, which does not work off the main thread, and sympy can hang for minutes on
   inputs like ``9^{9^{9^{9}}}``. A grading that misses the deadline scores 0, and the pool's
   worker processes are killed and replaced (a hung sympy call cannot be interrupted otherwise).

Returns ``{"rewards": r, "scores": r, "extra_logs": {...}}`` with 0/1 rewards (a float for one
query, lists for several); ``extra_logs`` carry ``rollout/acc``, ``rollout/garbled_frac`` and
``reward/timeout_frac``, which OpenRLHF logs per step. DAPO's overlong penalty is applied by
OpenRLHF itself (``--reward.overlong_buffer_len``), after this function.

The grading machinery lives in ``fp8rl.backends.openrlhf.grading`` (importable by name, which the
spawned pool workers need; this file is loaded by path under another module name).
"""

from __future__ import annotations

import atexit
import threading

from fp8rl.backends.openrlhf.grading import GradingPool, last_boxed, response_of

__all__ = ["reward_func", "score"]

_POOL: GradingPool | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> GradingPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = GradingPool()
            atexit.register(_POOL.close)
        return _POOL


def score(query: str, prompt: str, label: str, pool: GradingPool | None = None) -> dict:
    """Grade one sample: ``{"reward", "correct", "garbled", "timeout", "answer"}``."""
    answer = last_boxed(response_of(query, prompt))
    if answer is None:
        return {"reward": 0.0, "correct": False, "garbled": True, "timeout": False, "answer": None}
    correct, garbled, timed_out = (pool or _pool()).grade(answer, str(label))
    return {"reward": 1.0 if correct else 0.0, "correct": correct, "garbled": garbled,
            "timeout": timed_out, "answer": answer}


def reward_func(queries, prompts, labels, pool: GradingPool | None = None):
    """OpenRLHF's entry point: rewards and scores (0/1) plus per-sample extra logs."""
    results = [score(q, p, lab, pool) for q, p, lab in zip(queries, prompts, labels, strict=True)]
    rewards = [r["reward"] for r in results]
    n = max(1, len(results))
    extra = {
        "rollout/acc": sum(r["correct"] for r in results) / n,
        "rollout/garbled_frac": sum(r["garbled"] for r in results) / n,
        "reward/timeout_frac": sum(r["timeout"] for r in results) / n,
    }
    value = rewards[0] if len(rewards) == 1 else rewards
    return {"rewards": value, "scores": value, "extra_logs": extra}
