"""Clip methods registry, the sweep-axis arms, and calibrated bounds through the PPO kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp8rl.registry import RegistryError
from fp8rl.rl.calibration import Bounds, CalibratedClipController
from fp8rl.rl.clipping import (
    CLIP_ARMS,
    CLIP_METHODS,
    ClipArm,
    ClipMethod,
    VanillaClip,
    make_clipper,
)
from fp8rl.rl.correction import IS_CORRECTIONS
from fp8rl.rl.policy_loss import ppo_token_loss


def batch(seed=0, B=32, T=64, noise=0.15):
    g = torch.Generator().manual_seed(seed)
    shadow_lp = torch.randn(B, T, generator=g) * 0.15
    fp8_lp = shadow_lp + torch.randn(B, T, generator=g) * noise
    old = torch.zeros(B, T)
    adv = torch.randn(B, generator=g)[:, None].expand(B, T).contiguous()
    mask = torch.rand(B, T, generator=g) > 0.1
    return fp8_lp, shadow_lp, old, adv, mask


def test_registries_hold_the_documented_names():
    assert CLIP_METHODS.names() == ["calibrated", "no_lower_clip", "vanilla", "wide_lower"]
    assert CLIP_ARMS.names() == ["calibrated", "no_lower_clip", "score_centering", "score_centering_tis", "tis",
                                 "vanilla", "wide_lower"]
    assert CLIP_ARMS["vanilla"] == ClipArm("vanilla", "none")
    assert CLIP_ARMS["tis"] == ClipArm("vanilla", "tis")
    assert CLIP_ARMS["calibrated"] == ClipArm("calibrated", "tis")
    assert CLIP_ARMS["no_lower_clip"] == ClipArm("no_lower_clip", "tis")
    assert CLIP_ARMS["wide_lower"] == ClipArm("wide_lower", "tis")
    assert CLIP_ARMS["score_centering"] == ClipArm("vanilla", "none", score_centering=True)
    assert CLIP_ARMS["score_centering_tis"] == ClipArm("vanilla", "tis", score_centering=True)
    assert not any(CLIP_ARMS[a].score_centering for a in ("vanilla", "tis", "calibrated"))
    for arm in CLIP_ARMS.values():
        assert arm.method in CLIP_METHODS and arm.is_correction in IS_CORRECTIONS


def test_unknown_names_raise_listing_valid_ones():
    with pytest.raises(RegistryError, match="valid names are: calibrated, no_lower_clip, vanilla, wide_lower"):
        make_clipper("calibrate", 0.2, 0.28)
    with pytest.raises(RegistryError, match="valid names are: calibrated, no_lower_clip, score_centering, score_centering_tis, tis, vanilla, wide_lower"):
        CLIP_ARMS["calibrate"]
    with pytest.raises(RegistryError, match="clip method"):
        ClipArm("fixed", "tis")
    with pytest.raises(RegistryError, match="IS correction"):
        ClipArm("vanilla", "is")
    with pytest.raises(dataclasses.FrozenInstanceError):
        CLIP_ARMS["tis"].method = "calibrated"  # type: ignore[misc]


def test_vanilla_clip():
    clip = make_clipper("vanilla", 0.2, 0.28)
    assert isinstance(clip, VanillaClip) and isinstance(clip, ClipMethod)
    assert clip.bounds(0) == clip.bounds(1000) == Bounds(0.8, 1.28)
    assert not any(clip.needs_shadow(s) or clip.is_calibration_step(s) for s in range(50))
    fp8_lp, _, _, adv, mask = batch()
    assert clip.update(0, ratio=fp8_lp.exp(), advantages=adv, mask=mask) == Bounds(0.8, 1.28)
    assert clip.metrics() == {"clip/low": 0.8, "clip/high": 1.28}
    fresh = make_clipper("vanilla", 0.2, 0.28)
    fresh.load_state_dict(clip.state_dict())
    with pytest.raises(ValueError, match="eps"):
        make_clipper("vanilla", 0.2, 0.2).load_state_dict(clip.state_dict())
    for bad in [(0.0, 0.28), (1.0, 0.28), (0.2, 0.0), (0.2, float("inf"))]:
        with pytest.raises(ValueError):
            VanillaClip(*bad)
    with pytest.raises(TypeError, match="does not take option"):
        make_clipper("vanilla", 0.2, 0.28, period=20)


def test_make_clipper_calibrated_passes_options():
    clip = make_clipper("calibrated", 0.2, 0.28, mode="periodic", period=10, ema=0.0, init_bounds=(0.6, 1.8))
    assert isinstance(clip, CalibratedClipController) and isinstance(clip, ClipMethod)
    assert clip.period == 10 and clip.bounds(0) == Bounds(0.6, 1.8)
    assert clip.needs_shadow(0) and not clip.needs_shadow(5) and clip.needs_shadow(10)
    with pytest.raises(TypeError, match="does not take option"):
        make_clipper("calibrated", 0.2, 0.28, mode="periodic", periods=10)
    with pytest.raises(ValueError, match="period"):
        make_clipper("calibrated", 0.2, 0.28, mode="periodic", period=0)


def _run_loop(clipper, steps=3):
    """A generic trainer loop over the ClipMethod interface; returns FP8 clipfrac_neg_low per step."""
    out = []
    for step in range(steps):
        fp8_lp, shadow_lp, old, adv, mask = batch(seed=step)
        if clipper.is_calibration_step(step):
            shadow = shadow_lp.exp() if clipper.needs_shadow(step) else None
            clipper.update(step, ratio=fp8_lp.exp(), shadow_ratio=shadow, advantages=adv, mask=mask)
        low, high = clipper.bounds(step).as_tuple()
        _, m_fp8 = ppo_token_loss(fp8_lp, old, adv, mask, low=low, high=high)
        _, m_bf16 = ppo_token_loss(shadow_lp, old, adv, mask, low=0.8, high=1.28)
        n_neg = int((mask & (adv < 0)).sum())
        out.append((float(m_fp8["actor/clipfrac_neg_low"]), float(m_bf16["actor/clipfrac_neg_low"]), n_neg))
    return out


def test_calibrated_bounds_restore_bf16_lower_clipping_through_the_loss():
    # vanilla under FP8 noise clips many more A<0 tokens than BF16 would: the paper's failure
    vanilla = _run_loop(make_clipper("vanilla", 0.2, 0.28))
    assert all(fp8 > bf16 + 0.02 for fp8, bf16, _ in vanilla)
    # calibrated every step (period 1, no smoothing): the loss's own counter agrees with BF16
    calibrated = _run_loop(make_clipper("calibrated", 0.2, 0.28, mode="periodic", period=1, ema=0.0))
    for fp8, bf16, n_neg in calibrated:
        assert abs(fp8 - bf16) <= 1 / n_neg + 1e-6


def test_the_calibrating_api_the_plan_calls_is_public():
    """StepPlan calls only public methods of a calibrating clip method (the CalibratingMethod
    protocol); which methods calibrate is their class attribute, not their name."""
    import ast
    import inspect

    from fp8rl.rl.calibration import plan
    from fp8rl.rl.clipping import CLIP_METHODS, CalibratingMethod, make_clipper, method_calibrates

    assert isinstance(make_clipper("calibrated", 0.2, 0.28), CalibratingMethod)
    assert not isinstance(make_clipper("vanilla", 0.2, 0.28), CalibratingMethod)
    assert {n: method_calibrates(n) for n in CLIP_METHODS} == {"vanilla": False, "calibrated": True,
                                                               "no_lower_clip": False, "wide_lower": False}
    called = {node.attr for node in ast.walk(ast.parse(inspect.getsource(plan)))
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ctl"}
    assert called and not {c for c in called if c.startswith("_")}, called


@pytest.mark.parametrize(("method", "low"), [("no_lower_clip", 1e-30), ("wide_lower", 0.6)])
def test_the_controls_bounds_and_what_they_do_to_the_gradient_of_a_negative_advantage_token(method, low):
    """The two controls of Calibrated Clipping (issue 46): vanilla's upper bound, their own lower
    bound, no shadow, no state but the epsilons; and the PPO loss's gradient of A<0 tokens below
    vanilla's 0.8 is zero under vanilla, non-zero under a control down to its own bound."""
    from fp8rl.rl.policy_loss import ppo_token_loss

    eps_low, eps_high = 0.2, 0.28
    clip = make_clipper(method, eps_low, eps_high)
    assert (clip.bounds(0).low, clip.bounds(0).high) == (low, 1 + eps_high)
    assert not clip.calibrates and not clip.needs_shadow(0) and not clip.is_calibration_step(0)
    clip.load_state_dict(make_clipper(method, eps_low, eps_high).state_dict())
    ratios = torch.tensor([[0.05, 0.5, 0.7, 0.9, 1.1]])  # A<0 tokens from far below to above 0.8
    grads = {}
    for name, c in (("vanilla", make_clipper("vanilla", eps_low, eps_high)), (method, clip)):
        lp = ratios.log().clone().requires_grad_(True)
        loss, _ = ppo_token_loss(lp, torch.zeros_like(lp), -torch.ones_like(lp), torch.ones_like(lp, dtype=torch.bool),
                                 low=c.bounds(0).low, high=c.bounds(0).high)
        loss.sum().backward()
        grads[name] = (lp.grad != 0).flatten().tolist()
    assert grads["vanilla"] == [False, False, False, True, True]  # below 0.8: clipped, no gradient
    assert grads[method] == [r >= low for r in ratios.flatten().tolist()]


def test_score_centering_arm_needs_a_centering_mode_and_a_bool():
    with pytest.raises(TypeError, match="True or False"):
        ClipArm("vanilla", "tis", score_centering="yes")  # type: ignore[arg-type]


def test_clip_config_score_centering_options_follow_the_arm():
    from fp8rl.config.clip import ClipConfig

    assert ClipConfig(arm="tis").score_centering_options() is None
    assert ClipConfig(arm="score_centering").score_centering_options() == {"mode": "none", "bounds": None, "topk": 8}
    assert ClipConfig(arm="score_centering_tis", tis_cap=3.0, score_centering_topk=4).score_centering_options() == {
        "mode": "tis", "bounds": (0.0, 3.0), "topk": 4}
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"clip\.score_centering_topk must be an integer >= 1"):
            ClipConfig(arm="score_centering", score_centering_topk=bad)
