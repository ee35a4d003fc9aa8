"""Metric names: the one vocabulary shared by both backends and the analysis package.

Every name here is the exact key written to ``metrics.jsonl`` / ``eval.jsonl`` of a run
directory (docs/design.md, "The run directory"). Backends import the constants instead of typing
strings, so a typo is an ``AttributeError`` at import time rather than a silently missing
curve in a figure.

Row formats
-----------
``metrics.jsonl``: one JSON object per training step::

    {"step": 12, "actor/entropy": 0.41, "actor/clipfrac_neg_low": 0.003, ...}

``step`` (``STEP``) is required; every other key is optional (a backend logs what it
measured: the ``shadow/*`` keys appear on calibration steps only, ``dapo/*`` with DAPO only).

``eval.jsonl``: one JSON object per evaluation of one dataset::

    {"step": 100, "dataset": "aime24", "k": 16, "n": 30,
     "eval/aime24/avg@k": 0.41, "eval/aime24/pass@k": 0.70}

The metric keys spell ``avg@k`` / ``pass@k`` literally (docs/design.md) and the row's ``k`` field
says which k was used; ``n`` is the number of problems. :func:`eval_row` builds such a row.
Readers (``analysis.collect``) also accept a numeric k in the key (``eval/aime24/avg@16``) and
rows that carry several datasets at once, so an external logger need not be reshaped.

Two engines score an evaluation. ``eval/...`` is the arm's own rollout engine (FP8 for an FP8
rollout arm); ``eval_bf16/...`` (:data:`EVAL_BF16_PREFIX`) is a BF16 engine scoring the same
weights on the same problems with the same sampling seed, so that every arm is evaluated in one
precision and evaluation precision is not confounded with training precision. Both may share a
row (same ``step``, ``dataset``, ``k``, ``n``)::

    {"step": 20, "dataset": "arith", "k": 4, "n": 512,
     "eval/arith/avg@k": 0.80, "eval/arith/pass@k": 0.95,
     "eval_bf16/arith/avg@k": 0.81, "eval_bf16/arith/pass@k": 0.95}

Rows written before the BF16 evaluation existed have ``eval/`` keys only and read as before.

Values are fractions in [0, 1] for accuracies and clip fractions (not percent); times are
seconds; lengths are tokens. A non-finite value is written as JSON ``null`` (see
``fp8rl.runs.rundir``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

STEP = "step"

# --- actor (trainer) --------------------------------------------------------------------
ACTOR_ENTROPY = "actor/entropy"
ACTOR_PG_LOSS = "actor/pg_loss"
ACTOR_GRAD_NORM = "actor/grad_norm"
ACTOR_PPO_KL = "actor/ppo_kl"
ACTOR_CLIPFRAC = "actor/clipfrac"
ACTOR_CLIPFRAC_NEG_LOW = "actor/clipfrac_neg_low"
ACTOR_CLIPFRAC_NEG_HIGH = "actor/clipfrac_neg_high"
ACTOR_CLIPFRAC_POS_LOW = "actor/clipfrac_pos_low"
ACTOR_CLIPFRAC_POS_HIGH = "actor/clipfrac_pos_high"
ACTOR_RATIO_NEG_Q01 = "actor/ratio_neg_q01"
ACTOR_RATIO_NEG_Q50 = "actor/ratio_neg_q50"
ACTOR_RATIO_NEG_Q99 = "actor/ratio_neg_q99"
# the standard deviation of r - 1 over the step's response tokens: the precision-noise dose (issue 48)
ACTOR_RATIO_STD = "actor/ratio_std"
# the counts behind actor/clipfrac_neg_low (its denominator and numerator): a ratio of counts
# between two runs is not the ratio of their fractions when one run makes more A<0 tokens
ACTOR_N_NEG = "actor/n_neg"
ACTOR_N_NEG_LOW = "actor/n_neg_low"

# --- clip bounds ------------------------------------------------------------------------
CLIP_LOW = "clip/low"
CLIP_HIGH = "clip/high"
CLIP_ALPHA = "clip/alpha"
# how much data the step's calibrations had (issue 46; means over the step's calibrations):
# A<0 tokens the BF16 shadow puts below 1 - eps_low, A<0 tokens measured, the BF16-clipped count
# to expect among them (the run's BF16 rate so far x n), the share of calibrations with k = 0,
# the calibrations counted, and the run's BF16 rate so far
CLIP_K = "clip/k"
CLIP_N = "clip/n"
CLIP_ALPHA_N = "clip/alpha_n"
CLIP_K_ZERO = "clip/k_zero"
CLIP_EVENTS = "clip/events"
CLIP_ALPHA_RUN = "clip/alpha_run"
CALIBRATION_DATA_METRICS: tuple[str, ...] = (CLIP_K, CLIP_N, CLIP_ALPHA_N, CLIP_K_ZERO, CLIP_EVENTS, CLIP_ALPHA_RUN)

# --- BF16 shadow (calibration steps only) -----------------------------------------------
SHADOW_CLIPFRAC_NEG_LOW = "shadow/clipfrac_neg_low"
SHADOW_RATIO_NEG_Q01 = "shadow/ratio_neg_q01"
# which tokens are clipped (fp8rl.rl.calibration.agreement): A<0 tokens the BF16 shadow would
# clip with the vanilla bounds (bf16), that FP8 clips with the bounds in force (fp8), both; the
# same over A>0 tokens for the upper bound; recall = both / bf16, precision = both / fp8
SHADOW_LOW_BF16_N = "shadow/low_bf16_n"
SHADOW_LOW_FP8_N = "shadow/low_fp8_n"
SHADOW_LOW_BOTH_N = "shadow/low_both_n"
SHADOW_HIGH_BF16_N = "shadow/high_bf16_n"
SHADOW_HIGH_FP8_N = "shadow/high_fp8_n"
SHADOW_HIGH_BOTH_N = "shadow/high_both_n"
SHADOW_LOW_RECALL = "shadow/low_recall"
SHADOW_LOW_PRECISION = "shadow/low_precision"
SHADOW_HIGH_RECALL = "shadow/high_recall"
SHADOW_HIGH_PRECISION = "shadow/high_precision"
# out of sample (fp8rl.rl.calibration.heldout): A<0 tokens with a BF16 shadow that did not feed the
# estimate of the bounds applied to them: how many, how many FP8 puts below the lower bound applied,
# how many the BF16 shadow puts below 1 - eps_low; their ratio is the calibration's real error
SHADOW_OOS_N_NEG = "shadow/oos_n_neg"
SHADOW_OOS_FP8_LOW_N = "shadow/oos_fp8_low_n"
SHADOW_OOS_BF16_LOW_N = "shadow/oos_bf16_low_n"
SHADOW_OOS_CLIPFRAC_NEG_LOW = "shadow/oos_clipfrac_neg_low"
SHADOW_OOS_BF16_CLIPFRAC_NEG_LOW = "shadow/oos_bf16_clipfrac_neg_low"
# the same by 2-fold cross-fitting, for a mode whose bounds rule only the tokens they come from
# (same_batch): each half's tokens against the bounds the mode's estimator gives on the other half
SHADOW_XFIT_N_NEG = "shadow/xfit_n_neg"
SHADOW_XFIT_FP8_LOW_N = "shadow/xfit_fp8_low_n"
SHADOW_XFIT_BF16_LOW_N = "shadow/xfit_bf16_low_n"
# the held-out rows (clip.holdout_share; every arm alike): A<0 tokens of sequences that were
# shadowed and never measured, of which FP8 puts below the bound in force on them, of which the
# BF16 shadow puts below 1 - eps_low; and the gradient cosine on those rows alone
SHADOW_HO_N_NEG = "shadow/ho_n_neg"
SHADOW_HO_FP8_LOW_N = "shadow/ho_fp8_low_n"
SHADOW_HO_BF16_LOW_N = "shadow/ho_bf16_low_n"
SHADOW_HO_GRAD_COS = "shadow/ho_grad_cos"
# cosine between the policy-loss gradient as trained (FP8 ratios, the arm's bounds) and the one with
# BF16 shadow ratios and the vanilla bounds through the BF16 model, same weights and tokens
SHADOW_GRAD_COS = "shadow/grad_cos"

# --- rollout ----------------------------------------------------------------------------
ROLLOUT_MISMATCH_KL = "rollout/mismatch_kl"
ROLLOUT_IS_CLIPFRAC = "rollout/is_clipfrac"
ROLLOUT_REWARD_MEAN = "rollout/reward_mean"
ROLLOUT_ACC = "rollout/acc"
ROLLOUT_RESPONSE_LEN = "rollout/response_len"
ROLLOUT_TRUNCATED_FRAC = "rollout/truncated_frac"
ROLLOUT_GARBLED_FRAC = "rollout/garbled_frac"

# --- DAPO -------------------------------------------------------------------------------
DAPO_KEPT_GROUP_FRAC = "dapo/kept_group_frac"
#: Paper scale: prompt groups dynamic filtering dropped while drawing the step's batch, and the
#: replacement prompts it asked the loader for (those that found none included).
DAPO_FILTERED_GROUPS = "dapo/filtered_groups"
DAPO_REPLACEMENTS = "dapo/replacements"

# --- Score Centering (the score_centering* clip arms only; fp8rl.rl.score_centering) -----
#: mean over response tokens of sum_H q: the sampler's probability mass on its own top-k ids H
SC_HEAD_MASS = "sc/head_mass"
#: mean over response tokens of rho = (1 - sum_H q) / max(1 - sum_H p, 1e-6), p the current trainer
SC_RHO = "sc/rho"
#: mean over response tokens of |A * C|, the term's size in the per-token loss
SC_TERM_ABS = "sc/term_abs"
SCORE_CENTERING_METRICS: tuple[str, ...] = (SC_HEAD_MASS, SC_RHO, SC_TERM_ABS)

# --- timing -----------------------------------------------------------------------------
PERF_STEP_S = "perf/step_s"
PERF_ROLLOUT_S = "perf/rollout_s"
PERF_TRAIN_S = "perf/train_s"
PERF_SHADOW_S = "perf/shadow_s"
PERF_TOKENS_PER_S = "perf/tokens_per_s"

#: Which tokens are clipped (``shadow/*`` counts and rates; on measured steps only).
AGREEMENT_METRICS: tuple[str, ...] = (
    SHADOW_LOW_BF16_N,
    SHADOW_LOW_FP8_N,
    SHADOW_LOW_BOTH_N,
    SHADOW_HIGH_BF16_N,
    SHADOW_HIGH_FP8_N,
    SHADOW_HIGH_BOTH_N,
    SHADOW_LOW_RECALL,
    SHADOW_LOW_PRECISION,
    SHADOW_HIGH_RECALL,
    SHADOW_HIGH_PRECISION,
)

#: Held-out calibration error and the gradient's agreement (diagnostic steps; ``shadow/*``).
HELDOUT_METRICS: tuple[str, ...] = (
    SHADOW_OOS_N_NEG,
    SHADOW_OOS_FP8_LOW_N,
    SHADOW_OOS_BF16_LOW_N,
    SHADOW_OOS_CLIPFRAC_NEG_LOW,
    SHADOW_OOS_BF16_CLIPFRAC_NEG_LOW,
    SHADOW_XFIT_N_NEG,
    SHADOW_XFIT_FP8_LOW_N,
    SHADOW_XFIT_BF16_LOW_N,
    SHADOW_GRAD_COS,
    SHADOW_HO_N_NEG,
    SHADOW_HO_FP8_LOW_N,
    SHADOW_HO_BF16_LOW_N,
    SHADOW_HO_GRAD_COS,
)

#: Every per-step metric name, in the order of docs/design.md's table (``step`` excluded).
TRAIN_METRICS: tuple[str, ...] = (
    ACTOR_ENTROPY,
    ACTOR_PG_LOSS,
    ACTOR_GRAD_NORM,
    ACTOR_PPO_KL,
    ACTOR_CLIPFRAC,
    ACTOR_CLIPFRAC_NEG_LOW,
    ACTOR_CLIPFRAC_NEG_HIGH,
    ACTOR_CLIPFRAC_POS_LOW,
    ACTOR_CLIPFRAC_POS_HIGH,
    ACTOR_RATIO_NEG_Q01,
    ACTOR_RATIO_NEG_Q50,
    ACTOR_RATIO_NEG_Q99,
    ACTOR_RATIO_STD,
    ACTOR_N_NEG,
    ACTOR_N_NEG_LOW,
    CLIP_LOW,
    CLIP_HIGH,
    CLIP_ALPHA,
    *CALIBRATION_DATA_METRICS,
    SHADOW_CLIPFRAC_NEG_LOW,
    SHADOW_RATIO_NEG_Q01,
    *AGREEMENT_METRICS,
    *HELDOUT_METRICS,
    ROLLOUT_MISMATCH_KL,
    ROLLOUT_IS_CLIPFRAC,
    ROLLOUT_REWARD_MEAN,
    ROLLOUT_ACC,
    ROLLOUT_RESPONSE_LEN,
    ROLLOUT_TRUNCATED_FRAC,
    ROLLOUT_GARBLED_FRAC,
    DAPO_KEPT_GROUP_FRAC,
    DAPO_FILTERED_GROUPS,
    DAPO_REPLACEMENTS,
    *SCORE_CENTERING_METRICS,
    PERF_STEP_S,
    PERF_ROLLOUT_S,
    PERF_TRAIN_S,
    PERF_SHADOW_S,
    PERF_TOKENS_PER_S,
)

#: Per-step metrics that are logged on some steps or some configurations only.
SPARSE_METRICS: tuple[str, ...] = (
    CLIP_ALPHA,
    *CALIBRATION_DATA_METRICS,
    *CALIBRATION_DATA_METRICS,
    SHADOW_CLIPFRAC_NEG_LOW,
    SHADOW_RATIO_NEG_Q01,
    *AGREEMENT_METRICS,
    *HELDOUT_METRICS,
    DAPO_KEPT_GROUP_FRAC,
    DAPO_FILTERED_GROUPS,
    DAPO_REPLACEMENTS,
    *SCORE_CENTERING_METRICS,
    PERF_SHADOW_S,
)

# --- evaluation -------------------------------------------------------------------------
EVAL_PREFIX = "eval/"
#: Prefix of the same statistics scored by a BF16 engine on the same weights (every arm).
EVAL_BF16_PREFIX = "eval_bf16/"
#: Which engine scored an evaluation (``precision=`` of :func:`eval_key`): the arm's own rollout
#: engine, or a BF16 engine.
EVAL_OWN = "own"
EVAL_BF16 = "bf16"
EVAL_PRECISIONS: tuple[str, ...] = (EVAL_OWN, EVAL_BF16)
_EVAL_PREFIXES = {EVAL_OWN: EVAL_PREFIX, EVAL_BF16: EVAL_BF16_PREFIX}
EVAL_AVG = "avg@k"
EVAL_PASS = "pass@k"
#: Accuracy of one greedy decode per problem (the mini backend's paired evaluation).
EVAL_GREEDY = "greedy"
EVAL_STATS: tuple[str, ...] = (EVAL_AVG, EVAL_PASS, EVAL_GREEDY)
#: Fields of an ``eval.jsonl`` row besides the metric keys.
EVAL_DATASET = "dataset"
EVAL_K = "k"
EVAL_N = "n"

_DATASET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+]*$")
#: Matches ``eval/<dataset>/avg@k``, ``eval/<dataset>/pass@16`` (numeric k accepted on read) and the
#: same under ``eval_bf16/``; the ``prefix`` group says which engine.
EVAL_KEY_RE = re.compile(r"^(?P<prefix>eval|eval_bf16)/(?P<dataset>[^/]+)/"
                         r"(?:(?P<stat>avg|pass)@(?P<k>k|\d+)|(?P<greedy>greedy))$")


class EvalKey(NamedTuple):
    """A parsed evaluation key: ``dataset``, ``stat`` (one of :data:`EVAL_STATS`), ``k`` (None when
    the key spells ``k``) and ``precision`` (one of :data:`EVAL_PRECISIONS`)."""

    dataset: str
    stat: str
    k: int | None
    precision: str


def _check_dataset(dataset: str) -> str:
    if not isinstance(dataset, str) or not _DATASET_RE.match(dataset):
        raise ValueError(
            f"evaluation dataset name {dataset!r} is not a plain token: use letters, digits, "
            "'_', '.', '+' (no '/', no spaces), e.g. 'aime24' or 'math500'"
        )
    return dataset


def _check_precision(precision: str) -> str:
    if precision not in EVAL_PRECISIONS:
        raise ValueError(f"evaluation precision must be one of {EVAL_PRECISIONS} ('own': the arm's rollout "
                         f"engine, 'bf16': a BF16 engine on the same weights), got {precision!r}")
    return precision


def eval_key(dataset: str, stat: str, *, precision: str = EVAL_OWN) -> str:
    """The metric key of one evaluation statistic: ``eval_key("aime24", "avg@k")``.

    Args:
        dataset: the evaluation set's name, a plain token (``aime24``, ``math500``).
        stat: ``"avg@k"`` (mean accuracy over the k samples per problem), ``"pass@k"`` or
            ``"greedy"`` (accuracy of one greedy decode per problem).
        precision: ``"own"`` (the arm's rollout engine) or ``"bf16"`` (a BF16 engine).

    Returns:
        ``"eval/<dataset>/<stat>"``, or ``"eval_bf16/<dataset>/<stat>"`` for ``precision="bf16"``.
    """
    _check_dataset(dataset)
    if stat not in EVAL_STATS:
        raise ValueError(f"evaluation statistic must be one of {EVAL_STATS}, got {stat!r}")
    return f"{_EVAL_PREFIXES[_check_precision(precision)]}{dataset}/{stat}"


def split_eval_key(key: str) -> EvalKey | None:
    """``"eval_bf16/aime24/avg@16"`` -> ``EvalKey("aime24", "avg@k", 16, "bf16")``; None for keys
    that are not evaluation metrics of either engine."""
    m = EVAL_KEY_RE.match(key)
    if m is None:
        return None
    precision = EVAL_BF16 if m.group("prefix") == "eval_bf16" else EVAL_OWN
    if m.group("greedy"):
        return EvalKey(m.group("dataset"), EVAL_GREEDY, None, precision)
    k = m.group("k")
    return EvalKey(m.group("dataset"), f"{m.group('stat')}@k", None if k == "k" else int(k), precision)


def parse_eval_key(key: str, *, precision: str = EVAL_OWN) -> tuple[str, str, int | None] | None:
    """``"eval/aime24/avg@16"`` -> ``("aime24", "avg@k", 16)``; ``"eval/x/avg@k"`` -> k None;
    ``"eval/x/greedy"`` -> ``("x", "greedy", None)``.

    Only keys of the engine ``precision`` names match (default: the arm's own, ``eval/``):
    ``parse_eval_key("eval_bf16/x/avg@k")`` is None and ``parse_eval_key("eval_bf16/x/avg@k",
    precision="bf16")`` is ``("x", "avg@k", None)``. Returns None for other keys.
    """
    _check_precision(precision)
    p = split_eval_key(key)
    if p is None or p.precision != precision:
        return None
    return p.dataset, p.stat, p.k


def eval_row(
    step: int,
    dataset: str,
    *,
    avg_at_k: float | None = None,
    pass_at_k: float | None = None,
    k: int,
    n: int,
    bf16_avg_at_k: float | None = None,
    bf16_pass_at_k: float | None = None,
) -> dict:
    """One ``eval.jsonl`` row in the canonical layout (see the module docstring).

    Args:
        step: training step the evaluated policy comes from (0 = before training).
        dataset: evaluation set name.
        avg_at_k: mean accuracy over ``k`` samples per problem, a fraction in [0, 1] (the arm's
            own engine); None only in a row of the BF16 engine alone (``bf16_avg_at_k`` given).
        pass_at_k: fraction of problems with at least one correct sample, or None.
        k: samples per problem (>= 1).
        n: number of problems (>= 1).
        bf16_avg_at_k, bf16_pass_at_k: the same statistics from a BF16 engine on the same weights,
            problems and seed (``eval_bf16/`` keys), or None when not evaluated.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"eval k must be an int >= 1, got {k!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"eval n (problems) must be an int >= 1, got {n!r}")
    if avg_at_k is None and bf16_avg_at_k is None:
        raise ValueError("eval_row needs avg_at_k (the arm's own engine) or bf16_avg_at_k (a BF16 engine)")
    if pass_at_k is not None and avg_at_k is None:
        raise ValueError("eval_row: pass_at_k without avg_at_k; give both from the same evaluation")
    if bf16_pass_at_k is not None and bf16_avg_at_k is None:
        raise ValueError("eval_row: bf16_pass_at_k without bf16_avg_at_k; give both from the BF16 evaluation")
    row = {
        STEP: int(step),
        EVAL_DATASET: _check_dataset(dataset),
        EVAL_K: k,
        EVAL_N: n,
    }
    if avg_at_k is not None:
        row[eval_key(dataset, EVAL_AVG)] = avg_at_k
    if pass_at_k is not None:
        row[eval_key(dataset, EVAL_PASS)] = pass_at_k
    if bf16_avg_at_k is not None:
        row[eval_key(dataset, EVAL_AVG, precision=EVAL_BF16)] = bf16_avg_at_k
    if bf16_pass_at_k is not None:
        row[eval_key(dataset, EVAL_PASS, precision=EVAL_BF16)] = bf16_pass_at_k
    return row
