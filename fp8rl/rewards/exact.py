"""Exact-match grading for the mini backend's arithmetic task, with garbled-output detection.

A response is graded on its final answer line, ``A:<integer>`` (the last such line counts).
It is *garbled* when

1. it has no parseable final answer line, or
2. it shows degenerate repetition: some unit of 1..``max_period`` characters repeated
   back-to-back at least ``min_repeats`` times, covering at least ``min_span`` characters
   (e.g. ``"1+1+1+1+1+1+"`` or ``"\\n\\n\\n\\n..."``). A correct worked solution of the task never
   has such a run: its lines all differ and numbers have at most 4 digits.

Where we chose: the thresholds (``min_repeats=4``, ``min_span=12``, ``max_period=8``) are ours;
the paper only says outputs became garbled. A response can be both correct and garbled (an
answer line after a repeated run); ``rollout/garbled_frac`` counts it as garbled.
"""

from __future__ import annotations

import re

from fp8rl.rewards.base import GRADERS, Grade

_ANSWER = re.compile(r"^A:(-?\d+)\s*$", re.MULTILINE)


def extract_final_answer(text: str) -> str | None:
    """The integer text on the last ``A:<int>`` line of ``text``, or ``None``."""
    found = _ANSWER.findall(text)
    return found[-1] if found else None


def has_degenerate_repetition(
    text: str, *, min_repeats: int = 4, min_span: int = 12, max_period: int = 8
) -> bool:
    """True if a unit of <= ``max_period`` chars repeats >= ``min_repeats`` times in a row
    over >= ``min_span`` characters."""
    if min_repeats < 2 or max_period < 1 or min_span < 1:
        raise ValueError("need min_repeats >= 2, max_period >= 1, min_span >= 1")
    pattern = re.compile(r"(.{1,%d}?)\1{%d,}" % (max_period, min_repeats - 1), re.DOTALL)  # noqa: UP031
    return any(len(m.group(0)) >= min_span for m in pattern.finditer(text))


def is_garbled(text: str) -> bool:
    """No parseable final answer, or degenerate repetition."""
    return extract_final_answer(text) is None or has_degenerate_repetition(text)


@GRADERS.register("exact")
def grade_exact(response: str, target: str) -> Grade:
    """Correct iff the final ``A:`` integer equals ``int(target)``."""
    answer = extract_final_answer(response)
    correct = answer is not None and int(answer) == int(target)
    return Grade(correct=correct, garbled=is_garbled(response), answer=answer)
