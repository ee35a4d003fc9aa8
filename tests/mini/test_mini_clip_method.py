"""A clip method registered through the public path (``CLIP_METHODS``, ``CLIP_ARMS``) trains at
mini scale with no other change: its bounds are the ones the loss used (the paper-scale side of the
same method: ``tests/openrlhf/test_orl_clip_method.py``)."""

from __future__ import annotations

import pytest

from fp8rl.backends.mini.run import run_mini
from fp8rl.rl import clipping
from fp8rl.runs import metrics as M
from fp8rl.runs.rundir import RunDir


class HalfWidthClip(clipping.VanillaClip):
    """Bounds (1 - eps_low / 2, 1 + eps_high / 2)."""

    def __init__(self, eps_low: float, eps_high: float) -> None:
        super().__init__(eps_low / 2, eps_high / 2)


def test_a_registered_method_trains_with_its_own_bounds(tiny, monkeypatch):
    for reg in (clipping.CLIP_METHODS, clipping.CLIP_ARMS):
        monkeypatch.setattr(reg, "_entries", dict(reg._entries))  # undone after the test
    clipping.CLIP_METHODS.register("halfwidth")(HalfWidthClip)
    clipping.CLIP_ARMS.add("halfwidth", clipping.ClipArm(method="halfwidth", is_correction="tis"))
    cfg = tiny("tensorwise", "halfwidth", steps=2, eval_every=0, samples_every=0)
    summary = run_mini(cfg)
    assert summary["state"] == "DONE"
    rows = RunDir(summary["run_dir"]).read_metrics()
    a = cfg.algorithm
    assert len(rows) == 2
    for r in rows:
        assert (r[M.CLIP_LOW], r[M.CLIP_HIGH]) == pytest.approx((1 - a.eps_low / 2, 1 + a.eps_high / 2))
        assert M.ROLLOUT_IS_CLIPFRAC in r  # the arm's TIS correction ran
