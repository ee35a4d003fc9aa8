"""The report's calibration section: what holds by construction, and the four calibration tables.

**What holds by construction** (:func:`construction_table`, ``tables/by_construction.*``): per
block and arm, which of the report's calibration numbers the method forces, and the numbers side
by side so a reader can check it:

- ``same_batch`` with the ``in_sample`` lower estimator sets each mini-batch's L so that FP8 clips
  as many of its A<0 tokens as its own BF16 shadow does: FP8-clipped / own-shadow-clipped (the
  agreement table's count ratio, in sample) is ~1 by construction, so the arm's clipped count /
  BF16 is S (:mod:`analysis.counts`), the FP8 trajectory's own-shadow count over the BF16 run's.
  S of the vanilla and TIS arms, which never calibrate, is the same quantity without any
  calibration: where it matches the calibrated arm's, "calibrated / BF16 near 1" says nothing the
  vanilla runs did not;
- ``same_batch`` with another estimator still fits its bounds on the tokens they rule: its
  in-sample ratio is no test; only the cross-fitted one is;
- ``periodic``, ``pooled`` and ``sampled`` bounds rule tokens they were not fit on: nothing is
  forced, and the out-of-sample ratio tests them;
- vanilla and TIS: nothing (they never calibrate); BF16 arms have no FP8 (their shadow is the run
  itself).

Columns: the ratio over the measured tokens (``analysis.calibration_match.agreement_rows``, low
side; in sample under ``same_batch``), the
held-out ratio (:mod:`analysis.heldout`), S, and the arm's A<0-below-L fraction and count as
multiples of BF16's (:mod:`analysis.bf16_ratio`, :mod:`analysis.counts`), each with its 95%
interval.

:func:`calibration_match_sections` writes the half-width, by-construction, agreement and held-out
tables and returns the report's sections for them, in that order, then the held-out judgement of
runs with held-out rows (``clip.holdout_share``; :mod:`analysis.heldout_report`; none otherwise).
"""

from __future__ import annotations

import os

import numpy as np
import pandas as pd

from analysis.arms import FP8_LABELS, arm_label, select, split_clip
from analysis.bf16_ratio import bf16_ratios
from analysis.calibration_match import agreement_rows, agreement_table, halfwidth_table
from analysis.clip_config import NO_MODE, SAME_BATCH, arm_modes, run_settings
from analysis.clip_tables import run_mechanism
from analysis.collect import Collection
from analysis.counts import NOT_LOGGED, ci_columns, count_ratios, reference_text, run_counts
from analysis.heldout import heldout_rows, heldout_table
from analysis.heldout_report import heldout_sections
from analysis.tabulate import Table, bf16_reference, blocks, render_blocks
from fp8rl.runs import metrics as M

#: Modes whose bounds rule tokens they were not computed from.
OUT_OF_SAMPLE_MODES: tuple[str, ...] = ("periodic", "pooled", "sampled")


def construction_note(fp8: str, method: str, mode: str, estimator: str) -> str:
    """What an arm's calibration numbers hold by construction (one sentence; module docstring)."""
    if fp8 == "bf16":
        return "no FP8: the run is its own shadow"
    if method != "calibrated":
        return "nothing (never calibrates): S is its own BF16 shadow against BF16"
    if mode == SAME_BATCH and estimator == "in_sample":
        return ("FP8-clipped / own shadow ~1 (each mini-batch clips as many A<0 tokens as its shadow), "
                "so count below L / BF16 ~ S")
    if mode == SAME_BATCH:
        return "bounds fit on the tokens they rule: the in-sample ratio is no test, the cross-fitted one is"
    if mode in OUT_OF_SAMPLE_MODES:
        return "nothing: the bounds rule tokens they were not fit on (the held-out ratio tests them)"
    if "/" in mode:
        return "modes differ between runs: see the held-out table"
    return "unknown calibration mode"


