"""The BF16 shadow of one mini trainer step, and the diagnostic gradient comparison.

Calibrated Clipping needs FP8 and BF16 ratios of the *same* tokens (the paper's shadow is two
extra BF16 forwards: old policy and current policy). The step's plan
(``fp8rl.rl.calibration.plan``; the clip method's ``begin_step``) says which sequences get a
shadow and which feed the estimate; this module computes what the plan asks for:

1. :func:`shadow_old_log_probs`: the BF16 old log-probs of the shadowed sequences, on the weights
   theta_0 that sampled the batch (``fp8_disabled``), in rollout order in micro-batches of
   ``logprob_micro_batch`` rows (when every row is shadowed: the very micro-batches of the FP8
   old log-probs);
2. :func:`shadow_ratio`: in each mini-batch, before its update (weights theta_j), the BF16
   current log-probs of its shadowed rows (one no-grad forward of those rows with FP8 off) over
   their BF16 old log-probs: the shadow ratio of the same tokens the loss's FP8 ratio is
   computed on. Before the step's first optimizer step the weights are still theta_0, so the
   current log-probs are the old ones and no forward runs (ratio 1; the BF16 forward's rows do
   not depend on each other, so the forward would give the very same numbers: checked by the
   golden-number tests). This saves a quarter of the current-policy shadow forwards with 4
   mini-batches. Paper scale does not take this shortcut yet (its first optimizer step's
   micro-batches run their shadow forward; ``docs/cluster.md``).

A trainer without FP8 layers (``bf16``, ``rollout_only``) computes BF16 already: its own ratios
are the shadow and no extra forward runs.

**The gradient as trained against BF16's** (``shadow/grad_cos``, :func:`reference_grad_cos`;
``clip.shadow_diagnostics`` only): after a mini-batch's backward, the policy-loss gradient as
trained (its FP8 forward, FP8 ratios, the arm's bounds, its IS weights) is set aside; the same
loss is then computed through the BF16 model (``fp8_disabled``, with grad) with the BF16 shadow
ratios (BF16 current over BF16 old log-probs), the **vanilla** bounds and the IS weights a BF16
trainer would compute (its old log-probs against the engine's), on the same weights and tokens,
and backpropagated; the cosine of the two gradients over every trainable parameter is logged and
the trained gradient restored before clipping and the optimizer step (training is unchanged).
One more forward and backward per mini-batch on diagnostic steps.

**The same on the held-out rows alone** (``shadow/ho_grad_cos``, :func:`holdout_grad_cos`;
``clip.holdout_share`` > 0, every arm alike, issue 46): the policy loss of the mini-batch's
held-out rows as trained (FP8 forward and ratios, the bounds in force on them, the arm's IS
weights; the Score Centering term left out, as in ``shadow/grad_cos``) against the BF16 reference
of the same rows, each backpropagated on its own. Rows that fed no estimate, so the cosine scores
the deployed bound where it cannot have fitted its own tokens. Two more forwards and backwards of
the held-out rows per mini-batch.
"""

from __future__ import annotations

import time

import torch

from fp8rl.backends.mini.batch import token_logprobs

__all__ = ["grad_cosine", "holdout_grad_cos", "reference_grad_cos", "shadow_old_log_probs", "shadow_ratio"]


@torch.no_grad()
def shadow_old_log_probs(trainer, rb, rows: torch.Tensor) -> torch.Tensor:
    """BF16 old log-probs ``[N, T]`` of the sequences ``rows`` (``[N]`` bool; zeros elsewhere)."""
    from fp8rl.quant.convert import fp8_disabled

    out = torch.zeros_like(rb.rollout_log_probs)
    idx = torch.nonzero(rows, as_tuple=False).flatten().to(trainer.device)
    size = trainer.cfg.logprob_micro_batch
    with fp8_disabled(trainer.policy):
        for i in range(0, idx.numel(), size):
            part = idx[i:i + size]
            out[part] = token_logprobs(trainer.forward_logits(rb, part), rb.response_ids[part], trainer.cfg.temperature)
    return out


