"""The calibration tables pick their arms by what the arm's clip method is (``calibrates``, a class
attribute in ``fp8rl.rl.clipping``), not by the name ``calibrated``: an arm registered through the
public path appears in them without an edit to ``analysis/``."""

from __future__ import annotations

import pytest

from analysis import arms
from fp8rl.rl import clipping
from fp8rl.rl.calibration import CalibratedClipController


class EagerCalibratedClip(CalibratedClipController):
    """A calibrating method under another name (throwaway)."""


@pytest.fixture
def registered(monkeypatch):
    for reg in (clipping.CLIP_METHODS, clipping.CLIP_ARMS):
        monkeypatch.setattr(reg, "_entries", dict(reg._entries))
    clipping.CLIP_METHODS.register("eager")(EagerCalibratedClip)
    clipping.CLIP_ARMS.add("eager", clipping.ClipArm(method="eager", is_correction="tis"))
    clipping.CLIP_ARMS.add("plain", clipping.ClipArm(method="vanilla", is_correction="icepop"))
    arms._base_calibrates.cache_clear()
    yield
    arms._base_calibrates.cache_clear()


def test_arms_that_calibrate_are_those_whose_method_calibrates(registered):
    assert arms.arm_calibrates("calibrated") and arms.arm_calibrates("calibrated[clip.period=10]")
    assert arms.arm_calibrates("eager") and arms.arm_calibrates("eager[clip.calibration_mode=sampled]")
    assert not any(arms.arm_calibrates(c) for c in ("vanilla", "tis", "plain", "unknown_arm"))


def test_a_new_calibrating_arm_gets_the_construction_note_of_a_calibrated_arm(registered):
    from analysis.calibration_report import construction_note

    never = construction_note("tensorwise", "tis", "", "")
    assert construction_note("tensorwise", "eager", "pooled", "unbiased") != never
    assert construction_note("tensorwise", "eager", "pooled", "unbiased") == \
        construction_note("tensorwise", "calibrated", "pooled", "unbiased")
