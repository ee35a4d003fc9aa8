"""Calibrated Clipping, the lower bound: L so that FP8 clips the fraction of A<0 tokens BF16 would.

Notation: the n A<0 tokens of one calibration have FP8 ratios x_1..x_n with order statistics
s_1 <= ... <= s_n, and BF16 shadow ratios y_i (same tokens); v = 1 - eps_low is the vanilla
bound; k = #(y_i < v) is what vanilla BF16 clips among them. The bound rules *later* tokens
(the next steps with ``periodic``/``pooled`` calibration), drawn from the same distribution:
F, G = the cdfs of a new token's FP8 and BF16 ratio. The BF16 vanilla bound is fixed, so its
out-of-sample fraction is alpha = G(v), unbiasedly estimated by k / n. The goal of the
``unbiased`` estimator: **E[F(L)] = alpha** (E over calibration batches), for alpha n down to 1.

Estimators (``LOWER_ESTIMATORS`` registry):

- ``in_sample`` (the first implementation; for the ablation): L in (s_k, s_{k+1}], the bounds
  that clip exactly k of *these* FP8 ratios, at the point nearest v (v itself if it lies
  inside, else s_{k+1}, or the next representable number above s_k; ties: the achievable
  count nearest k, the smaller on a tie); static reference: k = floor(alpha n + 1/2). Exact
  for the tokens it was computed on (``same_batch`` calibration, where the bounds rule the very
  tokens they come from), but biased for new ones: when FP8 is noisier L = s_{k+1}, and a new
  ratio falls below s_{k+1} with probability (k+1)/(n+1), about 2 alpha at alpha n = 1.
- ``unbiased`` (default): the derivation follows.

1. Plotting position. For i.i.d. continuous ratios F(s_j) ~ Beta(j, n + 1 - j): a new ratio
   falls below s_j with probability j / (n + 1). A bound at a fractional position j, linear
   between s_floor(j) and s_ceil(j), has E F(L) ~= j / (n + 1) (exact where F is linear
   between neighbouring order statistics; in a convex lower tail slightly less). With alpha
   known (``reference="static"``) the position is j* = alpha (n + 1).
2. alpha estimated from the same tokens (``reference="shadow"``). If the FP8 sample were
   independent of k, j* = (k / n)(n + 1) would give E F(L) = E[k] / n = alpha; a rule that
   reads only (x, k) must then clip nothing out of sample when k = 0 (E[g(k)] = alpha for
   every alpha forces g(k) = k / n). But x and y are the same tokens: the BF16-clipped tokens
   tend to have the lowest FP8 ratios, and then k and s_k move together. Exchangeability
   gives the general condition: with the new token as token n + 1, P(x_{n+1} < L) =
   E[sum_m 1(x_m < L^(-m))] / (n + 1) (L^(-m): the bound without token m) and alpha =
   E[K] / (n + 1) (K: BF16-clipped among all n + 1). Rank the n + 1 tokens by FP8 ratio and
   let b_j = 1 if the token of FP8 rank j is BF16-clipped. For a bound at position k + c
   (c in [0, 1]; interpolating ~ choosing s_{k+1} with probability c), the tokens of rank
   <= K - 1 are always counted, those of rank >= K + 2 never, so the sum is
   K - 1 + (1 - b_K) + c b_K + c (1 - b_{K+1}); its expectation is K iff
   **c = P(b_K = 1) / (1 + P(b_K = 1) - P(b_{K+1} = 1))**. Independent FP8 and BF16:
   P(b = 1) = K / (n + 1) at every rank, c ~= k / n (step 2's first formula). FP8 a monotone
   function of BF16: b_K = 1, b_{K+1} = 0, c = 1/2. We plug in p1 = the BF16-clipped
   fraction among the tokens with FP8 ratio <= s_k (for P(b_K = 1)) and p2 = the fraction
   among the others (for P(b_{K+1} = 1)): **j* = k + p1 / (1 + p1 - p2)**, j* = 0 when k = 0.
3. Exactness (projection). When v itself clips exactly k FP8 ratios (#(x < v) = k, i.e. v in
   (s_k, s_{k+1}], ties included), L = v, as in ``in_sample``: identical BF16 and FP8 ratios
   give the vanilla bounds exactly, and when FP8 noise is small next to the spacing of the
   order statistics (FP8 ~ monotone in BF16) this is the exact rule (the sum in step 2 is
   then K for every sample). Its price: with FP8 independent of BF16 and F(v) close to alpha
   it is a bias upwards at alpha n <= 2 (measured in the simulation test).
4. Outside [1, n]. k = 0 without projection: L = 0, i.e. the clamp ``low_min`` ("clip
   nothing", step 2). k = 0 *with* the projection (no FP8 ratio below v either) keeps L = v:
   decided in issue 46 against "clip nothing whenever k = 0". In the trainer's setting (paired:
   FP8 and BF16 ratios of the same tokens) a batch with k = 0 and no FP8 ratio below v is one
   where v is about right when FP8 noise is small, and dropping the projection there biases the
   bound down: mean F(L) / alpha 0.75-0.84 at alpha n = 1 and 0.51-0.62 at 0.5 in the two
   small-noise models (the projection: 1.05-1.09 and 1.11-1.22), 0.83-1.00 in the others
   (projection 0.91-1.42 at 0.5, 0.97-1.08 at 1). At alpha n = 0.5 neither rule is unbiased;
   from alpha n = 3 on the two agree within 0.02 in every paired model (a calibration sees
   k = 0 with probability ~exp(-alpha n)), within 0.01 where FP8 noise dominates (the mini
   regime). So the k = 0 question is settled by pooling to alpha n >= 3 (the ``windowed``
   mode's ``window_target``), not here. The projection costs where FP8 is independent of BF16
   (not the trainer's setting): 1.43-1.53 at alpha n = 0.5 against 1.05-1.18 without it where
   noise does not dominate. Static j* < 1: power-law tail (F(x) ~ x^lambda near the minimum, so
   positions 1 and 2 sit at s_1 and s_2): L = s_1 (s_2 / s_1)^(log2 j*), L -> 0 as j* -> 0;
   n = 1: L = 0. j* > n: the next number above s_n (every FP8 ratio clipped); the caller
   clamps L below 1.

Measured (``tests/rl/test_calibration_unbiased.py``, thousands of batches per cell, mean
F(L) / alpha over paired FP8 = BF16 x noise ratios, log-normal and log-t3, FP8 noise from
0.4x to 2.5x the BF16 spread): ``unbiased`` 0.98-1.09 at alpha n = 1, 0.95-1.02 from
alpha n = 2 on; ``in_sample`` 1.16-1.95 at alpha n = 1, 1.12-1.46 at 2, 1.06-1.19 at 5.
With a static alpha: 0.98-1.01 everywhere. The test's docstring has the table and the
cells where the exactness projection costs more (FP8 drawn independently of BF16).

Guesses (none of this is in the paper): the plotting position j / (n + 1) and linear
interpolation in the ratio (not its log); p1, p2 pooled over all ranks below / above k (a
local estimate near rank k would be less biased under partial coupling, and noisier); the
projection to v (kept for exactness, at the cost above, k = 0 included: step 4); k = 0 with an
FP8 ratio below v -> ``low_min``; the power-law extrapolation below s_1 (static only: with the
shadow j* >= 1 whenever k >= 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8rl.registry import Registry
from fp8rl.rl.calibration.order_stats import lower_interval, order_stats, project_lower

__all__ = ["LOWER_ESTIMATORS", "LowerInput", "unbiased_lower_rows"]


@dataclass(frozen=True)
class LowerInput:
    """What a lower estimator may use: ``x`` ``[n]`` FP8 ratios of the A<0 tokens (finite, > 0);
    ``clipped`` ``[n]`` bool, BF16 ratio < v (shadow) or None (static); ``alpha`` the static
    target (None for shadow); ``vanilla_low`` v."""

    x: torch.Tensor
    clipped: torch.Tensor | None
    alpha: float | None
    vanilla_low: float


LowerEstimator = Callable[[LowerInput], float]  # -> L (unclamped; <= 0 means "clip nothing")

LOWER_ESTIMATORS: Registry[LowerEstimator] = Registry("calibration lower estimator")


@LOWER_ESTIMATORS.register("in_sample")
def _lower_in_sample(inp: LowerInput) -> float:
    x = inp.x
    n = x.numel()
    k = int(inp.clipped.sum()) if inp.clipped is not None else math.floor(inp.alpha * n + 0.5)
    a, b, _ = lower_interval(x, k)
    return project_lower(inp.vanilla_low, a, b, x.dtype)


@LOWER_ESTIMATORS.register("unbiased")
def _lower_unbiased(inp: LowerInput) -> float:
    clipped = None if inp.clipped is None else inp.clipped[None]
    return float(unbiased_lower_rows(inp.x[None], inp.vanilla_low, clipped=clipped, alpha=inp.alpha)[0])


def _interpolate(stat: Callable[[torch.Tensor], torch.Tensor], n: int, pos: torch.Tensor) -> torch.Tensor:
    """Rows' bound at plotting position ``pos`` (float64 ``[R]``, >= 1): linear between s_floor and
    s_ceil; above n: the number after s_n. ``stat``: the rows' ``order_stats``."""
    j0 = pos.floor().clamp(1, n).long()
    frac = (pos - j0).clamp(0, 1)
    a = stat(j0)
    b = stat((j0 + 1).clamp(max=n))
    top = stat(torch.full_like(j0, n))
    top = torch.nextafter(top, torch.full_like(top, math.inf))
    inner = a.double() + frac * (b.double() - a.double())
    return torch.where(pos > n, top.double(), inner)


