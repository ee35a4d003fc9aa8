"""IS corrections: none / tis / icepop weights vs per-token formulas, metrics, bad input."""

import math

import pytest
import torch

from fp8rl.registry import RegistryError
from fp8rl.rl.correction import (
    IS_CORRECTIONS,
    corrected_ppo_token_loss,
    is_weights,
    make_correction,
)
from fp8rl.rl.policy_loss import ppo_token_loss


def batch(seed=0, B=5, T=11, spread=0.8):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    rollout = old + torch.randn(B, T, generator=g) * spread
    mask = torch.rand(B, T, generator=g) > 0.25
    rollout[~mask] = -float("inf")  # padding garbage
    return old, rollout, mask


def test_registry_names():
    assert sorted(IS_CORRECTIONS) == ["icepop", "none", "tis"]


def test_none_is_one_on_response_tokens():
    old, rollout, mask = batch()
    w, m = is_weights(old, rollout, mask, "none")
    assert torch.equal(w, mask.float())
    assert float(m["rollout/is_clipfrac"]) == 0.0


@pytest.mark.parametrize("cap", [0.7, 1.0, 2.0, 3.0])
def test_tis_is_min_of_ratio_and_cap_per_token(cap):
    old, rollout, mask = batch(seed=1)
    w, m = is_weights(old, rollout, mask, "tis", cap=cap)
    truncated = 0
    for b in range(old.shape[0]):
        for t in range(old.shape[1]):
            if not mask[b, t]:
                assert w[b, t] == 0
                continue
            r = float(torch.exp(old[b, t] - rollout[b, t]))
            assert float(w[b, t]) == pytest.approx(min(r, cap), rel=1e-6)
            truncated += r > cap
    assert 0 < truncated < mask.sum()
    assert float(m["rollout/is_clipfrac"]) == pytest.approx(truncated / int(mask.sum()))


def test_tis_with_infinite_cap_is_untruncated_is():
    """cap = inf: the weight is exactly the IS ratio, and nothing counts as truncated."""
    old, rollout, mask = batch(seed=2)
    w, m = is_weights(old, rollout, mask, "tis", cap=math.inf)
    assert torch.equal(w[mask], torch.exp(old - rollout)[mask])
    assert float(m["rollout/is_clipfrac"]) == 0.0


@pytest.mark.parametrize("method, params", [("tis", {"cap": math.inf}), ("tis", {"cap": 2.0}), ("icepop", {})])
def test_equals_none_without_mismatch(method, params):
    """With identical rollout and trainer log-probs every correction equals `none` exactly."""
    old, _, mask = batch(seed=3)
    g = torch.Generator().manual_seed(9)
    lp = (old + torch.randn(old.shape, generator=g) * 0.3).requires_grad_(True)
    adv = torch.randn(old.shape, generator=g)
    kw = dict(low=0.8, high=1.28)
    ref, _ = corrected_ppo_token_loss(lp, old, old, adv, mask, **kw, correction="none")
    got, m = corrected_ppo_token_loss(lp, old, old, adv, mask, **kw, correction=method, correction_params=params)
    assert torch.equal(got, ref)
    assert float(m["rollout/mismatch_kl"]) == 0.0 and float(m["rollout/is_clipfrac"]) == 0.0


def test_icepop_masks_exactly_outside_half_to_five():
    lo_x = torch.log(torch.tensor(0.5))
    hi_x = torch.log(torch.tensor(5.0))
    assert torch.exp(lo_x) == 0.5 and torch.exp(hi_x) == 5.0  # exact in float32
    xs = []
    for x in (lo_x, hi_x):
        xs += [torch.nextafter(x, torch.tensor(-9.0)), x, torch.nextafter(x, torch.tensor(9.0))]
    xs += [torch.tensor(0.0), torch.tensor(-3.0), torch.tensor(3.0)]
    x = torch.stack(xs)[None, :]
    old = torch.zeros_like(x)
    w, m = is_weights(old, -x, torch.ones_like(x), "icepop")  # ratio = exp(0 - (-x)) = exp(x)
    r = torch.exp(x)
    inside = (r >= 0.5) & (r <= 5.0)
    assert inside.tolist() == [[False, True, True, True, True, False, True, False, False]]
    assert torch.equal(w, torch.where(inside, r, torch.zeros_like(r)))
    assert float(m["rollout/is_clipfrac"]) == pytest.approx(4 / 9)


