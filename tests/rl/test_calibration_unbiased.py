"""Calibrated Clipping's lower bound out of sample: simulation against known distributions.

The bound computed on one calibration batch rules *new* tokens. For ratio distributions with
known cdfs we draw thousands of calibration batches (vectorised: ``[reps, n]``), compute L
per batch with the library's estimator, and average the exact out-of-sample fraction F(L)
of a new FP8 ratio below L; the target is alpha = G(1 - eps_low), the out-of-sample fraction
of the fixed vanilla bound on BF16 ratios. Table cells are mean F(L) / alpha.

Models (``MODELS``): log BF16 ratio = s_y e1, log FP8 ratio = log BF16 ratio + s_n e2 (the same
token; e1, e2 standard normal or Student-t with 3 dof), from small FP8 noise (F(v) ~ 1.3
alpha) to noise-dominated (F(v) ~ 16 alpha, the mini scale's regime). Three settings:

- ``shadow-paired``: ``reference="shadow"``, (FP8, BF16) pairs of the same tokens, as the
  trainer hands them; the setting the estimator is built for;
- ``shadow-indep``: ``reference="shadow"`` with the BF16 ratios drawn independently of the
  FP8 ones (same marginals): k carries no information about which FP8 ratios are low;
- ``static``: ``reference="static"`` with alpha given exactly (no BF16 ratios).

Measured (mean F(L) / alpha, 4x the quick test's repetitions, new | old estimator):

    shadow-paired             an=1          an=2          an=5          an=20         an=200
    lognormal small noise     1.091|1.259   1.011|1.174   1.015|1.097   0.998|1.026   0.996|0.999
    lognormal noise=spread    1.047|1.684   0.971|1.369   1.003|1.162   0.998|1.037   1.001|1.005
    lognormal noise-dominated 0.983|1.954   0.991|1.460   0.994|1.186   1.011|1.056   1.001|1.006
    log-t3 small noise        1.049|1.156   1.008|1.118   0.996|1.063   0.995|1.020   0.999|1.001
    log-t3 noise>spread       1.023|1.667   0.955|1.367   0.987|1.144   0.991|1.028   0.993|0.996
    log-t3 far tail           0.991|1.744   0.955|1.385   0.977|1.143   0.995|1.034   1.007|1.011
    shadow-indep
    lognormal small noise     1.216|1.421   1.068|1.239   1.017|1.123   1.004|1.043   1.001|1.006
    lognormal noise=spread    1.164|1.744   1.018|1.416   0.994|1.186   1.002|1.050   1.000|1.005
    lognormal noise-dominated 0.988|1.979   0.990|1.491   1.002|1.201   1.003|1.051   1.005|1.010
    log-t3 small noise        1.208|1.376   1.083|1.223   1.027|1.111   0.990|1.023   0.987|0.991
    log-t3 noise>spread       1.145|1.727   1.035|1.433   1.008|1.200   0.987|1.035   0.986|0.991
    log-t3 far tail           1.132|1.835   1.015|1.464   0.999|1.193   0.997|1.048   1.001|1.006
    static: new 0.98-1.01 in every cell; old 1.32-1.98 at an=1, 1.21-1.49 at an=2

- ``static``: unbiased in every cell (plotting position alpha (n + 1), no projection).
- ``shadow-paired``: within +-5% from alpha n = 2 on; at alpha n = 1 up to 1.09 with small
  FP8 noise: the projection to the vanilla bound, kept for exactness, fires when k = 0 and
  no FP8 ratio is below v, and F(v) > alpha there. The pairing term of the plotting position
  (p1, p2 in ``lower.py``) is what removes the rest: without it (position k (n + 1) / n)
  the paired cells average 0.95 at alpha n = 2 and 5 and "log-t3 far tail" is at 0.86 at 2.
- ``shadow-indep``: within +-10% where FP8 noise dominates and from alpha n = 5 on; at
  alpha n = 1 with F(v) within ~5x alpha it is 1.13-1.22 high (1.08 at alpha n = 2): with
  no coupling between k and the FP8 sample, unbiasedness needs "clip nothing" at k = 0
  (lower.py, step 2), and the exactness projection returns v there when no FP8 ratio is
  below it. Not the trainer's situation (its pairs are the same tokens); kept to show the
  price of the projection.
- k = 0 (issue 46): with k = 0 the estimator keeps the exactness projection (L = v when no FP8
  ratio is below v; else 0, "clip nothing"), against the variant that clips nothing whenever
  k = 0 (``k0_clip_nothing_rows``). Paired, current | variant (alpha n = 0.5 by the same
  harness with the seed 500):

    shadow-paired             an=0.5        an=1          an=2          an=3          an=5
    lognormal small noise     1.223|0.623   1.091|0.835   1.021|0.971   1.014|1.008   1.017|1.017
    lognormal noise=spread    1.419|0.909   1.077|0.995   0.983|0.978   0.994|0.994   1.002|1.002
    lognormal noise-dominated 0.910|0.905   0.967|0.967   1.000|1.000   0.983|0.983   0.991|0.991
    log-t3 small noise        1.110|0.511   1.053|0.752   1.016|0.941   0.990|0.972   0.999|0.996
    log-t3 noise>spread       1.367|0.853   1.018|0.929   0.968|0.966   0.961|0.961   0.988|0.988
    log-t3 far tail           1.297|0.826   1.005|0.935   0.947|0.947   0.938|0.938   0.974|0.974

  Independent BF16: 1.43-1.53|1.05-1.18 at alpha n = 0.5 (0.99|0.99 noise-dominated). Decision:
  keep the projection. In the trainer's paired setting dropping it biases the bound down by up
  to 49% at alpha n <= 1 with small FP8 noise (log-t3 small noise: 0.75 against 1.05 at alpha
  n = 1, asserted), and from alpha n = 3 on the two agree within 0.02 (asserted: 0.03 at a
  quarter of the repetitions), so pooling to alpha n >= 3 (``windowed``) settles k = 0; at
  alpha n = 0.5 neither rule is unbiased. lower.py, step 4, has the reading.
- contribution rule (log-normal, paired), out-of-sample p over the population BF16 p:
  new 0.97-1.00, old 0.98-1.00 at every alpha n (p is a sum over many tokens: the
  order-statistic bias is one token's contribution over the sum).

Runtime: the quick tests ~20 s on two shared CPU cores (the k = 0 ones ~4 s of it on a loaded
machine); the ``slow`` one (10x) ~4 min.

Tolerances asserted: +-10%, except the alpha n = 1 paired cells (0.9-1.15) and the alpha
n <= 2 independent cells of the models where noise does not dominate (0.9-1.3), for the
reasons above; the old estimator is asserted to fail (> 1.1 at alpha n = 1, > 1.05 at 2).
The contribution rule: the out-of-sample p of FP8 with (L, H) over the population BF16 p with
the vanilla bounds (log-normal only: with log-t ratios E[r] is infinite and p undefined).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
import torch

from fp8rl.rl.calibration import LOWER_ESTIMATORS, calibrate_bounds
from fp8rl.rl.calibration.lower import LowerInput, unbiased_lower_rows
from fp8rl.rl.calibration.order_stats import order_stat

EPS_LOW, EPS_HIGH = 0.2, 0.28
VL, VH = 1.0 - EPS_LOW, 1.0 + EPS_HIGH
AN = (1, 2, 5, 20, 200)
F64 = torch.float64


def _phi(z: torch.Tensor) -> torch.Tensor:
    return torch.special.ndtr(z)


def _t3_cdf(t: torch.Tensor) -> torch.Tensor:
    """Student-t cdf with 3 degrees of freedom, closed form."""
    r3 = math.sqrt(3.0)
    return 0.5 + (t / (r3 * (1 + t * t / 3)) + torch.atan(t / r3)) / math.pi


# t3 = sqrt(3) tan(theta), theta in (-pi/2, pi/2): density dt = (2/pi) cos^2(theta) dtheta; the
# midpoint rule in theta with 1000 nodes is exact to ~1e-6 relative here (64000 nodes as reference)
_M = 1000
_THETA = (torch.arange(_M, dtype=F64) + 0.5) / _M * math.pi - math.pi / 2
_T3_NODES = math.sqrt(3.0) * torch.tan(_THETA)
_T3_WEIGHTS = (2 / math.pi) * torch.cos(_THETA) ** 2 * (math.pi / _M)


@dataclass(frozen=True)
class Model:
    name: str
    tail: str  # "normal" | "t3"
    sy: float  # spread of the log BF16 ratio
    sn: float  # spread of the FP8 noise on the log ratio

    def _draw(self, g: torch.Generator, shape: tuple[int, int]) -> torch.Tensor:
        z = torch.randn(shape, generator=g, dtype=F64)
        if self.tail == "t3":
            chi2 = (torch.randn((*shape, 3), generator=g, dtype=F64) ** 2).sum(-1)
            z = z / torch.sqrt(chi2 / 3)
        return z

    def _g(self, t: torch.Tensor) -> torch.Tensor:
        return _phi(t) if self.tail == "normal" else _t3_cdf(t)

    @property
    def alpha(self) -> float:
        """G(v): the out-of-sample fraction of BF16 ratios below the vanilla bound."""
        return float(self._g(torch.tensor(math.log(VL) / self.sy, dtype=F64)))

    def F(self, x: torch.Tensor) -> torch.Tensor:
        """The FP8 ratio's cdf (``[R]`` -> ``[R]``): exact for normal, quadrature for t3."""
        lx = torch.log(x.clamp(min=1e-300).to(F64))
        if self.tail == "normal":
            return _phi(lx / math.hypot(self.sy, self.sn))
        grid, table = _t3_table(self)  # linear in log x between 8001 points of [log 1e-3, log 2]
        i = torch.searchsorted(grid, lx.clamp(grid[0], grid[-1])).clamp(1, grid.numel() - 1)
        w = (lx.clamp(grid[0], grid[-1]) - grid[i - 1]) / (grid[i] - grid[i - 1])
        return table[i - 1] + w * (table[i] - table[i - 1])

    def F_quadrature(self, lx: torch.Tensor) -> torch.Tensor:
        """t3: the FP8 cdf at log ratios ``lx`` by quadrature over the noise."""
        inner = self._g((lx[:, None] - self.sn * _T3_NODES[None]) / self.sy)
        return (inner * _T3_WEIGHTS).sum(1).clamp(0, 1)

    def sample(self, g: torch.Generator, reps: int, n: int, paired: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp8 [reps, n], bf16 [reps, n])`` ratios; paired = the same tokens."""
        ly = self.sy * self._draw(g, (reps, n))
        base = ly if paired else self.sy * self._draw(g, (reps, n))
        lx = base + self.sn * self._draw(g, (reps, n))
        return torch.exp(lx), torch.exp(ly)


@functools.cache
def _t3_table(model: Model) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.linspace(math.log(1e-3), math.log(2.0), 8001, dtype=F64)
    return grid, model.F_quadrature(grid)


MODELS = (
    Model("lognormal small noise", "normal", 0.12, 0.05),
    Model("lognormal noise=spread", "normal", 0.12, 0.12),
    Model("lognormal noise-dominated", "normal", 0.10, 0.25),
    Model("log-t3 small noise", "t3", 0.08, 0.03),
    Model("log-t3 noise>spread", "t3", 0.08, 0.10),
    Model("log-t3 far tail", "t3", 0.06, 0.08),
)


def in_sample_rows(x: torch.Tensor, clipped: torch.Tensor | None, alpha: float | None) -> torch.Tensor:
    """The old (in_sample) estimator, batched, for tie-free rows: the point of (s_k, s_{k+1}]
    nearest v. Checked against the library's ``in_sample`` in ``test_in_sample_replica``."""
    R, n = x.shape
    xs = torch.sort(x, 1).values
    k = clipped.sum(1) if clipped is not None else torch.full((R,), math.floor(alpha * n + 0.5))
    lo = torch.where(k > 0, xs.gather(1, (k - 1).clamp(0, n - 1)[:, None])[:, 0], torch.full((R,), -math.inf, dtype=x.dtype))
    hi = torch.where(k < n, xs.gather(1, k.clamp(0, n - 1)[:, None])[:, 0], torch.full((R,), math.inf, dtype=x.dtype))
    inside = (lo < VL) & (VL <= hi)
    other = torch.where(VL <= lo, torch.nextafter(lo, hi), hi).double()
    return torch.where(inside, torch.full_like(other, VL), other)


