"""A clip method added through the public path (``CLIP_METHODS`` and ``CLIP_ARMS`` of
``fp8rl.rl.clipping``, nothing else) runs at both scales: the mini trainer logs its bounds, and the
paper-scale plugin's spec builds it (the spec asks ``method_calibrates``, never the method's name)
or refuses it before submission. One method that takes no options, one that calibrates."""

from __future__ import annotations

import dataclasses

import pytest
from test_orl_cpu_job import smoke_config

from fp8rl.backends.openrlhf.plugin.spec import PluginSpec
from fp8rl.config import ClipConfig
from fp8rl.rl import clipping
from fp8rl.rl.calibration import CalibratedClipController


class HalfWidthClip(clipping.VanillaClip):
    """Bounds (1 - eps_low / 2, 1 + eps_high / 2): a throwaway method, no options."""

    def __init__(self, eps_low: float, eps_high: float) -> None:
        super().__init__(eps_low / 2, eps_high / 2)


class EagerCalibratedClip(CalibratedClipController):
    """A calibrating method: the controller under another name (it takes options and seed)."""


@pytest.fixture
def registered(monkeypatch):
    """Register both methods and their arms through the public API; undone after the test."""
    for reg in (clipping.CLIP_METHODS, clipping.CLIP_ARMS):
        monkeypatch.setattr(reg, "_entries", dict(reg._entries))
    clipping.CLIP_METHODS.register("halfwidth")(HalfWidthClip)
    clipping.CLIP_METHODS.register("eager")(EagerCalibratedClip)
    clipping.CLIP_ARMS.add("halfwidth", clipping.ClipArm(method="halfwidth", is_correction="tis"))
    clipping.CLIP_ARMS.add("eager", clipping.ClipArm(method="eager", is_correction="tis"))


def _cell(tmp_path, arm: str):
    cfg = smoke_config(tmp_path, "dapo_tensorwise_score_centering_tis")
    return dataclasses.replace(cfg, clip=dataclasses.replace(cfg.clip, arm=arm))


def test_a_new_method_without_options_is_built_by_the_paper_scale_spec(registered, tmp_path):
    cfg = _cell(tmp_path, "halfwidth")
    assert cfg.clip.method == "halfwidth" and not clipping.method_calibrates("halfwidth")
    spec = PluginSpec.from_json(PluginSpec.from_config(cfg, run_dir=tmp_path / "run").to_json())
    assert spec.clip_options is None
    clipper = spec.make_clipper()
    assert isinstance(clipper, HalfWidthClip)
    a = cfg.algorithm
    assert (clipper.bounds(0).low, clipper.bounds(0).high) == pytest.approx((1 - a.eps_low / 2, 1 + a.eps_high / 2))


def test_a_new_calibrating_method_gets_the_options_and_seed(registered, tmp_path):
    cfg = _cell(tmp_path, "eager")
    spec = PluginSpec.from_json(PluginSpec.from_config(cfg, run_dir=tmp_path / "run").to_json())
    assert clipping.method_calibrates("eager") and spec.clip_options.mode == cfg.clip.calibration_mode
    clipper = spec.make_clipper()
    assert isinstance(clipper, EagerCalibratedClip) and clipper.mode == cfg.clip.calibration_mode


def test_a_method_the_plugin_cannot_build_is_refused_before_submission(registered, tmp_path, monkeypatch):
    """A method whose constructor does not fit the options it claims is refused when its config is
    built (the dry run and the launcher build every cell's config), naming the method; and the
    plugin spec checks its own call too, so nothing fails inside the Ray actors."""
    cfg = _cell(tmp_path, "halfwidth")
    monkeypatch.setattr(HalfWidthClip, "calibrates", True)  # claims options its constructor refuses
    with pytest.raises(ValueError, match=r"clip method 'halfwidth' does not take option\(s\) \['options', 'seed'\]"):
        _cell(tmp_path, "halfwidth")
    with pytest.raises(ValueError, match="clip method 'halfwidth' cannot be built by the paper-scale plugin"):
        PluginSpec.from_config(cfg, run_dir=tmp_path / "run")


def test_clip_config_passes_options_by_the_methods_attribute(registered):
    assert ClipConfig(arm="halfwidth").clipper_options(seed=3) == {}
    opts = ClipConfig(arm="eager").clipper_options(seed=3)
    assert opts["seed"] == 3 and opts["options"].mode == ClipConfig().calibration_mode


def test_the_spec_carries_typed_options_and_resolved_recipes_through_its_json(tmp_path):
    """``PluginSpec`` holds the cell's ``CalibrationOptions`` and ``Recipe`` objects (resolved once,
    when it is built) and writes them itself: every option and both recipes survive the JSON the
    workers read, so a value dropped or renamed on the way fails here, not inside a Ray actor."""
    from fp8rl.quant import RECIPES

    cfg = _cell(tmp_path, "calibrated")
    clip = dataclasses.replace(cfg.clip, calibration_mode="sampled", sample_fraction=0.3, sample_pool=2,
                               init_bounds=[0.7, 1.4], low_min=0.2, upper_rule="proportional")
    cfg = dataclasses.replace(cfg, clip=clip)
    spec = PluginSpec.from_config(cfg, run_dir=tmp_path / "run")
    assert spec.clip_options == cfg.clip.calibration_options()
    assert spec.trainer_recipe is RECIPES[cfg.fp8.trainer_recipe] and spec.rollout_recipe is RECIPES[cfg.fp8.rollout_recipe]
    back = PluginSpec.from_json(spec.to_json())
    assert back == spec and back.clip_options == spec.clip_options
    assert back.trainer_recipe is spec.trainer_recipe and back.rollout_recipe is spec.rollout_recipe
    for bad, match in (({"clip_options": {"mode": "hourly"}}, "hourly"), ({"trainer_recipe": "fp9"}, "fp9"),
                       ({"clip_options": [0.6]}, "CalibrationOptions or None")):
        with pytest.raises((KeyError, TypeError, ValueError), match=match):
            PluginSpec(**bad)


@pytest.mark.parametrize("arm", ["no_lower_clip", "wide_lower"])
def test_the_calibration_controls_are_built_by_the_paper_scale_plugin_with_the_mini_bounds(tmp_path, arm):
    """The controls of issue 46 at paper scale: the plugin's loss builds the same method, with the
    same bounds as the mini trainer's, and the cell keeps TIS (its OpenRLHF flags carry the cap)."""
    from fp8rl.rl.clipping import make_clipper

    cfg = _cell(tmp_path, arm)
    spec = PluginSpec.from_json(PluginSpec.from_config(cfg, run_dir=tmp_path / "run").to_json())
    a = cfg.algorithm
    assert spec.clip_method == arm and spec.clip_options is None
    assert spec.make_clipper().bounds(0) == make_clipper(arm, a.eps_low, a.eps_high).bounds(0)
    assert cfg.clip.is_correction == "tis" and cfg.clip.correction_params() == {"cap": cfg.clip.tis_cap}
