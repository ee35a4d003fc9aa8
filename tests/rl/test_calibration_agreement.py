"""Which tokens are clipped: fp8rl.rl.calibration.agreement against a per-token loop."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl.rl.calibration.agreement import COUNT_KEYS, agreement_counts, agreement_metrics
from fp8rl.runs import metrics as M


def _loop(ratio, shadow, adv, mask, low, high, vl, vh):
    c = [0] * 6
    for r, s, a, m in zip(ratio.tolist(), shadow.tolist(), adv.tolist(), mask.tolist(), strict=True):
        if not m:
            continue
        if a < 0:
            b, f = s < vl, r < low
            c[0] += b
            c[1] += f
            c[2] += b and f
        elif a > 0:
            b, f = s > vh, r > high
            c[3] += b
            c[4] += f
            c[5] += b and f
    return c


@pytest.mark.parametrize("seed", range(5))
def test_counts_match_a_per_token_loop(seed):
    g = torch.Generator().manual_seed(seed)
    n = 2000
    shadow = torch.exp(0.15 * torch.randn(n, generator=g))
    ratio = shadow * torch.exp(0.1 * torch.randn(n, generator=g))  # FP8 = BF16 + noise
    adv = torch.randn(n, generator=g).round()  # some exact zeros: ignored
    mask = torch.rand(n, generator=g) > 0.2
    got = agreement_counts(ratio, shadow, adv, mask, low=0.75, high=1.3, vanilla_low=0.8, vanilla_high=1.2)
    assert got.tolist() == _loop(ratio, shadow, adv, mask, 0.75, 1.3, 0.8, 1.2)
    assert got.dtype == torch.int64


def test_identical_ratios_and_vanilla_bounds_agree_perfectly():
    g = torch.Generator().manual_seed(0)
    r = torch.exp(0.3 * torch.randn(4, 50, generator=g))
    adv = torch.tensor([-1.0, 1.0, -0.5, 2.0])  # one per sequence, broadcast over T
    counts = agreement_counts(r, r.clone(), adv, torch.ones(4, 50, dtype=torch.bool),
                              low=0.8, high=1.2, vanilla_low=0.8, vanilla_high=1.2)
    m = agreement_metrics(counts)
    assert m[M.SHADOW_LOW_BF16_N] > 0 and m[M.SHADOW_HIGH_BF16_N] > 0
    for k in (M.SHADOW_LOW_RECALL, M.SHADOW_LOW_PRECISION, M.SHADOW_HIGH_RECALL, M.SHADOW_HIGH_PRECISION):
        assert m[k] == 1.0


def test_a_ratio_on_the_bound_is_not_clipped():
    one = torch.ones(1, dtype=torch.bool)
    c = agreement_counts(torch.tensor([0.8]), torch.tensor([0.8]), torch.tensor([-1.0]), one,
                         low=0.8, high=1.2, vanilla_low=0.8, vanilla_high=1.2)
    assert c.tolist() == [0] * 6


def test_rates_are_ratios_of_pooled_counts_and_nan_when_empty():
    a = torch.tensor([4, 2, 1, 0, 0, 0])
    b = torch.tensor([0, 2, 1, 3, 1, 1])
    m = agreement_metrics(a + b)
    assert m[M.SHADOW_LOW_RECALL] == 2 / 4 and m[M.SHADOW_LOW_PRECISION] == 2 / 4
    assert m[M.SHADOW_HIGH_RECALL] == 1 / 3 and m[M.SHADOW_HIGH_PRECISION] == 1.0
    empty = agreement_metrics(torch.zeros(6, dtype=torch.int64))
    assert all(math.isnan(empty[k]) for k in empty if not k.endswith("_n"))
    assert set(COUNT_KEYS) <= set(M.TRAIN_METRICS) and set(COUNT_KEYS) <= set(M.SPARSE_METRICS)


def test_bad_input_is_refused():
    r = torch.ones(3)
    with pytest.raises(ValueError, match="shadow_ratio has shape"):
        agreement_counts(r, torch.ones(4), r, r, low=0.8, high=1.2, vanilla_low=0.8, vanilla_high=1.2)
    with pytest.raises(ValueError, match="advantages has shape"):
        agreement_counts(r, r, torch.ones(2), r, low=0.8, high=1.2, vanilla_low=0.8, vanilla_high=1.2)
    with pytest.raises(ValueError, match="vanilla bounds"):
        agreement_counts(r, r, r, r, low=0.8, high=1.2, vanilla_low=1.2, vanilla_high=0.8)
    with pytest.raises(ValueError, match="counts must have shape"):
        agreement_metrics(torch.zeros(5))
