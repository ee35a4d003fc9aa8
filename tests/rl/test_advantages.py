"""GRPO / Dr.GRPO advantages vs a loop over groups and vs the upstream formulas."""

import statistics

import pytest
import torch

from fp8rl.registry import RegistryError
from fp8rl.rl.advantages import ADVANTAGE_ESTIMATORS, GRPO_EPS, broadcast_to_tokens, dr_grpo, grpo


def shuffled_groups(seed=0, sizes=(4, 2, 5, 3, 4)):
    """Rewards with arbitrary, non-contiguous, unsorted group labels (interleaved)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.tensor([1000, -3, 7, 42, 5])[: len(sizes)]
    ids = torch.cat([labels[i].repeat(n) for i, n in enumerate(sizes)])
    perm = torch.randperm(len(ids), generator=g)
    ids = ids[perm]
    rewards = torch.randint(0, 2, (len(ids),), generator=g).float() + 0.1 * torch.randn(len(ids), generator=g)
    rewards[ids == 42] = 1.0  # one all-equal group
    return rewards, ids


def loop_advantages(rewards, ids, normalise, eps=GRPO_EPS):
    out = []
    for i in range(len(rewards)):
        group = [float(rewards[j]) for j in range(len(rewards)) if ids[j] == ids[i]]
        mean = statistics.fmean(group)
        a = float(rewards[i]) - mean
        if normalise:
            a /= statistics.stdev(group) + eps  # sample (n - 1) std, as torch.std
        out.append(a)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_matches_loop_over_groups(seed):
    rewards, ids = shuffled_groups(seed)
    torch.testing.assert_close(grpo(rewards, ids).double(), loop_advantages(rewards, ids, True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dr_grpo_matches_loop_over_groups(seed):
    rewards, ids = shuffled_groups(seed)
    torch.testing.assert_close(dr_grpo(rewards, ids).double(), loop_advantages(rewards, ids, False), rtol=1e-5, atol=1e-6)


def test_all_equal_group_gets_zero():
    rewards, ids = shuffled_groups()
    assert torch.all(grpo(rewards, ids)[ids == 42] == 0)
    assert torch.all(dr_grpo(rewards, ids)[ids == 42] == 0)


def test_matches_verl_grpo_outcome_advantage():
    """verl's compute_grpo_outcome_advantage: per-group torch.std (unbiased), epsilon 1e-6."""
    rewards, ids = shuffled_groups(3)
    id2score = {}
    for i in range(len(rewards)):
        id2score.setdefault(int(ids[i]), []).append(rewards[i])
    id2mean = {k: torch.mean(torch.stack(v)) for k, v in id2score.items()}
    id2std = {k: torch.std(torch.stack(v)) for k, v in id2score.items()}
    verl = torch.stack([(rewards[i] - id2mean[int(ids[i])]) / (id2std[int(ids[i])] + 1e-6) for i in range(len(rewards))])
    torch.testing.assert_close(grpo(rewards, ids), verl)


def test_matches_openrlhf_group_norm_and_dr_grpo():
    """OpenRLHF 0.11.2: rewards.reshape(-1, n); group_norm divides by std(-1) + 1e-9."""
    g = torch.Generator().manual_seed(4)
    n = 8
    rewards = torch.randint(0, 2, (6 * n,), generator=g).float()
    ids = torch.arange(6).repeat_interleave(n)
    r = rewards.reshape(-1, n)
    group_norm = ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)).reshape(-1)
    torch.testing.assert_close(grpo(rewards, ids, eps=1e-9), group_norm)
    torch.testing.assert_close(dr_grpo(rewards, ids), (r - r.mean(-1, keepdim=True)).reshape(-1))


def test_dtypes():
    rewards, ids = shuffled_groups()
    assert grpo(rewards.double(), ids).dtype == torch.float64
    assert grpo(rewards.bfloat16(), ids).dtype == torch.float32
    assert dr_grpo(rewards, ids.int()).dtype == torch.float32


def test_registry():
    assert sorted(ADVANTAGE_ESTIMATORS) == ["dr_grpo", "grpo"]
    rewards, ids = shuffled_groups()
    torch.testing.assert_close(ADVANTAGE_ESTIMATORS["grpo"](rewards, ids), grpo(rewards, ids))
    with pytest.raises(RegistryError, match="valid names are: dr_grpo, grpo"):
        ADVANTAGE_ESTIMATORS["rloo"]


def test_broadcast_to_tokens():
    adv = torch.tensor([1.5, -2.0, 0.5])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    out = broadcast_to_tokens(adv, mask)
    assert torch.equal(out, torch.tensor([[1.5, 1.5, 0.0], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"\[N\]"):
        broadcast_to_tokens(adv[:, None], mask)
    with pytest.raises(ValueError, match="one row per response"):
        broadcast_to_tokens(adv, mask[:2])


def test_bad_input_raises():
    r = torch.tensor([1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="single response"):
        grpo(r, torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="single response"):
        dr_grpo(r, torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="NaN or inf"):
        grpo(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="same length"):
        grpo(r, torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="integer"):
        grpo(r, torch.tensor([0.0, 0.0, 1.0]))
    with pytest.raises(TypeError, match="floating"):
        grpo(torch.tensor([1, 0]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="empty"):
        grpo(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="eps"):
        grpo(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), eps=-1.0)
