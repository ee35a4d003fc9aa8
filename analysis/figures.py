"""The paper's figures, regenerated from a :class:`analysis.collect.Collection`.

Every figure has one column of panels per (algorithm, model) and one row per metric, one line
per arm (``analysis.arms``: fixed colour and line style per (fp8, clip), the same in every
figure), the mean over seeds of the EMA-smoothed per-run curves with a band of +-1 standard
deviation over seeds where there are two or more, and the legend *below* the panels (it never
covers data). Each figure is written as PNG (200 dpi; PDF with ``pdf=True``), with a CSV of exactly the
plotted numbers beside it (``kind=line`` rows: step, mean, std, n_seeds; ``kind=surge`` rows:
the surge onsets marked with a triangle), sorted and formatted deterministically.

Figures (:data:`FIGURES`): entropy over training, drawn by ``analysis.granularity`` (one panel
per FP8 setting, clip methods as colours, min-max band; surge onsets marked, ``analysis.surge``);
``actor/clipfrac_neg_low`` (the mechanism); reward and rollout accuracy; response length; mismatch KL
(log scale); the clip bounds ``clip/low``, ``clip/high`` and ``clip/alpha``; the ratio
quantiles of negative-advantage tokens.

The clip-fraction figure is drawn as small multiples: one row of panels per clip method and
one line per FP8 setting in each (coloured by the FP8 setting), so a main-table panel holds
five lines instead of fifteen; ``analysis.bars`` adds a one-panel-per-block summary of the same
metric (mean over training per arm, bars).

Layout: at most three panels per row (a single-metric figure wraps into rows, a multi-metric
figure narrows its panels towards a 7.2 in page width), panels GRPO before DAPO and models in
natural order; panels 3.0 x 2.1 in with 7-8 pt text, PDF fonts embedded as TrueType.

Choices: the EMA span defaults to ``max(1, round(T / 50))`` logged steps for a run of T steps
(``smooth=1`` disables it); metrics logged on a minority of steps (``clip/alpha``,
``shadow/*``) are drawn unsmoothed with markers; a metric absent from every run skips its
figure (the report says so). matplotlib runs on the Agg backend (no display needed).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analysis.arms import (
    CLIP_LABELS,
    FP8_LABELS,
    arm_label,
    arm_order_key,
    arm_style,
    select,
    sort_arms,
    split_clip,
)
from analysis.captions import describe_runs
from analysis.collect import Collection
from analysis.curves import (  # noqa: F401  (arm_curves, auto_span, ...: public here too)
    EVAL_AVG_METRIC,
    MAX_COLS,
    PAGE_WIDTH,
    RC,
    FigurePaths,
    arm_curves,
    auto_span,
    format_number,
    panels_of,
    plain_yaxis,
    save_figure,
    spec_by_name,
)
from analysis.granularity import plot_by_granularity
from analysis.surge import SurgeRule, surge_table
from fp8rl.runs import metrics as M


@dataclasses.dataclass(frozen=True)
class FigureSpec:
    """One figure: a name (file stem), metrics (one row of panels each) and their labels."""

    name: str
    metrics: tuple[str, ...]
    ylabels: tuple[str, ...]
    title: str
    logy: bool = False
    mark_surge: bool = False
    smooth: bool = True  # False for step functions such as the clip bounds in force
    #: Small multiples: one row of panels per clip method (vanilla / TIS / calibrated), one
    #: line per FP8 setting in each, when the sweep holds two or more clip methods.
    facet_clip: bool = False
    #: Factor applied to the plotted values (100: fractions drawn as percent).
    scale: float = 1.0
    #: The paper's layout (``analysis.granularity``): one panel per FP8 setting, clip methods
    #: as colours, mean over seeds and a min-max band.
    by_granularity: bool = False


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec("entropy", (M.ACTOR_ENTROPY,), ("entropy (nats/token)",),
               "Policy entropy over training", mark_surge=True, by_granularity=True),
    FigureSpec("clipfrac_neg_low", (M.ACTOR_CLIPFRAC_NEG_LOW,),
               ("A<0 below L (%)",),
               "Negative-advantage tokens below the lower clip bound (gradient zeroed)",
               facet_clip=True, scale=100.0),
    FigureSpec("reward_accuracy", (M.ROLLOUT_REWARD_MEAN, M.ROLLOUT_ACC),
               ("mean reward", "rollout accuracy (fraction)"), "Reward and rollout accuracy"),
    FigureSpec("response_length", (M.ROLLOUT_RESPONSE_LEN,), ("response length (tokens)",),
               "Response length"),
    FigureSpec("mismatch_kl", (M.ROLLOUT_MISMATCH_KL,), ("rollout-trainer KL (nats/token)",),
               "Rollout / trainer mismatch", logy=True),
    FigureSpec("clip_bounds", (M.CLIP_LOW, M.CLIP_HIGH, M.CLIP_ALPHA),
               ("lower clip bound", "upper clip bound", "alpha (BF16 shadow clip fraction)"),
               "Clip bounds in force and the calibration target", smooth=False),
    FigureSpec("ratio_quantiles", (M.ACTOR_RATIO_NEG_Q01, M.ACTOR_RATIO_NEG_Q50, M.ACTOR_RATIO_NEG_Q99),
               ("ratio q01 (A<0)", "ratio q50 (A<0)", "ratio q99 (A<0)"),
               "PPO ratio quantiles over negative-advantage tokens"),
)
FIGURE_NAMES = tuple(f.name for f in FIGURES)


def figure_spec(name: str) -> FigureSpec:
    return spec_by_name(FIGURES, name)


def _figure_rows(spec: FigureSpec, arms: Sequence[tuple[str, str]]) -> list[tuple[str, str | None, str]]:
    """``(metric, clip method or None, y label)`` per row of panels: one per metric, or with
    ``spec.facet_clip`` and two or more clip methods among ``arms``, one per (metric, method)."""
    methods = sorted({split_clip(c)[0] for _, c in arms}, key=lambda c: arm_order_key("bf16", c))
    if not spec.facet_clip or len(methods) < 2:
        return [(m, None, lab) for m, lab in zip(spec.metrics, spec.ylabels, strict=True)]
    return [(m, c, f"{CLIP_LABELS.get(c, c)}\n{lab}") for m, lab in zip(spec.metrics, spec.ylabels, strict=True)
            for c in methods]


def _facet_style(fp8: str, clip: str):
    """Style and legend label of an arm in a clip-faceted row: the colour of its FP8 setting
    (the same in every row), a solid line, the label without the clip method (the row says it)."""
    variant = split_clip(clip)[1]
    st = arm_style(fp8, "tis")
    label = FP8_LABELS.get(fp8, f"FP8 {fp8}") + (f" [{variant}]" if variant else "")
    return dataclasses.replace(st, linestyle="--" if fp8 == "rollout_only" else "-",
                               linewidth=2.0 if fp8 == "bf16" else 1.5), label


def plot_figure(
    coll: Collection,
    spec: FigureSpec | str,
    out_dir: str | os.PathLike,
    *,
    smooth: float | None = None,
    surge_rule: SurgeRule = SurgeRule(),  # noqa: B008
    pdf: bool = False,
    panel_width: float = 3.0,
    panel_height: float = 2.1,
) -> FigurePaths | None:
    """Draw one figure into ``out_dir`` as ``<name>.png``, ``.csv`` (and ``.pdf`` when ``pdf``);
    the returned paths carry the figure's ``caption``.

    Returns the written paths, or None when no run logged any of the figure's metrics.
    """
    spec = figure_spec(spec) if isinstance(spec, str) else spec
    if spec.by_granularity:
        return plot_by_granularity(coll, spec, out_dir, smooth=smooth, surge_rule=surge_rule, pdf=pdf)
    span = smooth if spec.smooth else 1.0
    curves = {m: arm_curves(coll, m, smooth=span) for m in spec.metrics}
    if all(c.empty for c in curves.values()):
        return None
    panels = panels_of(coll)
    arms = sort_arms(zip(coll.runs["fp8"].astype(str), coll.runs["clip"].astype(str), strict=True))
    rows = _figure_rows(spec, arms)
    n_panels = max(len(panels), 1)
    wrap = len(rows) == 1 and n_panels > MAX_COLS
    if wrap:  # one metric, many panels: rows of MAX_COLS panels
        nrows, ncols = math.ceil(n_panels / MAX_COLS), MAX_COLS
        pw = panel_width
    else:  # one row per metric (and clip method), one column per panel, narrower beyond MAX_COLS
        nrows, ncols = len(rows), n_panels
        pw = panel_width if ncols <= MAX_COLS else max(1.9, PAGE_WIDTH / ncols)

    def position(r: int, c: int) -> tuple[int, int]:
        return divmod(c, MAX_COLS) if wrap else (r, c)

    occupied = {position(r, c) for r in range(len(rows)) for c in range(n_panels)}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    surges = pd.DataFrame(columns=["run", "surge_step"])
    if spec.mark_surge and M.ACTOR_ENTROPY in coll.steps.columns:
        surges = surge_table(coll.steps, surge_rule).dropna()
        surges = surges.merge(coll.runs[["run", "algorithm", "model", "fp8", "clip", "arm", "seed"]],
                              on="run", how="left")
    csv_rows = []
    with plt.rc_context(RC):
        fig, axes = plt.subplots(nrows, ncols, figsize=(pw * ncols, panel_height * nrows + 0.6),
                                 squeeze=False, sharex=False if wrap else "col",
                                 sharey="row" if spec.facet_clip and not wrap else False,
                                 layout="constrained")
        handles: dict[str, object] = {}
        for r, (metric, facet, ylabel) in enumerate(rows):
            cur = curves[metric]
            for c, (algo, model) in enumerate(panels):
                rr, cc = position(r, c)
                ax = axes[rr][cc]
                sub = select(cur, algo, model)
                for fp8, clip in arms:
                    if facet is not None and split_clip(clip)[0] != facet:
                        continue
                    a = select(sub, algo, model, fp8, clip)
                    if a.empty:
                        continue
                    a = a.sort_values("step")
                    st, label = (_facet_style(fp8, clip) if facet is not None
                                 else (arm_style(fp8, clip), arm_label(fp8, clip)))
                    x, sd = a["step"].to_numpy(), a["std"].to_numpy() * spec.scale
                    y = a["mean"].to_numpy() * spec.scale
                    sparse = len(a) < 30 or metric == EVAL_AVG_METRIC
                    (line,) = ax.plot(x, y, color=st.color, linestyle=st.linestyle,
                                      linewidth=st.linewidth, marker="o" if sparse else None,
                                      markersize=2.5, label=label)
                    handles.setdefault(label, line)
                    if np.isfinite(sd).any():
                        ax.fill_between(x, y - sd, y + sd, color=st.color, alpha=0.15, linewidth=0)
                    for xi, yi, si, ni in zip(x, y, sd, a["n_seeds"].to_numpy(), strict=True):
                        csv_rows.append(("line", metric, algo, model, arm_label(fp8, clip), fp8, clip,
                                         int(xi), format_number(float(yi)), format_number(float(si)), int(ni), ""))
                    if spec.mark_surge and not surges.empty:
                        srg = select(surges, algo, model, fp8, clip)
                        for s_ in srg.itertuples(index=False):
                            xs = int(s_.surge_step)
                            ys = float(np.interp(xs, x, y))
                            ax.plot([xs], [ys], marker="v", color=st.color, markersize=6,
                                    markeredgecolor="white", markeredgewidth=0.5, linestyle="none",
                                    zorder=5)
                            csv_rows.append(("surge", metric, algo, model, arm_label(fp8, clip), fp8,
                                             clip, xs, format_number(ys), "", "", str(s_.run)))
                if spec.logy:
                    ax.set_yscale("log")
                else:
                    plain_yaxis(ax)
                if r == 0:
                    ax.set_title(f"{algo.upper()} · {model}")
                if (rr + 1, cc) not in occupied:
                    ax.set_xlabel("training step")
                if cc == 0:
                    ax.set_ylabel(ylabel)
                if sub.empty:
                    ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center",
                            color="0.5")
        for rr in range(nrows):
            for cc in range(ncols):
                if (rr, cc) not in occupied:
                    axes[rr][cc].set_visible(False)
        if spec.mark_surge and not surges.empty:
            handles["entropy surge onset"] = plt.Line2D([], [], marker="v", color="0.3",
                                                         linestyle="none", markersize=6)
        ncol = min(len(handles), 2 if ncols == 1 else 4)
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                   ncol=max(ncol, 1), frameon=False)
        fig.suptitle(spec.title, fontsize=9)
        paths = save_figure(fig, out_dir, spec.name, line_caption(coll, spec, rows), pdf=pdf)
        plt.close(fig)
    header = ["kind", "metric", "algorithm", "model", "arm", "fp8", "clip", "step", "mean", "std",
              "n_seeds", "run"]
    csv = pd.DataFrame(csv_rows, columns=header).sort_values(
        ["kind", "metric", "algorithm", "model", "arm", "step", "run"], kind="stable")
    csv.to_csv(paths["csv"], index=False, lineterminator="\n")
    return paths


def line_caption(coll: Collection, spec: FigureSpec, rows) -> str:
    """What a line figure shows and what was run (``analysis.captions``)."""
    layout = ("one row of panels per clip method, one colour per FP8 setting" if any(f for _, f, _ in rows)
              else "one panel column per (algorithm, model), one row per metric, one line per arm")
    how = "each run's curve unsmoothed" if not spec.smooth else "each run's curve after an EMA"
    return (f"{spec.title}: {layout}. Lines: mean over seeds of {how}; bands: ±1 std over seeds "
            f"(arms with two or more seeds). {describe_runs(coll)}")
