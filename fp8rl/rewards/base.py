"""The grade type and the grader registry (filled by ``exact`` and ``math_grader``)."""

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
