"""Does Calibrated Clipping match BF16? Two tables for the report.

**Half-width criterion** (:func:`halfwidth_table`, ``tables/calibration_match.*``): per block
(algorithm, model), FP8 granularity (the cell's ``fp8``: tensorwise, rowwise, blockwise, mxfp8,
...) and calibrated arm: calibrated FP8 / BF16 of ``actor/clipfrac_neg_low`` (a run's mean over
its logged steps; mean over runs / mean over the BF16 reference arm's runs, as the mechanism
table) with its 95% interval over seeds (Fieller, paired by seed where the seeds pair:
:mod:`analysis.bf16_ratio`, :mod:`analysis.ratio_ci`), the half-width ``(hi - lo) / 2``,
whether it is <= :data:`HALF_WIDTH_MAX` and whether the point estimate lies in
:data:`MATCH_RANGE`; for contrast the same ratio of the granularity's uncalibrated arm
(``vanilla``, else ``tis``). Beside the ratio: S, the arm's own-shadow clipped A<0 tokens over
the BF16 arm's (what the calibrated count ratio is by construction under ``same_batch`` with the
``in_sample`` bound), and the ratios of the counts behind the fraction (:mod:`analysis.counts`),
for the calibrated and the contrast arm. A computed headline sentence sums it up.

**Which tokens are clipped** (:func:`agreement_table`, ``tables/clip_agreement.*``): per block and
arm that logged the agreement counts (``shadow/{low,high}_{bf16,fp8,both}_n``,
:mod:`fp8rl.rl.calibration.agreement`; on measured steps): pooled recall = sum both / sum bf16
and precision = sum both / sum fp8 over all measured steps of all runs, for the lower side
(A<0 tokens) and the upper side (A>0 tokens), each with a 95% interval over seeds (Fieller on
the per-run sums, numerator and denominator paired within each run, cut to [0, 1]), the
number of BF16-clipped tokens it rests on, and the count ratio FP8-clipped / BF16-clipped on the
same tokens. The count ratio splits the half-width table's ratio in two: calibrated FP8 / BF16
run ~ (FP8-clipped / the run's own shadow-clipped) x (the FP8 run's shadow / the BF16 run). The
first factor is what the bound controls (``same_batch``: ~1 by construction); the second is how
far the FP8-trained policy's own BF16 ratio tail lies from the BF16 run's. Arms without the counts (runs from before them) are
left out and named in a note. The calibration mode (``clip.calibration_mode``: periodic | pooled
| same_batch) comes from the arm's variant when the sweep varies it, else from the runs'
``config.yaml`` (:mod:`analysis.clip_config`); "" where not set. The report's calibration
section around these tables is :mod:`analysis.calibration_report`.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.arms import FP8_LABELS, arm_label, select, split_clip
from analysis.bf16_ratio import bf16_ratios
from analysis.clip_config import arm_modes
from analysis.clip_tables import run_mechanism
from analysis.collect import Collection
from analysis.counts import ci_columns, count_ratios
from analysis.ratio_ci import RatioCI, ratio_ci
from analysis.tabulate import Table, bf16_reference, blocks, render_blocks
from fp8rl.runs import metrics as M

HALF_WIDTH_MAX = 0.15
MATCH_RANGE = (0.8, 1.25)
#: What the agreement table computes per side from the counts (see :func:`agreement_rows`).
QUANTITIES: tuple[str, ...] = ("recall", "precision", "count")
#: Per side: (bf16, fp8, both) count metrics.
SIDES: dict[str, tuple[str, str, str]] = {
    "low": (M.SHADOW_LOW_BF16_N, M.SHADOW_LOW_FP8_N, M.SHADOW_LOW_BOTH_N),
    "high": (M.SHADOW_HIGH_BF16_N, M.SHADOW_HIGH_FP8_N, M.SHADOW_HIGH_BOTH_N),
}


def _num(x: float, fmt: str) -> str:
    return format(x, fmt) if np.isfinite(x) else "n/a"


def _yes(b) -> str:
    return "n/a" if b is None or (isinstance(b, float) and math.isnan(b)) else ("yes" if b else "no")


# --- B: the half-width criterion ---------------------------------------------------------


def _ci_cols(prefix: str, ci: RatioCI | None) -> dict:
    if ci is None:
        return {f"{prefix}_estimate": math.nan, f"{prefix}_lo": math.nan, f"{prefix}_hi": math.nan,
                f"{prefix}_half_width": math.nan, f"{prefix}_boot_lo": math.nan, f"{prefix}_boot_hi": math.nan,
                f"{prefix}_n_x": 0, f"{prefix}_n_y": 0, f"{prefix}_paired": False, f"{prefix}_ci": ""}
    d = ci.as_dict(prefix)
    d.pop(f"{prefix}_note")
    d[f"{prefix}_ci"] = ci.interval_text() + ("" if ci.paired or ci.note else " unpaired")
    return d


def criterion(ci: RatioCI | None) -> tuple[bool | None, bool | None, bool | None]:
    """(half-width <= :data:`HALF_WIDTH_MAX`, estimate in :data:`MATCH_RANGE` (ends included),
    both) for one calibrated ratio; None where there is no interval / no estimate (an unbounded
    interval's half-width is inf: not met)."""
    if ci is None:
        return None, None, None
    hw, est = ci.half_width, ci.estimate
    hw_ok = None if math.isnan(hw) else bool(hw <= HALF_WIDTH_MAX)
    pt_ok = bool(MATCH_RANGE[0] <= est <= MATCH_RANGE[1]) if np.isfinite(est) else None
    return hw_ok, pt_ok, (None if hw_ok is None or pt_ok is None else hw_ok and pt_ok)


def halfwidth_rows(coll: Collection) -> pd.DataFrame:
    """One row per (algorithm, model, fp8, calibrated arm) of a block with a BF16 arm.

    Columns: ``algorithm, model, fp8, granularity, clip, arm, mode, bf16_reference``; the
    calibrated ratio ``cal_estimate, cal_lo, cal_hi, cal_half_width, cal_boot_lo, cal_boot_hi,
    cal_n_x, cal_n_y, cal_paired, cal_ci``; ``half_width_ok`` (half-width <= 0.15; None without
    an interval), ``point_ok`` (estimate in [0.8, 1.25]; None without one), ``both_ok``;
    the contrast arm ``contrast_clip`` and its ``con_*`` columns (the same as ``cal_*``).
    Beside the fraction's ratio, the ratios of counts (:mod:`analysis.counts`, columns of
    :func:`analysis.counts.ci_columns`): ``cal_s`` / ``con_s`` S, the arm's own-shadow clipped
    A<0 tokens per step over the BF16 arm's; ``cal_count`` / ``con_count`` the clipped A<0
    tokens (``actor/n_neg_low``); ``cal_n_neg`` the A<0 tokens (``actor/n_neg``).
    """
    per_run = run_mechanism(coll)
    cis = bf16_ratios(coll, per_run, M.ACTOR_CLIPFRAC_NEG_LOW)
    counts = count_ratios(coll)
    modes = arm_modes(coll)
    rows = []
    for algo, model, arms in blocks(coll):
        ref = bf16_reference(arms)
        if ref is None:
            continue
        for fp8, clip in arms:
            if fp8 == "bf16" or split_clip(clip)[0] != "calibrated":
                continue
            cal = cis.get((algo, model, fp8, clip))
            contrast = next((c for c in ("vanilla", "tis") if (fp8, c) in arms), "")
            con = cis.get((algo, model, fp8, contrast)) if contrast else None
            hw_ok, pt_ok, both_ok = criterion(cal)
            extra = {}
            for side, arm_clip in (("cal", clip), ("con", contrast)):
                for key in ("s", "count", "n_neg"):
                    if side == "con" and key == "n_neg":
                        continue
                    ci = counts[key].get((algo, model, fp8, arm_clip)) if arm_clip else None
                    extra.update(ci_columns(f"{side}_{key}", ci))
            rows.append({
                "algorithm": algo, "model": model, "fp8": fp8, "granularity": FP8_LABELS.get(fp8, fp8),
                "clip": clip, "arm": arm_label(fp8, clip), "mode": modes.get((algo, model, fp8, clip), ""),
                "bf16_reference": arm_label(*ref), **_ci_cols("cal", cal),
                "half_width_ok": hw_ok, "point_ok": pt_ok, "both_ok": both_ok,
                "contrast_clip": contrast, **_ci_cols("con", con), **extra,
            })
    cols = ["algorithm", "model", "fp8", "granularity", "clip", "arm", "mode", "bf16_reference",
            *_ci_cols("cal", None), "half_width_ok", "point_ok", "both_ok", "contrast_clip",
            *_ci_cols("con", None)]
    for side, keys in (("cal", ("s", "count", "n_neg")), ("con", ("s", "count"))):
        for key in keys:
            cols += list(ci_columns(f"{side}_{key}", None))
    return pd.DataFrame(rows, columns=cols)


def halfwidth_headline(df: pd.DataFrame) -> str:
    """One computed sentence over :func:`halfwidth_rows`' rows."""
    if df.empty:
        return "No calibrated FP8 arm with a BF16 arm in its block: no half-width criterion."
    n = len(df)
    with_ci = df[df["half_width_ok"].notna()]
    est = df["cal_estimate"].to_numpy(dtype=float)
    con = df["con_estimate"].to_numpy(dtype=float)
    parts = [f"Calibrated FP8 / BF16 of A<0 tokens below the lower bound: point estimate in "
             f"[{MATCH_RANGE[0]}, {MATCH_RANGE[1]}] for {_count(df['point_ok'])} of {n} "
             f"calibrated cells ({_range(est)})"]
    if len(with_ci):
        parts.append(f"95% half-width <= {HALF_WIDTH_MAX} for {_count(with_ci['half_width_ok'])} "
                     f"of {len(with_ci)} with an interval (half-widths {_range(with_ci['cal_half_width'])}); "
                     f"both for {_count(df['both_ok'])} of {n}")
    else:
        parts.append("no interval (one seed per arm)")
    if np.isfinite(con).any():
        parts.append(f"uncalibrated FP8 / BF16 for contrast: {_range(con)}")
    s_cal, s_con = df["cal_s"].to_numpy(dtype=float), df["con_s"].to_numpy(dtype=float)
    if np.isfinite(s_cal).any() or np.isfinite(s_con).any():
        parts.append(f"S (own-shadow clipped / BF16 clipped, which the calibrated count ratio equals by "
                     f"construction under same_batch with the in_sample bound): calibrated arms {_range(s_cal)}, "
                     f"uncalibrated {_range(s_con)}")
    return "; ".join(parts) + "."


def _count(flags) -> int:
    """How many of ``flags`` (True / False / None) are True."""
    return sum(f is True for f in flags)


def _range(v) -> str:
    v = np.asarray(v, dtype=float)
    fin = v[np.isfinite(v)]
    if not len(fin):
        return "n/a" if not np.isinf(v).any() else "unbounded"
    lo, hi = f"{fin.min():.2f}", f"{fin.max():.2f}"
    s = lo if lo == hi else f"{lo}-{hi}"
    return s + (", some unbounded" if np.isinf(v).any() else "")


def halfwidth_table(coll: Collection, *, name: str = "calibration_match") -> Table:
    """The half-width criterion as a table (see the module docstring); the headline is the
    first Markdown line."""
    df = halfwidth_rows(coll)
    header = ["Granularity", "calibrated arm", "mode", "seeds", "calibrated / BF16", "95% CI",
              "S = own shadow / BF16 (95% CI)", "count below L / BF16 (95% CI)", "A<0 tokens / BF16 (95% CI)",
              "half-width", f"≤ {HALF_WIDTH_MAX}", f"in [{MATCH_RANGE[0]}, {MATCH_RANGE[1]}]",
              "uncalibrated / BF16", "95% CI", "uncalibrated S (95% CI)", "uncalibrated count / BF16 (95% CI)"]

    def cells(r, latex: bool) -> list[str]:
        def esc(s):
            return s
        con = (f"{_num(r['con_estimate'], '.2f')} ({r['contrast_clip']})" if r["contrast_clip"] else "none")
        return [esc(r["granularity"]), esc(r["arm"]), esc(r["mode"]), str(r["cal_n_x"]),
                _num(r["cal_estimate"], ".2f"), esc(r["cal_ci"]), esc(r["cal_s_text"]), esc(r["cal_count_text"]),
                esc(r["cal_n_neg_text"]),
                "unbounded" if np.isinf(r["cal_half_width"]) else _num(r["cal_half_width"], ".2f"),
                _yes(r["half_width_ok"]), _yes(r["point_ok"]), esc(con), esc(r["con_ci"]),
                esc(r["con_s_text"]), esc(r["con_count_text"])]

    md, tex = render_blocks(df, header, cells, lambda a, m, g: (
        f"`actor/clipfrac_neg_low` (run mean over steps), mean over seeds relative to "
        f"{g['bf16_reference'].iloc[0]}; 95% CI: Fieller over seeds, paired by seed. S = the arm's "
        "A<0 tokens below 1 - eps_low under its own BF16 shadow (`shadow/low_bf16_n`) per measured "
        "step over the BF16 arm's clipped A<0 tokens per step; count below L / BF16 = S x (FP8-clipped / "
        "own-shadow-clipped) where every step is measured, and the second factor is ~1 by construction under same_batch with the "
        "in_sample bound, so there the count ratio is S, as it is for an arm that never calibrates "
        "(uncalibrated S); count / BF16 and A<0 tokens / BF16: `actor/n_neg_low` and `actor/n_neg` "
        "per step, the fraction's numerator and denominator (fraction ratio = count ratio / A<0 "
        "ratio); n/a (not logged): runs from before the counts"))
    headline = halfwidth_headline(df)
    md = [f"**{headline}**", "", *md]
    tex = [f"% {headline}", *tex]
    return Table.from_lines(name, df, md, tex, empty="No calibrated FP8 arm with a BF16 arm in its block.")


# --- C: which tokens are clipped ---------------------------------------------------------


def run_agreement(coll: Collection) -> pd.DataFrame:
    """Per run that logged the agreement counts: their sums over its measured steps.

    Columns: ``run, algorithm, model, fp8, clip, measured_steps`` and the six count metrics
    (``shadow/low_bf16_n`` ...); a run is measured on a step where ``shadow/low_bf16_n`` or
    ``shadow/high_bf16_n`` is logged. Runs without any such step are left out.
    """
    counts = [m for side in SIDES.values() for m in side]
    cols = ["run", "algorithm", "model", "fp8", "clip", "measured_steps", *counts]
    st = coll.steps
    if not len(st) or not any(m in st.columns for m in counts):
        return pd.DataFrame(columns=cols)
    present = [m for m in counts if m in st.columns]
    mark = [m for m in (M.SHADOW_LOW_BF16_N, M.SHADOW_HIGH_BF16_N) if m in st.columns]
    measured = st[st[mark].notna().any(axis=1)] if mark else st.iloc[:0]
    if measured.empty:
        return pd.DataFrame(columns=cols)
    g = measured.groupby("run", observed=True, sort=False)
    df = g[present].sum(min_count=1).reset_index()
    df["measured_steps"] = g.size().to_numpy()
    for m in counts:
        if m not in df.columns:
            df[m] = math.nan
    df["run"] = df["run"].astype(str)
    axes = coll.runs[["run", "algorithm", "model", "fp8", "clip"]].astype({"run": str})
    return df.merge(axes, on="run", how="left")[cols]


def agreement_rows(coll: Collection) -> tuple[pd.DataFrame, list[str]]:
    """One row per (algorithm, model, arm) that logged the counts, and the labels of the arms
    left out ("ALGO model: arm").

    Columns: ``algorithm, model, fp8, granularity, clip, method, mode, arm, runs,
    measured_steps``, per side s in (low, high): ``{s}_bf16_tokens, {s}_fp8_tokens,
    {s}_both_tokens`` (sums over steps and runs) and for q in :data:`QUANTITIES` (recall, precision,
    count = FP8-clipped / BF16-clipped on the same tokens):
    ``{s}_{q}`` (pooled), ``{s}_{q}_lo``, ``{s}_{q}_hi``, ``{s}_{q}_boot_lo``,
    ``{s}_{q}_boot_hi``, ``{s}_{q}_ci`` (text).
    """
    per_run = run_agreement(coll)
    modes = arm_modes(coll)
    rows, omitted = [], []
    for algo, model, arms in blocks(coll):
        for fp8, clip in arms:
            r = select(per_run, algo, model, fp8, clip)
            if r.empty:
                omitted.append(f"{algo.upper()} {model}: {arm_label(fp8, clip)}")
                continue
            row = {"algorithm": algo, "model": model, "fp8": fp8, "granularity": FP8_LABELS.get(fp8, fp8),
                   "clip": clip, "method": split_clip(clip)[0], "mode": modes.get((algo, model, fp8, clip), ""),
                   "arm": arm_label(fp8, clip), "runs": len(r), "measured_steps": int(r["measured_steps"].sum())}
            for side, (bf16, fp8n, both) in SIDES.items():
                for what, col in (("bf16", bf16), ("fp8", fp8n), ("both", both)):
                    v = r[col].to_numpy(dtype=float)
                    row[f"{side}_{what}_tokens"] = float(np.nansum(v)) if np.isfinite(v).any() else math.nan
                for q, num, den, bounds in (("recall", both, bf16, (0.0, 1.0)), ("precision", both, fp8n, (0.0, 1.0)),
                                            ("count", fp8n, bf16, (0.0, math.inf))):
                    ok = r[[num, den]].notna().all(axis=1)
                    ci = ratio_ci(dict(zip(r.loc[ok, "run"], r.loc[ok, num], strict=True)),
                                  dict(zip(r.loc[ok, "run"], r.loc[ok, den], strict=True)), bounds=bounds)
                    row.update({f"{side}_{q}": ci.estimate, f"{side}_{q}_lo": ci.lo, f"{side}_{q}_hi": ci.hi,
                                f"{side}_{q}_boot_lo": ci.boot_lo, f"{side}_{q}_boot_hi": ci.boot_hi,
                                f"{side}_{q}_ci": ci.interval_text()})
            rows.append(row)
    cols = ["algorithm", "model", "fp8", "granularity", "clip", "method", "mode", "arm", "runs", "measured_steps"]
    for side in SIDES:
        cols += [f"{side}_{w}_tokens" for w in ("bf16", "fp8", "both")]
        for q in QUANTITIES:
            cols += [f"{side}_{q}{s}" for s in ("", "_lo", "_hi", "_boot_lo", "_boot_hi", "_ci")]
    return pd.DataFrame(rows, columns=cols), omitted


def agreement_table(coll: Collection, *, name: str = "clip_agreement") -> Table:
    """Which tokens are clipped, FP8 against the BF16 shadow (see the module docstring)."""
    df, omitted = agreement_rows(coll)
    header = ["Granularity", "method", "mode", "seeds", "BF16-clipped A<0", "recall low", "95% CI",
              "precision low", "95% CI", "FP8 / BF16 count low", "95% CI", "BF16-clipped A>0",
              "recall high", "95% CI", "precision high", "95% CI", "FP8 / BF16 count high", "95% CI"]

    def cells(r, latex: bool) -> list[str]:
        def esc(s):
            return s
        out = [esc(r["granularity"]), esc(r["method"]), esc(r["mode"]), str(r["runs"])]
        for side in SIDES:
            out.append(_num(r[f"{side}_bf16_tokens"], ".0f"))
            for q in QUANTITIES:
                out += [_num(r[f"{side}_{q}"], ".2f" if q == "count" else ".3f"), esc(r[f"{side}_{q}_ci"])]
        return out

    md, tex = render_blocks(df, header, cells, lambda a, m, g: (
        "recall = FP8-and-BF16-clipped / BF16-clipped, precision = FP8-and-BF16-clipped / "
        "FP8-clipped, FP8 / BF16 count = FP8-clipped / BF16-clipped (the same tokens: how closely "
        "the bound follows the run's own shadow), summed over measured steps and seeds; 95% CI over "
        "seeds (Fieller, per-run sums; recall and precision cut to [0, 1])"))
    if omitted and not df.empty:
        note = ("Omitted (no `shadow/*_n` agreement counts logged, e.g. runs from before them): "
                + "; ".join(omitted) + ".")
        md.append(note)
        tex.append(f"% {note}")
    return Table.from_lines(name, df, md, tex, empty=(
        "No run logged the agreement counts (`shadow/low_bf16_n` ...): runs from before them."))
