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

from collections.abc import Callable
from dataclasses import dataclass

from fp8rl.registry import Registry


@dataclass(frozen=True)
class Grade:
    """The grade of one response.

    Attributes:
        correct: the extracted answer equals the target.
        garbled: no parseable final answer, or degenerate repetition.
        answer: the extracted answer text, ``None`` when none was found.
    """

    correct: bool
    garbled: bool
    answer: str | None

    @property
    def reward(self) -> float:
        return 1.0 if self.correct else 0.0


Grader = Callable[[str, str], Grade]
GRADERS: Registry[Grader] = Registry("grader")

from fp8rl.rewards import exact, math_grader  # noqa: E402  (registers the graders)

__all__ = ["GRADERS", "Grade", "Grader", "exact", "math_grader"]
