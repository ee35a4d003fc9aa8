"""The paper-style curve figure: one panel per FP8 setting, one colour per clip method.

Used for the entropy figure (``analysis.figures`` spec ``entropy``, ``by_granularity=True``).
Panels: one per FP8 setting (BF16, rollout only, tensorwise, rowwise, blockwise, MXFP8, in
the arms' order); with several (algorithm, model) blocks, one row of panels per block, and a
single block with more than three settings wraps into rows of three. The y axis is shared by
all panels of a block, so the BF16 panel is the reference for the FP8 ones.

In a panel, one colour per clip method (vanilla orange, TIS blue, calibrated green: the
Okabe-Ito palette, readable by colour-blind readers; a sweep whose clip values carry variants,
e.g. the calibration ablation, colours them in order from a qualitative palette): the **line**
is the mean over seeds of the per-run EMA-smoothed curves, the **band** the min-max range over
seeds (drawn where an arm has two or more seeds). Surge onsets (``analysis.surge``) are marked
with a triangle on the arm's mean curve. The CSV beside the figure holds the plotted numbers
(``kind=line``: step, mean, std, lo, hi, n_seeds; ``kind=surge``: each run's onset).
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from analysis.arms import (
    CLIP_LABELS,
    FP8_LABELS,
    arm_label,
    arm_order_key,
    select,
    sort_arms,
    split_clip,
)
from analysis.captions import describe_runs
from analysis.collect import Collection
from analysis.curves import (
    MAX_COLS,
    RC,
    FigurePaths,
    arm_curves,
    auto_span,
    format_number,
    panels_of,
    plain_yaxis,
    save_figure,
)
from analysis.surge import SurgeRule, surge_table
from fp8rl.runs import metrics as M

#: Clip-method colours (Okabe-Ito): vanilla orange, TIS blue, calibrated green.
CLIP_COLOURS: dict[str, str] = {"vanilla": "#E69F00", "tis": "#0072B2", "calibrated": "#009E73"}
_VARIANT_PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#F0E442",
                    "#000000", "#999999", "#882255", "#44AA99", "#117733", "#332288", "#DDCC77",
                    "#AA4499", "#88CCEE", "#661100", "#6699CC")
BAND = "min-max over seeds"


MAX_LINES = 6  # clip values per panel before variants are split over panels


def clip_colours(clips) -> dict[str, str]:
    """Colour per clip value (or legend label): the fixed :data:`CLIP_COLOURS` when every value
    is a known base method, else the values in display order through a qualitative palette."""
    clips = sorted({str(c) for c in clips}, key=lambda c: arm_order_key("bf16", c))
    if all(c in CLIP_COLOURS for c in clips):
        return {c: CLIP_COLOURS[c] for c in clips}
    return {c: _VARIANT_PALETTE[i % len(_VARIANT_PALETTE)] for i, c in enumerate(clips)}


def clip_label(clip: str) -> str:
    base, variant = split_clip(clip)
    label = CLIP_LABELS.get(base, base)
    return f"{label} [{variant}]" if variant else label


def facets(arms) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """``(fp8, panel title, [(clip, legend label)])`` per panel of one block, in display order.

    One panel per FP8 setting, one line per clip value. When a sweep has more than
    :data:`MAX_LINES` clip values (variants, e.g. the calibration ablation's eighteen), the
    first option of the variant picks the panel (``clip.period=2``) and the line is labelled by
    the rest (``calibrated [clip.init_bounds=[0.6,1.8] clip.upper_rule=fixed]``), so the same
    label has the same colour in every panel.
    """
    clips = {c for _, c in arms}
    split = len(clips) > MAX_LINES
    out: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for fp8, clip in arms:
        title, label = FP8_LABELS.get(fp8, f"FP8 {fp8}"), clip_label(clip)
        base, variant = split_clip(clip)
        if split and variant:
            first, _, rest = variant.partition(" ")
            title = f"{title} · {first}"
            label = CLIP_LABELS.get(base, base) + (f" [{rest}]" if rest else "")
        out.setdefault((fp8, title), []).append((clip, label))
    return [(fp8, title, lines) for (fp8, title), lines in out.items()]


def plot_by_granularity(
    coll: Collection,
    spec,
    out_dir: str | os.PathLike,
    *,
    smooth: float | None = None,
    surge_rule: SurgeRule = SurgeRule(),  # noqa: B008
    pdf: bool = False,
    panel_width: float = 2.3,
    panel_height: float = 1.8,
) -> FigurePaths | None:
    """Draw ``spec`` (one metric) by FP8 setting into ``out_dir``; None when no run logged it."""
    metric, ylabel = spec.metrics[0], spec.ylabels[0]
    cur = arm_curves(coll, metric, smooth=smooth)
    if cur.empty:
        return None
    blocks = panels_of(coll)
    arms = sort_arms(zip(coll.runs["fp8"].astype(str), coll.runs["clip"].astype(str), strict=True))
    settings = facets(arms)
    colours = clip_colours(lab for _, _, lines in settings for _, lab in lines)
    many = len(blocks) > 1
    if many:  # one row per block, one column per setting
        grid = [[(b, s) for s in settings] for b in blocks]
    else:  # one block: settings wrap into rows of MAX_COLS
        ncol = min(len(settings), MAX_COLS)
        flat = [(blocks[0], s) for s in settings]
        grid = [flat[i:i + ncol] for i in range(0, len(flat), ncol)]
    nrows, ncols = len(grid), max(len(r) for r in grid)
    surges = pd.DataFrame(columns=["run", "surge_step"])
    if spec.mark_surge and metric == M.ACTOR_ENTROPY and M.ACTOR_ENTROPY in coll.steps.columns:
        surges = surge_table(coll.steps, surge_rule).dropna()
        surges = surges.merge(coll.runs[["run", "algorithm", "model", "fp8", "clip"]], on="run", how="left")
    os.makedirs(out_dir, exist_ok=True)
    csv_rows, handles, any_band = [], {}, False
    with plt.rc_context(RC):
        fig, axes = plt.subplots(nrows, ncols, figsize=(panel_width * ncols, panel_height * nrows + 0.7),
                                 squeeze=False, sharex=True, sharey="row" if many else "all",
                                 layout="constrained")
        for r, row in enumerate(grid):
            for c in range(ncols):
                ax = axes[r][c]
                if c >= len(row):
                    ax.set_visible(False)
                    continue
                (algo, model), (fp8, title, lines) = row[c]
                ax.set_title(f"{algo.upper()} · {model} · {title}" if many else title)
                for clip, label in lines:
                    a = select(cur, algo, model, fp8, clip).sort_values("step")
                    if a.empty:
                        continue
                    x, y = a["step"].to_numpy(), a["mean"].to_numpy() * spec.scale
                    lo, hi = a["lo"].to_numpy() * spec.scale, a["hi"].to_numpy() * spec.scale
                    n = a["n_seeds"].to_numpy()
                    col = colours[label]
                    (line,) = ax.plot(x, y, color=col, linewidth=1.4, label=label,
                                      marker="o" if len(a) < 30 else None, markersize=2)
                    handles.setdefault(label, line)
                    if (n >= 2).any():
                        ax.fill_between(x, np.where(n >= 2, lo, y), np.where(n >= 2, hi, y), color=col,
                                        alpha=0.2, linewidth=0)
                        any_band = True
                    for xi, yi, si, li, hi_, ni in zip(x, y, a["std"].to_numpy() * spec.scale, lo, hi, n,
                                                       strict=True):
                        csv_rows.append(("line", metric, algo, model, arm_label(fp8, clip), fp8, clip, int(xi),
                                         format_number(float(yi)), format_number(float(si)),
                                         format_number(float(li)), format_number(float(hi_)), int(ni), ""))
                    for s_ in select(surges, algo, model, fp8, clip).itertuples(index=False) if len(surges) else ():
                        xs = int(s_.surge_step)
                        ys = float(np.interp(xs, x, y))
                        ax.plot([xs], [ys], marker="v", color=col, markersize=6, markeredgecolor="white",
                                markeredgewidth=0.5, linestyle="none", zorder=5)
                        csv_rows.append(("surge", metric, algo, model, arm_label(fp8, clip), fp8, clip, xs,
                                         format_number(ys), "", "", "", "", str(s_.run)))
                if spec.logy:
                    ax.set_yscale("log")
                else:
                    plain_yaxis(ax)
                if c == 0:
                    ax.set_ylabel(ylabel)
                if r == nrows - 1 or (r + 1 < nrows and c >= len(grid[r + 1])):
                    ax.set_xlabel("training step")
        if any_band:
            handles[BAND] = Patch(color="0.5", alpha=0.3, linewidth=0)
        if len(surges):
            handles["entropy surge onset"] = plt.Line2D([], [], marker="v", color="0.3", linestyle="none",
                                                         markersize=6)
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                   ncol=max(1, min(len(handles), (4 if ncols > 1 else 2)
                                   if max(map(len, handles)) < 40 else 2)), frameon=False)
        fig.suptitle(spec.title, fontsize=9)
        n_rows = pd.to_numeric(coll.runs["n_rows"], errors="coerce").max()
        span = smooth if smooth is not None else auto_span(int(n_rows) if n_rows == n_rows else 1)
        caption = granularity_caption(coll, spec, span=span, band=any_band, surges=len(surges) > 0,
                                      rule=surge_rule)
        paths = save_figure(fig, out_dir, spec.name, caption, pdf=pdf)
        plt.close(fig)
    header = ["kind", "metric", "algorithm", "model", "arm", "fp8", "clip", "step", "mean", "std", "lo", "hi",
              "n_seeds", "run"]
    pd.DataFrame(csv_rows, columns=header).sort_values(
        ["kind", "metric", "algorithm", "model", "arm", "step", "run"], kind="stable"
    ).to_csv(paths["csv"], index=False, lineterminator="\n")
    return paths


def granularity_caption(coll: Collection, spec, *, span: float, band: bool, surges: bool,
                        rule: SurgeRule) -> str:
    what = spec.ylabels[0]
    parts = [f"{spec.title}: {what}, one panel per FP8 setting, one colour per clip method.",
             "Lines: mean over seeds of each run's curve"
             + (f" (EMA, span {format_number(float(span))} logged steps)" if span > 1 else " (unsmoothed)")
             + (f"; bands: {BAND} (arms with two or more seeds)." if band
                         else "; one seed per arm, so no band.")]
    if surges:
        parts.append(f"Triangles: entropy surge onsets ({rule.describe()}).")
    parts.append(describe_runs(coll))
    return " ".join(parts)

