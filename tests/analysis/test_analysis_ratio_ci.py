"""Intervals for a ratio of means over seeds (analysis.ratio_ci): references and coverage."""

import math

import numpy as np
import pytest

from analysis.ratio_ci import bootstrap_ratio, fieller_ratio, ratio_ci, t_quantile

# Student t 0.975 quantiles (printed tables, e.g. Abramowitz & Stegun 26.10)
T975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 9: 2.2622, 19: 2.0930, 29: 2.0452, 120: 1.9799}


@pytest.mark.parametrize(("df", "ref"), sorted(T975.items()))
def test_t_quantile_against_the_printed_table(df, ref):
    assert t_quantile(0.975, df) == pytest.approx(ref, abs=1e-4)
    assert t_quantile(0.025, df) == pytest.approx(-ref, abs=1e-4)


def test_t_quantile_other_levels():
    assert t_quantile(0.95, 9) == pytest.approx(1.8331, abs=1e-4)
    assert t_quantile(0.995, 2) == pytest.approx(9.9248, abs=1e-4)
    assert t_quantile(0.5, 5) == pytest.approx(0.0, abs=1e-9)


def _fieller_by_grid(x, y, paired, level=0.95):
    """Slow reference: R is in the set when a plain t test of mean(x) - R mean(y) = 0 does not
    reject; scanned over a fine grid with explicit loops."""
    x, y = list(map(float, x)), list(map(float, y))
    nx, ny = len(x), len(y)
    t = T975[(nx if paired else min(nx, ny)) - 1]
    grid = np.linspace(0.0, 10.0, 20001)
    inside = []
    for r in grid:
        if paired:
            d = [a - r * b for a, b in zip(x, y, strict=True)]
            m = sum(d) / nx
            var = sum((v - m) ** 2 for v in d) / (nx - 1) / nx
        else:
            mx, my = sum(x) / nx, sum(y) / ny
            m = mx - r * my
            var = (sum((v - mx) ** 2 for v in x) / (nx - 1) / nx
                   + r * r * sum((v - my) ** 2 for v in y) / (ny - 1) / ny)
        inside.append(m * m <= t * t * var)
    inside = np.array(inside)
    return grid[inside].min(), grid[inside].max()


@pytest.mark.parametrize("paired", [True, False])
def test_fieller_matches_a_grid_search(paired):
    rng = np.random.default_rng(3)
    for _ in range(4):
        n = int(rng.integers(3, 7))
        z = rng.standard_normal((n, 2))
        y = 1.0 + 0.1 * z[:, 1]
        x = 3.0 * y * (1 + 0.05 * z[:, 0])
        lo, hi = fieller_ratio(x, y, paired=paired)
        glo, ghi = _fieller_by_grid(x, y, paired)
        assert lo == pytest.approx(glo, abs=1e-3) and hi == pytest.approx(ghi, abs=1e-3)
        assert lo < x.mean() / y.mean() < hi


def test_fieller_unbounded_when_the_denominator_is_not_above_zero():
    assert fieller_ratio([1.0, 2.0, 1.5], [0.1, -0.1, 0.05], paired=True) == (-math.inf, math.inf)
    assert all(math.isnan(v) for v in fieller_ratio([1.0], [2.0], paired=True))


@pytest.mark.parametrize("paired", [True, False])
def test_bootstrap_against_a_slow_loop(paired):
    x = np.array([3.1, 2.7, 3.6, 2.9])
    y = np.array([1.0, 0.8, 1.3, 1.1])
    n_boot = 300
    rng = np.random.default_rng(11)
    ix = rng.integers(0, 4, size=(n_boot, 4))
    iy = ix if paired else rng.integers(0, 4, size=(n_boot, 4))
    ratios = []
    for b in range(n_boot):
        sx = sum(x[i] for i in ix[b]) / 4
        sy = sum(y[i] for i in iy[b]) / 4
        ratios.append(sx / sy)
    ref = np.quantile(ratios, [0.025, 0.975])
    got = bootstrap_ratio(x, y, paired=paired, n_boot=n_boot, seed=11)
    assert got == pytest.approx(tuple(ref), rel=1e-12)
    assert bootstrap_ratio(x, y, paired=paired, n_boot=n_boot, seed=11) == got  # deterministic


