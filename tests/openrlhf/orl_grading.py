"""A grading "pool" that grades in the calling process (imported as ``orl_grading``).

``reward_func.score`` only calls ``pool.grade(answer, label)``; this stand-in runs the pool
workers' own function (``grading._grade``: math-verify via ``fp8rl.rewards.math_grader``) inline,
so tests of labels and reward schemes skip the process pool's start-up (the pool itself, its
deadline and its recovery are tested in ``test_orl_reward.py``).
"""

from __future__ import annotations

from fp8rl.backends.openrlhf.grading import _grade


class InlinePool:
    """``grade(answer, label) -> (correct, garbled, timed_out)`` without worker processes."""

    def grade(self, answer: str, label: str) -> tuple[bool, bool, bool]:
        correct, garbled = _grade(answer, label)
        return bool(correct), bool(garbled), False
