"""Train/rollout importance-sampling (IS) correction: a detached per-token weight.

The rollout engine (vLLM, or our mini engine, possibly in FP8) and the trainer compute
different probabilities for the same tokens. With r_is = pi_train_old / pi_rollout =
exp(old_log_prob - rollout_log_prob) per token, a correction multiplies the PPO token loss
by a detached weight w (the caller does ``loss_mat * w``; ``corrected_ppo_token_loss``
composes the two):

- ``none``: w = 1.
- ``tis`` (truncated IS; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training"): w = min(r_is, cap), cap C = 2 by default (the FP8 paper uses
  token-level TIS with C = 2 in every FP8 run). ``cap=inf`` is untruncated IS.
- ``icepop`` (masked IS, MiniMax-M1 / ICEPOP "IcePop"): w = r_is if low <= r_is <= high
  else 0, with [low, high] = [0.5, 5] by default (bounds inclusive, as OpenRLHF's mask mode).

These are OpenRLHF 0.11.2's ``is_correction_level=token`` with ``mode=clip`` and threshold
``(0, cap)`` (TIS) and ``mode=mask`` with threshold ``(low, high)`` (ICEPOP). Note that
OpenRLHF's clip mode also clamps from *below* at the threshold's low end (0.5 by default);
Yao et al.'s TIS does not, and neither do we.

Metrics (0-d detached float32 tensors; masked means over response tokens; NaN if none):

- ``rollout/is_clipfrac``: fraction of tokens whose weight was truncated (tis: r_is > cap)
  or masked (icepop: r_is outside [low, high]), decided on the raw ratio, before truncation.
- ``rollout/mismatch_kl``: the k3 estimator mean(r_is - 1 - log r_is) of
  KL(pi_rollout || pi_train_old). Tokens were sampled from the rollout policy, so k3 is an
  unbiased estimate of that KL, never negative per token, and of lower variance than k1
  (Schulman, "Approximating KL divergence", 2020). We prefer it to the mean log difference
  because the k1 mean can be near zero or negative on small batches while the policies differ.
- ``rollout/mismatch_k1``: mean(rollout_log_prob - old_log_prob), the k1 estimate of the same
  KL; it is what OpenRLHF logs as ``vllm_kl``, kept for comparison with cluster runs.

Choices made here: the log IS ratio is used unclamped for the weights (as OpenRLHF), so
with ``cap=inf`` a log ratio above ~88 gives w = inf in float32; it is clamped to +-20 for
the KL metrics only. Weights at masked (padding) tokens are 0. Inputs are computed in at
least float32.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from fp8rl.registry import Registry
from fp8rl.rl.diagnostics import _as_bool_mask, masked_mean
from fp8rl.rl.policy_loss import LOG_RATIO_CLAMP, _check_token_tensors, ppo_token_loss

__all__ = ["ICEPOP", "IS_CORRECTIONS", "TIS", "NoCorrection", "corrected_ppo_token_loss", "is_weights"]


class ISCorrection(Protocol):
    """A validated IS correction: ``(ratio [B,T]) -> (weights [B,T], truncated [B,T] bool)``."""

    def __call__(self, ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


IS_CORRECTIONS: Registry[type] = Registry("IS correction")


@IS_CORRECTIONS.register("none")
@dataclass(frozen=True)
class NoCorrection:
    """w = 1 everywhere; nothing is truncated."""

    def __call__(self, ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones_like(ratio), torch.zeros_like(ratio, dtype=torch.bool)


@IS_CORRECTIONS.register("tis")
@dataclass(frozen=True)
class TIS:
    """Truncated IS: w = min(r_is, cap). ``cap`` > 0; ``math.inf`` means no truncation."""

    cap: float = 2.0

    def __post_init__(self) -> None:
        cap = float(self.cap)
        if math.isnan(cap) or cap <= 0:
            raise ValueError(f"tis cap must be > 0 (e.g. 2.0; inf disables truncation), got {self.cap}")

    def __call__(self, ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.clamp(ratio, max=float(self.cap)), ratio > float(self.cap)


@IS_CORRECTIONS.register("icepop")
@dataclass(frozen=True)
class ICEPOP:
    """Masked IS: w = r_is if low <= r_is <= high else 0."""

    low: float = 0.5
    high: float = 5.0

    def __post_init__(self) -> None:
        low, high = float(self.low), float(self.high)
        if math.isnan(low) or math.isnan(high) or not 0.0 <= low < high:
            raise ValueError(f"icepop needs 0 <= low < high (default 0.5, 5.0), got low={self.low}, high={self.high}")

    def __call__(self, ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep = (ratio >= float(self.low)) & (ratio <= float(self.high))
        return torch.where(keep, ratio, torch.zeros((), dtype=ratio.dtype, device=ratio.device)), ~keep


def make_correction(method: str, **params: float) -> ISCorrection:
    """Build (and validate) a correction by registry name; use at config-load time."""
    cls = IS_CORRECTIONS[method]
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise TypeError(
            f"IS correction {method!r} got unknown parameter(s) {unknown}; "
            f"it accepts: {valid or 'no parameters'}"
        )
    return cls(**params)


@torch.no_grad()
def is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    method: str,
    **params: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached per-token IS weights and mismatch metrics.

    Args:
        old_log_prob: ``[B, T]`` trainer log-probs of the sampled tokens under pi_old.
        rollout_log_prob: ``[B, T]`` rollout-engine log-probs of the same tokens.
        mask: ``[B, T]`` response-token mask.
        method: an ``IS_CORRECTIONS`` name; ``params`` its parameters (tis: ``cap``;
            icepop: ``low``, ``high``).

    Returns:
        ``(weights [B, T], metrics)``; weights are 0 at masked tokens, detached.
    """
    correction = make_correction(method, **params)
    _check_token_tensors(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob)
    m = _as_bool_mask(mask, old_log_prob)
    dtype = torch.promote_types(old_log_prob.dtype, torch.float32)
    log_ratio = old_log_prob.detach().to(dtype) - rollout_log_prob.detach().to(dtype)
    weights, truncated = correction(torch.exp(log_ratio))
    weights = torch.where(m, weights, torch.zeros((), dtype=dtype, device=weights.device))
    clamped = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    metrics = {
        "rollout/is_clipfrac": masked_mean(truncated.float(), m),
        "rollout/mismatch_kl": masked_mean(torch.expm1(clamped) - clamped, m).to(torch.float32),
        "rollout/mismatch_k1": masked_mean(-log_ratio, m).to(torch.float32),
    }
    return weights, metrics