@torch.no_grad()
def unbiased_lower_rows(
    x: torch.Tensor, vanilla_low: float, *, clipped: torch.Tensor | None = None, alpha: float | None = None
) -> torch.Tensor:
    """The ``unbiased`` lower bound of each row (module docstring, steps 1-4), batched.

    Args:
        x: ``[R, n]`` FP8 ratios of the A<0 tokens of R independent calibrations (finite, > 0).
        vanilla_low: v = 1 - eps_low.
        clipped: ``[R, n]`` bool, BF16 shadow ratio < v (shadow reference), or None.
        alpha: the static target fraction in [0, 1) (exactly one of clipped / alpha).

    Returns:
        ``[R]`` float64 bounds L, unclamped (0 = clip nothing); comparisons with v in x's dtype.
    """
    if (clipped is None) == (alpha is None):
        raise ValueError("unbiased_lower_rows needs exactly one of clipped (shadow) and alpha (static)")
    R, n = x.shape
    f64 = torch.float64
    stat = order_stats(x)
    if alpha is not None:
        pos = torch.full((R,), alpha * (n + 1), dtype=f64, device=x.device)
        low = _interpolate(stat, n, pos.clamp(min=1.0))
        if alpha * (n + 1) < 1:  # step 4: power-law tail below s_1
            if n == 1 or alpha <= 0:
                return torch.zeros(R, dtype=f64, device=x.device)
            s1 = stat(torch.ones(R, dtype=torch.long, device=x.device)).double()
            s2 = stat(torch.full((R,), 2, dtype=torch.long, device=x.device)).double()
            low = s1 * (s2 / s1) ** math.log2(alpha * (n + 1))
        return low
    if clipped.shape != x.shape or clipped.dtype != torch.bool:
        raise ValueError(f"clipped must be a bool tensor of shape {tuple(x.shape)}")
    k = clipped.sum(1)
    s_k = stat(k.clamp(1, n))
    in_low = (x <= s_k[:, None]) & (k > 0)[:, None]  # FP8 ratio <= s_k (ties included)
    m1 = in_low.sum(1)
    p1 = (clipped & in_low).sum(1).double() / m1.clamp(min=1)
    p2 = (clipped & ~in_low).sum(1).double() / (n - m1).clamp(min=1)
    c = torch.where(p1 > 0, p1 / (1 + p1 - p2), torch.zeros_like(p1))
    low = torch.where(k > 0, _interpolate(stat, n, (k + c).clamp(min=1.0)), torch.zeros_like(c))
    consistent = (x < vanilla_low).sum(1) == k  # step 3: v clips exactly k FP8 ratios
    return torch.where(consistent, torch.full_like(low, vanilla_low), low)
