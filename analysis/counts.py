"""The counts behind the clip fraction: token counts relative to BF16, and S.

A run logs per step ``actor/n_neg`` (its A<0 response tokens) and ``actor/n_neg_low`` (those whose
ratio is below the lower bound in force; ``actor/clipfrac_neg_low`` is the second over the first).
The fraction's ratio to BF16 (the mechanism and half-width tables) hides how many A<0 tokens each
arm makes; the count ratio does not. Per run (:func:`run_counts`):

- ``n_neg_low``, ``n_neg``: the mean over its logged steps of the count, i.e. the sum over the run
  divided by the steps it logged. For runs of one length (the finished runs of a sweep) the ratio
  of means over seeds and its interval are exactly those of the sums over the run (Fieller's
  interval does not change when x and y are scaled by one constant); a run that stopped early
  counts at its own rate instead of looking small. ``*_total`` are the sums.
- ``own_shadow``: the mean per measured step of ``shadow/low_bf16_n``, the A<0 tokens the run's own
  BF16 shadow puts below 1 - eps_low (logged by every arm that runs the shadow diagnostics,
  ``clip.shadow_diagnostics``, and by calibrated arms on their measured steps): what a BF16 policy
  at this run's weights would clip.

**S** (:func:`count_ratios`, key ``"s"``) = mean over the arm's runs of ``own_shadow`` / mean over
the block's BF16 reference arm's runs of its clipped A<0 tokens per step. For a BF16 run the two
are the same count (its shadow is itself); where a BF16 run that does not calibrate logged no
shadow counts, its ``actor/n_neg_low`` per step stands in (it clips below 1 - eps_low, as its
shadow would). Per-step means, not sums, because a ``periodic`` arm is measured on a fraction of
the steps its BF16 reference is. Under ``same_batch`` with the ``in_sample`` lower estimator FP8
clips as many A<0 tokens of each mini-batch as the run's own shadow, so the calibrated arm's count
/ BF16 is S by construction; S of the vanilla and TIS arms, which never calibrate, says what that
number is without any calibration.

The three ratios use the pairing by (sweep, seed) and Fieller's interval of
:mod:`analysis.bf16_ratio`. A run that did not log a key (published before it existed) is NaN for
it, and an arm or reference without any such run shows "n/a (not logged)": never a number
computed from something else.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.arms import select, split_clip
from analysis.bf16_ratio import Arm, bf16_ratios
from analysis.collect import Collection
from analysis.ratio_ci import RatioCI
from fp8rl.runs import metrics as M

#: Per-run column -> the per-step metric it is the mean of.
COUNT_METRICS: dict[str, str] = {"n_neg_low": M.ACTOR_N_NEG_LOW, "n_neg": M.ACTOR_N_NEG,
                                 "own_shadow": M.SHADOW_LOW_BF16_N}
#: :func:`count_ratios`' keys -> the per-run column of :func:`run_counts` they are ratios of.
RATIOS: dict[str, str] = {"count": "n_neg_low", "n_neg": "n_neg", "s": "s_value"}
NOT_LOGGED = "n/a (not logged)"


def run_counts(coll: Collection) -> pd.DataFrame:
    """One row per run that logged steps.

    Columns: ``run, algorithm, model, fp8, clip``; for c in :data:`COUNT_METRICS` the per-step
    mean ``c`` (NaN where the run never logged it), the sum ``{c}_total`` and the number of steps
    that logged it ``{c}_steps``; ``s_value``, the run's side of S: ``own_shadow``, else for a BF16
    run that does not calibrate its ``n_neg_low`` (see the module docstring).
    """
    cols = ["run", "algorithm", "model", "fp8", "clip"]
    for c in COUNT_METRICS:
        cols += [c, f"{c}_total", f"{c}_steps"]
    cols.append("s_value")
    st = coll.steps
    if not len(st):
        return pd.DataFrame(columns=cols)
    present = {c: m for c, m in COUNT_METRICS.items() if m in st.columns}
    vals = st[list(present.values())].astype(float)
    vals.insert(0, "run", st["run"].astype(str).to_numpy())
    g = vals.groupby("run", sort=False)
    df = pd.DataFrame({"run": pd.unique(vals["run"])})
    mean, total, n = (x.reindex(df["run"]) for x in (g.mean(), g.sum(min_count=1), g.count()))
    for c in COUNT_METRICS:
        m = present.get(c)
        df[c] = mean[m].to_numpy(dtype=float) if m else math.nan
        df[f"{c}_total"] = total[m].to_numpy(dtype=float) if m else math.nan
        df[f"{c}_steps"] = n[m].to_numpy(dtype=int) if m else 0
    axes = coll.runs[["run", "algorithm", "model", "fp8", "clip"]].astype({"run": str})
    df = df.merge(axes, on="run", how="left")
    stand_in = [(f == "bf16") and split_clip(str(c))[0] != "calibrated" for f, c in zip(df["fp8"], df["clip"],
                                                                                       strict=True)]
    df["s_value"] = np.where(np.isfinite(df["own_shadow"].to_numpy(dtype=float)), df["own_shadow"],
                             np.where(stand_in, df["n_neg_low"], math.nan)).astype(float)
    return df[cols]


def count_ratios(coll: Collection, per_run: pd.DataFrame | None = None) -> dict[str, dict[Arm, RatioCI]]:
    """{"count" | "n_neg" | "s": {(algorithm, model, fp8, clip): RatioCI against the block's BF16
    arm}} (:data:`RATIOS`; every non-reference arm of a block with a BF16 arm)."""
    pr = run_counts(coll) if per_run is None else per_run
    return {k: bf16_ratios(coll, pr, col) for k, col in RATIOS.items()}


def reference_text(per_run: pd.DataFrame, algo: str, model: str, ref: tuple[str, str], column: str) -> str:
    """The BF16 reference arm's own cell: "reference" where any of its runs has ``column``,
    else :data:`NOT_LOGGED` (no ratio against it could be computed)."""
    r = select(per_run, algo, model, *ref)
    return "reference" if len(r) and np.isfinite(r[column].to_numpy(dtype=float)).any() else NOT_LOGGED


def ratio_text(ci: RatioCI | None, fmt: str = ".2f") -> str:
    """One cell: ``"1.18 [1.05, 1.33]"`` (``unpaired`` appended where the seeds did not pair),
    ``"1.18, n/a (1 seed)"``, ``"1.18 (CI unbounded)"``, :data:`NOT_LOGGED` when the arm or its
    reference has no run with the value, "" for no ratio at all (``ci`` None)."""
    if ci is None:
        return ""
    if ci.n_x == 0 or ci.n_y == 0:
        return NOT_LOGGED
    est = format(ci.estimate, fmt) if np.isfinite(ci.estimate) else "n/a"
    if ci.note:
        return f"{est}, {ci.note}"
    if not (np.isfinite(ci.lo) and np.isfinite(ci.hi)):
        return f"{est} (CI unbounded)"
    return f"{est} {ci.interval_text(fmt)}" + ("" if ci.paired else " unpaired")


def ci_columns(prefix: str, ci: RatioCI | None) -> dict:
    """A ratio's tidy columns for a table's CSV: ``{prefix}``, ``_lo``, ``_hi``, ``_boot_lo``,
    ``_boot_hi``, ``_n_x``, ``_n_y``, ``_paired``, ``_text`` (:func:`ratio_text`)."""
    if ci is None:
        return {prefix: math.nan, f"{prefix}_lo": math.nan, f"{prefix}_hi": math.nan,
                f"{prefix}_boot_lo": math.nan, f"{prefix}_boot_hi": math.nan, f"{prefix}_n_x": 0,
                f"{prefix}_n_y": 0, f"{prefix}_paired": False, f"{prefix}_text": ""}
    return {prefix: ci.estimate, f"{prefix}_lo": ci.lo, f"{prefix}_hi": ci.hi, f"{prefix}_boot_lo": ci.boot_lo,
            f"{prefix}_boot_hi": ci.boot_hi, f"{prefix}_n_x": ci.n_x, f"{prefix}_n_y": ci.n_y,
            f"{prefix}_paired": ci.paired, f"{prefix}_text": ratio_text(ci)}
