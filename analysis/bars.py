"""Summary figures: one mark per arm, one panel per (algorithm, model) block.

Where a line figure would be crowded (the calibration ablation has eighteen variants of one arm),
a summary shows the number the text quotes, ordered as in the tables (``analysis.arms``) and
coloured by clip method (``analysis.style``: the same colours as every line figure).

- ``clipfrac_summary``: per run the mean of ``actor/clipfrac_neg_low`` over its logged steps
  (``analysis.clip_tables.run_mechanism``), then per arm the mean over seeds as a bar, with the
  95% Student-t interval of that mean cut at 0 % (a fraction cannot be negative); the block's
  BF16 reference arm (BF16 vanilla, else the first BF16 arm) as a dashed black line.
- ``eval_accuracy``: the accuracy differences that matter are a point or two, so they are drawn as
  differences, not bars from 0: per arm and seed, the arm's gain in avg@k from step 0 to the last
  evaluation (mean over the evaluation sets; ``analysis.paired.run_gains``, finished runs) minus
  the BF16 reference arm's gain for the same seed (same warm start, same prompts), in points; a
  dot at the mean over seeds and the 95% Student-t interval of the mean (none below two paired
  seeds); zero (the BF16 reference) dashed black. It is the report's paired accuracy table drawn.
  **Which engine scores the gains**: a block whose runs were also scored by a BF16 engine on the
  same weights (``eval_bf16/`` keys) and pair with its BF16 arm is drawn from those BF16-scored
  gains (``run_gains(precision="bf16")``: the training effect, every arm in one precision); a
  block without them (sweeps from before the BF16 engine) falls back to each arm's own engine,
  whose FP8 scoring mixes the evaluation's precision into the training effect. The axis label,
  the title, the caption and the CSV column ``scored_by`` (``"bf16"`` | ``"own"``) say which.
  Choice: the engine is chosen per block, not per arm, so one panel never mixes the two; in a BF16
  block an arm without BF16-scored pairs has no dot.

Written like every figure (``analysis.figures``): PNG (200 dpi), PDF and the CSV of exactly the
plotted numbers (``kind=bar`` or ``kind=diff``: algorithm, model, arm, fp8, clip, mean, std,
n_seeds, lo, hi: the drawn interval; ``kind=diff`` adds ``scored_by``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analysis.arms import arm_label, arm_order_key, select
from analysis.captions import describe_runs
from analysis.clip_tables import run_mechanism
from analysis.collect import Collection, final_evals
from analysis.curves import (
    MAX_COLS,
    RC,
    FigurePaths,
    format_number,
    panels_of,
    save_figure,
    spec_by_name,
)
from analysis.paired import mean_interval, run_gains
from analysis.style import REFERENCE_COLOUR, method_colour, support
from analysis.tabulate import bf16_reference, blocks
from fp8rl.runs import metrics as M


@dataclasses.dataclass(frozen=True)
class SummarySpec:
    """One summary figure: a per-run mean of ``metric`` (a column of ``run_mechanism``)."""

    name: str
    metric: str
    xlabel: str
    title: str
    scale: float = 1.0
    #: ``"mechanism"``: the per-run mean over training (``run_mechanism``); ``"eval"``: the
    #: run's final evaluation averaged over the sets (finished runs); ``"paired_gain"``: the gain
    #: from step 0 minus the BF16 arm's gain for the same seed, BF16-scored where the runs have it
    #: (``paired_differences``).
    source: str = "mechanism"
    #: error bars: ``"std"`` (±1 std over seeds) or ``"ci95"`` (95% t interval of the mean).
    interval: str = "std"


EVAL_FINAL = "eval/final/avg@k"  # pseudo-metric: a run's final avg@k averaged over the sets
PAIRED_GAIN = "eval/gain_minus_bf16/avg@k"  # pseudo-metric of the accuracy summary

SUMMARIES: tuple[SummarySpec, ...] = (
    SummarySpec("eval_accuracy", PAIRED_GAIN, "avg@k gain − BF16 gain, same seed (points)",
                "Evaluation accuracy versus BF16, paired by seed", scale=100.0, source="paired_gain",
                interval="ci95"),
    SummarySpec("clipfrac_summary", M.ACTOR_CLIPFRAC_NEG_LOW, "A<0 tokens below L, mean over training (%)",
                "Negative-advantage tokens below the lower clip bound, per arm", scale=100.0,
                interval="ci95"),
)
#: Two-sided 95% Student t quantiles by degrees of freedom (1-30; 1.96 beyond).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    return T975[df - 1] if 1 <= df <= len(T975) else 1.96 if df > 0 else float("nan")


INTERVAL_TEXT = {"std": "error bars: ±1 std over seeds",
                 "ci95": "error bars: 95% confidence interval of the mean over seeds (Student t), "
                         "cut to the metric's range"}
SUMMARY_NAMES = tuple(s.name for s in SUMMARIES)


def summary_spec(name: str) -> SummarySpec:
    return spec_by_name(SUMMARIES, name, "summary figure")


def arm_means(coll: Collection, metric: str) -> pd.DataFrame:
    """``algorithm, model, fp8, clip, arm, mean, std, n_seeds``: per arm, over its runs, of each
    run's mean of ``metric`` over its logged steps (runs that never logged it are left out)."""
    cols = ["algorithm", "model", "fp8", "clip", "arm", "mean", "std", "n_seeds"]
    per_run = run_final_eval(coll) if metric == EVAL_FINAL else (
        run_mechanism(coll) if len(coll.steps) else pd.DataFrame())
    if per_run.empty or metric not in per_run.columns:
        return pd.DataFrame(columns=cols)
    per_run = per_run.dropna(subset=[metric])
    if per_run.empty:
        return pd.DataFrame(columns=cols)
    g = per_run.groupby(["algorithm", "model", "fp8", "clip"], observed=True)[metric]
    df = g.agg(mean="mean", std="std", n_seeds="count").reset_index()
    df.loc[df["n_seeds"] < 2, "std"] = np.nan
    df["arm"] = [arm_label(f, c) for f, c in zip(df["fp8"], df["clip"], strict=True)]
    df["_k"] = [arm_order_key(f, c) for f, c in zip(df["fp8"], df["clip"], strict=True)]
    return df.sort_values(["algorithm", "model", "_k"], kind="stable")[cols].reset_index(drop=True)


