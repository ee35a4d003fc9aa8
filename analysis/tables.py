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

**Mechanism table** (:func:`mechanism_table`): per arm, ``actor/clipfrac_neg_low`` with its
spread over runs and relative to the block's BF16 arm, the ratio's q01 over A<0 tokens, the
rollout/trainer mismatch and the clip bounds in force at the end. **Trajectory table**
(:func:`trajectory_table`): entropy, garbled fraction and evaluation at the start versus the end
of training. **Calibration table** (:func:`calibration_table`): the calibrated arms' alpha and
bounds at every calibration step.

All tables are written as Markdown, LaTeX (booktabs: ``\\toprule``/``\\midrule``/
``\\bottomrule``; needs ``\\usepackage{booktabs}``) and a tidy CSV.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.arms import arm_label, arm_order_key, panel_order_key, select, split_clip
from analysis.collect import CELL_OK, Collection, final_evals
from analysis.surge import SurgeRule, ema, surge_onset
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


def _latex_escape(s: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"),
                 ("#", r"\#"), ("$", r"\$"), ("{", r"\{"), ("}", r"\}")):
        s = s.replace(a, b)
    return s


def _finite(values) -> np.ndarray:
    """``values`` as a float array without NaN/inf."""
    v = np.asarray(values, dtype=float)
    return v[np.isfinite(v)]


def _fmean(values) -> float:
    """Mean of the finite ``values``; NaN when there are none."""
    v = _finite(values)
    return float(v.mean()) if len(v) else math.nan


def _std(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1)) if len(x) >= 2 else math.nan


@dataclasses.dataclass
class Table:
    """A rendered table: tidy ``data`` plus its Markdown and LaTeX text."""

    name: str
    data: pd.DataFrame
    markdown: str
    latex: str

    @classmethod
    def from_lines(cls, name: str, data: pd.DataFrame, md: list[str], tex: list[str],
                   empty: str | None = None) -> Table:
        """Join rendered Markdown / LaTeX lines; ``empty``: the sentence written when ``data``
        has no rows (as a LaTeX comment in the .tex)."""
        if empty is not None and data.empty:
            md.append(empty)
            tex.append(f"% {empty}")
        return cls(name, data, "\n".join(md).rstrip() + "\n", "\n".join(tex).rstrip() + "\n")

    def write(self, out_dir: str | os.PathLike) -> dict[str, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"md": out / f"{self.name}.md", "tex": out / f"{self.name}.tex",
                 "csv": out / f"{self.name}.csv"}
        paths["md"].write_text(self.markdown, encoding="utf-8")
        paths["tex"].write_text(self.latex, encoding="utf-8")
        self.data.to_csv(paths["csv"], index=False, lineterminator="\n", float_format="%.6g")
        return paths