def k0_clip_nothing_rows(x: torch.Tensor, clipped: torch.Tensor) -> torch.Tensor:
    """The rejected k = 0 rule, for the comparison: ``unbiased`` but 0 (clip nothing) whenever
    k = 0, i.e. without the exactness projection to v there (shadow reference only)."""
    low = unbiased_lower_rows(x, VL, clipped=clipped)
    return torch.where(clipped.sum(1) == 0, torch.zeros_like(low), low)


def _reps(n: int, scale: float) -> int:
    """Batches per cell: ~400k ratios per cell at scale 1 (at most 6000 batches, at least 40)."""
    return int(max(40, min(6000, 400_000 // n)) * scale)


@functools.cache  # deterministic: the tests below share cells
def cell(model: Model, an: int, kind: str, estimator: str, scale: float = 1.0, seed: int = 0) -> float:
    """Mean out-of-sample F(L) / alpha over many calibration batches of n = alpha n / alpha tokens."""
    alpha = model.alpha
    n = max(2, round(an / alpha))
    reps = _reps(n, scale)
    g = torch.Generator().manual_seed(seed + 1000 * an)
    low_min = 1e-3  # the estimator, not the clamp (the default 0.5 would lift some tails' L)
    tot, done = 0.0, 0
    while done < reps:  # chunks keep memory bounded
        r = min(reps - done, max(1, 2_000_000 // n))
        x, y = model.sample(g, r, n, paired=(kind == "shadow-paired"))
        clipped, a = (None, alpha) if kind == "static" else (y < VL, None)
        if estimator == "unbiased":
            low = unbiased_lower_rows(x, VL, clipped=clipped, alpha=a)
        elif estimator == "k0_clip_nothing":
            low = k0_clip_nothing_rows(x, clipped)
        else:
            low = in_sample_rows(x, clipped, a)
        low = low.clamp(low_min, float(torch.nextafter(torch.tensor(1.0, dtype=F64), torch.tensor(0.0, dtype=F64))))
        tot += float(model.F(low).sum())
        done += r
    return tot / reps / alpha


# ---------------------------------------------------------------------------------------
# The estimator's plumbing: batched rows == calibrate_bounds; a slow reference with ties
# ---------------------------------------------------------------------------------------


def test_order_stat_batched_matches_kthvalue():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 7, (9, 13), generator=g).float()  # ties
    ranks = torch.randint(1, 14, (9,), generator=g)
    rows = order_stat(x, ranks)
    one = torch.cat([order_stat(x[i : i + 1], ranks[i : i + 1]) for i in range(9)])
    assert torch.equal(rows, one)
    assert torch.equal(rows, torch.sort(x, 1).values.gather(1, (ranks - 1)[:, None])[:, 0])
    for j in (1, 2, 12, 13):  # the extremes take a min/max shortcut for one row
        assert float(order_stat(x[4:5], torch.tensor([j]))) == float(torch.sort(x[4]).values[j - 1])
    with pytest.raises(ValueError, match="order_stat"):
        order_stat(x[0], ranks)


def test_in_sample_replica():
    """The batched old estimator used in the tables is the library's ``in_sample``."""
    g = torch.Generator().manual_seed(1)
    for kind in ("shadow", "static"):
        x, y = MODELS[1].sample(g, 40, 60, paired=True)
        x, y = x.float(), y.float()
        clipped = y < VL
        ref = in_sample_rows(x, clipped if kind == "shadow" else None, 0.05 if kind == "static" else None)
        for i in range(40):
            cal = calibrate_bounds(
                x[i], y[i] if kind == "shadow" else None, -torch.ones(60), torch.ones(60), eps_low=EPS_LOW,
                eps_high=EPS_HIGH, upper_rule="fixed", lower_estimator="in_sample", low_min=1e-3,
                alpha=0.05 if kind == "static" else None,
            )
            assert cal.low == min(float(ref[i]), float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))), (kind, i)


def slow_unbiased(x: list[float], y: list[float] | None, alpha: float | None) -> float:
    """lower.py's formula, by a sorted Python list (float64 arithmetic, float32 comparisons)."""
    n = len(x)
    s = sorted(x)

    def at(pos: float) -> float:
        if pos > n:
            return float(torch.nextafter(torch.tensor(s[-1]), torch.tensor(math.inf)))
        j0 = min(max(math.floor(pos), 1), n)
        f = pos - j0
        return s[j0 - 1] + f * (s[min(j0 + 1, n) - 1] - s[j0 - 1])

    vl32 = float(torch.tensor(VL))
    if y is None:
        j = alpha * (n + 1)
        if j >= 1:
            return at(j)
        return 0.0 if alpha == 0 or n == 1 else s[0] * (s[1] / s[0]) ** math.log2(j)
    lab = [yi < vl32 for yi in y]
    k = sum(lab)
    if sum(xi < vl32 for xi in x) == k:
        return VL
    if k == 0:
        return 0.0
    sk = s[k - 1]
    low = [i for i in range(n) if x[i] <= sk]
    high = [i for i in range(n) if x[i] > sk]
    p1 = sum(lab[i] for i in low) / len(low)
    p2 = sum(lab[i] for i in high) / len(high) if high else 0.0
    return at(k + (p1 / (1 + p1 - p2) if p1 > 0 else 0.0))


@pytest.mark.parametrize("seed", range(6))
def test_unbiased_against_slow_reference_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    n = 40
    x = torch.randint(0, 14, (n,), generator=g).float() / 16 + 0.5  # heavy ties, some exactly 0.8
    y = x + (torch.randint(-3, 4, (n,), generator=g).float() / 16) * (seed % 3)  # seed % 3 == 0: identical
    adv = -torch.rand(n, generator=g) - 0.1
    mask = torch.ones(n, dtype=torch.bool)
    kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, upper_rule="fixed", low_min=1e-3)
    ref = slow_unbiased(x.tolist(), y.tolist(), None)
    cal = calibrate_bounds(x, y, adv, mask, **kw)
    cap = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))
    assert cal.low == pytest.approx(min(max(ref, 1e-3), cap), rel=1e-12)
    if seed % 3 == 0:
        assert cal.low == VL  # identical ratios: vanilla, exactly
    for alpha in (0.0, 0.01, 0.02, 0.05, 0.2, 0.5, 0.99):
        ref = slow_unbiased(x.tolist(), None, alpha)
        cal = calibrate_bounds(x, None, adv, mask, alpha=alpha, **kw)
        assert cal.low == pytest.approx(min(max(ref, 1e-3), cap), rel=1e-12), alpha


