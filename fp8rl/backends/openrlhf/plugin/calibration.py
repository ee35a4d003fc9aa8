"""Calibrated Clipping at paper scale: the calibration tokens of a step, over data-parallel ranks.

The controller (``fp8rl.rl.calibration.CalibratedClipController``) has three modes
(``CALIBRATION_MODES``); this module is the tensor side of how the OpenRLHF plugin feeds them
(the binding, ``binding.calibrate``, decides *when*; the loss computes the FP8 ratios):

- ``periodic`` / ``pooled``: on a measured step (``clipper.measures(step)``: every ``period``-th
  step, resp. every step) **every micro-batch** of the step, on every DP rank, contributes its
  tokens (the FP8 ratio of its loss, on the weights before its optimizer step, and the BF16
  shadow ratio of the same tokens on the same weights) to a :class:`StepTokens`; after upstream's
  ``ppo_train`` the tokens of all ranks are gathered and pooled into **one**
  ``clipper.update(step, ...)`` (:func:`global_update`), whose bounds rule from the next step.
- ``same_batch``: each optimizer step's bounds come from that optimizer step's own tokens, all
  ranks, before its loss (:func:`global_update_batch`, ``clipper.update_batch``).

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

__all__ = ["KEYS", "StepTokens", "calibration_tokens", "gather_calibration", "global_update", "global_update_batch",
           "log_ratio_to_ratio", "varlen_all_gather"]

#: The per-token tensors a calibration hands over (``shadow`` absent with a static reference).
KEYS = ("ratio", "shadow", "adv")


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


def calibration_tokens(ratio, shadow_ratio, advantages, mask) -> dict[str, torch.Tensor]:
    """The tokens a calibration reads, flattened: unmasked tokens with A != 0.

    ``ratio``, ``advantages``, ``mask`` (and ``shadow_ratio`` unless None) ``[B, T]`` ->
    ``{"ratio": [n], "adv": [n]}`` (+ ``"shadow": [n]``), float32, detached."""
    m = mask.bool() & (advantages != 0)
    out = {"ratio": ratio.detach()[m].float(), "adv": advantages.detach()[m].float()}
    if shadow_ratio is not None:
        out["shadow"] = shadow_ratio.detach()[m].float()
    return out


class StepTokens:
    """The calibration tokens of one step (or one optimizer step) on this rank, in arrival order."""

    def __init__(self) -> None:
        self.parts: list[dict[str, torch.Tensor]] = []

    def add(self, ratio, shadow_ratio, advantages, mask) -> None:
        """One micro-batch: ``[B, T]`` tensors as :func:`calibration_tokens` takes them."""
        part = calibration_tokens(ratio, shadow_ratio, advantages, mask)
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
            return {"ratio": torch.zeros(0, device=device), "adv": torch.zeros(0, device=device)}
        return {k: torch.cat([p[k] for p in self.parts]) for k in self.parts[0]}


def gather_calibration(local: dict[str, torch.Tensor],
                       all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None) -> dict[str, torch.Tensor]:
    """Concatenate every rank's calibration tokens (rank order); ``all_gather=None``: this rank only.

    Every rank must hand the same keys (one collective per key, in sorted key order)."""
    if all_gather is None:
        return dict(local)
    return {k: torch.cat(all_gather(v.contiguous())) for k, v in sorted(local.items())}


def _controller_args(g: dict[str, torch.Tensor]) -> dict:
    ones = torch.ones_like(g["ratio"], dtype=torch.bool)
    return {"ratio": g["ratio"], "shadow_ratio": g.get("shadow"), "advantages": g["adv"], "mask": ones}


def global_update(clipper, step: int, local: dict[str, torch.Tensor],
                  all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None):
    """``periodic`` / ``pooled``: one ``clipper.update`` on the pooled tokens of all ranks (call on
    every rank, after the step); returns the bounds that rule from the next step."""
    return clipper.update(step, **_controller_args(gather_calibration(local, all_gather)))


def global_update_batch(clipper, step: int, local: dict[str, torch.Tensor],
                        all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None):
    """``same_batch``: ``clipper.update_batch`` on one optimizer step's tokens of all ranks (call on
    every rank, before that optimizer step's loss); returns the bounds its loss uses."""
    return clipper.update_batch(step, **_controller_args(gather_calibration(local, all_gather)))
