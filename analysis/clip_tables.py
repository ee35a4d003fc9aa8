"""The clip tables: what FP8 noise does at the lower clip bound, and what the controller does.

**Clip cells** (:func:`clip_cells_table`): per arm, the four clip-table fractions (A<0 / A>0
tokens below the lower / above the upper bound), mean over training and runs.
**Mechanism table** (:func:`mechanism_table`): per arm, ``actor/clipfrac_neg_low`` with its
spread over runs and relative to the block's BF16 arm, the ratio's q01 over A<0 tokens, the
rollout/trainer mismatch and the clip bounds in force at the end.
**Calibration table** (:func:`calibration_table`): the calibrated arms' alpha, the A<0 tokens
its estimate read, and the bounds (target, next, in force) at every calibration step.

Written like every table of :mod:`analysis.tables` (Markdown, LaTeX, CSV).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.arms import arm_label, arm_order_key, select, split_clip
from analysis.bf16_ratio import bf16_ratios
from analysis.collect import Collection
from analysis.counts import RATIOS, ci_columns, count_ratios, reference_text, run_counts
from analysis.tabulate import (
    Table,
    bf16_reference,
    blocks,
    finite,
    fmean,
    render_blocks,
    sample_std,
)
from fp8rl.runs import metrics as M

CLIP_CELLS: tuple[str, ...] = (M.ACTOR_CLIPFRAC_NEG_LOW, M.ACTOR_CLIPFRAC_NEG_HIGH,
                               M.ACTOR_CLIPFRAC_POS_LOW, M.ACTOR_CLIPFRAC_POS_HIGH)


def clip_cells_table(coll: Collection) -> pd.DataFrame:
    """Mean over training (all logged steps of all runs) of the four clip cells per arm.

    Rows: (algorithm, model, arm) in display order; columns: the ``actor/clipfrac_*`` cells
    (A<0 below low = gradient zeroed, the paper's signal; A<0 above high; A>0 below low; A>0
    above high). Cells no run logged are left out.
    """
    cols = [c for c in CLIP_CELLS if c in coll.steps.columns]
    if not cols:
        return pd.DataFrame()
    st = coll.steps
    df = st.groupby(["algorithm", "model", "fp8", "clip"], observed=True)[cols].mean().reset_index()
    df["arm"] = [arm_label(f, c) for f, c in zip(df["fp8"], df["clip"], strict=True)]
    df["_k"] = [arm_order_key(str(f), str(c)) for f, c in zip(df["fp8"], df["clip"], strict=True)]
    df = df.sort_values(["algorithm", "model", "_k"]).drop(columns=["_k", "fp8", "clip"])
    return df.set_index(["algorithm", "model", "arm"])[cols]


# --- the mechanism -----------------------------------------------------------------------

#: Per-run means over training that the mechanism table reports (besides the clip bounds).
MECHANISM_MEANS: tuple[str, ...] = (M.ACTOR_CLIPFRAC_NEG_LOW, M.ACTOR_RATIO_NEG_Q01, M.ROLLOUT_MISMATCH_KL)


def run_mechanism(coll: Collection) -> pd.DataFrame:
    """Per run: the mean over logged steps of each of :data:`MECHANISM_MEANS` (NaN where the run
    never logged it) and the last logged ``clip/low`` / ``clip/high``, plus axes and ``cell``."""
    rows = []
    for run, g in coll.steps.groupby("run", observed=True, sort=False):
        g = g.sort_values("step")
        row = {"run": str(run)}
        for name in MECHANISM_MEANS:
            row[name] = fmean(g[name]) if name in g.columns else math.nan
        for name in (M.CLIP_LOW, M.CLIP_HIGH):
            v = finite(g[name]) if name in g.columns else np.array([])
            row[f"{name}_final"] = float(v[-1]) if len(v) else math.nan
        rows.append(row)
    cols = ["run", *MECHANISM_MEANS, f"{M.CLIP_LOW}_final", f"{M.CLIP_HIGH}_final"]
    df = pd.DataFrame(rows, columns=cols)
    return df.merge(coll.runs[["run", "algorithm", "model", "fp8", "clip", "seed", "arm", "cell"]],
                    on="run", how="left")


def _ci_columns(ci, *, is_ref: bool) -> dict:
    """The mechanism table's interval columns of one arm (``ci``: a ``RatioCI`` or None)."""
    if ci is None:
        return {"x_bf16_lo": math.nan, "x_bf16_hi": math.nan, "x_bf16_boot_lo": math.nan,
                "x_bf16_boot_hi": math.nan, "x_bf16_paired": False, "x_bf16_ci": "reference" if is_ref else ""}
    text = ci.interval_text()
    return {"x_bf16_lo": ci.lo, "x_bf16_hi": ci.hi, "x_bf16_boot_lo": ci.boot_lo, "x_bf16_boot_hi": ci.boot_hi,
            "x_bf16_paired": ci.paired,
            "x_bf16_ci": text + (" unpaired" if text.startswith("[") and not ci.paired else "")}


