"""Calibrated Clipping, the upper rules: H from the contribution balance (or a formula).

Upper rules (``UPPER_RULES`` registry), each given the clamped L and the calibration tokens:

- ``contribution`` (default): with the "contribution" of a token = |A| r (the weight its
  gradient gets in the surrogate), define
  ``p(L, H) = sum_{A>0, r <= H} |A| r / sum_{A<0, r >= L} |A| r``
  (numerator: unclipped positive tokens; denominator: unclipped negative tokens). H is set
  so that p on the FP8 ratios with (L, H) equals p on the BF16 ratios with the vanilla
  bounds (1 - eps_low, 1 + eps_high). p is a non-decreasing step function of H (strictly
  increasing steps, since every A>0 token has |A| r > 0), so the solver sorts the candidate
  A>0 FP8 ratios once, takes cumulative sums (float64), binary-searches the crossing of the
  target and picks the closer of the two steps around it (so p is reproduced to within one
  token's contribution, |A| r of the token at the crossing, whenever the target is reachable
  inside the clamps). Several H give the same p (an interval between two consecutive sorted
  ratios); among the closest steps we take the H nearest to the vanilla ``1 + eps_high``.
  If the target is not reachable (below the smallest or above the largest achievable p in
  ``(1, high_max]``), H is the bound of the nearest achievable step (the smallest / largest
  H range), again projected towards vanilla. The achieved and target p are metrics.
- ``proportional``: ``H = 1 + (1 - L) eps_high / eps_low`` (seen in a reimplementation),
  computed as ``(1 + eps_high) + ((1 - eps_low) - L) eps_high / eps_low`` so that L =
  vanilla gives exactly the vanilla H.
- ``fixed``: ``H = 1 + eps_high`` (only the lower bound moves; the paper reports this
  over-penalises, offered for the ablation).

Out of sample (the bounds rule later tokens). The contribution rule matches p *in sample*:
its numerator and denominator are sums over many tokens, so the order-statistic bias that
the lower bound needs a correction for (``lower.py``) is here about one token's contribution
over the sum; the simulation test (``tests/rl/test_calibration_unbiased.py``) measures the
out-of-sample FP8 p with (L, H) against the population BF16 p with the vanilla bounds.

Guesses: the definition of "contribution" (|A| r summed over unclipped tokens) and of
"unclipped" (A>0: r <= H; A<0: r >= L; the dual clip of A<0 tokens with r > c is ignored);
H among equal-p candidates nearest to vanilla; ``reference="static"`` with this rule takes
the BF16 p as a given constant.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8rl.registry import Registry
from fp8rl.rl.calibration.bounds import DegenerateCalibration
from fp8rl.rl.calibration.order_stats import in_dtype, next_down, next_up

__all__ = ["UPPER_RULES", "UpperInput", "solve_upper_contribution"]


def solve_upper_contribution(
    ratio_pos: torch.Tensor,
    weight_pos: torch.Tensor,
    target_sum: float,
    *,
    vanilla_high: float,
    high_max: float,
) -> tuple[float, float]:
    """H in (1, high_max] whose unclipped positive contribution is closest to ``target_sum``.

    Args:
        ratio_pos: ``[m]`` FP8 ratios of the A>0 tokens (finite, > 0).
        weight_pos: ``[m]`` their contributions |A| r (> 0).
        target_sum: the wanted ``sum_{r <= H} weight`` (= p_target x FP8 denominator).
        vanilla_high: tie-break target: among equally close H, the one nearest this.
        high_max: upper clamp (inclusive).

    Returns:
        ``(H, achieved_sum)``. Exact: S(H) = sum_{r <= H} w is a non-decreasing step function.
        Ratios <= 1 are always unclipped and ratios > high_max never, so only the ratios in
        [nextafter(1), high_max] are sorted (once); a cumulative sum gives every step and a
        binary search the crossing of the target. The two steps around the crossing are the
        only candidates (S is monotone); the closer one wins (on a tie, the one whose H
        interval lies nearer ``vanilla_high``), and H is ``vanilla_high`` projected onto that
        step's interval of H values.
    """
    dtype = ratio_pos.dtype
    h_lo = next_up(1.0, dtype)
    f64 = torch.float64
    always = ratio_pos < h_lo
    c0 = float(torch.where(always, weight_pos, 0).sum(dtype=f64))
    idx = ((~always) & (ratio_pos <= high_max)).nonzero().squeeze(1)
    xs, order = torch.sort(ratio_pos.index_select(0, idx))
    m = xs.numel()
    if m == 0:
        return _project_upper(vanilla_high, h_lo, high_max, True, dtype), c0
    cum = torch.cumsum(weight_pos.index_select(0, idx).index_select(0, order).to(f64), 0)
    cum += c0

    def step_at(j: int) -> tuple[float, float, float, bool]:
        """The step that includes xs[j] and its ties: (S, H interval lo, hi, is_last)."""
        v = xs[j]
        end = int(torch.searchsorted(xs, v, right=True))  # one past the last tie of v
        last = end == m
        return float(cum[end - 1]), float(v), high_max if last else float(xs[end]), last

    def step_below(j: int) -> tuple[float, float, float, bool] | None:
        """The step just below xs[j] (all ratios < xs[j]), or None if it is empty."""
        v = xs[j]
        start = int(torch.searchsorted(xs, v))  # first tie of v
        if start == 0:
            return (c0, h_lo, float(v), False) if float(v) > h_lo else None
        return float(cum[start - 1]), float(xs[start - 1]), float(v), False

    j = int(torch.searchsorted(cum, torch.tensor(target_sum, dtype=f64, device=cum.device)))  # first step >= target
    cands = [step_at(min(j, m - 1))]
    if j < m:
        below = step_below(j)
        if below is not None:
            cands.append(below)
    best = None
    for value, lo, hi, last in cands:
        h = _project_upper(vanilla_high, lo, hi, last, dtype)
        key = (abs(value - target_sum), abs(h - vanilla_high))
        if best is None or key < best[0]:
            best = (key, h, value)
    assert best is not None
    return best[1], best[2]


def _project_upper(target: float, lo: float, hi: float, closed: bool, dtype: torch.dtype) -> float:
    """The point of [lo, hi) ([lo, hi] if ``closed``) nearest ``target``, in ``dtype`` semantics."""
    t = in_dtype(target, dtype)
    if t < lo:
        return lo
    if closed:
        return target if target <= hi else hi
    return target if t < hi else next_down(hi, dtype)


# --------------------------------------------------------------------------------------
# Upper rules
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UpperInput:
    """What an upper rule may use (all 1-D, on the calibration tokens)."""

    low: float
    eps_low: float
    eps_high: float
    high_max: float
    r_neg: torch.Tensor
    a_neg: torch.Tensor  # |A| of A<0 tokens
    s_neg: torch.Tensor | None
    r_pos: torch.Tensor
    a_pos: torch.Tensor
    s_pos: torch.Tensor | None
    p_target: float | None  # static reference: the BF16 p given from outside


UpperRule = Callable[[UpperInput], tuple[float, float, float]]  # -> (H, p_target, p_achieved)

UPPER_RULES: Registry[UpperRule] = Registry("calibration upper rule")


@UPPER_RULES.register("fixed")
def _upper_fixed(u: UpperInput) -> tuple[float, float, float]:
    return 1.0 + u.eps_high, math.nan, math.nan


@UPPER_RULES.register("proportional")
def _upper_proportional(u: UpperInput) -> tuple[float, float, float]:
    vl, vh = 1.0 - u.eps_low, 1.0 + u.eps_high
    return vh + (vl - u.low) * u.eps_high / u.eps_low, math.nan, math.nan


@UPPER_RULES.register("contribution")
def _upper_contribution(u: UpperInput) -> tuple[float, float, float]:
    f64 = torch.float64
    vl, vh = 1.0 - u.eps_low, 1.0 + u.eps_high
    if u.p_target is None:
        assert u.s_neg is not None and u.s_pos is not None
        num = float(torch.where(u.s_pos <= vh, u.a_pos * u.s_pos, 0).sum(dtype=f64))
        den = float(torch.where(u.s_neg >= vl, u.a_neg * u.s_neg, 0).sum(dtype=f64))
        if not den > 0:
            raise DegenerateCalibration("BF16 p undefined: every A<0 shadow ratio is clipped")
        p_target = num / den
    else:
        p_target = u.p_target
    den_fp8 = float(torch.where(u.r_neg >= u.low, u.a_neg * u.r_neg, 0).sum(dtype=f64))
    if not den_fp8 > 0:
        raise DegenerateCalibration("FP8 p undefined: every A<0 FP8 ratio is below the lower bound")
    high, achieved = solve_upper_contribution(
        u.r_pos, u.a_pos * u.r_pos, p_target * den_fp8, vanilla_high=vh, high_max=u.high_max
    )
    return high, p_target, achieved / den_fp8