def _coverage(n_seeds, *, rho, cv, ratio=3.0, experiments=500, paired=True, seed=0):
    """Share of ``experiments`` synthetic experiments whose interval covers the true ratio:
    per seed, log-normal (x, y) with correlation ``rho`` on the log scale, E[x] / E[y] = ratio."""
    rng = np.random.default_rng(seed)
    s = math.sqrt(math.log(1 + cv * cv))
    hit = 0
    for _ in range(experiments):
        z = rng.standard_normal((n_seeds, 2))
        z[:, 1] = rho * z[:, 0] + math.sqrt(1 - rho * rho) * z[:, 1]
        x = ratio * 0.002 * np.exp(s * z[:, 0] - s * s / 2)
        y = 0.002 * np.exp(s * z[:, 1] - s * s / 2)
        lo, hi = fieller_ratio(x, y, paired=paired)
        hit += lo <= ratio <= hi
    return hit / experiments


@pytest.mark.parametrize("n_seeds", [3, 10])
def test_fieller_covers_the_true_ratio_95_percent_of_the_time(n_seeds):
    # 500 experiments: Monte-Carlo std of a 0.95 coverage is 0.0097, so [0.93, 0.97] is about ±2 std
    cov = _coverage(n_seeds, rho=0.8, cv=0.3, seed=n_seeds)
    assert 0.93 <= cov <= 0.97, cov


def test_dropping_the_pairing_overcovers_when_the_seeds_correlate():
    # what the test above guards: an unpaired interval on paired data is far too wide
    assert _coverage(10, rho=0.8, cv=0.3, paired=False, seed=10) > 0.98


def test_fieller_covers_a_pooled_recall_built_from_counts():
    """recall = sum both / sum bf16 over seeds: per seed bf16 ~ Poisson, both ~ Binomial, the
    seed's own recall varying around the truth; the interval on per-seed sums covers the
    population ratio of means E[both] / E[bf16] = true recall."""
    rng = np.random.default_rng(5)
    true, hit, experiments = 0.6, 0, 500
    for _ in range(experiments):
        bf16 = rng.poisson(200, 10).astype(float)
        both = rng.binomial(bf16.astype(int), np.clip(true + 0.08 * rng.standard_normal(10), 0, 1)).astype(float)
        lo, hi = fieller_ratio(both, bf16, paired=True)
        hit += lo <= true <= hi
    assert 0.93 <= hit / experiments <= 0.97, hit / experiments


def test_ratio_ci_pairs_by_key_and_says_why_there_is_no_interval():
    x = {("s", 0): 3.0, ("s", 1): 3.4, ("s", 2): 2.8}
    y = {("s", 2): 0.9, ("s", 0): 1.0, ("s", 1): 1.2}  # other order: pairing is by key
    ci = ratio_ci(x, y)
    assert ci.paired and ci.estimate == pytest.approx(np.mean([3, 3.4, 2.8]) / np.mean([1, 1.2, 0.9]))
    assert (ci.lo, ci.hi) == pytest.approx(fieller_ratio([3.0, 3.4, 2.8], [1.0, 1.2, 0.9], paired=True))
    assert ci.half_width == pytest.approx((ci.hi - ci.lo) / 2)
    # a seed missing on one side: independent samples, all runs used
    y2 = {k: v for k, v in y.items() if k != ("s", 2)}
    ci2 = ratio_ci(x, y2)
    assert not ci2.paired
    assert (ci2.lo, ci2.hi) == pytest.approx(fieller_ratio([3.0, 3.4, 2.8], [1.0, 1.2], paired=False))
    one = ratio_ci({("s", 0): 3.0}, {("s", 0): 1.0})
    assert one.estimate == 3.0 and one.note == "n/a (1 seed)" and one.interval_text() == "n/a (1 seed)"
    assert math.isnan(one.half_width)
    # non-finite values are dropped before pairing
    assert ratio_ci({**x, ("s", 3): math.nan}, y).paired


def test_ratio_ci_cuts_a_bounded_interval_to_the_parameter_space():
    ci = ratio_ci({0: 0.9, 1: 0.2, 2: 0.5}, {0: 1.0, 1: 1.0, 2: 1.0}, bounds=(0.0, 1.0))
    raw = fieller_ratio([0.9, 0.2, 0.5], [1.0, 1.0, 1.0], paired=True)
    assert raw[0] < 0 and raw[1] > 1
    assert (ci.lo, ci.hi) == (0.0, 1.0)
