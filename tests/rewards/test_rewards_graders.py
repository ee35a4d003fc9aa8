"""Graders: exact match + garbled detection for the toy task; math-verify off the main thread."""

from __future__ import annotations

import threading

import pytest

from fp8rl.registry import RegistryError
from fp8rl.rewards import GRADERS, Grade
from fp8rl.rewards.exact import (
    extract_final_answer,
    grade_exact,
    has_degenerate_repetition,
    is_garbled,
)


def test_registry_names():
    assert GRADERS.names() == ["exact", "math_verify"]
    with pytest.raises(RegistryError, match="valid names are: exact, math_verify"):
        GRADERS["nope"]


@pytest.mark.parametrize(
    ("text", "answer"),
    [("12+7=19\n19-5=14\nA:14\n", "14"), ("A:-3\n", "-3"), ("A:1\nA:2\n", "2"), ("A: 5\n", None),
     ("A:5x\n", None), ("no answer", None), ("", None), ("x A:5\n", None)],
)
def test_extract_final_answer(text, answer):
    assert extract_final_answer(text) == answer


def test_degenerate_repetition():
    assert has_degenerate_repetition("1+1+1+1+1+1+1+")  # "1+" x7 = 14 chars
    assert has_degenerate_repetition("\n" * 12)
    assert not has_degenerate_repetition("\n" * 11)  # span below 12
    assert not has_degenerate_repetition("12+7=19\n19-5=14\n14+3=17\nA:17\n")
    assert not has_degenerate_repetition("111")
    with pytest.raises(ValueError):
        has_degenerate_repetition("x", min_repeats=1)


def test_grade_exact():
    ok = grade_exact("3+4=7\nA:7\n", "7")
    assert ok == Grade(correct=True, garbled=False, answer="7") and ok.reward == 1.0
    wrong = grade_exact("3+4=8\nA:8\n", "7")
    assert not wrong.correct and not wrong.garbled and wrong.reward == 0.0
    assert grade_exact("3+4=", "7") == Grade(correct=False, garbled=True, answer=None)
    rep = grade_exact("7777777777777\nA:7\n", "7")
    assert rep.correct and rep.garbled
    assert grade_exact("A:007\n", "7").correct  # integers compare by value
    assert is_garbled("") and not is_garbled("A:1\n")


def test_math_verify_equivalences_in_a_thread():
    # math-verify's default timeouts use signal.alarm, which raises off the main thread;
    # our grader disables them, so it must work in a worker thread
    out = {}

    def work():
        out["half"] = GRADERS["math_verify"]("so the answer is $\\boxed{0.5}$", "\\frac{1}{2}")
        out["sqrt"] = GRADERS["math_verify"]("\\boxed{2\\sqrt{3}}", "\\sqrt{12}")
        out["wrong"] = GRADERS["math_verify"]("\\boxed{3}", "4")
        out["none"] = GRADERS["math_verify"]("I do not know", "4")

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert out["half"].correct and out["sqrt"].correct
    assert not out["wrong"].correct and not out["wrong"].garbled
    assert not out["none"].correct and out["none"].garbled