def test_rows_equal_calibrate_bounds():
    g = torch.Generator().manual_seed(3)
    x, y = MODELS[2].sample(g, 30, 50, paired=True)
    rows = unbiased_lower_rows(x, VL, clipped=y < VL)
    for i in range(30):
        cal = calibrate_bounds(x[i], y[i], -torch.ones(50, dtype=F64), torch.ones(50), eps_low=EPS_LOW,
                               eps_high=EPS_HIGH, upper_rule="fixed", low_min=1e-3)
        assert cal.low == min(max(float(rows[i]), 1e-3), float(torch.nextafter(torch.tensor(1.0, dtype=F64), torch.tensor(0.0, dtype=F64))))


def test_estimator_registry_and_bad_input():
    assert set(LOWER_ESTIMATORS.names()) == {"unbiased", "in_sample"}
    x = torch.rand(1, 5) + 0.5
    with pytest.raises(KeyError, match="valid names are: in_sample, unbiased"):
        calibrate_bounds(x, x, -torch.ones(1, 5), torch.ones(1, 5), eps_low=0.2, eps_high=0.28, lower_estimator="median")
    with pytest.raises(ValueError, match="exactly one"):
        unbiased_lower_rows(x, VL)
    with pytest.raises(ValueError, match="bool tensor"):
        unbiased_lower_rows(x, VL, clipped=torch.zeros(1, 4, dtype=torch.bool))