#: ``scored_by`` of :func:`paired_differences` -> what the figure's label and caption say.
SCORED_BY_TEXT = {M.EVAL_BF16: "scored by a BF16 engine on the same weights",
                  M.EVAL_OWN: "scored by each arm's own engine (no BF16-engine evaluation)"}
SCORED_BY_SHORT = {M.EVAL_BF16: "BF16-scored", M.EVAL_OWN: "own engine"}
#: which paired accuracy table of the report the figure draws, by the engines of its blocks
PAIRED_TABLE_OF = {(M.EVAL_BF16,): " scored by a BF16 engine (tables/paired_accuracy_bf16)",
                   (M.EVAL_OWN,): " (tables/paired_accuracy)"}
PAIRED_TABLE_MIXED = (" (tables/paired_accuracy_bf16 in the BF16-scored panels, tables/paired_accuracy in "
                      "the others)")
SCORED_BY_TITLE = {M.EVAL_BF16: "scored by a BF16 engine", M.EVAL_OWN: "scored by each arm's own engine"}


def _block_differences(gains: pd.DataFrame, algo: str, model: str, arms) -> list[dict]:
    ref = bf16_reference(arms)
    if ref is None or gains.empty:
        return []
    r = select(gains, algo, model, *ref).set_index("seed")["gain"]
    rows = []
    for arm in arms:
        a = select(gains, algo, model, *arm)
        if arm == ref or a.empty:
            continue
        d = (a.set_index("seed")["gain"] - r).dropna().to_numpy(dtype=float)
        if not len(d):
            continue
        lo, hi = mean_interval(d)
        rows.append({"algorithm": algo, "model": model, "fp8": arm[0], "clip": arm[1],
                     "arm": arm_label(*arm), "mean": float(d.mean()),
                     "std": float(d.std(ddof=1)) if len(d) >= 2 else np.nan, "n_seeds": len(d),
                     "lo": lo, "hi": hi})
    return rows


def paired_differences(coll: Collection, precision: str | None = None) -> pd.DataFrame:
    """Per non-reference arm of every block with a BF16 arm: the gain from step 0 (``run_gains``)
    minus the BF16 reference arm's gain for the same seed; ``mean, std, n_seeds`` over the paired
    seeds and ``lo, hi``, the 95% Student-t interval of the mean (fractions, not points), and
    ``scored_by``, the engine whose gains these are.

    ``precision=None``: per block, the BF16 engine's gains where the block has BF16-scored pairs
    (``eval_bf16/`` keys), else the arm's own engine's; ``"own"`` or ``"bf16"``: that engine only.
    """
    cols = ["algorithm", "model", "fp8", "clip", "arm", "mean", "std", "n_seeds", "lo", "hi", "scored_by"]
    if precision is not None and precision not in M.EVAL_PRECISIONS:
        raise ValueError(f"precision must be None (BF16 engine where present) or one of "
                         f"{M.EVAL_PRECISIONS}, got {precision!r}")
    order = (M.EVAL_BF16, M.EVAL_OWN) if precision is None else (precision,)
    gains = {p: run_gains(coll, precision=p) for p in order}
    rows = []
    for algo, model, arms in blocks(coll):
        for p in order:
            found = _block_differences(gains[p], algo, model, arms)
            if found:
                rows += [{**r, "scored_by": p} for r in found]
                break
    return pd.DataFrame(rows, columns=cols)


