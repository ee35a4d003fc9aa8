"""The ``sampled`` calibration mode: the draw, the design effect, the share rule, which bounds rule
which tokens, pooling, checkpoints, and the held-out counts (against direct recomputations)."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl.rl.calibration import (
    Bounds,
    CalibratedClipController,
    CalibrationOptions,
    calibrate_bounds,
)
from fp8rl.rl.calibration.heldout import cross_fit_counts, low_counts, xfit_folds
from fp8rl.rl.calibration.sampling import (
    WindowStats,
    choose_share,
    design_effect,
    draw_subset,
    window_stats,
)
from fp8rl.runs import metrics as M

EPS_LOW, EPS_HIGH = 0.2, 0.28
V = Bounds(1 - EPS_LOW, 1 + EPS_HIGH)


def window(seed: int, B: int = 24, T: int = 30, noise: float = 0.15, drift: float = 0.12):
    g = torch.Generator().manual_seed(seed)
    shadow = torch.exp(torch.randn(B, T, generator=g) * drift)
    fp8 = shadow * torch.exp(torch.randn(B, T, generator=g) * noise)
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    mask = torch.rand(B, T, generator=g) > 0.2
    return fp8, shadow, adv, mask


# ----- the draw ----------------------------------------------------------------------------


def test_draw_is_seeded_redrawn_each_step_and_only_eligible():
    eligible = torch.ones(64, dtype=torch.bool)
    eligible[::5] = False
    a = draw_subset(eligible, 0.25, seed=7, step=3)
    assert torch.equal(a, draw_subset(eligible, 0.25, seed=7, step=3))  # a resume draws the same
    assert int(a.sum()) == round(0.25 * int(eligible.sum())) and not bool((a & ~eligible).any())
    steps = [draw_subset(eligible, 0.25, seed=7, step=s) for s in range(6)]
    assert len({tuple(x.tolist()) for x in steps}) == 6  # re-drawn every step
    assert not torch.equal(a, draw_subset(eligible, 0.25, seed=8, step=3))  # the run's seed matters
    assert not torch.equal(a, draw_subset(eligible, 0.25, seed=7, step=3, rank=1))  # ranks draw their own
    # uniform: every eligible sequence is drawn about equally often
    freq = torch.stack([draw_subset(eligible, 0.25, seed=1, step=s) for s in range(2000)]).float().mean(0)
    assert float(freq[eligible].min()) > 0.21 and float(freq[eligible].max()) < 0.29


def test_draw_edges_and_bad_input():
    assert int(draw_subset(torch.zeros(5, dtype=torch.bool), 0.5, seed=0, step=0).sum()) == 0
    assert int(draw_subset(torch.tensor([True, False, False]), 0.01, seed=0, step=0).sum()) == 1  # at least one
    with pytest.raises(ValueError, match="share"):
        draw_subset(torch.ones(3, dtype=torch.bool), 0.0, seed=0, step=0)
    with pytest.raises(ValueError, match="1-D bool"):
        draw_subset(torch.ones(3, 2, dtype=torch.bool), 0.5, seed=0, step=0)


# ----- the design effect -------------------------------------------------------------------


def _deff_slow(clusters: list[list[int]]) -> float:
    """Kish's design effect of the pooled proportion, cluster by cluster (the formula, a loop)."""
    n = sum(len(c) for c in clusters)
    k = sum(sum(c) for c in clusters)
    p = k / n
    c = len(clusters)
    v_cl = c / (c - 1) * sum((sum(x) - p * len(x)) ** 2 for x in clusters) / n ** 2
    return min(max(v_cl / (p * (1 - p) / n), 1.0), max(len(x) for x in clusters))


