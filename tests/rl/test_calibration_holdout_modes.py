"""Held-out rows in every calibration mode, at the plan level (issue 46 item 6).

``test_calibration_holdout`` checks ``same_batch``; here every mode, the step-level ones
(``windowed`` at a share below 1, ``pooled``, ``periodic``) included, is driven over several steps
as a backend drives the plan (each window hands ``calibrate`` the tokens of its ``measured`` rows).
References: the held-out rows are the vanilla arm's, drawn from the eligible rows whatever the
mode (``sampling.draw_holdout``), and the bounds and logged counts of every step are those of the
same run whose held-out rows carry ratios that would drag any estimate they fed. Planted bugs
this catches: held-out rows left in ``measured`` (``plan.StepPlan``), the held-out rows drawn from
the rows that fit the bound (``draw_holdout(measured, ...)`` in the controller's ``begin_step``).
"""

from __future__ import annotations

import pytest
import torch

from fp8rl.rl.calibration import CalibratedClipController, CalibrationOptions
from fp8rl.rl.calibration.sampling import draw_holdout, draw_subset
from fp8rl.rl.clipping import make_clipper

EPS_LOW, EPS_HIGH = 0.2, 0.28
N, T, STEPS, SHARE, SEED = 48, 10, 4, 0.25, 7
MODES = {
    "windowed_half": {"mode": "windowed", "window_share": 0.5},
    "windowed": {"mode": "windowed"},
    "pooled": {"mode": "pooled"},
    "periodic": {"mode": "periodic", "period": 2, "ema": 0.0},
    "sampled": {"mode": "sampled", "sample_fraction": 0.5},
    "same_batch": {"mode": "same_batch"},
}
LOGGED = ("clip/low", "clip/high", "clip/low_next", "clip/high_next", "clip/k", "clip/n", "clip/alpha_n")


def tokens(step: int):
    """``[N, T]`` FP8 ratio, BF16 shadow ratio, advantages (per row; the last 4 rows A == 0: not
    eligible), mask; a few BF16-clipped A<0 tokens per step."""
    g = torch.Generator().manual_seed(100 + step)
    shadow = torch.exp(0.08 * torch.randn(N, T, generator=g))
    fp8 = shadow * torch.exp(0.08 * torch.randn(N, T, generator=g))
    adv = torch.where(torch.arange(N) % 2 == 0, -1.0, 1.0)[:, None].expand(N, T).clone()
    adv[-4:] = 0.0
    return fp8, shadow, adv, torch.ones(N, T)


def run(opts: dict, *, extreme: bool) -> tuple[list, list[dict]]:
    """``STEPS`` steps of two windows each, as a backend runs them; ``extreme``: the held-out rows'
    FP8 and BF16 ratios at 0.3 (below any bound: every estimate they fed would move). Returns the
    plans and each step's metrics."""
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, CalibrationOptions(**opts), seed=SEED)
    plans, outs = [], []
    for step in range(STEPS):
        fp8, shadow, adv, mask = tokens(step)
        eligible = (adv != 0).any(1)
        plan = ctl.begin_step(step, eligible=eligible, holdout_share=SHARE, seed=SEED)
        if extreme:
            fp8[plan.holdout], shadow[plan.holdout] = 0.3, 0.3
        for rows in (torch.arange(N // 2), torch.arange(N // 2, N)):
            w = plan.window(rows)
            m = w.measured
            after = w.calibrate(fp8[rows][m], shadow[rows][m], adv[rows][m], mask[rows][m], seq=rows[m])
            for held in (False, True):
                keep = w.shadowed & (w.holdout if held else ~w.holdout)
                if bool(keep.any()):
                    r = rows[keep]
                    w.observe(fp8[r], shadow[r], adv[r], mask[r], after=after is not w.before, holdout=held)
        plans.append(plan)
        outs.append(plan.finish())
    return plans, outs


@pytest.mark.parametrize("name", list(MODES))
def test_held_out_rows_are_the_vanilla_arms_and_never_feed_an_estimate(name):
    plans, outs = run(MODES[name], extreme=False)
    _, outs_extreme = run(MODES[name], extreme=True)
    vanilla = make_clipper("vanilla", EPS_LOW, EPS_HIGH)
    overlap = 0
    for step, plan in enumerate(plans):
        eligible = (tokens(step)[2] != 0).any(1)
        want = draw_holdout(eligible, SHARE, seed=SEED, step=step)
        assert torch.equal(plan.holdout, want), step  # drawn from the eligible rows, whatever the mode
        assert torch.equal(vanilla.begin_step(step, eligible=eligible, holdout_share=SHARE, seed=SEED).holdout, want)
        assert int(want.sum()) == round(SHARE * int(eligible.sum())) and not bool((want & ~eligible).any())
        assert not bool((plan.measured & plan.holdout).any()) and bool(plan.shadowed[plan.holdout].all())
        if plan.calibrates and MODES[name]["mode"] == "windowed":  # the mode's own draw, before the exclusion
            overlap += int((draw_subset(eligible, MODES[name].get("window_share", 1.0), seed=SEED, step=step)
                            & want).sum())
        # the estimate never saw the held-out rows: extreme held-out ratios change nothing it logs
        got = {k: outs[step][k] for k in LOGGED if k in outs[step]}
        assert got == {k: outs_extreme[step][k] for k in LOGGED if k in outs_extreme[step]}, step
        assert outs[step]["shadow/ho_n_neg"] > 0 and outs_extreme[step]["shadow/ho_bf16_low_n"] > 0
    if MODES[name]["mode"] == "windowed":  # not vacuous: the mode's draw held rows the plan held out
        assert overlap > 0
