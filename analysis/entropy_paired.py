"""End-of-training entropy paired by seed: FP8's entropy excess over BF16, and how much of it
Calibrated Clipping removes.

A run's **end entropy** is the mean of ``actor/entropy`` over the last 25% of its logged steps (at
least one step; the trajectory table's window, :func:`analysis.tables.window_mean`; steps whose
entropy is not finite are skipped). Only finished runs (``cell == "ok"``) count: a run that stopped
early ends at another point of training than its partner.

One row per block (algorithm, model) x arm x calibration mode (the held-out table's rows,
:mod:`analysis.heldout`: an arm's runs are split by their mode, :mod:`analysis.clip_config`, so two
sweeps of different modes reported together stay apart; a sweep that varies
``clip.calibration_mode`` already has one arm per mode). Per row:

- **− BF16**: per seed, the arm's end entropy minus the block's BF16 reference arm's (BF16 vanilla,
  else its first BF16 arm: :func:`analysis.tabulate.bf16_reference`); mean over the pairs, its 95%
  Student-t interval (n − 1 degrees of freedom, :func:`analysis.heldout.mean_ci`) and
  t = mean / (std / √n) (:func:`analysis.paired.t_stat`).
- **− TIS** (calibrated arms): the same against the TIS arm of the same FP8 setting (``tis``, else
  its first TIS variant: :func:`analysis.heldout.tis_clip`). The calibrated arm is the TIS arm plus
  calibrated bounds (same FP8 noise, same importance correction), and calibration sets its bounds
  from clip counts, not from entropy: this is a difference the method cannot force.
- **share removed** = mean_s(TIS_s − cal_s) / mean_s(TIS_s − BF16_s) over the seeds all three arms
  finished: the share of TIS's end-entropy excess over BF16 that the calibrated arm removes (1: it
  ends at BF16's entropy; 0: at TIS's; below 0: above TIS). 95% interval: **Fieller's**, paired by
  seed (:func:`analysis.ratio_ci.ratio_ci`, not cut to [0, 1]: the share can lie outside), unbounded
  when TIS's excess is not significantly above zero; the paired percentile bootstrap over seeds is
  written to the CSV only (``share_boot_lo``, ``share_boot_hi``; why: :mod:`analysis.ratio_ci`). No
  estimate where TIS's mean excess is not above zero (there is nothing to remove).

**Pairs.** The key of a run is (sweep, seed) (:func:`analysis.bf16_ratio.keyed_values`): same warm
start, same prompts. A difference is taken over the keys both arms finished, each once (a seed run
twice in one arm pairs with nothing); the table gives the pairs used, and :func:`entropy_rows`
names the seeds left without a partner (under the table).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pandas as pd

from analysis.arms import FP8_LABELS, arm_label, select, split_clip
from analysis.bf16_ratio import keyed_values
from analysis.clip_config import NO_MODE, run_settings
from analysis.collect import CELL_OK, Collection
from analysis.counts import ci_columns
from analysis.heldout import mean_ci, mean_text, tis_clip
from analysis.paired import t_stat
from analysis.ratio_ci import ratio_ci
from analysis.tables import TRAJECTORY_WINDOW, window_mean
from analysis.tabulate import Table, bf16_reference, blocks, render_blocks, sample_std
from fp8rl.runs import metrics as M

#: The differences are shown in this unit (nats); the CSV keeps nats.
DIFF_UNIT = 1e-4


def run_end_entropy(coll: Collection) -> pd.DataFrame:
    """One row per finished run that logged ``actor/entropy``: ``run, algorithm, model, fp8, clip,
    mode, seed, key`` (the pairing key (sweep, seed)), ``end_entropy`` (mean over the last
    :data:`analysis.tables.TRAJECTORY_WINDOW` of its logged steps), ``steps`` (logged steps)."""
    cols = ["run", "algorithm", "model", "fp8", "clip", "mode", "seed", "key", "end_entropy", "steps"]
    st = coll.steps
    if not len(st) or M.ACTOR_ENTROPY not in st.columns:
        return pd.DataFrame(columns=cols)
    ok = set(coll.runs.loc[coll.runs["cell"] == CELL_OK, "run"].astype(str))
    rows = []
    for run, g in st.groupby("run", observed=True, sort=False):
        if str(run) not in ok:
            continue
        g = g.sort_values("step")
        rows.append({"run": str(run), "end_entropy": window_mean(g[M.ACTOR_ENTROPY].to_numpy(dtype=float), "last"),
                     "steps": len(g)})
    df = pd.DataFrame(rows, columns=["run", "end_entropy", "steps"])
    df = df[np.isfinite(df["end_entropy"].to_numpy(dtype=float))]
    keyed = keyed_values(df, coll, "end_entropy").rename(columns={"value": "end_entropy"})
    keyed["seed"] = [k[1] for k in keyed["key"]]
    keyed = keyed.merge(df[["run", "steps"]], on="run", how="left").merge(
        run_settings(coll)[["run", "mode"]], on="run", how="left")
    keyed["mode"] = keyed["mode"].fillna("")
    return keyed[cols]


def _by_key(r: pd.DataFrame) -> dict:
    """{key: end entropy} of the keys that occur once in ``r`` (a key seen twice pairs with nothing)."""
    counts = Counter(r["key"])
    return {k: float(v) for k, v in zip(r["key"], r["end_entropy"], strict=True) if counts[k] == 1}


def _diff(a: dict, b: dict) -> tuple[dict, list]:
    """{key: a - b} over the keys both hold, and the keys without a partner: ``a``'s, and ``b``'s of the
    sweeps ``a`` has runs in (a row of one sweep's calibration mode is not short of another sweep's seeds)."""
    common = sorted(set(a) & set(b), key=str)
    sweeps = {k[0] for k in a}
    lone = (set(a) - set(b)) | {k for k in set(b) - set(a) if k[0] in sweeps}
    return {k: a[k] - b[k] for k in common}, sorted(lone, key=str)


def _diff_columns(prefix: str, d: dict) -> dict:
    v = list(d.values())
    m, lo, hi, n = mean_ci(v)
    return {f"{prefix}_pairs": n, f"{prefix}_mean": m, f"{prefix}_std": sample_std(np.asarray(v)),
            f"{prefix}_lo": lo, f"{prefix}_hi": hi, f"{prefix}_t": t_stat(v)}


def _share(cal: dict, tis: dict, bf16: dict) -> dict:
    """The share of TIS's excess over BF16 that the calibrated arm removes (module docstring)."""
    keys = set(cal) & set(tis) & set(bf16)
    x = {k: tis[k] - cal[k] for k in keys}
    y = {k: tis[k] - bf16[k] for k in keys}
    ci = ratio_ci(x, y, bounds=(-math.inf, math.inf))
    out = ci_columns("share", ci)
    out["share_tis_excess"] = float(np.mean(list(y.values()))) if y else math.nan
    if y and not out["share_tis_excess"] > 0:
        out["share_text"] = "n/a (no excess over BF16)"
    return out