def corrected_ppo_token_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
    dual_clip: float | None = None,
    correction: str = "none",
    correction_params: Mapping[str, float] | None = None,
    return_weights: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    """``ppo_token_loss`` times the IS weight of ``correction``: ``(loss_mat * w, metrics)``.

    ``correction_params`` are the correction's parameters (a mapping, since icepop's
    ``low``/``high`` would collide with the clip bounds), e.g. ``{"cap": 2.0}`` for tis.
    ``rollout_log_prob`` may be None only with ``correction="none"`` (then no ``rollout/``
    metrics are produced). ``return_weights``: also return the weights applied (``[B, T]``, None
    without rollout log-probs), as a third element. Shapes as in ``ppo_token_loss``.
    """
    correction_params = dict(correction_params or {})
    loss_mat, metrics = ppo_token_loss(
        log_prob, old_log_prob, advantages, mask, low=low, high=high, dual_clip=dual_clip
    )
    if rollout_log_prob is None:
        make_correction(correction, **correction_params)  # validates name and parameters
        if correction != "none":
            raise ValueError(f"IS correction {correction!r} needs rollout_log_prob (got None)")
        return (loss_mat, metrics, None) if return_weights else (loss_mat, metrics)
    weights, is_metrics = is_weights(old_log_prob, rollout_log_prob, mask, correction, **correction_params)
    metrics.update(is_metrics)
    return (loss_mat * weights, metrics, weights) if return_weights else (loss_mat * weights, metrics)
