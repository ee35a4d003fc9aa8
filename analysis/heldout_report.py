"""The report's held-out judgement: three tables, a figure and the default-mode verdict.

The numbers and every method choice are :mod:`analysis.heldout_judgement`'s; this module renders
them:

- ``tables/heldout_ratio.*`` (a, b): per block, granularity and arm, the deployed bound's held-out
  ratio on the tokens that did not set it (ratio of sums over seeds, Fieller's paired 95%
  interval), the BF16 events it rests on and alpha n beside it (calibrating arms; "-" otherwise),
  the held-out rows' own ratio, ``ho_grad_cos`` (mean, 95% t interval);
- ``tables/heldout_paired.*`` (c): each calibrated mode against ``no_lower_clip``, ``wide_lower``
  and ``tis``, paired by seed, per granularity and measure, with the Holm-adjusted p-value and
  whether it survives (family: one block x calibrated mode x comparator, its measures x
  granularities);
- ``tables/heldout_rule.*`` (d): per calibrated mode and granularity the rule's two conditions,
  and under it the verdict (:func:`analysis.heldout_judgement.default_mode_rule`);
- ``figures/heldout_ratio.png`` / ``.csv`` (e): one panel per (block, granularity), per arm the
  held-out ratio with its 95% interval, the target range [0.8, 1.25] shaded, BF16 (1) dashed.

Sweeps whose runs never logged ``shadow/ho_*`` (every sweep published before the held-out rows)
get no section and no file: :func:`heldout_sections` returns nothing, so their published reports
stay byte for byte what they were, and :func:`no_data_line` is the line ``analysis.report`` prints
instead.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd

from analysis.arms import CLIP_LABELS
from analysis.captions import describe_runs
from analysis.collect import Collection
from analysis.curves import RC, FigurePaths, format_number, save_figure
from analysis.heldout import mean_text
from analysis.heldout_judgement import (
    COMPARATORS,
    CONTROLS,
    FWER,
    RATIO_RANGE,
    arm_rows,
    comparison_rows,
    default_mode_rule,
    has_holdout,
    rule_rows,
    run_holdout,
)
from analysis.style import REFERENCE_COLOUR, method_colour, variant_style
from analysis.tabulate import Table, render_blocks

FIGURE = "heldout_ratio"
#: The figure's x axis: symmetric-log (linear below 0.5, so ``no_lower_clip``'s 0 is drawn), up to
#: this ratio; an interval reaching beyond (or unbounded) ends in an arrow.
X_MAX = 16.0
#: Where a ratio beyond X_MAX is drawn (a right-pointing triangle; the CSV keeps its value).
X_EDGE = X_MAX * 1.25
X_TICKS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
NO_DATA = ("no held-out data: no run logged the held-out rows' counts (`shadow/ho_*`, "
           "`clip.holdout_share` > 0), so there is no held-out judgement")
MEASURE_LABELS = {"ratio_dist": "abs(held-out ratio − 1)", "grad_cos": "held-out grad_cos"}


def no_data_line(coll: Collection) -> str:
    """The sentence saying no run logged held-out counts; "" when some run did."""
    return "" if has_holdout(coll) else NO_DATA[0].upper() + NO_DATA[1:] + "."


def _num(x, fmt: str) -> str:
    return format(float(x), fmt) if x is not None and np.isfinite(float(x)) else "n/a"


def ratio_table(arms: pd.DataFrame, *, name: str = "heldout_ratio") -> Table:
    header = ["Granularity", "arm", "mode", "seeds", "unseen A<0", "BF16-clipped", "FP8-clipped",
              "held-out ratio (95% CI)", "alpha n", "after the first quarter (95% CI)",
              "held-out rows: BF16 / FP8-clipped", "ho_grad_cos (95% CI)"]

    def cells(r, latex: bool) -> list[str]:
        ratio = mean_text(r["ratio_mean"], r["ratio_lo"], r["ratio_hi"], int(r["ratio_n"]), fmt=".3f")
        alpha = _num(r["alpha_n"], ".2f") if r["method"] == "calibrated" else "-"
        return [r["granularity"], r["arm"], r["mode"], str(r["runs"]), _num(r["un_n_neg"], ".0f"),
                _num(r["un_bf16"], ".0f"), _num(r["un_fp8"], ".0f"), ratio, alpha,
                mean_text(r["late_mean"], r["late_lo"], r["late_hi"], int(r["ratio_n"]), fmt=".3f"),
                f"{_num(r['ho_bf16'], '.0f')} / {_num(r['ho_fp8'], '.0f')}",
                mean_text(r["cos_mean"], r["cos_lo"], r["cos_hi"], int(r["cos_n"]))]

    md, tex = render_blocks(arms, header, cells, lambda a, m, g: (
        "unseen A<0 tokens: those with a BF16 shadow that did not set the bound in force on them (every "
        "token of an arm whose bounds come from earlier steps or from no tokens; under same_batch the "
        "held-out rows only); held-out ratio: FP8 below the bound in force / BF16 shadow below 1 - eps_low, "
        "ratio of sums over seeds, Fieller's 95% interval paired by seed (cut at 0; inf: BF16's count not "
        "significantly above 0); BF16-clipped: the events it rests on; alpha n: mean `clip/alpha_n` (the "
        "BF16-clipped count each calibration could expect); after the first quarter: the same ratio over the "
        "steps after the first 25% of each run (exploratory, added after the first results: the start-up "
        "transient of the bounds pooled from earlier steps); held-out rows: the seeded rows every arm of a "
        "seed holds out, never fed to any calibration; ho_grad_cos: their policy gradient's cosine to "
        "BF16's, mean over seeds of each run's mean, 95% Student-t interval"))
    return Table.from_lines(name, arms, md, tex, empty=NO_DATA[0].upper() + NO_DATA[1:] + ".")


def paired_table(comp: pd.DataFrame, *, name: str = "heldout_paired") -> Table:
    header = ["calibrated mode", "against", "Granularity", "measure", "pairs", "difference (95% CI)", "t", "p",
              "p (Holm)", "survives", "favours"]
    df = comp.copy()

    def cells(r, latex: bool) -> list[str]:
        fmt = ".3f" if r["measure"] == "ratio_dist" else ".4f"
        return [r["mode"] or r["clip"], r["comparator"], r["granularity"], MEASURE_LABELS[r["measure"]],
                str(r["pairs"]), mean_text(r["diff_mean"], r["diff_lo"], r["diff_hi"], int(r["pairs"]), fmt=fmt,
                                           signed=True),
                _num(r["t"], ".2f"), _num(r["p"], ".3g"), _num(r["p_holm"], ".3g"),
                "yes" if r["survives"] else "no", r["favours"] or "-"]

    md, tex = render_blocks(df, header, cells, lambda a, m, g: (
        f"each calibrated mode against {', '.join(COMPARATORS)}, paired by seed (same prompts and held-out "
        "rows; abs(ratio − 1) from each seed's own unseen-token ratio, a seed without a BF16-clipped unseen "
        "token in either arm does not pair): mean "
        "of the per-seed differences calibrated − comparator, 95% t interval, paired t and its two-sided "
        f"p; Holm correction within each (calibrated mode, comparator) family of measures x granularities "
        f"({len(g['measure'].unique())} x {len(g['fp8'].unique())} here), survives: adjusted p < {FWER}; "
        "abs(held-out ratio − 1): lower is closer to BF16; grad_cos: higher is closer"))
    return Table.from_lines(name, df, md, tex, empty="No calibrated arm with a comparator that logged held-out data.")


def rule_table(rules: pd.DataFrame, *, name: str = "heldout_rule") -> Table:
    verdict = default_mode_rule(rules)
    header = ["calibrated mode", "Granularity", "shadow s/step (not ranked)", "held-out ratio (95% CI)",
              f"within [{RATIO_RANGE[0]}, {RATIO_RANGE[1]}]", "best control", "grad_cos − best control (95% CI)",
              "no worse"]

    def cells(r, latex: bool) -> list[str]:
        lo, hi = float(r["ratio_lo"]), float(r["ratio_hi"])
        within = "n/a" if not (np.isfinite(lo) and np.isfinite(hi)) else (
            "yes" if RATIO_RANGE[0] <= lo and hi <= RATIO_RANGE[1] else "no")
        dh = float(r["cos_diff_hi"])
        return [r["mode"], r["granularity"], _num(r["cost"], ".3f"),
                mean_text(r["ratio_mean"], lo, hi, 2 if np.isfinite(lo) else 1, fmt=".3f"),
                within, r["best_control"] or "none",
                mean_text(r["cos_diff_mean"], r["cos_diff_lo"], dh, int(r["cos_pairs"]), signed=True),
                "n/a" if not np.isfinite(dh) else ("yes" if dh >= 0 else "no")]

    md, tex = render_blocks(rules, header, cells, lambda a, m, g: (
        f"the default-mode rule's two conditions per calibrated mode and granularity; best control: the "
        f"one of {', '.join(CONTROLS)} with the highest mean held-out grad_cos; no worse: the paired "
        "difference's 95% t interval reaches 0 or above"))
    md += ["", verdict.text]
    tex.append(f"% {verdict.text}")
    return Table.from_lines(name, rules, md, tex, empty="No calibrated arm with held-out data.")


def plot_heldout_ratio(coll: Collection, arms: pd.DataFrame, out_dir: str | os.PathLike, *,
                       pdf: bool = False) -> FigurePaths | None:
    """(e): one panel per (block, granularity) of an FP8 arm; None without held-out data."""
    fp8_arms = arms[arms["fp8"] != "bf16"]
    if fp8_arms.empty:
        return None
    panels = list(dict.fromkeys(zip(fp8_arms["algorithm"], fp8_arms["model"], fp8_arms["fp8"], strict=True)))
    ncols = min(len(panels), 2)
    nrows = math.ceil(len(panels) / ncols)
    n_arms = max(len(fp8_arms[(fp8_arms["algorithm"] == a) & (fp8_arms["model"] == m) & (fp8_arms["fp8"] == f)])
                 for a, m, f in panels)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_rows = []
    any_off = False
    with plt.rc_context(RC):
        fig, axes = plt.subplots(nrows, ncols, figsize=(3.4 * ncols + 0.6, (0.5 + 0.2 * n_arms) * nrows + 0.5),
                                 squeeze=False, sharex=True, layout="constrained")
        for i, (algo, model, fp8) in enumerate(panels):
            ax = axes[i // ncols][i % ncols]
            a = fp8_arms[(fp8_arms["algorithm"] == algo) & (fp8_arms["model"] == model)
                         & (fp8_arms["fp8"] == fp8)].reset_index(drop=True)
            y = np.arange(len(a))[::-1]
            ax.axvspan(*RATIO_RANGE, color="0.9", zorder=0, gid="target")
            ax.axvline(1.0, color=REFERENCE_COLOUR, linestyle="--", linewidth=0.8, gid="reference")
            calibrated = [c for c in a["clip"] if c.startswith("calibrated")]
            for yi, r in zip(y, a.itertuples(index=False), strict=True):
                k = calibrated.index(r.clip) if r.clip in calibrated else 0
                m_, lo, hi = float(r.ratio_mean), float(r.ratio_lo), float(r.ratio_hi)
                # a ratio beyond the axis (few BF16-clipped tokens, a strong dose): a triangle at its edge
                off_axis = np.isfinite(m_) and m_ > X_MAX
                any_off = any_off or off_axis
                at = X_EDGE if off_axis else m_
                shown = min(hi, X_MAX) if np.isfinite(m_) else hi
                err = [[max(at - lo, 0.0) if np.isfinite(lo) else 0.0],
                       [max(shown - at, 0.0) if np.isfinite(shown) else 0.0]]
                colour = method_colour(r.clip)
                ax.errorbar([at], [yi], xerr=err, fmt=">" if off_axis else variant_style(k)[1] or "o",
                            color=colour, markersize=3.5, elinewidth=1.0, capsize=2,
                            gid=f"{fp8}|{r.clip}" + ("|off_axis" if off_axis else ""))
                if np.isfinite(m_) and hi > X_MAX and not off_axis:  # beyond the axis or unbounded: an arrow
                    ax.annotate("", xy=(X_EDGE, yi), xytext=(max(m_, shown), yi), textcoords="data",
                                arrowprops={"arrowstyle": "->", "color": colour, "lw": 1.0},
                                gid=f"{fp8}|{r.clip}|beyond")
                csv_rows.append((algo, model, fp8, r.arm, r.clip, r.mode, format_number(m_), format_number(lo),
                                 format_number(hi), int(r.ratio_n)))
            ax.set_yticks(y, [CLIP_LABELS.get(r.method, r.method) + (f" ({r.mode})" if r.method == "calibrated" else "")
                              for r in a.itertuples(index=False)])
            ax.tick_params(axis="y", length=0)
            ax.grid(axis="y", visible=False)
            ax.set_title(f"{algo.upper()} · {model} · {a['granularity'].iloc[0]}")
            ax.set_xscale("symlog", linthresh=0.5, linscale=0.6)
            ax.set_xlim(0.0, X_MAX * 1.3)
            ax.set_xticks(X_TICKS, [format(t, "g") for t in X_TICKS])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            if i // ncols == nrows - 1 or i + ncols >= len(panels):
                ax.set_xlabel("held-out ratio, FP8 / BF16-clipped A<0")
        for j in range(len(panels), nrows * ncols):
            axes[j // ncols][j % ncols].set_visible(False)
        fig.suptitle("Held-out ratio of the deployed lower bound per arm; dashed: BF16 (1)", fontsize=9)
        caption = ("Held-out ratio of the deployed lower bound per arm and granularity: the A<0 tokens that did "
                   "not set the bound in force on them (under same_batch the held-out rows only) FP8 puts below "
                   "that bound, over those the BF16 shadow puts below 1 - eps_low, summed over steps and seeds; "
                   "error bar: Fieller's 95% interval paired by seed (cut at 0; an arrow: beyond the axis or unbounded"
                   + (f"; a triangle at the edge: a ratio above {X_MAX:g}, its value in the CSV" if any_off else "")
                   + "); "
                   "symmetric-log axis; shaded: "
                   f"[{RATIO_RANGE[0]}, {RATIO_RANGE[1]}]; dashed: BF16 (1). {describe_runs(coll)}")
        paths = save_figure(fig, out_dir, FIGURE, caption, pdf=pdf)
        plt.close(fig)
    header = ["algorithm", "model", "fp8", "arm", "clip", "mode", "mean", "lo", "hi", "n_seeds"]
    pd.DataFrame(csv_rows, columns=header).to_csv(paths["csv"], index=False, lineterminator="\n")
    return paths


def heldout_sections(coll: Collection, tab_dir: str | os.PathLike, fig_dir: str | os.PathLike | None = None, *,
                     pdf: bool = False) -> list[tuple[str, list[str]]]:
    """Write the held-out tables (and the figure when ``fig_dir`` is given) and return the report's
    section for them; [] when no run logged held-out counts (module docstring)."""
    if not has_holdout(coll):
        return []
    per_run = run_holdout(coll)
    arms = arm_rows(coll, per_run)
    tables = [ratio_table(arms), paired_table(comparison_rows(coll, per_run)), rule_table(rule_rows(coll, per_run))]
    for t in tables:
        t.write(tab_dir)
    lines = []
    if fig_dir is not None:
        paths = plot_heldout_ratio(coll, arms, fig_dir, pdf=pdf)
        if paths is not None:
            lines += [f"![Held-out ratio per arm](figures/{FIGURE}.png)", "",
                      f"*{paths.caption}* [data](figures/{FIGURE}.csv)", ""]
    titles = ("The deployed bound's held-out ratio and grad_cos", "Calibrated modes against the controls, paired "
              "by seed (Holm)", "The default-mode rule")
    for title, t in zip(titles, tables, strict=True):
        lines += [f"**{title}** (tables/{t.name}.md)", "", t.markdown, ""]
    return [("Held-out judgement: the deployed bounds on rows no calibration saw", lines)]
