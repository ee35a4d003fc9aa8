"""The line figures: one panel per FP8 setting, one colour per clip method.

Every line figure of the report (``analysis.figures``) is drawn here, like the paper's entropy
figure. Panels: one per FP8 setting (BF16, rollout only, tensorwise, rowwise, blockwise,
MXFP8, in the arms' order); with several (algorithm, model) blocks or several metrics, one row
of panels per (block, metric), and a single row of more than three settings wraps into rows of
three. Every panel of one metric shares its y axis (the BF16 panel is the reference for the FP8
ones, and two rows are never on different scales).

In a panel, one colour per clip method (``analysis.style``: vanilla orange, TIS blue, calibrated
green; the same in every figure of every report): the **line** is the mean over seeds of the
per-run EMA-smoothed curves, the **band** the 95% Student-t interval of that mean, cut to the
metric's range (a fraction's band never goes below 0 %; drawn where an arm has two or more
seeds). Over every FP8 panel the block's BF16 reference arm (BF16 vanilla, else the first BF16
arm) is drawn as a thin black line. Variants of one method (the calibration ablation) keep its
colour and differ by line style and marker; a sweep with more than :data:`MAX_LINES` clip values
puts the first option of the variant in the panel title. Surge onsets (``analysis.surge``) are
marked with a triangle on the arm's mean curve.

``paired`` specs (``entropy_vs_bf16``) draw each run's curve minus the BF16 reference run of the
same seed (same warm start, same prompts), so differences of 1e-3 nats that the seeds' spread
hides are visible; the black line is then zero. A metric identical to an earlier one of the same
figure in every run (the mini backend's ``rollout/acc`` is its ``rollout/reward_mean``) is drawn
once and the caption says so. The CSV beside the figure holds the plotted numbers (``kind=line``:
step, mean, std, lo, hi (the band), n_seeds; ``kind=surge``: each run's onset).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

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
from analysis.pooling import unfinished
from analysis.style import BAND_TEXT, REFERENCE_COLOUR, method_colour, variant_style
from analysis.surge import SurgeRule, surge_table
from analysis.tabulate import bf16_reference, blocks
from fp8rl.runs import metrics as M

BAND = "band: 95% t interval of the mean"
MAX_LINES = 6  # clip values per panel before variants are split over panels
MAX_PANELS = 12  # panels per image: a figure with more is split (split_panels)


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
    label has the same style in every panel.
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


def _line_styles(settings) -> dict[str, tuple[str, str | None]]:
    """(line style, marker) per legend label: the variants of each method in display order."""
    by_method: dict[str, list[tuple[tuple, str]]] = {}
    for _, _, lines in settings:
        for clip, label in lines:
            entry = (arm_order_key("bf16", clip), label)
            lst = by_method.setdefault(split_clip(clip)[0], [])
            if label not in [lab for _, lab in lst]:
                lst.append(entry)
    out = {}
    for lst in by_method.values():
        for i, (_, label) in enumerate(sorted(lst)):
            out[label] = variant_style(i)
    return out


def duplicate_metrics(coll: Collection, metrics) -> dict[str, str]:
    """{metric: earlier metric it equals in every run} among ``metrics`` (same steps, same values)."""
    st = coll.steps
    out: dict[str, str] = {}
    for j, b in enumerate(metrics):
        for a in metrics[:j]:
            if a in out or a not in st.columns or b not in st.columns:
                continue
            x, y = st[a].to_numpy(dtype=float), st[b].to_numpy(dtype=float)
            both = np.isfinite(x) | np.isfinite(y)
            if both.any() and np.array_equal(np.isfinite(x), np.isfinite(y)) and np.allclose(x[both], y[both]):
                out[b] = a
                break
    return out


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
    """Draw ``spec`` by FP8 setting into ``out_dir``; None when no run logged its metrics."""
    paired = getattr(spec, "paired", False)
    blks = panels_of(coll)
    block_dups = {b: duplicate_metrics(_block(coll, *b), list(spec.metrics)) for b in blks}
    dups = duplicate_metrics(coll, list(spec.metrics))
    rows_m = [(m, lab) for m, lab in zip(spec.metrics, spec.ylabels, strict=True) if m not in dups]
    span = smooth if spec.smooth else 1.0
    curves = {m: arm_curves(coll, m, smooth=span, paired=paired) for m, _ in rows_m}
    if all(c.empty for c in curves.values()):
        return None
    arms = sort_arms(zip(coll.runs["fp8"].astype(str), coll.runs["clip"].astype(str), strict=True))
    settings = facets(arms)
    styles = _line_styles(settings)
    refs = {(a, m): bf16_reference(arms_) for a, m, arms_ in blocks(coll)}
    rows = [(b, m, lab) for b in blks for m, lab in rows_m if m not in block_dups[b]]
    # a metric no run of a block logged (clip/alpha without a calibrated arm) gets no row of panels
    unlogged: dict[str, list] = {}
    for b, m, _ in rows:
        if select(curves[m], *b).empty:
            unlogged.setdefault(m, []).append(b)
    rows = [r for r in rows if r[0] not in unlogged.get(r[1], [])]
    pieces = split_panels(rows, settings)
    many = len(blks) > 1
    os.makedirs(out_dir, exist_ok=True)
    draw = dict(spec=spec, coll=coll, curves=curves, refs=refs, styles=styles, paired=paired,
                panel_width=panel_width, panel_height=panel_height)
    surges = pd.DataFrame(columns=["run", "surge_step"])
    if spec.mark_surge and M.ACTOR_ENTROPY in spec.metrics and M.ACTOR_ENTROPY in coll.steps.columns and not paired:
        surges = surge_table(coll.steps, surge_rule).dropna()
        surges = surges.merge(coll.runs[["run", "algorithm", "model", "fp8", "clip"]], on="run", how="left")
    csv_rows, any_band = [], False
    figs = []
    with plt.rc_context(RC):
        for slug, label, grid in pieces:
            fig, band = _draw(grid, surges=surges, csv_rows=csv_rows, block_titles=many and not label,
                              title=f"{spec.title} — {label}" if label else spec.title, **draw)
            any_band |= band
            figs.append((slug, label, fig))
        n_rows = pd.to_numeric(coll.runs["n_rows"], errors="coerce").max()
        span_txt = span if span is not None else auto_span(int(n_rows) if n_rows == n_rows else 1)
        partial = {m: [b for b in blks if m in block_dups[b]] for m in spec.metrics if m not in dups}
        caption = granularity_caption(coll, spec, span=span_txt, band=any_band, surges=len(surges) > 0,
                                      rule=surge_rule, dups=dups,
                                      block_dups={m: (block_dups[bs[0]][m], bs) for m, bs in partial.items() if bs},
                                      unlogged=unlogged)
        parts, saved = [], []
        for slug, label, fig in figs:
            name = f"{spec.name}-{slug}" if slug else spec.name
            p = save_figure(fig, out_dir, name, f"{caption} Panels: {label}." if label else caption, pdf=pdf)
            plt.close(fig)
            parts.append((p["png"], label))
            saved.append(p)
    paths = FigurePaths(png=parts[0][0], csv=Path(out_dir) / f"{spec.name}.csv")
    if "pdf" in saved[0]:
        paths["pdf"] = saved[0]["pdf"]
    paths.caption = caption
    paths.parts = parts if len(parts) > 1 else None
    header = ["kind", "metric", "algorithm", "model", "arm", "fp8", "clip", "step", "mean", "std", "lo", "hi",
              "n_seeds", "run"]
    pd.DataFrame(csv_rows, columns=header).sort_values(
        ["kind", "metric", "algorithm", "model", "arm", "step", "run"], kind="stable"
    ).to_csv(paths["csv"], index=False, lineterminator="\n")
    return paths


def _block(coll: Collection, algo: str, model: str) -> Collection:
    """``coll`` with only the steps of one (algorithm, model) block (for per-block duplicates)."""
    import dataclasses

    st = coll.steps
    keep = (st["algorithm"].astype(str) == algo) & (st["model"].astype(str) == model) if len(st) else []
    return dataclasses.replace(coll, steps=st[keep] if len(st) else st)


def _layout(rows, settings) -> list[list]:
    """The panel grid of ``rows`` x ``settings``; one row of more than three panels wraps into threes."""
    if len(rows) == 1 and len(settings) > MAX_COLS:  # one block, one metric: wrap into rows of three
        return [[(rows[0], s) for s in settings[i:i + MAX_COLS]] for i in range(0, len(settings), MAX_COLS)]
    return [[(r, s) for s in settings] for r in rows]


def _slug(*parts: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")


def split_panels(rows, settings) -> list[tuple[str, str, list[list]]]:
    """``(file suffix, label, grid)`` per image of a figure: one image when it has at most
    :data:`MAX_PANELS` panels; else one per (algorithm, model) block (what a reader compares: the FP8
    settings and clip methods of one block), and one per (block, metric) where a block alone has more;
    a row of more than :data:`MAX_PANELS` settings is cut into images of that many."""
    def size(grid):
        return sum(len(r) for r in grid)

    if size(_layout(rows, settings)) <= MAX_PANELS:
        return [("", "", _layout(rows, settings))]
    out = []
    for b in dict.fromkeys(r[0] for r in rows):
        mine = [r for r in rows if r[0] == b]
        block = f"{b[0].upper()} · {b[1]}"
        if size(_layout(mine, settings)) <= MAX_PANELS:
            out.append((_slug(*b), block, _layout(mine, settings)))
            continue
        for r in mine:
            label = f"{block} · {r[2]}" if len(mine) > 1 else block
            slug = _slug(*b, r[1].replace("/", "-")) if len(mine) > 1 else _slug(*b)
            chunks = [settings[i:i + MAX_PANELS] for i in range(0, len(settings), MAX_PANELS)]
            for k, chunk in enumerate(chunks):
                suffix = (f"-{k + 1}", f" ({k + 1} of {len(chunks)})") if len(chunks) > 1 else ("", "")
                out.append((slug + suffix[0], label + suffix[1], _layout([r], chunk)))
    return out


def _draw(grid, *, spec, coll, curves, refs, styles, paired, surges, csv_rows, block_titles, title,
          panel_width, panel_height):
    """One image of a line figure: the panels of ``grid``; returns (figure, whether a band was drawn)."""
    nrows, ncols = len(grid), max(len(r) for r in grid)
    handles, any_band = {}, False
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_width * ncols, panel_height * nrows + 0.7),
                             squeeze=False, sharex=True, layout="constrained")
    first_of: dict[str, object] = {}
    for r, row in enumerate(grid):
        for c in range(ncols):
            ax = axes[r][c]
            if c >= len(row):
                ax.set_visible(False)
                continue
            ((algo, model), metric, ylabel), (fp8, ftitle, lines) = row[c]
            if metric in first_of:
                ax.sharey(first_of[metric])
            else:
                first_of[metric] = ax
            ax.set_title(f"{algo.upper()} · {model} · {ftitle}" if block_titles else ftitle)
            cur = curves[metric]
            ref = refs.get((algo, model))
            if paired:
                ax.axhline(0.0, color=REFERENCE_COLOUR, linewidth=0.8, linestyle="--", gid="reference")
                handles.setdefault(f"{arm_label(*ref)} (same seed)" if ref else "BF16",
                                   plt.Line2D([], [], color=REFERENCE_COLOUR, linewidth=0.8, linestyle="--"))
            elif ref is not None and fp8 != ref[0]:
                a = select(cur, algo, model, *ref).sort_values("step")
                if len(a):
                    (ln,) = ax.plot(a["step"], a["mean"] * spec.scale, color=REFERENCE_COLOUR, linewidth=0.8,
                                    zorder=1.5, gid="reference")
                    handles.setdefault(f"BF16 reference ({arm_label(*ref)})", ln)
            for clip, label in lines:
                a = select(cur, algo, model, fp8, clip).sort_values("step")
                if a.empty:
                    continue
                x, y = a["step"].to_numpy(), a["mean"].to_numpy() * spec.scale
                lo, hi = a["lo"].to_numpy() * spec.scale, a["hi"].to_numpy() * spec.scale
                n = a["n_seeds"].to_numpy()
                col = method_colour(clip)
                ls, marker = styles[label]
                sparse = len(a) < 30
                (line,) = ax.plot(x, y, color=col, linewidth=1.4, linestyle=ls, label=label,
                                  marker=marker or ("o" if sparse else None), markersize=2, gid=f"{fp8}|{clip}")
                handles.setdefault(label, line)
                has = np.isfinite(lo) & np.isfinite(hi)
                if has.any():
                    ax.fill_between(x, np.where(has, lo, y), np.where(has, hi, y), color=col, alpha=0.2,
                                    linewidth=0, gid=f"{fp8}|{clip}|band")
                    any_band = True
                for xi, yi, si, li, hi_, ni in zip(x, y, a["std"].to_numpy() * spec.scale, lo, hi, n,
                                                   strict=True):
                    csv_rows.append(("line", metric, algo, model, arm_label(fp8, clip), fp8, clip, int(xi),
                                     format_number(float(yi)), format_number(float(si)),
                                     format_number(float(li)), format_number(float(hi_)), int(ni), ""))
                if metric == M.ACTOR_ENTROPY and len(surges):
                    for s_ in select(surges, algo, model, fp8, clip).itertuples(index=False):
                        xs = int(s_.surge_step)
                        ys = float(np.interp(xs, x, y))
                        ax.plot([xs], [ys], marker="v", color=col, markersize=6, markeredgecolor="white",
                                markeredgewidth=0.5, linestyle="none", zorder=5, gid=f"{fp8}|{clip}|surge")
                        csv_rows.append(("surge", metric, algo, model, arm_label(fp8, clip), fp8, clip, xs,
                                         format_number(ys), "", "", "", "", str(s_.run)))
            if spec.logy:
                ax.set_yscale("log", nonpositive="clip")
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
    if handles:
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                   ncol=max(1, min(len(handles), (4 if ncols > 1 else 2)
                                   if max(map(len, handles)) < 40 else 2)), frameon=False)
    fig.suptitle(title, fontsize=9)
    return fig, any_band


def granularity_caption(coll: Collection, spec, *, span: float, band: bool, surges: bool,
                        rule: SurgeRule, dups: dict | None = None, block_dups: dict | None = None,
                        unlogged: dict | None = None) -> str:
    what = "; ".join(spec.ylabels)
    paired = getattr(spec, "paired", False)
    parts = [f"{spec.title}: {what}, one panel per FP8 setting, one colour per clip method"
             + (", one row per metric" if len(spec.metrics) - len(dups or {}) > 1 else "") + "."]
    lines = ("Lines: mean over seeds of each run's curve minus the BF16 reference run of the same seed"
             if paired else "Lines: mean over seeds of each run's curve")
    parts.append(lines + (f" (EMA, span {format_number(float(span))} logged steps)" if span > 1 else " (unsmoothed)")
                 + (f"; bands: {BAND_TEXT} (arms with two or more seeds)." if band
                    else "; one seed per arm, so no band."))
    parts.append("Dashed black: zero, the BF16 reference." if paired
                 else "Thin black line: the block's BF16 reference arm.")
    for b, a in (dups or {}).items():
        parts.append(f"{b} equals {a} at every step of every run, so it is drawn once.")
    for b, (a, blks) in (block_dups or {}).items():
        where = ", ".join(f"{x.upper()} · {y}" for x, y in blks)
        parts.append(f"{b} equals {a} at every step of every run of {where}, so it is drawn once there.")
    for m, blks in (unlogged or {}).items():
        where = ", ".join(f"{x.upper()} · {y}" for x, y in blks)
        parts.append(f"No run of {where} logged {m}: no panels for it there.")
    if surges:
        parts.append(f"Triangles: entropy surge onsets ({rule.describe()}).")
    u = unfinished(coll)
    if len(u):
        parts.append(f"The curves include {len(u)} unfinished run(s) up to their last step: "
                     + ", ".join(f"{r.run} ({r.reason or r.cell})" for r in u.itertuples(index=False)) + ".")
    parts.append(describe_runs(coll))
    return " ".join(parts)
