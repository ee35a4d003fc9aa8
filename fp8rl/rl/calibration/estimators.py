"""Calibrated Clipping, the estimation: clip bounds for FP8 ratios from the BF16 shadow ratios.

The method (the FP8 paper, "Towards Full Pipeline FP8 Reinforcement Learning for LLMs",
arXiv 2609.22870, Sec. "Calibrated Clipping"; reconstructed from readings of the PDF, see
the project's reference notes). FP8 noise in the PPO ratio r = pi_theta / pi_old pushes
negative-advantage tokens below the lower bound, where their gradient is zero. On a
calibration step the trainer also computes the ratios in BF16 (the "shadow" pass) on the
same batch, and the controller

1. measures alpha = the fraction of A<0 tokens whose **BF16** ratio is below
   ``1 - eps_low`` (what vanilla PPO would clip in BF16);
2. sets the lower bound L from the **FP8** ratios over A<0 tokens so that FP8 clips the same
   fraction of A<0 tokens as BF16 would: by default of *new* tokens, in expectation (the
   ``unbiased`` estimator: an interpolated order statistic at plotting position
   ``k + p1 / (1 + p1 - p2)``, or ``alpha (n + 1)`` for a static alpha; ``lower.py`` derives
   it), or of *these* tokens exactly (``in_sample``, the paper's "alpha-quantile" read
   literally; ``LOWER_ESTIMATORS``, keyword ``lower_estimator``);
3. sets the upper bound H by an upper rule (``UPPER_RULES`` in ``upper.py``: contribution,
   proportional, fixed) that rebalances the positive side;
4. smooths the bounds (EMA) and keeps them for the next ``period`` steps (``controller.py``).

Module layout (no cycles): ``bounds.py`` (``Bounds``, ``Calibration``,
``DegenerateCalibration``), ``order_stats.py`` (dtype-exact order statistics),
``lower.py``, ``upper.py``, and this module (input checks and ``calibrate_bounds``; it
re-exports the public names of the others).

Notation: the tokens of a calibration step are the unmasked tokens; A<0 ("negative") and
A>0 ("positive") tokens are counted separately, tokens with A == 0 are ignored (their loss
is zero). n = number of negative tokens. In PPO the lower dead zone is ``r < L`` (A<0) and
the upper dead zone is ``r > H`` (A>0); a ratio exactly on a bound is not clipped (as in
``fp8rl.rl.diagnostics``). All bound comparisons happen in the ratio's dtype (float32 for
bf16/fp16/float32 inputs, float64 for float64), as ``torch.clamp`` and the loss kernel do.
Both lower estimators project the vanilla bound when it clips exactly k FP8 ratios, so a
controller fed identical BF16 and FP8 ratios returns the vanilla bounds exactly, for every
upper rule and both estimators.

Choices we had to guess (the paper gives none of these; each is an option or documented):

- the lower estimator and its plotting position (``lower.py`` lists its own guesses); the
  contribution definition and H among equal-p candidates (``upper.py``);
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

import torch

from fp8rl.rl.calibration.bounds import REFERENCES, Bounds, Calibration, DegenerateCalibration
from fp8rl.rl.calibration.lower import LOWER_ESTIMATORS, LowerInput
from fp8rl.rl.calibration.order_stats import INF, next_down, next_up, sorted_quantile
from fp8rl.rl.calibration.upper import UPPER_RULES, UpperInput, solve_upper_contribution

__all__ = [
    "LOWER_ESTIMATORS",
    "REFERENCES",
    "UPPER_RULES",
    "Bounds",
    "Calibration",
    "DegenerateCalibration",
    "calibrate_bounds",
    "solve_upper_contribution",
]

log = logging.getLogger(__name__)


def flat_inputs(
    ratio: torch.Tensor,
    shadow_ratio: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Check types and shapes (caller bugs raise) and return flat ``[N]`` (ratio, shadow, adv,
    valid) in float32 or wider (the promoted dtype of the ratios); ``advantages`` may be ``[B]``
    for 2-D inputs (broadcast over T); ``valid`` is ``mask != 0`` as bool."""
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
        if not (float(lo) > 0.0 and float(hi) < INF):
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
    lower_estimator: str = "unbiased",
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
        lower_estimator: a name in ``LOWER_ESTIMATORS``: ``unbiased`` (default; the bound
            rules new tokens) or ``in_sample`` (exact on these tokens; see ``lower.py``).
        alpha: static reference: the target lower-clip fraction (ignores ``shadow_ratio``).
        p_target: static reference with the contribution rule: the BF16 p.
        low_min, high_max: clamps of L and H.

    Raises:
        DegenerateCalibration: the batch cannot be calibrated on (the controller catches it).
        ValueError / TypeError: wrong shapes or types (caller bugs).
    """
    rule = UPPER_RULES[upper_rule]
    estimator = LOWER_ESTIMATORS[lower_estimator]
    static = alpha is not None
    if not static and shadow_ratio is None:
        raise ValueError("calibrate_bounds needs shadow_ratio (BF16 ratios) or a static alpha")
    r, s, adv, valid = flat_inputs(ratio, None if static else shadow_ratio, advantages, mask)
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
    clipped = None
    k = -1
    if static:
        shadow_frac = math.nan
        alpha_v = float(alpha)
    else:
        s_neg = s.index_select(0, neg_idx)
        _check_ratios(s_neg, "BF16 shadow")
        clipped = s_neg < vl
        k = int(clipped.sum())
        alpha_v = shadow_frac = k / n
        q01 = sorted_quantile(s_neg, 0.01, hint=vl, n_below=k)

    low = estimator(LowerInput(x=r_neg, clipped=clipped, alpha=None if not static else alpha_v, vanilla_low=vl))
    low = min(max(low, low_min), next_down(1.0, dtype))

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
    u = UpperInput(
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
    high = min(max(high, next_up(1.0, dtype)), high_max)
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
        k=k,
    )
