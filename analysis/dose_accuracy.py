"""Accuracy in the dose response (issue 48): each arm's gain against its reference, paired by seed.

The surge comparisons (:func:`analysis.dose.comparison_rows`) ask whether the clip method or the
precision changes the *surge probability*; this module asks the same of the *accuracy gain*, over
the same comparisons (:func:`analysis.dose.comparison_pairs`): each non-vanilla clip arm against the
vanilla arm of its dose (does giving the lower clip's tokens their gradient back, or weighting by
TIS, change what the run learns at that precision?), and each FP arm against BF16 vanilla.

- **Outcome.** A run's gain in avg@k scored by a BF16 engine on the same weights, last evaluation
  minus step 0, averaged over the evaluation sets (:func:`analysis.paired.run_gains` with
  ``precision="bf16"``; finished runs only). Scoring every arm in one precision keeps the
  rollout's own noise out of the measure; the gain, not the final value, so that a seed's two arms
  are compared on what they learned even where their step-0 evaluations differ (they do not when
  every arm starts from the same warm start, as in ``surge_dose``: then the difference of gains is
  the difference of final accuracies).
- **Pairing.** By seed (the same prompts, the same held-out rows and the same evaluation sample in
  both arms of a seed): the per-seed differences arm - reference over the seeds both arms finished
  once (:func:`analysis.heldout_judgement.paired_diff`), their mean with a 95% Student-t interval,
  the paired t and its two-sided p.
- **Correction.** Holm over every comparison of the section (all blocks), the same family as the
  surge comparisons': the section's question is "does the clip method or the precision change
  the outcome". An adjusted p below :data:`analysis.dose.FWER` survives.

Where the issue was silent we chose [G]: avg@k, not greedy (the report's accuracy tables give
greedy too); the BF16-scored gain; one Holm family for the whole section (the surge
comparisons' family), fixed before the slip regime's sweep had finished.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.collect import Collection
from analysis.dose import FWER, comparison_pairs
from analysis.heldout_judgement import holm, paired_diff, values_by_key
from analysis.paired import run_gains
from analysis.pooling import finished
from fp8rl.runs import metrics as M

COLUMNS = ["algorithm", "model", "fp8", "clip", "arm", "against", "pairs", "gain", "ref_gain", "diff_mean",
           "diff_lo", "diff_hi", "t", "p", "p_holm", "survives"]


def seed_gains(coll: Collection) -> pd.DataFrame:
    """Per finished run: ``algorithm, model, fp8, clip, key`` (its seed) and ``gain`` (BF16-scored
    avg@k, last evaluation minus step 0, a fraction; module docstring)."""
    g = run_gains(finished(coll), stat=M.EVAL_AVG, precision=M.EVAL_BF16)
    return g.assign(key=g["seed"])[["algorithm", "model", "fp8", "clip", "key", "gain"]]


def _arm(gains: pd.DataFrame, r: pd.Series) -> pd.DataFrame:
    return gains[(gains["algorithm"] == r["algorithm"]) & (gains["model"] == r["model"])
                 & (gains["fp8"] == r["fp8"]) & (gains["clip"] == r["clip"])]


def accuracy_comparison_rows(coll: Collection, arms: pd.DataFrame) -> pd.DataFrame:
    """One row per comparison of :func:`analysis.dose.comparison_pairs` over ``arms``
    (:func:`analysis.dose.arm_rows`), columns :data:`COLUMNS`: ``pairs`` (seeds in both arms),
    ``gain, ref_gain`` (mean gain over those seeds, fractions), ``diff_mean, diff_lo, diff_hi``
    (arm - reference, 95% t interval), ``t, p`` (paired, two-sided; NaN below two pairs),
    ``p_holm`` (Holm over every row with a p), ``survives`` (``p_holm <`` FWER)."""
    gains = seed_gains(coll)
    rows = []
    for r, ref, against in comparison_pairs(arms):
        arm, reference = _arm(gains, r), _arm(gains, ref)
        a, b = values_by_key(arm, "gain"), values_by_key(reference, "gain")
        both = sorted(set(a) & set(b), key=str)
        rows.append({"algorithm": r["algorithm"], "model": r["model"], "fp8": r["fp8"], "clip": r["clip"],
                     "arm": r["arm"], "against": against, **paired_diff(arm, reference, "gain"),
                     "gain": float(np.mean([a[k] for k in both])) if both else math.nan,
                     "ref_gain": float(np.mean([b[k] for k in both])) if both else math.nan})
    df = pd.DataFrame(rows, columns=[c for c in COLUMNS if c not in ("p_holm", "survives")])
    df["p_holm"] = holm(df["p"].to_numpy(dtype=float)) if len(df) else []
    df["survives"] = np.isfinite(df["p_holm"].to_numpy(dtype=float)) & (df["p_holm"] < FWER)
    return df[COLUMNS]
