"""DAPO dynamic sampling's refill bound in the mini trainer: with ``algorithm.max_extra_rounds=k`` a
step draws at most ``k`` refill rounds after its first (``MiniTrainer.collect``), stops refilling as
soon as the batch holds ``prompts_per_step`` informative groups, and logs what it did
(``dapo/extra_rounds``, ``dapo/groups_used``).

The rewards are constructed per round (which groups have mixed rewards), so the numbers expected
are exact on any CPU; one test also checks an unmodified run's logs against the rollouts it made.
"""

from __future__ import annotations

import pytest
import torch

from fp8rl.backends.mini.run import run_mini
from fp8rl.backends.mini.trainer import MiniTrainer
from fp8rl.runs import metrics as M
from fp8rl.runs.rundir import RunDir

PROMPTS = 4  # the tiny fixture's prompts per step (groups of 4 samples)


def _dapo(tiny, k: int, **kw):
    return tiny("bf16", "vanilla", algorithm=dict(name="dapo", eps_high=0.28, dynamic_sampling=True,
                                                  max_extra_rounds=k), **kw)


def _forced(trainer, monkeypatch, kept_per_round) -> list[tuple[int, int]]:
    """Give round r of every step ``kept_per_round(r)`` groups with mixed rewards (one right answer
    of four) and the rest all-wrong groups; return the log of ``(step, round)`` rollouts."""
    real = trainer.rollout
    log: list[tuple[int, int]] = []

    def rollout(step, round_, gen):
        log.append((step, round_))
        batch = real(step, round_, gen)
        n = trainer.cfg.algorithm.n_samples_per_prompt
        rewards = torch.zeros(len(batch))
        for g in range(min(kept_per_round(round_), PROMPTS)):
            rewards[g * n] = 1.0
        batch.rewards, batch.correct = rewards, rewards.clone()
        return batch

    monkeypatch.setattr(trainer, "rollout", rollout)
    return log


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_no_group_kept_draws_exactly_max_extra_rounds(tiny, monkeypatch, k):
    """Every round's groups are all wrong: the step refills as often as allowed, no more."""
    cfg = _dapo(tiny, k, steps=2)
    trainer = MiniTrainer(cfg, None, sft_cache=cfg.mini.cache_dir)
    log = _forced(trainer, monkeypatch, lambda r: 0)
    for step in (1, 2):
        gen = torch.Generator().manual_seed(step)
        batch, generated, metrics = trainer.collect(step, gen)
        assert [r for s, r in log if s == step] == list(range(k + 1))  # the first round and k refills
        assert metrics["dapo/extra_rounds"] == k
        assert metrics["dapo/groups_used"] == 0 and len(batch) == 0
        assert len(generated) == (k + 1) * PROMPTS * cfg.algorithm.n_samples_per_prompt


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_one_group_per_round_refills_until_full_or_out_of_rounds(tiny, monkeypatch, k):
    """One informative group per round: a batch of 4 groups needs 3 refills; with fewer allowed the
    step stops at k and trains on what it has, with more it stops once full."""
    cfg = _dapo(tiny, k, steps=1)
    trainer = MiniTrainer(cfg, None, sft_cache=cfg.mini.cache_dir)
    log = _forced(trainer, monkeypatch, lambda r: 1)
    batch, _, metrics = trainer.collect(1, torch.Generator().manual_seed(1))
    rounds = min(k, PROMPTS - 1)
    assert [r for _, r in log] == list(range(rounds + 1))
    assert metrics["dapo/extra_rounds"] == rounds
    assert metrics["dapo/groups_used"] == rounds + 1
    assert len(batch) == (rounds + 1) * cfg.algorithm.n_samples_per_prompt
    assert int(batch.group_ids.max()) < (k + 1) * PROMPTS  # no group of a round beyond the bound


@pytest.mark.parametrize("k", [0, 2])
def test_a_full_first_round_draws_no_refill(tiny, monkeypatch, k):
    cfg = _dapo(tiny, k, steps=1)
    trainer = MiniTrainer(cfg, None, sft_cache=cfg.mini.cache_dir)
    log = _forced(trainer, monkeypatch, lambda r: PROMPTS)
    _, _, metrics = trainer.collect(1, torch.Generator().manual_seed(1))
    assert log == [(1, 0)]
    assert metrics["dapo/extra_rounds"] == 0 and metrics["dapo/groups_used"] == PROMPTS


@pytest.mark.parametrize("k", [0, 1])
def test_logged_rounds_match_the_rollouts_and_the_bound(tiny, monkeypatch, k):
    """An unmodified run: each step's logged refill rounds are the rollouts it drew beyond the
    first, at most k; fewer than k only when the batch was full."""
    real = MiniTrainer.rollout
    log: list[tuple[int, int]] = []

    def rollout(self, step, round_, gen):
        log.append((step, round_))
        return real(self, step, round_, gen)

    monkeypatch.setattr(MiniTrainer, "rollout", rollout)
    rows = RunDir(run_mini(_dapo(tiny, k, steps=3, samples_every=0, eval_every=0))["run_dir"]).read_metrics()
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        drawn = [rd for s, rd in log if s == r["step"]]
        assert drawn == list(range(r["dapo/extra_rounds"] + 1))
        assert 0 <= r["dapo/extra_rounds"] <= k
        assert 0 <= r["dapo/groups_used"] <= PROMPTS
        if r["dapo/extra_rounds"] < k:
            assert r["dapo/groups_used"] == PROMPTS  # stopped early only because the batch was full
        assert 0.0 <= r[M.DAPO_KEPT_GROUP_FRAC] <= 1.0
