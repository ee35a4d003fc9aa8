"""How much data each calibration had (issue 46): ``clip/k``, ``clip/n``, ``clip/alpha_n``.

References are counted here directly from the tokens (A<0 tokens, BF16 shadow ratios below
1 - eps_low); alpha_n is the run's BF16 rate so far times n, read from the shadow, never from
the FP8 ratios (a planted bug that reads FP8 ratios fails ``test_alpha_n_reads_the_bf16_shadow_not_fp8``).
"""

from __future__ import annotations

import pytest
import torch

from fp8rl.rl.calibration import CalibratedClipController, CalibrationOptions

EPS_LOW, EPS_HIGH = 0.2, 0.28
V = 1.0 - EPS_LOW


def batch(seed: int, n: int = 300, *, fp8_noise: float = 0.05, clipped: int = 2):
    """FP8 ratio, BF16 shadow ratio, advantages, mask ``[n]``; ``clipped`` shadow ratios set
    below the vanilla bound on A<0 tokens."""
    g = torch.Generator().manual_seed(seed)
    shadow = torch.exp(0.04 * torch.randn(n, generator=g))
    fp8 = shadow * torch.exp(fp8_noise * torch.randn(n, generator=g))
    adv = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    neg = (adv < 0).nonzero().flatten()[:clipped]
    shadow[neg] = 0.7
    return fp8, shadow, adv, torch.ones(n)


def reference(data):
    """``[(k, n)]`` per batch, counted from the tokens."""
    return [(int(((s < V) & (a < 0)).sum()), int((a < 0).sum())) for _, s, a, _ in data]


def test_pooled_mode_logs_k_n_and_the_run_rate_times_n():
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, CalibrationOptions(mode="pooled"))
    data = [batch(s, clipped=c) for s, c in enumerate([2, 0, 5, 1])]
    k_tot = n_tot = 0
    for step, ((fp8, shadow, adv, mask), (k, n)) in enumerate(zip(data, reference(data), strict=True)):
        ctl.update(step, ratio=fp8, shadow_ratio=shadow, advantages=adv, mask=mask)
        m = ctl.metrics(step)
        k_tot, n_tot = k_tot + k, n_tot + n
        assert (m["clip/k"], m["clip/n"], m["clip/events"]) == (k, n, 1.0)
        assert m["clip/k_zero"] == float(k == 0)
        assert m["clip/alpha_run"] == pytest.approx(k_tot / n_tot)
        assert m["clip/alpha_n"] == pytest.approx(k_tot / n_tot * n)
    # a step that did not calibrate repeats none of them (a stale metric would)
    assert "clip/k" not in ctl.metrics(step + 1)


def test_alpha_n_reads_the_bf16_shadow_not_fp8():
    """FP8 ratios far below the bound, BF16 shadow clipping none: k = 0 and alpha_n = 0."""
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, CalibrationOptions(mode="pooled"))
    fp8, shadow, adv, mask = batch(7, clipped=0)
    fp8 = torch.where(adv < 0, fp8 * 0.5, fp8)  # every A<0 FP8 ratio below 1 - eps_low
    ctl.update(0, ratio=fp8, shadow_ratio=shadow, advantages=adv, mask=mask)
    m = ctl.metrics(0)
    assert m["clip/k"] == 0 and m["clip/alpha_n"] == 0.0 and m["clip/alpha_run"] == 0.0
    assert m["clip/n"] == int((adv < 0).sum())


def test_same_batch_logs_the_mean_over_the_step_windows():
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, CalibrationOptions(mode="same_batch"))
    fp8, shadow, adv, mask = batch(3, n=400, clipped=6)
    rows = torch.arange(400).view(4, 100)  # 4 sequences of 100 tokens: one window per sequence
    f2, s2, a2, m2 = (t.view(4, 100) for t in (fp8, shadow, adv, mask))
    plan = ctl.begin_step(0, eligible=torch.ones(4, dtype=torch.bool))
    ks, ns = [], []
    for i in range(4):
        w = plan.window(torch.tensor([i]))
        w.calibrate(f2[i:i + 1], s2[i:i + 1], a2[i:i + 1], m2[i:i + 1], seq=torch.tensor([i]))
        neg = a2[i] < 0
        ks.append(int((s2[i][neg] < V).sum()))
        ns.append(int(neg.sum()))
    out = plan.finish()
    assert out["clip/events"] == 4.0
    assert out["clip/k"] == pytest.approx(sum(ks) / 4) and out["clip/n"] == pytest.approx(sum(ns) / 4)
    assert out["clip/k_zero"] == pytest.approx(sum(k == 0 for k in ks) / 4)
    # alpha_n of window i uses the rate through window i
    want = [sum(ks[: i + 1]) / sum(ns[: i + 1]) * ns[i] for i in range(4)]
    assert out["clip/alpha_n"] == pytest.approx(sum(want) / 4)
    assert rows.numel() == 400


def test_static_alpha_logs_alpha_times_n_and_no_k():
    ctl = CalibratedClipController(EPS_LOW, EPS_HIGH, CalibrationOptions(mode="pooled", reference="static",
                                                                         alpha=0.01, upper_rule="fixed"))
    fp8, _, adv, mask = batch(5)
    ctl.update(0, ratio=fp8, advantages=adv, mask=mask)
    m = ctl.metrics(0)
    n = int((adv < 0).sum())
    assert m["clip/n"] == n and m["clip/alpha_n"] == pytest.approx(0.01 * n)
    assert "clip/k" not in m and "clip/alpha_run" not in m


def test_the_run_rate_survives_a_checkpoint():
    data = [batch(s, clipped=c) for s, c in enumerate([3, 0, 1])]

    def run(ctl, steps):
        for step in steps:
            fp8, shadow, adv, mask = data[step]
            ctl.update(step, ratio=fp8, shadow_ratio=shadow, advantages=adv, mask=mask)
        return ctl.metrics(steps[-1])

    whole = run(CalibratedClipController(EPS_LOW, EPS_HIGH, CalibrationOptions(mode="pooled")), [0, 1, 2])
    first = CalibratedClipController(EPS_LOW, EPS_HIGH, CalibrationOptions(mode="pooled"))
    run(first, [0, 1])
    resumed = CalibratedClipController(EPS_LOW, EPS_HIGH, CalibrationOptions(mode="pooled"))
    resumed.load_state_dict(first.state_dict())
    assert run(resumed, [2])["clip/alpha_n"] == pytest.approx(whole["clip/alpha_n"])
    assert resumed.metrics(2)["clip/alpha_run"] == pytest.approx(whole["clip/alpha_run"])
