"""Calibration modes of the controller: schedule, same-batch bounds, agreement, state, bad config."""

from __future__ import annotations

import json

import pytest
import torch

from fp8rl.rl.calibration import (
    CALIBRATION_MODES,
    DEFAULT_CALIBRATION_MODE,
    AgreementTally,
    Bounds,
    CalibratedClipController,
    calibrate_bounds,
)
from fp8rl.rl.calibration.agreement import agreement_counts, agreement_metrics
from fp8rl.runs import metrics as M

EPS_LOW, EPS_HIGH = 0.2, 0.28
VANILLA = Bounds(1 - EPS_LOW, 1 + EPS_HIGH)


def batch(seed: int, B: int = 16, T: int = 40, noise: float = 0.15):
    """One mini-batch: ``ratio``, ``shadow_ratio`` ``[B, T]``, ``advantages`` ``[B]``, ``mask``."""
    g = torch.Generator().manual_seed(seed)
    shadow = torch.exp(torch.randn(B, T, generator=g) * 0.1)
    fp8 = shadow * torch.exp(torch.randn(B, T, generator=g) * noise)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.15
    return {"ratio": fp8, "shadow_ratio": shadow, "advantages": adv, "mask": mask}


def ctl(mode: str, **kw) -> CalibratedClipController:
    return CalibratedClipController(EPS_LOW, EPS_HIGH, mode=mode, init_bounds=(0.6, 1.8), **kw)


def direct(b: dict, lower_estimator: str = "unbiased") -> Bounds:
    """Reference: one calibration of the batch's own tokens (raw, clamped)."""
    c = calibrate_bounds(b["ratio"], b["shadow_ratio"], b["advantages"], b["mask"], eps_low=EPS_LOW, eps_high=EPS_HIGH,
                         lower_estimator=lower_estimator)
    return Bounds(c.low, c.high)


def direct_counts(b: dict, applied: Bounds) -> torch.Tensor:
    return agreement_counts(b["ratio"], b["shadow_ratio"], b["advantages"], b["mask"], low=applied.low,
                            high=applied.high, vanilla_low=VANILLA.low, vanilla_high=VANILLA.high)


def test_registry_and_default():
    assert sorted(CALIBRATION_MODES) == ["periodic", "pooled", "same_batch", "sampled", "windowed"]
    assert DEFAULT_CALIBRATION_MODE in CALIBRATION_MODES
    assert CalibratedClipController(EPS_LOW, EPS_HIGH).mode == DEFAULT_CALIBRATION_MODE


def test_schedule_per_mode():
    per = ctl("periodic", period=3)
    assert [per.measures(s) for s in range(7)] == [True, False, False, True, False, False, True]
    late = ctl("periodic", period=3, calibrate_at_start=False)
    assert [late.is_calibration_step(s) for s in range(4)] == [False, False, False, True]
    for mode in ("pooled", "same_batch"):
        c = ctl(mode)
        assert all(c.measures(s) and c.is_calibration_step(s) for s in range(7)), mode
        assert c.needs_shadow(5)
    static = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="same_batch", reference="static", alpha=0.01,
                                      upper_rule="fixed")
    assert static.is_calibration_step(2) and not static.measures(2)  # no shadow to run


def test_update_methods_belong_to_their_modes():
    b = batch(0)
    with pytest.raises(ValueError, match="call update_batch"):
        ctl("same_batch").update(0, **b)
    for mode in ("periodic", "pooled"):
        with pytest.raises(ValueError, match="call update once per step"):
            ctl(mode).update_batch(0, **b)
    c = ctl("same_batch")
    c.update_batch(3, **b)
    c.update_batch(3, **batch(1))  # several mini-batches of one step
    with pytest.raises(ValueError, match="must not go back"):
        c.update_batch(2, **b)
    with pytest.raises(ValueError, match="needs shadow_ratio"):
        c.update_batch(4, ratio=b["ratio"], advantages=b["advantages"], mask=b["mask"])