def run_final_eval(coll: Collection) -> pd.DataFrame:
    """Per finished run: ``algorithm, model, fp8, clip`` and :data:`EVAL_FINAL`, its final avg@k
    averaged over the evaluation sets (runs missing a set of their sweep are left out)."""
    fe = final_evals(coll)
    if fe.empty:
        return pd.DataFrame(columns=["run", "algorithm", "model", "fp8", "clip", EVAL_FINAL])
    n_sets = fe["dataset"].nunique()
    g = fe.groupby(["run", "algorithm", "model", "fp8", "clip"], observed=True, dropna=False)["value"]
    df = g.agg(["mean", "count"]).reset_index()
    df = df[df["count"] == n_sets].rename(columns={"mean": EVAL_FINAL})
    return df[["run", "algorithm", "model", "fp8", "clip", EVAL_FINAL]]


def _interval(mean: np.ndarray, std: np.ndarray, n: np.ndarray, kind: str,
              bounds: tuple[float, float] = (-np.inf, np.inf)) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper ends of the error bar around ``mean`` (NaN where there is none), cut to
    ``bounds``."""
    half = std if kind == "std" else np.array([t975(int(k) - 1) for k in n]) * std / np.sqrt(n)
    return np.clip(mean - half, *bounds), np.clip(mean + half, *bounds)


def plot_summary(coll: Collection, spec: SummarySpec | str, out_dir: str | os.PathLike, *,
                 pdf: bool = False, panel_width: float = 2.4) -> FigurePaths | None:
    """Draw one summary figure into ``out_dir``; None when no run logged its metric."""
    spec = summary_spec(spec) if isinstance(spec, str) else spec
    diff = spec.source == "paired_gain"
    data = paired_differences(coll) if diff else arm_means(coll, spec.metric)
    if data.empty:
        return None
    engines = sorted(set(data["scored_by"])) if diff else []  # "bf16" sorts before "own"
    panels = [p for p in panels_of(coll) if not data[(data["algorithm"] == p[0]) & (data["model"] == p[1])].empty]
    arm_sets = {p: data[(data["algorithm"] == p[0]) & (data["model"] == p[1])] for p in panels}
    same_arms = len({tuple(a["arm"]) for a in arm_sets.values()}) == 1
    n_arms = max(len(a) for a in arm_sets.values())
    ncols = min(len(panels), MAX_COLS)
    nrows = math.ceil(len(panels) / ncols)
    height = 0.45 + 0.17 * n_arms
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_rows = []
    with plt.rc_context(RC):
        fig, axes = plt.subplots(nrows, ncols, figsize=(panel_width * ncols + 1.8, height * nrows + 0.5),
                                 squeeze=False, sharey=same_arms, sharex=True, layout="constrained")
        for i, (algo, model) in enumerate(panels):
            ax = axes[i // ncols][i % ncols]
            a = arm_sets[(algo, model)].reset_index(drop=True)
            y = np.arange(len(a))[::-1]
            mean = a["mean"].to_numpy(dtype=float) * spec.scale
            std = a["std"].to_numpy(dtype=float) * spec.scale
            if diff:
                lo, hi = a["lo"].to_numpy(dtype=float) * spec.scale, a["hi"].to_numpy(dtype=float) * spec.scale
            else:
                lo, hi = _interval(mean, std, a["n_seeds"].to_numpy(dtype=float), spec.interval,
                                   tuple(b * spec.scale for b in support(spec.metric)))
            xerr = np.vstack([np.where(np.isfinite(lo), mean - lo, 0.0), np.where(np.isfinite(hi), hi - mean, 0.0)])
            for yi, m_, e0, e1, clip, fp8 in zip(y, mean, xerr[0], xerr[1], a["clip"], a["fp8"], strict=True):
                col = method_colour(clip)
                if diff:
                    ax.errorbar([m_], [yi], xerr=[[e0], [e1]], fmt="o", color=col, markersize=3.5, elinewidth=1.0,
                                capsize=2, gid=f"{fp8}|{clip}")
                else:
                    ax.barh([yi], [m_], color=col, height=0.7, gid=f"{fp8}|{clip}")
                    if e0 > 0 or e1 > 0:
                        ax.errorbar([m_], [yi], xerr=[[e0], [e1]], fmt="none", ecolor="0.2", elinewidth=0.8,
                                    capsize=1.5)
            if diff:
                ax.axvline(0.0, color=REFERENCE_COLOUR, linestyle="--", linewidth=0.8, gid="reference")
            else:
                ref = bf16_reference(sorted(zip(a["fp8"], a["clip"], strict=True), key=lambda p: arm_order_key(*p)))
                if ref is not None:
                    m_ref = a[(a["fp8"] == ref[0]) & (a["clip"] == ref[1])]["mean"]
                    ax.axvline(float(m_ref.iloc[0]) * spec.scale, color=REFERENCE_COLOUR, linestyle="--",
                               linewidth=0.8, gid="reference")
            if i == 0 or not same_arms:  # shared y: the first panel's labels serve its row
                ax.set_yticks(y, a["arm"].tolist())
            ax.tick_params(axis="y", length=0)
            ax.grid(axis="y", visible=False)
            engine = str(a["scored_by"].iloc[0]) if diff else ""
            ax.set_title(f"{algo.upper()} · {model}" + (f" ({SCORED_BY_SHORT[engine]})" if len(engines) > 1 else ""))
            if i // ncols == nrows - 1 or i + ncols >= len(panels):
                ax.set_xlabel(f"{spec.xlabel}\n{SCORED_BY_TITLE[engine]}" if diff else spec.xlabel)
            for r, lo_, hi_ in zip(a.itertuples(index=False), lo, hi, strict=True):
                csv_rows.append(("diff" if diff else "bar", spec.metric, algo, model, r.arm, r.fp8, r.clip,
                                 format_number(float(r.mean) * spec.scale), format_number(float(r.std) * spec.scale),
                                 int(r.n_seeds), format_number(float(lo_)), format_number(float(hi_)),
                                 *((r.scored_by,) if diff else ())))
        for j in range(len(panels), nrows * ncols):
            axes[j // ncols][j % ncols].set_visible(False)
        has_ref = diff or (data["fp8"] == "bf16").any()
        if not diff:
            scored, title_engine = "", ""
        elif len(engines) == 1:
            scored = SCORED_BY_TEXT[engines[0]]
            title_engine = f", {SCORED_BY_TITLE[engines[0]]}"
        else:
            scored = (f"{SCORED_BY_TEXT[M.EVAL_BF16]} in the panels marked {SCORED_BY_SHORT[M.EVAL_BF16]}, "
                      f"else {SCORED_BY_TEXT[M.EVAL_OWN]}")
            title_engine = ", BF16-scored where the runs have it (panel titles say)"
        fig.suptitle(spec.title + title_engine + ("; dashed: BF16" if has_ref else ""), fontsize=9)
        if diff:
            caption = (f"{spec.title}: per arm and seed, the gain in avg@k from step 0 to the last evaluation "
                       f"(mean over the evaluation sets, {scored}; same problems and sampling seed at every "
                       "evaluation; finished runs) minus the BF16 reference arm's gain for the same seed, in "
                       "points; dots: "
                       "the mean over the paired seeds; error bars: its 95% confidence interval (Student t; "
                       "none below two pairs); dashed line: zero, the BF16 reference. The report's paired "
                       f"accuracy table{PAIRED_TABLE_OF.get(tuple(engines), PAIRED_TABLE_MIXED)}, drawn. "
                       f"{describe_runs(coll)}")
        else:
            what = ("each finished run's final evaluation, avg@k averaged over the evaluation sets"
                    if spec.source == "eval" else "each run's mean over its logged steps")
            caption = (f"{spec.title}: bars are the mean over seeds of {what}, coloured by clip method; "
                       f"{INTERVAL_TEXT[spec.interval]} (none for single-seed arms)"
                       + ("; dashed line: the BF16 reference arm" if has_ref else "")
                       + f". {describe_runs(coll)}")
        paths = save_figure(fig, out_dir, spec.name, caption, pdf=pdf)
        plt.close(fig)
    header = ["kind", "metric", "algorithm", "model", "arm", "fp8", "clip", "mean", "std", "n_seeds", "lo", "hi",
              *(("scored_by",) if diff else ())]
    pd.DataFrame(csv_rows, columns=header).to_csv(paths["csv"], index=False, lineterminator="\n")
    return paths
