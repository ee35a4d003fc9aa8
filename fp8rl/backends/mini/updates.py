"""The mini trainer's update: advantages, old log-probs, the mini-batch updates (a mixin of
``MiniTrainer``; the loop and its documentation are in ``trainer.py``, the BF16 shadow in
``shadow.py``).

Score Centering (the ``score_centering*`` clip arms; ``fp8rl.rl.score_centering``,
docs/score_centering.md): the rollout carries the engine's top-k ids and log-probs per token
(``RolloutBatch.topk_ids``, ``topk_logprobs``: log q); each mini-batch takes the trainer's
log p at those ids from the logits of its own forward, at the rollout temperature as
``token_logprobs`` does, the term C in the arm's mode and bounds, and adds ``A * C`` to the
IS-weighted PPO token loss before ``aggregate`` (``loss_mat * w + A * C``: the term is not
weighted again, its IS correction is inside m and alpha). ``actor/pg_loss`` is that sum.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from fp8rl.backends.mini.batch import response_logits, token_logprobs
from fp8rl.backends.mini.rollout import RolloutBatch
from fp8rl.backends.mini.scored import ScoredBatch
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
        """Advantages, old log-probs, IS weights, the mini-batch updates, and the step's
        calibration plan (``fp8rl.rl.calibration.plan``: which rows get a BF16 shadow, which feed
        the estimate, which bounds rule which rows; ``shadow.py`` computes the shadow)."""
        from fp8rl.backends.mini.shadow import shadow_old_log_probs
        from fp8rl.quant.convert import fp8_layers
        from fp8rl.rl.correction import is_weights

        cfg, rb = self.cfg, batch.rollout
        perm = torch.randperm(len(batch), generator=gen, device=gen.device).to(self.device)
        parts = [p for p in torch.tensor_split(perm, cfg.num_mini_batches) if p.numel() > 0]
        adv = self.advantages(batch)
        eligible = ((adv != 0) & rb.response_mask.bool()).any(1)
        plan = self.clipper.begin_step(step - 1, eligible=eligible, diagnostics=cfg.clip.shadow_diagnostics,
                                       holdout_share=cfg.clip.holdout_share, seed=cfg.seed)
        has_fp8 = bool(fp8_layers(self.policy))
        self.policy.train()
        old, out = self.old_log_probs(rb)
        shadow_s = 0.0
        shadow_old = None
        if bool(plan.shadowed.any()):
            t0 = time.perf_counter()
            shadow_old = shadow_old_log_probs(self, rb, plan.shadowed) if has_fp8 else old
            shadow_s += time.perf_counter() - t0
        weights, is_metrics = is_weights(old, rb.rollout_log_probs, rb.response_mask,
                                         cfg.clip.is_correction, **cfg.clip.correction_params())
        out.update({k: to_float(v) for k, v in is_metrics.items()})
        ref_weights = None
        if cfg.clip.shadow_diagnostics or bool(plan.holdout.any()):  # a BF16 trainer's IS weights (*grad_cos)
            ref_weights, _ = is_weights(shadow_old, rb.rollout_log_probs, rb.response_mask,
                                        cfg.clip.is_correction, **cfg.clip.correction_params())
        sc_sums = {"n": 0, "rho": 0.0, "term_abs": 0.0}
        if cfg.clip.score_centering:  # the sampler's head mass, over the batch's response tokens
            from fp8rl.rl.diagnostics import masked_mean

            head = torch.exp(rb.topk_logprobs.float()).sum(-1)
            out[M.SC_HEAD_MASS] = to_float(masked_mean(head, rb.response_mask))
        acc = UpdateStats()
        stepped = False  # an optimizer step has run: the weights are no longer those of ``old``
        for idx in parts:
            res = self.minibatch_update(rb, idx, old[idx], adv[idx], weights[idx], plan.window(idx), has_fp8,
                                        None if shadow_old is None else shadow_old[idx],
                                        None if ref_weights is None else ref_weights[idx], old_weights=not stepped)
            shadow_s += res.pop("shadow_s")
            for k, v in (res.pop("sc", None) or {}).items():
                sc_sums[k] += v
            stepped = stepped or not res["skipped"]
            acc.add(res)
        out.update(acc.result())
        if cfg.clip.score_centering:
            n = max(sc_sums["n"], 1)  # no response token at all: 0, as the sums
            out.update({M.SC_RHO: sc_sums["rho"] / n, M.SC_TERM_ABS: sc_sums["term_abs"] / n})
        t0 = time.perf_counter()
        out.update(plan.finish())
        shadow_s += time.perf_counter() - t0
        if bool(plan.shadowed.any()) or plan.calibrates:
            out[M.PERF_SHADOW_S] = shadow_s
        self.skipped_updates += acc.skipped
        out["train/skipped_updates"] = acc.skipped
        return out

    def minibatch_update(self, rb: RolloutBatch, idx: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                         weights: torch.Tensor, win, has_fp8: bool, shadow_old: torch.Tensor | None,
                         ref_weights: torch.Tensor | None, *, old_weights: bool = False) -> dict:
        """One AdamW step on mini-batch ``idx`` (one window of the step's plan); returns its
        counts and metrics.

        Forward with grad -> FP8 ratio; the BF16 shadow ratio of the window's shadowed rows (one
        no-grad forward of those rows with FP8 off; the trainer's own ratio without FP8 layers);
        ``win.calibrate`` on the measured rows -> the bounds of the other rows (the measured rows
        of a mode whose bounds do not rule their own tokens keep ``win.before``: their loss "ran
        first"); loss; backward; on diagnostic steps the gradient against BF16's
        (``shadow.reference_grad_cos``); step. ``old``/``adv``/``weights`` ``[n, T]``,
        ``shadow_old`` the BF16 old log-probs ``[n, T]`` (None: no row is shadowed),
        ``ref_weights`` the BF16 trainer's IS weights (diagnostics only); ``old_weights``: no
        optimizer step has run in this step yet (the BF16 current log-probs are the old ones,
        ``shadow.shadow_ratio``)."""
        from fp8rl.backends.mini.shadow import holdout_grad_cos, reference_grad_cos, shadow_ratio
        from fp8rl.rl.aggregation import aggregate
        from fp8rl.rl.diagnostics import masked_mean
        from fp8rl.rl.policy_loss import LOG_RATIO_CLAMP

        cfg, a = self.cfg, self.cfg.algorithm
        mask = rb.response_mask[idx]
        logits = self.forward_logits(rb, idx)
        logp = token_logprobs(logits, rb.response_ids[idx], cfg.temperature)
        log_ratio = logp.detach() - old
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        shadow_s = 0.0
        shadowed = win.shadowed
        shadow = None  # [n, T]: the BF16 shadow ratio on shadowed rows (1 elsewhere, never read)
        if bool(shadowed.any()):
            t0 = time.perf_counter()
            if not has_fp8:  # no FP8 layers: the trainer's own ratio is the BF16 one
                shadow = ratio
            elif bool(shadowed.all()):
                shadow = shadow_ratio(self, rb, idx, shadow_old, old_weights=old_weights)
            else:
                shadow = torch.ones_like(ratio)
                shadow[shadowed] = shadow_ratio(self, rb, idx[shadowed], shadow_old[shadowed], old_weights=old_weights)
            shadow_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        meas = win.measured
        if bool(meas.all()):
            after = win.calibrate(ratio, shadow, adv, mask, seq=idx)
        else:
            after = win.calibrate(ratio[meas], None if shadow is None else shadow[meas], adv[meas], mask[meas],
                                  seq=idx[meas])
        groups = _bound_groups(win.first, win.before, after)
        if shadow is not None:  # held-out rows in an observe call of their own (plan.WindowPlan.observe)
            for rows, bounds_after in groups:
                for held in (False, True):
                    keep = rows & shadowed & (win.holdout if held else ~win.holdout)
                    if bool(keep.any()):
                        win.observe(ratio[keep], shadow[keep], adv[keep], mask[keep], after=bounds_after is after,
                                    holdout=held)
        if bool(shadowed.any()) or bool(meas.any()):
            shadow_s += time.perf_counter() - t0
        loss_mat, counts = _grouped_loss(logp, old, adv, mask, ratio, groups, dual_clip=a.dual_clip)
        m = mask.bool()
        loss_mat = loss_mat * weights
        sc = None
        finite = bool((torch.isfinite(logp.detach()) | ~m).all())
        if cfg.clip.score_centering and finite:  # + A * C (module docstring); not IS-weighted again
            sc_mat, sc = score_centering_loss(logits, rb, idx, adv, mask, cfg.temperature,
                                              cfg.clip.score_centering_options())
            finite = sc is not None
            if finite:
                loss_mat = loss_mat + sc_mat
        loss = aggregate(loss_mat, mask, a.loss_agg_mode, horizon=cfg.max_response_len)
        res = {"counts": counts, "ratio": ratio, "adv": adv, "mask": mask, "pg_loss": to_float(loss),
               "ppo_kl": to_float(masked_mean(-log_ratio, m)), "skipped": 0, "grad_norm": float("nan"),
               "shadow_s": shadow_s, "grad_cos": None, "shadow_ratio": shadow, "bounds": after.as_tuple(),
               "bounds_first": win.before.as_tuple() if bool(win.first.any()) else None, "sc": sc}
        self.optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss) or not finite:
            res["skipped"] = 1
            return res
        loss.backward()
        if ref_weights is not None and cfg.clip.shadow_diagnostics:
            res["grad_cos"], dt = reference_grad_cos(self, rb, idx, adv, shadow_old, ref_weights)
            res["shadow_s"] += dt
        held = win.holdout
        if ref_weights is not None and bool(held.any()):  # the held-out rows alone, as trained vs BF16
            # never measured, so never ``first``: the window's ``after`` bounds ruled them
            res["ho_grad_cos"], dt = holdout_grad_cos(self, rb, idx[held], old[held], adv[held], weights[held],
                                                      after, shadow_old[held], ref_weights[held])
            res["shadow_s"] += dt
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm, foreach=True)
        res["grad_norm"] = to_float(grad_norm)
        if not math.isfinite(res["grad_norm"]):
            self.optimizer.zero_grad(set_to_none=True)
            res["skipped"] = 1
            return res
        self.optimizer.step()
        return res


def score_centering_loss(logits: torch.Tensor, rb: RolloutBatch, idx: torch.Tensor, adv: torch.Tensor,
                         mask: torch.Tensor, temperature: float, opts: dict) -> tuple[torch.Tensor, dict | None]:
    """``(A * C [n, T], sums)`` of mini-batch ``idx``: the trainer's log p at the sampler's top-k
    ids of those rows from ``logits`` ``[n, T, V]`` (the mini-batch's forward, with grad), the
    term C in ``opts``' mode and bounds (``ClipConfig.score_centering_options``), masked by
    ``mask`` ``[n, T]``; ``sums``: response tokens ``n`` and the sums of rho and |A * C| over
    them (the step's ``sc/*`` means), or None where log p is not finite at a response token
    (the mini-batch is skipped, as for a non-finite loss)."""
    from fp8rl.rl.score_centering import (
        score_centering_loss_mat,
        score_centering_sums,
        score_centering_term,
    )

    m = mask.bool()
    train = trainer_topk_logprobs(logits, rb, idx, temperature)  # [n, T, k]
    if not bool((torch.isfinite(train.detach()) | ~m.unsqueeze(-1)).all()):
        return torch.zeros_like(adv), None
    sampler = rb.topk_logprobs[idx]
    term = score_centering_term(train, sampler, opts["mode"], bounds=opts["bounds"], mask=mask)
    mat = score_centering_loss_mat(term, adv, mask)
    sums = score_centering_sums(train, sampler, mat, mask)  # the paper scale's sums too
    return mat, {"n": int(sums["sc_tokens"]), "rho": float(sums["sc_rho"]), "term_abs": float(sums["sc_term_abs"])}


def trainer_topk_logprobs(logits: torch.Tensor, rb: RolloutBatch, idx: torch.Tensor,
                          temperature: float) -> torch.Tensor:
    """The trainer's ``log softmax(logits / temperature)`` ``[n, T, k]`` at the sampler's top-k ids of
    rows ``idx`` (``logits`` ``[n, T, V]``, row t predicting response token t, as
    ``batch.response_logits`` gives them); the gradient flows into ``logits``."""
    from fp8rl.rl.score_centering import trainer_logp_at_sampler_topk

    if rb.topk_ids is None or rb.topk_logprobs is None:
        raise RuntimeError("a Score Centering arm needs the rollout's top-k ids and log-probs; generate the "
                           "training rollouts with RolloutEngine.generate(topk=clip.score_centering_topk)")
    return trainer_logp_at_sampler_topk(logits, rb.topk_ids[idx], temperature=temperature)


def _bound_groups(first: torch.Tensor, before, after) -> list[tuple[torch.Tensor, object]]:
    """``[(rows, bounds)]``: the rows ruled by ``before`` (``first``) and by ``after`` (the rest);
    one group when they coincide or one side is empty."""
    if not bool(first.any()) or before == after:
        return [(torch.ones_like(first), after)]
    if bool(first.all()):
        return [(first, before)]
    return [(first, before), (~first, after)]


def _grouped_loss(logp, old, adv, mask, ratio, groups, *, dual_clip):
    """``(loss_mat [n, T], clip counts)``: the PPO token loss of each row group with its bounds."""
    from fp8rl.rl.diagnostics import clip_counts
    from fp8rl.rl.policy_loss import ppo_token_loss

    m = mask.bool()
    if len(groups) == 1:
        low, high = groups[0][1].as_tuple()
        loss_mat, _ = ppo_token_loss(logp, old, adv, mask, low=low, high=high, dual_clip=dual_clip, metrics=False)
        return loss_mat, clip_counts(ratio, adv, m, low=low, high=high)
    loss_mat = torch.zeros_like(logp)
    counts: dict = {}
    for rows, b in groups:
        low, high = b.as_tuple()
        part, _ = ppo_token_loss(logp[rows], old[rows], adv[rows], mask[rows], low=low, high=high,
                                 dual_clip=dual_clip, metrics=False)
        loss_mat = loss_mat.index_put((torch.nonzero(rows, as_tuple=False).flatten(),), part)
        for k, v in clip_counts(ratio[rows], adv[rows], m[rows], low=low, high=high).items():
            counts[k] = v if k not in counts else counts[k] + v
    return loss_mat, counts
