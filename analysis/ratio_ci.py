"""Confidence intervals for a ratio of means over seeds: R = mean_s(x_s) / mean_s(y_s).

The report's "x BF16" numbers and the recall / precision of which tokens are clipped are such
ratios: x_s is a run's value for the FP8 arm (or the tokens both precisions clip), y_s the
BF16 arm's value for the same seed (or the tokens BF16 clips). The seed is the unit of
replication; steps and tokens within a run are not independent draws.

**The reported interval: Fieller's, with Student's t** (:func:`fieller_ratio`). R is in the
interval when the hypothesis mean(x) - R mean(y) = 0 is not rejected at the level by a t test:

- paired (every seed in both arms, once): on d_s(R) = x_s - R y_s, i.e.
  ``(mx - R my)^2 <= t^2 (sxx - 2 R sxy + R^2 syy) / n`` with t = t_{n-1, (1+level)/2};
- unpaired: ``(mx - R my)^2 <= t^2 (sxx / nx + R^2 syy / ny)`` with t on min(nx, ny) - 1
  degrees of freedom (Hsu's conservative choice instead of Welch's, which would depend on R).

It is exact when the per-seed values are normal, whatever the number of seeds. The interval is
unbounded (``lo = -inf, hi = inf``) when mean(y) is not significantly above zero at the level.

**Why not the bootstrap.** A percentile bootstrap over seeds (:func:`bootstrap_ratio`, also
computed and written to the CSVs) cannot reach its level with few seeds: it resamples from the
n values seen, so its spread is that of the sample (ddof = 0), and its quantiles are normal, not
t. Simulated on log-normal per-seed values (coefficient of variation 0.2-0.4, correlation 0.5,
500 experiments each): coverage of the 95% percentile bootstrap 0.75-0.79 at 3 seeds, 0.82-0.84
at 5, 0.87-0.89 at 10, 0.92-0.94 at 20 (BCa no better); Fieller 0.95-0.97 at every n. The
tests check Fieller's coverage by simulation and its bounds against a grid search.

Only numpy and the standard library (no scipy in the environment): the t quantile is computed
by bisection on the integral of the t density (:func:`t_quantile`); a two-sided p-value of a t
statistic through the regularized incomplete beta function (:func:`t_two_sided_p`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

LEVEL = 0.95
N_BOOT = 4000
BOOT_SEED = 20240607


def _t_cdf(x: float, df: float) -> float:
    """Student t CDF at ``x`` (df > 0): 0.5 + Simpson's rule on the density from 0 to |x|."""
    if x == 0:
        return 0.5
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    a = abs(x)
    # the density is smooth and bounded: Simpson on 4001 points is accurate to ~1e-9 here
    u = np.linspace(0.0, a, 4001)
    f = c * (1.0 + u * u / df) ** (-(df + 1) / 2)
    h = a / 4000
    area = h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())
    return 0.5 + math.copysign(area, x)


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (0 < p < 1, df > 0)."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if _t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) (a, b > 0, 0 <= x <= 1)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """Two-sided p-value of Student's t statistic ``t`` with ``df`` > 0 degrees of freedom:
    P(|T| >= |t|) = I_{df / (df + t^2)}(df / 2, 1 / 2) (exact at any |t|, unlike integrating the
    density; ``t = ±inf`` gives 0, NaN gives NaN)."""
    if not df > 0:
        raise ValueError(f"t_two_sided_p needs df > 0, got {df}")
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0
    return min(1.0, max(0.0, betainc(df / 2.0, 0.5, df / (df + t * t))))


def _xy(x, y) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(x, dtype=float).ravel(), np.asarray(y, dtype=float).ravel()


def fieller_ratio(x, y, *, paired: bool, level: float = LEVEL) -> tuple[float, float]:
    """Fieller's interval for mean(x) / mean(y) (see the module docstring).

    ``x`` [nx], ``y`` [ny] per-seed values (finite); ``paired``: x[i] and y[i] are the same
    seed (then nx == ny). Returns (lo, hi); (-inf, inf) when unbounded; (nan, nan) with fewer
    than two values on either side.
    """
    x, y = _xy(x, y)
    nx, ny = len(x), len(y)
    if nx < 2 or ny < 2:
        return math.nan, math.nan
    mx, my = float(x.mean()), float(y.mean())
    if paired:
        if nx != ny:
            raise ValueError(f"paired needs as many x as y values, got {nx} and {ny}")
        t = t_quantile(0.5 + level / 2, nx - 1)
        c = np.cov(x, y, ddof=1)
        vxx, vyy, vxy = c[0, 0] / nx, c[1, 1] / nx, c[0, 1] / nx
    else:
        t = t_quantile(0.5 + level / 2, min(nx, ny) - 1)
        vxx, vyy, vxy = float(x.var(ddof=1)) / nx, float(y.var(ddof=1)) / ny, 0.0
    t2 = t * t
    a = my * my - t2 * vyy
    b = mx * my - t2 * vxy  # the quadratic is a R^2 - 2 b R + c <= 0
    c0 = mx * mx - t2 * vxx
    if a <= 0:
        return -math.inf, math.inf
    disc = max(b * b - a * c0, 0.0)  # >= 0 up to rounding: R = mx / my satisfies the inequality
    r = math.sqrt(disc)
    return float((b - r) / a), float((b + r) / a)


def bootstrap_ratio(x, y, *, paired: bool, level: float = LEVEL, n_boot: int = N_BOOT,
                    seed: int = BOOT_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval for mean(x) / mean(y) over seeds.

    Paired: one draw of seed indices [n_boot, n] resamples x and y jointly; unpaired: x's
    indices [n_boot, nx] are drawn first, then y's [n_boot, ny], from one generator
    ``np.random.default_rng(seed)`` (deterministic). Resamples with mean(y) <= 0 count as +inf.
    Returns (lo, hi) (nan, nan with fewer than two values on either side).
    """
    x, y = _xy(x, y)
    if len(x) < 2 or len(y) < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    ix = rng.integers(0, len(x), size=(n_boot, len(x)))
    iy = ix if paired else rng.integers(0, len(y), size=(n_boot, len(y)))
    num, den = x[ix].mean(axis=1), y[iy].mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.inf)
    q = np.quantile(r, [0.5 - level / 2, 0.5 + level / 2])
    return float(q[0]), float(q[1])


