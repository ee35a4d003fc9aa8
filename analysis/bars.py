"""Summary figures: one bar per arm, one panel per (algorithm, model) block.

Where a line figure would be crowded (a main-table panel has fifteen arms; the calibration
ablation eighteen variants of one arm), a summary shows the number the text quotes: per run the
mean of a metric over its logged steps (``analysis.clip_tables.run_mechanism``), then per arm the
mean over seeds with a ±1 std error bar where there are two or more seeds. Bars are horizontal
and ordered as in the tables (``analysis.arms``), coloured by arm (``arm_style``); the block's
BF16 arm (BF16 vanilla, else the first BF16 arm) is drawn as a dashed vertical line.

Written like every figure (``analysis.figures``): PNG (200 dpi), PDF and the CSV of exactly the
plotted numbers (``kind=bar``: algorithm, model, arm, fp8, clip, mean, std, n_seeds).
Summaries (:data:`SUMMARIES`): ``clipfrac_summary``, the percentage of A<0 tokens below the
lower clip bound over training.
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

from analysis.arms import arm_label, arm_order_key, arm_style
from analysis.clip_tables import run_mechanism
from analysis.collect import Collection
from analysis.figures import MAX_COLS, RC, format_number, panels_of, spec_by_name
from fp8rl.runs import metrics as M


@dataclasses.dataclass(frozen=True)
class SummarySpec:
    """One summary figure: a per-run mean of ``metric`` (a column of ``run_mechanism``)."""

    name: str
    metric: str
    xlabel: str
    title: str
    scale: float = 1.0


SUMMARIES: tuple[SummarySpec, ...] = (
    SummarySpec("clipfrac_summary", M.ACTOR_CLIPFRAC_NEG_LOW, "A<0 tokens below L, mean over training (%)",
                "Negative-advantage tokens below the lower clip bound, per arm", scale=100.0),
)
SUMMARY_NAMES = tuple(s.name for s in SUMMARIES)


def summary_spec(name: str) -> SummarySpec:
    return spec_by_name(SUMMARIES, name, "summary figure")


def arm_means(coll: Collection, metric: str) -> pd.DataFrame:
    """``algorithm, model, fp8, clip, arm, mean, std, n_seeds``: per arm, over its runs, of each
    run's mean of ``metric`` over its logged steps (runs that never logged it are left out)."""
    cols = ["algorithm", "model", "fp8", "clip", "arm", "mean", "std", "n_seeds"]
    per_run = run_mechanism(coll) if len(coll.steps) else pd.DataFrame()
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


def plot_summary(coll: Collection, spec: SummarySpec | str, out_dir: str | os.PathLike, *,
                 panel_width: float = 2.4) -> dict[str, Path] | None:
    """Draw one summary figure into ``out_dir``; None when no run logged its metric."""
    spec = summary_spec(spec) if isinstance(spec, str) else spec
    data = arm_means(coll, spec.metric)
    if data.empty:
        return None
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
            colors = [arm_style(f, c).color for f, c in zip(a["fp8"], a["clip"], strict=True)]
            ax.barh(y, mean, color=colors, height=0.7,
                    xerr=np.where(np.isfinite(std), std, 0.0) if np.isfinite(std).any() else None,
                    error_kw={"elinewidth": 0.8, "capsize": 1.5})
            ref = a[a["fp8"] == "bf16"].sort_values("clip", key=lambda c: c != "vanilla", kind="stable")
            if len(ref):  # BF16 vanilla, else the first BF16 arm (as the tables' reference)
                ax.axvline(float(ref["mean"].iloc[0]) * spec.scale, color="0.3", linestyle="--", linewidth=0.8)
            if i == 0 or not same_arms:  # shared y: the first panel's labels serve its row
                ax.set_yticks(y, a["arm"].tolist())
            ax.tick_params(axis="y", length=0)
            ax.grid(axis="y", visible=False)
            ax.set_title(f"{algo.upper()} · {model}")
            if i // ncols == nrows - 1 or i + ncols >= len(panels):
                ax.set_xlabel(spec.xlabel)
            for r in a.itertuples(index=False):
                csv_rows.append(("bar", spec.metric, algo, model, r.arm, r.fp8, r.clip,
                                 format_number(float(r.mean) * spec.scale), format_number(float(r.std) * spec.scale),
                                 int(r.n_seeds)))
        for j in range(len(panels), nrows * ncols):
            axes[j // ncols][j % ncols].set_visible(False)
        fig.suptitle(spec.title + ("; dashed: BF16" if (data["fp8"] == "bf16").any() else ""), fontsize=9)
        paths = {"png": out_dir / f"{spec.name}.png", "pdf": out_dir / f"{spec.name}.pdf",
                 "csv": out_dir / f"{spec.name}.csv"}
        fig.savefig(paths["png"], dpi=200)
        fig.savefig(paths["pdf"], metadata={"CreationDate": None})
        plt.close(fig)
    header = ["kind", "metric", "algorithm", "model", "arm", "fp8", "clip", "mean", "std", "n_seeds"]
    pd.DataFrame(csv_rows, columns=header).to_csv(paths["csv"], index=False, lineterminator="\n")
    return paths
