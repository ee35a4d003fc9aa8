"""Tokenizer, task generation and splits of the mini backend."""

from __future__ import annotations

import random

import pytest

from fp8rl.backends.mini.task import (
    make_splits,
    parse_prompt,
    render,
    sample_problem,
    slipped_solution,
)
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


def test_parse_prompt_inverts_render_and_refuses_what_is_not_a_prompt():
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(2, 9)
        terms = [rng.randint(0, 120) for _ in range(n)]
        ops = [rng.choice("+-") for _ in range(n - 1)]
        assert parse_prompt(render(terms, ops).prompt) == (terms, ops)
    for bad in ("12+7\n", "Q:12+7", "Q:12*7\n", "Q:12+\n", "Q:\n", "Q:1 2\n"):
        with pytest.raises(ValueError, match="not a task prompt"):
            parse_prompt(bad)


def _slow_slip(terms, ops, slipped):
    """The slip by hand: ``slipped`` = indices of the lines that carry it."""
    acc, lines = terms[0], []
    for i, (o, t) in enumerate(zip(ops, terms[1:], strict=True)):
        new = acc + t if o == "+" else acc - t
        if i in slipped:
            assert o == "-" and t >= 10
            new = new + 10
        lines.append(f"{acc}{o}{t}={new}")
        acc = new
    return "\n".join(lines) + f"\nA:{acc}\n"


def test_slipped_solution_slips_exactly_the_eligible_lines_at_its_rate():
    rng = random.Random(2)
    problems = [sample_problem(rng, 7, 9, 20) for _ in range(400)]
    eligible = slipped = 0
    for p in problems:
        terms, ops = parse_prompt(p.prompt)
        elig = [i for i, (o, t) in enumerate(zip(ops, terms[1:], strict=True)) if o == "-" and t >= 10]
        # rate 0: the reference, and no draw from the stream
        draws = random.Random(5)
        assert slipped_solution(p, draws, 0.0) == p.solution
        assert draws.random() == random.Random(5).random()
        # rate 1: every eligible line, and only those
        assert slipped_solution(p, random.Random(0), 1.0) == _slow_slip(terms, ops, set(elig))
        # rate 0.6: a subset of the eligible lines, one draw per eligible line, in order
        got = slipped_solution(p, random.Random(eligible), 0.6)
        u = random.Random(eligible)
        chosen = {i for i in elig if u.random() < 0.6}
        assert got == _slow_slip(terms, ops, chosen)
        eligible += len(elig)
        slipped += len(chosen)
        if chosen:  # a slipped demonstration is graded wrong: its answer is off
            assert not grade_exact(got, str(p.answer)).correct
    assert eligible > 500
    assert 0.5 < slipped / eligible < 0.7
    for bad in (-0.01, 1.01):
        with pytest.raises(ValueError, match="slip rate"):
            slipped_solution(problems[0], random.Random(0), bad)
