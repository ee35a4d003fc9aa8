"""aggregate(): each mode vs its formula, DP-split invariance, verl relation, bad input."""

import pytest
import torch

from fp8rl.registry import RegistryError
from fp8rl.rl.aggregation import LOSS_AGGREGATIONS, aggregate

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
HORIZON = 12


def batch(seed=0, B=7, T=HORIZON):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.35
    mask[3] = False  # a fully masked (padding) sequence
    loss[~mask] = float("nan")  # garbage at masked tokens must not leak
    return loss, mask


def loop_formula(loss, mask, mode):
    """The mode's definition written as plain Python over sequences and tokens."""
    seq_vals, tokens, total = [], 0, 0.0
    for b in range(loss.shape[0]):
        vals = [float(loss[b, t]) for t in range(loss.shape[1]) if mask[b, t]]
        tokens += len(vals)
        total += sum(vals)
        if vals:
            seq_vals.append(sum(vals) / len(vals) if mode == "seq-mean-token-mean" else sum(vals) / HORIZON)
    if mode == "token-mean":
        return total / tokens
    return sum(seq_vals) / len(seq_vals)


def kwargs_for(mode):
    return {"horizon": HORIZON} if mode == "seq-mean-token-sum-norm" else {}


@pytest.mark.parametrize("mode", MODES)
def test_matches_formula(mode):
    loss, mask = batch()
    got = aggregate(loss, mask, mode, **kwargs_for(mode))
    assert got.dim() == 0
    assert float(got) == pytest.approx(loop_formula(loss, mask, mode), rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cut", [1, 3, 4, 6])
def test_dp_split_with_global_counts_sums_to_whole(mode, cut):
    loss, mask = batch(seed=cut)
    whole = aggregate(loss, mask, mode, **kwargs_for(mode))
    counts = dict(global_tokens=mask.sum(), global_seqs=(mask.sum(-1) > 0).sum())
    shards = [aggregate(loss[s], mask[s], mode, **counts, **kwargs_for(mode)) for s in (slice(0, cut), slice(cut, None))]
    torch.testing.assert_close(shards[0] + shards[1], whole, rtol=1e-12, atol=1e-12)
    # Python-number counts work the same way as device tensors.
    py = {k: int(v) for k, v in counts.items()}
    again = sum(aggregate(loss[s], mask[s], mode, **py, **kwargs_for(mode)) for s in (slice(0, cut), slice(cut, None)))
    torch.testing.assert_close(again, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_local_counts_are_not_split_invariant(mode):
    """Guard that the split test can fail: without global counts shards do not sum to the whole."""
    loss, mask = batch(seed=11)
    whole = aggregate(loss, mask, mode, **kwargs_for(mode))
    parts = [aggregate(loss[s], mask[s], mode, **kwargs_for(mode)) for s in (slice(0, 2), slice(2, None))]
    assert not torch.allclose(parts[0] + parts[1], whole)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_matches_whole_batch(mode):
    loss, mask = batch(seed=2)
    loss = torch.where(mask, loss, torch.zeros_like(loss)).requires_grad_(True)
    (g_whole,) = torch.autograd.grad(aggregate(loss, mask, mode, **kwargs_for(mode)), loss)
    counts = dict(global_tokens=mask.sum(), global_seqs=(mask.sum(-1) > 0).sum())
    total = sum(aggregate(loss[s], mask[s], mode, **counts, **kwargs_for(mode)) for s in (slice(0, 3), slice(3, None)))
    (g_split,) = torch.autograd.grad(total, loss)
    torch.testing.assert_close(g_split, g_whole)


def test_seq_mean_token_sum_norm_relation_to_verl():
    """verl's agg_loss divides the sum over sequences by the horizon without a seq-mean."""
    loss, mask = batch(seed=4)
    lm = torch.where(mask, loss, torch.zeros_like(loss))
    verl = torch.sum(torch.sum(lm * mask, dim=-1)) / HORIZON  # verl: sum(seq_losses) / loss_scale_factor
    ours = aggregate(loss, mask, "seq-mean-token-sum-norm", horizon=HORIZON)
    torch.testing.assert_close(ours * (mask.sum(-1) > 0).sum(), verl)


def test_token_mean_matches_verl_masked_mean():
    loss, mask = batch(seed=5)
    lm = torch.where(mask, loss, torch.zeros_like(loss))
    torch.testing.assert_close(aggregate(loss, mask, "token-mean"), (lm * mask).sum() / mask.sum())


@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_returns_zero_with_graph(mode):
    loss = torch.randn(2, 4, requires_grad=True)
    out = aggregate(loss, torch.zeros(2, 4, dtype=torch.bool), mode, **kwargs_for(mode))
    assert float(out.detach()) == 0.0 and out.requires_grad
    shard = aggregate(loss, torch.zeros(2, 4), mode, global_tokens=10, global_seqs=3, **kwargs_for(mode))
    assert float(shard.detach()) == 0.0


def test_registry_names():
    assert sorted(LOSS_AGGREGATIONS) == sorted(MODES)


def test_bad_input_raises():
    loss, mask = batch()
    with pytest.raises(RegistryError, match="valid names are: seq-mean-token-mean"):
        aggregate(loss, mask, "seq-mean")
    with pytest.raises(ValueError, match="needs horizon"):
        aggregate(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="horizon must be"):
        aggregate(loss, mask, "seq-mean-token-sum-norm", horizon=0)
    with pytest.raises(ValueError, match="global_tokens"):
        aggregate(loss, mask, "token-mean", global_tokens=0)
    with pytest.raises(ValueError, match="global_seqs"):
        aggregate(loss, mask, "seq-mean-token-mean", global_seqs=-3)
    with pytest.raises(ValueError, match="scalar"):
        aggregate(loss, mask, "token-mean", global_tokens=torch.ones(2))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        aggregate(loss[0], mask[0], "token-mean")
    with pytest.raises(ValueError, match="mask has shape"):
        aggregate(loss, mask[:, :3], "token-mean")