def test_k0_projection_to_vanilla_else_clip_nothing():
    """k = 0 (no BF16 ratio below v): L = v exactly when no FP8 ratio is below v either (an FP8
    ratio equal to v is not below it), else 0, "clip nothing" (lower.py, steps 3 and 4)."""
    rows = torch.tensor([[0.85, 0.9, 1.1, 1.2, 0.95],   # no FP8 ratio below v
                         [VL, 0.9, 1.1, 1.2, 0.95],     # one exactly at v: not below
                         [0.85, 0.9, 1.1, 1.2, 0.7],    # one below v
                         [0.5, 0.6, 1.1, 1.2, 0.95]], dtype=F64)
    none = torch.zeros_like(rows, dtype=torch.bool)  # k = 0 in every row
    want = [VL, VL, 0.0, 0.0]
    assert unbiased_lower_rows(rows, VL, clipped=none).tolist() == want
    est = LOWER_ESTIMATORS["unbiased"]
    assert [est(LowerInput(x, c, None, VL)) for x, c in zip(rows, none, strict=True)] == want
    for dtype in (torch.float32, torch.bfloat16):  # comparisons with v in x's dtype
        x = torch.tensor([0.85, 0.9, 1.1], dtype=dtype)
        assert est(LowerInput(x, torch.zeros(3, dtype=torch.bool), None, VL)) == VL, dtype
        assert est(LowerInput(torch.cat([x, x[:1] - 0.2]), torch.zeros(4, dtype=torch.bool), None, VL)) == 0.0, dtype


