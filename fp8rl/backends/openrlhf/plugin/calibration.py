"""Calibrated Clipping at paper scale: a window's calibration tokens, over data-parallel ranks.

The step's plan (``fp8rl.rl.calibration.plan``) says which rows of each optimizer-step window
feed the estimate; this module is the tensor side of how the OpenRLHF plugin feeds it (the
binding, ``binding.calibrate``, decides *when*; the loss computes the FP8 ratios): each
micro-batch's measured rows (:class:`Pending`) hand their tokens -- the FP8 ratio of the loss, on
the weights before the window's optimizer step, the BF16 shadow ratio of the same tokens on the
same weights, the advantage and a global sequence id -- to the window's :class:`StepTokens`
(:func:`add_measured`); the binding gathers the tokens of all ranks and calls the window's
``calibrate`` on every rank.

Gathering, not reducing: the tokens of all ranks are all-gathered exactly (variable lengths:
sizes first, then padded payloads, :func:`varlen_all_gather`) and concatenated in rank order, so
every rank runs the controller on the same tensors and ends with the same bounds and the same
agreement counts (``shadow/low_bf16_n`` ...), exactly what one process holding the tokens of all
ranks would compute. A histogram all-reduce would cost O(bins) but quantise the bound; three
floats per A != 0 token of the measured micro-batches are small next to the forward passes.

Only unmasked tokens with A != 0 travel (:func:`calibration_tokens`): the estimator and the
agreement counts ignore A == 0 tokens, so dropping them changes nothing but the payload.

Torch and ``torch.distributed`` only (the collective comes in as a function; None = this rank).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["KEYS", "ROW_BITS", "Pending", "StepTokens", "add_measured", "calibration_tokens", "gather_calibration",
           "log_ratio_to_ratio", "varlen_all_gather"]

#: The per-token tensors a calibration hands over (``shadow`` absent with a static reference).
KEYS = ("ratio", "shadow", "adv", "seq")
#: Row ids are unique per rank; the global sequence id is ``rank << ROW_BITS | row``.
ROW_BITS = 24


def varlen_all_gather(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """All-gather 1-D tensors of different lengths over ``group`` (sizes first, then padded payloads)."""
    import torch.distributed as dist

    n = torch.tensor([t.numel()], device=t.device, dtype=torch.long)
    world = dist.get_world_size(group)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    top = int(max(int(s) for s in sizes))
    padded = torch.zeros(top, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    outs = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(outs, padded, group=group)
    return [o[: int(s)] for o, s in zip(outs, sizes, strict=True)]


def log_ratio_to_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` log-probs and old log-probs -> the ratio as the loss computes it (no grad,
    float32 or wider, log-ratio clamped to ``fp8rl.rl.policy_loss.LOG_RATIO_CLAMP``)."""
    from fp8rl.rl.policy_loss import LOG_RATIO_CLAMP

    with torch.no_grad():
        dtype = torch.promote_types(log_probs.dtype, torch.float32)
        log_ratio = log_probs.detach().to(dtype) - old_log_probs.detach().to(dtype)
        return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def calibration_tokens(ratio, shadow_ratio, advantages, mask, seq=None) -> dict[str, torch.Tensor]:
    """The tokens a calibration reads, flattened: unmasked tokens with A != 0.

    ``ratio``, ``advantages``, ``mask`` (and ``shadow_ratio`` unless None) ``[B, T]``, ``seq``
    ``[B]`` sequence ids or None -> ``{"ratio": [n], "adv": [n]}`` (+ ``"shadow": [n]``, float32,
    detached; + ``"seq": [n]`` int64)."""
    m = mask.bool() & (advantages != 0)
    out = {"ratio": ratio.detach()[m].float(), "adv": advantages.detach()[m].float()}
    if shadow_ratio is not None:
        out["shadow"] = shadow_ratio.detach()[m].float()
    if seq is not None:
        out["seq"] = seq.to(torch.int64)[:, None].expand(m.shape)[m]
    return out


class StepTokens:
    """The calibration tokens of one window on this rank, in arrival order.

    ``shadow`` (None: whatever the first micro-batch brings): whether the tokens carry a BF16
    shadow ratio; an empty sink then still hands every key (``local``), so that every rank runs
    the same collectives when some rank measured nothing."""

    def __init__(self, shadow: bool | None = None) -> None:
        self.parts: list[dict[str, torch.Tensor]] = []
        self.shadow = shadow

    def add(self, ratio, shadow_ratio, advantages, mask, seq=None) -> None:
        """One micro-batch: ``[B, T]`` tensors (and ``[B]`` ids) as :func:`calibration_tokens` takes them."""
        part = calibration_tokens(ratio, shadow_ratio, advantages, mask, seq)
        if self.shadow is not None and ("shadow" in part) != self.shadow:
            raise ValueError(f"a micro-batch came {'without' if self.shadow else 'with'} a BF16 shadow ratio to a "
                             f"window that {'measures' if self.shadow else 'does not measure'} one")
        if self.parts and set(part) != set(self.parts[0]):
            raise ValueError("a micro-batch came with a BF16 shadow ratio and another without: every measured "
                             "micro-batch of a step needs one (shadow reference) or none does (static)")
        self.parts.append(part)

    @property
    def micro_batches(self) -> int:
        return len(self.parts)

    def local(self, device=None) -> dict[str, torch.Tensor]:
        """This rank's tokens concatenated (``{key: [n]}``; empty tensors when nothing was added)."""
        if not self.parts:
            out = {"ratio": torch.zeros(0, device=device), "adv": torch.zeros(0, device=device),
                   "seq": torch.zeros(0, dtype=torch.int64, device=device)}
            if self.shadow:
                out["shadow"] = torch.zeros(0, device=device)
            return out
        return {k: torch.cat([p[k] for p in self.parts]) for k in self.parts[0]}


def gather_calibration(local: dict[str, torch.Tensor],
                       all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None) -> dict[str, torch.Tensor]:
    """Concatenate every rank's calibration tokens (rank order); ``all_gather=None``: this rank only.

    Every rank must hand the same keys (one collective per key, in sorted key order)."""
    if all_gather is None:
        return dict(local)
    return {k: torch.cat(all_gather(v.contiguous())) for k, v in sorted(local.items())}


class Pending:
    """What the loss of one micro-batch needs from the plan (set by the binding): ``rows`` ``[B]``
    (this rank's row ids), ``measured`` and ``shadowed`` ``[B]`` bool, ``shadow`` the BF16 shadow
    ratio ``[B, T]`` (ones on unshadowed rows; None when no row is shadowed), ``rank`` the DP rank,
    ``holdout`` ``[B]`` bool the held-out rows (``plan.StepPlan.holdout``: shadowed, never
    measured; None: none)."""

    def __init__(self, rows, measured, shadowed, shadow, rank: int = 0, holdout=None) -> None:
        self.rows, self.measured, self.shadowed, self.shadow, self.rank = rows, measured, shadowed, shadow, rank
        self.holdout = torch.zeros_like(shadowed, dtype=torch.bool) if holdout is None else holdout


def add_measured(sink: StepTokens, p: Pending, ratio, advantages, mask) -> None:
    """The measured rows' tokens of one micro-batch (``[B, T]``) into a window's sink, with their
    global sequence ids (``rank << ROW_BITS | row``)."""
    m = p.measured.to(ratio.device)
    if not bool(m.any()):
        return
    seq = (p.rows.to(ratio.device) | (int(p.rank) << ROW_BITS))[m]
    shadow = None if p.shadow is None else p.shadow[m]
    sink.add(ratio[m], shadow, advantages[m], mask[m], seq=seq)