def test_design_effect_matches_the_formula_and_its_limits():
    g = torch.Generator().manual_seed(0)
    clusters = [[int(v) for v in (torch.rand(int(torch.randint(3, 12, (1,), generator=g)), generator=g) < 0.2)]
                for _ in range(40)]
    seq = torch.cat([torch.full((len(c),), i) for i, c in enumerate(clusters)])
    y = torch.cat([torch.tensor(c) for c in clusters]).bool()
    shadow = torch.where(y, torch.tensor(0.5), torch.tensor(1.0))
    adv = -torch.ones_like(shadow)
    half = len(clusters) // 2
    cut = sum(len(c) for c in clusters[:half])
    stats = [window_stats(shadow[:cut], adv[:cut], seq[:cut], vanilla_low=0.8, share=0.5),
             window_stats(shadow[cut:], adv[cut:], seq[cut:], vanilla_low=0.8, share=0.5)]
    assert design_effect(stats) == pytest.approx(_deff_slow(clusters), rel=1e-12)
    # perfectly correlated sequences (all or nothing): deff = the cluster size
    whole = [[1] * 6 if i % 4 == 0 else [0] * 6 for i in range(40)]
    s = torch.tensor([0.5 if v else 1.0 for c in whole for v in c])
    q = torch.cat([torch.full((6,), i) for i in range(40)])
    assert design_effect([window_stats(s, -torch.ones_like(s), q, vanilla_low=0.8, share=1.0)]) == pytest.approx(6.0)
    assert design_effect([WindowStats(10, 0, 3, 0, 0, 30, 4, 1.0)]) == 1.0  # no clipped token: undefined -> 1


# ----- the share rule ----------------------------------------------------------------------


def _stats(n, k, share, clusters=100.0):
    m = n / clusters
    p = k / n
    # independent tokens within clusters: sum of (y - p m)^2 ~ c * m p (1 - p)
    return WindowStats(n=n, k=k, clusters=clusters, sum_y2=k * (1 + (m - 1) * p), sum_ym=k * m,
                       sum_m2=clusters * m * m, max_m=m, share=share)


def test_share_rule_takes_the_smallest_share_and_pool_that_reach_the_target():
    first = choose_share([], target=5, share_min=1 / 64, share_max=0.125, pool_max=8)
    assert (first.share, first.pool, first.low_data) == (0.125, 1, True)  # nothing measured yet: the ceiling
    # plenty of data: one window at a share below the ceiling
    rich = [_stats(n=2000, k=20, share=0.1)] * 4  # alpha ~ 1%, 20,000 A<0 tokens per window
    c = choose_share(rich, target=5, share_min=1 / 64, share_max=0.125, pool_max=8)
    assert c.pool == 1 and 1 / 64 <= c.share < 0.125 and not c.low_data
    assert c.alpha * c.share * c.window_tokens / c.deff == pytest.approx(5, rel=1e-6)  # exactly the target
    # scarce data: the ceiling share and more windows
    poor = [_stats(n=200, k=1, share=0.125)] * 4  # 1,600 A<0 tokens per window, alpha ~ 0.75%
    c = choose_share(poor, target=5, share_min=1 / 64, share_max=0.125, pool_max=8)
    assert c.pool > 1 and c.share <= 0.125 and c.expected >= 5 * (1 - 1e-9) and not c.low_data
    # mini scale: not enough even at the maximum -> both at their maximum, flagged
    mini = [_stats(n=50, k=0, share=0.125)] * 8
    c = choose_share(mini, target=5, share_min=1 / 64, share_max=0.125, pool_max=8)
    assert (c.share, c.pool, c.low_data) == (0.125, 8, True) and c.expected < 5
    fixed = choose_share(poor, target=5, share_min=1 / 64, share_max=0.125, pool_max=8, fixed_share=0.5)
    assert fixed.share == 0.5 and fixed.pool == math.ceil(fixed.needed / (0.5 * fixed.window_tokens)) == 2


# ----- the controller through the plan -----------------------------------------------------


def sampled(**kw) -> CalibratedClipController:
    return CalibratedClipController(EPS_LOW, EPS_HIGH, mode="sampled", init_bounds=(0.6, 1.8), low_min=0.05, seed=5,
                                    **kw)


def _run_window(plan, rows, fp8, shadow, adv, mask):
    w = plan.window(rows)
    m = w.measured
    after = w.calibrate(fp8[rows][m], shadow[rows][m], adv[rows][m], mask[rows][m], seq=rows[m])
    return w, after


