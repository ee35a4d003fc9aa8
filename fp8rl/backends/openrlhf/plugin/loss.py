"""Our policy loss inside OpenRLHF, and Calibrated Clipping across data-parallel ranks.

**Loss** (paper: the PPO-clip surrogate with the train/rollout IS weight).
:func:`make_policy_loss_class` subclasses upstream ``PolicyLoss`` with its constructor and
``forward`` signature and its 5-tuple ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``,
and computes it with ``fp8rl.rl.correction.corrected_ppo_token_loss`` +
``fp8rl.rl.aggregation.aggregate`` using the bounds of our clip method (``vanilla``: ``1 -+ eps``;
``calibrated``: the controller's). With calibration off it equals upstream (tested against the
real 0.11.2 class). Upstream's IS options map onto ours (:func:`correction_from_upstream`):
token/clip/threshold ``(0, C)`` = TIS with cap C; token/mask = ICEPOP; off = none; anything else
raises. The loss adds each micro-batch's counts to ``self.step_metrics``
(``plugin.metrics.StepMetrics``), never to ``experience.info`` (see ``metrics`` for why).

**Calibrated Clipping across DP ranks.** On a calibration step the binding hands the loss the
BF16 shadow ratios of the measured micro-batch (``pending_shadow``); the loss computes the FP8
ratios from its own inputs, **all-gathers** ``(ratio, shadow ratio, advantage)`` of the unmasked
A != 0 tokens of every DP rank (variable lengths: sizes first, then padded payloads;
:func:`varlen_all_gather`) and runs the controller on the concatenation in rank order
(:func:`global_update`). Every rank computes the same bounds from the same tensors, exactly what
one process holding the whole micro-batch would compute. A histogram all-reduce would cost
O(bins) but quantise the bound; 3 floats per token of one micro-batch every K steps is
negligible next to the forward passes.

Torch and the project's ``fp8rl.rl`` only; upstream classes come in as arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fp8rl.backends.openrlhf.plugin.spec import PluginSpec


def correction_from_upstream(level: str, mode: str, gating: str, threshold: Sequence[float]) -> tuple[str, dict]:
    """Upstream's ``is_correction_*`` options -> ``(our correction name, its params)``."""
    if level == "off":
        return "none", {}
    if level != "token" or gating != "ratio":
        raise ValueError(f"is_correction_level={level!r}, gating={gating!r} has no fp8rl equivalent; "
                         "use token level with ratio gating (TIS / ICEPOP)")
    low, high = (float(x) for x in threshold)
    if mode == "clip":
        if low != 0.0:
            raise ValueError(f"is_correction_mode=clip with threshold low {low} > 0 clamps the IS weight "
                             "from below, which TIS does not; pass --algo.advantage.is_correction_threshold 0 C")
        return "tis", {"cap": high}
    return "icepop", {"low": low, "high": high}


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


def calibration_tokens(ratio, shadow_ratio, advantages, mask) -> dict[str, torch.Tensor]:
    """The tokens a calibration reads, flattened: unmasked tokens with A != 0 (``[n]`` each)."""
    m = mask.bool() & (advantages != 0)
    out = {"ratio": ratio.detach()[m].float(), "adv": advantages.detach()[m].float()}
    if shadow_ratio is not None:
        out["shadow"] = shadow_ratio.detach()[m].float()
    return out


def gather_calibration(local: dict[str, torch.Tensor],
                       all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None) -> dict[str, torch.Tensor]:
    """Concatenate every rank's calibration tokens (rank order); ``all_gather=None``: this rank only."""
    if all_gather is None:
        return dict(local)
    return {k: torch.cat(all_gather(v.contiguous())) for k, v in sorted(local.items())}


def global_update(clipper, step: int, local: dict[str, torch.Tensor],
                  all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None):
    """Run the clip method's ``update`` on the tokens of all ranks; returns the new bounds."""
    g = gather_calibration(local, all_gather)
    ones = torch.ones_like(g["ratio"], dtype=torch.bool)
    return clipper.update(step, ratio=g["ratio"], shadow_ratio=g.get("shadow"), advantages=g["adv"], mask=ones)


