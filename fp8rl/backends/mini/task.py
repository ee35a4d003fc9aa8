"""The synthetic, verifiable task of the mini backend: multi-step integer arithmetic.

A problem is a chain of ``n_terms`` integers joined by ``+``/``-`` (``n_terms`` drawn from
``[min_terms, max_terms]``, operands from ``[0, max_operand]``). The prompt and the reference
response (a worked solution, evaluated left to right, one line per step, and a final answer
line) look like::

    prompt:    "Q:12+7-5\\n"
    response:  "12+7=19\\n19-5=14\\nA:14\\n"

so a 4-term problem has a response of about 30 characters = 30 tokens. The answer is graded by
exact match of the integer on the ``A:`` line (``fp8rl.rewards.exact``). Harder settings (more
terms, larger operands) push a warm-started model's accuracy down; the defaults are chosen so
that the SFT warm start lands between 0% and 100% (see ``docs/mini.md``).

The slip (``slipped_solution``; the long regime's warm start, ``mini.sft_slip_rate``): a worked
solution in which some ``-`` lines with a two-digit subtrahend forget its tens once
(``31-12=29`` instead of ``19``). A warm start trained on demonstrations that slip on more than
half of those lines makes the slip its greedy choice while still sampling the right line at
times: the base model's pass@k is well above its greedy accuracy, and unlearning the slip
(a context-dependent rule, not a sharper output distribution) is what RL has to do in the body.
This is our design for a regime where the body learns, not the paper's: the paper's base models
bring their own errors from pretraining.

Splits: ``make_splits(seed, ...)`` draws the train pool and the held-out eval set from one
``random.Random(seed)`` and removes from the train pool every problem whose prompt appears in
the eval set, so the eval set is held out exactly.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One problem: ``prompt`` (ends with a newline), reference ``solution``, integer ``answer``."""

    prompt: str
    solution: str
    answer: int


def render(terms: list[int], ops: list[str]) -> Problem:
    """Build the prompt, the worked solution and the answer of ``terms[0] ops[0] terms[1] ...``."""
    if len(ops) != len(terms) - 1:
        raise ValueError(f"need len(ops) == len(terms) - 1, got {len(ops)} and {len(terms)}")
    expr = str(terms[0]) + "".join(f"{o}{t}" for o, t in zip(ops, terms[1:], strict=True))
    solution, answer = _worked(terms, ops)
    return Problem(prompt=f"Q:{expr}\n", solution=solution, answer=answer)


def _worked(terms: list[int], ops: list[str], slip=None) -> tuple[str, int]:
    """``(worked solution, its answer)``, left to right, one line per step; ``slip(o, t)`` (if
    given) says whether that line adds 10 to its result (``slipped_solution``)."""
    acc, lines = terms[0], []
    for o, t in zip(ops, terms[1:], strict=True):
        if o == "+":
            new = acc + t
        elif o == "-":
            new = acc - t
        else:
            raise ValueError(f"unknown operator {o!r}; the task uses '+' and '-'")
        if slip is not None and slip(o, t):
            new += 10
        lines.append(f"{acc}{o}{t}={new}")
        acc = new
    return "\n".join([*lines, f"A:{acc}"]) + "\n", acc


def sample_problem(rng: random.Random, min_terms: int, max_terms: int, max_operand: int) -> Problem:
    """Draw one problem from ``rng``."""
    n = rng.randint(min_terms, max_terms)
    terms = [rng.randint(0, max_operand) for _ in range(n)]
    ops = [rng.choice("+-") for _ in range(n - 1)]
    return render(terms, ops)


def parse_prompt(prompt: str) -> tuple[list[int], list[str]]:
    """``(terms, ops)`` of a prompt ``"Q:12+7-5\\n"`` (the inverse of :func:`render`)."""
    if not (prompt.startswith("Q:") and prompt.endswith("\n")):
        raise ValueError(f"not a task prompt (want 'Q:<expr>\\n'): {prompt!r}")
    expr, terms, ops, cur = prompt[2:-1], [], [], ""
    for ch in expr:
        if ch in "+-" and cur:
            terms.append(int(cur))
            ops.append(ch)
            cur = ""
        elif ch.isdigit():
            cur += ch
        else:
            raise ValueError(f"not a task prompt (unexpected {ch!r}): {prompt!r}")
    if not cur:
        raise ValueError(f"not a task prompt (ends in an operator): {prompt!r}")
    return [*terms, int(cur)], ops


def slipped_solution(problem: Problem, rng: random.Random, rate: float) -> str:
    """A worked solution of ``problem`` with the borrow slip made at ``rate``.

    The slip: on a ``-`` line whose subtrahend has two digits (``t >= 10``) the demonstration
    writes ``acc - t + 10`` (the tens of the subtrahend forgotten once), with probability ``rate``
    per such line, drawn from ``rng``; later lines go on from the slipped value, so a slipped
    demonstration is a consistent worked solution of the wrong answer. ``rate = 0`` returns the
    reference solution and draws nothing. Used by the SFT warm start (``mini.sft_slip_rate``).
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"slip rate must be in [0, 1], got {rate}")
    if rate == 0.0:
        return problem.solution
    terms, ops = parse_prompt(problem.prompt)
    return _worked(terms, ops, slip=lambda o, t: o == "-" and t >= 10 and rng.random() < rate)[0]


def make_splits(
    seed: int, n_train: int, n_eval: int, *, min_terms: int, max_terms: int, max_operand: int
) -> tuple[list[Problem], list[Problem]]:
    """Train pool and held-out eval set (disjoint by prompt), deterministic in ``seed``.

    Memoised per process (the lists are shared: treat them as read-only): drawing 20,000
    problems takes ~0.5 s, which a worker that runs many cells pays once.
    """
    train, eval_set = _make_splits(seed, n_train, n_eval, min_terms, max_terms, max_operand)
    return list(train), list(eval_set)


@functools.lru_cache(maxsize=8)
def _make_splits(seed: int, n_train: int, n_eval: int, min_terms: int, max_terms: int, max_operand: int
                 ) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
    if not 2 <= min_terms <= max_terms:
        raise ValueError(f"need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    if n_train < 1 or n_eval < 1:
        raise ValueError(f"n_train and n_eval must be >= 1, got {n_train}, {n_eval}")
    rng = random.Random(seed)
    eval_set: list[Problem] = []
    seen: set[str] = set()
    tries = 0
    while len(eval_set) < n_eval:
        tries += 1
        if tries > 50 * n_eval:
            raise ValueError(f"cannot draw {n_eval} distinct eval problems; widen the task or ask fewer")
        p = sample_problem(rng, min_terms, max_terms, max_operand)
        if p.prompt not in seen:
            seen.add(p.prompt)
            eval_set.append(p)
    train: list[Problem] = []
    tries = 0
    while len(train) < n_train:
        tries += 1
        if tries > 50 * n_train:
            raise ValueError("cannot draw train problems distinct from the eval set; widen the task")
        p = sample_problem(rng, min_terms, max_terms, max_operand)
        if p.prompt not in seen:
            train.append(p)
    return tuple(train), tuple(eval_set)
