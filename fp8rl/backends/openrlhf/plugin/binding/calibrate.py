"""The calibration schedule in the PPO actors: which micro-batches are measured, the BF16 shadow
forwards, and the ``same_batch`` pre-pass over each optimizer step (called from ``actor``).

OpenRLHF 0.11.2's ``ActorPPOTrainer.ppo_train`` runs one *step* (the controller's step: the
number of ``ppo_train`` calls so far) as ``num_mini_batches`` optimizer steps per rank, each
accumulating ``accumulated_gradient`` micro-batches (``iter_grad_accum_global_norm`` groups
them; a micro-batch is ``micro_train_batch_size`` samples; forward, loss and backward per
micro-batch in ``training_step``, the optimizer step after the last one of a window).

**BF16 shadow** (unchanged from before the modes): on a step that needs it
(``clipper.needs_shadow(step)``, ``== clipper.measures(step)``) the BF16 log-probs of every replay-buffer sample under the
weights before the first update are computed first (``fp8_disabled``, no grad, in micro-batches;
kept in the sample's ``info`` under ``SHADOW_OLD_KEY``, popped before upstream sees it). The BF16
ratio of a micro-batch is ``exp(BF16 log-probs now - BF16 old log-probs)``, one more forward with
FP8 off on the weights the micro-batch's loss sees. A measured micro-batch without its BF16 old
log-probs raises.

**periodic / pooled.** On a calibration step (``clipper.is_calibration_step(step)``; the BF16
shadow when ``clipper.needs_shadow(step)``, i.e. unless the reference is static) every micro-batch of every
rank is measured: ``training_step`` computes its BF16 ratio before upstream's forward, the loss
adds ``(FP8 ratio, BF16 ratio, A)`` of its tokens to the step's ``StepTokens``; after upstream's
``ppo_train`` the tokens of all ranks are gathered and one ``clipper.update(step)`` runs on every
rank (``plugin.calibration.global_update``); the bounds rule from the next step. Cost per
measured step: one BF16 forward per micro-batch for the old log-probs, one per micro-batch for
the current ones (2 no-grad forwards per micro-batch, against ~3 forward-equivalents of
forward + backward; +1 with gradient checkpointing).

**same_batch: a no-grad pre-pass per optimizer step** (the choice). The mini trainer's unit is the
mini-batch, one optimizer step: its bounds come from all its tokens, measured on the weights
before its update, and rule its whole loss. Here an optimizer step is ``accumulated_gradient``
micro-batches per rank x the DP ranks, and the loss of its first micro-batch is computed (and
backpropagated) before the forward of its second. So before the first micro-batch of each window
the plugin runs, for each of the window's micro-batches, a no-grad FP8 forward (the loss's ratio:
same weights, same inputs, same module in train mode; deterministic forwards give the same
numbers, checked on CPU by the integration tier) and a no-grad BF16 forward (the shadow ratio),
gathers the window's tokens of all ranks, calls ``clipper.update_batch`` once and hands the
bounds to the loss (``batch_bounds``) for every micro-batch of the window. Cost per step: the
BF16 old log-probs (1 forward per micro-batch) plus 2 no-grad forwards per micro-batch, about
+1x the training phase's compute (the rollout is not affected). The alternative, calibrating each
micro-batch between its forward and its loss from its own tokens (gathered over ranks), costs one
forward less per micro-batch but calibrates on ``1 / accumulated_gradient`` of the optimizer
step's tokens and mixes several bounds in one gradient: at alpha ~ 1e-4 the quantile then rests
on a few tokens (``clip/low_data``). With ``accumulated_gradient == 1`` both coincide except for
the FP8 forward, which the pre-pass repeats. Deviations from the mini trainer: the FP8 ratio the
bounds are computed from comes from a separate no-grad forward (equal to the loss's where the
forward is deterministic; on GPUs a non-deterministic kernel can change the last bits), and the
calibration unit is OpenRLHF's optimizer step over all DP ranks. Dynamic batching
(``--train.dynamic_batch_enable``, which fp8rl never sets) has no windows and is refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from fp8rl.backends.openrlhf.plugin.binding.common import SHADOW_OLD_KEY, UpstreamChangedError
from fp8rl.backends.openrlhf.plugin.calibration import (
    StepTokens,
    global_update,
    global_update_batch,
    log_ratio_to_ratio,
)


def _device() -> torch.device:
    """Where the step's tensors live (the rank's GPU; the CPU in the CPU job)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def counting(counters: dict | None, phase: str):
    """``plugin.kernels.count_matmuls`` into ``counters[phase]`` (a no-op without counters)."""
    import contextlib

    if counters is None:
        return contextlib.nullcontext()
    from fp8rl.backends.openrlhf.plugin.kernels import count_matmuls

    return count_matmuls(counters[phase])


def actor_log_probs(trainer, experience, *, fp8: bool) -> torch.Tensor:
    """Log-probs ``[B, T]`` of ``experience`` under the current weights, no grad; ``fp8=False``:
    the BF16 shadow (``fp8_disabled``), ``fp8=True``: the FP8 model as the loss's forward runs it."""
    import contextlib

    from fp8rl.quant.convert import fp8_disabled

    counter = getattr(trainer, "_fp8rl_kernels", None)  # diagnostic dumps only (plugin.kernels)
    off = contextlib.nullcontext() if fp8 else fp8_disabled(trainer.actor.model)
    with torch.no_grad(), off, counting(counter, "train" if fp8 else "shadow"):
        return trainer.actor(experience.sequences, experience.action_mask, attention_mask=experience.attention_mask,
                             ring_attn_group=trainer.strategy.ring_attn_group)


