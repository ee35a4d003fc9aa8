"""DAPO's two batch-shaping pieces: dynamic sampling and the soft overlong penalty.

DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"):

- **Dynamic sampling** (Sec. 3.2, Eq. 11): a prompt group whose rewards are all equal (all
  correct or all wrong) has zero group-relative advantage for every response and only
  dilutes the batch; such groups are dropped and sampling continues until the batch is
  full (the loop that refills lives in the trainer). ``dynamic_sampling_filter`` returns
  which responses to keep and ``dapo/kept_group_frac``.
- **Soft overlong punishment** (Sec. 3.4, Eq. 13), a length-dependent reward added to the
  task reward, with L_max the maximum response length and L_cache the buffer:

      R_length(L) = 0                              if L <= L_max - L_cache
                  = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
                  = -1                             if L > L_max

  scaled by a penalty factor (default 1.0). This equals OpenRLHF 0.11.2's
  ``apply_overlong_penalty`` (``-min(L - (L_max - L_cache), L_cache) / L_cache * factor``).

Choices made here:

- "All equal" is exact equality (max == min within the group); for 0/1 rewards it is the
  same as OpenRLHF's filter on the group mean lying strictly inside (0, 1).
- Groups of any size, including 1, are allowed by the filter (a singleton group is "all
  equal" and dropped).
- Lengths are response token counts (``[N]`` integers or floats).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["GroupFilter", "dynamic_sampling_filter", "overlong_penalty"]


@dataclass(frozen=True)
class GroupFilter:
    """Result of ``dynamic_sampling_filter``.

    Attributes:
        keep: ``[N]`` bool, True for responses of groups with non-identical rewards.
        num_groups: distinct groups in the input.
        num_kept: groups kept.
    """

    keep: torch.Tensor
    num_groups: int
    num_kept: int

    @property
    def kept_group_frac(self) -> float:
        return self.num_kept / self.num_groups

    @property
    def indices(self) -> torch.Tensor:
        """``[num kept responses]`` int64 indices of the kept responses, in input order."""
        return torch.nonzero(self.keep, as_tuple=False).flatten()

    def metrics(self) -> dict[str, float]:
        return {"dapo/kept_group_frac": self.kept_group_frac}


def dynamic_sampling_filter(rewards: torch.Tensor, group_ids: torch.Tensor) -> GroupFilter:
    """Keep the responses of groups whose rewards are not all equal.

    Args:
        rewards: ``[N]`` rewards (any real dtype; NaN raises).
        group_ids: ``[N]`` integer group labels (arbitrary, not necessarily contiguous).
    """
    if not isinstance(rewards, torch.Tensor) or not isinstance(group_ids, torch.Tensor):
        raise TypeError("rewards and group_ids must be torch.Tensors")
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty: nothing to filter")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    if bool(torch.isnan(r).any()):
        raise ValueError("rewards contain NaN; fix the reward function before filtering")
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    g = uniq.numel()
    gmax = torch.full((g,), -math.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inverse, r, "amax")
    gmin = torch.full((g,), math.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inverse, r, "amin")
    varied = gmax > gmin
    return GroupFilter(keep=varied[inverse], num_groups=g, num_kept=int(varied.sum()))


def overlong_penalty(
    lengths: torch.Tensor, *, max_len: int, cache_len: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong penalty, ``[N]`` lengths -> ``[N]`` float32 penalties (<= 0).

    Args:
        lengths: ``[N]`` response lengths in tokens.
        max_len: L_max, the maximum response length.
        cache_len: L_cache, the soft buffer (0 < cache_len <= max_len).
        factor: scale of the penalty (>= 0), so it lies in [-factor, 0].
    """
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
        raise ValueError(f"lengths must be a [N] tensor, got {getattr(lengths, 'shape', type(lengths))}")
    if not 0 < cache_len <= max_len:
        raise ValueError(
            f"need 0 < cache_len <= max_len (DAPO uses L_cache=4096 for L_max=20480), "
            f"got cache_len={cache_len}, max_len={max_len}"
        )
    if not (factor >= 0 and math.isfinite(factor)):
        raise ValueError(f"factor must be a finite number >= 0, got {factor}")
    length = lengths.to(torch.float32)
    start = float(max_len - cache_len)
    ramp = (start - length) / float(cache_len)
    zero = torch.zeros((), dtype=torch.float32, device=length.device)
    minus_one = torch.full((), -1.0, dtype=torch.float32, device=length.device)
    pen = torch.where(length <= start, zero, torch.where(length <= float(max_len), ramp, minus_one))
    return pen * float(factor)