def test_model_cdfs_against_monte_carlo():
    """The exact/quadrature cdfs the simulation scores with agree with a large sample."""
    g = torch.Generator().manual_seed(7)
    pts = torch.tensor([0.7, 0.75, 0.8, 0.85, 0.9], dtype=F64)
    for m in MODELS:
        x, y = m.sample(g, 400, 1000, paired=True)
        emp_f = (x.reshape(-1)[:, None] < pts).double().mean(0)
        assert torch.allclose(m.F(pts), emp_f, rtol=0.03), m.name  # MC: <= 1% relative s.e.
        assert abs(float((y < VL).double().mean()) / m.alpha - 1) < 0.03, m.name
        if m.tail == "t3":  # the table is the quadrature
            assert torch.allclose(m.F(pts), m.F_quadrature(pts.log()), rtol=1e-4), m.name


# ---------------------------------------------------------------------------------------
# The simulation
# ---------------------------------------------------------------------------------------

# (kind, alpha n) -> (lo, hi) band for mean F(L) / alpha; +-10% unless the docstring says why
def _band(kind: str, an: int, model: Model) -> tuple[float, float]:
    if kind == "shadow-paired" and an == 1:
        return 0.9, 1.15
    if kind == "shadow-indep" and an <= 2 and model.name != "lognormal noise-dominated":
        return 0.9, 1.3
    return 0.9, 1.1


