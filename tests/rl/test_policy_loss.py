"""ppo_token_loss against an explicit per-token loop, plus gradient and bad-input checks."""

import math

import pytest
import torch

from fp8rl.rl.policy_loss import ppo_token_loss


def f32(x: float) -> float:
    """The float32 value nearest x, as a Python float (exact)."""
    return float(torch.tensor(x, dtype=torch.float32))


def exp_in(dtype, x: float) -> float:
    """exp(x) computed in ``dtype`` like the kernel does, returned exactly as a Python float."""
    return float(torch.exp(torch.tensor(x, dtype=dtype)))


# Bounds that are exactly exp of a small dyadic log-ratio in float32/float64, so that tokens
# can sit exactly on a bound.
LOG_LOW, LOG_HIGH, LOG_DUAL = -0.25, 0.25, 1.25


def make_batch(dtype, seed=0, B=6, T=9):
    """Random inputs with exact-boundary ratios, A == 0 tokens, garbage at masked tokens."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    log_ratio = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    # Exact boundary log-ratios (dyadic, so old + x - old == x exactly in any float dtype).
    old = torch.round(old * 64) / 64
    picks = torch.randint(0, 6, (B, T), generator=g)
    exact = torch.tensor([LOG_LOW, LOG_HIGH, LOG_DUAL, 0.0], dtype=torch.float64)
    log_ratio = torch.where(picks < 4, exact[picks.clamp(max=3)], torch.round(log_ratio * 1024) / 1024)
    log_ratio[0, 0] = 25.0  # beyond the +-20 clamp
    lp = old + log_ratio
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv[torch.rand(B, T, generator=g) < 0.15] = 0.0  # A == 0 tokens
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    lp = lp.to(dtype)
    lp[~mask] = float("nan")  # padding garbage must not leak
    return lp, old.to(dtype), adv.to(dtype), mask


def loop_reference(lp, old, adv, mask, low, high, dual):
    """Explicit per-token loop: loss matrix, the four cells, clipfrac, quantiles, ppo_kl."""
    dtype = lp.dtype
    lo, hi = float(torch.tensor(low, dtype=dtype)), float(torch.tensor(high, dtype=dtype))
    B, T = lp.shape
    loss = [[0.0] * T for _ in range(B)]
    cnt = dict(tok=0, neg=0, pos=0, neg_low=0, neg_high=0, pos_low=0, pos_high=0, dual=0)
    neg_ratios, kl = [], []
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            x = float(lp[b, t]) - float(old[b, t])
            r = exp_in(dtype, min(max(x, -20.0), 20.0))
            a = float(adv[b, t])
            clipped_r = min(max(r, lo), hi)
            val = max(-a * r, -a * clipped_r)
            if dual is not None and a < 0:
                val = min(val, -a * dual)
                cnt["dual"] += r > dual
            loss[b][t] = val
            kl.append(-x)
            cnt["tok"] += 1
            if a < 0:
                cnt["neg"] += 1
                cnt["neg_low"] += r < lo
                cnt["neg_high"] += r > hi
                neg_ratios.append(r)
            elif a > 0:
                cnt["pos"] += 1
                cnt["pos_low"] += r < lo
                cnt["pos_high"] += r > hi
    return torch.tensor(loss, dtype=torch.float64), cnt, sorted(neg_ratios), sum(kl) / len(kl)


def lin_quantile(xs, q):
    h = q * (len(xs) - 1)
    i = math.floor(h)
    j = min(i + 1, len(xs) - 1)
    return xs[i] + (h - i) * (xs[j] - xs[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dual", [None, "exp"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_per_token_loop(dtype, dual, seed):
    lp, old, adv, mask = make_batch(dtype, seed)
    low, high = exp_in(dtype, LOG_LOW), exp_in(dtype, LOG_HIGH)
    c = exp_in(dtype, LOG_DUAL) if dual else None
    loss, metrics = ppo_token_loss(lp, old, adv, mask, low=low, high=high, dual_clip=c)
    ref, cnt, neg, kl = loop_reference(lp, old, adv, mask, low, high, c)
    # the batch really exercises the edge cases
    r = torch.exp(lp - old)[mask]
    assert (r == low).any() and (r == high).any() and (r == c if c else r == high).any()
    assert cnt["neg_low"] > 0 and cnt["pos_high"] > 0 and (adv[mask] == 0).any()
    assert loss.dtype == dtype and torch.all(loss[~mask] == 0)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    m = {k: float(v) for k, v in metrics.items()}
    assert m["actor/clipfrac"] == pytest.approx((cnt["neg_low"] + cnt["pos_high"]) / cnt["tok"])
    for cell in ("neg_low", "neg_high", "pos_low", "pos_high"):
        den = cnt["neg"] if cell.startswith("neg") else cnt["pos"]
        assert m[f"actor/clipfrac_{cell}"] == pytest.approx(cnt[cell] / den), cell
    for name, q in (("q01", 0.01), ("q50", 0.5), ("q99", 0.99)):
        assert m[f"actor/ratio_neg_{name}"] == pytest.approx(lin_quantile(neg, q), rel=1e-6)
    assert m["actor/ppo_kl"] == pytest.approx(kl, rel=1e-5, abs=1e-6)
    if c is None:
        assert "actor/dualclipfrac" not in m
    else:
        assert m["actor/dualclipfrac"] == pytest.approx(cnt["dual"] / cnt["tok"])
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_boundary_ratios_are_not_clipped():
    """A ratio exactly on a bound is not counted as clipped (strict inequality)."""
    low, high = exp_in(torch.float32, LOG_LOW), exp_in(torch.float32, LOG_HIGH)
    old = torch.zeros(1, 4)
    lp = torch.tensor([[LOG_LOW, LOG_HIGH, LOG_LOW - 2**-10, LOG_HIGH + 2**-10]])
    adv = torch.tensor([[-1.0, 1.0, -1.0, 1.0]])
    _, m = ppo_token_loss(lp, old, adv, torch.ones(1, 4), low=low, high=high)
    assert float(m["actor/clipfrac"]) == 0.5
    assert float(m["actor/clipfrac_neg_low"]) == 0.5 and float(m["actor/clipfrac_pos_high"]) == 0.5


def test_clipped_tokens_have_zero_gradient_and_others_do_not():
    """actor/clipfrac counts exactly the tokens whose gradient the PPO clip zeroes."""
    lp, old, adv, mask = make_batch(torch.float64, seed=5)
    lp = torch.where(mask, lp, torch.zeros_like(lp))
    lp.requires_grad_(True)
    low, high = 0.8, 1.28
    loss, metrics = ppo_token_loss(lp, old, adv, mask, low=low, high=high)
    loss.sum().backward()
    r = torch.exp((lp.detach() - old).clamp(-20, 20))
    clipped = mask & (((adv < 0) & (r < low)) | ((adv > 0) & (r > high)))
    live = mask & (adv != 0) & ~clipped & ((lp.detach() - old).abs() < 20)
    assert torch.all(lp.grad[clipped] == 0)
    assert torch.all(lp.grad[live] != 0)
    assert float(metrics["actor/clipfrac"]) == pytest.approx(float(clipped.sum() / mask.sum()))


def test_empty_sign_gives_nan_cells_and_quantiles():
    lp = torch.tensor([[0.25, -0.3, 0.0]])
    adv = torch.tensor([[1.0, 2.0, 0.0]])  # no A<0 tokens
    _, m = ppo_token_loss(lp, torch.zeros(1, 3), adv, torch.ones(1, 3), low=0.8, high=1.2)
    for k in ("clipfrac_neg_low", "clipfrac_neg_high", "ratio_neg_q01", "ratio_neg_q50", "ratio_neg_q99"):
        assert math.isnan(float(m[f"actor/{k}"])), k
    assert float(m["actor/clipfrac_pos_high"]) == 0.5  # r = 1.28 > 1.2
    assert float(m["actor/clipfrac_pos_low"]) == 0.5  # r = 0.74 < 0.8


def test_bf16_log_probs_are_computed_in_float32():
    lp, old, adv, mask = make_batch(torch.float32, seed=3)
    lp = torch.where(mask, lp, torch.zeros_like(lp))
    loss_bf, _ = ppo_token_loss(lp.bfloat16(), old.bfloat16(), adv.bfloat16(), mask, low=0.8, high=1.28)
    loss_32, _ = ppo_token_loss(
        lp.bfloat16().float(), old.bfloat16().float(), adv.bfloat16().float(), mask, low=0.8, high=1.28
    )
    assert loss_bf.dtype == torch.float32
    torch.testing.assert_close(loss_bf, loss_32)


def test_float_mask_equals_bool_mask():
    lp, old, adv, mask = make_batch(torch.float32, seed=4)
    a, ma = ppo_token_loss(lp, old, adv, mask, low=0.8, high=1.28)
    b, mb = ppo_token_loss(lp, old, adv, mask.float(), low=0.8, high=1.28)
    torch.testing.assert_close(a, b)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(low=1.0, high=1.2), "low bound"),
        (dict(low=0.2, high=0.28), "high bound"),  # eps passed instead of ratios
        (dict(low=-0.1, high=1.2), "low bound"),
        (dict(low=0.8, high=1.0), "high bound"),
        (dict(low=float("nan"), high=1.2), "NaN"),
        (dict(low=0.8, high=1.2, dual_clip=1.0), "dual_clip"),
        (dict(low=0.8, high=1.2, dual_clip=float("inf")), "dual_clip"),
    ],
)
def test_bad_bounds_raise(kwargs, match):
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=match):
        ppo_token_loss(x, x, x, torch.ones(2, 3), **kwargs)


def test_bad_tensors_raise():
    x = torch.zeros(2, 3)
    ok = dict(low=0.8, high=1.2)
    with pytest.raises(ValueError, match="broadcast_to_tokens"):
        ppo_token_loss(x, x, torch.zeros(2), torch.ones(2, 3), **ok)
    with pytest.raises(ValueError, match="expected"):
        ppo_token_loss(x, torch.zeros(2, 4), x, torch.ones(2, 3), **ok)
    with pytest.raises(TypeError, match="floating"):
        ppo_token_loss(x.long(), x, x, torch.ones(2, 3), **ok)
    with pytest.raises(ValueError, match="mask has shape"):
        ppo_token_loss(x, x, x, torch.ones(3, 2), **ok)
    with pytest.raises(ValueError, match="0/1"):
        ppo_token_loss(x, x, x, torch.full((2, 3), 2.0), **ok)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        ppo_token_loss([[0.0]], x, x, torch.ones(2, 3), **ok)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    lp, old, adv, mask = make_batch(torch.float32, seed=8)
    cpu, mc = ppo_token_loss(lp, old, adv, mask, low=0.8, high=1.28, dual_clip=3.0)
    gpu, mg = ppo_token_loss(lp.cuda(), old.cuda(), adv.cuda(), mask.cuda(), low=0.8, high=1.28, dual_clip=3.0)
    torch.testing.assert_close(gpu.cpu(), cpu)
    for k in mc:
        torch.testing.assert_close(mg[k].cpu(), mc[k], equal_nan=True)


def test_metrics_off_gives_the_same_loss_and_no_diagnostics():
    g = torch.Generator().manual_seed(7)
    lp, old = torch.randn(4, 6, generator=g) * 0.1, torch.randn(4, 6, generator=g) * 0.1
    adv, mask = torch.randn(4, 6, generator=g), (torch.rand(4, 6, generator=g) > 0.2)
    a, ma = ppo_token_loss(lp, old, adv, mask, low=0.8, high=1.28, dual_clip=3.0)
    b, mb = ppo_token_loss(lp, old, adv, mask, low=0.8, high=1.28, dual_clip=3.0, metrics=False)
    assert torch.equal(a, b) and mb == {} and "actor/clipfrac_neg_low" in ma
