"""The statistics of ``benchmarks/bench_peer_trl.py`` (TRL itself is only in the ``bench`` extra,
so the benchmark's runs are not part of the suite; its summary maths is)."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_peer_trl as bench


def coverage(n: int, lo: int, hi: int) -> float:
    """P(x_(lo) <= median < x_(hi)) for n draws of a continuous law, by counting how many of the
    n draws fall below the median (each pattern of 'below' / 'above' equally likely)."""
    hits = sum(1 for below in itertools.product((0, 1), repeat=n) if lo <= sum(below) < hi)
    return hits / 2**n


@pytest.mark.parametrize("n", [6, 7, 8, 9, 12, 16])
def test_median_interval_is_the_tightest_order_statistics_pair_with_95_percent_coverage(n):
    values = [float(i) for i in range(1, n + 1)][::-1]  # unsorted on purpose
    lo, hi = bench.median_ci95(values)
    k = int(lo)
    assert hi == n - k + 1
    assert coverage(n, k, n - k + 1) >= 0.95
    assert coverage(n, k + 1, n - k) < 0.95  # one step tighter would not cover


@pytest.mark.parametrize("n", [1, 2, 5])
def test_median_interval_needs_six_rounds(n):
    assert bench.median_ci95([1.0] * n) is None


def test_summary_ratios_are_peer_over_ours_per_round_and_pooled():
    def rows(totals):
        return [{"total_s": t, "cpu_s": t, "rollout_s": t / 2, "train_s": t / 2, "completion_len": 27}
                for t in totals]

    ours = [rows([1.0, 1.0, 1.0]), rows([2.0, 2.0, 2.0])]
    trl = [rows([3.0, 3.0, 3.0]), rows([3.0, 3.0, 3.0])]
    out = bench.summarize({"ours": ours, "trl": trl, "trl_kept": ours}, 27)
    assert out["speedup_rounds"] == [3.0, 1.5]
    assert out["speedup_spread"] == [1.5, 3.0]
    assert out["speedup"] == round(3.0 / 1.5, 3)  # pooled medians: 3 / median(1, 1, 1, 2, 2, 2)
    assert out["speedup_vs_trl_kept_rounds"] == [1.0, 1.0]
    assert out["trl_completion_len"] == 27
    assert math.isclose(out["speedup_rollout"], out["speedup"])
