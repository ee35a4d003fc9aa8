"""Calibrated Clipping controller: references, invariants, schedule, guards, checkpoints."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fp8rl.rl.calibration import (
    UPPER_RULES,
    Bounds,
    CalibratedClipController,
    calibrate_bounds,
    solve_upper_contribution,
)
from fp8rl.rl.diagnostics import clip_table, masked_quantiles

EPS_LOW, EPS_HIGH = 0.2, 0.28
VL, VH = 1.0 - EPS_LOW, 1.0 + EPS_HIGH
RULES = ["contribution", "proportional", "fixed"]


def synthetic(seed: int, B: int = 48, T: int = 96, noise: float = 0.1, bf16_std: float = 0.08):
    """BF16 ratios log-normal around 1; FP8 ratios = BF16 x log-normal noise; [B] advantages."""
    g = torch.Generator().manual_seed(seed)
    shadow = torch.exp(torch.randn(B, T, generator=g) * bf16_std)
    fp8 = shadow * torch.exp(torch.randn(B, T, generator=g) * noise)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.15
    return fp8, shadow, adv, mask


def ref_p(ratio, adv_tok, mask, low, high):
    """The contribution balance p, by the formula, in float64 with a per-token loop."""
    r = ratio.double().flatten().tolist()
    a = adv_tok.double().flatten().tolist()
    m = mask.flatten().tolist()
    lo32 = float(torch.tensor(low, dtype=ratio.dtype))
    hi32 = float(torch.tensor(high, dtype=ratio.dtype))
    num = den = 0.0
    for ri, ai, mi in zip(r, a, m, strict=True):
        if not mi:
            continue
        if ai > 0 and ri <= hi32:
            num += ai * ri
        elif ai < 0 and ri >= lo32:
            den += -ai * ri
    return num / den, den


def count_below(x: torch.Tensor, bound: float) -> int:
    return int((x < bound).sum())  # comparison in x's dtype, as the loss does


# ---------------------------------------------------------------------------------------
# Identity: FP8 == BF16 gives back the vanilla bounds exactly
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_identical_ratios_give_vanilla_bounds(rule, seed):
    _, shadow, adv, mask = synthetic(seed)
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", upper_rule=rule, ema=0.0)
    b = ctl.update(0, ratio=shadow.clone(), shadow_ratio=shadow, advantages=adv, mask=mask)
    assert b == Bounds(VL, VH)
    # the default EMA from the default (vanilla) init gives vanilla too
    ctl2 = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", upper_rule=rule)
    assert ctl2.update(0, ratio=shadow, shadow_ratio=shadow, advantages=adv, mask=mask) == Bounds(VL, VH)


@pytest.mark.parametrize("rule", RULES)
def test_identity_with_ties_and_values_on_the_bounds(rule):
    # ratios on a 0.01 grid: many ties, and some exactly at 0.8 and 1.28 (float32)
    g = torch.Generator().manual_seed(5)
    shadow = torch.round(torch.exp(torch.randn(64, 64, generator=g) * 0.15) * 100) / 100
    shadow[0, :8] = VL
    shadow[1, :8] = VH
    adv = torch.randn(64, 64, generator=g)
    mask = torch.ones(64, 64, dtype=torch.bool)
    cal = calibrate_bounds(shadow, shadow, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, upper_rule=rule)
    assert (cal.low, cal.high) == (VL, VH)


@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.3), (0.3, 0.25)])
def test_identity_for_other_epsilons_and_float64(eps):
    el, eh = eps
    _, shadow, adv, mask = synthetic(3, bf16_std=0.15)
    for x in (shadow, shadow.double()):
        for rule in RULES:
            cal = calibrate_bounds(x, x, adv, mask, eps_low=el, eps_high=eh, upper_rule=rule)
            assert (cal.low, cal.high) == (1 - el, 1 + eh), (rule, x.dtype)


# ---------------------------------------------------------------------------------------
# Lower bound: FP8 clips the same fraction of A<0 tokens as BF16
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("noise", [0.03, 0.1, 0.3])
def test_lower_bound_matches_alpha_within_one_token(seed, noise):
    fp8, shadow, adv, mask = synthetic(seed, noise=noise)
    cal = calibrate_bounds(fp8, shadow, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, upper_rule="fixed", low_min=0.05)
    adv_tok = adv[:, None].expand_as(fp8)
    neg = mask & (adv_tok < 0)
    n = int(neg.sum())
    k = count_below(shadow[neg], VL)
    assert cal.alpha == k / n
    assert abs(count_below(fp8[neg], cal.low) - k) <= 1
    assert cal.alpha_achieved == count_below(fp8[neg], cal.low) / n
    # the same through the loss's own clip table: FP8 with L clips what BF16 with vanilla clips
    fp8_cells = clip_table(fp8, adv_tok, mask, low=cal.low, high=VH)
    bf16_cells = clip_table(shadow, adv_tok, mask, low=VL, high=VH)
    assert abs(float(fp8_cells["actor/clipfrac_neg_low"]) - float(bf16_cells["actor/clipfrac_neg_low"])) <= 1 / n + 1e-7
    # more noise -> lower L (FP8 ratios spread wider)
    if noise >= 0.1:
        assert cal.low < VL


def brute_lower(x: torch.Tensor, k: int, target: float) -> tuple[int, float]:
    """Scan candidate bounds: best achievable count (nearest k, smaller on tie), then nearest target."""
    vals = sorted(set(x.tolist()))
    cands = {target}
    for v in vals:
        cands.add(v)
        cands.add(float(torch.nextafter(torch.tensor(v, dtype=x.dtype), torch.tensor(math.inf, dtype=x.dtype))))
    scored = []
    for c in cands:
        cnt = count_below(x, c)
        scored.append((abs(cnt - k), cnt, abs(c - target), c))
    scored.sort()
    best = scored[0]
    return best[1], best[2]


@pytest.mark.parametrize("seed", range(6))
def test_lower_bound_against_brute_force_with_ties(seed):
    # the in_sample estimator's convention (clip exactly k of these tokens, nearest vanilla);
    # the default unbiased estimator targets new tokens and has its own reference below
    g = torch.Generator().manual_seed(seed)
    n = 30
    x = torch.randint(0, 12, (n,), generator=g).float() / 16 + 0.375  # heavy ties, exact in float32
    cap = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))  # largest float32 below 1
    adv = -torch.rand(n, generator=g) - 0.1
    mask = torch.ones(n, dtype=torch.bool)
    for k in range(n + 1):
        alpha = k / n
        cal = calibrate_bounds(
            x, None, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, upper_rule="fixed", alpha=alpha, low_min=0.01,
            lower_estimator="in_sample",
        )
        cnt, dist = brute_lower(x, k, VL)
        if cal.low < cap:  # not clamped
            assert count_below(x, cal.low) == cnt, k
            assert abs(cal.low - VL) == pytest.approx(dist, abs=0), k


# ---------------------------------------------------------------------------------------
# Upper bound: the contribution rule
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("noise", [0.03, 0.1, 0.2])
def test_contribution_rule_reproduces_bf16_p_within_one_token(seed, noise):
    # BF16 ratio spread 0.15: vanilla clips ~6% of A<0 tokens, and the target is reachable
    fp8, shadow, adv, mask = synthetic(seed, noise=noise, bf16_std=0.15)
    _check_contribution(fp8, shadow, adv, mask, reachable=True)


def test_contribution_rule_unreachable_target():
    # BF16 barely clips (spread 0.08): with FP8 noise the lower L unclips so many A<0 tokens
    # that even H = max ratio cannot restore the BF16 p (this seed)
    fp8, shadow, adv, mask = synthetic(3, noise=0.1)
    _check_contribution(fp8, shadow, adv, mask, reachable=False)


def _check_contribution(fp8, shadow, adv, mask, reachable):
    cal = calibrate_bounds(fp8, shadow, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, low_min=0.05, high_max=4.0)
    adv_tok = adv[:, None].expand_as(fp8)
    p_bf, _ = ref_p(shadow, adv_tok, mask, VL, VH)
    p_fp8, den_fp8 = ref_p(fp8, adv_tok, mask, cal.low, cal.high)
    p_max, _ = ref_p(fp8, adv_tok, mask, cal.low, 4.0)  # every A>0 token up to the clamp
    pos = mask & (adv_tok > 0)
    one_token = float((adv_tok[pos] * fp8[pos]).max())
    assert cal.p_target == pytest.approx(p_bf, rel=1e-6)  # float32 products, float64 sums
    assert cal.p_achieved == pytest.approx(p_fp8, rel=1e-6)
    assert (p_bf <= p_max) == reachable
    if reachable:
        assert abs(p_fp8 - p_bf) * den_fp8 <= one_token
        assert cal.high > VH and cal.low < VL  # both bounds move outwards under FP8 noise
    else:  # the largest achievable p; H = the largest A>0 ratio (nearest vanilla among those)
        assert p_fp8 == pytest.approx(p_max, rel=1e-12)
        assert cal.high == pytest.approx(float(fp8[pos].max()))
    assert 1.0 < cal.high <= 4.0


def brute_upper(r_pos, w_pos, target_sum, vanilla_high, high_max):
    """Scan every candidate H (each ratio, the number below it, 1+, the clamp, vanilla)."""
    dt = r_pos.dtype
    up = float(torch.nextafter(torch.tensor(1.0, dtype=dt), torch.tensor(2.0, dtype=dt)))
    cands = {up, high_max, vanilla_high}
    for v in r_pos.tolist():
        cands.add(v)
        cands.add(float(torch.nextafter(torch.tensor(v, dtype=dt), torch.tensor(-math.inf, dtype=dt))))
    cands = [c for c in cands if up <= c <= high_max]
    rows = []
    for h in cands:
        s = sum(w for r, w in zip(r_pos.tolist(), w_pos.double().tolist(), strict=True) if r <= float(torch.tensor(h, dtype=dt)))
        rows.append((abs(s - target_sum), abs(h - vanilla_high), h, s))
    best_err = min(r[0] for r in rows)
    best = [r for r in rows if r[0] <= best_err + 1e-12]
    return best_err, min(r[1] for r in best), best


@pytest.mark.parametrize("seed", range(8))
def test_contribution_solver_against_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    m = 25
    r = torch.round(torch.exp(torch.randn(m, generator=g) * 0.3) * 32) / 32  # ties, exact values
    w = torch.rand(m, generator=g) * r
    total = float(w.double().sum())
    for frac in [-0.1, 0.0, 0.2, 0.5, 0.77, 0.95, 1.0, 1.3]:
        target = frac * total
        for vh in (1.28, 1.1, 1.9):
            h, s = solve_upper_contribution(r, w, target, vanilla_high=vh, high_max=2.5)
            err, dist, _ = brute_upper(r, w, target, vh, 2.5)
            s_ref = float(w.double()[r <= h].sum())
            assert s == pytest.approx(s_ref, abs=1e-9)
            assert abs(s - target) == pytest.approx(err, abs=1e-9), (frac, vh)
            assert abs(h - vh) == pytest.approx(dist, abs=1e-12), (frac, vh)


def test_contribution_unreachable_targets_and_no_positive_tokens():
    r = torch.tensor([0.9, 1.05, 1.1, 1.5, 3.0])
    w = torch.ones(5)
    # target above everything reachable in (1, 2]: all tokens <= 2 unclipped; H nearest vanilla
    h, s = solve_upper_contribution(r, w, 100.0, vanilla_high=1.28, high_max=2.0)
    assert s == 4.0 and h == pytest.approx(1.5)
    # target below what r <= 1 already contributes: H just above 1 (the smallest step)
    h, s = solve_upper_contribution(r, w, 0.0, vanilla_high=1.28, high_max=2.0)
    assert s == 1.0 and 1.0 < h < 1.05
    # no A>0 tokens at all: any H gives p = 0, so H stays vanilla
    fp8, shadow, adv, mask = synthetic(0)
    adv = -adv.abs() - 0.01
    cal = calibrate_bounds(fp8, shadow, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, low_min=0.05)
    assert cal.high == VH and cal.p_target == 0.0


def test_proportional_and_fixed_rules_formulas():
    fp8, shadow, adv, mask = synthetic(7, noise=0.2)
    prop = calibrate_bounds(fp8, shadow, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, upper_rule="proportional", low_min=0.05, high_max=5)
    assert prop.high == pytest.approx(1 + (1 - prop.low) * EPS_HIGH / EPS_LOW, rel=1e-12)
    fixed = calibrate_bounds(fp8, shadow, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, upper_rule="fixed", low_min=0.05)
    assert fixed.high == VH and fixed.low == prop.low
    assert set(UPPER_RULES.names()) == set(RULES)


def test_token_and_sequence_advantages_agree():
    fp8, shadow, adv, mask = synthetic(4)
    a = calibrate_bounds(fp8, shadow, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    b = calibrate_bounds(fp8, shadow, adv[:, None].expand_as(fp8).clone(), mask.float(), eps_low=EPS_LOW, eps_high=EPS_HIGH)
    assert a == b


def test_shadow_q01_matches_numpy_and_diagnostics():
    fp8, shadow, adv, mask = synthetic(2, bf16_std=0.2)
    adv_tok = adv[:, None].expand_as(fp8)
    neg = mask & (adv_tok < 0)
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic")
    ctl.update(0, ratio=fp8, shadow_ratio=shadow, advantages=adv, mask=mask)
    q = ctl.metrics(0)["shadow/ratio_neg_q01"]
    assert q == pytest.approx(float(np.quantile(shadow[neg].double().numpy(), 0.01)), rel=1e-6)
    assert q == pytest.approx(float(masked_quantiles(shadow, neg, [0.01])[0]), rel=1e-6)
    # q01 above the vanilla bound (little BF16 clipping) takes the full-selection path
    _, s2, _, _ = synthetic(2, bf16_std=0.01)
    ctl2 = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic")
    ctl2.update(0, ratio=s2, shadow_ratio=s2, advantages=adv, mask=mask)
    assert ctl2.metrics()["shadow/ratio_neg_q01"] == pytest.approx(float(np.quantile(s2[neg].double().numpy(), 0.01)), rel=1e-6)


# ---------------------------------------------------------------------------------------
# Schedule, EMA, init bounds, static reference, clamps
# ---------------------------------------------------------------------------------------


def staged_batch():
    """10 A<0 tokens: BF16 clips 2 (alpha = 0.2), the two lowest FP8 ratios (p1 = 1, p2 = 0).

    The unbiased L sits at plotting position k + p1 / (1 + p1 - p2) = 2.5: halfway between
    s_2 = 0.5625 and s_3 = 0.625, L = 0.59375 (the in-sample estimator took s_3 = 0.625).
    """
    fp8 = torch.tensor([[0.5, 0.5625, 0.625, 0.6875, 0.75, 0.875, 0.9375, 1.0, 1.0625, 1.125]])
    shadow = torch.tensor([[0.7, 0.75, 0.85, 0.9, 0.95, 1.0, 1.0, 1.05, 1.1, 1.1]])
    adv = -torch.ones(1, 10)
    mask = torch.ones(1, 10, dtype=torch.bool)
    return {"ratio": fp8, "shadow_ratio": shadow, "advantages": adv, "mask": mask}


def test_period_schedule():
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", period=3)
    assert [ctl.is_calibration_step(s) for s in range(10)] == [True, False, False, True, False, False, True, False, False, True]
    late = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", period=3, calibrate_at_start=False)
    assert [late.is_calibration_step(s) for s in range(7)] == [False, False, False, True, False, False, True]
    static = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", period=3, reference="static", alpha=0.1, upper_rule="fixed")
    assert not any(static.needs_shadow(s) for s in range(7)) and static.is_calibration_step(3)
    assert [ctl.needs_shadow(s) for s in range(4)] == [True, False, False, True]
    with pytest.raises(ValueError, match="not a calibration step"):
        ctl.update(1, **staged_batch())
    ctl.update(0, **staged_batch())
    with pytest.raises(ValueError, match="steps must increase"):
        ctl.update(0, **staged_batch())
    with pytest.raises(ValueError, match="step must be an integer"):
        ctl.bounds(-1)


def test_ema_sequence_from_wide_init_bounds():
    # raw bounds each calibration: L = 0.59375 (staged_batch), H = 1.28 (fixed rule)
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", period=20, ema=0.5, upper_rule="fixed", init_bounds=(0.6, 1.8))
    seen = []
    for step in range(61):
        if step in (0, 1, 19):
            pass
        if ctl.is_calibration_step(step):
            ctl.update(step, **staged_batch())
        seen.append(ctl.bounds(step).as_tuple())
    # new = prev + (1 - ema) (raw - prev), starting from init_bounds at step 0
    assert seen[0] == pytest.approx((0.596875, 1.54))
    assert seen[19] == seen[0]
    assert seen[20] == pytest.approx((0.5953125, 1.41))
    assert seen[40] == pytest.approx((0.59453125, 1.345))
    assert seen[60] == pytest.approx((0.594140625, 1.3125))
    m = ctl.metrics(60)
    assert m["clip/low_raw"] == 0.59375 and m["clip/high_raw"] == VH and m["clip/calibrations"] == 4
    assert "shadow/clipfrac_neg_low" not in ctl.metrics(61) and ctl.metrics(61)["clip/alpha"] == 0.2


def test_no_smoothing_and_init_bounds_before_first_calibration():
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", period=5, ema=0.0, upper_rule="fixed", init_bounds=Bounds(0.6, 1.8), calibrate_at_start=False)
    for step in range(5):
        assert ctl.bounds(step) == Bounds(0.6, 1.8)
        assert not ctl.is_calibration_step(step)
    assert "clip/alpha" not in ctl.metrics()
    assert ctl.update(5, **staged_batch()) == Bounds(0.59375, VH)
    assert ctl.bounds(7) == Bounds(0.59375, VH)
    m = ctl.metrics(5)
    assert m["clip/alpha"] == m["shadow/clipfrac_neg_low"] == 0.2
    assert m["clip/alpha_achieved"] == 0.2


def test_static_reference():
    batch = staged_batch()
    batch.pop("shadow_ratio")
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", ema=0.0, reference="static", alpha=0.2, upper_rule="proportional")
    b = ctl.update(0, **batch)
    # static: plotting position alpha (n + 1) = 2.2, between s_2 = 0.5625 and s_3 = 0.625
    # (the in-sample estimator took s_3)
    assert b.low == pytest.approx(0.575, abs=1e-15) and b.high == pytest.approx(VH + (VL - b.low) * EPS_HIGH / EPS_LOW)
    m = ctl.metrics(0)
    assert m["clip/alpha"] == 0.2 and "shadow/clipfrac_neg_low" not in m
    # static + contribution: p_target given from outside, reproduced within one token
    fp8, _, adv, mask = synthetic(1)
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", ema=0.0, reference="static", alpha=0.05, p_target=1.1, low_min=0.05, high_max=4.0)
    b = ctl.update(0, ratio=fp8, advantages=adv, mask=mask)
    adv_tok = adv[:, None].expand_as(fp8)
    p, den = ref_p(fp8, adv_tok, mask, b.low, b.high)
    pos = mask & (adv_tok > 0)
    assert abs(p - 1.1) * den <= float((adv_tok[pos] * fp8[pos]).max())
    neg = mask & (adv_tok < 0)
    assert abs(count_below(fp8[neg], b.low) - round(0.05 * int(neg.sum()))) <= 1


def test_clamps():
    batch = staged_batch()
    batch["ratio"] = batch["ratio"] * 0.5  # the unbiased L is now 0.296875 (position 2.5)
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", ema=0.0, upper_rule="proportional", low_min=0.5, high_max=1.5)
    b = ctl.update(0, **batch)
    assert b == Bounds(0.5, 1.5)  # proportional H = 1.28 + 0.3 * 1.4 = 1.7 > 1.5
    wide = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", ema=0.0, upper_rule="proportional", low_min=0.1, high_max=3.0)
    b = wide.update(0, **batch)
    assert b.low == 0.296875 and b.high == pytest.approx(VH + (VL - 0.296875) * 1.4)
    # alpha near 1: the quantile lands above 1, clamped below 1
    up = staged_batch()
    up["shadow_ratio"] = torch.full((1, 10), 0.5)
    up["shadow_ratio"][0, -1] = 0.9
    b = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", ema=0.0, upper_rule="fixed").update(0, **up)
    # k = 9: position 9.5, between 1.0625 and 1.125, above 1: L is clamped to the float32 below 1
    assert b.low == float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))


# ---------------------------------------------------------------------------------------
# Degenerate input keeps the bounds and is counted; caller bugs raise
# ---------------------------------------------------------------------------------------


def _degenerate_batches():
    fp8, shadow, adv, mask = synthetic(0)
    yield "no A<0", dict(ratio=fp8, shadow_ratio=shadow, advantages=adv.abs() + 0.1, mask=mask)
    yield "all masked", dict(ratio=fp8, shadow_ratio=shadow, advantages=adv, mask=torch.zeros_like(mask))
    for name, bad in (("nan", math.nan), ("inf", math.inf), ("zero", 0.0)):
        r = fp8.clone()
        r[adv < 0, 3] = bad
        yield f"fp8 {name}", dict(ratio=r, shadow_ratio=shadow, advantages=adv, mask=torch.ones_like(mask))
        s = shadow.clone()
        s[adv < 0, 5] = bad
        yield f"shadow {name}", dict(ratio=fp8, shadow_ratio=s, advantages=adv, mask=torch.ones_like(mask))
    a = adv.clone()
    a[0] = math.nan
    yield "nan advantage", dict(ratio=fp8, shadow_ratio=shadow, advantages=a, mask=mask)
    r = fp8.clone()
    r[adv > 0, 2] = math.nan
    yield "nan on A>0 (contribution)", dict(ratio=r, shadow_ratio=shadow, advantages=adv, mask=torch.ones_like(mask))
    # every A<0 BF16 ratio clipped: the BF16 p is undefined for the contribution rule
    yield "p undefined", dict(ratio=fp8, shadow_ratio=torch.full_like(shadow, 0.5), advantages=adv, mask=mask)


def test_degenerate_input_keeps_bounds_and_counts():
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", period=1, ema=0.0, init_bounds=(0.7, 1.5))
    fp8, shadow, adv, mask = synthetic(9, noise=0.2)
    good = ctl.update(0, ratio=fp8, shadow_ratio=shadow, advantages=adv, mask=mask)
    assert good != Bounds(0.7, 1.5)
    n_bad = 0
    for step, (name, batch) in enumerate(_degenerate_batches(), start=1):
        assert ctl.update(step, **batch) == good, name
        n_bad += 1
        m = ctl.metrics(step)
        assert m["clip/degenerate_updates"] == n_bad, name
        assert (m["clip/low"], m["clip/high"]) == good.as_tuple()
        assert "shadow/clipfrac_neg_low" not in m  # nothing was measured on this step
    assert ctl.metrics()["clip/calibrations"] == 1


def test_non_finite_values_at_masked_positions_are_ignored():
    fp8, shadow, adv, mask = synthetic(1)
    clean = calibrate_bounds(fp8, shadow, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    r, s = fp8.clone(), shadow.clone()
    r[~mask] = math.nan
    s[~mask] = math.inf
    assert calibrate_bounds(r, s, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH) == clean


def test_caller_bugs_raise():
    fp8, shadow, adv, mask = synthetic(0)
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", period=1)
    with pytest.raises(ValueError, match="shadow_ratio has shape"):
        ctl.update(0, ratio=fp8, shadow_ratio=shadow[:, :-1], advantages=adv, mask=mask)
    with pytest.raises(ValueError, match="mask has shape"):
        ctl.update(1, ratio=fp8, shadow_ratio=shadow, advantages=adv, mask=mask[:-1])
    with pytest.raises(ValueError, match="advantages has shape"):
        ctl.update(2, ratio=fp8, shadow_ratio=shadow, advantages=adv[:-1], mask=mask)
    with pytest.raises(ValueError, match="needs shadow_ratio"):
        ctl.update(3, ratio=fp8, advantages=adv, mask=mask)
    with pytest.raises(TypeError):
        ctl.update(4, ratio=fp8.numpy(), shadow_ratio=shadow, advantages=adv, mask=mask)
    assert ctl.metrics()["clip/degenerate_updates"] == 0


# ---------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------


def _run(ctl, steps, seed0=100):
    out = []
    for step in steps:
        if ctl.is_calibration_step(step):
            fp8, shadow, adv, mask = synthetic(seed0 + step, B=16, T=32, noise=0.15)
            ctl.update(step, ratio=fp8, shadow_ratio=shadow, advantages=adv, mask=mask)
        out.append((ctl.bounds(step), ctl.metrics(step)))
    return out


def test_state_dict_round_trip_resumes_identically():
    kw = dict(period=4, ema=0.3, init_bounds=(0.6, 1.8))
    ref = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", **kw)
    full = _run(ref, range(30))
    a = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", **kw)
    _run(a, range(13))
    state = json.loads(json.dumps(a.state_dict()))  # checkpoints may go through JSON
    b = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", **kw)
    b.load_state_dict(state)
    assert repr(b.metrics()) == repr(a.metrics())  # repr: NaN rates compare equal
    assert repr(_run(b, range(13, 30))) == repr(full[13:])
    other = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", period=5)
    with pytest.raises(ValueError, match="period"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict({**state, "version": 99})


# ---------------------------------------------------------------------------------------
# Configuration errors
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(eps_low=0.0), "eps_low"),
        (dict(eps_low=-0.1), "eps_low"),
        (dict(eps_low=1.0), "eps_low"),
        (dict(eps_high=0.0), "eps_high"),
        (dict(eps_high=math.inf), "eps_high"),
        (dict(period=0), "period"),
        (dict(period=2.5), "period"),
        (dict(ema=1.0), "ema"),
        (dict(ema=-0.1), "ema"),
        (dict(upper_rule="median"), "valid names are: contribution, fixed, proportional"),
        (dict(reference="bf16"), "valid values are: shadow, static"),
        (dict(reference="static"), "needs alpha"),
        (dict(reference="static", alpha=1.2, upper_rule="fixed"), "alpha"),
        (dict(reference="static", alpha=0.1), "needs p_target"),
        (dict(reference="static", alpha=0.1, upper_rule="fixed", p_target=1.0), "p_target is only used"),
        (dict(alpha=0.1), "only used with reference='static'"),
        (dict(init_bounds=(1.2, 1.8)), "0 < low < 1 < high"),
        (dict(init_bounds=(0.6,)), "init_bounds"),
        (dict(init_bounds=(0.4, 1.8)), "inside the clamps"),
        (dict(low_min=1.0), "low_min"),
        (dict(low_min=0.0), "low_min"),
        (dict(high_max=1.0), "high_max"),
        (dict(high_max=1.2), "vanilla bounds"),
        (dict(low_min=0.85), "vanilla bounds"),
        (dict(calibrate_at_start="yes"), "calibrate_at_start"),
    ],
)
def test_bad_config_raises(kwargs, match):
    args = {"eps_low": EPS_LOW, "eps_high": EPS_HIGH}
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises((ValueError, TypeError, KeyError), match=match):
        CalibratedClipController(args["eps_low"], args["eps_high"], **{"mode": "periodic", **kwargs})


@pytest.mark.parametrize("pair", [(0.0, 1.2), (0.8, 1.0), (math.nan, 1.2), (0.8, math.inf), (1.1, 1.2)])
def test_bounds_validation(pair):
    with pytest.raises(ValueError):
        Bounds(*pair)


# ---------------------------------------------------------------------------------------
# Beyond torch.quantile's 2**24-element limit
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_more_than_16m_tokens():
    g = torch.Generator().manual_seed(0)
    B, T = 4100, 4096  # 16.8M tokens > 2**24
    shadow = torch.exp(torch.randn(B, T, generator=g) * 0.08)
    fp8 = shadow * torch.exp(torch.randn(B, T, generator=g) * 0.1)
    adv = torch.randn(B, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", ema=0.0)
    b = ctl.update(0, ratio=fp8, shadow_ratio=shadow, advantages=adv, mask=mask)
    neg = (adv < 0)[:, None].expand(B, T)
    k = count_below(shadow[neg], VL)
    assert abs(count_below(fp8[neg], b.low) - k) <= 1
    assert ctl.metrics()["clip/degenerate_updates"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rule", RULES)
def test_cuda_matches_cpu(rule):
    fp8, shadow, adv, mask = synthetic(6, noise=0.15, bf16_std=0.15)
    kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, upper_rule=rule, low_min=0.05, high_max=4.0)
    cpu = calibrate_bounds(fp8, shadow, adv, mask, **kw)
    gpu = calibrate_bounds(fp8.cuda(), shadow.cuda(), adv.cuda(), mask.cuda(), **kw)
    assert (gpu.low, gpu.high, gpu.alpha) == (cpu.low, cpu.high, cpu.alpha)
    assert gpu.p_achieved == pytest.approx(cpu.p_achieved, rel=1e-9, nan_ok=True)


def _flat_tokens(r, s, adv, mask):
    m = mask.bool()
    a = adv[:, None].expand_as(r) if adv.dim() == 1 else adv
    return r[m], s[m], a[m]


def test_window_pools_the_tokens_of_the_last_calibrations():
    """With window W the estimate equals one calibration on the concatenated tokens of the
    last W calibrations (reference: calibrate_bounds on the concatenation)."""
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", period=1, ema=0.0, window=2)
    batches = [synthetic(seed, B=8, T=24) for seed in range(3)]
    for step, (s, r, adv, mask) in enumerate(batches):
        ctl.update(step, ratio=r, shadow_ratio=s, advantages=adv, mask=mask)
        used = batches[max(0, step - 1): step + 1]
        toks = [_flat_tokens(r_, s_, a_, m_) for s_, r_, a_, m_ in used]
        ref = calibrate_bounds(torch.cat([t[0] for t in toks]), torch.cat([t[1] for t in toks]),
                               torch.cat([t[2] for t in toks]), torch.ones(sum(t[0].numel() for t in toks)),
                               eps_low=EPS_LOW, eps_high=EPS_HIGH)
        assert ctl.bounds(step).as_tuple() == (ref.low, ref.high)
        m = ctl.metrics(step)
        assert m["clip/n_neg"] == ref.n_neg and m["clip/pooled_calibrations"] == len(used)
        assert m["clip/low_data"] == float(ref.alpha * ref.n_neg < 5)


def test_window_state_round_trip_continues_exactly():
    batches = [synthetic(seed, B=8, T=24) for seed in range(5)]
    a = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", period=1, window=3)
    for step, (s, r, adv, mask) in enumerate(batches[:3]):
        a.update(step, ratio=r, shadow_ratio=s, advantages=adv, mask=mask)
    b = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", period=1, window=3)
    state = a.state_dict()
    assert len(state["pool"]) == 2
    b.load_state_dict(state)
    for step, (s, r, adv, mask) in enumerate(batches[3:], start=3):
        assert a.update(step, ratio=r, shadow_ratio=s, advantages=adv, mask=mask) == \
            b.update(step, ratio=r, shadow_ratio=s, advantages=adv, mask=mask)
    with pytest.raises(ValueError, match="window"):
        CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", period=1, window=2).load_state_dict(a.state_dict())
    json.dumps(CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic").state_dict())  # window 1: plain JSON


def test_degenerate_calibration_adds_nothing_to_the_window():
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", period=1, ema=0.0, window=2)
    s, r, adv, mask = synthetic(0, B=8, T=24)
    ctl.update(0, ratio=r, shadow_ratio=s, advantages=adv, mask=mask)
    before = ctl.bounds(0)
    bad = r.clone()
    bad[mask.bool()] = float("nan")  # a broken measurement poisons the pooled estimate
    assert ctl.update(1, ratio=bad, shadow_ratio=s, advantages=adv, mask=mask) == before
    assert ctl.metrics()["clip/degenerate_updates"] == 1.0 and len(ctl.state_dict()["pool"]) == 1
    # an empty measurement: the window's earlier tokens still calibrate
    ctl.update(2, ratio=r, shadow_ratio=s, advantages=adv, mask=torch.zeros_like(mask))
    assert ctl.metrics(2)["clip/pooled_calibrations"] == 2.0 and ctl.metrics()["clip/degenerate_updates"] == 1.0
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        CalibratedClipController(EPS_LOW, EPS_HIGH, mode="periodic", window=0)