def _blocks(coll: Collection) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(algorithm, model, arms in display order) for every block of the grid."""
    runs = coll.runs.dropna(subset=["algorithm", "model"])
    out = []
    for (algo, model), g in runs.groupby(["algorithm", "model"], sort=True):
        arms = sorted({(str(f), str(c)) for f, c in zip(g["fp8"], g["clip"], strict=True)},
                      key=lambda p: arm_order_key(*p))
        out.append((str(algo), str(model), arms))
    return sorted(out, key=lambda b: panel_order_key(b[0], b[1]))


def _render_blocks(df: pd.DataFrame, header: Sequence[str], cells, caption) -> tuple[list[str], list[str]]:
    """Markdown and LaTeX lines of one table per (algorithm, model) block of ``df``.

    ``cells(row, latex) -> list[str]`` renders a row; ``caption(algo, model, block_df) -> str``
    is the Markdown line above each block (the LaTeX table gets ``ALGO · model`` as its title).
    """
    md: list[str] = []
    tex: list[str] = []
    if df.empty:
        return md, tex
    for (algo, model), g in df.groupby(["algorithm", "model"], sort=False):
        md.append(f"**{algo.upper()} · {model}** — {caption(algo, model, g)}\n")
        md.append("| " + " | ".join(header) + " |")
        md.append("|---|" + "---:|" * (len(header) - 1))
        tex += ["\\begin{tabular}{l" + "r" * (len(header) - 1) + "}", "\\toprule",
                f"\\multicolumn{{{len(header)}}}{{l}}{{{_latex_escape(algo.upper())} · "
                f"{_latex_escape(model)}}} \\\\", "\\midrule",
                " & ".join(_latex_escape(h) for h in header) + " \\\\", "\\midrule"]
        for _, r in g.iterrows():
            md.append("| " + " | ".join(cells(r, False)) + " |")
            tex.append(" & ".join(cells(r, True)) + " \\\\")
        md.append("")
        tex += ["\\bottomrule", "\\end{tabular}", ""]
    return md, tex


def accuracy_table(coll: Collection, *, stat: str = M.EVAL_AVG, percent: bool = True,
                   decimals: int = 1, name: str = "accuracy") -> Table:
    """The accuracy table (see the module docstring)."""
    fe = final_evals(coll, stat)
    scale = 100.0 if percent else 1.0
    expected = coll.runs.groupby(["algorithm", "model", "fp8", "clip"], dropna=True).size()
    rows = []
    for algo, model, arms in _blocks(coll):
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
                    "std": _std(vals), "n": len(vals), "n_expected": n_exp,
                })
    df = pd.DataFrame(rows, columns=["algorithm", "model", "arm", "fp8", "clip", "dataset", "stat",
                                     "mean", "std", "n", "n_expected"])
    df["missing"] = df["n"] == 0
    df["partial"] = (df["n"] > 0) & (df["n"] < df["n_expected"])
    best = df.groupby(["algorithm", "model", "dataset"])["mean"].transform("max")
    df["best"] = (~df["missing"]) & np.isclose(df["mean"], best, rtol=0, atol=1e-12)
    return Table(name, df, _acc_markdown(df, decimals, stat, percent), _acc_latex(df, decimals, stat, percent))


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
        out.append(f"\\multicolumn{{{len(cols) + 1}}}{{l}}{{{_latex_escape(algo.upper())} · "
                   f"{_latex_escape(model)} ({_latex_escape(stat)}{unit})}} \\\\")
        out.append("\\midrule")
        out.append("Arm & " + " & ".join(_latex_escape(_col_label(c)) for c in cols) + " \\\\")
        out.append("\\midrule")
        for arm, ga in g.groupby("arm", sort=False):
            cells = {r["dataset"]: _cell_text(r, decimals, True) for _, r in ga.iterrows()}
            out.append(_latex_escape(arm) + " & " + " & ".join(cells[c] for c in cols) + " \\\\")
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
    for algo, model, arms in _blocks(coll):
        for fp8, clip in arms:
            r = select(per_run, algo, model, fp8, clip)
            n_cells = int(((coll.runs["algorithm"] == algo) & (coll.runs["model"] == model)
                           & (coll.runs["fp8"] == fp8) & (coll.runs["clip"] == clip)).sum())
            onsets = r["surge_step"].dropna().to_numpy(dtype=float)

            def m(c, r=r):
                return _fmean(r[c])

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
        return [_latex_escape(r["arm"]) if latex else r["arm"],
                f"{r['runs']} ({r['finished']}/{r['cells']})", f(r["final_entropy"]),
                f(r["peak_entropy"]), f"{r['surged']}/{r['runs']}{onset}",
                f(r["mean_clipfrac_neg_low"], 4), f(r["final_garbled_frac"])]

    md, tex = _render_blocks(df, header, cells, lambda a, m, g: "end-of-training diagnostics (mean over runs)")
    md.append(f"Surge rule: {rule.describe()}. Runs include unfinished ones (a surging run may fail); "
              f"'final' = mean over the last {FINAL_FRACTION:.0%} of logged steps.")
    tex.append(f"% Surge rule: {rule.describe()}.")
    return Table.from_lines(name, df, md, tex)


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


def _bf16_reference(arms: Sequence[tuple[str, str]]) -> tuple[str, str] | None:
    """The block's BF16 reference arm: ``bf16`` + ``vanilla`` if present, else the first ``bf16`` arm."""
    bf16 = [a for a in arms if a[0] == "bf16"]
    if not bf16:
        return None
    return ("bf16", "vanilla") if ("bf16", "vanilla") in bf16 else bf16[0]


def run_mechanism(coll: Collection) -> pd.DataFrame:
    """Per run: the mean over logged steps of each of :data:`MECHANISM_MEANS` (NaN where the run
    never logged it) and the last logged ``clip/low`` / ``clip/high``, plus axes and ``cell``."""
    rows = []
    for run, g in coll.steps.groupby("run", observed=True, sort=False):
        g = g.sort_values("step")
        row = {"run": str(run)}
        for name in MECHANISM_MEANS:
            row[name] = _fmean(g[name]) if name in g.columns else math.nan
        for name in (M.CLIP_LOW, M.CLIP_HIGH):
            v = _finite(g[name]) if name in g.columns else np.array([])
            row[f"{name}_final"] = float(v[-1]) if len(v) else math.nan
        rows.append(row)
    cols = ["run", *MECHANISM_MEANS, f"{M.CLIP_LOW}_final", f"{M.CLIP_HIGH}_final"]
    df = pd.DataFrame(rows, columns=cols)
    return df.merge(coll.runs[["run", "algorithm", "model", "fp8", "clip", "seed", "arm", "cell"]],
                    on="run", how="left")


