"""Held-out rows under the ``windowed`` calibration mode at mini scale (issue 46 item 6).

``test_mini_holdout`` follows ``same_batch`` (``calibrate_window``); ``windowed`` hands the plan
its measured tokens through ``WindowPlan.calibrate`` and pools them after the step. Reference:
the rows each step's estimate read are exactly the mode's own seeded draw at ``window_share``
minus the held-out rows, and the held-out rows are the seed's draw from the eligible rows
(``sampling.draw_subset`` / ``draw_holdout`` recomputed here). Planted bugs this catches: the
held-out rows left in the measured set (``plan.StepPlan``), the mini trainer feeding them to the
estimate (``meas = win.measured | win.holdout`` in ``updates``), and the held-out rows drawn from
the windowed subset instead of the eligible rows.
"""

from __future__ import annotations

import torch

from fp8rl.backends.mini import run_mini
from fp8rl.rl.calibration.plan import WindowPlan
from fp8rl.rl.calibration.sampling import draw_holdout, draw_subset
from fp8rl.runs import RunDir
from fp8rl.runs import metrics as M

SHARE, HOLDOUT = 0.75, 0.25


def test_windowed_estimates_read_the_mode_draw_minus_the_held_out_rows(tiny, tmp_path, monkeypatch):
    fed = []  # (plan, the sequence ids one window's calibrate read)
    calibrate = WindowPlan.calibrate

    def record(self, ratio, shadow_ratio, advantages, mask, *, seq=None):
        fed.append((self.plan, seq.tolist()))
        return calibrate(self, ratio, shadow_ratio, advantages, mask, seq=seq)

    monkeypatch.setattr(WindowPlan, "calibrate", record)
    cfg = tiny("tensorwise", "calibrated", steps=4, samples_every=0, eval_every=0,
               clip_opts={"calibration_mode": "windowed", "window_share": SHARE, "holdout_share": HOLDOUT})
    summary = run_mini(cfg)
    assert summary["state"] == "DONE", summary
    plans = list({id(p): p for p, _ in fed}.values())
    assert plans and all(p.calibrates for p in plans)
    overlap = held_rows = 0
    for plan in plans:
        held = draw_holdout(plan.eligible, HOLDOUT, seed=cfg.seed, step=plan.step)
        drawn = draw_subset(plan.eligible, SHARE, seed=plan.clipper.seed, step=plan.step)
        assert torch.equal(plan.holdout, held), plan.step
        read = sorted({s for p, seq in fed if p is plan for s in seq})
        assert read == torch.nonzero(drawn & ~held).flatten().tolist(), plan.step  # never a held-out row
        overlap += int((drawn & held).sum())
        held_rows += int(held.sum())
    assert held_rows > 0 and overlap > 0  # not vacuous: the mode's draw held rows the plan held out
    rows = RunDir(summary["run_dir"]).read_metrics()
    assert all(M.CLIP_N in r and M.SHADOW_HO_N_NEG in r for r in rows if r[M.ACTOR_N_NEG] > 0)
