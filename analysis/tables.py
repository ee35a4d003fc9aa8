"""The paper's tables, regenerated from a :class:`analysis.collect.Collection`.

**Accuracy table** (paper layout): one block per (algorithm, model), rows = arms, columns =
evaluation sets (``avg@k`` by default, in percent) and their ``Average``. A cell is the mean
over the seeds of that arm's *finished* runs (``cell == "ok"``; a run's final evaluation per
``analysis.collect.final_evals``), shown as ``mean ± std`` (sample std, ddof=1) when there are
two or more seeds. The best mean per column within a block is marked (Markdown ``**bold**``,
LaTeX ``\\textbf``, CSV ``best=True``; ties are all marked). A cell without any finished run is
shown as ``n/a†`` with a footnote; a cell averaged over fewer seeds than the manifest asked for
carries ``‡`` and a footnote (the report lists which cells are missing, FAILED or incomplete).
A run's ``Average`` is the mean over the block's evaluation sets and exists only if the run
has all of them.

**Diagnostics table**: per (algorithm, model, arm), over the runs that logged metrics (finished
or not, since a surging run may well have FAILED): final entropy (mean of a run's last 5% of
logged steps, at least one), peak entropy (max of the EMA-smoothed curve), surges
(``surged/runs``, rule of ``analysis.surge``) and the median onset step, mean
``actor/clipfrac_neg_low`` over training, and the final garbled fraction (last 5%, as for
entropy). Each number is a mean over runs.

**Trajectory table** (:func:`trajectory_table`): entropy, garbled fraction and evaluation at the
start versus the end of training. The mechanism and calibration tables are in
:mod:`analysis.clip_tables`, the paired accuracy gains in :mod:`analysis.paired`, the rendering
they share in :mod:`analysis.tabulate`.

All tables are written as Markdown, LaTeX (booktabs: ``\\toprule``/``\\midrule``/
``\\bottomrule``; needs ``\\usepackage{booktabs}``) and a tidy CSV.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.arms import arm_label, select
from analysis.collect import CELL_OK, Collection, final_evals
from analysis.evals import select_evals
from analysis.surge import SurgeRule, ema, surge_onset
from analysis.tabulate import (
    Table,
    blocks,
    finite,
    fmean,
    latex_escape,
    render_blocks,
    sample_std,
)
from fp8rl.runs import metrics as M

#: Known evaluation sets in the paper's column order; others follow alphabetically.
DATASET_ORDER: tuple[str, ...] = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")
DATASET_LABELS: dict[str, str] = {
    "aime24": "AIME24", "aime25": "AIME25", "amc23": "AMC23", "math500": "MATH-500",
    "minerva": "Minerva", "olympiadbench": "OlympiadBench",
}
AVERAGE = "Average"
MISSING_MARK = "†"
PARTIAL_MARK = "‡"
FINAL_FRACTION = 0.05


def _dataset_key(ds: str) -> tuple:
    return (0, DATASET_ORDER.index(ds), "") if ds in DATASET_ORDER else (1, 0, ds)


def accuracy_table(coll: Collection, *, stat: str = M.EVAL_AVG, percent: bool = True,
                   decimals: int = 1, name: str = "accuracy", precision: str = M.EVAL_OWN) -> Table:
    """The accuracy table (see the module docstring) of the arm's own engine, or with
    ``precision="bf16"`` of the BF16 engine that scored the same weights (``eval_bf16/``)."""
    fe = final_evals(coll, stat, precision=precision)
    scale = 100.0 if percent else 1.0
    expected = coll.runs.groupby(["algorithm", "model", "fp8", "clip"], dropna=True).size()
    rows = []
    for algo, model, arms in blocks(coll):
        blk = select(fe, algo, model)
        datasets = sorted(blk["dataset"].unique().tolist(), key=_dataset_key)
        for fp8, clip in arms:
            a = select(blk, algo, model, fp8, clip)
            n_exp = int(expected.get((algo, model, fp8, clip), 0))
            per_run = a.pivot_table(index="run", columns="dataset", values="value", aggfunc="last")
            for ds in [*datasets, AVERAGE]:
                if ds == AVERAGE:
                    vals = (per_run[datasets].dropna().mean(axis=1).to_numpy()
                            if datasets and set(datasets) <= set(per_run.columns) else np.array([]))
                else:
                    vals = per_run[ds].dropna().to_numpy() if ds in per_run.columns else np.array([])
                vals = vals.astype(float) * scale
                rows.append({
                    "algorithm": algo, "model": model, "arm": arm_label(fp8, clip), "fp8": fp8,
                    "clip": clip, "dataset": ds, "stat": stat,
                    "mean": float(np.mean(vals)) if len(vals) else math.nan,
                    "std": sample_std(vals), "n": len(vals), "n_expected": n_exp,
                })
    df = pd.DataFrame(rows, columns=["algorithm", "model", "arm", "fp8", "clip", "dataset", "stat",
                                     "mean", "std", "n", "n_expected"])
    df["missing"] = df["n"] == 0
    df["partial"] = (df["n"] > 0) & (df["n"] < df["n_expected"])
    best = df.groupby(["algorithm", "model", "dataset"])["mean"].transform("max")
    df["best"] = (~df["missing"]) & np.isclose(df["mean"], best, rtol=0, atol=1e-12)
    label = stat if precision == M.EVAL_OWN else f"{stat} by a BF16 engine"
    return Table(name, df, _acc_markdown(df, decimals, label, percent), _acc_latex(df, decimals, label, percent))


def _cell_text(r, decimals: int, latex: bool) -> str:
    if r["missing"]:
        return "n/a$^\\dagger$" if latex else f"n/a{MISSING_MARK}"
    s = f"{r['mean']:.{decimals}f}"
    if r["n"] >= 2:
        s += (f" {{\\scriptsize $\\pm$ {r['std']:.{decimals}f}}}" if latex else f" ± {r['std']:.{decimals}f}")
    if r["best"]:
        s = f"\\textbf{{{s}}}" if latex else f"**{s}**"
    if r["partial"]:
        s += "$^\\ddagger$" if latex else PARTIAL_MARK
    return s


def _footnotes(df: pd.DataFrame, latex: bool) -> list[str]:
    notes = []
    if df["missing"].any():
        notes.append(("$^\\dagger$" if latex else MISSING_MARK)
                     + " no finished run for this cell (missing, FAILED or incomplete: see report.md).")
    if df["partial"].any():
        notes.append(("$^\\ddagger$" if latex else PARTIAL_MARK)
                     + " fewer finished seeds than the sweep asked for (see report.md).")
    return notes


def _col_label(ds: str) -> str:
    return DATASET_LABELS.get(ds, ds)


def _acc_markdown(df: pd.DataFrame, decimals: int, stat: str, percent: bool) -> str:
    out = []
    unit = " (%)" if percent else ""
    for (algo, model), g in df.groupby(["algorithm", "model"], sort=False):
        cols = list(dict.fromkeys(g["dataset"]))
        out.append(f"**{algo.upper()} · {model}** — {stat}{unit}, mean ± std over seeds\n")
        out.append("| Arm | " + " | ".join(_col_label(c) for c in cols) + " |")
        out.append("|---|" + "---:|" * len(cols))
        for arm, ga in g.groupby("arm", sort=False):
            cells = {r["dataset"]: _cell_text(r, decimals, False) for _, r in ga.iterrows()}
            out.append(f"| {arm} | " + " | ".join(cells[c] for c in cols) + " |")
        out.append("")
    out.extend(_footnotes(df, False))
    return "\n".join(out).rstrip() + "\n"


def _acc_latex(df: pd.DataFrame, decimals: int, stat: str, percent: bool) -> str:
    out = []
    for (algo, model), g in df.groupby(["algorithm", "model"], sort=False):
        cols = list(dict.fromkeys(g["dataset"]))
        out.append("\\begin{tabular}{l" + "r" * len(cols) + "}")
        out.append("\\toprule")
        unit = ", \\%" if percent else ""
        title = latex_escape(f"{algo.upper()} · {model} ({stat}")
        out.append(f"\\multicolumn{{{len(cols) + 1}}}{{l}}{{{title}{unit})}} \\\\")
        out.append("\\midrule")
        out.append("Arm & " + " & ".join(latex_escape(_col_label(c)) for c in cols) + " \\\\")
        out.append("\\midrule")
        for arm, ga in g.groupby("arm", sort=False):
            cells = {r["dataset"]: _cell_text(r, decimals, True) for _, r in ga.iterrows()}
            out.append(latex_escape(arm) + " & " + " & ".join(cells[c] for c in cols) + " \\\\")
        out.append("\\bottomrule")
        out.append("\\end{tabular}")
        out.append("")
    for n in _footnotes(df, True):
        out.append(f"\\par\\footnotesize {n}")
    return "\n".join(out).rstrip() + "\n"


# --- diagnostics -------------------------------------------------------------------------


def run_diagnostics(coll: Collection, rule: SurgeRule = SurgeRule()) -> pd.DataFrame:  # noqa: B008
    """Per-run end-of-training diagnostics: ``run, final_entropy, peak_entropy, surge_step,
    mean_clipfrac_neg_low, final_garbled_frac`` plus axes and ``cell``."""
    st = coll.steps
    rows = []
    for run, g in st.groupby("run", observed=True, sort=False):
        g = g.sort_values("step")
        tail = max(1, math.ceil(FINAL_FRACTION * len(g)))

        def col(name, g=g):
            return g[name].to_numpy(dtype=float) if name in g.columns else np.full(len(g), np.nan)

        ent = col(M.ACTOR_ENTROPY)
        fin = ent[np.isfinite(ent)]
        smooth = ema(fin, rule.span) if len(fin) else fin
        garb = col(M.ROLLOUT_GARBLED_FRAC)
        garb_fin = garb[np.isfinite(garb)]
        cnl = col(M.ACTOR_CLIPFRAC_NEG_LOW)
        rows.append({
            "run": str(run),
            "final_entropy": float(np.mean(fin[-tail:])) if len(fin) else math.nan,
            "peak_entropy": float(np.max(smooth)) if len(smooth) else math.nan,
            "surge_step": surge_onset(g["step"].to_numpy(), ent, rule),
            "mean_clipfrac_neg_low": float(np.nanmean(cnl)) if np.isfinite(cnl).any() else math.nan,
            "final_garbled_frac": float(np.mean(garb_fin[-tail:])) if len(garb_fin) else math.nan,
        })
    df = pd.DataFrame(rows, columns=["run", "final_entropy", "peak_entropy", "surge_step",
                                     "mean_clipfrac_neg_low", "final_garbled_frac"])
    df["surge_step"] = df["surge_step"].astype("Int64")
    return df.merge(coll.runs[["run", "algorithm", "model", "fp8", "clip", "seed", "arm", "cell"]],
                    on="run", how="left")


def diagnostics_table(coll: Collection, rule: SurgeRule = SurgeRule(), *, decimals: int = 3,  # noqa: B008
                      name: str = "diagnostics") -> Table:
    """End-of-training diagnostics per arm (see the module docstring)."""
    per_run = run_diagnostics(coll, rule)
    rows = []
    for algo, model, arms in blocks(coll):
        for fp8, clip in arms:
            r = select(per_run, algo, model, fp8, clip)
            n_cells = int(((coll.runs["algorithm"] == algo) & (coll.runs["model"] == model)
                           & (coll.runs["fp8"] == fp8) & (coll.runs["clip"] == clip)).sum())
            onsets = r["surge_step"].dropna().to_numpy(dtype=float)

            def m(c, r=r):
                return fmean(r[c])

            rows.append({
                "algorithm": algo, "model": model, "arm": arm_label(fp8, clip), "fp8": fp8, "clip": clip,
                "runs": len(r), "finished": int((r["cell"] == CELL_OK).sum()), "cells": n_cells,
                "final_entropy": m("final_entropy"), "peak_entropy": m("peak_entropy"),
                "surged": len(onsets),
                "surge_step_median": float(np.median(onsets)) if len(onsets) else math.nan,
                "mean_clipfrac_neg_low": m("mean_clipfrac_neg_low"),
                "final_garbled_frac": m("final_garbled_frac"),
            })
    df = pd.DataFrame(rows)
    header = ["Arm", "runs (finished/cells)", "final entropy", "peak entropy", "surges (onset)",
              "mean clipfrac_neg_low", "final garbled frac"]

    def cells(r, latex: bool) -> list[str]:
        def f(x, d=decimals):
            return "n/a" if not np.isfinite(x) else f"{x:.{d}f}"
        onset = ("" if not r["surged"] else f" (step {r['surge_step_median']:.0f})")
        return [r["arm"],
                f"{r['runs']} ({r['finished']}/{r['cells']})", f(r["final_entropy"]),
                f(r["peak_entropy"]), f"{r['surged']}/{r['runs']}{onset}",
                f(r["mean_clipfrac_neg_low"], 4), f(r["final_garbled_frac"])]

    md, tex = render_blocks(df, header, cells, lambda a, m, g: "end-of-training diagnostics (mean over runs)")
    md.append(f"Surge rule: {rule.describe()}. Runs include unfinished ones (a surging run may fail); "
              f"'final' = mean over the last {FINAL_FRACTION:.0%} of logged steps.")
    tex.append(f"% Surge rule: {rule.describe()}.")
    return Table.from_lines(name, df, md, tex)


# --- trajectory: start vs end ------------------------------------------------------------

TRAJECTORY_WINDOW = 0.25


def window_mean(values, part: str, fraction: float = TRAJECTORY_WINDOW) -> float:
    """Mean of the finite ``values`` [n logged steps, in step order] over the ``part`` ("first" or
    "last") ``fraction`` of the logged steps, at least one (NaN when none of them is finite)."""
    v = np.asarray(values, dtype=float)
    w = max(1, math.ceil(fraction * len(v)))
    return fmean(v[:w] if part == "first" else v[-w:])


def trajectory_table(coll: Collection, *, stat: str = M.EVAL_AVG, name: str = "trajectory") -> Table:
    """Start versus end of training per arm: did entropy, garbling or accuracy move?

    Per run (every run that logged metrics): mean ``actor/entropy`` and ``rollout/garbled_frac``
    over the first and the last quarter of its logged steps (at least one step each), the max
    of ``actor/entropy`` over all steps, and the evaluation ``stat`` (mean over datasets) at the
    first and the last evaluation. Per arm: mean and sample std (ddof=1) over runs.
    """
    st = coll.steps
    ev = select_evals(coll.evals, stat)
    per_run = []
    for run, g in st.groupby("run", observed=True, sort=False):
        g = g.sort_values("step")

        def win(m, part, g=g):
            return window_mean(g[m].to_numpy(dtype=float), part) if m in g.columns else math.nan

        ent = finite(g[M.ACTOR_ENTROPY]) if M.ACTOR_ENTROPY in g.columns else np.array([])
        e = ev[ev["run"] == run] if len(ev) else ev
        by_step = e.groupby("step")["value"].mean().sort_index() if len(e) else pd.Series(dtype=float)
        per_run.append({
            "run": str(run),
            "entropy_first": win(M.ACTOR_ENTROPY, "first"), "entropy_last": win(M.ACTOR_ENTROPY, "last"),
            "entropy_max": float(ent.max()) if len(ent) else math.nan,
            "garbled_first": win(M.ROLLOUT_GARBLED_FRAC, "first"),
            "garbled_last": win(M.ROLLOUT_GARBLED_FRAC, "last"),
            "eval_first": float(by_step.iloc[0]) if len(by_step) else math.nan,
            "eval_last": float(by_step.iloc[-1]) if len(by_step) else math.nan,
        })
    keys = ["entropy_first", "entropy_last", "entropy_max", "garbled_first", "garbled_last",
            "eval_first", "eval_last"]
    pr = pd.DataFrame(per_run, columns=["run", *keys]).merge(
        coll.runs[["run", "algorithm", "model", "fp8", "clip"]], on="run", how="left")
    rows = []
    for algo, model, arms in blocks(coll):
        for fp8, clip in arms:
            r = select(pr, algo, model, fp8, clip)
            row = {"algorithm": algo, "model": model, "arm": arm_label(fp8, clip), "fp8": fp8, "clip": clip,
                   "runs": len(r)}
            for k in keys:
                v = finite(r[k])
                row[f"{k}_mean"] = fmean(v)
                row[f"{k}_std"] = sample_std(v)
            rows.append(row)
    cols = ["algorithm", "model", "arm", "fp8", "clip", "runs"] + [f"{k}_{s}" for k in keys for s in ("mean", "std")]
    df = pd.DataFrame(rows, columns=cols)
    header = ["Arm", "runs", "entropy first → last", "entropy max", "garbled % first → last",
              f"eval {stat} % first → last"]

    def ms(r, k, scale, fmt, latex):
        m, s = r[f"{k}_mean"] * scale, r[f"{k}_std"] * scale
        if not np.isfinite(m):
            return "n/a"
        pm = " ± "
        return format(m, fmt) + (pm + format(s, fmt) if np.isfinite(s) else "")

    def cells(r, latex: bool) -> list[str]:
        arrow = " → "
        return [r["arm"], str(r["runs"]),
                ms(r, "entropy_first", 1, ".3f", latex) + arrow + ms(r, "entropy_last", 1, ".3f", latex),
                ms(r, "entropy_max", 1, ".3f", latex),
                ms(r, "garbled_first", 100, ".2f", latex) + arrow + ms(r, "garbled_last", 100, ".2f", latex),
                ms(r, "eval_first", 100, ".1f", latex) + arrow + ms(r, "eval_last", 100, ".1f", latex)]

    md, tex = render_blocks(df, header, cells, lambda a, m, g: (
        f"first vs last {TRAJECTORY_WINDOW:.0%} of steps, first vs last evaluation (mean ± std over runs)"))
    return Table.from_lines(name, df, md, tex)