def test_the_subset_is_ruled_by_the_bounds_in_force_and_its_estimate_rules_the_rest():
    ctl = sampled(sample_fraction=0.5, sample_pool=1)
    fp8, shadow, adv, mask = window(0, B=32)
    plan = ctl.begin_step(0, eligible=torch.ones(32, dtype=torch.bool))
    assert plan.measured.sum() == 16 and torch.equal(plan.shadowed, plan.measured)
    w0, a0 = _run_window(plan, torch.arange(16), fp8, shadow, adv, mask)
    assert torch.equal(w0.first, w0.measured)  # the measured rows' loss runs first...
    assert w0.before == Bounds(0.6, 1.8)  # ...under the bounds in force (the initial ones)
    m = w0.measured
    ref = calibrate_bounds(fp8[:16][m], shadow[:16][m], adv[:16][m], mask[:16][m], eps_low=EPS_LOW, eps_high=EPS_HIGH,
                           low_min=0.05, lower_estimator="unbiased")
    assert a0 == Bounds(ref.low, ref.high)  # the rest: the subset's unbiased estimate
    w1, a1 = _run_window(plan, torch.arange(16, 32), fp8, shadow, adv, mask)
    assert w1.before == a0  # the next window's subset: the previous window's bounds
    out = plan.finish()
    assert out["clip/sample_share"] == 0.5 and out["clip/sample_pool"] == 1.0
    assert out[M.CLIP_LOW] == pytest.approx((a0.low + a1.low) / 2)


def test_pooling_reads_the_last_windows_measured_tokens():
    from fp8rl.rl.calibration.sampling import ShareChoice

    ctl = sampled(sample_fraction=1.0, sample_pool=3)
    data = [window(s, B=8) for s in range(4)]
    plan = ctl.begin_step(0, eligible=torch.ones(32, dtype=torch.bool))
    ctl._choice = ShareChoice(1.0, 3, 0.01, 1.0, 100.0, 500.0, 1.0, True)  # the rule's pool: 3 windows
    flat = []
    for i, (fp8, shadow, adv, mask) in enumerate(data):
        rows = torch.arange(8 * i, 8 * i + 8)
        w = plan.window(rows)
        after = w.calibrate(fp8, shadow, adv, mask, seq=rows)
        flat.append((fp8[mask], shadow[mask], adv[mask]))
        parts = flat[-3:]
        ref = calibrate_bounds(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                               torch.cat([p[2] for p in parts]), torch.ones(sum(p[0].numel() for p in parts),
                                                                             dtype=torch.bool),
                               eps_low=EPS_LOW, eps_high=EPS_HIGH, low_min=0.05, lower_estimator="unbiased")
        assert after == Bounds(ref.low, ref.high), i


def test_a_resumed_controller_continues_exactly():
    def run(ctl, steps, start=0):
        out = []
        for step in range(start, start + steps):
            fp8, shadow, adv, mask = window(100 + step, B=32)
            plan = ctl.begin_step(step, eligible=torch.ones(32, dtype=torch.bool))
            for rows in torch.tensor_split(torch.arange(32), 4):
                out.append(_run_window(plan, rows, fp8, shadow, adv, mask)[1].as_tuple())
            plan.finish()
        return out

    a = sampled()
    whole = run(a, 4)
    b = sampled()
    first = run(b, 2)
    state = b.state_dict()
    c = sampled()
    c.load_state_dict(state)
    assert first + run(c, 2, start=2) == whole
    with pytest.raises(ValueError, match="different configuration"):
        sampled(sample_pool=4).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        CalibratedClipController(EPS_LOW, EPS_HIGH, mode="sampled", init_bounds=(0.6, 1.8), low_min=0.05,
                                 seed=6).load_state_dict(state)


def test_out_of_sample_counts_every_token_with_the_bounds_it_was_clipped_with():
    ctl = sampled(sample_fraction=0.25, sample_pool=1)
    fp8, shadow, adv, mask = window(3, B=32)
    plan = ctl.begin_step(0, eligible=torch.ones(32, dtype=torch.bool), diagnostics=True)
    assert bool(plan.shadowed.all())  # diagnostics: every row gets a shadow
    want = torch.zeros(3, dtype=torch.int64)
    for rows in torch.tensor_split(torch.arange(32), 2):
        w, after = _run_window(plan, rows, fp8, shadow, adv, mask)
        for sel, use_after in ((w.first, False), (~w.first, True)):
            idx = rows[sel]
            w.observe(fp8[idx], shadow[idx], adv[idx], mask[idx], after=use_after)
            b = after if use_after else w.before
            want += low_counts(fp8[idx], shadow[idx], adv[idx], mask[idx], low=b.low, vanilla_low=V.low)
    out = plan.finish()
    assert [out[M.SHADOW_OOS_N_NEG], out[M.SHADOW_OOS_FP8_LOW_N], out[M.SHADOW_OOS_BF16_LOW_N]] == \
        [float(x) for x in want]
    assert out[M.SHADOW_OOS_N_NEG] == float((mask & (adv < 0)).sum())  # every A<0 token is out of sample
    assert M.SHADOW_XFIT_N_NEG not in out


