"""Reduce a per-token loss matrix to the scalar that is back-propagated.

Modes (registry ``LOSS_AGGREGATIONS``; names as in verl's ``agg_loss``):

- ``token-mean`` (DAPO, Yu et al. 2025, Sec. 3.3 "token-level policy gradient loss"):
  sum over all response tokens of the batch / number of response tokens.
- ``seq-mean-token-mean`` (original GRPO, Shao et al. 2024, Eq. 3): mean over each
  sequence's tokens, then mean over sequences.
- ``seq-mean-token-sum-norm`` (Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-Like
  Training", Sec. 3.2): each sequence's token *sum* divided by a constant ``horizon``
  (e.g. the maximum response length), then mean over sequences. The constant removes
  GRPO's length bias; ``horizon`` is required for this mode.

Data-parallel sharding and gradient accumulation. Every mode is a sum over sequences of a
per-sequence term divided by a batch-wide count:

    token-mean:               sum_i sum_t l_it m_it           / global_tokens
    seq-mean-token-mean:      sum_i (sum_t l_it m_it / n_i)   / global_seqs
    seq-mean-token-sum-norm:  sum_i (sum_t l_it m_it / horizon) / global_seqs

where n_i is sequence i's token count, ``global_tokens`` is the number of response tokens
and ``global_seqs`` the number of sequences with at least one response token, both over
the *whole* batch (all ranks, all micro-batches of one optimizer step). A shard that
passes the global counts therefore returns its share, and **the shards' values sum to the
whole-batch value** (tested). Without global counts a shard is normalised by its own
counts, which is the whole-batch value only for a single shard.

How this maps onto upstream: verl's ``agg_loss(..., dp_size, batch_num_tokens,
global_batch_size)`` and OpenRLHF 0.11.2's ``aggregate_loss`` compute
``sum / global_count * dp_size``, because DDP/DeepSpeed *average* gradients over the
``dp_size`` ranks. We leave that factor to the caller: under gradient averaging multiply
our value by the world size; under gradient summation (or plain accumulation of
micro-batches) use it as is.

Choices made here:

- Fully masked sequences are excluded from the sequence count (as verl and OpenRLHF do for
  ``seq-mean-token-mean``), and we do the same for ``seq-mean-token-sum-norm``. verl's
  ``seq-mean-token-sum-norm`` divides the *sum* over sequences by the horizon with no
  division by the number of sequences; we follow the Dr.GRPO reference (a mean over
  sequences), which differs from verl by the constant factor global_seqs (a learning-rate
  rescaling).
- An empty shard (no response tokens) contributes 0. Without global counts an all-masked
  batch also returns 0 (the empty sum), not NaN, so that a rank with nothing to train on
  cannot poison the all-reduce; it keeps the autograd graph.
- Counts unused by a mode are ignored (a trainer may always pass both counts); ``horizon``
  is only read by ``seq-mean-token-sum-norm``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fp8rl.registry import Registry
from fp8rl.rl.diagnostics import _as_bool_mask

__all__ = ["LOSS_AGGREGATIONS", "aggregate"]

Count = float | int | torch.Tensor
AggFn = Callable[..., torch.Tensor]

LOSS_AGGREGATIONS: Registry[AggFn] = Registry("loss aggregation mode")


def _divide(total: torch.Tensor, count: Count | None, local: torch.Tensor) -> torch.Tensor:
    """total / count, with count defaulting to the local count; 0 when that is 0."""
    if count is None:
        return total / local.clamp(min=1).to(total.dtype)  # local == 0 -> total == 0 -> 0
    return total / (count.to(total.dtype) if isinstance(count, torch.Tensor) else count)


def _seq_terms(loss_mat: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence token sums ``[B]``, token counts ``[B]`` and the has-tokens mask ``[B]``."""
    sums = torch.where(m, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)).sum(-1)
    counts = m.sum(-1)
    return sums, counts, counts > 0


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(loss_mat, m, *, global_tokens=None, global_seqs=None, horizon=None) -> torch.Tensor:
    """sum of all response-token losses / global_tokens (default: this batch's token count)."""
    total = torch.where(m, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)).sum()
    return _divide(total, global_tokens, m.sum())


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss_mat, m, *, global_tokens=None, global_seqs=None, horizon=None) -> torch.Tensor:
    """sum over sequences of (token mean) / global_seqs (default: non-empty sequences here)."""
    sums, counts, has = _seq_terms(loss_mat, m)
    per_seq = sums / counts.clamp(min=1).to(sums.dtype)  # empty sequences: 0 / 1 = 0
    return _divide(per_seq.sum(), global_seqs, has.sum())


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss_mat, m, *, global_tokens=None, global_seqs=None, horizon=None) -> torch.Tensor:
    """sum over sequences of (token sum / horizon) / global_seqs (Dr.GRPO)."""
    if horizon is None:
        raise ValueError(
            "loss aggregation 'seq-mean-token-sum-norm' needs horizon= (a constant such as the "
            "maximum response length; Dr.GRPO divides each sequence's token sum by it)"
        )
    horizon = float(horizon)
    if not (horizon > 0 and math.isfinite(horizon)):
        raise ValueError(f"horizon must be a finite number > 0, got {horizon}")
    sums, _, has = _seq_terms(loss_mat, m)
    return _divide(sums.sum() / horizon, global_seqs, has.sum())


def _check_count(name: str, value: Count | None) -> None:
    if value is None or isinstance(value, torch.Tensor):
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return  # a device tensor is not synced to the host to check it
    if not (float(value) > 0 and math.isfinite(float(value))):
        raise ValueError(f"{name} must be a positive finite count (the whole batch's), got {value}")


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
    horizon: float | None = None,
) -> torch.Tensor:
    """Reduce ``loss_mat [B, T]`` over response tokens (``mask [B, T]``) to a 0-d tensor.

    Args:
        mode: a ``LOSS_AGGREGATIONS`` name.
        global_tokens: response tokens in the whole batch (``token-mean``).
        global_seqs: non-empty sequences in the whole batch (the ``seq-mean-*`` modes).
        horizon: the constant divisor of ``seq-mean-token-sum-norm``.

    With global counts, values from disjoint shards of a batch sum to the whole-batch value.
    """
    fn = LOSS_AGGREGATIONS[mode]
    if not isinstance(loss_mat, torch.Tensor) or loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be a [B, T] tensor, got {getattr(loss_mat, 'shape', type(loss_mat))}")
    m = _as_bool_mask(mask, loss_mat)
    _check_count("global_tokens", global_tokens)
    _check_count("global_seqs", global_seqs)
    return fn(loss_mat, m, global_tokens=global_tokens, global_seqs=global_seqs, horizon=horizon)
