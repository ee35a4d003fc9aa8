"""Math answer grading with ``math-verify`` (for the paper-scale datasets).

``grade_math(response, target)`` parses the gold answer and the response with
``math_verify.parse`` and compares them with ``math_verify.verify`` (so ``1/2`` equals ``0.5``
and ``\\sqrt{12}`` equals ``2\\sqrt{3}``).

Thread safety: math-verify's default timeouts use ``signal.alarm``, which raises
``ValueError: signal only works in main thread`` anywhere but the main thread (Ray workers,
thread pools). We therefore pass ``parsing_timeout=None`` to ``parse`` and
``timeout_seconds=None`` to ``verify``; a caller that needs a deadline must bring its own (a
process pool with a timeout). ``raise_on_error=False`` keeps a malformed answer a wrong answer.

E-notation (**ours**, for Minerva-Math, whose published answers read ``4.5e33``, ``1.04e-3``):
math-verify parses ``4.5e33`` as ``4.5 * e * 33`` (Euler's number), so ``4.5 \\times 10^{33}`` would
not match it. Both the gold answer and the response are rewritten first: a number ``<m>e<k>``
standing alone (not inside a word or after a backslash) becomes ``<m>\\times10^{<k>}``. This reads
a literal ``2e5`` meaning 2 * e * 5 as 2 x 10^5; no answer of the paper's sets means the former.

Garbled: no extractable answer in the response, or degenerate repetition (the detector of
``fp8rl.rewards.exact``, applied to the last 2,000 characters to keep it cheap).
"""

from __future__ import annotations

import re

from fp8rl.rewards.base import GRADERS, Grade
from fp8rl.rewards.exact import has_degenerate_repetition


@GRADERS.register("math_verify")
def grade_math(response: str, target: str) -> Grade:
    """Correct iff math-verify judges the response's answer equal to ``target``."""
    from math_verify import parse, verify  # lazy: sympy import is slow

    gold = parse(sci_notation(_boxed(target)), parsing_timeout=None, raise_on_error=False)
    pred = parse(sci_notation(response), parsing_timeout=None, raise_on_error=False)
    correct = bool(gold) and bool(pred) and bool(
        verify(gold, pred, timeout_seconds=None, raise_on_error=False)
    )
    answer = str(pred[-1]) if pred else None
    garbled = not pred or has_degenerate_repetition(response[-2000:])
    return Grade(correct=correct, garbled=garbled, answer=answer)


def _boxed(target: str) -> str:
    """Wrap a bare gold answer in ``\\boxed{}`` so the LaTeX extractor finds it."""
    t = target.strip()
    return t if "\\boxed" in t or t.startswith("$") else f"\\boxed{{{t}}}"


_SCI = re.compile(r"(?<![\w.\\])(\d+(?:\.\d+)?)[eE]([-+]?\d+)(?![\w.])")


def sci_notation(text: str) -> str:
    """``4.5e33`` -> ``4.5\\times10^{33}``, ``1e-3`` -> ``1\\times10^{-3}`` (numbers standing alone)."""
    return _SCI.sub(lambda m: f"{m.group(1)}\\times10^{{{m.group(2).lstrip('+')}}}", text)
