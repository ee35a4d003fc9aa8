"""Calibrated Clipping judged where it has data: the held-out rows (numbers; the report's tables,
figure and verdict are :mod:`analysis.heldout_report`).

With ``clip.holdout_share > 0`` every arm holds out the same seeded rows of each step (from the run
seed and the step only, so every arm of a seed holds out the same rows); they get a BF16 shadow and
never feed any calibration. Per step the run logs ``shadow/ho_n_neg`` (their A<0 tokens),
``shadow/ho_fp8_low_n`` (of which FP8 is below the lower bound in force), ``shadow/ho_bf16_low_n``
(of which the BF16 shadow is below 1 - eps_low) and ``shadow/ho_grad_cos`` (cosine of their policy
gradient as trained against BF16's); calibrating arms also log ``clip/alpha_n`` (the BF16-clipped
count each calibration could expect: how much data it had).

**(a) The deployed bound's held-out ratio.** One definition for every arm: the A<0 tokens with a
BF16 shadow that **did not set the bound in force on them** (``shadow/oos_*``, the *unseen* tokens):
every shadowed token of vanilla, TIS, the controls and the step-level modes (``windowed``,
``pooled``, ``periodic``: their bounds come from earlier steps), the tokens ``sampled``'s subset
did not feed, and under ``same_batch`` (whose bounds rule the tokens they come from) the held-out
rows only. With ``clip.shadow_diagnostics`` every row has a shadow, so each arm is scored on every
token it can be; the held-out rows alone (``shadow/ho_*``, the same rows for every arm) are shown
beside it. Per run (= per seed of an arm): x_s = sum_steps ``oos_fp8_low_n`` (FP8 below the bound
in force), y_s = sum_steps ``oos_bf16_low_n`` (the BF16 shadow below 1 - eps_low). Per arm: the
**ratio of sums over seeds** R = sum_s x_s / sum_s y_s (= mean x / mean y) with **Fieller's 95%
interval, paired by seed** (:func:`analysis.ratio_ci.fieller_ratio`; cut at 0; unbounded when the
BF16 count is not significantly above 0). 1 = the deployed bound clips, on tokens it never saw, as
many A<0 tokens as BF16 would. Why not the mean of per-seed ratios (this module's first version): a
run holds 1-20 BF16-clipped unseen tokens at mini scale, so a per-seed ratio is undefined in the
seeds where BF16 clipped none and biased upwards in the others (E[x/y] > E[x]/E[y] for a small
Poisson y); the seed stays the unit of replication in Fieller's interval. Beside it the **BF16
events** (sum_s y_s: what the interval rests on) and **alpha n**: the mean over seeds of each
run's mean ``clip/alpha_n`` over the steps that logged it (calibrating arms; "-" otherwise).

**(a') After the start** (added after the first results of ``calibration_heldout`` were seen, so
exploratory and outside the rule): the same ratio over the steps after the first quarter of each
run (step > :data:`LATE_FRACTION` x the run's last step). At mini scale the BF16 clip rate falls
several-fold over the first few steps of a 20-step run as the policy sharpens, and a bound pooled
from earlier steps (``windowed``, ``pooled``, ``periodic``) then carries their higher rate into the
current step; this column shows how much of an arm's ratio is that start-up transient.

**(b) ``ho_grad_cos``.** Per run the mean over its logged steps; per arm the mean over seeds with
its 95% Student-t interval.

**(c) Paired comparisons.** Each calibrated arm (one per calibration mode) against
:data:`COMPARATORS` (``no_lower_clip``, ``wide_lower``, ``tis``) of the same block and FP8
granularity, paired by seed (key (sweep, seed): same warm start, prompts and held-out rows; a seed
present once in both arms pairs), on two measures: ``ratio_dist`` = |R_s - 1| (the held-out ratio's
distance from BF16's 1; lower is better; |R - 1| rather than |log R| because an arm without a lower
bound, ``no_lower_clip``, has R = 0) and ``grad_cos`` (higher is better). Per (granularity,
measure): the mean of the per-seed differences calibrated - comparator (``ratio_dist`` from
each seed's own unseen-token ratio x_s / y_s; a seed where either arm's BF16 count is 0 does not
pair), its 95% t interval, the
paired t statistic and its two-sided p-value (:func:`analysis.ratio_ci.t_two_sided_p`). **Holm
correction** (:func:`holm`): the family is one (block, calibrated mode, comparator): its
measures x granularities (2 x 4 = 8 tests in ``calibration_heldout``), the tests with a p-value
(at least two pairs); a test *survives* when its Holm-adjusted p-value is below :data:`FWER`.

**(d) The default-mode rule**, written down before the sweep ran (:func:`default_mode_rule`, a pure
function of :func:`rule_rows`' table): among the calibrated modes, the cheapest whose held-out
ratio's 95% interval lies within [0.8, 1.25] (:data:`RATIO_RANGE`, ends included) and whose
held-out ``grad_cos`` is no worse than the best control's; if none qualifies, say so and keep the
cheapest. Where the issue was silent we chose:

- a mode qualifies only if it qualifies in **every** (block, granularity) row it has: one default
  for all granularities; a row without an interval (fewer than two seeds) does not qualify;
- the **controls** are :data:`CONTROLS` (``no_lower_clip``, ``wide_lower``: the issue's two control
  arms); the best control of a granularity is the one with the highest mean ``ho_grad_cos``;
- **no worse** = the paired difference mode - best control (by seed) has a 95% t interval whose
  upper end is >= 0 (the mode is not significantly below the best control; no multiplicity
  correction: the stricter reading); no control with data in a granularity: not met;
- **cheapest** = :data:`NOMINAL_COST`'s order (the extra BF16 forwards per step at the defaults,
  docs/mini.md's table; the paper-scale cost model orders them the same way): the measured
  ``perf/shadow_s`` is shown but does not rank, because a sweep run with ``clip.shadow_diagnostics``
  (as ``calibration_heldout``) shadows every row of every arm, so the seconds measure the
  diagnostic, not the mode; ``benchmarks/bench_calibration.py --part modes`` measures the modes'
  cost without it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd

from analysis.arms import FP8_LABELS, arm_label, split_clip
from analysis.bf16_ratio import keyed_values
from analysis.clip_config import run_settings
from analysis.collect import Collection
from analysis.heldout import mean_ci
from analysis.ratio_ci import fieller_ratio, t_two_sided_p
from analysis.tabulate import blocks
from fp8rl.runs import metrics as M

#: The held-out ratio's 95% interval must lie in this range (as calibration_match's MATCH_RANGE).
RATIO_RANGE = (0.8, 1.25)
#: The rule's controls (their best ho_grad_cos is the bar).
CONTROLS: tuple[str, ...] = ("no_lower_clip", "wide_lower")
#: What each calibrated mode is compared with, paired by seed (c).
COMPARATORS: tuple[str, ...] = ("no_lower_clip", "wide_lower", "tis")
#: Family-wise error rate of the Holm correction.
FWER = 0.05
#: The compared measures: name -> (per-run column, higher is better).
MEASURES: dict[str, tuple[str, bool]] = {"ratio_dist": ("ratio_dist", False), "grad_cos": ("grad_cos", True)}
#: Tie-break / fallback cost order of the modes: extra BF16 forwards per step at the defaults.
NOMINAL_COST: tuple[str, ...] = ("periodic", "sampled", "windowed", "pooled", "same_batch")
HOLDOUT_COUNTS = (M.SHADOW_HO_N_NEG, M.SHADOW_HO_FP8_LOW_N, M.SHADOW_HO_BF16_LOW_N)
#: (a'): the steps after this fraction of a run's last step.
LATE_FRACTION = 0.25
#: The unseen tokens' counts ((a): every shadowed A<0 token that did not set the bound in force on it).
UNSEEN_COUNTS = (M.SHADOW_OOS_N_NEG, M.SHADOW_OOS_FP8_LOW_N, M.SHADOW_OOS_BF16_LOW_N)


def has_holdout(coll: Collection) -> bool:
    """Whether any run logged the held-out counts (``shadow/ho_fp8_low_n`` and ``ho_bf16_low_n``)."""
    st = coll.steps
    if not len(st) or not all(m in st.columns for m in HOLDOUT_COUNTS[1:]):
        return False
    return bool((st[M.SHADOW_HO_FP8_LOW_N].notna() & st[M.SHADOW_HO_BF16_LOW_N].notna()).any())


def run_holdout(coll: Collection) -> pd.DataFrame:
    """One row per run that logged steps: ``run, algorithm, model, fp8, clip, method, mode, key``
    (pairing key (sweep, seed)); ``un_n_neg, un_fp8, un_bf16`` (the unseen tokens' counts, (a), summed
    over the steps that logged both clipped counts), ``un_steps``; ``ratio`` = un_fp8 / un_bf16 (NaN
    without a BF16-clipped unseen token), ``ratio_dist`` = |ratio - 1|; ``late_fp8, late_bf16`` (the
    same counts over the steps after the first quarter, (a')); ``ho_n_neg, ho_fp8, ho_bf16,
    ho_steps`` (the held-out rows alone, likewise); ``grad_cos`` (mean ``shadow/ho_grad_cos``),
    ``alpha_n`` (mean ``clip/alpha_n``; NaN where not logged), ``shadow_s`` (``perf/shadow_s`` per
    logged step, missing = 0; NaN when the run never logged it)."""
    cols = ["run", "algorithm", "model", "fp8", "clip", "method", "mode", "key", "un_n_neg", "un_fp8", "un_bf16",
            "un_steps", "ratio", "ratio_dist", "late_fp8", "late_bf16", "ho_n_neg", "ho_fp8", "ho_bf16", "ho_steps",
            "grad_cos", "alpha_n", "shadow_s"]
    st = coll.steps
    if not len(st):
        return pd.DataFrame(columns=cols)

    def col(m: str) -> np.ndarray:
        return st[m].to_numpy(dtype=float) if m in st.columns else np.full(len(st), np.nan)

    part = pd.DataFrame({"run": st["run"].astype(str).to_numpy(), "grad_cos": col(M.SHADOW_HO_GRAD_COS),
                         "alpha_n": col(M.CLIP_ALPHA_N), "shadow": col(M.PERF_SHADOW_S)})
    step = st["step"].to_numpy(dtype=float)
    late = step > LATE_FRACTION * part.assign(step=step).groupby("run")["step"].transform("max").to_numpy(dtype=float)
    for prefix, (n_key, fp8_key, bf16_key) in (("un", UNSEEN_COUNTS), ("ho", HOLDOUT_COUNTS)):
        fp8, bf16, n_neg = col(fp8_key), col(bf16_key), col(n_key)
        ok = np.isfinite(fp8) & np.isfinite(bf16)
        part[f"{prefix}_n_neg"] = np.where(ok, n_neg, np.nan)
        part[f"{prefix}_fp8"], part[f"{prefix}_bf16"] = np.where(ok, fp8, np.nan), np.where(ok, bf16, np.nan)
        part[f"{prefix}_ok"] = ok
    part["late_fp8"] = np.where(late, part["un_fp8"], np.nan)
    part["late_bf16"] = np.where(late, part["un_bf16"], np.nan)
    g = part.groupby("run", sort=False)
    counts = [f"{p}_{c}" for p in ("un", "ho") for c in ("n_neg", "fp8", "bf16")] + ["late_fp8", "late_bf16"]
    df = g[counts].sum(min_count=1)
    df["un_steps"], df["ho_steps"] = g["un_ok"].sum().astype(int), g["ho_ok"].sum().astype(int)
    df["grad_cos"] = g["grad_cos"].mean()
    df["alpha_n"] = g["alpha_n"].mean()
    logged = g["shadow"].count()
    df["shadow_s"] = (g["shadow"].sum() / g.size()).where(logged > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        df["ratio"] = np.where(df["un_bf16"] > 0, df["un_fp8"] / df["un_bf16"], np.nan)
    df["ratio_dist"] = (df["ratio"] - 1.0).abs()
    df = df.reset_index()
    keys = keyed_values(df, coll, "ratio")[["run", "algorithm", "model", "fp8", "clip", "key"]]
    df = df.merge(keys, on="run", how="left").merge(run_settings(coll)[["run", "method", "mode"]], on="run",
                                                      how="left")
    df["method"] = [m if isinstance(m, str) else split_clip(str(c))[0]
                    for m, c in zip(df["method"], df["clip"], strict=True)]
    df["mode"] = df["mode"].fillna("")
    return df[cols]


def pooled_ratio(x, y) -> tuple[float, float, float]:
    """(a)'s ratio of sums over seeds with Fieller's paired 95% interval (cut at 0): ``x`` ``[n]``
    per-seed FP8-clipped unseen counts, ``y`` ``[n]`` the BF16-clipped ones (same seeds, finite).
    NaN ratio when ``sum(y) == 0``; NaN bounds below two seeds."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if not len(x) or float(y.sum()) <= 0:
        return math.nan, math.nan, math.nan
    lo, hi = fieller_ratio(x, y, paired=True)
    return float(x.sum() / y.sum()), (max(lo, 0.0) if np.isfinite(lo) else lo), hi


def _arm_runs(per_run: pd.DataFrame, algo: str, model: str, fp8: str, clip: str) -> pd.DataFrame:
    m = ((per_run["algorithm"].astype(str) == algo) & (per_run["model"].astype(str) == model)
         & (per_run["fp8"].astype(str) == fp8) & (per_run["clip"].astype(str) == clip))
    return per_run[m & ((per_run["un_steps"] > 0) | (per_run["ho_steps"] > 0))]


def arm_rows(coll: Collection, per_run: pd.DataFrame | None = None) -> pd.DataFrame:
    """(a) and (b): one row per (algorithm, model, arm) whose runs logged the held-out counts.

    Columns: ``algorithm, model, fp8, granularity, clip, method, mode, arm, runs`` (seeds with
    held-out counts), ``steps``; ``un_n_neg, un_bf16, un_fp8`` (the unseen tokens, summed over seeds);
    ``ratio_mean, ratio_lo, ratio_hi`` (:func:`pooled_ratio` over the seeds with unseen counts: the
    ratio of sums and Fieller's paired interval), ``ratio_n`` (those seeds); ``late_mean, late_lo,
    late_hi, late_bf16`` (the same after the first quarter of the steps, (a')); ``ho_n_neg, ho_bf16,
    ho_fp8, ho_ratio`` (the held-out rows alone: sums and their ratio); ``alpha_n`` (NaN for arms
    that do not calibrate or never logged it), ``cos_mean, cos_lo, cos_hi, cos_n``, ``shadow_s``
    (mean over runs).
    """
    per_run = run_holdout(coll) if per_run is None else per_run
    rows = []
    for algo, model, arms in blocks(coll):
        for fp8, clip in arms:
            r = _arm_runs(per_run, algo, model, fp8, clip)
            if r.empty:
                continue
            un = r[r["un_steps"] > 0]
            m, lo, hi = pooled_ratio(un["un_fp8"], un["un_bf16"])
            late = un[np.isfinite(un["late_bf16"].to_numpy(dtype=float))]
            lm, llo, lhi = pooled_ratio(late["late_fp8"], late["late_bf16"])
            cm, clo, chi, cn = mean_ci(r["grad_cos"])
            method = split_clip(clip)[0]
            alpha = r["alpha_n"].to_numpy(dtype=float)
            ho_bf16 = float(r["ho_bf16"].sum())
            rows.append({
                "algorithm": algo, "model": model, "fp8": fp8, "granularity": FP8_LABELS.get(fp8, fp8),
                "clip": clip, "method": method, "mode": "/".join(sorted({x for x in r["mode"] if x})),
                "arm": arm_label(fp8, clip), "runs": len(r), "steps": int(r["un_steps"].sum()),
                "un_n_neg": float(un["un_n_neg"].sum()), "un_bf16": float(un["un_bf16"].sum()),
                "un_fp8": float(un["un_fp8"].sum()),
                "ratio_mean": m, "ratio_lo": lo, "ratio_hi": hi, "ratio_n": len(un),
                "late_mean": lm, "late_lo": llo, "late_hi": lhi, "late_bf16": float(late["late_bf16"].sum()),
                "ho_n_neg": float(r["ho_n_neg"].sum()), "ho_bf16": ho_bf16, "ho_fp8": float(r["ho_fp8"].sum()),
                "ho_ratio": float(r["ho_fp8"].sum()) / ho_bf16 if ho_bf16 > 0 else math.nan,
                "alpha_n": (float(np.nanmean(alpha)) if method == "calibrated" and np.isfinite(alpha).any()
                            else math.nan),
                "cos_mean": cm, "cos_lo": clo, "cos_hi": chi, "cos_n": cn,
                "shadow_s": float(np.nanmean(r["shadow_s"])) if np.isfinite(r["shadow_s"].to_numpy(float)).any()
                else math.nan})
    cols = ["algorithm", "model", "fp8", "granularity", "clip", "method", "mode", "arm", "runs", "steps",
            "un_n_neg", "un_bf16", "un_fp8", "ratio_mean", "ratio_lo", "ratio_hi", "ratio_n", "late_mean", "late_lo",
            "late_hi", "late_bf16", "ho_n_neg", "ho_bf16",
            "ho_fp8", "ho_ratio", "alpha_n", "cos_mean", "cos_lo", "cos_hi", "cos_n", "shadow_s"]
    return pd.DataFrame(rows, columns=cols)


def values_by_key(df: pd.DataFrame, column: str) -> dict:
    """key -> ``column`` for the keys (``df["key"]``: seeds) that hold exactly one finite value:
    the values :func:`paired_diff` pairs."""
    out: dict = {}
    for k, v in zip(df["key"], df[column].to_numpy(dtype=float), strict=True):
        if np.isfinite(v):
            out.setdefault(k, []).append(v)
    return {k: v[0] for k, v in out.items() if len(v) == 1}


def paired_diff(a: pd.DataFrame, b: pd.DataFrame, column: str) -> dict:
    """Per-seed differences a - b of ``column`` over the keys both hold once (finite values;
    :func:`values_by_key`): ``pairs, diff_mean, diff_lo, diff_hi`` (95% t interval), ``t``, ``p``
    (two-sided; NaN below two pairs; zero spread: p = 1 for a zero mean, else 0)."""
    x, y = values_by_key(a, column), values_by_key(b, column)
    d = np.array([x[k] - y[k] for k in sorted(set(x) & set(y), key=str)], dtype=float)
    m, lo, hi, n = mean_ci(d)
    t = p = math.nan
    if n >= 2:
        sd = float(np.std(d, ddof=1))
        if sd > 0:
            t = m / (sd / math.sqrt(n))
            p = t_two_sided_p(t, n - 1)
        else:
            t, p = (0.0, 1.0) if m == 0 else (math.copysign(math.inf, m), 0.0)
    return {"pairs": n, "diff_mean": m, "diff_lo": lo, "diff_hi": hi, "t": t, "p": p}


def holm(pvalues) -> np.ndarray:
    """Holm's step-down adjusted p-values of one family (NaN entries are not tests: they stay NaN
    and do not count in the family's size m). Sorted ascending p_(1) <= ... <= p_(m):
    adj_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    m = len(idx)
    running = 0.0
    for j, i in enumerate(idx[np.argsort(p[idx], kind="stable")]):
        running = max(running, min(1.0, (m - j) * p[i]))
        out[i] = running
    return out


def comparison_rows(coll: Collection, per_run: pd.DataFrame | None = None) -> pd.DataFrame:
    """(c): one row per (block, calibrated arm, comparator, granularity, measure).

    Columns: ``algorithm, model, clip`` (the calibrated arm's key without its FP8 setting),
    ``mode``, ``comparator``, ``fp8, granularity, measure`` (:data:`MEASURES`), ``pairs, diff_mean,
    diff_lo, diff_hi, t, p`` (:func:`paired_diff`, calibrated - comparator), ``p_holm`` (within the
    family (algorithm, model, clip, comparator)), ``survives`` (p_holm < :data:`FWER`; False
    without a test), ``favours`` ("calibrated" / comparator / "" for a zero or missing difference).
    """
    per_run = run_holdout(coll) if per_run is None else per_run
    rows = []
    for algo, model, arms in blocks(coll):
        cal = sorted({c for f, c in arms if f != "bf16" and split_clip(c)[0] == "calibrated"})
        for clip in cal:
            for comp in COMPARATORS:
                family = []
                for fp8 in [f for f, c in arms if c == clip]:
                    a, b = _arm_runs(per_run, algo, model, fp8, clip), _arm_runs(per_run, algo, model, fp8, comp)
                    if a.empty or b.empty:
                        continue
                    mode = "/".join(sorted({x for x in a["mode"] if x}))
                    for measure, (column, higher) in MEASURES.items():
                        d = paired_diff(a, b, column)
                        sign = np.sign(d["diff_mean"]) if np.isfinite(d["diff_mean"]) else 0.0
                        favours = "" if sign == 0 else ("calibrated" if (sign > 0) == higher else comp)
                        family.append({"algorithm": algo, "model": model, "clip": clip, "mode": mode,
                                       "comparator": comp, "fp8": fp8, "granularity": FP8_LABELS.get(fp8, fp8),
                                       "measure": measure, **d, "favours": favours})
                adj = holm([r["p"] for r in family])
                for r, q in zip(family, adj, strict=True):
                    r["p_holm"] = q
                    r["survives"] = bool(np.isfinite(q) and q < FWER)
                rows += family
    cols = ["algorithm", "model", "clip", "mode", "comparator", "fp8", "granularity", "measure", "pairs",
            "diff_mean", "diff_lo", "diff_hi", "t", "p", "p_holm", "survives", "favours"]
    return pd.DataFrame(rows, columns=cols)


def rule_rows(coll: Collection, per_run: pd.DataFrame | None = None) -> pd.DataFrame:
    """(d)'s input: one row per (block, calibrated mode, granularity): ``algorithm, model, mode,
    clip, fp8, granularity, cost`` (the arm's mean shadow seconds per step), ``ratio_mean, ratio_lo,
    ratio_hi``, ``cos_mean``, ``best_control`` ("" when no control has data), ``best_control_cos``,
    ``cos_diff_mean, cos_diff_lo, cos_diff_hi, cos_pairs`` (mode - best control, by seed)."""
    per_run = run_holdout(coll) if per_run is None else per_run
    arms = arm_rows(coll, per_run)
    rows = []
    for _, r in arms[(arms["method"] == "calibrated") & (arms["fp8"] != "bf16")].iterrows():
        algo, model, fp8 = r["algorithm"], r["model"], r["fp8"]
        ctrl = arms[(arms["algorithm"] == algo) & (arms["model"] == model) & (arms["fp8"] == fp8)
                    & arms["clip"].isin(CONTROLS) & arms["cos_mean"].map(np.isfinite)]
        best = ctrl.sort_values("cos_mean", ascending=False, kind="stable").iloc[0] if len(ctrl) else None
        d = (paired_diff(_arm_runs(per_run, algo, model, fp8, r["clip"]),
                         _arm_runs(per_run, algo, model, fp8, best["clip"]), "grad_cos")
             if best is not None else {"pairs": 0, "diff_mean": math.nan, "diff_lo": math.nan, "diff_hi": math.nan})
        rows.append({"algorithm": algo, "model": model, "mode": r["mode"], "clip": r["clip"], "fp8": fp8,
                     "granularity": r["granularity"], "cost": r["shadow_s"], "ratio_mean": r["ratio_mean"],
                     "ratio_lo": r["ratio_lo"], "ratio_hi": r["ratio_hi"], "cos_mean": r["cos_mean"],
                     "best_control": "" if best is None else best["clip"],
                     "best_control_cos": math.nan if best is None else best["cos_mean"],
                     "cos_diff_mean": d["diff_mean"], "cos_diff_lo": d["diff_lo"], "cos_diff_hi": d["diff_hi"],
                     "cos_pairs": d["pairs"]})
    cols = ["algorithm", "model", "mode", "clip", "fp8", "granularity", "cost", "ratio_mean", "ratio_lo",
            "ratio_hi", "cos_mean", "best_control", "best_control_cos", "cos_diff_mean", "cos_diff_lo",
            "cos_diff_hi", "cos_pairs"]
    return pd.DataFrame(rows, columns=cols)


@dataclasses.dataclass(frozen=True)
class RuleVerdict:
    """The default-mode rule's outcome: ``mode`` (the default it picks; "" without calibrated rows),
    ``qualified`` (the modes that qualify, cheapest first), ``order`` (every mode, cheapest first),
    ``reasons`` ({mode: why it does not qualify}) and ``text`` (the sentence the report prints)."""

    mode: str
    qualified: tuple[str, ...]
    order: tuple[str, ...]
    reasons: dict
    text: str


def _row_failures(r) -> list[str]:
    where = f"{r['granularity']}"
    out = []
    lo, hi = float(r["ratio_lo"]), float(r["ratio_hi"])
    if not (np.isfinite(lo) and np.isfinite(hi)):
        out.append(f"no held-out ratio interval on {where}")
    elif not (RATIO_RANGE[0] <= lo and hi <= RATIO_RANGE[1]):
        out.append(f"held-out ratio interval [{lo:.2f}, {hi:.2f}] not within "
                   f"[{RATIO_RANGE[0]}, {RATIO_RANGE[1]}] on {where}")
    if not r["best_control"]:
        out.append(f"no control with held-out grad_cos on {where}")
    elif not np.isfinite(float(r["cos_diff_hi"])):
        out.append(f"no paired grad_cos interval against {r['best_control']} on {where}")
    elif float(r["cos_diff_hi"]) < 0:
        out.append(f"held-out grad_cos below {r['best_control']}'s on {where} (difference 95% CI "
                   f"[{float(r['cos_diff_lo']):+.4f}, {float(r['cos_diff_hi']):+.4f}])")
    return out


def default_mode_rule(rules: pd.DataFrame) -> RuleVerdict:
    """The default-mode rule (module docstring, (d)) over :func:`rule_rows`' table: pure, reads
    only the columns ``mode, granularity, cost, ratio_lo, ratio_hi, best_control, cos_diff_lo,
    cos_diff_hi``."""
    if rules is None or rules.empty:
        return RuleVerdict("", (), (), {}, "No calibrated arm with held-out data: the default-mode rule has "
                                           "nothing to judge.")
    modes = sorted({str(m) for m in rules["mode"]})

    def cost_key(mode: str):
        return (NOMINAL_COST.index(mode) if mode in NOMINAL_COST else len(NOMINAL_COST), mode)

    order = tuple(sorted(modes, key=cost_key))
    reasons = {}
    for mode in order:
        fails = [f for _, r in rules[rules["mode"] == mode].iterrows() for f in _row_failures(r)]
        if fails:
            reasons[mode] = fails
    qualified = tuple(m for m in order if m not in reasons)
    rule = (f"among the calibrated modes, the cheapest whose held-out ratio's 95% interval lies within "
            f"[{RATIO_RANGE[0]}, {RATIO_RANGE[1]}] and whose held-out grad_cos is no worse than the best "
            f"control's ({', '.join(CONTROLS)}), in every granularity; if none qualifies, keep the cheapest")
    costs = ", ".join(order)
    if qualified:
        mode = qualified[0]
        text = (f"Default-mode rule ({rule}). Cheapest first (extra BF16 forwards per step): {costs}. "
                f"Qualify: {', '.join(qualified)}. "
                f"**Verdict: the default mode is `{mode}`.**")
    else:
        mode = order[0]
        text = (f"Default-mode rule ({rule}). Cheapest first (extra BF16 forwards per step): {costs}. "
                "**No calibrated mode qualifies** ("
                + "; ".join(f"{m}: {reasons[m][0]}" + (f" and {len(reasons[m]) - 1} more" if len(reasons[m]) > 1
                                                        else "") for m in order)
                + f"). **Verdict: none qualifies; keep the cheapest, `{mode}`.**")
    return RuleVerdict(mode, qualified, order, reasons, text)
