"""The dose-response section's three figures (numbers from :mod:`analysis.dose`).

- ``figures/entropy_dose.png`` (:func:`plot_entropy_dose`): the paper's entropy figure regenerated
  from the sweep: one panel per FP dose, ordered by the measured dose (one row of panels per
  (algorithm, model) block), per clip arm the mean over seeds of the EMA-smoothed per-run
  ``actor/entropy`` (:func:`analysis.curves.arm_curves`; span ``smooth`` or
  :func:`analysis.curves.auto_span`) in the method's colour (``analysis.style``), each seed a thin
  line of the same colour, and the block's BF16 vanilla mean dashed black in every panel;
- ``figures/dose_response.png`` (:func:`plot_dose_response`): x the measured dose of each
  precision (its vanilla runs' mean of per-run median ``actor/ratio_std``, log scale), y the
  surge probability with its Wilson 95% interval, one line per clip arm over the FP doses (dodged a few points sideways so
  the intervals do not hide each other), BF16 vanilla a black square;
- ``figures/share_vs_surge.png`` (:func:`plot_share_vs_surge`): one point per run, x its A<0
  share below the bound (its sum of ``actor/n_neg_low`` over its sum of ``actor/n_neg``, in
  percent), y its largest smoothed-entropy rise over the running minimum (nats,
  :func:`analysis.dose.entropy_rise`), colour the clip method (BF16 black), marker the dose,
  filled = surged; dotted: the rule's ``min_rise``.

Each is written with a CSV of the plotted numbers (the entropy figure's: the mean curves, not
the per-seed lines); only finished runs (as the section's tables).
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.transforms as mtransforms
import numpy as np
import pandas as pd

from analysis.arms import CLIP_LABELS, arm_order_key, panel_order_key, select, split_clip
from analysis.captions import describe_runs
from analysis.collect import Collection
from analysis.curves import (
    PAGE_WIDTH,
    RC,
    FigurePaths,
    arm_curves,
    auto_span,
    format_number,
    save_figure,
)
from analysis.dose import BF16, REFERENCE_CLIP, is_fp, label
from analysis.pooling import finished
from analysis.style import REFERENCE_COLOUR, method_colour
from analysis.surge import SurgeRule, ema
from fp8rl.runs import metrics as M

ENTROPY_FIGURE, RESPONSE_FIGURE, SHARE_FIGURE = "entropy_dose", "dose_response", "share_vs_surge"
#: Marker of the n-th dose (measured order); BF16 a square.
DOSE_MARKERS: tuple[str, ...] = ("o", "^", "D", "v", "P", "X", "<", ">")
BF16_MARKER = "s"


def _clip_name(clip: str) -> str:
    base, variant = split_clip(clip)
    return CLIP_LABELS.get(base, base) + (f" [{variant}]" if variant else "")


def _blocks(levels: pd.DataFrame) -> list[tuple[str, str]]:
    pairs = dict.fromkeys(zip(levels["algorithm"].astype(str), levels["model"].astype(str), strict=True))
    return sorted(pairs, key=lambda b: panel_order_key(*b))


def _row_of_panels(n: int, height: float):
    """``(fig, axes [1, n])``: one panel per (algorithm, model) block, side by side."""
    return plt.subplots(1, n, figsize=(3.4 * n + 0.4, height), squeeze=False, layout="constrained")


def _write_csv(rows: list, header: list[str], path: Path) -> None:
    pd.DataFrame(rows, columns=header).to_csv(path, index=False, lineterminator="\n")


def plot_entropy_dose(coll: Collection, levels: pd.DataFrame, out_dir: str | os.PathLike, *,
                      smooth: float | None = None, pdf: bool = False) -> FigurePaths | None:
    """(a) of the module docstring; None without an FP dose with entropy."""
    done = finished(coll)
    if M.ACTOR_ENTROPY not in done.steps.columns:
        return None
    curves = arm_curves(done, M.ACTOR_ENTROPY, smooth=smooth)
    fp = levels[[is_fp(f) for f in levels["fp8"]]]
    blks = _blocks(fp)
    if curves.empty or not blks:
        return None
    ncols = max(int((fp["algorithm"].eq(a) & fp["model"].eq(m)).sum()) for a, m in blks)
    runs = done.runs.set_index(done.runs["run"].astype(str))[["algorithm", "model", "fp8", "clip"]].astype(str)
    st = done.steps[["run", "step", M.ACTOR_ENTROPY]].dropna(subset=[M.ACTOR_ENTROPY])
    csv_rows, handles = [], {}
    with plt.rc_context(RC):
        fig, axes = plt.subplots(len(blks), ncols, figsize=(min(PAGE_WIDTH, 1.9 * ncols) + 0.4, 1.9 * len(blks) + 0.8),
                                 squeeze=False, sharex=True, sharey="row", layout="constrained")
        for i, (algo, model) in enumerate(blks):
            doses = fp[(fp["algorithm"] == algo) & (fp["model"] == model)].sort_values("dose_rank")
            ref = select(curves, algo, model, BF16, REFERENCE_CLIP).sort_values("step")
            for j in range(ncols):
                ax = axes[i][j]
                if j >= len(doses):
                    ax.set_visible(False)
                    continue
                lv = doses.iloc[j]
                mine = select(curves, algo, model, lv["fp8"])
                for clip in sorted(set(mine["clip"].astype(str)), key=lambda c: arm_order_key(lv["fp8"], c)):
                    colour = method_colour(clip)
                    for run in runs.index[(runs["algorithm"] == algo) & (runs["model"] == model)
                                          & (runs["fp8"] == lv["fp8"]) & (runs["clip"] == clip)]:
                        g = st[st["run"].astype(str) == run].sort_values("step")
                        if len(g):
                            span = smooth or auto_span(len(g))
                            v = g[M.ACTOR_ENTROPY].to_numpy(dtype=float)
                            ax.plot(g["step"], ema(v, span) if span > 1 else v, color=colour, linewidth=0.4,
                                    alpha=0.35, gid=f"{lv['fp8']}|{clip}|{run}")
                    a = mine[mine["clip"].astype(str) == clip].sort_values("step")
                    (ln,) = ax.plot(a["step"], a["mean"], color=colour, linewidth=1.4, gid=f"{lv['fp8']}|{clip}")
                    handles.setdefault(_clip_name(clip), ln)
                    csv_rows += [(algo, model, lv["fp8"], clip, int(s), format_number(float(m)), int(n))
                                 for s, m, n in zip(a["step"], a["mean"], a["n_seeds"], strict=True)]
                if len(ref):
                    (ln,) = ax.plot(ref["step"], ref["mean"], color=REFERENCE_COLOUR, linewidth=1.0, linestyle="--",
                                    gid="reference")
                    handles.setdefault("BF16 vanilla (mean)", ln)
                    if j == 0:
                        csv_rows += [(algo, model, BF16, REFERENCE_CLIP, int(s), format_number(float(m)), int(n))
                                     for s, m, n in zip(ref["step"], ref["mean"], ref["n_seeds"], strict=True)]
                title = f"{label(lv['fp8'])} · dose {format(lv['dose_mean'], '.3g')}"
                ax.set_title(f"{algo.upper()} · {model} · {title}" if len(blks) > 1 else title)
                if j == 0:
                    ax.set_ylabel("entropy (nats/token)")
                if i == len(blks) - 1:
                    ax.set_xlabel("training step")
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                   ncol=min(len(handles), 5), frameon=False)
        fig.suptitle("Policy entropy per noise dose (panels ordered by the measured dose)", fontsize=9)
        span_txt = (f"EMA span {format_number(float(smooth))} logged steps" if smooth
                    else "EMA span max(1, round(T / 50)) for a run of T logged steps")
        caption = ("Policy entropy over training, one panel per FP precision ordered by its measured dose (the mean "
                   "over its vanilla runs of each run's median actor/ratio_std, in the title); thick line: the mean "
                   f"over seeds of each run's smoothed curve ({span_txt}) per clip arm, one colour per clip method; "
                   "thin lines: the seeds; dashed black: BF16 vanilla's mean, the same in every panel; finished "
                   f"runs only. {describe_runs(done)}")
        paths = save_figure(fig, out_dir, ENTROPY_FIGURE, caption, pdf=pdf)
        plt.close(fig)
    _write_csv(csv_rows, ["algorithm", "model", "fp8", "clip", "step", "mean", "n_seeds"], paths["csv"])
    return paths


def plot_dose_response(coll: Collection, arms: pd.DataFrame, out_dir: str | os.PathLike, *,
                       rule: SurgeRule, pdf: bool = False) -> FigurePaths | None:
    """(b) of the module docstring; None without an FP arm."""
    blks = _blocks(arms[[is_fp(f) for f in arms["fp8"]]])
    if not blks:
        return None
    csv_rows, handles = [], {}
    with plt.rc_context(RC):
        fig, axes = _row_of_panels(len(blks), 2.6)
        for i, (algo, model) in enumerate(blks):
            ax = axes[0][i]
            blk = arms[(arms["algorithm"] == algo) & (arms["model"] == model)]
            fp = blk[[is_fp(f) for f in blk["fp8"]]]
            clips = sorted(set(fp["clip"]), key=lambda c: arm_order_key("tensorwise", c))
            parts = [(c, fp[fp["clip"] == c]) for c in clips]
            bf16 = blk[(blk["fp8"] == BF16) & (blk["clip"] == REFERENCE_CLIP)]
            if len(bf16):
                parts.append((None, bf16))
            for k, (clip, a) in enumerate(parts):
                a = a[np.isfinite(a["dose_mean"].to_numpy(dtype=float))].sort_values("dose_mean")
                if a.empty:
                    continue
                dx = (k - (len(parts) - 1) / 2) * 3.0
                shift = mtransforms.offset_copy(ax.transData, fig=fig, x=dx, y=0.0, units="points")
                x, y = a["dose_mean"].to_numpy(dtype=float), a["p_surge"].to_numpy(dtype=float)
                err = [y - a["p_lo"].to_numpy(dtype=float), a["p_hi"].to_numpy(dtype=float) - y]
                colour = REFERENCE_COLOUR if clip is None else method_colour(clip)
                name = "BF16 vanilla" if clip is None else _clip_name(clip)
                h = ax.errorbar(x, y, yerr=err, transform=shift, color=colour, marker=BF16_MARKER if clip is None else "o",
                                markersize=3.5, linewidth=1.2, elinewidth=0.8, capsize=2,
                                linestyle="none" if clip is None else "-", gid=name)
                handles.setdefault(name, h)
                csv_rows += [(algo, model, r.fp8, r.clip, format_number(float(r.dose_mean)), int(r.surged), int(r.runs),
                              format_number(float(r.p_surge)), format_number(float(r.p_lo)),
                              format_number(float(r.p_hi))) for r in a.itertuples(index=False)]
            doses = blk["dose_mean"].to_numpy(dtype=float)
            pos = doses[np.isfinite(doses) & (doses > 0)]
            ax.set_xscale("log")  # the doses span orders of magnitude (FP8 ~0.1, NVFP4 ~10)
            if len(pos):  # the dodge's transform keeps the points out of autoscaling
                ax.set_xlim(float(pos.min()) / 1.6, 1.6 * float(pos.max()))
            ax.set_ylim(-0.03, 1.03)
            ax.set_xlabel("measured dose: actor/ratio_std (log scale)")
            ax.set_ylabel("surge probability")
            if len(blks) > 1:
                ax.set_title(f"{algo.upper()} · {model}")
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                   ncol=min(len(handles), 5), frameon=False)
        fig.suptitle("Surge probability against the measured noise dose", fontsize=9)
        caption = ("Surge probability per arm against its precision's measured dose (the mean over the precision's "
                   "vanilla runs of each run's median actor/ratio_std; log scale), one line per clip arm over the FP precisions, "
                   "BF16 vanilla a black square; error bars: Wilson's 95% interval of the proportion of runs (seeds) "
                   f"that surged (points dodged a few points sideways); surge: {rule.describe()}; finished runs only. "
                   f"{describe_runs(finished(coll))}")
        paths = save_figure(fig, out_dir, RESPONSE_FIGURE, caption, pdf=pdf)
        plt.close(fig)
    _write_csv(csv_rows, ["algorithm", "model", "fp8", "clip", "dose", "surged", "runs", "p_surge", "p_lo", "p_hi"],
               paths["csv"])
    return paths


def plot_share_vs_surge(coll: Collection, runs: pd.DataFrame, levels: pd.DataFrame, out_dir: str | os.PathLike, *,
                        rule: SurgeRule, pdf: bool = False) -> FigurePaths | None:
    """(c) of the module docstring; None without a run with both numbers."""
    ok = runs[np.isfinite(runs["share"].to_numpy(dtype=float)) & np.isfinite(runs["rise"].to_numpy(dtype=float))]
    blks = _blocks(levels)
    if ok.empty or not blks:
        return None
    csv_rows, handles = [], {}
    with plt.rc_context(RC):
        fig, axes = _row_of_panels(len(blks), 2.8)
        for i, (algo, model) in enumerate(blks):
            ax = axes[0][i]
            lv = levels[(levels["algorithm"] == algo) & (levels["model"] == model)].sort_values("dose_rank")
            fp_ranks = [f for f in lv["fp8"] if is_fp(f)]
            for fp8 in lv["fp8"]:
                marker = BF16_MARKER if not is_fp(fp8) else DOSE_MARKERS[fp_ranks.index(fp8) % len(DOSE_MARKERS)]
                mine = ok[(ok["algorithm"] == algo) & (ok["model"] == model) & (ok["fp8"] == fp8)]
                for clip in sorted(set(mine["clip"]), key=lambda c, f=fp8: arm_order_key(f, c)):
                    a = mine[mine["clip"] == clip]
                    colour = REFERENCE_COLOUR if not is_fp(fp8) else method_colour(clip)
                    for surged, face in ((True, colour), (False, "none")):
                        b = a[a["surged"] == surged]
                        if len(b):
                            ax.scatter(100 * b["share"], b["rise"], marker=marker, s=16, facecolors=face,
                                       edgecolors=colour, linewidths=0.8, gid=f"{fp8}|{clip}|{surged}")
                    handles.setdefault(f"colour: {_clip_name(clip)}" if is_fp(fp8) else "BF16 vanilla (black square)",
                                       plt.Line2D([], [], color=colour, marker="o" if is_fp(fp8) else BF16_MARKER,
                                                  linestyle="none", markersize=4))
                    csv_rows += [(algo, model, r.run, r.fp8, r.clip, r.seed, format_number(float(r.share)),
                                  format_number(float(r.rise)), bool(r.surged),
                                  "" if pd.isna(r.surge_step) else int(r.surge_step)) for r in a.itertuples(index=False)]
                if is_fp(fp8):
                    handles.setdefault(f"marker: {label(fp8)}", plt.Line2D([], [], color="0.4", marker=marker,
                                                                           linestyle="none", markersize=4))
            ax.axhline(rule.min_rise, color="0.5", linestyle=":", linewidth=0.8, gid="min_rise")
            ax.set_xlabel("A<0 tokens below the bound (% of A<0 tokens)")
            ax.set_ylabel("max smoothed entropy rise (nats)")
            if len(blks) > 1:
                ax.set_title(f"{algo.upper()} · {model}")
        handles["filled: surged, hollow: not"] = plt.Line2D([], [], color="0.4", marker="o", markerfacecolor="none",
                                                            linestyle="none", markersize=4)
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center", ncol=3, frameon=False)
        fig.suptitle("Per run: A<0 share below the bound against the entropy rise", fontsize=9)
        caption = ("One point per finished run: x its A<0 tokens below the lower bound in force as a share of its A<0 "
                   "tokens (sum of actor/n_neg_low over its steps / sum of actor/n_neg), y the largest amount by which "
                   f"its entropy, EMA-smoothed with span {format_number(rule.span)}, exceeds the running minimum of that "
                   f"curve after step {rule.warmup} (nats); colour: clip method (BF16 black), marker: precision; filled: "
                   f"the run surged ({rule.describe()}); dotted: the rule's {format_number(rule.min_rise)}-nat floor. "
                   f"{describe_runs(finished(coll))}")
        paths = save_figure(fig, out_dir, SHARE_FIGURE, caption, pdf=pdf)
        plt.close(fig)
    _write_csv(csv_rows, ["algorithm", "model", "run", "fp8", "clip", "seed", "share", "rise", "surged", "surge_step"],
               paths["csv"])
    return paths