def make_policy_loss_class(base: type, spec: PluginSpec) -> type:
    """A subclass of upstream ``PolicyLoss`` (``base``) computing the loss with our kernel.

    The class has upstream's constructor and ``forward`` signature; ``spec`` fixes the clip
    method. Instances expose ``clipper``, ``step`` (the controller step, set by the trainer
    wrapper), ``step_metrics`` (a ``StepMetrics`` receiving each micro-batch's counts, or None),
    ``pending_shadow`` (BF16 shadow ratios ``[B, T]`` for the next forward, which then
    calibrates) and ``all_gather`` (the DP all-gather the calibration uses, None = this rank).
    """
    from fp8rl.rl.aggregation import aggregate
    from fp8rl.rl.correction import corrected_ppo_token_loss
    from fp8rl.rl.policy_loss import LOG_RATIO_CLAMP

    class Fp8rlPolicyLoss(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.policy_loss_type != "ppo":
                raise ValueError(f"fp8rl's loss implements policy_loss_type='ppo' only, got {self.policy_loss_type!r}")
            if (self.clip_eps_low, self.clip_eps_high) != (spec.eps_low, spec.eps_high):
                raise ValueError(f"--actor.eps_clip_low_high ({self.clip_eps_low}, {self.clip_eps_high}) "
                                 f"disagrees with the plugin spec ({spec.eps_low}, {spec.eps_high})")
            self.correction, self.correction_params = correction_from_upstream(
                self.is_correction_level, self.is_correction_mode, self.is_correction_gating,
                self.is_correction_threshold)
            self.agg_mode = "token-mean" if self.token_level_loss else "seq-mean-token-mean"
            self.spec = spec
            self.clipper = spec.make_clipper()
            self.step = 0
            self.step_metrics = None
            self.pending_shadow: torch.Tensor | None = None
            self.all_gather: Callable | None = None

        def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None,
                    dp_size=1, batch_num_tokens=None, global_batch_size=None):
            """``[B, T]`` log-probs, old log-probs, advantages, mask, rollout log-probs -> the 5-tuple."""
            if action_mask is None:
                action_mask = torch.ones_like(log_probs, dtype=torch.bool)
            with torch.no_grad():  # the kernel's ratio: float32 or wider, same clamp
                dtype = torch.promote_types(log_probs.dtype, torch.float32)
                log_ratio = log_probs.detach().to(dtype) - old_log_probs.detach().to(dtype)
                ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            if self.pending_shadow is not None:
                shadow, self.pending_shadow = self.pending_shadow, None
                local = calibration_tokens(ratio, shadow, advantages, action_mask)
                global_update(self.clipper, self.step, local, self.all_gather)
            low, high = self.clipper.bounds(self.step).as_tuple()
            corr = self.correction if rollout_log_probs is not None else "none"
            loss_mat, m = corrected_ppo_token_loss(
                log_probs, old_log_probs, rollout_log_probs if corr != "none" else None, advantages,
                action_mask, low=low, high=high, dual_clip=self.dual_clip, correction=corr,
                correction_params=self.correction_params if corr != "none" else None)
            if batch_num_tokens is None and global_batch_size is None:
                loss = aggregate(loss_mat, action_mask, self.agg_mode)
            else:
                loss = aggregate(loss_mat, action_mask, self.agg_mode, global_tokens=batch_num_tokens,
                                 global_seqs=global_batch_size) * dp_size
            if self.step_metrics is not None:
                self.step_metrics.add(ratio, advantages, action_mask, low=low, high=high,
                                      mismatch_kl=m.get("rollout/mismatch_kl"))
            if spec.dump_dir:
                dump(spec.dump_dir, self, ratio=ratio, advantages=advantages, mask=action_mask, low=low,
                     high=high, loss=loss)
            return loss, m["actor/clipfrac"], m["actor/ppo_kl"], m.get("rollout/mismatch_k1"), \
                m.get("rollout/is_clipfrac")

    Fp8rlPolicyLoss.__qualname__ = Fp8rlPolicyLoss.__name__ = "Fp8rlPolicyLoss"
    return Fp8rlPolicyLoss


def dump(directory: str, loss_fn, **tensors) -> None:
    """Write one micro-batch's loss inputs and bounds (``PluginSpec.dump_dir``; tests only).

    File ``<directory>/rank<R>-<pid>-<N>.pt`` (``N`` counts this process's forwards; a resumed
    attempt is another process): the controller step, pid, time, the tensors given (detached, on
    the CPU) and the bounds in force. The tests of the smoke job recompute the logged clip
    fractions from these files."""
    import os
    import time

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    n = loss_fn._fp8rl_dumps = getattr(loss_fn, "_fp8rl_dumps", 0) + 1
    rec = {"step": int(loss_fn.step), "rank": rank, "n": n, "pid": os.getpid(), "time": time.time()}
    for k, v in tensors.items():
        rec[k] = v.detach().to("cpu").clone() if isinstance(v, torch.Tensor) else v
    os.makedirs(directory, exist_ok=True)
    torch.save(rec, os.path.join(directory, f"rank{rank}-{os.getpid()}-{n:05d}.pt"))
