"""The dose-response of the entropy surge to the precision noise (issue 48): the numbers.

The ``surge_dose`` sweep runs GRPO at ``scale=long`` over precision arms (``fp8``: the *doses*,
BF16 with vanilla clipping only) x clip arms x seeds; every run logs ``actor/ratio_std`` (the
standard deviation of r - 1 over the step's response tokens: the measured noise dose), the A<0
counts behind the clip fraction (``actor/n_neg``, ``actor/n_neg_low``) and the held-out rows'
counts (``shadow/ho_*``). The report's section and figures are :mod:`analysis.dose_report` and
:mod:`analysis.dose_figures`; this module computes, per (algorithm, model) block:

- **Which runs.** The finished runs only (``analysis.pooling.finished``: an unfinished run may not
  have reached its surge yet, so counting it would bias the surge probability down); the report
  names the ones left out. A *FP run* is one whose ``fp8`` is not ``bf16``.
- **Per run** (:func:`run_rows`): its dose, the **median** of ``actor/ratio_std`` over its
  logged steps (not the mean: at FP4 the step's std of r - 1 is heavy-tailed; one NVFP4 run's
  steps ranged 0.91-3.1e5 around a median of 17.5, its mean 1,867 set by a single step); its A<0
  counts summed over steps; its surge onset (:func:`analysis.surge.surge_onset`
  with the report's rule); the *rise*: the largest amount by which its EMA-smoothed entropy
  (the rule's span) exceeds the running minimum of that curve after the rule's warm-up (nats;
  the quantity the rule thresholds); its ``rollout/garbled_frac`` summed and counted over all
  steps and over the steps from its surge onset on; its held-out counts summed over the steps
  that logged both; its BF16-scored accuracy at the last evaluation (``eval_bf16/<ds>/avg@k`` of
  :func:`analysis.evals.final_evals`, averaged over the evaluation sets).
- **The dose of a precision arm** (:func:`dose_levels`): the mean over its **vanilla** runs of
  the per-run dose, with the 95% Student-t interval over those runs (seeds). Vanilla, because it
  is the one clip arm every precision has and the clip method itself changes the ratio's spread
  (a wider bound lets more tokens move); where a precision has no finished vanilla run, all its
  runs define it and the table says so. The precision arms are **ordered by this measured dose**
  (BF16 first, then ascending; a precision without a dose last), and the nominal order
  (:data:`NOMINAL_DOSES`, the sweep's ``MXFP8 < FP8 tensorwise < MXFP6 < NVFP4``) is given beside
  it.
- **Per (precision, clip) arm** (:func:`arm_rows`): the arm's own mean dose (t interval); the
  **share of A<0 tokens below the bound**: the ratio of sums over runs and steps, sum
  ``actor/n_neg_low`` / sum ``actor/n_neg`` (not the mean of per-run fractions: a run with more
  A<0 tokens weighs more, as in the pooled count); surged runs of the runs, the surge probability
  with **Wilson's 95% score interval** (:func:`wilson`), the median onset and its range among
  the surged runs; the garbled fraction as the mean over all (run, step) values and over the
  steps from each surged run's onset on; the held-out ratio, sum over seeds of FP8's held-out
  A<0 tokens below the bound in force over the BF16 shadow's below 1 - eps_low
  (:func:`analysis.heldout_judgement.pooled_ratio`: ratio of sums, Fieller's paired 95%
  interval); the BF16-scored final accuracy, mean over runs with its 95% t interval.
- **Comparisons** (:func:`comparison_rows`): the surge probability of each non-vanilla clip arm
  against the vanilla arm of the same dose, and of each FP arm against BF16 vanilla (the block's
  reference), by **Fisher's exact test**, two-sided (:func:`fisher_exact`: the sum of the
  hypergeometric probabilities of every table with the observed margins no more likely than the
  observed one). **Holm's correction** (:func:`analysis.heldout_judgement.holm`) over every
  comparison of the section (all blocks): the family is the section's question "does the clip
  method or the precision change the surge probability"; an adjusted p below :data:`FWER`
  survives.

Where the issue was silent we chose [G]: finished runs only; the median over a run's steps as
its dose; the vanilla runs as the dose's
definition; the rise in nats (the rule's ``min_rise`` is in nats) rather than as a multiple; the
garbled fraction after the onset pooled over the surged runs' steps; accuracy averaged over the
evaluation sets; the Holm family spanning the whole section; Wilson's z = 1.959964 (95%).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.arms import FP8_LABELS, arm_label, arm_order_key, panel_order_key, split_clip
from analysis.collect import Collection
from analysis.evals import final_evals
from analysis.heldout import mean_ci
from analysis.heldout_judgement import holm, pooled_ratio
from analysis.pooling import finished
from analysis.surge import SurgeRule, ema, surge_onset
from fp8rl.runs import metrics as M

#: The BF16 precision arm (no FP8 noise: the reference dose).
BF16 = "bf16"
#: The clip arm that defines a precision's dose and that the other clip arms are compared with.
REFERENCE_CLIP = "vanilla"
#: The sweep's nominal dose order, weakest first (sweeps/sweep/surge_dose.yaml).
NOMINAL_DOSES: tuple[str, ...] = ("mxfp8", "tensorwise", "mxfp6", "nvfp4")
#: 0.975 quantile of the standard normal (Wilson's 95% interval).
Z95 = 1.959963984540054
#: Family-wise error rate of the Holm correction.
FWER = 0.05
#: Fewest FP precision arms with a measured dose for the section to be drawn.
MIN_DOSES = 2

RUN_COLUMNS = ["run", "algorithm", "model", "fp8", "clip", "seed", "dose", "dose_steps", "n_neg", "n_neg_low",
               "share", "surge_step", "surged", "rise", "garbled_sum", "garbled_n", "after_sum", "after_n",
               "ho_fp8", "ho_bf16", "ho_steps", "acc_bf16"]


def is_fp(fp8: str) -> bool:
    """Whether the precision arm ``fp8`` carries low-precision noise (anything but BF16)."""
    return str(fp8) != BF16


def _dose_runs(coll: Collection) -> set[str]:
    st = coll.steps
    if not len(st) or M.ACTOR_RATIO_STD not in st.columns:
        return set()
    ok = np.isfinite(st[M.ACTOR_RATIO_STD].to_numpy(dtype=float))
    return set(st.loc[ok, "run"].astype(str))


def has_dose(coll: Collection) -> bool:
    """Whether ``coll`` has a dose response to report: finished runs of at least
    :data:`MIN_DOSES` FP (non-BF16) precision arms that logged ``actor/ratio_std``."""
    done = finished(coll)
    logged = _dose_runs(done)
    if not logged:
        return False
    r = done.runs[done.runs["run"].astype(str).isin(logged)]
    return len({str(f) for f in r["fp8"] if is_fp(f)}) >= MIN_DOSES


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float, float]:
    """(k / n, lo, hi): Wilson's score interval for a binomial proportion, k successes of n,
    ``(p + z^2/2n ± z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)``; NaN for n = 0."""
    k, n = int(k), int(n)
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"wilson needs 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return math.nan, math.nan, math.nan
    p = k / n
    den = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return p, 0.0 if k == 0 else max(0.0, centre - half), 1.0 if k == n else min(1.0, centre + half)


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided p of Fisher's exact test of the 2x2 table [[a, b], [c, d]] (rows: the two arms;
    columns: surged, not surged): the sum of the hypergeometric probabilities, given the margins,
    of every table no more likely than the observed one (relative tolerance 1e-7, as R and scipy)."""
    cells = [int(x) for x in (a, b, c, d)]
    if min(cells) < 0:
        raise ValueError(f"fisher_exact needs non-negative counts, got {cells}")
    a, b, c, d = cells
    r1, r2, c1 = a + b, c + d, a + c
    n = r1 + r2
    if n == 0:
        return 1.0
    total = math.comb(n, c1)
    probs = {x: math.comb(r1, x) * math.comb(r2, c1 - x) / total for x in range(max(0, c1 - r2), min(r1, c1) + 1)}
    observed = probs[a]
    return min(1.0, float(sum(p for p in probs.values() if p <= observed * (1 + 1e-7))))