def test_icepop_custom_band():
    old, rollout, mask = batch(seed=4)
    w, _ = is_weights(old, rollout, mask, "icepop", low=0.8, high=1.25)
    r = torch.exp(old - rollout)
    keep = mask & (r >= 0.8) & (r <= 1.25)
    assert torch.equal(w, torch.where(keep, r, torch.zeros_like(r)))


def test_metrics_formulas_and_detached():
    old, rollout, mask = batch(seed=5)
    old = old.clone().requires_grad_(True)
    w, m = is_weights(old, rollout, mask, "tis")
    assert not w.requires_grad and all(not v.requires_grad for v in m.values())
    x = (old.detach() - rollout)[mask].double()
    k3 = (x.exp() - 1 - x).mean()
    assert float(m["rollout/mismatch_kl"]) == pytest.approx(float(k3), rel=1e-5)
    assert float(m["rollout/mismatch_kl"]) > 0
    assert float(m["rollout/mismatch_k1"]) == pytest.approx(float((-x).mean()), rel=1e-5)


def test_corrected_loss_is_loss_times_weight():
    old, rollout, mask = batch(seed=6, spread=0.3)
    g = torch.Generator().manual_seed(1)
    lp = old + torch.randn(old.shape, generator=g) * 0.2
    adv = torch.randn(old.shape, generator=g)
    base, _ = ppo_token_loss(lp, old, adv, mask, low=0.8, high=1.28)
    w, _ = is_weights(old, rollout, mask, "tis", cap=2.0)
    got, m = corrected_ppo_token_loss(
        lp, old, rollout, adv, mask, low=0.8, high=1.28, correction="tis", correction_params={"cap": 2.0}
    )
    torch.testing.assert_close(got, base * w)
    assert "rollout/mismatch_kl" in m and "actor/clipfrac" in m


@pytest.mark.parametrize(
    "method, params, exc, match",
    [
        ("tis", {"cap": 0.0}, ValueError, "cap must be > 0"),
        ("tis", {"cap": -2.0}, ValueError, "cap must be > 0"),
        ("tis", {"cap": float("nan")}, ValueError, "cap must be > 0"),
        ("tis", {"C": 2.0}, TypeError, r"accepts: \['cap'\]"),
        ("icepop", {"low": 5.0, "high": 0.5}, ValueError, "low < high"),
        ("icepop", {"low": -1.0}, ValueError, "0 <= low"),
        ("none", {"cap": 2.0}, TypeError, "no parameters"),
        ("trunc", {}, RegistryError, "valid names are: icepop, none, tis"),
    ],
)
def test_bad_parameters_raise(method, params, exc, match):
    with pytest.raises(exc, match=match):
        make_correction(method, **params)
    old, rollout, mask = batch()
    with pytest.raises(exc, match=match):
        is_weights(old, rollout, mask, method, **params)


def test_bad_tensors_raise():
    old, rollout, mask = batch()
    with pytest.raises(ValueError, match="expected"):
        is_weights(old, rollout[:, :3], mask, "tis")
    with pytest.raises(ValueError, match="mask has shape"):
        is_weights(old, rollout, mask[:2], "tis")
    with pytest.raises(ValueError, match="needs rollout_log_prob"):
        corrected_ppo_token_loss(old, old, None, old, mask, low=0.8, high=1.2, correction="tis")


def test_return_weights_hands_back_the_weights_applied():
    """``return_weights=True``: the third element is the detached IS weight the loss was
    multiplied by (min(exp(old - rollout), cap) for tis), None without rollout log-probs."""
    old, rollout, mask = batch(seed=5)
    g = torch.Generator().manual_seed(4)
    lp, adv = old + torch.randn(old.shape, generator=g) * 0.2, torch.randn(old.shape, generator=g)
    kw = dict(low=0.8, high=1.28)
    plain, _ = corrected_ppo_token_loss(lp, old, None, adv, mask, **kw)
    got, _, w = corrected_ppo_token_loss(lp, old, rollout, adv, mask, **kw, correction="tis",
                                         correction_params={"cap": 2.0}, return_weights=True)
    m = mask.bool()
    torch.testing.assert_close(w[m], torch.clamp(torch.exp(old - rollout), max=2.0)[m])
    assert torch.equal(got, plain * w)
    assert corrected_ppo_token_loss(lp, old, None, adv, mask, **kw, return_weights=True)[2] is None
