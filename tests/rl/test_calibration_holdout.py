"""The held-out rows (issue 46): one definition of "tokens the bound never saw" for every arm.

A seeded share of each step's sequences is shadowed, never measured, and scored against the
bounds in force on it (``shadow/ho_*``). References: the counts are recomputed here from the
tokens with the bounds the plan applied; the held-out rows' tokens must not move the estimate
(planted bug: held-out rows left in ``measured`` fails ``test_held_out_rows_never_feed_the_estimate``).
"""

from __future__ import annotations

import pytest
import torch

from fp8rl.rl.calibration import CalibratedClipController, CalibrationOptions
from fp8rl.rl.calibration.heldout import HOLDOUT_KEYS
from fp8rl.rl.calibration.sampling import draw_holdout, draw_subset
from fp8rl.rl.clipping import make_clipper

EPS_LOW, EPS_HIGH = 0.2, 0.28
B, T = 32, 12


def tokens(seed: int):
    g = torch.Generator().manual_seed(seed)
    shadow = torch.exp(0.05 * torch.randn(B, T, generator=g))
    fp8 = shadow * torch.exp(0.08 * torch.randn(B, T, generator=g))
    adv = torch.where(torch.rand(B, generator=g) < 0.5, -1.0, 1.0)[:, None].expand(B, T).clone()
    return fp8, shadow, adv, torch.ones(B, T)


def same_batch() -> CalibratedClipController:
    return CalibratedClipController(EPS_LOW, EPS_HIGH, CalibrationOptions(mode="same_batch"), seed=3)


def run_step(ctl, data, *, share: float, seed: int = 3, extreme_holdout: bool = False):
    """One step, one window over all rows, observed as a backend does; returns (plan, after, metrics)."""
    fp8, shadow, adv, mask = (t.clone() for t in data)
    plan = ctl.begin_step(0, eligible=torch.ones(B, dtype=torch.bool), holdout_share=share, seed=seed)
    if extreme_holdout:  # held-out rows whose FP8 ratios would drag any estimate they fed
        fp8[plan.holdout] = 0.3
    rows = torch.arange(B)
    w = plan.window(rows)
    m = w.measured
    after = w.calibrate(fp8[m], shadow[m], adv[m], mask[m], seq=rows[m])
    used_after = True
    keep = w.shadowed & ~w.holdout
    if bool(keep.any()):
        w.observe(fp8[keep], shadow[keep], adv[keep], mask[keep], after=used_after)
    h = w.holdout
    if bool(h.any()):
        w.observe(fp8[h], shadow[h], adv[h], mask[h], after=used_after, holdout=True)
    return plan, after, plan.finish(), (fp8, shadow, adv, mask)


def test_every_arm_of_a_seed_holds_out_the_same_rows():
    eligible = torch.rand(64, generator=torch.Generator().manual_seed(0)) < 0.8
    a = make_clipper("vanilla", EPS_LOW, EPS_HIGH).begin_step(5, eligible=eligible, holdout_share=0.125, seed=7)
    b = same_batch().begin_step(5, eligible=eligible, holdout_share=0.125, seed=7)
    assert torch.equal(a.holdout, b.holdout) and int(a.holdout.sum()) == round(0.125 * int(eligible.sum()))
    assert not bool((a.holdout & ~eligible).any())
    assert not torch.equal(a.holdout, draw_subset(eligible, 0.125, seed=7, step=5))  # its own stream
    assert not bool(draw_holdout(eligible, 0.0, seed=7, step=5).any())
    assert bool(a.shadowed[a.holdout].all()) and not bool(b.measured[b.holdout].any())
    with pytest.raises(ValueError, match="held-out share"):
        draw_holdout(eligible, 1.0, seed=7, step=5)


def test_held_out_rows_never_feed_the_estimate():
    data = tokens(1)
    _, after, _, _ = run_step(same_batch(), data, share=0.25)
    _, after_extreme, _, _ = run_step(same_batch(), data, share=0.25, extreme_holdout=True)
    assert after == after_extreme


def test_held_out_counts_use_the_bounds_in_force_and_are_out_of_sample():
    plan, after, out, (fp8, shadow, adv, mask) = run_step(same_batch(), tokens(2), share=0.25)
    h = plan.holdout
    neg = (adv[h] < 0) & (mask[h] != 0)
    want = (int(neg.sum()), int((neg & (fp8[h] < after.low)).sum()), int((neg & (shadow[h] < 1 - EPS_LOW)).sum()))
    assert tuple(out[k] for k in HOLDOUT_KEYS) == want
    # same_batch's own rows are in sample: only the held-out rows reach the out-of-sample tally
    assert out["shadow/oos_n_neg"] == want[0]


def test_vanilla_arm_scores_its_held_out_rows_against_the_vanilla_bounds():
    plan, after, out, (fp8, _, adv, _) = run_step(make_clipper("vanilla", EPS_LOW, EPS_HIGH), tokens(3),
                                                          share=0.25)
    h = plan.holdout
    neg = adv[h] < 0
    assert after.low == pytest.approx(1 - EPS_LOW)
    assert out["shadow/ho_fp8_low_n"] == int((neg & (fp8[h] < 1 - EPS_LOW)).sum())


def test_without_a_share_nothing_is_held_out():
    _, _, out, _ = run_step(same_batch(), tokens(4), share=0.0)
    assert not any(k in out for k in HOLDOUT_KEYS)


def test_the_counts_are_summed_over_ranks():
    # a second plan on the same data, finished with a reduce that doubles (two identical ranks)
    ctl = same_batch()
    p2 = ctl.begin_step(0, eligible=torch.ones(B, dtype=torch.bool), holdout_share=0.25, seed=3)
    fp8, shadow, adv, mask = tokens(5)
    w = p2.window(torch.arange(B))
    m = w.measured
    w.calibrate(fp8[m], shadow[m], adv[m], mask[m], seq=torch.arange(B)[m])
    h = w.holdout
    w.observe(fp8[h], shadow[h], adv[h], mask[h], after=True, holdout=True)
    single = p2.heldout.ho.clone()
    out = p2.finish(reduce_sum=lambda t: 2 * t)
    assert tuple(out[k] for k in HOLDOUT_KEYS) == tuple(float(2 * x) for x in single.tolist())


@pytest.mark.parametrize("bad", [1.0, -0.1, True, "x"])
def test_clip_holdout_share_is_checked_in_the_config(bad):
    from fp8rl.config.clip import ClipConfig

    assert ClipConfig(holdout_share=0.125).holdout_share == 0.125
    with pytest.raises(ValueError, match=r"clip.holdout_share is a share .* in \[0, 1\)"):
        ClipConfig(holdout_share=bad)