def mechanism_table(coll: Collection, *, name: str = "mechanism") -> Table:
    """The paper's mechanism per arm: how many negative-advantage tokens fall below the lower
    clip bound (gradient zeroed), relative to BF16, and what drives it.

    Per (algorithm, model, arm), over every run of ``coll`` that logged metrics (the report passes
    the finished runs only, ``analysis.pooling.finished``, so an unfinished run never moves
    x BF16): ``actor/clipfrac_neg_low`` averaged over a run's steps, then mean ± std
    (ddof=1) over runs; ``x_bf16`` = that mean over the block's BF16 reference arm's mean
    (``bf16`` + ``vanilla`` if the block has it, else its first ``bf16`` arm; NaN without
    one) with its 95% interval over seeds (``x_bf16_lo`` / ``x_bf16_hi``: Fieller's, paired by
    (sweep, seed) where the two arms hold the same seeds, :mod:`analysis.bf16_ratio`;
    ``x_bf16_boot_lo`` / ``_hi`` the percentile bootstrap; ``x_bf16_ci`` the interval as text,
    "n/a (1 seed)" without one);
    the run-mean ``actor/ratio_neg_q01`` and ``rollout/mismatch_kl`` and the last
    ``clip/low`` / ``clip/high`` in force, each a mean over runs. Beside the fraction, the same
    ratio of counts (:mod:`analysis.counts`): ``count_x_bf16*`` of the A<0 tokens below the lower
    bound (``actor/n_neg_low`` per step) and ``n_neg_x_bf16*`` of the A<0 tokens
    (``actor/n_neg``), with their intervals; "n/a (not logged)" for runs from before the counts.
    """
    per_run = run_mechanism(coll)
    cnl = M.ACTOR_CLIPFRAC_NEG_LOW
    cis = bf16_ratios(coll, per_run, cnl)
    per_count = run_counts(coll)
    counts = count_ratios(coll, per_count)
    rows = []
    for algo, model, arms in blocks(coll):
        ref = bf16_reference(arms)
        ref_mean = fmean(select(per_run, algo, model, *ref)[cnl]) if ref is not None else math.nan
        for arm in arms:
            r = select(per_run, algo, model, *arm)
            v = finite(r[cnl])
            mean = fmean(v)
            row = {"algorithm": algo, "model": model, "arm": arm_label(*arm), "fp8": arm[0], "clip": arm[1],
                   "runs": len(r), "clipfrac_neg_low_mean": mean, "clipfrac_neg_low_std": sample_std(v),
                   "x_bf16": mean / ref_mean if ref_mean > 0 else math.nan,
                   "bf16_reference": arm_label(*ref) if ref is not None else ""}
            is_ref = ref is not None and arm == ref
            row.update(_ci_columns(cis.get((algo, model, *arm)), is_ref=is_ref))
            for key, prefix in (("count", "count_x_bf16"), ("n_neg", "n_neg_x_bf16")):
                row.update(ci_columns(prefix, counts[key].get((algo, model, *arm))))
                if is_ref:
                    row[f"{prefix}_text"] = reference_text(per_count, algo, model, ref, RATIOS[key])
            for c, key in ((M.ACTOR_RATIO_NEG_Q01, "ratio_neg_q01"), (M.ROLLOUT_MISMATCH_KL, "mismatch_kl"),
                           (f"{M.CLIP_LOW}_final", "clip_low_final"), (f"{M.CLIP_HIGH}_final", "clip_high_final")):
                row[key] = fmean(r[c])
            rows.append(row)
    df = pd.DataFrame(rows, columns=["algorithm", "model", "arm", "fp8", "clip", "runs",
                                     "clipfrac_neg_low_mean", "clipfrac_neg_low_std", "x_bf16",
                                     "x_bf16_lo", "x_bf16_hi", "x_bf16_boot_lo", "x_bf16_boot_hi",
                                     "x_bf16_paired", "x_bf16_ci", "bf16_reference", "ratio_neg_q01",
                                     "mismatch_kl", "clip_low_final", "clip_high_final",
                                     *ci_columns("count_x_bf16", None), *ci_columns("n_neg_x_bf16", None)])
    header = ["Arm", "runs", "A<0 below low (%)", "x BF16", "95% CI", "count below low x BF16 (95% CI)",
              "A<0 tokens x BF16 (95% CI)", "ratio q01 (A<0)", "mismatch KL", "final low / high"]

    def cells(r, latex: bool) -> list[str]:
        def f(x, fmt):
            return "n/a" if not np.isfinite(x) else format(x, fmt)
        pm = " ± "
        c = f(100 * r["clipfrac_neg_low_mean"], ".3f")
        if np.isfinite(r["clipfrac_neg_low_std"]):
            c += pm + f(100 * r["clipfrac_neg_low_std"], ".3f")
        return [r["arm"], str(r["runs"]), c, f(r["x_bf16"], ".2f"),
                r["x_bf16_ci"], r["count_x_bf16_text"], r["n_neg_x_bf16_text"],
                f(r["ratio_neg_q01"], ".3f"), f(r["mismatch_kl"], ".2e"),
                f"{f(r['clip_low_final'], '.3f')} / {f(r['clip_high_final'], '.3f')}"]

    def caption(algo, model, g):
        ref = g["bf16_reference"].iloc[0] or "none in this block"
        return (f"A<0 tokens below the lower clip bound, mean over training (± std over runs); "
                f"x BF16 relative to {ref}")

    md, tex = render_blocks(df, header, cells, caption)
    md.append("Per run: means over logged steps (`actor/clipfrac_neg_low`, `actor/ratio_neg_q01`, "
              "`rollout/mismatch_kl`) and the last `clip/low` / `clip/high`; then mean over runs. "
              "x BF16 = mean over the arm's runs / mean over the BF16 arm's runs; 95% CI: Fieller's "
              "interval with Student's t over seeds, paired by seed (same sweep) where both arms "
              "have the same seeds, else marked unpaired (docs/analysis.md). Count x BF16: the same ratio "
              "and interval of the A<0 tokens below the lower bound per step (`actor/n_neg_low`; "
              "the fraction's numerator), A<0 tokens x BF16 of its denominator (`actor/n_neg`); "
              "n/a (not logged) for runs from before the counts.")
    return Table.from_lines(name, df, md, tex)


