"""The ``windowed`` calibration mode (issue 46): a window across steps sized to reach alpha n.

Reference: the window is the fewest recent steps (this one included) whose A<0 count times the
BF16 rate over the last ``window_max`` steps reaches ``window_target``, counted here from the
tokens. Planted bugs this catches: a window that never drops old steps
(``test_abundant_events_pool_only_this_step``, ``test_the_window_never_exceeds_window_max``), a
rate read from the FP8 ratios (``test_window_size_follows_the_bf16_rate``).
"""

from __future__ import annotations

import pytest
import torch

from fp8rl.rl.calibration import CalibratedClipController, CalibrationOptions

EPS_LOW, EPS_HIGH = 0.2, 0.28
V = 1.0 - EPS_LOW


def step_tokens(seed: int, n: int = 200, clipped: int = 0, fp8_low: bool = False):
    """``[n]`` FP8 ratio, BF16 shadow ratio, advantages, mask; ``clipped`` A<0 shadow ratios at 0.7;
    ``fp8_low``: every A<0 FP8 ratio below 1 - eps_low (the shadow unchanged)."""
    g = torch.Generator().manual_seed(seed)
    shadow = torch.exp(0.03 * torch.randn(n, generator=g))
    fp8 = shadow * torch.exp(0.03 * torch.randn(n, generator=g))
    adv = torch.where(torch.arange(n) % 2 == 0, -1.0, 1.0)
    neg = (adv < 0).nonzero().flatten()
    shadow[neg[:clipped]] = 0.7
    if fp8_low:
        fp8 = torch.where(adv < 0, fp8 * 0.5, fp8)
    return fp8, shadow, adv, torch.ones(n)


def windowed(**kw) -> CalibratedClipController:
    return CalibratedClipController(EPS_LOW, EPS_HIGH, CalibrationOptions(mode="windowed", **kw))


def run(ctl, data, start=0):
    out = []
    for i, (fp8, shadow, adv, mask) in enumerate(data):
        step = start + i
        ctl.update(step, ratio=fp8, shadow_ratio=shadow, advantages=adv, mask=mask)
        out.append(ctl.metrics(step))
    return out


def reference_window(ks, ns, target, wmax):
    """The window (number of steps) the rule picks at the last step of ``ks``/``ns``."""
    ks, ns = ks[-wmax:], ns[-wmax:]
    alpha = sum(ks) / sum(ns)
    pooled = 0
    for w in range(1, len(ns) + 1):
        pooled += ns[-w]
        if alpha * pooled >= target:
            return w
    return len(ns)


def test_window_size_follows_the_bf16_rate():
    clipped = [1, 0, 0, 2, 0, 1, 0, 0, 3, 0]
    data = [step_tokens(s, clipped=c, fp8_low=(s % 3 == 0)) for s, c in enumerate(clipped)]
    ns = [int((d[2] < 0).sum()) for d in data]
    ms = run(windowed(window_target=3.0, window_max=5), data)
    for i, m in enumerate(ms):
        w = reference_window(clipped[: i + 1], ns[: i + 1], 3.0, 5)
        assert m["clip/pooled_calibrations"] == w, i
        assert m["clip/n"] == sum(ns[i + 1 - w: i + 1]), i
        assert m["clip/k"] == sum(clipped[i + 1 - w: i + 1]), i


def test_abundant_events_pool_only_this_step():
    data = [step_tokens(s, clipped=8) for s in range(6)]
    ms = run(windowed(window_target=3.0, window_max=4), data)
    assert [m["clip/pooled_calibrations"] for m in ms] == [1.0] * 6
    assert all(m["clip/n"] == 100 for m in ms)


def test_the_window_never_exceeds_window_max():
    data = [step_tokens(s, clipped=0) for s in range(7)]  # no BF16 event: the target is out of reach
    ctl = windowed(window_target=3.0, window_max=3)
    ms = run(ctl, data)
    assert [m["clip/pooled_calibrations"] for m in ms] == [1.0, 2.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    assert len(ctl._steps) == 2 and len(ctl.state_dict()["windowed"]) == 2


def test_a_resumed_run_pools_the_same_steps():
    data = [step_tokens(s, clipped=c) for s, c in enumerate([1, 0, 2, 0, 0, 1])]
    whole = run(windowed(window_max=4), data)
    first = windowed(window_max=4)
    run(first, data[:3])
    resumed = windowed(window_max=4)
    resumed.load_state_dict(first.state_dict())
    rest = run(resumed, data[3:], start=3)
    for a, b in zip(whole[3:], rest, strict=True):
        assert (a["clip/pooled_calibrations"], a["clip/n"], a["clip/low"]) == \
            (b["clip/pooled_calibrations"], b["clip/n"], b["clip/low"])


def test_the_share_draws_a_seeded_subset_and_rules_from_the_next_step():
    ctl = windowed(window_share=0.25)
    eligible = torch.ones(32, dtype=torch.bool)
    plan = ctl.begin_step(0, eligible=eligible)
    assert int(plan.measured.sum()) == 8 and torch.equal(plan.shadowed, plan.measured)
    again = windowed(window_share=0.25).begin_step(0, eligible=eligible)
    assert torch.equal(plan.measured, again.measured)
    fp8, shadow, adv, mask = (t.view(32, 10) for t in step_tokens(0, n=320, clipped=20))
    rows = torch.arange(32)
    m = plan.measured
    w = plan.window(rows)
    assert w.after is None and not bool(w.first.any())  # every row ruled by the bounds in force
    w.calibrate(fp8[m], shadow[m], adv[m], mask[m], seq=rows[m])
    out = plan.finish()
    assert out["clip/n"] == int((adv[m] < 0).sum())
    assert ctl.bounds(1) == type(ctl.bounds(1))(out["clip/low_next"], out["clip/high_next"])


@pytest.mark.parametrize(("kw", "msg"), [
    ({"window_target": 0.0}, "window_target"), ({"window_max": 0}, "window_max"),
    ({"window_share": 1.5}, "window_share"), ({"window_share": 0.0}, "window_share"),
])
def test_bad_window_options_raise(kw, msg):
    with pytest.raises(ValueError, match=msg):
        CalibrationOptions(mode="windowed", **kw)
    with pytest.raises(ValueError, match="calibration_mode=windowed"):
        CalibrationOptions(mode="pooled", window_max=3)