def test_pooled_is_raw_every_step_and_rules_from_next_step():
    c = ctl("pooled")
    for step in range(4):
        b = batch(step)
        assert c.bounds(step) == (Bounds(0.6, 1.8) if step == 0 else direct(batch(step - 1)))
        assert c.update(step, **b) == direct(b)  # no EMA (default ema=0.5 is periodic's)
    ref = ctl("periodic", period=1, ema=0.0)
    for step in range(4):
        assert ref.update(step, **batch(step)) == direct(batch(step))


def test_same_batch_bounds_come_from_the_batch_itself():
    c = ctl("same_batch")
    for step in range(3):
        for j in range(3):
            b = batch(10 * step + j)
            got = c.update_batch(step, **b)
            assert got == direct(b, "in_sample") and c.bounds(step) == got
        assert c.metrics(step)["clip/calibrations"] == 3 * (step + 1)
    # a degenerate mini-batch keeps the last bounds and is counted
    b = batch(99)
    kept = c.bounds(2)
    assert c.update_batch(3, **{**b, "mask": torch.zeros_like(b["mask"])}) == kept
    assert c.metrics(3)["clip/degenerate_updates"] == 1


def test_agreement_same_batch_sums_the_steps_batches_with_their_own_bounds():
    c = ctl("same_batch")
    total = torch.zeros(6, dtype=torch.int64)
    for j in range(3):
        b = batch(j)
        applied = c.update_batch(0, **b)
        total += direct_counts(b, applied)
    m = c.metrics(0)
    assert m == pytest.approx(m | agreement_metrics(total), nan_ok=True)
    assert m[M.SHADOW_LOW_BF16_N] == float(total[0]) and m[M.SHADOW_LOW_BOTH_N] == float(total[2])
    assert total[0] > 0 and total[1] > 0  # the check has clipped tokens to compare
    # the next step starts a new sum; other steps report none
    b = batch(7)
    applied = c.update_batch(1, **b)
    assert c.metrics(1)[M.SHADOW_LOW_FP8_N] == float(direct_counts(b, applied)[1])
    assert M.SHADOW_LOW_RECALL not in c.metrics(0)


@pytest.mark.parametrize("mode", ["periodic", "pooled"])
def test_agreement_pooled_modes_use_the_bounds_in_force_during_the_step(mode):
    c = ctl(mode, **({"period": 1} if mode == "periodic" else {}))
    for step in range(3):
        b = batch(step)
        in_force = c.bounds(step)
        c.update(step, **b)
        m = c.metrics(step)
        want = agreement_metrics(direct_counts(b, in_force))
        assert {k: m[k] for k in want} == pytest.approx(want, nan_ok=True)
    assert c.bounds(2) != Bounds(0.6, 1.8)


def test_static_reference_counts_no_agreement():
    c = CalibratedClipController(EPS_LOW, EPS_HIGH, mode="same_batch", reference="static", alpha=0.01,
                                 upper_rule="fixed")
    b = batch(0)
    c.update_batch(0, ratio=b["ratio"], advantages=b["advantages"], mask=b["mask"])
    assert M.SHADOW_LOW_RECALL not in c.metrics(0)


def test_agreement_tally_alone():
    t = AgreementTally()
    b = batch(3)
    t.add(5, **b, applied=VANILLA, vanilla=VANILLA)
    m = t.metrics(5)
    assert m[M.SHADOW_LOW_FP8_N] == float(direct_counts(b, VANILLA)[1]) and t.metrics(4) == {}
    # the shadow itself: recall = precision = 1 (BF16 arms log their own ratios as the shadow)
    t.add(6, b["shadow_ratio"], b["shadow_ratio"], b["advantages"], b["mask"], applied=VANILLA, vanilla=VANILLA)
    assert t.metrics(6)[M.SHADOW_LOW_RECALL] == 1.0 and t.metrics(6)[M.SHADOW_LOW_PRECISION] == 1.0


