"""Tokenizer, task generation and splits of the mini backend."""

from __future__ import annotations

import random

import pytest

from fp8rl.backends.mini.task import make_splits, render, sample_problem
from fp8rl.backends.mini.tokenizer import CharTokenizer
from fp8rl.rewards.exact import grade_exact


def test_tokenizer_round_trip_and_specials():
    tok = CharTokenizer()
    text = "Q:12+7-5\n12+7=19\nA:14\n"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == len(text) + 2
    assert tok.decode(ids) == text
    assert tok.decode([*tok.encode("A:1"), tok.eos_id, *tok.encode("99")]) == "A:1"
    assert tok.decode([tok.pad_id, *tok.encode("7"), tok.pad_id]) == "7"
    assert len({*tok.encode(tok.alphabet)}) == len(tok.alphabet) == tok.vocab_size - 3
    with pytest.raises(ValueError, match="not in the tokenizer alphabet"):
        tok.encode("x")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="duplicate"):
        CharTokenizer("aa")


def test_render_against_python_eval():
    rng = random.Random(0)
    for _ in range(200):
        p = sample_problem(rng, 2, 5, 99)
        expr = p.prompt[2:-1]
        assert p.answer == eval(expr)  # left-to-right + and - equals Python's evaluation
        lines = p.solution.splitlines()
        assert len(lines) == expr.count("+") + expr.count("-") + 1 - expr.startswith("-")
        for line in lines[:-1]:
            lhs, rhs = line.split("=")
            assert eval(lhs) == int(rhs)
        assert grade_exact(p.solution, str(p.answer)).correct
        assert not grade_exact(p.solution, str(p.answer)).garbled
    with pytest.raises(ValueError):
        render([1, 2], ["*"])
    with pytest.raises(ValueError):
        render([1, 2], [])


def test_splits_are_deterministic_and_disjoint():
    kw = dict(min_terms=3, max_terms=4, max_operand=20)
    tr1, ev1 = make_splits(7, 500, 50, **kw)
    tr2, ev2 = make_splits(7, 500, 50, **kw)
    assert tr1 == tr2 and ev1 == ev2
    assert len({p.prompt for p in ev1}) == 50
    assert not {p.prompt for p in tr1} & {p.prompt for p in ev1}
    assert make_splits(8, 500, 50, **kw)[1] != ev1
    for bad in (dict(min_terms=1, max_terms=2, max_operand=5), dict(min_terms=3, max_terms=2, max_operand=5),
                dict(min_terms=2, max_terms=2, max_operand=0)):
        with pytest.raises(ValueError):
            make_splits(0, 10, 10, **bad)
    # only 8 problems exist with 2 terms in [0, 1]
    with pytest.raises(ValueError, match="distinct eval"):
        make_splits(0, 10, 9, min_terms=2, max_terms=2, max_operand=1)
    with pytest.raises(ValueError, match="distinct from the eval"):
        make_splits(0, 10, 8, min_terms=2, max_terms=2, max_operand=1)