@dataclasses.dataclass(frozen=True)
class RatioCI:
    """A ratio of means with its interval: ``estimate`` = mean(x) / mean(y) over all runs of each
    side; ``lo``, ``hi`` Fieller's interval; ``boot_lo``, ``boot_hi`` the percentile bootstrap;
    ``n_x``, ``n_y`` runs per side; ``paired`` whether the seeds paired; ``note`` why there is
    no interval ("" when there is one)."""

    estimate: float
    lo: float
    hi: float
    boot_lo: float
    boot_hi: float
    n_x: int
    n_y: int
    paired: bool
    note: str = ""

    @property
    def half_width(self) -> float:
        """(hi - lo) / 2 (the interval need not be symmetric about the estimate); NaN without one."""
        if math.isnan(self.lo) or math.isnan(self.hi):
            return math.nan
        return (self.hi - self.lo) / 2

    def interval_text(self, fmt: str = ".2f") -> str:
        """``"[lo, hi]"``, ``"unbounded"`` or the note (``"n/a (1 seed)"``)."""
        if self.note:
            return self.note
        if not (np.isfinite(self.lo) and np.isfinite(self.hi)):
            return "unbounded"
        return f"[{format(self.lo, fmt)}, {format(self.hi, fmt)}]"

    def as_dict(self, prefix: str) -> dict:
        """The fields as ``{prefix}_estimate, {prefix}_lo, ...`` (for a table's tidy data)."""
        return {f"{prefix}_estimate": self.estimate, f"{prefix}_lo": self.lo, f"{prefix}_hi": self.hi,
                f"{prefix}_half_width": self.half_width, f"{prefix}_boot_lo": self.boot_lo,
                f"{prefix}_boot_hi": self.boot_hi, f"{prefix}_n_x": self.n_x, f"{prefix}_n_y": self.n_y,
                f"{prefix}_paired": self.paired, f"{prefix}_note": self.note}


def ratio_ci(x: dict, y: dict, *, level: float = LEVEL, n_boot: int = N_BOOT, seed: int = BOOT_SEED,
             bounds: tuple[float, float] = (0.0, math.inf)) -> RatioCI:
    """mean(x) / mean(y) with its intervals; ``x``, ``y``: {pairing key: value} per run.

    The keys (e.g. (sweep, seed)) decide the pairing: when both sides hold the same set of keys,
    the seeds pair (x[k] with y[k]); otherwise the two sides are treated as independent samples
    and every run of each side is used. Non-finite values are dropped first. With fewer than two
    runs on either side the note is ``"n/a (1 seed)"`` (``"n/a (0 seeds)"`` with none); the
    estimate is NaN when mean(y) <= 0. A bounded interval is intersected with ``bounds``, the
    values R can take (a ratio of non-negative means is >= 0; a recall is <= 1 too): a
    confidence set cut to the parameter space keeps its coverage. An unbounded one stays so.
    """
    xs = {k: float(v) for k, v in x.items() if np.isfinite(v)}
    ys = {k: float(v) for k, v in y.items() if np.isfinite(v)}
    est = math.nan
    if xs and ys:
        mx, my = float(np.mean(list(xs.values()))), float(np.mean(list(ys.values())))
        est = mx / my if my > 0 else math.nan
    paired = len(xs) >= 2 and set(xs) == set(ys)
    n = min(len(xs), len(ys))
    if n < 2:
        return RatioCI(est, math.nan, math.nan, math.nan, math.nan, len(xs), len(ys), False,
                       f"n/a ({n} seed{'s' if n != 1 else ''})")
    if paired:
        keys = sorted(xs, key=str)
        xv, yv = [xs[k] for k in keys], [ys[k] for k in keys]
    else:
        xv, yv = list(xs.values()), list(ys.values())
    lo, hi = fieller_ratio(xv, yv, paired=paired, level=level)
    if math.isfinite(lo) and math.isfinite(hi):
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    blo, bhi = bootstrap_ratio(xv, yv, paired=paired, level=level, n_boot=n_boot, seed=seed)
    return RatioCI(est, lo, hi, blo, bhi, len(xs), len(ys), paired)
