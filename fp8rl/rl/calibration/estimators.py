"""Calibrated Clipping, the estimation: clip bounds for FP8 ratios from the BF16 shadow ratios.

The method (the FP8 paper, "Towards Full Pipeline FP8 Reinforcement Learning for LLMs",
arXiv 2609.22870, Sec. "Calibrated Clipping"; reconstructed from readings of the PDF, see
the project's reference notes). FP8 noise in the PPO ratio r = pi_theta / pi_old pushes
negative-advantage tokens below the lower bound, where their gradient is zero. On a
calibration step the trainer also computes the ratios in BF16 (the "shadow" pass) on the
same batch, and the controller

1. measures alpha = the fraction of A<0 tokens whose **BF16** ratio is below
   ``1 - eps_low`` (what vanilla PPO would clip in BF16);
2. sets the lower bound L to the alpha-quantile of the **FP8** ratios over A<0 tokens, so
   that FP8 clips the same fraction of A<0 tokens as BF16 would;
3. sets the upper bound H by an upper rule (below) that rebalances the positive side;
4. smooths the bounds (EMA) and keeps them for the next ``period`` steps.

Notation: the tokens of a calibration step are the unmasked tokens; A<0 ("negative") and
A>0 ("positive") tokens are counted separately, tokens with A == 0 are ignored (their loss
is zero). n = number of negative tokens. In PPO the lower dead zone is ``r < L`` (A<0) and
the upper dead zone is ``r > H`` (A>0); a ratio exactly on a bound is not clipped (as in
``fp8rl.rl.diagnostics``). All bound comparisons happen in the ratio's dtype (float32 for
bf16/fp16/float32 inputs, float64 for float64), as ``torch.clamp`` and the loss kernel do:
a returned bound is exact in that sense (see "quantile convention").

Upper rules (``UPPER_RULES`` registry):

- ``contribution`` (default): with the "contribution" of a token = |A| r (the weight its
  gradient gets in the surrogate), define
  ``p(L, H) = sum_{A>0, r <= H} |A| r / sum_{A<0, r >= L} |A| r``
  (numerator: unclipped positive tokens; denominator: unclipped negative tokens). H is set
  so that p on the FP8 ratios with (L, H) equals p on the BF16 ratios with the vanilla
  bounds (1 - eps_low, 1 + eps_high). p is a non-decreasing step function of H (strictly
  increasing steps, since every A>0 token has |A| r > 0), so the solver sorts the candidate
  A>0 FP8 ratios once, takes cumulative sums (float64), binary-searches the crossing of the
  target and picks the closer of the two steps around it (so p is reproduced to within one token's
  contribution, |A| r of the token at the crossing, whenever the target is reachable inside
  the clamps). Several H give the same p (an interval between two consecutive sorted
  ratios); among the closest steps we take the H nearest to the vanilla ``1 + eps_high``.
  If the target is not reachable (below the smallest or above the largest achievable p in
  ``(1, high_max]``), H is the bound of the nearest achievable step (the smallest / largest
  H range), again projected towards vanilla. The achieved and target p are metrics.
- ``proportional``: ``H = 1 + (1 - L) eps_high / eps_low`` (seen in a reimplementation),
  computed as ``(1 + eps_high) + ((1 - eps_low) - L) eps_high / eps_low`` so that L =
  vanilla gives exactly the vanilla H.
- ``fixed``: ``H = 1 + eps_high`` (only the lower bound moves; the paper reports this
  over-penalises, offered for the ablation).

Quantile convention (the lower bound). Let k = the number of A<0 tokens to clip: in
``reference="shadow"`` k = #(BF16 ratio < 1 - eps_low) exactly (alpha = k / n); in
``reference="static"`` k = floor(alpha n + 1/2). The set of bounds that clip exactly k FP8
ratios is the interval (s_k, s_{k+1}] between the k-th and (k+1)-th smallest FP8 ratio
(s_0 = -inf, s_{n+1} = +inf); we take its point nearest to the vanilla bound 1 - eps_low
(vanilla itself if it lies inside, else s_{k+1}, or the next representable number above
s_k). So #(FP8 ratio < L) == k exactly unless ties straddle the boundary, in which case no
bound clips exactly k and we take the achievable count nearest to k (the smaller on a tie)
-- with continuous ratios this is "equal to alpha within one token". Because we project the
vanilla bound, a controller fed identical BF16 and FP8 ratios returns the vanilla bounds
exactly, for every upper rule. ``torch.quantile`` is not used (it refuses more than 2**24
elements); order statistics come from ``torch.kthvalue`` (O(n)) and masked min/max.

Choices we had to guess (the paper gives none of these; each is an option or documented):

- the definition of "contribution" (|A| r summed over unclipped tokens) and of "unclipped"
  (A>0: r <= H; A<0: r >= L; the dual clip of A<0 tokens with r > c is ignored here);
- the quantile convention above, and H among equal-p candidates nearest to vanilla;
- the order of operations: L is clamped first, H is solved against that (raw, unsmoothed)
  L and clamped; smoothing is the controller's (``controller.py``);
- ``reference="static"``: alpha is a given constant (a BF16 baseline's logged
  ``actor/clipfrac_neg_low``), and with the contribution rule the BF16 p is given too;
- degenerate input (all tokens masked, no A<0 tokens, non-finite advantages on unmasked
  tokens, non-finite or non-positive ratios on the unmasked tokens the calibration reads --
  A<0 always, A>0 for the contribution rule -- or an undefined p in the contribution rule)
  raises :class:`DegenerateCalibration` (the controller then keeps its bounds). Wrong shapes
  or a missing shadow ratio are caller bugs and raise ``ValueError``;
- shapes: ``ratio``, ``shadow_ratio``, ``mask`` share a shape (``[B, T]`` or any shape,
  flattened); ``advantages`` has that shape or is ``[B]`` (one per sequence) for 2-D inputs
  and is broadcast over T; ``mask`` is bool or numeric (nonzero = response token);
- the quantiles are global over the tensors handed in: under data parallelism the caller
  gathers the calibration tensors first (no ``torch.distributed`` here);
- ``shadow/ratio_neg_q01`` uses linear interpolation between order statistics (numpy's
  default), as ``actor/ratio_neg_q01`` does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8rl.registry import Registry

__all__ = [
    "REFERENCES",
    "UPPER_RULES",
    "Bounds",
    "Calibration",
    "DegenerateCalibration",
    "calibrate_bounds",
    "solve_upper_contribution",
]

log = logging.getLogger(__name__)

REFERENCES: tuple[str, ...] = ("shadow", "static")
_INF = float("inf")


@dataclass(frozen=True)
class Bounds:
    """A PPO clip-bound pair as ratios: tokens with A<0 and r < low, or A>0 and r > high, are clipped.

    Validates ``0 < low < 1 < high`` with both finite.
    """

    low: float
    high: float

    def __post_init__(self) -> None:
        try:
            low, high = float(self.low), float(self.high)
        except (TypeError, ValueError) as e:
            raise TypeError(f"Bounds(low, high) must be numbers, got {self.low!r}, {self.high!r}") from e
        if not (math.isfinite(low) and math.isfinite(high)):
            raise ValueError(f"Bounds must be finite, got low={low}, high={high}")
        if not 0.0 < low < 1.0 < high:
            raise ValueError(f"Bounds need 0 < low < 1 < high, got low={low}, high={high}")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)

    @classmethod
    def vanilla(cls, eps_low: float, eps_high: float) -> Bounds:
        """The PPO/DAPO bounds ``(1 - eps_low, 1 + eps_high)``."""
        return cls(1.0 - eps_low, 1.0 + eps_high)

    def as_tuple(self) -> tuple[float, float]:
        return (self.low, self.high)


class DegenerateCalibration(Exception):
    """The calibration input carries no usable information; the controller keeps its bounds."""


@dataclass(frozen=True)
class Calibration:
    """The result of one calibration, before smoothing (``low``/``high`` are clamped).

    ``alpha``: target fraction of A<0 tokens below L; ``alpha_achieved``: fraction of A<0 FP8
    ratios below ``low``; ``p_target``/``p_achieved``: the contribution balance (NaN for the
    other upper rules); ``n_pos``: A>0 tokens read (-1 when the rule reads none);
    ``shadow_*``: BF16 shadow measurements (NaN for ``static``).
    """

    low: float
    high: float
    alpha: float
    alpha_achieved: float
    n_neg: int
    n_pos: int
    p_target: float
    p_achieved: float
    shadow_clipfrac_neg_low: float
    shadow_ratio_neg_q01: float


# --------------------------------------------------------------------------------------
# Small exact helpers (dtype-aware: bounds are compared in the ratio's dtype)
# --------------------------------------------------------------------------------------


def _in_dtype(x: float, dtype: torch.dtype) -> float:
    """``x`` rounded to ``dtype`` (what torch does when comparing a tensor with a Python float)."""
    return float(torch.tensor(x, dtype=dtype))


def _next_up(x: float, dtype: torch.dtype) -> float:
    """Smallest ``dtype`` number above ``x`` (``x`` representable in ``dtype``)."""
    return float(torch.nextafter(torch.tensor(x, dtype=dtype), torch.tensor(_INF, dtype=dtype)))


def _next_down(x: float, dtype: torch.dtype) -> float:
    """Largest ``dtype`` number below ``x`` (``x`` representable in ``dtype``)."""
    return float(torch.nextafter(torch.tensor(x, dtype=dtype), torch.tensor(-_INF, dtype=dtype)))


def _lower_interval(x: torch.Tensor, k: int) -> tuple[float, float, int]:
    """The bounds L with #(x < L) = k*: returns ``(a, b, k*)``, L valid iff a < L <= b.

    ``x``: 1-D, nonempty, finite. k* = k unless ties straddle the k-th/(k+1)-th order
    statistic; then k* is the achievable count nearest k (the smaller on a tie).
    a = largest x below the bound (-inf if k* = 0), b = smallest x at or above it (+inf if
    k* = n). O(n): one or two ``kthvalue`` selections plus masked min/max.
    """
    n = x.numel()
    if k <= 0:
        return -_INF, float(x.min()), 0
    if k >= n:
        return float(x.max()), _INF, n
    a = torch.kthvalue(x, k).values  # k-th smallest (1-based)
    n_le = int((x <= a).sum())
    if n_le == k:  # no tie across the boundary
        return float(a), float(torch.where(x > a, x, _INF).min()), k
    lo = int((x < a).sum())  # the tied value a occupies ranks lo+1 .. n_le
    if k - lo <= n_le - k:
        below = float(torch.where(x < a, x, -_INF).max()) if lo > 0 else -_INF
        return below, float(a), lo
    above = float(torch.where(x > a, x, _INF).min()) if n_le < n else _INF
    return float(a), above, n_le


def _project_lower(target: float, a: float, b: float, dtype: torch.dtype) -> float:
    """The point of (a, b] nearest ``target``, in ``dtype`` comparison semantics."""
    t = _in_dtype(target, dtype)
    if a < t <= b:
        return target
    if t <= a:
        return _next_up(a, dtype)
    return b


def _sorted_quantile(x: torch.Tensor, q: float, hint: float | None = None, n_below: int = 0) -> float:
    """Linear-interpolation quantile of 1-D ``x`` (numpy's default) via kthvalue.

    ``hint``, ``n_below``: ``n_below`` = #(x < hint); when the needed order statistics lie
    below ``hint`` only those elements are searched (cheap for low quantiles).
    """
    n = x.numel()
    h = q * (n - 1)
    lo = min(math.floor(h), n - 1)
    hi = min(lo + 1, n - 1)
    frac = h - lo
    src = x
    if hint is not None and n_below >= hi + 1:
        src = x[x < hint]
    v_lo = float(torch.kthvalue(src, lo + 1).values)
    v_hi = float(torch.kthvalue(src, hi + 1).values) if hi != lo else v_lo
    return v_lo + frac * (v_hi - v_lo)


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
    h_lo = _next_up(1.0, dtype)
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
    t = _in_dtype(target, dtype)
    if t < lo:
        return lo
    if closed:
        return target if target <= hi else hi
    return target if t < hi else _next_down(hi, dtype)


# --------------------------------------------------------------------------------------
# Upper rules
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _UpperInput:
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


UpperRule = Callable[[_UpperInput], tuple[float, float, float]]  # -> (H, p_target, p_achieved)

UPPER_RULES: Registry[UpperRule] = Registry("calibration upper rule")


@UPPER_RULES.register("fixed")
def _upper_fixed(u: _UpperInput) -> tuple[float, float, float]:
    return 1.0 + u.eps_high, math.nan, math.nan


@UPPER_RULES.register("proportional")
def _upper_proportional(u: _UpperInput) -> tuple[float, float, float]:
    vl, vh = 1.0 - u.eps_low, 1.0 + u.eps_high
    return vh + (vl - u.low) * u.eps_high / u.eps_low, math.nan, math.nan


@UPPER_RULES.register("contribution")
def _upper_contribution(u: _UpperInput) -> tuple[float, float, float]:
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


# --------------------------------------------------------------------------------------
# One calibration (pure function)
# --------------------------------------------------------------------------------------


def _flat_inputs(
    ratio: torch.Tensor,
    shadow_ratio: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Check shapes (caller bugs raise) and return flat (ratio, shadow, adv, valid)."""
    named = {"ratio": ratio, "advantages": advantages, "mask": mask}
    if shadow_ratio is not None:
        named["shadow_ratio"] = shadow_ratio
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    shape = ratio.shape
    for name in ("shadow_ratio", "mask"):
        if name in named and named[name].shape != shape:
            raise ValueError(f"{name} has shape {tuple(named[name].shape)}, ratio has {tuple(shape)}")
    if not ratio.is_floating_point() or (shadow_ratio is not None and not shadow_ratio.is_floating_point()):
        raise TypeError("ratio and shadow_ratio must be floating-point tensors")
    adv = advantages.detach()
    if adv.shape != shape:
        if ratio.dim() == 2 and adv.shape == shape[:1]:
            adv = adv[:, None].expand(shape)
        else:
            raise ValueError(
                f"advantages has shape {tuple(adv.shape)}; expected {tuple(shape)} (token level) "
                f"or {tuple(shape[:1])} (one per sequence, 2-D inputs only)"
            )
    valid = mask.detach().reshape(-1)
    valid = valid if valid.dtype == torch.bool else valid != 0
    dtype = torch.promote_types(ratio.dtype, torch.float32)
    if shadow_ratio is not None:
        dtype = torch.promote_types(dtype, shadow_ratio.dtype)
    r = ratio.detach().reshape(-1).to(dtype)
    s = shadow_ratio.detach().reshape(-1).to(dtype) if shadow_ratio is not None else None
    return r, s, adv.reshape(-1).to(dtype), valid


def _check_ratios(x: torch.Tensor, what: str) -> None:
    if x.numel():
        lo, hi = torch.aminmax(x)  # NaN propagates into both
        if not (float(lo) > 0.0 and float(hi) < _INF):
            raise DegenerateCalibration(f"non-finite or non-positive {what} ratios on unmasked tokens")


@torch.no_grad()
def calibrate_bounds(
    ratio: torch.Tensor,
    shadow_ratio: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    upper_rule: str = "contribution",
    alpha: float | None = None,
    p_target: float | None = None,
    low_min: float = 0.5,
    high_max: float = 2.0,
) -> Calibration:
    """One calibration: raw (clamped, unsmoothed) bounds from one batch. See the module docstring.

    Args:
        ratio: ``[B, T]`` FP8 ratios pi_theta / pi_old (as the loss computes them).
        shadow_ratio: ``[B, T]`` BF16 shadow ratios, or None when ``alpha`` is given (static).
        advantages: ``[B, T]`` token advantages, or ``[B]`` broadcast over T.
        mask: ``[B, T]`` response-token mask (bool or numeric; nonzero = token).
        eps_low, eps_high: the vanilla clip epsilons.
        upper_rule: a name in ``UPPER_RULES``.
        alpha: static reference: the target lower-clip fraction (ignores ``shadow_ratio``).
        p_target: static reference with the contribution rule: the BF16 p.
        low_min, high_max: clamps of L and H.

    Raises:
        DegenerateCalibration: the batch cannot be calibrated on (the controller catches it).
        ValueError / TypeError: wrong shapes or types (caller bugs).
    """
    rule = UPPER_RULES[upper_rule]
    static = alpha is not None
    if not static and shadow_ratio is None:
        raise ValueError("calibrate_bounds needs shadow_ratio (BF16 ratios) or a static alpha")
    r, s, adv, valid = _flat_inputs(ratio, None if static else shadow_ratio, advantages, mask)
    dtype = r.dtype
    if not bool(valid.any()):
        raise DegenerateCalibration("all tokens are masked")
    adv = torch.where(valid, adv, 0.0)  # masked tokens count as A == 0 from here on
    a_min, a_max = torch.aminmax(adv)
    if not (math.isfinite(float(a_min)) and math.isfinite(float(a_max))):
        raise DegenerateCalibration("non-finite advantages on unmasked tokens")
    neg_idx = (adv < 0).nonzero().squeeze(1)
    n = neg_idx.numel()
    if n == 0:
        raise DegenerateCalibration("no unmasked tokens with negative advantage")
    r_neg = r.index_select(0, neg_idx)
    _check_ratios(r_neg, "FP8")
    s_neg = None
    vl = 1.0 - eps_low
    q01 = math.nan
    if static:
        k = math.floor(alpha * n + 0.5)
        shadow_frac = math.nan
        alpha_v = float(alpha)
    else:
        s_neg = s.index_select(0, neg_idx)
        _check_ratios(s_neg, "BF16 shadow")
        k = int((s_neg < vl).sum())
        alpha_v = shadow_frac = k / n
        q01 = _sorted_quantile(s_neg, 0.01, hint=vl, n_below=k)

    a, b, _ = _lower_interval(r_neg, k)
    low = _project_lower(vl, a, b, dtype)
    low = min(max(low, low_min), _next_down(1.0, dtype))

    need_pos = upper_rule == "contribution"
    if need_pos:
        pos_idx = (adv > 0).nonzero().squeeze(1)
        r_pos = r.index_select(0, pos_idx)
        _check_ratios(r_pos, "FP8")
        s_pos = None
        if not static:
            s_pos = s.index_select(0, pos_idx)
            _check_ratios(s_pos, "BF16 shadow")
        a_pos = adv.index_select(0, pos_idx)
        a_neg = -adv.index_select(0, neg_idx)
    else:
        r_pos = a_pos = a_neg = torch.empty(0, dtype=dtype)
        s_pos = None
    u = _UpperInput(
        low=low,
        eps_low=eps_low,
        eps_high=eps_high,
        high_max=high_max,
        r_neg=r_neg,
        a_neg=a_neg,
        s_neg=s_neg,
        r_pos=r_pos,
        a_pos=a_pos,
        s_pos=s_pos,
        p_target=p_target if static else None,
    )
    high, p_t, p_a = rule(u)
    high = min(max(high, _next_up(1.0, dtype)), high_max)
    achieved = int((r_neg < low).sum()) / n
    return Calibration(
        low=low,
        high=high,
        alpha=alpha_v,
        alpha_achieved=achieved,
        n_neg=n,
        n_pos=int(r_pos.numel()) if need_pos else -1,
        p_target=p_t,
        p_achieved=p_a,
        shadow_clipfrac_neg_low=shadow_frac,
        shadow_ratio_neg_q01=q01,
    )