def construction_rows(coll: Collection) -> pd.DataFrame:
    """One row per (algorithm, model, arm) (see the module docstring).

    Columns: ``algorithm, model, fp8, granularity, clip, method, mode, lower_estimator, arm, runs,
    by_construction``; ``measured``, ``measured_text`` (FP8-clipped / own-shadow-clipped over
    the measured tokens, low side: in sample under ``same_batch``); ``heldout_text`` (with its
    kind); and :func:`analysis.counts.ci_columns` with prefixes
    ``s`` (S), ``fraction`` (A<0-below-L fraction / BF16) and ``count`` (its count / BF16); the BF16
    reference arm's ``*_text`` say "reference".
    """
    per_run = run_mechanism(coll)
    fraction = bf16_ratios(coll, per_run, M.ACTOR_CLIPFRAC_NEG_LOW)
    per_count = run_counts(coll)
    counts = count_ratios(coll, per_count)
    agree, _ = agreement_rows(coll)
    agree = agree.set_index(["algorithm", "model", "clip", "fp8"]) if len(agree) else agree
    held, _ = heldout_rows(coll)
    modes = arm_modes(coll)
    settings = run_settings(coll).set_index("run")
    rows = []
    for algo, model, arms in blocks(coll):
        ref = bf16_reference(arms)
        for fp8, clip in arms:
            arm = (algo, model, fp8, clip)
            runs = select(per_run, algo, model, fp8, clip)["run"].astype(str)
            method, mode = split_clip(clip)[0], modes.get(arm, "")
            est = "/".join(sorted({e for e in settings.reindex(runs)["lower_estimator"].dropna() if e}))
            row = {"algorithm": algo, "model": model, "fp8": fp8, "granularity": FP8_LABELS.get(fp8, fp8),
                   "clip": clip, "method": method, "mode": mode, "lower_estimator": est,
                   "arm": arm_label(fp8, clip), "runs": len(runs),
                   "by_construction": construction_note(fp8, method, mode, est)}
            key = (algo, model, clip, fp8)
            if len(agree) and key in agree.index:
                a = agree.loc[key]
                row["measured"] = float(a["low_count"])
                sep = ", " if str(a["low_count_ci"]).startswith("n/a") else " "
                row["measured_text"] = (f"{a['low_count']:.2f}{sep}{a['low_count_ci']}"
                                        if np.isfinite(a["low_count"]) else "n/a")
            else:
                row["measured"], row["measured_text"] = np.nan, NOT_LOGGED
            h = select(held, algo, model, fp8, clip) if len(held) else held
            h = h[h["runs"] > 0] if len(h) else h
            row["heldout_text"] = ("; ".join(
                (f"{r['mode']}: " if len(h) > 1 else "") + f"{r['ratio_text']} ({r['kind']})"
                for _, r in h.iterrows()) if len(h) else NOT_LOGGED)
            for prefix, ci, col in (("s", counts["s"].get(arm), "s_value"),
                                    ("fraction", fraction.get(arm), M.ACTOR_CLIPFRAC_NEG_LOW),
                                    ("count", counts["count"].get(arm), "n_neg_low")):
                row.update(ci_columns(prefix, ci))
                if ref is not None and (fp8, clip) == ref:
                    src = per_count if col != M.ACTOR_CLIPFRAC_NEG_LOW else per_run
                    row[f"{prefix}_text"] = reference_text(src, algo, model, ref, col)
            rows.append(row)
    cols = ["algorithm", "model", "fp8", "granularity", "clip", "method", "mode", "lower_estimator", "arm", "runs",
            "by_construction", "measured", "measured_text", "heldout_text",
            *ci_columns("s", None), *ci_columns("fraction", None), *ci_columns("count", None)]
    return pd.DataFrame(rows, columns=cols)


def construction_table(coll: Collection, *, name: str = "by_construction") -> Table:
    """What holds by construction, per arm (see the module docstring)."""
    df = construction_rows(coll)
    header = ["Granularity", "method", "mode", "lower bound", "seeds", "holds by construction",
              "FP8 / own shadow, measured tokens (95% CI)", "held-out FP8 / BF16-clipped (95% CI)",
              "S = own shadow / BF16 (95% CI)", "below L / BF16, fraction (95% CI)",
              "below L / BF16, count (95% CI)"]

    def cells(r, latex: bool) -> list[str]:
        def esc(s):
            return str(s)
        return [esc(r["granularity"]), esc(r["method"]), esc(r["mode"]), esc(r["lower_estimator"] or NO_MODE),
                str(r["runs"]), esc(r["by_construction"]), esc(r["measured_text"]), esc(r["heldout_text"]),
                esc(r["s_text"]), esc(r["fraction_text"]), esc(r["count_text"])]

    md, tex = render_blocks(df, header, cells, lambda a, m, g: (
        "which calibration numbers the method forces. Measured tokens: FP8-clipped / own-shadow-clipped "
        "A<0 tokens over every token with a BF16 shadow (the agreement table's count ratio; in sample "
        "under same_batch, whose bounds come from these tokens); held-out: the same on tokens the "
        "bounds did not come from (the held-out table); S: the arm's own-shadow "
        "clipped A<0 tokens per measured step over the BF16 arm's clipped A<0 tokens per step; "
        "fraction and count: `actor/clipfrac_neg_low` and `actor/n_neg_low` per step over the BF16 "
        "arm's. 95% CI: Fieller over seeds (paired by seed; measured and held-out: per-run sums, paired "
        "within each run)"))
    return Table.from_lines(name, df, md, tex, empty="No arm in these sweeps.")


def calibration_match_sections(coll: Collection, tab_dir: str | os.PathLike, fig_dir: str | os.PathLike | None = None,
                               *, pdf: bool = False) -> list[tuple[str, list[str]]]:
    """Write the calibration tables into ``tab_dir`` and return the report's sections for them:
    (title, lines), in the order of the module docstring, then the held-out judgement
    (:mod:`analysis.heldout_report`; its figure into ``fig_dir``) where runs logged held-out rows."""
    tables = [("Calibrated Clipping against BF16: the half-width criterion", halfwidth_table(coll)),
              ("What holds by construction", construction_table(coll)),
              ("Which tokens are clipped: FP8 against the BF16 shadow", agreement_table(coll)),
              ("Held-out calibration error and the gradient against BF16's", heldout_table(coll))]
    for _, t in tables:
        t.write(tab_dir)
    return [(title, [t.markdown]) for title, t in tables] + heldout_sections(coll, tab_dir, fig_dir, pdf=pdf)