def mechanism_table(coll: Collection, *, name: str = "mechanism") -> Table:
    """The paper's mechanism per arm: how many negative-advantage tokens fall below the lower
    clip bound (gradient zeroed), relative to BF16, and what drives it.

    Per (algorithm, model, arm), over every run that logged metrics (finished or not, as the
    diagnostics table): ``actor/clipfrac_neg_low`` averaged over a run's steps, then mean ± std
    (ddof=1) over runs; ``x_bf16`` = that mean over the block's BF16 reference arm's mean
    (``bf16`` + ``vanilla`` if the block has it, else its first ``bf16`` arm; NaN without
    one); the run-mean ``actor/ratio_neg_q01`` and ``rollout/mismatch_kl`` and the last
    ``clip/low`` / ``clip/high`` in force, each a mean over runs.
    """
    per_run = run_mechanism(coll)
    cnl = M.ACTOR_CLIPFRAC_NEG_LOW
    rows = []
    for algo, model, arms in _blocks(coll):
        ref = _bf16_reference(arms)
        ref_mean = _fmean(select(per_run, algo, model, *ref)[cnl]) if ref is not None else math.nan
        for arm in arms:
            r = select(per_run, algo, model, *arm)
            v = _finite(r[cnl])
            mean = _fmean(v)
            row = {"algorithm": algo, "model": model, "arm": arm_label(*arm), "fp8": arm[0], "clip": arm[1],
                   "runs": len(r), "clipfrac_neg_low_mean": mean, "clipfrac_neg_low_std": _std(v),
                   "x_bf16": mean / ref_mean if ref_mean > 0 else math.nan,
                   "bf16_reference": arm_label(*ref) if ref is not None else ""}
            for c, key in ((M.ACTOR_RATIO_NEG_Q01, "ratio_neg_q01"), (M.ROLLOUT_MISMATCH_KL, "mismatch_kl"),
                           (f"{M.CLIP_LOW}_final", "clip_low_final"), (f"{M.CLIP_HIGH}_final", "clip_high_final")):
                row[key] = _fmean(r[c])
            rows.append(row)
    df = pd.DataFrame(rows, columns=["algorithm", "model", "arm", "fp8", "clip", "runs",
                                     "clipfrac_neg_low_mean", "clipfrac_neg_low_std", "x_bf16",
                                     "bf16_reference", "ratio_neg_q01", "mismatch_kl",
                                     "clip_low_final", "clip_high_final"])
    header = ["Arm", "runs", "A<0 below low (%)", "x BF16", "ratio q01 (A<0)", "mismatch KL",
              "final low / high"]

    def cells(r, latex: bool) -> list[str]:
        def f(x, fmt):
            return "n/a" if not np.isfinite(x) else format(x, fmt)
        pm = " $\\pm$ " if latex else " ± "
        c = f(100 * r["clipfrac_neg_low_mean"], ".3f")
        if np.isfinite(r["clipfrac_neg_low_std"]):
            c += pm + f(100 * r["clipfrac_neg_low_std"], ".3f")
        return [_latex_escape(r["arm"]) if latex else r["arm"], str(r["runs"]), c, f(r["x_bf16"], ".1f"),
                f(r["ratio_neg_q01"], ".3f"), f(r["mismatch_kl"], ".2e"),
                f"{f(r['clip_low_final'], '.3f')} / {f(r['clip_high_final'], '.3f')}"]

    def caption(algo, model, g):
        ref = g["bf16_reference"].iloc[0] or "none in this block"
        return (f"A<0 tokens below the lower clip bound, mean over training (± std over runs); "
                f"x BF16 relative to {ref}")

    md, tex = _render_blocks(df, header, cells, caption)
    md.append("Per run: means over logged steps (`actor/clipfrac_neg_low`, `actor/ratio_neg_q01`, "
              "`rollout/mismatch_kl`) and the last `clip/low` / `clip/high`; then mean over runs.")
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
    for algo, model, arms in _blocks(coll):
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
                    row[m] = _fmean(at[m]) if m in at.columns else math.nan
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
        return [_latex_escape(r["arm"]) if latex else r["arm"], step, str(r["runs"]),
                f(100 * r[M.CLIP_ALPHA], ".3f"), f(r[CLIP_N_NEG], ".0f") if r["calibration"] else "",
                f(r[CLIP_LOW_DATA], ".2f") if r["calibration"] else "",
                pair(CLIP_LOW_RAW, CLIP_HIGH_RAW), pair(CLIP_LOW_NEXT, CLIP_HIGH_NEXT),
                f"{f(r[M.CLIP_LOW], '.4f')} / {f(r[M.CLIP_HIGH], '.4f')}",
                f(100 * r[M.ACTOR_CLIPFRAC_NEG_LOW], ".3f"), f(100 * r["shadow_share"], ".1f")]

    md, tex = _render_blocks(df, header, cells, lambda a, m, g: (
        "the controller at each calibration step (mean over runs): alpha = the BF16 shadow's share "
        "of A<0 tokens below 1 - eps_low; 'alpha n < 5' = share of runs whose lower bound rests on "
        "fewer than five tokens; 'next' = the bounds set for the following steps (after EMA); "
        "'in force' = the bounds of this step's updates; shadow time = the arm's BF16 shadow time "
        "over its step time, whole runs"))
    return Table.from_lines(name, df, md, tex, empty="No calibrated arm in these sweeps.")