def entropy_rows(coll: Collection) -> tuple[pd.DataFrame, list[str]]:
    """One row per (algorithm, model, arm, calibration mode) with finished runs, and one note per
    difference that left seeds without a partner.

    Columns: ``algorithm, model, fp8, granularity, clip, method, mode, arm, runs, end_entropy_mean,
    end_entropy_std``; ``bf16_clip`` (the reference arm's clip; "" without one) and for the
    difference to it ``bf16_pairs, bf16_mean, bf16_std, bf16_lo, bf16_hi, bf16_t``; ``tis_clip``
    (calibrated arms: the TIS arm compared with; "" otherwise) and ``tis_*`` the same; the share
    removed as :func:`analysis.counts.ci_columns` with prefix ``share``, and ``share_tis_excess``
    (TIS − BF16 over the seeds the share uses); ``tis_reference`` (a TIS arm that a calibrated arm
    of its block is compared with). Entropies and differences in nats.
    """
    per_run = run_end_entropy(coll)
    sweeps = coll.runs["sweep"].astype(str).nunique() if len(coll.runs) else 0
    rows, notes = [], []
    for algo, model, arms in blocks(coll):
        ref = bf16_reference(arms)
        bf16 = _by_key(select(per_run, algo, model, *ref)) if ref else {}
        tis_refs = {(f, tis_clip(arms, f)) for f, c in arms if split_clip(c)[0] == "calibrated"}
        for fp8, clip in arms:
            method = split_clip(clip)[0]
            r_arm = select(per_run, algo, model, fp8, clip)
            tis = tis_clip(arms, fp8) if method == "calibrated" else ""
            tis_vals = _by_key(select(per_run, algo, model, fp8, tis)) if tis else {}
            for mode, r in r_arm.groupby("mode", sort=True):
                mine = _by_key(r)
                label = arm_label(fp8, clip) + (f" ({mode})" if mode and mode != NO_MODE and mode not in clip else "")
                row = {"algorithm": algo, "model": model, "fp8": fp8, "granularity": FP8_LABELS.get(fp8, fp8),
                       "clip": clip, "method": method, "mode": mode, "arm": arm_label(fp8, clip), "runs": len(r),
                       "end_entropy_mean": float(r["end_entropy"].mean()),
                       "end_entropy_std": sample_std(r["end_entropy"].to_numpy(dtype=float)),
                       "bf16_clip": ref[1] if ref else "", "tis_clip": tis,
                       "tis_reference": (fp8, clip) in tis_refs}
                d_bf16, lone = (_diff(mine, bf16) if ref and (fp8, clip) != ref else ({}, []))
                row.update(_diff_columns("bf16", d_bf16))
                if lone:
                    notes.append(_note(algo, model, label, "BF16", d_bf16, lone, sweeps))
                d_tis, lone = _diff(mine, tis_vals) if tis else ({}, [])
                row.update(_diff_columns("tis", d_tis))
                if lone:
                    notes.append(_note(algo, model, label, "TIS", d_tis, lone, sweeps))
                row.update(_share(mine, tis_vals, bf16) if tis and ref else ci_columns("share", None))
                row.setdefault("share_tis_excess", math.nan)
                rows.append(row)
    cols = ["algorithm", "model", "fp8", "granularity", "clip", "method", "mode", "arm", "runs", "end_entropy_mean",
            "end_entropy_std", "bf16_clip", *(f"bf16_{c}" for c in ("pairs", "mean", "std", "lo", "hi", "t")),
            "tis_clip", *(f"tis_{c}" for c in ("pairs", "mean", "std", "lo", "hi", "t")),
            "tis_reference", *ci_columns("share", None), "share_tis_excess"]
    return pd.DataFrame(rows, columns=cols), notes


