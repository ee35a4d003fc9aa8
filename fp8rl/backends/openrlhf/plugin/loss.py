"""Our policy loss inside OpenRLHF, and Calibrated Clipping across data-parallel ranks.

**Loss** (paper: the PPO-clip surrogate with the train/rollout IS weight).
:func:`make_policy_loss_class` subclasses upstream ``PolicyLoss`` with its constructor and
``forward`` signature and its 5-tuple ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``,
and computes it with ``fp8rl.rl.correction.corrected_ppo_token_loss`` (which also hands back the
IS weights applied, for the dump) +
``fp8rl.rl.aggregation.aggregate`` using the bounds of our clip method (``vanilla``: ``1 -+ eps``;
``calibrated``: the controller's). With calibration off it equals upstream (tested against the
real 0.11.2 class). Upstream's IS options map onto ours (:func:`correction_from_upstream`):
token/clip/threshold ``(0, C)`` = TIS with cap C; token/mask = ICEPOP; off = none; anything else
raises. A correction without rollout log-probs raises too (upstream fails there on ``None``): the
engines were not asked for them, and a silent fallback to no correction would hide it. The loss adds each micro-batch's counts to ``self.step_metrics``
(``plugin.metrics.StepMetrics``), never to ``experience.info`` (see ``metrics`` for why).

**Score Centering** (``PluginSpec.score_centering``; ``plugin.score_centering``): the per-token
loss becomes ``loss_mat * IS weights + A * C`` before the same reduction, with C
``fp8rl.rl.score_centering.score_centering_term`` of the trainer's log p at the sampler's top-k
ids (``sc_inputs``, handed over per micro-batch by ``binding.actor``) and the sampler's log q; the
term's mode must be the IS correction the flags give (:func:`check_score_centering`).

**Calibrated Clipping.** The loss follows the step's plan (``fp8rl.rl.calibration.plan``; the
binding, ``binding.calibrate``, runs it): it clips with the bounds of its optimizer-step window
(``window.bounds()``: the bounds in force until the window's calibration, the window's own after
it; the clip method's bounds outside a calibrating step), computes the FP8 ratio of its
micro-batch from its own inputs (the same float32 clamp as the kernel), hands the measured rows'
tokens to the window's sink (with the BF16 shadow ratio the binding computed for the same tokens,
``pending``) until the binding calibrates, and counts its shadowed rows against the bounds it
used (``window.observe``; the held-out rows, ``clip.holdout_share``, in a call of their own, so
that they are also counted as ``shadow/ho_*``). The loss itself runs no collective.

Torch and the project's ``fp8rl.rl`` only; upstream classes come in as arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fp8rl.backends.openrlhf.plugin.calibration import add_measured, log_ratio_to_ratio
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


def check_score_centering(options: dict | None, correction: str, correction_params: dict) -> None:
    """The spec's Score Centering options must fit the IS correction the flags gave the loss: the
    term's mode is the correction's name and its tis bounds ``(0, cap)`` (``ClipConfig.score_centering_options``)."""
    if options is None:
        return
    if options["mode"] != correction:
        raise ValueError(f"the plugin spec's Score Centering mode {options['mode']!r} disagrees with the IS correction "
                         f"{correction!r} of the --algo.advantage.is_correction_* flags: the term must compose "
                         "with the correction the loss applies (clip arm and command built from different configs?)")
    if correction == "tis" and tuple(options["bounds"]) != (0.0, float(correction_params["cap"])):
        raise ValueError(f"the plugin spec's Score Centering tis bounds {tuple(options['bounds'])} disagree with the "
                         f"TIS cap {correction_params['cap']} of --algo.advantage.is_correction_threshold")


def score_centering_terms(options: dict, inputs, advantages: torch.Tensor, mask: torch.Tensor) -> dict:
    """Score Centering of one micro-batch: ``{"loss_term": A * C [B, T], "term": C, "train_logp_topk",
    "sampler_logp_topk", "topk_ids", "sums"}`` (``sums``: ``fp8rl.rl.score_centering.score_centering_sums``).

    ``inputs``: ``(train_logp_topk [B, T, k] with gradient, sampler_logp_topk [B, T, k], ids [B, T, k])``,
    handed over by the binding's forward hook (``binding.actor.score_centering_hook``)."""
    from fp8rl.rl.score_centering import (
        score_centering_loss_mat,
        score_centering_sums,
        score_centering_term,
    )

    if inputs is None:
        raise RuntimeError("the plugin spec has Score Centering but the loss got no top-k log-probs for this "
                           "micro-batch (binding.actor's forward hook did not run)")
    train_lp, sampler_lp, ids = inputs
    if train_lp.shape[:2] != advantages.shape or train_lp.shape[-1] != int(options["topk"]):
        raise ValueError(f"top-k log-probs of shape {tuple(train_lp.shape)} for advantages "
                         f"{tuple(advantages.shape)} and k = {options['topk']}")
    mask = mask.bool()
    term = score_centering_term(train_lp, sampler_lp, options["mode"], bounds=options["bounds"], mask=mask)
    loss_term = score_centering_loss_mat(term, advantages, mask)
    return {"loss_term": loss_term, "term": term, "train_logp_topk": train_lp, "sampler_logp_topk": sampler_lp,
            "topk_ids": ids, "sums": score_centering_sums(train_lp, sampler_lp, loss_term, mask)}