@pytest.mark.parametrize("kind", ["shadow-paired", "shadow-indep", "static"])
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name.replace(" ", "-"))
def test_unbiased_out_of_sample_fraction(model, kind):
    for an in AN:
        ratio = cell(model, an, kind, "unbiased")
        lo, hi = _band(kind, an, model)
        assert lo <= ratio <= hi, (model.name, kind, an, ratio)


@pytest.mark.parametrize("kind", ["shadow-paired", "shadow-indep", "static"])
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name.replace(" ", "-"))
def test_in_sample_estimator_is_biased(model, kind):
    """The test discriminates: the old estimator fails +-10% at alpha n = 1 and 2 ..."""
    r1 = cell(model, 1, kind, "in_sample")
    r2 = cell(model, 2, kind, "in_sample")
    assert r1 > 1.1 and r2 > 1.05, (model.name, kind, r1, r2)
    # ... and the new one is closer to alpha in every such cell
    for an, old in ((1, r1), (2, r2)):
        new = cell(model, an, kind, "unbiased")
        assert abs(new - 1) < abs(old - 1), (model.name, kind, an, new, old)


def test_pairing_term_removes_the_remaining_bias():
    """Averaged over the paired models at alpha n = 2 and 5, the bias is within +-3%.

    This is what the pairing term p1 / (1 + p1 - p2) buys over the plain position k (n + 1) / n
    (which ignores that BF16-clipped tokens have low FP8 ratios): that one averages 0.95 here.
    """
    ratios = [cell(m, an, "shadow-paired", "unbiased") for m in MODELS for an in (2, 5)]
    assert abs(sum(ratios) / len(ratios) - 1) < 0.03, ratios


