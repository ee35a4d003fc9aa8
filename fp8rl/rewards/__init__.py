"""Answer extraction and grading.

Every grader maps ``(response, target) -> Grade`` and is registered in ``GRADERS``:

- ``exact`` (``fp8rl.rewards.exact``): the toy task of the mini backend; the integer on the
  final ``A:`` line must equal the target. Also flags *garbled* responses (no parseable final
  answer, or degenerate repetition), the paper's visible symptom of the FP8 entropy surge.
- ``math_verify`` (``fp8rl.rewards.math_grader``): real math answers (``\\boxed{}``, LaTeX,
  plain expressions) via the ``math-verify`` package, thread-safe (its ``signal.alarm``
  timeouts are switched off; see that module).

The reward of a graded response is ``1.0`` if correct else ``0.0`` (``Grade.reward``).
"""

from __future__ import annotations

from fp8rl.rewards import exact, math_grader  # registers the graders
from fp8rl.rewards.base import GRADERS, Grade, Grader

__all__ = ["GRADERS", "Grade", "Grader", "exact", "math_grader"]