def make_policy_loss_class(base: type, spec: PluginSpec) -> type:
    """A subclass of upstream ``PolicyLoss`` (``base``) computing the loss with our kernel.

    The class has upstream's constructor and ``forward`` signature; ``spec`` fixes the clip
    method. Instances expose ``clipper``, ``step`` (the controller step, set by the trainer
    wrapper), ``step_metrics`` (a ``StepMetrics`` receiving each micro-batch's counts, or None),
    ``window`` (the current ``WindowPlan`` while a calibrating step runs, else None), ``sink`` (a
    ``calibration.StepTokens`` collecting the window's measured tokens until it calibrates, or
    None), ``pending`` (``binding.calibrate.Pending``: the next forward's rows, which are measured
    and shadowed, and their BF16 shadow ratio ``[B, T]``) and ``all_gather`` (the DP all-gather
    the binding's calibration uses, None = this rank).
    """
    from fp8rl.rl.aggregation import aggregate
    from fp8rl.rl.correction import corrected_ppo_token_loss

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
            check_score_centering(spec.score_centering, self.correction, self.correction_params)
            self.agg_mode = "token-mean" if self.token_level_loss else "seq-mean-token-mean"
            self.spec = spec
            self.clipper = spec.make_clipper()
            self.step = 0
            self.step_metrics = None
            self.window = None
            self.sink = None
            self.pending = None
            self.all_gather: Callable | None = None
            self.sc_inputs = None

        def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None,
                    dp_size=1, batch_num_tokens=None, global_batch_size=None):
            """``[B, T]`` log-probs, old log-probs, advantages, mask, rollout log-probs -> the 5-tuple."""
            if action_mask is None:
                action_mask = torch.ones_like(log_probs, dtype=torch.bool)
            ratio = log_ratio_to_ratio(log_probs, old_log_probs)  # the kernel's ratio: float32 or wider, same clamp
            p, self.pending = self.pending, None
            w = self.window
            if p is not None and w is None:
                raise RuntimeError("a micro-batch carries the calibration plan's rows but no window is open")
            bounds = w.bounds() if w is not None else self.clipper.bounds(self.step)
            if p is not None:
                if self.sink is not None:  # the window has not calibrated yet: its measured rows feed it
                    add_measured(self.sink, p, ratio, advantages, action_mask)
                if p.shadow is not None:  # the shadowed rows against the bounds used; held-out rows on their own
                    sh, ho = p.shadowed.to(ratio.device), p.holdout.to(ratio.device)
                    for rows, held in ((sh & ~ho, False), (sh & ho, True)):
                        if bool(rows.any()):
                            w.observe(ratio[rows], p.shadow[rows], advantages[rows], action_mask[rows],
                                      after=w.after is not None, holdout=held)
            low, high = bounds.as_tuple()
            if self.correction != "none" and rollout_log_probs is None:
                raise ValueError(
                    f"the IS correction {self.correction!r} (--algo.advantage.is_correction_level "
                    f"{self.is_correction_level}) got no rollout log-probs: the engines were not asked for "
                    "them (SamplingParams(logprobs=...)), so the train/rollout correction cannot run")
            corrected = self.correction != "none"
            loss_mat, m, weights = corrected_ppo_token_loss(
                log_probs, old_log_probs, rollout_log_probs if corrected else None, advantages, action_mask,
                low=low, high=high, dual_clip=self.dual_clip, correction=self.correction,
                correction_params=self.correction_params if corrected else None, return_weights=True)
            sc = None
            if spec.score_centering is not None:  # + A * C per token, before the reduction (IS weights applied)
                sc = score_centering_terms(spec.score_centering, self.sc_inputs, advantages, action_mask)
                self.sc_inputs = None
                loss_mat = loss_mat + sc["loss_term"]
            if batch_num_tokens is None and global_batch_size is None:
                loss = aggregate(loss_mat, action_mask, self.agg_mode)
            else:
                loss = aggregate(loss_mat, action_mask, self.agg_mode, global_tokens=batch_num_tokens,
                                 global_seqs=global_batch_size) * dp_size
            if self.step_metrics is not None:
                self.step_metrics.add(ratio, advantages, action_mask, low=low, high=high,
                                      mismatch_kl=m.get("rollout/mismatch_kl"))
                if sc is not None:
                    self.step_metrics.add_score_centering(sc["sums"])
            if spec.dump_dir:
                dump(spec.dump_dir, self, ratio=ratio, advantages=advantages, mask=action_mask, low=low,
                     high=high, loss=loss, token_loss=loss_mat, log_probs=log_probs, old_log_probs=old_log_probs,
                     rollout_log_probs=rollout_log_probs, is_weights=weights,
                     correction=self.correction, correction_params=dict(self.correction_params),
                     agg_mode=self.agg_mode, dp_size=int(dp_size), dual_clip=self.dual_clip,
                     batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
                     **({} if sc is None else {f"sc_{k}": v for k, v in sc.items() if k != "sums"}))
            return loss, m["actor/clipfrac"], m["actor/ppo_kl"], m.get("rollout/mismatch_k1"), \
                m.get("rollout/is_clipfrac")

    Fp8rlPolicyLoss.__qualname__ = Fp8rlPolicyLoss.__name__ = "Fp8rlPolicyLoss"
    return Fp8rlPolicyLoss


def dump(directory: str, loss_fn, **tensors) -> None:
    """Write one micro-batch's loss inputs and bounds (``PluginSpec.dump_dir``; tests only).

    File ``<directory>/rank<R>-<pid>-<N>.pt`` (``N`` counts this process's forwards; a resumed
    attempt is another process): the controller step, pid, time, the tensors given (detached, on
    the CPU) and the bounds in force. The loss gives the ratio, advantages, mask, bounds, the
    reduced loss, the per-token loss it reduced (``token_loss``, IS weights applied), the log-probs,
    old and rollout log-probs (None when the engines sent none), the IS weights applied (None
    without a correction), the correction with its parameters, and what reduced the loss (the
    aggregation mode, the DP size, the dual-clip bound and upstream's global normalisers
    ``batch_num_tokens`` / ``global_batch_size``). The tests of the smoke job recompute the logged
    clip fractions, the IS weights and the loss from these files."""
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