def test_k0_rule_matters_only_below_alpha_n_3():
    """The k = 0 decision (keep the projection) in the paired setting: from alpha n = 3 on the
    current rule and "clip nothing at k = 0" agree within 0.03 in every model (the same draws
    score both: they differ only on the k = 0 batches, ~exp(-alpha n) of them) ..."""
    for m in MODELS:
        for an in (3, 5):
            cur = cell(m, an, "shadow-paired", "unbiased", scale=0.25)
            alt = cell(m, an, "shadow-paired", "k0_clip_nothing", scale=0.25)
            assert abs(cur - alt) < 0.03, (m.name, an, cur, alt)


def test_k0_clip_nothing_is_biased_down_at_alpha_n_1():
    """... while at alpha n = 1 with small FP8 noise clipping nothing at k = 0 is > 15% low where
    the current rule is within 10%: "log-t3 small noise" (0.75 against 1.05; "lognormal small
    noise": 0.84 against 1.09)."""
    got = {m.name: (cell(m, 1, "shadow-paired", "unbiased"), cell(m, 1, "shadow-paired", "k0_clip_nothing"))
           for m in MODELS if "small noise" in m.name}
    biased = [name for name, (cur, alt) in got.items() if alt < 0.85 and abs(cur - 1) < 0.1]
    assert "log-t3 small noise" in biased, got


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["shadow-paired", "shadow-indep", "static"])
def test_unbiased_out_of_sample_fraction_more_repetitions(kind):
    for model in MODELS:
        for an in AN:
            ratio = cell(model, an, kind, "unbiased", scale=10.0, seed=1)
            lo, hi = _band(kind, an, model)
            assert lo <= ratio <= hi, (model.name, kind, an, ratio)


# ---------------------------------------------------------------------------------------
# The contribution rule out of sample
# ---------------------------------------------------------------------------------------


def _trunc_mean(sigma: float, lo: float, hi: float) -> float:
    """E[r 1(lo <= r <= hi)] for log r ~ N(0, sigma^2)."""
    def cdf(b):
        return float(_phi(torch.tensor((math.log(b) - sigma**2) / sigma, dtype=F64))) if b < math.inf else 1.0
    return math.exp(sigma**2 / 2) * (cdf(hi) - (cdf(lo) if lo > 0 else 0.0))


def contribution_cell(model: Model, an: int, estimator: str, reps: int, seed: int = 0) -> float:
    """Mean over batches of p_FP8(L, H) out of sample / p_BF16(vanilla) (population).

    Tokens: n A<0 and n A>0, |A| = 1, paired log-normal ratios. Population p(L, H) =
    E[r; r <= H] / E[r; r >= L] (equal token counts and |A| cancel).
    """
    assert model.tail == "normal"
    sx = math.hypot(model.sy, model.sn)
    p_bf16 = _trunc_mean(model.sy, 0.0, VH) / _trunc_mean(model.sy, VL, math.inf)
    n = max(2, round(an / model.alpha))
    g = torch.Generator().manual_seed(seed + an)
    adv = torch.cat([-torch.ones(n, dtype=F64), torch.ones(n, dtype=F64)])
    mask = torch.ones(2 * n, dtype=torch.bool)
    acc = 0.0
    for _ in range(reps):
        x, y = model.sample(g, 2, n, paired=True)
        cal = calibrate_bounds(x.reshape(-1), y.reshape(-1), adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                               lower_estimator=estimator, low_min=0.05, high_max=4.0)
        acc += _trunc_mean(sx, 0.0, cal.high) / _trunc_mean(sx, cal.low, math.inf) / p_bf16
    return acc / reps


@pytest.mark.parametrize("model", [m for m in MODELS if m.tail == "normal"], ids=lambda m: m.name.replace(" ", "-"))
def test_contribution_rule_out_of_sample(model):
    for an in AN:
        ratio = contribution_cell(model, an, "unbiased", reps=40 if an < 200 else 10)
        assert 0.9 <= ratio <= 1.1, (model.name, an, ratio)