def seed_ranges(seeds) -> str:
    """``[0, 2, 3, 4, 7]`` -> ``"seeds 0, 2-4, 7"``; ``[5]`` -> ``"seed 5"`` (a run without a seed: "?")."""
    unknown = ["?" for s in seeds if s is None]
    seeds = sorted(s for s in seeds if s is not None)
    parts, i = [], 0
    while i < len(seeds):
        j = i
        while j + 1 < len(seeds) and seeds[j + 1] == seeds[j] + 1:
            j += 1
        parts.append(str(seeds[i]) if i == j else f"{seeds[i]}-{seeds[j]}")
        i = j + 1
    parts += unknown
    return ("seed " if len(seeds) + len(unknown) == 1 else "seeds ") + ", ".join(parts)


def _note(algo: str, model: str, label: str, other: str, d: dict, lone: list, sweeps: int) -> str:
    by_sweep: dict = {}
    for sweep, seed in lone:
        by_sweep.setdefault(sweep, []).append(seed)
    seeds = "; ".join((f"{sw} " if sweeps > 1 else "") + seed_ranges(v) for sw, v in sorted(by_sweep.items()))
    n = len(d)
    return f"{algo.upper()} {model} {label} − {other}: {n} pair{'s' if n != 1 else ''} (no partner: {seeds})"