# --- calibration over time ---------------------------------------------------------------

CALIBRATION_METRICS: tuple[str, ...] = (M.CLIP_ALPHA, M.SHADOW_CLIPFRAC_NEG_LOW, M.CLIP_LOW, M.CLIP_HIGH,
                                        M.ACTOR_CLIPFRAC_NEG_LOW)
#: Logged on calibration steps by the mini backend: the controller's bounds before smoothing, the
#: bounds it sets for the next step, the A<0 tokens its estimate read and whether alpha n < 5.
CLIP_LOW_RAW, CLIP_HIGH_RAW = "clip/low_raw", "clip/high_raw"
CLIP_LOW_NEXT, CLIP_HIGH_NEXT = "clip/low_next", "clip/high_next"
CLIP_N_NEG, CLIP_LOW_DATA = "clip/n_neg", "clip/low_data"
CALIBRATION_EXTRA: tuple[str, ...] = (CLIP_LOW_RAW, CLIP_HIGH_RAW, CLIP_LOW_NEXT, CLIP_HIGH_NEXT, CLIP_N_NEG,
                                      CLIP_LOW_DATA)


def calibration_table(coll: Collection, *, name: str = "calibration") -> Table:
    """What the calibrated arms' controller did, step by step.

    For every calibrated arm (clip method ``calibrated``, any variant) and every step at which
    any of its runs logged ``shadow/clipfrac_neg_low`` (a calibration step: the BF16 shadow runs
    only then; for a backend that logs no shadow metric, ``clip/alpha`` marks them), plus the
    arm's first and last logged steps: the mean over runs of ``clip/alpha`` (the BF16 shadow's
    fraction of A<0 tokens below 1 - eps_low), the A<0 tokens the estimate read
    (``clip/n_neg``) and the fraction of runs whose estimate rests on alpha n < 5 tokens
    (``clip/low_data``), the controller's target bounds before smoothing (``clip/low_raw``,
    ``clip/high_raw``) and the bounds it set for the next step (``clip/low_next``,
    ``clip/high_next``) where logged, the bounds in force during the step (``clip/low``,
    ``clip/high``) and its FP8 ``actor/clipfrac_neg_low``. ``shadow_share`` is the arm's time in
    the BF16 shadow over its total step time (``perf/shadow_s`` / ``perf/step_s``, all steps of
    all runs). Empty (with a sentence saying so) when no arm is calibrated.
    """
    st = coll.steps
    rows = []
    for algo, model, arms in blocks(coll):
        for fp8, clip in arms:
            if split_clip(clip)[0] != "calibrated":
                continue
            g = select(st, algo, model, fp8, clip)
            if g.empty:
                continue
            steps = set(g["step"].astype(int))
            marker = next((m for m in (M.SHADOW_CLIPFRAC_NEG_LOW, M.CLIP_ALPHA) if m in g.columns), None)
            cal = set(g.loc[g[marker].notna(), "step"].astype(int)) if marker else set()
            share = (float(g[M.PERF_SHADOW_S].sum()) / float(g[M.PERF_STEP_S].sum())
                     if {M.PERF_SHADOW_S, M.PERF_STEP_S} <= set(g.columns) and g[M.PERF_STEP_S].sum() > 0
                     else math.nan)
            for step in sorted(cal | {min(steps), max(steps)}):
                at = g[g["step"] == step]
                row = {"algorithm": algo, "model": model, "arm": arm_label(fp8, clip), "fp8": fp8,
                       "clip": clip, "step": step, "calibration": step in cal, "runs": at["run"].nunique(),
                       "shadow_share": share}
                for m in (*CALIBRATION_METRICS, *CALIBRATION_EXTRA):
                    row[m] = fmean(at[m]) if m in at.columns else math.nan
                rows.append(row)
    cols = ["algorithm", "model", "arm", "fp8", "clip", "step", "calibration", "runs", *CALIBRATION_METRICS,
            *CALIBRATION_EXTRA, "shadow_share"]
    df = pd.DataFrame(rows, columns=cols)
    header = ["Arm", "step", "runs", "alpha (%)", "A<0 tokens read", "alpha n < 5", "L / H target",
              "L / H next", "L / H in force", "FP8 A<0 below L (%)", "shadow time (%)"]

    def cells(r, latex: bool) -> list[str]:
        def f(x, fmt):
            return "" if not np.isfinite(x) else format(x, fmt)

        def pair(lo, hi):
            return f"{f(r[lo], '.4f')} / {f(r[hi], '.4f')}" if r["calibration"] and np.isfinite(r[lo]) else ""
        step = f"{r['step']}{'' if r['calibration'] else ' (not a calibration step)'}"
        return [r["arm"], step, str(r["runs"]),
                f(100 * r[M.CLIP_ALPHA], ".3f"), f(r[CLIP_N_NEG], ".0f") if r["calibration"] else "",
                f(r[CLIP_LOW_DATA], ".2f") if r["calibration"] else "",
                pair(CLIP_LOW_RAW, CLIP_HIGH_RAW), pair(CLIP_LOW_NEXT, CLIP_HIGH_NEXT),
                f"{f(r[M.CLIP_LOW], '.4f')} / {f(r[M.CLIP_HIGH], '.4f')}",
                f(100 * r[M.ACTOR_CLIPFRAC_NEG_LOW], ".3f"), f(100 * r["shadow_share"], ".1f")]

    md, tex = render_blocks(df, header, cells, lambda a, m, g: (
        "the controller at each calibration step (mean over runs): alpha = the BF16 shadow's share "
        "of A<0 tokens below 1 - eps_low; 'alpha n < 5' = share of runs whose lower bound rests on "
        "fewer than five tokens; 'next' = the bounds set for the following steps (after EMA); "
        "'in force' = the bounds of this step's updates; shadow time = the arm's BF16 shadow time "
        "over its step time, whole runs"))
    return Table.from_lines(name, df, md, tex, empty="No calibrated arm in these sweeps.")