@torch.no_grad()
def shadow_ratio(trainer, rb, idx: torch.Tensor, shadow_old: torch.Tensor, *, old_weights: bool = False) -> torch.Tensor:
    """BF16 shadow ratio ``[n, T]`` of rows ``idx`` on the current weights (FP8 off).

    ``old_weights``: no optimizer step has run since ``shadow_old`` was computed (the step's
    first mini-batch), so the BF16 current log-probs *are* ``shadow_old`` (the same weights and
    a BF16 forward whose rows do not depend on each other: no per-tensor scale) and no forward
    runs; the ratio is ``exp(0) = 1`` on every finite token, as the forward would give."""
    from fp8rl.quant.convert import fp8_disabled
    from fp8rl.rl.policy_loss import LOG_RATIO_CLAMP

    if old_weights:
        logp = shadow_old
    else:
        with fp8_disabled(trainer.policy):
            logp = token_logprobs(trainer.forward_logits(rb, idx), rb.response_ids[idx], trainer.cfg.temperature)
    return torch.exp((logp - shadow_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def grad_cosine(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    """Cosine of two gradients given per parameter (None = zero; float64 accumulation; NaN if
    either is zero)."""
    dot = na = nb = 0.0
    for x, y in zip(a, b, strict=True):
        if x is not None:
            na += float((x.double() ** 2).sum())
        if y is not None:
            nb += float((y.double() ** 2).sum())
        if x is not None and y is not None:
            dot += float((x.double() * y.double()).sum())
    return dot / (na ** 0.5 * nb ** 0.5) if na > 0 and nb > 0 else float("nan")


def reference_grad_cos(trainer, rb, idx: torch.Tensor, adv: torch.Tensor, shadow_old: torch.Tensor,
                       ref_weights: torch.Tensor) -> tuple[float, float]:
    """``(cosine, seconds)``: the gradient now in ``.grad`` (the loss as trained, just
    backpropagated) against the BF16 reference gradient of the same rows (module docstring);
    the trained gradient is back in ``.grad`` on return.

    ``adv`` ``[n, T]``, ``shadow_old`` ``[n, T]`` BF16 old log-probs, ``ref_weights`` ``[n, T]``
    the IS weights a BF16 trainer would apply (ones without IS correction)."""
    from fp8rl.quant.convert import fp8_disabled
    from fp8rl.rl.aggregation import aggregate
    from fp8rl.rl.calibration import Bounds
    from fp8rl.rl.policy_loss import ppo_token_loss

    t0 = time.perf_counter()
    cfg, a = trainer.cfg, trainer.cfg.algorithm
    params = [p for p in trainer.policy.parameters() if p.requires_grad]
    trained = _grads(params)
    trainer.optimizer.zero_grad(set_to_none=True)
    vanilla = Bounds.vanilla(a.eps_low, a.eps_high)
    mask = rb.response_mask[idx]
    with fp8_disabled(trainer.policy):
        logp = token_logprobs(trainer.forward_logits(rb, idx), rb.response_ids[idx], cfg.temperature)
    loss_mat, _ = ppo_token_loss(logp, shadow_old, adv, mask, low=vanilla.low, high=vanilla.high,
                                 dual_clip=a.dual_clip, metrics=False)
    loss = aggregate(loss_mat * ref_weights, mask, a.loss_agg_mode, horizon=cfg.max_response_len)
    loss.backward()
    reference = _grads(params)
    cos = grad_cosine(trained, reference)
    for p, g in zip(params, trained, strict=True):
        p.grad = g
    return cos, time.perf_counter() - t0


def holdout_grad_cos(trainer, rb, idx: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, weights: torch.Tensor,
                     bounds, shadow_old: torch.Tensor, ref_weights: torch.Tensor) -> tuple[float, float]:
    """``(cosine, seconds)`` of the held-out rows ``idx`` (``[h]``; module docstring): their loss
    as trained (FP8 old log-probs ``old``, advantages ``adv``, IS weights ``weights``, ``bounds``
    in force; all ``[h, T]``) against the BF16 reference (``shadow_old``, ``ref_weights``, the
    vanilla bounds); the gradient in ``.grad`` on entry is back on return."""
    from fp8rl.rl.aggregation import aggregate
    from fp8rl.rl.policy_loss import ppo_token_loss

    t0 = time.perf_counter()
    cfg, a = trainer.cfg, trainer.cfg.algorithm
    params = [p for p in trainer.policy.parameters() if p.requires_grad]
    kept = _grads(params)
    trainer.optimizer.zero_grad(set_to_none=True)
    mask = rb.response_mask[idx]
    logp = token_logprobs(trainer.forward_logits(rb, idx), rb.response_ids[idx], cfg.temperature)
    low, high = bounds.as_tuple()
    loss_mat, _ = ppo_token_loss(logp, old, adv, mask, low=low, high=high, dual_clip=a.dual_clip, metrics=False)
    aggregate(loss_mat * weights, mask, a.loss_agg_mode, horizon=cfg.max_response_len).backward()
    cos, _ = reference_grad_cos(trainer, rb, idx, adv, shadow_old, ref_weights)  # .grad (these rows) vs BF16
    for p, g in zip(params, kept, strict=True):
        p.grad = g
    return cos, time.perf_counter() - t0