# --- trajectory: start vs end ------------------------------------------------------------

TRAJECTORY_WINDOW = 0.25


def trajectory_table(coll: Collection, *, stat: str = M.EVAL_AVG, name: str = "trajectory") -> Table:
    """Start versus end of training per arm: did entropy, garbling or accuracy move?

    Per run (every run that logged metrics): mean ``actor/entropy`` and ``rollout/garbled_frac``
    over the first and the last quarter of its logged steps (at least one step each), the max
    of ``actor/entropy`` over all steps, and the evaluation ``stat`` (mean over datasets) at the
    first and the last evaluation. Per arm: mean and sample std (ddof=1) over runs.
    """
    st = coll.steps
    ev = coll.evals
    ev = ev[ev["stat"] == stat] if len(ev) else ev
    per_run = []
    for run, g in st.groupby("run", observed=True, sort=False):
        g = g.sort_values("step")
        w = max(1, math.ceil(TRAJECTORY_WINDOW * len(g)))

        def win(m, part, g=g, w=w):
            if m not in g.columns:
                return math.nan
            v = g[m].to_numpy(dtype=float)
            return _fmean(v[:w] if part == "first" else v[-w:])

        ent = _finite(g[M.ACTOR_ENTROPY]) if M.ACTOR_ENTROPY in g.columns else np.array([])
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
    for algo, model, arms in _blocks(coll):
        for fp8, clip in arms:
            r = select(pr, algo, model, fp8, clip)
            row = {"algorithm": algo, "model": model, "arm": arm_label(fp8, clip), "fp8": fp8, "clip": clip,
                   "runs": len(r)}
            for k in keys:
                v = _finite(r[k])
                row[f"{k}_mean"] = _fmean(v)
                row[f"{k}_std"] = _std(v)
            rows.append(row)
    cols = ["algorithm", "model", "arm", "fp8", "clip", "runs"] + [f"{k}_{s}" for k in keys for s in ("mean", "std")]
    df = pd.DataFrame(rows, columns=cols)
    header = ["Arm", "runs", "entropy first → last", "entropy max", "garbled % first → last",
              f"eval {stat} % first → last"]

    def ms(r, k, scale, fmt, latex):
        m, s = r[f"{k}_mean"] * scale, r[f"{k}_std"] * scale
        if not np.isfinite(m):
            return "n/a"
        pm = " $\\pm$ " if latex else " ± "
        return format(m, fmt) + (pm + format(s, fmt) if np.isfinite(s) else "")

    def cells(r, latex: bool) -> list[str]:
        arrow = " $\\to$ " if latex else " → "
        return [_latex_escape(r["arm"]) if latex else r["arm"], str(r["runs"]),
                ms(r, "entropy_first", 1, ".3f", latex) + arrow + ms(r, "entropy_last", 1, ".3f", latex),
                ms(r, "entropy_max", 1, ".3f", latex),
                ms(r, "garbled_first", 100, ".2f", latex) + arrow + ms(r, "garbled_last", 100, ".2f", latex),
                ms(r, "eval_first", 100, ".1f", latex) + arrow + ms(r, "eval_last", 100, ".1f", latex)]

    md, tex = _render_blocks(df, header, cells, lambda a, m, g: (
        f"first vs last {TRAJECTORY_WINDOW:.0%} of steps, first vs last evaluation (mean ± std over runs)"))
    return Table.from_lines(name, df, md, tex)