def entropy_rise(steps, entropy, rule: SurgeRule) -> float:
    """The largest excess of the EMA-smoothed entropy (span ``rule.span``, NaN steps skipped) over
    its running minimum, over the steps >= ``rule.warmup`` (nats; NaN without such a step).
    ``steps``, ``entropy``: [T]."""
    steps, e = np.asarray(steps), np.asarray(entropy, dtype=float)
    if steps.shape != e.shape:
        raise ValueError(f"steps {steps.shape} and entropy {e.shape} must have the same shape")
    ok = np.isfinite(e)
    steps, e = steps[ok], e[ok]
    if not e.size:
        return math.nan
    s = ema(e, rule.span)[steps >= rule.warmup]
    return float(np.max(s - np.minimum.accumulate(s))) if s.size else math.nan


def _final_accuracy(coll: Collection) -> dict[str, float]:
    """run -> BF16-scored avg@k at its last evaluation, mean over the evaluation sets."""
    ev = final_evals(coll, M.EVAL_AVG, precision=M.EVAL_BF16)
    if ev.empty:
        return {}
    return {str(k): float(v) for k, v in ev.groupby("run", observed=True)["value"].mean().items()}


def run_rows(coll: Collection, rule: SurgeRule) -> pd.DataFrame:
    """One row per finished run of ``coll`` that logged steps (columns :data:`RUN_COLUMNS`, see
    the module docstring): ``dose`` (median ``actor/ratio_std``; NaN when never logged),
    ``dose_steps``; ``n_neg, n_neg_low`` (sums over the steps that logged both), ``share`` (their
    quotient; NaN without an A<0 token); ``surge_step`` (Int64, NA: none), ``surged``, ``rise``;
    ``garbled_sum, garbled_n`` (over all steps), ``after_sum, after_n`` (steps >= the onset);
    ``ho_fp8, ho_bf16, ho_steps`` (the held-out counts over the steps that logged both);
    ``acc_bf16`` (NaN without a BF16-scored evaluation)."""
    done = finished(coll)
    st = done.steps
    if not len(st):
        return pd.DataFrame(columns=RUN_COLUMNS)
    acc = _final_accuracy(done)
    axes = done.runs.set_index(done.runs["run"].astype(str))
    rows = []
    for run, g in st.groupby("run", observed=True, sort=False):
        run = str(run)
        if run not in axes.index:
            continue
        g = g.sort_values("step")

        def col(m: str, g=g) -> np.ndarray:
            return g[m].to_numpy(dtype=float) if m in g.columns else np.full(len(g), np.nan)

        steps = g["step"].to_numpy()
        ent, dose, garb = col(M.ACTOR_ENTROPY), col(M.ACTOR_RATIO_STD), col(M.ROLLOUT_GARBLED_FRAC)
        neg, low = col(M.ACTOR_N_NEG), col(M.ACTOR_N_NEG_LOW)
        counts = np.isfinite(neg) & np.isfinite(low)
        ho_f, ho_b = col(M.SHADOW_HO_FP8_LOW_N), col(M.SHADOW_HO_BF16_LOW_N)
        ho = np.isfinite(ho_f) & np.isfinite(ho_b)
        onset = surge_onset(steps, ent, rule)
        after = np.isfinite(garb) & (steps >= onset) if onset is not None else np.zeros(len(g), bool)
        n_neg = float(neg[counts].sum()) if counts.any() else math.nan
        n_low = float(low[counts].sum()) if counts.any() else math.nan
        a = axes.loc[run]
        rows.append({
            "run": run, "algorithm": str(a["algorithm"]), "model": str(a["model"]), "fp8": str(a["fp8"]),
            "clip": str(a["clip"]), "seed": a["seed"],
            "dose": float(np.median(dose[np.isfinite(dose)])) if np.isfinite(dose).any() else math.nan,
            "dose_steps": int(np.isfinite(dose).sum()), "n_neg": n_neg, "n_neg_low": n_low,
            "share": n_low / n_neg if n_neg > 0 else math.nan,
            "surge_step": onset, "surged": onset is not None, "rise": entropy_rise(steps, ent, rule),
            "garbled_sum": float(garb[np.isfinite(garb)].sum()), "garbled_n": int(np.isfinite(garb).sum()),
            "after_sum": float(garb[after].sum()), "after_n": int(after.sum()),
            "ho_fp8": float(ho_f[ho].sum()), "ho_bf16": float(ho_b[ho].sum()), "ho_steps": int(ho.sum()),
            "acc_bf16": acc.get(run, math.nan)})
    df = pd.DataFrame(rows, columns=RUN_COLUMNS)
    df["surge_step"] = df["surge_step"].astype("Int64")
    return df