def shadow_old_pass(trainer, items, metrics) -> None:
    """BF16 log-probs of every replay-buffer sample before the first update, into ``info[SHADOW_OLD_KEY]``."""
    t0 = time.perf_counter()
    size = max(1, int(trainer.micro_train_batch_size))
    for i in range(0, len(items), size):
        chunk = items[i:i + size]
        batch = trainer.replay_buffer.collate_fn(chunk)
        batch.to_device(_device())
        lp = actor_log_probs(trainer, batch, fp8=False).to("cpu")
        for j, item in enumerate(chunk):
            item.info[SHADOW_OLD_KEY] = lp[j, : item.action_mask.shape[0]]
    metrics.shadow_s += time.perf_counter() - t0


def shadow_ratio(trainer, experience, shadow_old) -> torch.Tensor:
    """BF16 ratio ``[B, T]`` of a micro-batch: BF16 log-probs now over the BF16 old log-probs."""
    from torch.nn.utils.rnn import pad_sequence

    if shadow_old is None:
        raise RuntimeError("a measured micro-batch has no BF16 old log-probs (the shadow pre-pass did not reach "
                           "this sample): the BF16 shadow ratio cannot be computed")
    t0 = time.perf_counter()
    mask = experience.action_mask
    old_bf16 = pad_sequence(list(shadow_old), batch_first=True).to(mask.device)[:, : mask.shape[1]]
    out = log_ratio_to_ratio(actor_log_probs(trainer, experience, fp8=False), old_bf16)
    trainer._fp8rl_metrics.shadow_s += time.perf_counter() - t0
    return out


def begin_step(trainer, step: int) -> None:
    """Set up the step's calibration: the shadow pre-pass, the loss's token sink or the windows."""
    loss = trainer.actor_loss_fn
    clipper = loss.clipper
    calibrates = bool(clipper.is_calibration_step(step))  # vanilla: never
    per_batch = calibrates and bool(clipper.per_batch)  # same_batch
    trainer._fp8rl_shadow = calibrates and bool(clipper.needs_shadow(step))  # False with a static reference
    trainer._fp8rl_same_batch = per_batch
    if per_batch and trainer.args.train.dynamic_batch_enable:
        raise ValueError("calibration mode same_batch needs OpenRLHF's fixed optimizer-step windows; "
                         "--train.dynamic_batch_enable has none: turn dynamic batching off or use "
                         "clip.calibration_mode=pooled")
    loss.step_tokens = StepTokens() if calibrates and not per_batch else None
    loss.batch_bounds = None
    if trainer._fp8rl_shadow:
        shadow_old_pass(trainer, trainer.replay_buffer.items, trainer._fp8rl_metrics)


def before_micro_batch(trainer, experience) -> None:
    """``training_step``, before upstream's forward: the BF16 ratio of a measured micro-batch."""
    loss = trainer.actor_loss_fn
    shadow_old = experience.info.pop(SHADOW_OLD_KEY, None)
    if loss.step_tokens is not None and trainer._fp8rl_shadow:
        loss.pending_shadow = shadow_ratio(trainer, experience, shadow_old)


def end_step(trainer, step: int) -> None:
    """After upstream's ``ppo_train`` (every rank): the pooled update of a measured step."""
    loss = trainer.actor_loss_fn
    tokens, loss.step_tokens, loss.batch_bounds, loss.pending_shadow = loss.step_tokens, None, None, None
    if tokens is not None and loss.clipper.is_calibration_step(step):
        global_update(loss.clipper, step, tokens.local(_device()), loss.all_gather)


def abort_step(trainer) -> None:
    loss = trainer.actor_loss_fn
    loss.step_tokens = loss.batch_bounds = loss.pending_shadow = None
    trainer._fp8rl_same_batch = False


def calibrate_window(trainer, window: list) -> None:
    """``same_batch``: the bounds of one optimizer step from its micro-batches on all ranks (the
    no-grad pre-pass; every rank calls it once per window, in the same order)."""
    loss = trainer.actor_loss_fn
    tokens = StepTokens()
    device = _device()
    for experience in window:
        experience.to_device(device)
        ratio = log_ratio_to_ratio(actor_log_probs(trainer, experience, fp8=True), experience.action_log_probs)
        shadow = None
        if trainer._fp8rl_shadow:
            shadow = shadow_ratio(trainer, experience, experience.info.get(SHADOW_OLD_KEY))
        tokens.add(ratio, shadow, experience.advantages, experience.action_mask)
    loss.batch_bounds = global_update_batch(loss.clipper, loss.step, tokens.local(device), loss.all_gather)


def same_batch_windows(trainer, upstream: Iterator, accumulated_gradient: int) -> Iterator:
    """Wrap upstream's ``iter_grad_accum_global_norm`` output: before yielding the first micro-batch
    of an optimizer-step window, calibrate on the whole window (:func:`calibrate_window`).

    Upstream yields windows of ``accumulated_gradient`` micro-batches (a trailing partial one when
    the data is not a multiple), each sharing one ``loss_batch_info`` dict; a window whose
    micro-batches do not share it means upstream's grouping changed, and raises."""
    gas = max(int(accumulated_gradient), 1)
    while True:
        window = []
        for item in upstream:
            window.append(item)
            if len(window) == gas:
                break
        if not window:
            return
        infos = {id(info) for _, info in window}
        if len(infos) != 1:
            raise UpstreamChangedError("iter_grad_accum_global_norm yielded an optimizer-step window whose "
                                       "micro-batches do not share one loss_batch_info: its grouping changed")
        calibrate_window(trainer, [exp for exp, _ in window])
        yield from window
