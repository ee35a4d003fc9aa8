"""The mini trainer's evaluations: step 0 (shared by the cells of a sweep) and after training,
through the run's rollout engine and through a BF16 engine (a mixin of ``MiniTrainer``; the loop
and its documentation are in ``trainer.py``, the evaluation itself in ``evaluate.py``).

Every evaluation of a run, with either engine, samples with the generator seeded by
``(seed, "eval")``: differences between steps are the policy's, differences between the engines
are the engines'. An FP8 rollout arm is evaluated by its own (FP8) engine under ``eval/`` and by
a BF16 engine on the same weights under ``eval_bf16/``; a BF16 rollout arm's engine is the BF16
engine, and its one evaluation fills both.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fp8rl.backends.mini.evaluate import DATASET, cached_evaluation, evaluate
from fp8rl.backends.mini.numerics import numerics_key
from fp8rl.backends.mini.rollout import RolloutEngine
from fp8rl.backends.mini.runtime import seed_for
from fp8rl.runs import metrics as M

#: Part of the step-0 evaluation cache key: bump when the engine or the evaluation computes
#: different numbers for the same settings.
EVAL0_VERSION = 1
#: The rollout recipe of the BF16 evaluation engine (``eval_bf16/`` keys).
BF16_EVAL_RECIPE = "bf16"


def with_bf16(own: dict, bf16: dict) -> dict:
    """``own`` (an engine's ``eval.jsonl`` row) plus ``bf16``'s metric keys renamed ``eval/`` ->
    ``eval_bf16/`` (the BF16 engine's row of the same step, data set, k and n)."""
    same = (M.STEP, M.EVAL_DATASET, M.EVAL_K, M.EVAL_N)
    if any(own[f] != bf16[f] for f in same):
        raise ValueError(f"the BF16 evaluation row is not the same evaluation: {[bf16[f] for f in same]} "
                         f"against {[own[f] for f in same]} ({same})")
    out = dict(own)
    for key, value in bf16.items():
        if key.startswith(M.EVAL_PREFIX):
            out[M.EVAL_BF16_PREFIX + key[len(M.EVAL_PREFIX):]] = value
    return out


class EvalMixin:
    """``evaluate_start``, ``evaluate``, ``bf16_eval_engine``; needs ``cfg``, ``engine``,
    ``_bf16_engine``, ``bf16_eval``, ``policy``, ``eval_set``, ``tok``, ``device`` and
    ``sft_meta`` on the instance."""

    def evaluate_start(self) -> dict:
        """The step-0 evaluation: the warm start seen through this run's rollout engine and
        through a BF16 engine.

        Every cell of a sweep with the same warm start, engine (rollout recipe, emulation,
        compute dtype), evaluation settings and seed computes the same numbers for that engine,
        so the first computes them and stores them beside the warm start; the others read them
        (``evaluate.cached_evaluation``; exact: the evaluation is deterministic given that key).
        The cache holds one engine's row per entry, keyed by that engine's recipe: the BF16 part
        of an FP8 arm's row is the entry of the BF16 engine, the one a BF16 arm of the sweep
        computes for its own evaluation (same warm start weights, same engine, same seed).
        """
        cache = Path(self.sft_meta["path"])
        own = cached_evaluation(cache, self._eval0_spec(self.cfg.fp8.rollout_recipe),
                                lambda: self._engine_row(0, self.engine))
        if not self.bf16_eval:
            return own
        bf16 = own if self._bf16_engine_is_own() else cached_evaluation(
            cache, self._eval0_spec(BF16_EVAL_RECIPE), lambda: self._engine_row(0, self.bf16_eval_engine()))
        return with_bf16(own, bf16)

    def _eval0_spec(self, rollout_recipe: str) -> dict:
        """The step-0 cache key of the engine with ``rollout_recipe`` (everything its numbers depend on)."""
        cfg = self.cfg
        return {"version": EVAL0_VERSION, "rollout_recipe": rollout_recipe, "emulate": cfg.fp8.emulate,
                "compute_dtype": cfg.fp8.compute_dtype, "eval_k": cfg.eval_k,
                "eval_temperature": cfg.eval_temperature, "eval_greedy": cfg.eval_greedy,
                "max_response_len": cfg.max_response_len, "seed": cfg.seed, "device": self.device.type,
                # the kernels compute the bits: a cache shared by machines with other CPUs (a
                # cluster's file system) or another torch must not hand one's rows to the other
                "kernels": numerics_key(self.device.type)}

    def evaluate(self, step: int) -> dict:
        """Held-out accuracy of the current policy through its rollout engine (``eval/`` keys) and
        through a BF16 engine on the same weights (``eval_bf16/``). Paired: every evaluation of the
        run, with either engine, samples with the same seed, so differences between steps are the
        policy's and differences between the engines are the engines'."""
        own = self._engine_row(step, self.engine)
        if not self.bf16_eval:
            return own
        bf16 = own if self._bf16_engine_is_own() else self._engine_row(step, self.bf16_eval_engine())
        return with_bf16(own, bf16)

    def _bf16_engine_is_own(self) -> bool:
        """Whether the rollout engine is already the BF16 engine (no FP8 rollout recipe): then its
        evaluation is the BF16 evaluation, reused instead of computed twice."""
        return not self.cfg.fp8.rollout.enabled

    def bf16_eval_engine(self) -> RolloutEngine:
        """The BF16 evaluation engine (the ``bf16`` rollout recipe at the run's compute dtype, its own
        weight copy), synced from the policy's current weights on every call; the rollout engine
        itself where that is a BF16 engine already."""
        if self._bf16_engine is None:
            return self.engine
        self._bf16_engine.sync(self.policy)
        return self._bf16_engine

    def _engine_row(self, step: int, engine: RolloutEngine) -> dict:
        """One engine's evaluation of the current policy as an ``eval.jsonl`` row (``eval/`` keys)."""
        cfg = self.cfg
        gen = torch.Generator(device=self.device).manual_seed(seed_for(cfg.seed, "eval"))
        res = evaluate(engine, self.eval_set, self.tok, k=cfg.eval_k, temperature=cfg.eval_temperature,
                       max_new_tokens=cfg.max_response_len, generator=gen, device=self.device,
                       greedy=cfg.eval_greedy)
        row = M.eval_row(step, DATASET, avg_at_k=res["avg@k"], pass_at_k=res["pass@k"],
                         k=res["k"], n=res["n"])
        row[f"eval/{DATASET}/garbled_frac"] = res["garbled_frac"]
        if "greedy" in res:
            row[M.eval_key(DATASET, "greedy")] = res["greedy"]
        return row