def nominal_rank(fp8: str) -> int:
    """1-based position of ``fp8`` in :data:`NOMINAL_DOSES` (BF16: 0; unknown: after them)."""
    if not is_fp(fp8):
        return 0
    return NOMINAL_DOSES.index(fp8) + 1 if fp8 in NOMINAL_DOSES else len(NOMINAL_DOSES) + 1


def dose_levels(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (algorithm, model, fp8) of :func:`run_rows`' table: ``dose_mean, dose_lo, dose_hi,
    dose_n`` (the per-run doses of its vanilla runs, or of all its runs where it has no vanilla run
    with a dose: ``dose_from`` says which; 95% t interval over runs), ``nominal_rank``,
    ``dose_rank`` (BF16 0, then 1, 2, ... by ascending measured dose; no dose: last, by nominal
    rank then name), rows in ``dose_rank`` order within each block."""
    cols = ["algorithm", "model", "fp8", "dose_mean", "dose_lo", "dose_hi", "dose_n", "dose_from", "nominal_rank",
            "dose_rank"]
    out = []
    for (algo, model), blk in sorted(runs.groupby(["algorithm", "model"], sort=False),
                                     key=lambda kv: panel_order_key(*kv[0])):
        rows = []
        for fp8, g in blk.groupby("fp8", sort=False):
            ref = g[(g["clip"] == REFERENCE_CLIP) & np.isfinite(g["dose"].to_numpy(dtype=float))]
            src = REFERENCE_CLIP if len(ref) else "all arms"
            m, lo, hi, n = mean_ci((ref if len(ref) else g)["dose"])
            rows.append({"algorithm": algo, "model": model, "fp8": str(fp8), "dose_mean": m, "dose_lo": lo,
                         "dose_hi": hi, "dose_n": n, "dose_from": src, "nominal_rank": nominal_rank(str(fp8))})
        rows.sort(key=lambda r: (is_fp(r["fp8"]), not np.isfinite(r["dose_mean"]),
                                 r["dose_mean"] if np.isfinite(r["dose_mean"]) else 0.0, r["nominal_rank"], r["fp8"]))
        first = 0 if rows and not is_fp(rows[0]["fp8"]) else 1
        for i, r in enumerate(rows):
            r["dose_rank"] = i + first
        out += rows
    return pd.DataFrame(out, columns=cols)


def arm_rows(runs: pd.DataFrame, levels: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per (algorithm, model, fp8, clip) of :func:`run_rows`' table, in dose order then clip order
    (module docstring): the precision's ``dose_*``, ``nominal_rank``, ``dose_rank`` (from
    ``levels``, :func:`dose_levels`); the arm's ``arm_dose_mean, arm_dose_lo, arm_dose_hi``;
    ``n_neg, n_neg_low, share`` (ratio of sums); ``runs, surged, p_surge, p_lo, p_hi`` (Wilson);
    ``onset_median, onset_min, onset_max``; ``garbled, garbled_after`` (NaN: no such step);
    ``ho_ratio, ho_lo, ho_hi, ho_n`` (seeds with held-out counts), ``ho_fp8, ho_bf16``;
    ``acc_mean, acc_lo, acc_hi, acc_n`` (BF16-scored final avg@k, a fraction)."""
    levels = dose_levels(runs) if levels is None else levels
    rows = []
    for lv in levels.itertuples(index=False):
        blk = runs[(runs["algorithm"] == lv.algorithm) & (runs["model"] == lv.model) & (runs["fp8"] == lv.fp8)]
        for clip in sorted(set(blk["clip"]), key=lambda c: arm_order_key(lv.fp8, c)):
            g = blk[blk["clip"] == clip]
            dm, dlo, dhi, _ = mean_ci(g["dose"])
            n_neg, n_low = float(g["n_neg"].sum()), float(g["n_neg_low"].sum())
            k, n = int(g["surged"].sum()), len(g)
            p, plo, phi = wilson(k, n)
            onsets = g.loc[g["surged"], "surge_step"].astype(float).to_numpy()
            garbled_n, after_n = float(g["garbled_n"].sum()), float(g["after_n"].sum())
            ho = g[g["ho_steps"] > 0]
            hr, hlo, hhi = pooled_ratio(ho["ho_fp8"], ho["ho_bf16"])
            am, alo, ahi, an = mean_ci(g["acc_bf16"])
            rows.append({
                **lv._asdict(), "clip": clip, "method": split_clip(clip)[0], "arm": arm_label(lv.fp8, clip),
                "arm_dose_mean": dm, "arm_dose_lo": dlo, "arm_dose_hi": dhi,
                "n_neg": n_neg, "n_neg_low": n_low, "share": n_low / n_neg if n_neg > 0 else math.nan,
                "runs": n, "surged": k, "p_surge": p, "p_lo": plo, "p_hi": phi,
                "onset_median": float(np.median(onsets)) if len(onsets) else math.nan,
                "onset_min": float(onsets.min()) if len(onsets) else math.nan,
                "onset_max": float(onsets.max()) if len(onsets) else math.nan,
                "garbled": float(g["garbled_sum"].sum()) / garbled_n if garbled_n else math.nan,
                "garbled_after": float(g["after_sum"].sum()) / after_n if after_n else math.nan,
                "ho_ratio": hr, "ho_lo": hlo, "ho_hi": hhi, "ho_n": len(ho),
                "ho_fp8": float(ho["ho_fp8"].sum()), "ho_bf16": float(ho["ho_bf16"].sum()),
                "acc_mean": am, "acc_lo": alo, "acc_hi": ahi, "acc_n": an})
    cols = [*levels.columns, "clip", "method", "arm", "arm_dose_mean", "arm_dose_lo", "arm_dose_hi", "n_neg",
            "n_neg_low", "share", "runs", "surged", "p_surge", "p_lo", "p_hi", "onset_median", "onset_min",
            "onset_max", "garbled", "garbled_after", "ho_ratio", "ho_lo", "ho_hi", "ho_n", "ho_fp8", "ho_bf16",
            "acc_mean", "acc_lo", "acc_hi", "acc_n"]
    return pd.DataFrame(rows, columns=cols)


def fp_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The FP runs of :func:`run_rows`' table (every precision arm but BF16)."""
    return runs[[is_fp(f) for f in runs["fp8"]]]


def comparison_pairs(arms: pd.DataFrame) -> list[tuple[pd.Series, pd.Series, str]]:
    """The section's comparisons as (arm, reference arm, against) rows of :func:`arm_rows`' table,
    in dose order: per block and FP dose each non-vanilla clip arm against that dose's vanilla arm
    (``against`` = :data:`REFERENCE_CLIP`), then each FP arm against BF16 vanilla (``"BF16"``).
    Shared by the surge comparisons and the accuracy comparisons (:mod:`analysis.dose_accuracy`)."""
    pairs = []
    for _, blk in arms.groupby(["algorithm", "model"], sort=False):
        fp = blk[[is_fp(f) for f in blk["fp8"]]]
        bf16 = blk[(blk["fp8"] == BF16) & (blk["clip"] == REFERENCE_CLIP)]
        for _, dose in fp.groupby("fp8", sort=False):
            van = dose[dose["clip"] == REFERENCE_CLIP]
            if not van.empty:
                pairs += [(r, van.iloc[0], REFERENCE_CLIP)
                          for _, r in dose[dose["clip"] != REFERENCE_CLIP].iterrows()]
        if not bf16.empty:
            pairs += [(r, bf16.iloc[0], "BF16") for _, r in fp.iterrows()]
    return pairs


def comparison_rows(arms: pd.DataFrame) -> pd.DataFrame:
    """The section's Fisher tests on surge probability (module docstring), one row each, in
    dose order: per block and FP dose each non-vanilla clip arm against that dose's vanilla arm,
    then each FP arm against BF16 vanilla. Columns ``algorithm, model, fp8, clip, arm, against``
    (``"vanilla"``: the same dose's; ``"BF16"``), ``surged, runs, ref_surged, ref_runs, p_surge,
    ref_p_surge, diff`` (p_surge - ref_p_surge), ``p`` (two-sided), ``p_holm`` (Holm over every
    row), ``survives`` (``p_holm <`` :data:`FWER`)."""
    rows = []
    for r, ref, against in comparison_pairs(arms):
        rows.append({"algorithm": r["algorithm"], "model": r["model"], "fp8": r["fp8"], "clip": r["clip"],
                     "arm": r["arm"], "against": against, "surged": int(r["surged"]), "runs": int(r["runs"]),
                     "ref_surged": int(ref["surged"]), "ref_runs": int(ref["runs"]), "p_surge": r["p_surge"],
                     "ref_p_surge": ref["p_surge"], "diff": r["p_surge"] - ref["p_surge"],
                     "p": fisher_exact(r["surged"], r["runs"] - r["surged"], ref["surged"],
                                       ref["runs"] - ref["surged"])})
    cols = ["algorithm", "model", "fp8", "clip", "arm", "against", "surged", "runs", "ref_surged", "ref_runs",
            "p_surge", "ref_p_surge", "diff", "p", "p_holm", "survives"]
    df = pd.DataFrame(rows, columns=cols)
    df["p_holm"] = holm(df["p"].to_numpy(dtype=float)) if len(df) else []
    df["survives"] = df["p_holm"] < FWER
    return df


def label(fp8: str) -> str:
    """The precision arm's display name (``FP8 MXFP8``)."""
    return FP8_LABELS.get(str(fp8), f"FP8 {fp8}")


def dose_arms(coll: Collection, rule: SurgeRule) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(runs, levels, arms, comparisons) of ``coll``: :func:`run_rows`, :func:`dose_levels`,
    :func:`arm_rows`, :func:`comparison_rows`."""
    runs = run_rows(coll, rule)
    levels = dose_levels(runs)
    arms = arm_rows(runs, levels)
    return runs, levels, arms, comparison_rows(arms)

