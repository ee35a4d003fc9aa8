"""Our PolicyLoss subclass vs the real OpenRLHF 0.11.2 ``PolicyLoss`` (loaded by path)."""

import inspect

import pytest
import torch
from orl_helpers import random_batch

from fp8rl.backends.openrlhf.plugin import (
    PluginSpec,
    correction_from_upstream,
    make_policy_loss_class,
)

CASES = [
    dict(is_correction_level="off"),
    dict(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.0, 2.0)),
    dict(is_correction_level="token", is_correction_mode="mask", is_correction_threshold=(0.5, 5.0)),
]


@pytest.mark.parametrize("corr", CASES, ids=["off", "tis", "icepop"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("dp", [None, 2])
def test_subclass_equals_upstream_when_calibration_off(upstream_loss, corr, dual_clip, token_level, dp):
    eps = (0.2, 0.28)
    kw = dict(clip_eps_low=eps[0], clip_eps_high=eps[1], dual_clip=dual_clip, token_level_loss=token_level, **corr)
    theirs = upstream_loss.PolicyLoss(**kw)
    cls = make_policy_loss_class(upstream_loss.PolicyLoss, PluginSpec(eps_low=eps[0], eps_high=eps[1]))
    ours = cls(**kw)
    assert isinstance(ours, upstream_loss.PolicyLoss)
    lp, old, rollout, adv, mask = random_batch(3)
    extra = {} if dp is None else dict(dp_size=dp, batch_num_tokens=mask.sum() * 1.5, global_batch_size=20.0)
    t = theirs(lp, old, adv, mask, rollout_log_probs=rollout, **extra)
    o = ours(lp, old, adv, mask, rollout_log_probs=rollout, **extra)
    assert len(o) == len(t) == 5
    torch.testing.assert_close(o[0], t[0], rtol=1e-6, atol=1e-7)
    (tg,) = torch.autograd.grad(t[0], lp)
    (og,) = torch.autograd.grad(o[0], lp)
    torch.testing.assert_close(og, tg, rtol=1e-6, atol=1e-8)
    for a, b in zip(o[1:], t[1:], strict=True):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-6, atol=1e-7)
    assert float(t[1]) > 0.02  # the batch really clips
    assert set(ours.last_metrics) >= {"actor/clipfrac_neg_low", "clip/low", "clip/high"}
    assert float(ours.last_metrics["clip/low"]) == pytest.approx(0.8)


def test_signature_matches_upstream(upstream_loss):
    cls = make_policy_loss_class(upstream_loss.PolicyLoss, PluginSpec())
    def spec(f):
        return [(p.name, p.default) for p in inspect.signature(f).parameters.values()]

    assert spec(cls.forward) == spec(upstream_loss.PolicyLoss.forward)


def test_metrics_reach_the_sink(upstream_loss):
    cls = make_policy_loss_class(upstream_loss.PolicyLoss, PluginSpec())
    loss = cls(clip_eps_low=0.2, clip_eps_high=0.2)
    info: dict = {}
    loss.sink = info
    lp, old, _, adv, mask = random_batch(0)
    loss(lp, old, adv, mask)
    assert all(v.dim() == 0 for v in info.values())  # upstream merges 0-d tensors of info
    assert "actor/clipfrac_neg_low" in info and "clip/low" in info


def test_calibrated_bounds_move_the_loss(upstream_loss):
    spec = PluginSpec(clip_method="calibrated", clip_options={"period": 1, "ema": 0.0, "init_bounds": [0.8, 1.2]},
                      eps_low=0.2, eps_high=0.2)
    cls = make_policy_loss_class(upstream_loss.PolicyLoss, spec)
    loss = cls(clip_eps_low=0.2, clip_eps_high=0.2)
    lp, old, _, adv, mask = random_batch(1)
    ratio = torch.exp((lp.detach() - old).clamp(-20, 20))
    loss.pending_shadow = ratio ** 0.25  # a BF16 shadow that strays far less than the FP8 ratio
    loss(lp, old, adv, mask)
    low, _high = loss.clipper.bounds(0).as_tuple()
    assert low < 0.8  # FP8 ratios are noisier: the lower bound widens
    assert "clip/alpha" in loss.last_metrics


def test_correction_mapping_and_bad_input():
    assert correction_from_upstream("off", "mask", "ratio", (0.5, 5.0)) == ("none", {})
    assert correction_from_upstream("token", "clip", "ratio", (0.0, 2.0)) == ("tis", {"cap": 2.0})
    assert correction_from_upstream("token", "mask", "ratio", (0.5, 5.0)) == ("icepop", {"low": 0.5, "high": 5.0})
    with pytest.raises(ValueError, match="clamps the IS weight from below"):
        correction_from_upstream("token", "clip", "ratio", (0.5, 2.0))
    with pytest.raises(ValueError, match="no fp8rl equivalent"):
        correction_from_upstream("seq", "mask", "ratio", (0.5, 5.0))


def test_eps_mismatch_with_spec_raises(upstream_loss):
    cls = make_policy_loss_class(upstream_loss.PolicyLoss, PluginSpec(eps_low=0.2, eps_high=0.28))
    with pytest.raises(ValueError, match="disagrees with the plugin spec"):
        cls(clip_eps_low=0.2, clip_eps_high=0.2)
