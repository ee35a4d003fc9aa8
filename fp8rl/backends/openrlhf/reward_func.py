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

Returns ``{"rewards": r, "scores": s, "extra_logs": {...}}`` (floats for one query, lists for
several). ``scores`` are always 0/1 (correct or not); ``rewards`` follow the cell's reward scheme
(``openrlhf.reward_scheme``, :data:`REWARDS`): ``binary`` 1/0, ``signed`` +1/-1 (DAPO's recipe:
correct +1, anything else -1, so that DAPO's overlong penalty of up to ``factor`` is measured
against a range of 2). This file gives the binary rewards; ``reward_func_signed.py`` beside it,
which the command builder names for signed cells, calls :func:`reward_func` with
``scheme="signed"``. A second file rather than an environment variable because OpenRLHF loads the
file in Ray actors on every node, whose environment the command does not control.

How OpenRLHF 0.11.2 uses the two: ``rewards`` (plus DAPO's overlong penalty, which OpenRLHF adds
itself, ``--reward.overlong_buffer_len``, after this function) make the advantages and
``rollout/reward_mean``; ``scores`` decide dynamic filtering (a group is kept when the mean of
its scores lies strictly inside ``--algo.dynamic_filtering_range 0 1``, i.e. some but not all
samples are correct, whatever the scheme). Evaluation (``eval_<ds>_pass1`` / ``pass<k>``) averages
the *rewards*: under ``signed`` it reads ``2 x accuracy - 1``, which
``fp8rl.backends.openrlhf.ingest`` maps back to accuracy. ``extra_logs`` carry ``rollout/acc``,
``rollout/garbled_frac`` and ``reward/timeout_frac``, which OpenRLHF logs per step.

The grading machinery lives in ``fp8rl.backends.openrlhf.grading`` (importable by name, which the
spawned pool workers need; this file is loaded by path under another module name).
"""

from __future__ import annotations

import atexit
import threading

from fp8rl.backends.openrlhf.grading import GradingPool, last_boxed, response_of

__all__ = ["REWARDS", "reward_func", "score"]

#: ``(reward if correct, reward otherwise)`` per reward scheme (``openrlhf.reward_scheme``).
REWARDS: dict[str, tuple[float, float]] = {"binary": (1.0, 0.0), "signed": (1.0, -1.0)}

_POOL: GradingPool | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> GradingPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = GradingPool()
            atexit.register(_POOL.close)
        return _POOL


def _rewards(scheme: str) -> tuple[float, float]:
    if scheme not in REWARDS:
        raise ValueError(f"reward scheme {scheme!r} is not one of {sorted(REWARDS)} "
                         "(openrlhf.reward_scheme: binary = 1/0, signed = +1/-1)")
    return REWARDS[scheme]


def score(query: str, prompt: str, label: str, pool: GradingPool | None = None, scheme: str = "binary") -> dict:
    """Grade one sample: ``{"reward", "score", "correct", "garbled", "timeout", "answer"}``."""
    right, wrong = _rewards(scheme)
    answer = last_boxed(response_of(query, prompt))
    if answer is None:
        return {"reward": wrong, "score": 0.0, "correct": False, "garbled": True, "timeout": False, "answer": None}
    correct, garbled, timed_out = (pool or _pool()).grade(answer, str(label))
    return {"reward": right if correct else wrong, "score": 1.0 if correct else 0.0, "correct": correct,
            "garbled": garbled, "timeout": timed_out, "answer": answer}


def reward_func(queries, prompts, labels, pool: GradingPool | None = None, scheme: str = "binary"):
    """OpenRLHF's entry point: rewards (by ``scheme``), 0/1 scores, and per-sample extra logs."""
    _rewards(scheme)  # a bad scheme raises before any grading
    results = [score(q, p, lab, pool, scheme) for q, p, lab in zip(queries, prompts, labels, strict=True)]
    rewards = [r["reward"] for r in results]
    scores = [r["score"] for r in results]
    n = max(1, len(results))
    extra = {
        "rollout/acc": sum(r["correct"] for r in results) / n,
        "rollout/garbled_frac": sum(r["garbled"] for r in results) / n,
        "reward/timeout_frac": sum(r["timeout"] for r in results) / n,
    }
    _log_samples(queries, prompts, labels, results)
    if len(results) == 1:
        return {"rewards": rewards[0], "scores": scores[0], "extra_logs": extra}
    return {"rewards": rewards, "scores": scores, "extra_logs": extra}


#: Environment variable naming a JSONL file that receives every graded sample (the CPU smoke
#: job's diagnostic dumps set it: ``<run>/openrlhf/dumps/samples.jsonl``; unset in production).
SAMPLE_LOG_ENV = "FP8RL_SAMPLE_LOG"
#: The driver's pid, set beside it: each logged sample names the attempt that graded it (an
#: attempt killed mid-rollout grades its aborted requests, which carry no tokens, as it dies).
DRIVER_PID_ENV = "FP8RL_DRIVER_PID"


def _log_samples(queries, prompts, labels, results) -> None:
    import json
    import os
    import time

    path = os.environ.get(SAMPLE_LOG_ENV)
    if not path:
        return
    with _POOL_LOCK, open(path, "a", encoding="utf-8") as f:
        for q, p, lab, r in zip(queries, prompts, labels, results, strict=True):
            f.write(json.dumps({"time": time.time(), "prompt": p, "response": response_of(q, p), "label": lab,
                                "reward": r["reward"], "score": r["score"],
                                "driver_pid": os.environ.get(DRIVER_PID_ENV),
                                # the raw text past the prompt (before any </think> cut) and
                                # whether the query started with the prompt at all
                                "tail": q[len(p):] if q.startswith(p) else None}) + "\n")
