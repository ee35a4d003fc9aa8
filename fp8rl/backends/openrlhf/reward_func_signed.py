"""Signed math reward (+1 correct, -1 otherwise; DAPO's recipe) for ``--reward.remote_url``.

The command builder names this file for cells whose ``openrlhf.reward_scheme`` is ``signed``
(DAPO by default); everything else is ``reward_func.py`` (next to this file), called with
``scheme="signed"``: the same grading, ``scores`` still 0/1 for dynamic filtering. OpenRLHF
0.11.2 loads this file by path and calls ``reward_func(queries, prompts, labels)``.
"""

from __future__ import annotations

from fp8rl.backends.openrlhf.grading import GradingPool
from fp8rl.backends.openrlhf.reward_func import reward_func as _reward_func

__all__ = ["SCHEME", "reward_func"]

#: The reward scheme this file implements (``fp8rl.backends.openrlhf.reward_func.REWARDS``).
SCHEME = "signed"


def reward_func(queries, prompts, labels, pool: GradingPool | None = None):
    """OpenRLHF's entry point: +1/-1 rewards, 0/1 scores, per-sample extra logs."""
    return _reward_func(queries, prompts, labels, pool=pool, scheme=SCHEME)
