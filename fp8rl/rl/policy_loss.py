"""The PPO clipped surrogate, per token, with the clip bounds handed in from outside.

Method (PPO, Schulman et al. 2017, Eq. 7; dual clip: Ye et al. 2020, arXiv 1912.09729;
asymmetric "clip-higher" bounds: DAPO, Yu et al. 2025, Sec. 3.1). For each response token

    r    = exp(clamp(log_prob - old_log_prob, -20, 20))
    loss = max(-A r, -A clip(r, low, high))
    dual clip (A < 0 only, c > 1):  loss = min(loss, -A c)

The bounds ``(low, high)`` are ratios, not epsilons: vanilla PPO/DAPO gives
``(1 - eps_low, 1 + eps_high)``, Calibrated Clipping (the FP8 paper, Sec. "Calibrated
Clipping") gives whatever its controller computed. One kernel serves every clip method;
the train/rollout importance-sampling weight is a separate multiplicative factor
(``fp8rl.rl.correction``) and the reduction to a scalar is ``fp8rl.rl.aggregation``.

Why the lower bound matters for FP8 (the paper's mechanism): for A < 0 and r < low the
clipped branch -A*low wins and is constant in theta, so the token's gradient is zero. FP8
noise in log r pushes many more A<0 tokens across ``low`` than BF16 does;
``actor/clipfrac_neg_low`` measures exactly that.

Metrics (0-d detached float32 tensors; NaN where a denominator is zero; see
``fp8rl.rl.diagnostics`` for the conventions): ``actor/clipfrac`` and the four cells
``actor/clipfrac_{neg,pos}_{low,high}`` (single implementation: ``diagnostics.clip_table``),
``actor/ratio_neg_q01|q50|q99`` (linear-interpolation quantiles over A<0 response tokens,
via kthvalue), ``actor/ppo_kl`` and, when a dual clip is set, ``actor/dualclipfrac``.

Choices made here (the paper and the issue are silent; each matches OpenRLHF 0.11.2
``PolicyLoss`` unless said otherwise):

- ``actor/ppo_kl`` is the k1 estimator mean(old_log_prob - log_prob) over response tokens,
  an estimate of KL(pi_old || pi_theta) from tokens sampled (approximately) from pi_old; the
  log-ratio is not clamped for this metric (as OpenRLHF and verl).
- ``actor/clipfrac`` counts the tokens where the PPO clip zeroes the gradient, strictly
  beyond the bound (A<0, r<low or A>0, r>high); equals OpenRLHF's ``clip_ratio``.
- ``actor/dualclipfrac`` (our addition, like verl's ``pg_clipfrac_lower``): fraction of
  response tokens with A<0 and r > c, whose loss the dual clip caps.
- Ratios and losses are computed in the inputs' dtype promoted to at least float32.
- ``old_log_prob`` and ``advantages`` are detached (constants of the surrogate).
- Masked tokens get loss exactly 0 (``torch.where``, so NaN/inf at padding never leaks).
- At a ratio exactly on a bound, ``torch.maximum`` splits the gradient between equal
  branches; such a token is not counted as clipped.
"""

from __future__ import annotations

import math

import torch

from fp8rl.rl.diagnostics import _as_bool_mask, clip_table, masked_mean, ratio_quantiles

__all__ = ["LOG_RATIO_CLAMP", "check_bounds", "ppo_token_loss"]

# log(pi/pi_old) is clamped to +-20 before exp, as in OpenRLHF and verl.
LOG_RATIO_CLAMP = 20.0


def check_bounds(low: float, high: float, dual_clip: float | None = None) -> tuple[float, float, float | None]:
    """Validate PPO clip bounds (as ratios) and return them as floats.

    Requires 0 <= low < 1 < high (high may be inf: no upper clip) and, if given, a finite
    dual_clip > 1.
    """
    low, high = float(low), float(high)
    if math.isnan(low) or math.isnan(high):
        raise ValueError(f"clip bounds must not be NaN, got low={low}, high={high}")
    if not 0.0 <= low < 1.0:
        raise ValueError(
            f"low bound must satisfy 0 <= low < 1 (it is a ratio such as 0.8 = 1 - eps_low, "
            f"not eps_low), got low={low}"
        )
    if not high > 1.0:
        raise ValueError(
            f"high bound must be > 1 (a ratio such as 1.28 = 1 + eps_high, not eps_high), "
            f"got high={high}"
        )
    if dual_clip is not None:
        dual_clip = float(dual_clip)
        if not (dual_clip > 1.0 and math.isfinite(dual_clip)):
            raise ValueError(f"dual_clip must be a finite number > 1 (e.g. 3.0) or None, got {dual_clip}")
    return low, high, dual_clip


def _check_token_tensors(**tensors: torch.Tensor) -> None:
    shape = None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dim() != 2:
            raise ValueError(
                f"{name} must be [B, T] (2-D), got shape {tuple(t.shape)}"
                + ("; broadcast per-sequence advantages with broadcast_to_tokens" if name == "advantages" else "")
            )
        if shape is None:
            shape = t.shape
        elif t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like log_prob")


def ppo_token_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
    dual_clip: float | None = None,
    metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO clipped loss and its clip diagnostics.

    Args:
        log_prob: ``[B, T]`` log pi_theta of the sampled tokens (carries the gradient).
        old_log_prob: ``[B, T]`` log pi_old (the trainer's recomputed old log-probs).
        advantages: ``[B, T]`` per-token advantages (see ``broadcast_to_tokens``).
        mask: ``[B, T]`` response-token mask (bool or 0/1).
        low, high: clip bounds as ratios, 0 <= low < 1 < high (e.g. 0.8, 1.28).
        dual_clip: c > 1 caps the A<0 loss at -A c; None disables it.
        metrics: compute the diagnostics (False: an empty dict, for a caller that computes
            its own, e.g. from counts summed over mini-batches).

    Returns:
        ``(loss_mat [B, T], metrics)``: ``loss_mat`` is 0 at masked tokens; reduce it with
        ``fp8rl.rl.aggregation.aggregate``. ``metrics`` maps names to 0-d float32 tensors.
    """
    low, high, dual_clip = check_bounds(low, high, dual_clip)
    _check_token_tensors(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    m = _as_bool_mask(mask, log_prob)
    dtype = torch.promote_types(log_prob.dtype, torch.float32)
    log_ratio = log_prob.to(dtype) - old_log_prob.detach().to(dtype)
    adv = advantages.detach().to(dtype)
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, low, high))
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip), loss)
    loss_mat = torch.where(m, loss, torch.zeros((), dtype=dtype, device=loss.device))
    if not metrics:
        return loss_mat, {}

    with torch.no_grad():
        r = ratio.detach()
        out = clip_table(r, adv, m, low=low, high=high)
        out.update(ratio_quantiles(r, adv, m))
        out["actor/ppo_kl"] = masked_mean(-log_ratio.detach(), m).to(torch.float32)
        if dual_clip is not None:
            out["actor/dualclipfrac"] = masked_mean(((adv < 0) & (r > dual_clip)).float(), m)
    return loss_mat, out
