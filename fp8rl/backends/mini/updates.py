"""The mini trainer's update: advantages, old log-probs, the mini-batch updates (a mixin of
``MiniTrainer``; the loop and its documentation are in ``trainer.py``, the BF16 shadow in
``shadow.py``)."""

from __future__ import annotations

import contextlib
import math
import time

import torch

from fp8rl.backends.mini.batch import response_logits, token_logprobs
from fp8rl.backends.mini.rollout import RolloutBatch
from fp8rl.backends.mini.scored import ScoredBatch
from fp8rl.backends.mini.shadow import StepShadow
from fp8rl.backends.mini.stats import UpdateStats, to_float
from fp8rl.runs import metrics as M


class UpdateMixin:
    """``advantages``, ``forward_logits``, ``old_log_probs``, ``update``, ``minibatch_update``;
    needs ``cfg``, ``policy``, ``optimizer``, ``clipper``, ``device``, ``dtype``,
    ``skipped_updates`` on the instance."""

    def advantages(self, batch: ScoredBatch) -> torch.Tensor:
        """``[N, T]`` per-token advantages."""
        from fp8rl.rl.advantages import ADVANTAGE_ESTIMATORS, broadcast_to_tokens

        adv = ADVANTAGE_ESTIMATORS[self.cfg.algorithm.advantage_estimator](batch.rewards, batch.group_ids)
        return broadcast_to_tokens(adv.to(self.device), batch.rollout.response_mask)

    def forward_logits(self, rb: RolloutBatch, idx: torch.Tensor) -> torch.Tensor:
        """Trainer logits ``[n, T, V]`` for rows ``idx`` (grad enabled if the caller allows)."""
        return response_logits(self.policy, rb.prompt_ids[idx], rb.prompt_mask[idx],
                               rb.response_ids[idx], rb.response_mask[idx], self.dtype)

    def micro_batches(self, n: int) -> list[torch.Tensor]:
        """Rows ``0..n-1`` in rollout order, in chunks of ``logprob_micro_batch`` (the batches
        old log-probs are recomputed in, as OpenRLHF's ``--rollout.micro_batch_size``)."""
        size = self.cfg.logprob_micro_batch
        return [torch.arange(i, min(i + size, n), device=self.device) for i in range(0, n, size)]

    @torch.no_grad()
    def old_log_probs(self, rb: RolloutBatch, *, shadow: bool = False) -> tuple[torch.Tensor, dict]:
        """Old log-probs ``[N, T]`` of the trainer (its own precision) and the entropy metric.

        Recomputed in rollout order in micro-batches of ``logprob_micro_batch`` rows, not with
        the updates' (shuffled) mini-batches, as OpenRLHF and verl do: with per-tensor scales
        the FP8 numbers of a row depend on the batch its GEMMs see, so this puts the
        batch-composition noise of ``tensorwise`` into the ratio, as at scale. ``shadow``: the
        same with FP8 off (the BF16 old log-probs of the shadow).
        """
        from fp8rl.quant.convert import fp8_disabled
        from fp8rl.rl.diagnostics import masked_mean, token_entropy

        tau = self.cfg.temperature
        old = torch.zeros_like(rb.rollout_log_probs)
        ent = None if shadow else torch.zeros_like(rb.rollout_log_probs)
        with fp8_disabled(self.policy) if shadow else contextlib.nullcontext():
            for idx in self.micro_batches(len(rb.response_ids)):
                logits = self.forward_logits(rb, idx)
                old[idx] = token_logprobs(logits, rb.response_ids[idx], tau)
                if ent is not None:  # contiguous: one pass over all rows instead of a loop per row
                    ent[idx] = token_entropy(logits.contiguous(), temperature=tau)
        return old, ({} if ent is None else {M.ACTOR_ENTROPY: to_float(masked_mean(ent, rb.response_mask))})

    def update(self, step: int, batch: ScoredBatch, gen: torch.Generator) -> dict:
        """Advantages, old log-probs, IS weights, the mini-batch updates and, on a measured step,
        the BF16 shadow and the controller's updates (``shadow.StepShadow``)."""
        from fp8rl.quant.convert import fp8_layers
        from fp8rl.rl.correction import is_weights

        cfg, rb = self.cfg, batch.rollout
        perm = torch.randperm(len(batch), generator=gen, device=gen.device).to(self.device)
        parts = [p for p in torch.tensor_split(perm, cfg.num_mini_batches) if p.numel() > 0]
        sh = StepShadow(self.clipper, cfg.clip, step - 1, has_fp8=bool(fp8_layers(self.policy)))
        adv = self.advantages(batch)
        self.policy.train()
        old, out = self.old_log_probs(rb)
        shadow_old = None
        if sh.extra_forward:
            t0 = time.perf_counter()
            shadow_old, _ = self.old_log_probs(rb, shadow=True)
            sh.shadow_s += time.perf_counter() - t0
        weights, is_metrics = is_weights(old, rb.rollout_log_probs, rb.response_mask,
                                         cfg.clip.is_correction, **cfg.clip.correction_params())
        out.update({k: to_float(v) for k, v in is_metrics.items()})
        acc = UpdateStats()
        for idx in parts:
            res = self.minibatch_update(rb, idx, old[idx], adv[idx], weights[idx], sh,
                                        None if shadow_old is None else shadow_old[idx])
            acc.add(res)
        out.update(acc.result())
        out.update(sh.finish())
        self.skipped_updates += acc.skipped
        out["train/skipped_updates"] = acc.skipped
        return out

    def minibatch_update(self, rb: RolloutBatch, idx: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                         weights: torch.Tensor, sh: StepShadow, shadow_old: torch.Tensor | None) -> dict:
        """One AdamW step on mini-batch ``idx``; returns its counts and metrics.

        Forward with grad -> FP8 ratio; when the step is measured, the shadow forward (no grad,
        FP8 off, same weights) -> BF16 shadow ratio of the same tokens; ``sh.bounds_for`` -> the
        bounds of this loss; loss; backward; step. ``old``/``adv``/``weights`` ``[n, T]``,
        ``shadow_old`` the BF16 old log-probs ``[n, T]`` (None: no extra forward)."""
        from fp8rl.quant.convert import fp8_disabled
        from fp8rl.rl.aggregation import aggregate
        from fp8rl.rl.diagnostics import clip_counts, masked_mean
        from fp8rl.rl.policy_loss import LOG_RATIO_CLAMP, ppo_token_loss

        cfg, a = self.cfg, self.cfg.algorithm
        mask = rb.response_mask[idx]
        logits = self.forward_logits(rb, idx)
        logp = token_logprobs(logits, rb.response_ids[idx], cfg.temperature)
        log_ratio = logp.detach() - old
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        shadow_ratio = None
        if sh.measure:
            shadow_ratio = ratio  # no FP8 layers: the trainer's own ratio is the BF16 one
            if sh.extra_forward:
                t0 = time.perf_counter()
                with torch.no_grad(), fp8_disabled(self.policy):
                    shadow_logp = token_logprobs(self.forward_logits(rb, idx), rb.response_ids[idx],
                                                 cfg.temperature)
                shadow_ratio = torch.exp((shadow_logp - shadow_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
                sh.shadow_s += time.perf_counter() - t0
        low, high = sh.bounds_for(ratio, shadow_ratio, adv, mask).as_tuple()
        # the step's diagnostics come from counts and ratios summed over mini-batches
        # (UpdateStats), so the loss computes none of its own
        loss_mat, _ = ppo_token_loss(logp, old, adv, mask, low=low, high=high, dual_clip=a.dual_clip,
                                     metrics=False)
        loss = aggregate(loss_mat * weights, mask, a.loss_agg_mode, horizon=cfg.max_response_len)
        m = mask.bool()
        res = {"counts": clip_counts(ratio, adv, m, low=low, high=high), "ratio": ratio,
               "adv": adv, "mask": mask, "pg_loss": to_float(loss), "ppo_kl": to_float(masked_mean(-log_ratio, m)),
               "skipped": 0, "grad_norm": float("nan"), "shadow_ratio": shadow_ratio, "bounds": (low, high)}
        self.optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss) or not bool((torch.isfinite(logp.detach()) | ~m).all()):
            res["skipped"] = 1
            return res
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm, foreach=True)
        res["grad_norm"] = to_float(grad_norm)
        if not math.isfinite(res["grad_norm"]):
            self.optimizer.zero_grad(set_to_none=True)
            res["skipped"] = 1
            return res
        self.optimizer.step()
        return res