def test_same_batch_has_no_out_of_sample_tokens_and_is_cross_fitted():
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="same_batch", low_min=0.05)
    fp8, shadow, adv, mask = window(4, B=32)
    plan = ctl.begin_step(0, eligible=torch.ones(32, dtype=torch.bool))
    rows = torch.arange(32)
    w = plan.window(rows)
    assert w.prepass and not bool(w.first.any())
    w.calibrate(fp8, shadow, adv, mask, seq=rows)
    w.observe(fp8, shadow, adv, mask, after=True)
    out = plan.finish()
    assert M.SHADOW_OOS_N_NEG not in out  # its bounds rule only the tokens they come from
    # cross-fitting, recomputed by hand: each half against the in-sample estimate of the other half
    seq = rows[:, None].expand(fp8.shape)[mask]
    fold = xfit_folds(seq, 0)
    r, s, a = fp8[mask], shadow[mask], adv[mask]
    want = [0, 0, 0]
    for f in (False, True):
        tr, te = fold != f, fold == f
        b = calibrate_bounds(r[tr], s[tr], a[tr], torch.ones(int(tr.sum()), dtype=torch.bool), eps_low=EPS_LOW,
                             eps_high=EPS_HIGH, low_min=0.05, lower_estimator="in_sample")
        neg = te & (a < 0)
        want = [want[0] + int(neg.sum()), want[1] + int((neg & (r < b.low)).sum()),
                want[2] + int((neg & (s < V.low)).sum())]
    assert [out[M.SHADOW_XFIT_N_NEG], out[M.SHADOW_XFIT_FP8_LOW_N], out[M.SHADOW_XFIT_BF16_LOW_N]] == \
        [float(x) for x in want]
    assert 0 < want[0] < int((mask & (adv < 0)).sum()) + 1
    counts = cross_fit_counts(r, s, a, seq, step=0, vanilla_low=V.low, estimate=ctl.estimate_flat)
    assert counts.tolist() == want
    assert 0.3 < float((xfit_folds(torch.arange(1000), 3)).float().mean()) < 0.7  # two halves


# ----- options -----------------------------------------------------------------------------


def test_options_are_validated_once_with_clear_messages():
    o = CalibrationOptions(mode="sampled", sample_fraction=0.25)
    assert CalibrationOptions.from_dict(o.to_dict()) == o
    with pytest.raises(ValueError, match="sample_fraction is a share"):
        CalibrationOptions(mode="sampled", sample_fraction=1.5)
    with pytest.raises(ValueError, match="sample_min and sample_max"):
        CalibrationOptions(mode="sampled", sample_min=0.5, sample_max=0.25)
    with pytest.raises(ValueError, match=r"clip.sample_pool=4: only clip.calibration_mode=sampled uses"):
        CalibrationOptions.from_dict({"mode": "same_batch", "sample_pool": 4}, prefix="clip.")
    with pytest.raises(ValueError, match="reference='static' runs no shadow"):
        CalibrationOptions(mode="sampled", reference="static", alpha=0.01, upper_rule="fixed")
    with pytest.raises(TypeError, match="unknown calibration option"):
        CalibrationOptions.from_dict({"mode": "sampled", "sample_share": 0.5})
    with pytest.raises(TypeError, match="either as CalibrationOptions or as keywords"):
        CalibratedClipController(EPS_LOW, EPS_HIGH, o, mode="sampled")
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, o, seed=3)
    assert ctl.mode == "sampled" and ctl.sample_fraction == 0.25 and ctl.lower_estimator == "unbiased"
    assert math.isclose(ctl.options.sample_min, 1 / 64)