@pytest.mark.parametrize("mode", ["periodic", "pooled", "same_batch"])
def test_state_round_trip_continues_exactly(mode):
    kw = {"period": 2, "window": 2, "ema": 0.3} if mode == "periodic" else {}

    def drive(c, steps):
        out = []
        for step in steps:
            if c.per_batch:
                for j in range(2):
                    c.update_batch(step, **batch(10 * step + j))
            elif c.is_calibration_step(step):
                c.update(step, **batch(step))
            out.append(repr((c.bounds(step), c.metrics(step))))
        return out

    full = drive(ctl(mode, **kw), range(6))
    a = ctl(mode, **kw)
    drive(a, range(3))
    state = a.state_dict()
    if mode != "periodic":
        state = json.loads(json.dumps(state))  # no pooled tensors: plain JSON
    b = ctl(mode, **kw)
    b.load_state_dict(state)
    assert repr(b.metrics(2)) == repr(a.metrics(2))
    assert drive(b, range(3, 6)) == full[3:]
    other = "pooled" if mode == "same_batch" else "same_batch"
    with pytest.raises(ValueError, match="mode"):
        ctl(other).load_state_dict(state)


def test_version1_state_loads_as_periodic():
    a = ctl("periodic", period=1)
    a.update(0, **batch(0))
    old = a.state_dict()
    old["version"] = 1
    del old["config"]["mode"], old["agreement"]
    b = ctl("periodic", period=1)
    b.load_state_dict(old)
    assert b.bounds(1) == a.bounds(1) and b.metrics(1) == a.metrics(1)
    with pytest.raises(ValueError, match="mode: checkpoint 'periodic' vs now 'same_batch'"):
        ctl("same_batch").load_state_dict({**old, "config": {**old["config"], "period": 20}})


@pytest.mark.parametrize("mode", ["pooled", "same_batch"])
@pytest.mark.parametrize("opt", [{"period": 4}, {"ema": 0.0}, {"window": 4}, {"calibrate_at_start": False}])
def test_periodic_options_with_another_mode_raise(mode, opt):
    name = next(iter(opt))
    with pytest.raises(ValueError, match=f"{name}=.*only calibration_mode=periodic uses {name}"):
        ctl(mode, **opt)
    ctl("periodic", **opt)  # fine where they belong


@pytest.mark.parametrize("mode", ["Periodic", "every_step", 3])
def test_unknown_mode_raises(mode):
    with pytest.raises((KeyError, TypeError), match="periodic"):
        ctl(mode)


# ---------------------------------------------------------------------------------------
# ClipConfig: clip.calibration_mode
# ---------------------------------------------------------------------------------------


def test_clip_config_mode_reaches_the_controller():
    from fp8rl.config import ClipConfig
    from fp8rl.rl.clipping import make_clipper

    assert ClipConfig().calibration_mode == DEFAULT_CALIBRATION_MODE
    for mode in CALIBRATION_MODES:
        cfg = ClipConfig(arm="calibrated", calibration_mode=mode)
        assert make_clipper(cfg.method, EPS_LOW, EPS_HIGH, **cfg.clipper_options()).mode == mode
    assert ClipConfig(arm="calibrated", calibration_mode="periodic", period=4, window=4).period == 4


@pytest.mark.parametrize(("kw", "match"), [
    ({"calibration_mode": "per_batch"}, "clip.calibration_mode: unknown name 'per_batch'"),
    ({"calibration_mode": "same_batch", "period": 4}, r"clip.period=4: only clip.calibration_mode=periodic uses"),
    ({"calibration_mode": "pooled", "window": 4, "ema": 0.0}, r"clip.ema=0.0.*Set clip.calibration_mode=periodic"),
    ({"shadow_diagnostics": "yes"}, "clip.shadow_diagnostics must be true or false"),
])
def test_clip_config_bad_values(kw, match):
    from fp8rl.config import ClipConfig

    with pytest.raises(ValueError, match=match):
        ClipConfig(arm="calibrated", **kw)


