"""The mini trainer: one RL loop, full-pipeline FP8, on a tiny Qwen3 and the arithmetic task.

One step (``MiniTrainer.train_step``) reads as the paper's pipeline:

    rollout (FP8 engine) -> reward -> [DAPO dynamic sampling] -> advantages
      -> old log-probs (trainer, its own precision) -> [measured step: BF16 shadow]
      -> M mini-batch updates (clip method + IS correction) -> re-sync the engine
      -> [evaluate] -> log

- **Rollout**: ``RolloutEngine`` (own weight copy, re-quantized per the rollout recipe after
  every update; ``rollout.py``). ``prompts_per_step`` prompts, ``n_samples_per_prompt``
  responses each, grouped contiguously (group id = prompt index).
- **Reward**: exact-match 0/1 (``fp8rl.rewards.exact``) plus DAPO's soft overlong penalty when
  ``algorithm.overlong_buffer > 0``. Garbled responses are counted (``rollout/garbled_frac``).
- **Dynamic sampling** (DAPO): groups with identical rewards are dropped; up to
  ``max_extra_rounds`` further rounds of fresh prompts refill the batch; the batch is cut to
  ``prompts_per_step`` groups. ``dapo/kept_group_frac`` is the kept fraction of the *first*
  round (how informative the policy's batches are). A step with no group left makes no update.
- **Advantages**: ``ADVANTAGE_ESTIMATORS[algorithm.advantage_estimator]`` over the groups,
  broadcast to tokens.
- **Precision**: the trainer and the engine compute in ``fp8.compute_dtype`` outside FP8 GEMMs
  (``bf16``: BF16 mixed precision on fp32 master weights, ``fp8rl.quant.lowp``; ``fp32`` for
  the explicit fp32 arm). The BF16 engine rounds the weights once per sync and decodes with
  a fused attention (``rollout.py``), so even the ``bf16`` arm has a small train/rollout
  mismatch, as an inference engine has.
- **Old log-probs**: recomputed by the trainer model (FP8 for full-FP8 arms) without grad, in
  rollout order in micro-batches of ``logprob_micro_batch`` rows -- not the updates' shuffled
  mini-batches -- as OpenRLHF (``--rollout.micro_batch_size``) and verl
  (``log_prob_micro_batch_size``) recompute them. With per-tensor FP8 scales a row's numbers
  depend on the batch its GEMMs see, so ``tensorwise`` puts that batch-composition noise into
  the ratio (as at scale); per-row and per-block scales, and BF16, do not.
  ``actor/entropy`` is the entropy of these logits (policy at the rollout temperature).
- **IS correction**: weights from (trainer old log-prob, engine log-prob), detached
  (``fp8rl.rl.correction.is_weights``); ``rollout/mismatch_kl`` is logged for every arm.
- **Updates**: the rollout batch is shuffled (per-step generator) and split into
  ``num_mini_batches`` mini-batches, one AdamW step each (optimizer groups: the body at
  ``lr``, the LM head at ``lr_lm_head``, the final norm at ``lr_final_norm``), so from the
  second mini-batch on the ratio pi_theta/pi_old moves off 1. The loss is ``ppo_token_loss * w``
  aggregated per mini-batch, with the clip bounds of the clip method (``same_batch``: each
  mini-batch's own); the Score Centering arms add ``A * C`` per token (``updates.py``).

**The BF16 shadow** (Calibrated Clipping's measurement, and the diagnostic shadow of
``clip.shadow_diagnostics``): ``shadow.py`` says which steps and mini-batches are measured,
which bounds each mini-batch's loss uses in each ``clip.calibration_mode``, and what is logged.
The shadow's cost is ``perf/shadow_s``. The update itself (old log-probs, mini-batches) is
``updates.py``, the evaluations (which engines, the step-0 cache) ``trainer_eval.py``, saving and
restoring the trainer's state ``checkpoint.py``.

Step numbering: logged steps are 1..``steps`` (step k = the k-th update); ``eval.jsonl`` has a
row at step 0 (the warm-started model) and after every ``eval_every`` steps and the last. The
controller, whose steps count from 0, gets ``k - 1`` (so step 1 is a calibration step). The
step-0 evaluation is shared by the cells of a sweep that have the same warm start, engine,
evaluation settings and seed (``evaluate.cached_evaluation``).

Determinism: all randomness of step k (prompt choice, sampling, mini-batch shuffle) comes
from generators seeded by ``(seed, k)``; every evaluation from ``(seed, "eval")`` (paired
evaluations). A run resumed from
the checkpoint of step k therefore continues exactly as the uninterrupted run (the checkpoint
also stores torch/python RNG states for code that would use the global streams); a run killed
before its first checkpoint restarts from step 0 and drops what it had logged, and temporary
files of writes a kill interrupted are removed (``fp8rl.runs.relaunch``).

Non-finite values: a mini-batch whose loss or gradient norm is not finite is skipped (no
optimizer step; ``train/skipped_updates``), the step counts as bad; ``max_bad_steps``
consecutive bad steps, or non-finite parameters, end the run FAILED with the reason.

Deviations / choices (the paper gives none of these at this scale): one PPO epoch; AdamW
without weight decay; gradient clipping at ``max_grad_norm``; KL off; the engine sync happens
after the last mini-batch of every step (its time is in ``perf/train_s``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from fp8rl.backends.mini.batch import left_pad
from fp8rl.backends.mini.checkpoint import CheckpointMixin
from fp8rl.backends.mini.config import MiniRunConfig
from fp8rl.backends.mini.rollout import RolloutBatch, RolloutEngine
from fp8rl.backends.mini.runtime import RunFailed, seed_for
from fp8rl.backends.mini.scored import ScoredBatch, concat_batches
from fp8rl.backends.mini.sft import warm_start
from fp8rl.backends.mini.stats import (
    brief,
    param_groups,
    progress_bar,
    run_summary,
    to_float,
)
from fp8rl.backends.mini.task import Problem, make_splits
from fp8rl.backends.mini.tokenizer import CharTokenizer
from fp8rl.backends.mini.trainer_eval import BF16_EVAL_RECIPE, EvalMixin
from fp8rl.backends.mini.updates import UpdateMixin
from fp8rl.config import torch_dtype
from fp8rl.rewards.exact import grade_exact
from fp8rl.runs import metrics as M


class MiniTrainer(EvalMixin, UpdateMixin, CheckpointMixin):
    """Builds the task, the warm-started policy, the rollout engine and the clip method of a
    ``MiniRunConfig``, and runs the loop. ``run_dir`` is an ``fp8rl.runs.RunDir`` (or None:
    nothing is written, no checkpoint, e.g. for benchmarks). ``bf16_eval=False`` leaves out the
    BF16 engine's evaluation (``eval_bf16/`` keys; for benchmarks and tests: a run always has it);
    ``sft_progress``: a progress bar while the SFT warm start trains (``sft.warm_start``)."""

    def __init__(self, cfg: MiniRunConfig, run_dir=None, *, sft_cache: str | Path, bf16_eval: bool = True,
                 sft_progress: bool = False) -> None:
        from fp8rl.quant.convert import convert_to_fp8
        from fp8rl.rl.clipping import make_clipper

        self.cfg, self.run_dir = cfg, run_dir
        mini = cfg.mini
        self.device = torch.device(mini.device)
        self.tok = CharTokenizer()
        self.train_set, self.eval_set = make_splits(
            mini.data_seed, mini.n_train, mini.n_eval, min_terms=mini.min_terms,
            max_terms=mini.max_terms, max_operand=mini.max_operand)
        base, self.sft_meta = warm_start(cfg.model.slot, self.train_set, self.tok, mini, sft_cache,
                                         progress=sft_progress)
        self.dtype = torch_dtype(cfg.fp8.compute_dtype)
        self.engine = RolloutEngine(base, cfg.fp8.rollout, emulate=cfg.fp8.emulate, dtype=self.dtype)
        self.policy = convert_to_fp8(copy.deepcopy(base).train(), cfg.fp8.trainer,
                                     emulate=cfg.fp8.emulate, impl=cfg.fp8.impl, seed=seed_for(cfg.seed, "rounding"))
        self.engine.sync(self.policy)
        # the BF16 evaluation engine (eval_bf16/ keys), from the same unconverted template as the
        # rollout engine; None where the rollout engine is one already (its evaluation is reused)
        self.bf16_eval = bf16_eval
        self._bf16_engine = (None if not bf16_eval or self._bf16_engine_is_own() else
                             RolloutEngine(base, BF16_EVAL_RECIPE, emulate=cfg.fp8.emulate, dtype=self.dtype))
        # foreach: the same arithmetic as the per-parameter loop (bit for bit), fewer calls
        self.optimizer = torch.optim.AdamW(param_groups(self.policy, cfg), lr=cfg.lr, betas=tuple(cfg.adam_betas),
                                           weight_decay=cfg.weight_decay, foreach=True)
        a = cfg.algorithm
        self.clipper = make_clipper(cfg.clip.method, a.eps_low, a.eps_high, **cfg.clip.clipper_options(seed=cfg.seed))
        self.step = 0  # last completed step
        self.bad_steps = 0  # consecutive
        self.skipped_updates = 0  # total
        self.history: list[dict] = []
        self._live = None  # fp8rl.runs.live.LiveLog while run() runs

    # ----- rollout and reward ---------------------------------------------------------------

    def rollout(self, step: int, round_: int, gen: torch.Generator) -> ScoredBatch:
        """Sample ``prompts_per_step`` prompts x ``n`` responses with the engine and score them (with
        the engine's top-k log-probs per token for a Score Centering arm, ``updates.py``)."""
        cfg, n = self.cfg, self.cfg.algorithm.n_samples_per_prompt
        topk = cfg.clip.score_centering_topk if cfg.clip.score_centering else 0
        rng = random.Random(seed_for(cfg.seed, "prompts", step, round_))
        problems = rng.sample(self.train_set, cfg.prompts_per_step)
        rows = [p for p in problems for _ in range(n)]
        ids, mask = left_pad([self.tok.encode(p.prompt, bos=True) for p in rows], self.tok.pad_id)
        rb = self.engine.generate(ids.to(self.device), mask.to(self.device),
                                  max_new_tokens=cfg.max_response_len, temperature=cfg.temperature,
                                  eos_id=self.tok.eos_id, pad_id=self.tok.pad_id, generator=gen, topk=topk)
        group_ids = torch.arange(len(problems)).repeat_interleave(n) + round_ * len(problems)
        return self.score(rb, rows, group_ids)

    def score(self, rb: RolloutBatch, rows: list[Problem], group_ids: torch.Tensor) -> ScoredBatch:
        from fp8rl.rl.dapo import overlong_penalty

        texts = [self.tok.decode(r) for r in rb.response_ids.cpu().tolist()]
        grades = [grade_exact(t, str(p.answer)) for t, p in zip(texts, rows, strict=True)]
        correct = torch.tensor([g.correct for g in grades], dtype=torch.float32)
        rewards = correct.clone()
        a = self.cfg.algorithm
        if a.overlong_buffer > 0:
            lengths = rb.response_lengths.cpu()
            rewards = rewards + overlong_penalty(lengths, max_len=self.cfg.max_response_len,
                                                 cache_len=a.overlong_buffer, factor=a.overlong_penalty)
        return ScoredBatch(rollout=rb, problems=rows, texts=texts, rewards=rewards, correct=correct,
                           garbled=torch.tensor([g.garbled for g in grades], dtype=torch.float32),
                           group_ids=group_ids)

    def collect(self, step: int, gen: torch.Generator) -> tuple[ScoredBatch, ScoredBatch, dict]:
        """``(training batch, everything generated, metrics)``; DAPO filtering when enabled."""
        from fp8rl.rl.dapo import dynamic_sampling_filter

        a = self.cfg.algorithm
        first = self.rollout(step, 0, gen)
        if not a.dynamic_sampling:
            return first, first, {}
        n_groups = self.cfg.prompts_per_step
        generated, kept = [first], []
        filt = dynamic_sampling_filter(first.rewards, first.group_ids)
        metrics = {M.DAPO_KEPT_GROUP_FRAC: filt.kept_group_frac}
        kept.append(first.select(filt.indices))
        n_kept, rounds = filt.num_kept, 0
        while n_kept < n_groups and rounds < a.max_extra_rounds:
            rounds += 1
            more = self.rollout(step, rounds, gen)
            generated.append(more)
            f = dynamic_sampling_filter(more.rewards, more.group_ids)
            kept.append(more.select(f.indices))
            n_kept += f.num_kept
        batch = concat_batches(kept, self.tok.pad_id)
        keep_n = min(n_kept, n_groups) * a.n_samples_per_prompt
        batch = batch.select(torch.arange(keep_n))
        metrics.update({"dapo/extra_rounds": rounds, "dapo/groups_used": keep_n // a.n_samples_per_prompt})
        return batch, concat_batches(generated, self.tok.pad_id), metrics

    def rollout_metrics(self, gen_batch: ScoredBatch) -> dict:
        lengths = gen_batch.rollout.response_lengths.float().cpu()
        return {
            M.ROLLOUT_REWARD_MEAN: to_float(gen_batch.rewards.mean()),
            M.ROLLOUT_ACC: to_float(gen_batch.correct.mean()),
            M.ROLLOUT_RESPONSE_LEN: to_float(lengths.mean()),
            M.ROLLOUT_TRUNCATED_FRAC: to_float(gen_batch.rollout.truncated.float().mean()),
            M.ROLLOUT_GARBLED_FRAC: to_float(gen_batch.garbled.mean()),
        }

    # ----- one step, evaluation, logging ------------------------------------------------------

    def train_step(self, step: int) -> dict:
        """Run step ``step`` (1-based) and return its metrics row."""
        gen = torch.Generator(device=self.device).manual_seed(seed_for(self.cfg.seed, "step", step))
        t0 = time.perf_counter()
        batch, generated, row = self.collect(step, gen)
        t1 = time.perf_counter()
        row.update(self.rollout_metrics(generated))
        if len(batch) > 0:
            row.update(self.update(step, batch, gen))
            self.engine.sync(self.policy)
        t2 = time.perf_counter()
        self.check_finite_parameters()
        skipped = row.get("train/skipped_updates", 0)
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        gen_tokens = int(generated.rollout.response_lengths.sum())
        train_tokens = int(batch.rollout.response_lengths.sum()) if len(batch) else 0
        shadow_s = row.get(M.PERF_SHADOW_S, 0.0)
        row.update({
            M.PERF_STEP_S: t2 - t0, M.PERF_ROLLOUT_S: t1 - t0, M.PERF_TRAIN_S: t2 - t1 - shadow_s,
            M.PERF_TOKENS_PER_S: gen_tokens / max(t2 - t0, 1e-9),
            "perf/rollout_tokens_per_s": gen_tokens / max(t1 - t0, 1e-9),
            "perf/train_tokens_per_s": train_tokens / max(t2 - t1, 1e-9),
        })
        if self.bad_steps >= self.cfg.max_bad_steps:
            raise RunFailed(f"{self.bad_steps} consecutive steps with non-finite loss or gradients "
                            f"(last at step {step}); the run diverged")
        self._last_samples = (step, generated)
        return {M.STEP: step, **row}

    def check_finite_parameters(self) -> None:
        """Raise ``RunFailed`` naming the first non-finite parameter (one check over all of them
        first: the largest magnitude of each, finite for a finite tensor)."""
        named = list(self.policy.named_parameters())
        peaks = torch._foreach_max(torch._foreach_abs([p.detach() for _, p in named]))
        if bool(torch.isfinite(torch.stack(peaks)).all()):
            return
        for name, p in named:
            if not bool(torch.isfinite(p).all()):
                raise RunFailed(f"parameter {name} became non-finite; the run diverged")

    def write_samples(self, step: int, batch: ScoredBatch, n: int = 8) -> None:
        if self.run_dir is None:
            return
        from fp8rl.runs.jsonl import atomic_write_text

        path = Path(self.run_dir.samples_dir) / f"step_{step:06d}.jsonl"
        atomic_write_text(path, "".join(json.dumps({
            "prompt": batch.problems[i].prompt, "response": batch.texts[i],
            "answer": batch.problems[i].answer, "reward": float(batch.rewards[i]),
            "correct": bool(batch.correct[i]), "garbled": bool(batch.garbled[i])}) + "\n"
            for i in range(min(n, len(batch)))))

    # ----- the loop -------------------------------------------------------------------------------

    def run(self, *, progress: bool = False) -> dict:
        """Train to ``cfg.steps`` (resuming from a checkpoint if present); returns the summary."""
        from fp8rl.runs import DONE, FAILED, PREEMPTED, RUNNING
        from fp8rl.runs.relaunch import discard_outputs, remove_stale_temps
        from fp8rl.runs.stop import RunStopped, stop_requested

        cfg, rd = self.cfg, self.run_dir
        t_start = time.perf_counter()
        if rd is not None:
            remove_stale_temps(rd)  # of writes a kill interrupted (a checkpoint's included)
        try:
            resumed = self.load_checkpoint()
        except Exception as e:  # refused (damaged, foreign): FAILED with why and what to do,
            if rd is not None:  # never the last attempt's PREEMPTED with its "relaunch to resume"
                rd.set_status(FAILED, _logged_step(rd), reason=f"{type(e).__name__}: {e}")
            raise
        if rd is not None:
            if resumed:
                rd.truncate_after(self.step)
            else:  # killed before its first checkpoint, or a new run: start from step 0
                discard_outputs(rd)
            rd.set_status(RUNNING, self.step)
        mw = rd.metrics_writer() if rd is not None else None
        ew = rd.eval_writer() if rd is not None else None
        self._live = None
        if rd is not None:
            from fp8rl.runs.live import LiveLog

            self._live = LiveLog(rd.path, cfg.logging, resume_step=self.step, config=config_dict(cfg))
        bar = progress_bar(range(self.step + 1, cfg.steps + 1), progress, initial=self.step, total=cfg.steps)
        try:
            if self.step == 0:
                self._log_eval(ew, self.evaluate_start())
            for step in bar:
                if stop_requested():  # a safe point: everything of self.step is logged
                    self._stop_here()
                row = self.train_step(step)
                self.step = step
                self.history.append(brief(row))
                if mw is not None:
                    mw.write(row)
                    self._live.log(row)
                if cfg.samples_every and step % cfg.samples_every == 0:
                    self.write_samples(step, self._last_samples[1])
                if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                    self._log_eval(ew, self.evaluate(step))
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps:
                    self.save_checkpoint()
                if rd is not None:
                    rd.set_status(RUNNING, step)
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(reward=f"{row[M.ROLLOUT_REWARD_MEAN]:.3f}",
                                    entropy=f"{row.get(M.ACTOR_ENTROPY, float('nan')):.3f}")
        except RunFailed as e:
            if rd is not None:
                rd.set_status(FAILED, self.step, reason=str(e))
                rd.write_summary(self.summary(time.perf_counter() - t_start, FAILED, str(e)))
            return self.summary(time.perf_counter() - t_start, FAILED, str(e))
        except KeyboardInterrupt as e:
            if rd is not None:
                reason = str(e) if isinstance(e, RunStopped) else "interrupted"
                with contextlib.suppress(OSError):  # a full disk: the error itself says more
                    rd.set_status(PREEMPTED, self.step, reason=reason)
            raise
        except BaseException as e:
            if rd is not None:
                with contextlib.suppress(OSError):  # a full disk: the error itself says more
                    rd.set_status(FAILED, self.step, reason=f"{type(e).__name__}: {e}")
            raise
        finally:
            for w in (mw, ew, self._live):
                if w is not None:
                    w.close()
            if hasattr(bar, "close"):
                bar.close()
        summary = self.summary(time.perf_counter() - t_start, DONE, None)
        if rd is not None:
            rd.write_summary(summary)
            rd.set_status(DONE, self.step)
        return summary

    def _stop_here(self) -> None:
        """Stop between steps on request (``fp8rl.runs.stop``): checkpoint the last finished step
        (unless ``checkpoint_every`` just did), then raise ``RunStopped``; ``run`` records PREEMPTED."""
        from fp8rl.runs.stop import RunStopped

        every = self.cfg.checkpoint_every
        if self.step > 0 and not (every and self.step % every == 0):
            self.save_checkpoint()
        at = f"step {self.step}" if self.step > 0 else "the start (no step done)"
        raise RunStopped(f"stopped on request at {at}; relaunch to resume from there")

    def _log_eval(self, writer, row: dict) -> None:
        self.history.append({"eval": row})
        if writer is not None:
            writer.write(row)
        if self._live is not None:
            self._live.log(row)

    def summary(self, wall_s: float, state: str, reason: str | None) -> dict:
        """The numbers tables read (``stats.run_summary``)."""
        return run_summary(self.history, steps=self.step, wall_s=wall_s, state=state, reason=reason,
                           skipped_updates=self.skipped_updates, sft_meta=self.sft_meta)


def _logged_step(rd) -> int:
    """The step ``status.json`` says the run reached (0 when it cannot be read)."""
    try:
        return int((rd.status() or {}).get("step") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def config_dict(cfg: MiniRunConfig) -> dict:
    """The config as plain containers (what ``config.yaml`` holds and the hash reads)."""
    return asdict(cfg)