def entropy_paired_table(coll: Collection, *, name: str = "entropy_paired") -> Table:
    """End entropy per arm and its paired differences to BF16 and TIS (see the module docstring)."""
    df, notes = entropy_rows(coll)
    unit = f"{DIFF_UNIT:.0e}".replace("e-0", "e-")
    header = ["Arm", "mode", "seeds", "end entropy (nats)", f"− BF16 ({unit} nats, 95% CI)", "t", "pairs",
              f"− TIS ({unit} nats, 95% CI)", "t", "pairs", "share of TIS's excess removed (95% CI)", "pairs"]

    def num(x, fmt):
        return format(x, fmt) if np.isfinite(x) else ""

    def diff(r, prefix: str, is_ref: bool, none: str) -> list[str]:
        if is_ref:
            return ["reference", "", ""]
        if not r[f"{prefix}_clip"]:
            return [none, "", ""]
        n = int(r[f"{prefix}_pairs"])
        return [mean_text(r[f"{prefix}_mean"] / DIFF_UNIT, r[f"{prefix}_lo"] / DIFF_UNIT,
                          r[f"{prefix}_hi"] / DIFF_UNIT, n, fmt=".1f", signed=True),
                num(r[f"{prefix}_t"], ".1f"), str(n)]

    def cells(r, latex: bool) -> list[str]:
        def esc(s):
            return s
        sep = " ± "
        end = num(r["end_entropy_mean"], ".4f") + (sep + num(r["end_entropy_std"], ".4f")
                                                  if np.isfinite(r["end_entropy_std"]) else "")
        is_bf16_ref = r["fp8"] == "bf16" and r["clip"] == r["bf16_clip"]
        calibrated = r["method"] == "calibrated"
        share = (r["share_text"] or "n/a") if calibrated and r["tis_clip"] and r["bf16_clip"] else ""
        return [esc(r["arm"]), esc(r["mode"]), str(r["runs"]), end,
                *(esc(c) for c in diff(r, "bf16", is_bf16_ref, "no BF16 arm")),
                *(esc(c) for c in (diff(r, "tis", r["tis_reference"], "no TIS arm")
                                   if calibrated or r["tis_reference"] else ["", "", ""])),
                esc(share), str(r["share_n_x"]) if share else ""]

    md, tex = render_blocks(df, header, cells, lambda a, m, g: (
        f"end entropy = mean of `actor/entropy` over the last {TRAJECTORY_WINDOW:.0%} of a run's logged "
        "steps, finished runs, mean ± std over seeds; − BF16 / − TIS: per seed, the arm's end entropy minus "
        f"{arm_label('bf16', g['bf16_clip'].iloc[0]) if g['bf16_clip'].iloc[0] else 'the BF16 arm'}'s / the same "
        "FP8 setting's TIS arm's, paired by seed (same sweep and seed), mean over the pairs with its 95% "
        "Student-t interval and t = mean / (std / √n); share removed = mean(TIS − calibrated) / mean(TIS − "
        "BF16) over the seeds all three finished, 95% CI: Fieller, paired by seed"))
    if notes and not df.empty:
        note = ("Differences are over the seeds both arms finished, each once; seeds without a partner "
                "(missing or unfinished in one arm, or run twice): " + " · ".join(notes) + ".")
        md.append(note)
        tex.append(f"% {note}")
    return Table.from_lines(name, df, md, tex, empty="No finished run logged `actor/entropy`.")