def test_each_mode_uses_its_own_lower_estimator_unless_told():
    """same_batch's bounds rule the tokens they come from: the in-sample bound (FP8 clips exactly
    the shadow's count there); periodic/pooled rule later tokens: the unbiased one."""
    assert ctl("same_batch").lower_estimator == "in_sample"
    assert ctl("pooled").lower_estimator == ctl("periodic").lower_estimator == "unbiased"
    b = batch(3)
    assert direct(b, "in_sample") != direct(b, "unbiased")  # the batch tells the two apart
    assert ctl("same_batch").update_batch(0, **b) == direct(b, "in_sample")
    told = ctl("same_batch", lower_estimator="unbiased")
    assert told.update_batch(0, **b) == direct(b, "unbiased")
    assert ctl("pooled", lower_estimator="in_sample").update(0, **b) == direct(b, "in_sample")
    with pytest.raises(Exception, match="unknown calibration lower estimator 'median'"):
        ctl("pooled", lower_estimator="median")
    # the estimator is part of the checkpointed configuration; a state saved before it was an
    # option was in-sample's
    state = ctl("pooled").state_dict()
    with pytest.raises(ValueError, match="lower_estimator"):
        ctl("pooled", lower_estimator="in_sample").load_state_dict(state)
    del state["config"]["lower_estimator"]
    ctl("pooled", lower_estimator="in_sample").load_state_dict(state)


def test_clip_config_carries_every_calibration_option_to_the_controller():
    """Each ``CalibrationOptions`` field is a ``clip.`` key with the options' default (but the four
    stated ones: two of them, period and window, None = the scale's preset), and a non-default
    value of each reaches the options the controller gets."""
    import dataclasses

    from fp8rl.config import ClipConfig
    from fp8rl.config.clip import CONFIG_DEFAULTS, CONFIG_NAMES
    from fp8rl.rl.calibration import CalibrationOptions

    cfg_fields = {f.name: f for f in dataclasses.fields(ClipConfig)}
    assert set(CONFIG_DEFAULTS) == {"init_bounds", "low_min", "period", "window"}
    for f in dataclasses.fields(CalibrationOptions):
        key = CONFIG_NAMES.get(f.name, f.name)
        assert key in cfg_fields, f"CalibrationOptions.{f.name} has no clip.{key}"
        cf = cfg_fields[key]
        default = cf.default if cf.default is not dataclasses.MISSING else cf.default_factory()
        if f.name in CONFIG_DEFAULTS:
            assert (tuple(default) if isinstance(default, list) else default) == CONFIG_DEFAULTS[f.name]
            assert default != f.default
        else:
            assert default == f.default, f"clip.{key} default {default!r} != CalibrationOptions' {f.default!r}"
    # one non-default value per option, each in a mode that reads it
    changes = [("periodic", {"period": 4}), ("periodic", {"ema": 0.0}), ("periodic", {"window": 3}),
               ("periodic", {"calibrate_at_start": False}), ("sampled", {"sample_fraction": 0.5}),
               ("sampled", {"sample_min": 0.02}), ("sampled", {"sample_max": 0.2}), ("sampled", {"sample_pool": 2}),
               ("sampled", {"sample_target": 3.0}), ("pooled", {"upper_rule": "proportional"}),
               ("pooled", {"init_bounds": [0.7, 1.5]}), ("pooled", {"low_min": 0.3}), ("pooled", {"high_max": 1.9}),
               ("pooled", {"lower_estimator": "in_sample"}),
               ("pooled", {"reference": "static", "alpha": 0.01, "p_target": 1.2}),
               ("windowed", {"window_target": 2.0}), ("windowed", {"window_max": 4}),
               ("windowed", {"window_share": 0.25})]
    covered = {"mode"}
    for mode, kw in changes:
        opts = ClipConfig(arm="calibrated", calibration_mode=mode, **kw).calibration_options()
        assert opts.mode == mode
        for k, v in kw.items():
            got = getattr(opts, k)
            assert (list(got) if isinstance(got, tuple) else got) == v, k
            covered.add(k)
    assert covered == {f.name for f in dataclasses.fields(CalibrationOptions)}
