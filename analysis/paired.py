"""Paired accuracy statistics: did training raise held-out accuracy, and by as much as BF16's?

The mini backend evaluates every run on the same held-out problems with the same sampling seed
at every evaluation, step 0 included (``fp8rl.backends.mini.evaluate``), so a run's change in
accuracy is paired by problem and sampler, and two arms of one seed start from the same warm
start and see the same prompts in the same order. The statistics use those pairings:

- **gain** of a run: its last evaluation minus its first (step 0), of ``stat`` (``avg@k`` at the
  evaluation temperature, or ``greedy``) averaged over the evaluation sets;
- per arm: mean gain over seeds ± sample std (ddof = 1), and the one-sample t statistic
  ``mean / (std / sqrt(n))`` with n - 1 degrees of freedom (n >= 2 seeds);
- **vs BF16**: per seed, the arm's gain minus the block's BF16 arm's gain for the same seed
  (BF16 vanilla, else the first BF16 arm); mean ± std over the seeds both have, and its t.

Only finished runs (``cell == "ok"``) with an evaluation at step 0 and a later one count. The
t statistic is reported, not a p-value: with 3 seeds t = 3 is p ≈ 0.1 two-sided, t = 4.3 is
p = 0.05 (Student t, 2 degrees of freedom).

**Which engine.** An FP8 rollout arm's own evaluation is scored by its FP8 engine, so its gain
and its difference to BF16 mix the evaluation's precision into the training's (at step 0 the
weights are the same warm start in every arm, yet the FP8 engine scores them lower). Runs that
also scored every evaluation with a BF16 engine (``eval_bf16/`` keys, ``precision="bf16"``) give
the same statistics in one precision for every arm; **the training effect is the BF16-evaluated
paired gain**: per seed, the arm's BF16-evaluated gain from step 0 minus the BF16 arm's, with its
95% interval over seeds (Student t, paired by seed; :func:`mean_interval`), which
:func:`training_effect_lines` states and the BF16 table carries (``vs_bf16_lo``, ``vs_bf16_hi``).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.arms import arm_label
from analysis.collect import CELL_OK, Collection
from analysis.evals import select_evals
from analysis.ratio_ci import t_quantile
from analysis.tabulate import Table, bf16_reference, blocks, render_blocks
from fp8rl.runs import metrics as M


def run_gains(coll: Collection, stat: str = M.EVAL_AVG, precision: str = M.EVAL_OWN) -> pd.DataFrame:
    """Per finished run: ``run, algorithm, model, fp8, clip, seed, first, last, gain, first_step,
    last_step`` (``stat`` of the engine ``precision`` averaged over the run's evaluation sets;
    steps where every set was evaluated); runs without a step-0 and a later evaluation are left out."""
    cols = ["run", "algorithm", "model", "fp8", "clip", "seed", "first", "last", "gain", "first_step",
            "last_step"]
    ev = coll.evals
    if len(ev) == 0:
        return pd.DataFrame(columns=cols)
    ev = select_evals(ev, stat, precision)
    ok = set(coll.runs.loc[coll.runs["cell"] == CELL_OK, "run"].astype(str))
    rows = []
    for run, g in ev.groupby("run", observed=True, sort=False):
        if str(run) not in ok:
            continue
        n_sets = g["dataset"].nunique()
        by_step = g.groupby("step")["value"].agg(["mean", "count"])
        by_step = by_step[by_step["count"] == n_sets].sort_index()
        if len(by_step) < 2 or int(by_step.index[0]) != 0:
            continue
        first, last = float(by_step["mean"].iloc[0]), float(by_step["mean"].iloc[-1])
        rows.append({"run": str(run), "first": first, "last": last, "gain": last - first,
                     "first_step": int(by_step.index[0]), "last_step": int(by_step.index[-1])})
    df = pd.DataFrame(rows, columns=["run", "first", "last", "gain", "first_step", "last_step"])
    axes = coll.runs[["run", "algorithm", "model", "fp8", "clip", "seed"]].astype({"run": str})
    return df.merge(axes, on="run", how="left")[cols]


def t_stat(x) -> float:
    """One-sample t of ``x`` against 0 (NaN with fewer than two values or zero spread)."""
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    if len(x) < 2:
        return math.nan
    sd = float(np.std(x, ddof=1))
    return float(np.mean(x)) / (sd / math.sqrt(len(x))) if sd > 0 else math.nan


def mean_interval(x, level: float = 0.95) -> tuple[float, float]:
    """Student-t interval of the mean of ``x`` (NaN with fewer than two values; the mean itself
    with zero spread)."""
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    if len(x) < 2:
        return math.nan, math.nan
    half = t_quantile(0.5 + level / 2, len(x) - 1) * float(np.std(x, ddof=1)) / math.sqrt(len(x))
    m = float(np.mean(x))
    return m - half, m + half


def _ms(x) -> tuple[float, float]:
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    if not len(x):
        return math.nan, math.nan
    return float(np.mean(x)), float(np.std(x, ddof=1)) if len(x) >= 2 else math.nan


def paired_accuracy_table(coll: Collection, *, stat: str = M.EVAL_AVG, name: str = "paired_accuracy",
                          precision: str = M.EVAL_OWN) -> Table:
    """Accuracy gain per arm and versus the block's BF16 arm (see the module docstring), of the
    arm's own engine or (``precision="bf16"``) of the BF16 engine; the BF16 table also gives the
    95% interval of the difference to the BF16 arm (``vs_bf16_lo``, ``vs_bf16_hi``)."""
    gains = run_gains(coll, stat, precision)
    interval = precision == M.EVAL_BF16
    rows = []
    for algo, model, arms in blocks(coll):
        ref_arm = bf16_reference(arms)
        blk = gains[(gains["algorithm"].astype(str) == algo) & (gains["model"].astype(str) == model)]
        ref = (blk[(blk["fp8"].astype(str) == ref_arm[0]) & (blk["clip"].astype(str) == ref_arm[1])]
               .set_index("seed")["gain"] if ref_arm else pd.Series(dtype=float))
        for fp8, clip in arms:
            g = blk[(blk["fp8"].astype(str) == fp8) & (blk["clip"].astype(str) == clip)]
            if g.empty:
                continue
            row = {"algorithm": algo, "model": model, "arm": arm_label(fp8, clip), "fp8": fp8, "clip": clip,
                   "runs": len(g)}
            for k in ("first", "last", "gain"):
                row[f"{k}_mean"], row[f"{k}_std"] = _ms(g[k])
            row["gain_t"] = t_stat(g["gain"])
            is_ref = ref_arm is not None and (fp8, clip) == ref_arm
            d = pd.Series(dtype=float) if is_ref else (g.set_index("seed")["gain"] - ref).dropna()
            row["vs_bf16_pairs"] = len(d)
            row["vs_bf16_mean"], row["vs_bf16_std"] = _ms(d)
            row["vs_bf16_t"] = t_stat(d)
            row["vs_bf16_lo"], row["vs_bf16_hi"] = mean_interval(d)
            rows.append(row)
    cols = ["algorithm", "model", "arm", "fp8", "clip", "runs", "first_mean", "first_std", "last_mean",
            "last_std", "gain_mean", "gain_std", "gain_t", "vs_bf16_pairs", "vs_bf16_mean", "vs_bf16_std",
            "vs_bf16_t", *(("vs_bf16_lo", "vs_bf16_hi") if interval else ())]
    df = pd.DataFrame(rows, columns=cols)
    header = ["Arm", "seeds", f"{stat} % step 0", "final", "gain (pts)", "t", "gain − BF16 gain (pts)", "t",
              *(("95% CI (pts)",) if interval else ())]

    def pm(m, s, latex):
        if not np.isfinite(m):
            return "n/a"
        sep = " ± "
        return f"{100 * m:+.1f}" + (f"{sep}{100 * s:.1f}" if np.isfinite(s) else "")

    def num(x, fmt):
        return format(x, fmt) if np.isfinite(x) else ""

    def cells(r, latex: bool) -> list[str]:
        return [r["arm"], str(r["runs"]),
                num(100 * r["first_mean"], ".1f"), num(100 * r["last_mean"], ".1f"),
                pm(r["gain_mean"], r["gain_std"], latex), num(r["gain_t"], ".1f"),
                "" if r["vs_bf16_pairs"] == 0 else pm(r["vs_bf16_mean"], r["vs_bf16_std"], latex),
                num(r["vs_bf16_t"], ".1f"), *((ci(r, latex),) if interval else ())]

    def ci(r, latex: bool) -> str:
        lo, hi = r["vs_bf16_lo"], r["vs_bf16_hi"]
        return f"[{100 * lo:+.1f}, {100 * hi:+.1f}]" if np.isfinite(lo) and np.isfinite(hi) else ""

    engine = "" if precision == M.EVAL_OWN else "scored by a BF16 engine on the same weights, "
    md, tex = render_blocks(df, header, cells, lambda a, m, g: (
        f"{stat} {engine}averaged over the evaluation sets, last evaluation minus step 0 (same problems and "
        "sampling seed at every evaluation); mean ± std over seeds, t = mean / (std / √n); "
        "vs BF16: paired by seed" + ("; 95% CI: Student t over the paired seeds" if interval else "")))
    return Table.from_lines(
        name, df, md, tex, empty="No finished run has a step-0 and a later evaluation of this statistic.")


def training_effect_lines(paired_bf16: pd.DataFrame) -> list[str]:
    """The statement of the training effect from :func:`paired_accuracy_table` with
    ``precision="bf16"``: per block, every arm's BF16-evaluated gain minus the BF16 arm's, with
    its 95% interval (empty without such pairs)."""
    if paired_bf16 is None or paired_bf16.empty or "vs_bf16_lo" not in paired_bf16.columns:
        return []
    d = paired_bf16[(paired_bf16["vs_bf16_pairs"] > 0) & paired_bf16["vs_bf16_mean"].map(np.isfinite)]
    if d.empty:
        return []
    out = ["The training effect is the BF16-evaluated paired gain: per seed, the arm's gain from step 0 "
           "scored by a BF16 engine minus the BF16 arm's, mean and 95% interval over seeds (points):", ""]
    for (algo, model), g in d.groupby(["algorithm", "model"], sort=False):
        parts = []
        for _, r in g.iterrows():
            ci = (f" [{100 * r['vs_bf16_lo']:+.1f}, {100 * r['vs_bf16_hi']:+.1f}]"
                  if np.isfinite(r["vs_bf16_lo"]) else "")
            n = int(r["vs_bf16_pairs"])
            parts.append(f"{r['arm']} {100 * r['vs_bf16_mean']:+.1f}{ci} ({n} seed{'s' if n != 1 else ''})")
        out.append(f"- {algo.upper()} · {model}: " + "; ".join(parts) + ".")
    return out
