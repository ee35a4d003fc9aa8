"""Group-relative advantages for outcome rewards (one scalar reward per response).

Each prompt is sampled n times; responses of one prompt form a group (``group_ids``).

- ``grpo`` (GRPO, Shao et al. 2024, DeepSeekMath Sec. 4.1.2, "outcome supervision"):
  A_i = (R_i - mean_g) / (std_g + eps), with mean and std over the response's group.
- ``dr_grpo`` (Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training", Sec. 3.2):
  A_i = R_i - mean_g; no std division (it biases towards too-easy and too-hard prompts).
  Dr.GRPO's other half, the constant length normaliser, is the ``seq-mean-token-sum-norm``
  loss aggregation.

The advantage of a response is broadcast to all its tokens with ``broadcast_to_tokens``.

Conventions (matching the upstream implementations people use):

- std is the **sample (unbiased, n - 1) standard deviation**, ``torch.std``'s default, as in
  verl's ``compute_grpo_outcome_advantage`` (``torch.std(scores_of_group)``) and OpenRLHF
  0.11.2's ``group_norm`` estimator (``rewards.std(-1)``).
- eps = 1e-6 (verl's default ``epsilon``; OpenRLHF uses 1e-9). A group whose rewards are
  all equal has std 0 and gets A = 0 exactly.
- **Groups of size 1 raise** ``ValueError``: the group mean is the reward itself, so the
  response carries no learning signal, and the sample std is undefined. OpenRLHF asserts
  n_samples_per_prompt > 1 for the same reason (otherwise training is a silent no-op);
  verl instead silently uses mean 0 and std 1 (A = R) for singletons. Filter singleton groups
  out before calling if that is really intended.
- ``group_ids`` are arbitrary integer labels (need not be contiguous, sorted or start at 0).
- Group statistics are computed in the rewards' dtype promoted to at least float32, with a
  two-pass (centred) variance; non-finite rewards raise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fp8rl.registry import Registry
from fp8rl.rl.diagnostics import _as_bool_mask

__all__ = ["ADVANTAGE_ESTIMATORS", "GRPO_EPS", "broadcast_to_tokens", "dr_grpo", "group_stats", "grpo"]

GRPO_EPS = 1e-6

AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-response group mean and sample std, both ``[N]`` (each response gets its group's).

    Args:
        rewards: ``[N]`` floating scalar rewards (finite).
        group_ids: ``[N]`` integer group labels; every group must have >= 2 members.
    """
    if not isinstance(rewards, torch.Tensor) or not isinstance(group_ids, torch.Tensor):
        raise TypeError("rewards and group_ids must be torch.Tensors")
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N] (1-D, same length), got "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if not rewards.is_floating_point():
        raise TypeError(f"rewards must be floating point, got {rewards.dtype}")
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty: no responses to compute advantages for")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or inf; fix the reward function before computing advantages")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if bool((counts < 2).any()):
        singles = int((counts < 2).sum())
        raise ValueError(
            f"{singles} group(s) have a single response; group-relative advantages need >= 2 "
            "samples per prompt (set n_samples_per_prompt > 1 or drop singleton groups)"
        )
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.to(dtype)
    n = counts.to(dtype)
    mean_g = torch.zeros(counts.shape, dtype=dtype, device=r.device).index_add_(0, inverse, r) / n
    centred = r - mean_g[inverse]
    var_g = torch.zeros_like(mean_g).index_add_(0, inverse, centred * centred) / (n - 1)
    return mean_g[inverse], var_g.sqrt()[inverse]


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = GRPO_EPS) -> torch.Tensor:
    """GRPO: ``[N]`` advantages (R - mean_g) / (std_g + eps), sample std."""
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    mean, std = group_stats(rewards, group_ids)
    return (rewards.to(mean.dtype) - mean) / (std + eps)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: ``[N]`` advantages R - mean_g."""
    mean, _ = group_stats(rewards, group_ids)
    return rewards.to(mean.dtype) - mean


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` per-response advantages -> ``[N, T]`` per-token, 0 at masked tokens."""
    if not isinstance(advantages, torch.Tensor) or advantages.dim() != 1:
        raise ValueError(f"advantages must be [N] (1-D), got {getattr(advantages, 'shape', type(advantages))}")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"mask must be [N, T] with N = {advantages.shape[0]} (one row per response), "
            f"got {getattr(mask, 'shape', type(mask))}"
        )
    m = _as_bool_mask(mask, mask)
    adv = advantages[:, None].expand(m.shape)
    return torch.where(m, adv, torch.zeros((), dtype=advantages.dtype, device=advantages.device))
