"""Held-out rows at mini scale (``clip.holdout_share``; issue 46): every arm alike.

What ran is checked, not names: held-out rows are shadowed and scored every step
(``shadow/ho_*``), a non-calibrated arm trains bit for bit as without them, the same rows are
held out by every arm of a seed, and under ``same_batch`` they are the only out-of-sample tokens.
"""

from __future__ import annotations

import math

import pytest

from fp8rl.backends.mini import run_mini
from fp8rl.runs import RunDir
from fp8rl.runs import metrics as M

HO = (M.SHADOW_HO_N_NEG, M.SHADOW_HO_FP8_LOW_N, M.SHADOW_HO_BF16_LOW_N)
KW = dict(steps=3, samples_every=0, eval_every=0)


def _rows(summary: dict) -> list[dict]:
    assert summary["state"] == "DONE", summary
    return RunDir(summary["run_dir"]).read_metrics()


def _strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not (k.startswith("shadow/") or k.startswith("perf/"))} for r in rows]


def test_held_out_rows_score_a_tis_arm_without_changing_its_training(tiny, tmp_path):
    off = _rows(run_mini(tiny("tensorwise", "tis", run_dir=str(tmp_path / "off"), **KW)))
    on = _rows(run_mini(tiny("tensorwise", "tis", clip_opts={"holdout_share": 0.25}, run_dir=str(tmp_path / "on"),
                             **KW)))
    assert _strip(on) == _strip(off)
    for r in on:
        if r[M.ACTOR_N_NEG] == 0:  # no sequence with A != 0: nothing to hold out
            assert not any(k in r for k in HO)
            continue
        assert all(k in r for k in HO), r["step"]
        assert 0 <= r[M.SHADOW_HO_FP8_LOW_N] <= r[M.SHADOW_HO_N_NEG] and r[M.SHADOW_HO_BF16_LOW_N] <= r[M.SHADOW_HO_N_NEG]
        assert M.PERF_SHADOW_S in r
    cos = [r[M.SHADOW_HO_GRAD_COS] for r in on if M.SHADOW_HO_GRAD_COS in r]
    assert cos and all(-1.0 <= c <= 1.0 and math.isfinite(c) for c in cos)
    assert sum(r.get(M.SHADOW_HO_N_NEG, 0) for r in on) > 0


@pytest.mark.parametrize("clip", ["calibrated", "no_lower_clip"])
def test_every_arm_of_a_seed_holds_out_the_same_rows(tiny, tmp_path, clip):
    """Step 1 starts from the same weights and samples the same batch in every arm: the held-out
    rows, and so their A<0 count, are the same."""
    kw = dict(KW, steps=1, seed=11, clip_opts={"holdout_share": 0.25})
    a = _rows(run_mini(tiny("tensorwise", "tis", run_dir=str(tmp_path / "a"), **kw)))[0]
    b = _rows(run_mini(tiny("tensorwise", clip, run_dir=str(tmp_path / "b"), **kw)))[0]
    assert a[M.SHADOW_HO_N_NEG] == b[M.SHADOW_HO_N_NEG] > 0


def test_same_batch_held_out_rows_are_its_only_out_of_sample_tokens(tiny, tmp_path):
    rows = _rows(run_mini(tiny("tensorwise", "calibrated", clip_opts={"holdout_share": 0.25,
                                                                      "calibration_mode": "same_batch"},
                               run_dir=str(tmp_path / "sb"), **KW)))
    assert any(r[M.ACTOR_N_NEG] > 0 for r in rows)
    for r in rows:
        if r[M.ACTOR_N_NEG] > 0:
            assert r[M.SHADOW_OOS_N_NEG] == r[M.SHADOW_HO_N_NEG], r["step"]
            assert M.CLIP_N in r and M.CLIP_ALPHA_N in r


def test_no_held_out_token_reaches_a_calibration(tiny, tmp_path, monkeypatch):
    """The sequences each window's estimate reads (``seq``) never include a held-out row."""
    from fp8rl.rl.calibration import CalibratedClipController

    plans, seen = [], []
    begin, calibrate = CalibratedClipController.begin_step, CalibratedClipController.calibrate_window

    def record_plan(self, *a, **kw):
        plans.append(begin(self, *a, **kw))
        return plans[-1]

    def record_seq(self, step, tokens, *, seq=None):
        seen.append((plans[-1], seq))
        return calibrate(self, step, tokens, seq=seq)

    monkeypatch.setattr(CalibratedClipController, "begin_step", record_plan)
    monkeypatch.setattr(CalibratedClipController, "calibrate_window", record_seq)
    _rows(run_mini(tiny("tensorwise", "calibrated", clip_opts={"holdout_share": 0.25, "calibration_mode": "same_batch"},
                        run_dir=str(tmp_path / "sb"), **KW)))
    assert seen and any(bool(p.holdout.any()) for p, _ in seen)
    for plan, seq in seen:
        held = plan.holdout.nonzero().flatten().tolist()
        assert not set(seq.tolist()) & set(held)
