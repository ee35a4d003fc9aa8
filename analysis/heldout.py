"""Measures Calibrated Clipping cannot force: its held-out error and the gradient against BF16's.

Two per-step measures, logged on diagnostic steps (``fp8rl.runs.metrics``, ``HELDOUT_METRICS``):

**Held-out calibration error.** ``shadow/oos_n_neg``: A<0 tokens with a BF16 shadow that did not
feed the bounds applied to them; ``shadow/oos_fp8_low_n``: of those, the ones whose FP8 ratio is
below the lower bound applied; ``shadow/oos_bf16_low_n``: the ones whose BF16 shadow ratio is
below 1 - eps_low. Σ fp8 / Σ bf16 is the calibration's real error: 1 when the bound clips as many
new A<0 tokens as BF16 would. Which tokens are out of sample depends on the mode: vanilla and TIS
(never calibrated) every shadowed token; ``periodic`` / ``pooled`` every measured token (their
bounds come from earlier steps); ``sampled`` the tokens outside the step's measured subset, and the
subset against the previous bounds. ``same_batch`` bounds rule only the tokens they come from, so
nothing is out of sample; its runs log the same counts by 2-fold cross-fitting
(``shadow/xfit_*``: each half against the bounds the mode's estimator gives on the other half),
and for them this table reads those, marked **cross-fitted**. A run's kind is decided by its mode
(:mod:`analysis.clip_config`), never by which keys happen to be there: a ``same_batch`` run is read
from ``xfit_*`` only, every other run from ``oos_*`` only (a calibrated run whose mode is unknown:
``xfit_*`` when it logged no out-of-sample token).

Per row (block x arm x calibration mode): the per-run sums over diagnostic steps (steps that logged
both clipped counts), pooled ratio Σ fp8 / Σ bf16 over steps and seeds, and its 95% interval over
seeds: **Fieller's** on the per-run sums, numerator and denominator paired within a run
(:func:`analysis.ratio_ci.ratio_ci`, cut to R >= 0; the percentile bootstrap over seeds goes to the
CSV only, for the reason in that module); the tokens behind it (A<0, BF16-clipped, FP8-clipped).

**Gradient agreement.** ``shadow/grad_cos``: cosine between the policy-loss gradient as trained
(FP8 ratios, the arm's bounds) and the one with BF16 shadow ratios and the vanilla bounds through
the BF16 model, same weights and tokens; a run's value is its mean over the steps that logged it.
Per row: the mean over seeds with the 95% Student-t interval (n - 1 degrees of freedom), and the
difference to the TIS arm of the same block and FP8 setting, paired by (sweep, seed): mean, 95%
t interval and t. Recall and precision of the clipped tokens are in the agreement table
(:func:`analysis.calibration_match.agreement_table`).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.arms import FP8_LABELS, arm_label, select, split_clip
from analysis.bf16_ratio import keyed_values
from analysis.clip_config import SAME_BATCH, run_settings
from analysis.collect import Collection
from analysis.counts import ci_columns
from analysis.ratio_ci import LEVEL, ratio_ci, t_quantile
from analysis.tabulate import Table, blocks, render_blocks
from fp8rl.runs import metrics as M

#: Per kind: (A<0 tokens, FP8-clipped, BF16-clipped) count metrics.
HELDOUT: dict[str, tuple[str, str, str]] = {
    "oos": (M.SHADOW_OOS_N_NEG, M.SHADOW_OOS_FP8_LOW_N, M.SHADOW_OOS_BF16_LOW_N),
    "xfit": (M.SHADOW_XFIT_N_NEG, M.SHADOW_XFIT_FP8_LOW_N, M.SHADOW_XFIT_BF16_LOW_N),
}
KIND_LABELS: dict[str, str] = {"oos": "out of sample", "xfit": "cross-fitted"}


def mean_ci(values, level: float = LEVEL) -> tuple[float, float, float, int]:
    """(mean, lo, hi, n) of the finite ``values``: Student t interval with n - 1 degrees of
    freedom (NaN bounds with fewer than two values; a zero-width interval with zero spread)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    n = len(v)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    m = float(v.mean())
    if n < 2:
        return m, math.nan, math.nan, n
    h = t_quantile(0.5 + level / 2, n - 1) * float(v.std(ddof=1)) / math.sqrt(n)
    return m, m - h, m + h, n


def mean_text(m: float, lo: float, hi: float, n: int, fmt: str = ".4f", signed: bool = False) -> str:
    """``"0.9812 [0.9790, 0.9834]"``; ``"0.9812, n/a (1 seed)"``; "n/a" without a value."""
    if n == 0 or not np.isfinite(m):
        return "n/a"
    f = ("+" if signed else "") + fmt
    if n < 2:
        return f"{format(m, f)}, n/a (1 seed)"
    return f"{format(m, f)} [{format(lo, f)}, {format(hi, f)}]"


def _kind(mode: str, oos_tokens: float, xfit_steps: int) -> str:
    if mode == SAME_BATCH:
        return "xfit"
    if mode == "" and xfit_steps > 0 and not oos_tokens > 0:
        return "xfit"
    return "oos"


def run_heldout(coll: Collection) -> pd.DataFrame:
    """One row per run that logged steps.

    Columns: ``run, algorithm, model, fp8, clip, method, mode, lower_estimator, kind`` (``oos`` /
    ``xfit``, see the module docstring); per kind k: ``{k}_n_neg, {k}_fp8, {k}_bf16`` (sums over
    the steps that logged both clipped counts; NaN where none did) and ``{k}_steps``; the chosen
    kind's ``n_neg, fp8, bf16, steps``; ``grad_cos`` (mean over the steps that logged it) and
    ``grad_cos_steps``.
    """
    kinds = [f"{k}_{c}" for k in HELDOUT for c in ("n_neg", "fp8", "bf16", "steps")]
    cols = ["run", "algorithm", "model", "fp8", "clip", "method", "mode", "lower_estimator", "kind", *kinds,
            "n_neg", "fp8_low", "bf16_low", "steps", "grad_cos", "grad_cos_steps"]
    st = coll.steps
    if not len(st):
        return pd.DataFrame(columns=cols)
    run = st["run"].astype(str).to_numpy()
    df = pd.DataFrame({"run": pd.unique(run)})

    def col(m: str) -> np.ndarray:
        return st[m].to_numpy(dtype=float) if m in st.columns else np.full(len(st), np.nan)

    for k, (n_m, fp8_m, bf16_m) in HELDOUT.items():
        fp8, bf16, n_neg = col(fp8_m), col(bf16_m), col(n_m)
        ok = np.isfinite(fp8) & np.isfinite(bf16)
        part = pd.DataFrame({"run": run, "n_neg": np.where(ok, n_neg, np.nan), "fp8": np.where(ok, fp8, np.nan),
                             "bf16": np.where(ok, bf16, np.nan), "ok": ok})
        g = part.groupby("run", sort=False)
        sums = g[["n_neg", "fp8", "bf16"]].sum(min_count=1).reindex(df["run"])
        for c in ("n_neg", "fp8", "bf16"):
            df[f"{k}_{c}"] = sums[c].to_numpy(dtype=float)
        df[f"{k}_steps"] = g["ok"].sum().reindex(df["run"]).to_numpy(dtype=int)
    cos = pd.DataFrame({"run": run, "v": col(M.SHADOW_GRAD_COS)}).groupby("run", sort=False)["v"]
    df["grad_cos"] = cos.mean().reindex(df["run"]).to_numpy(dtype=float)
    df["grad_cos_steps"] = cos.count().reindex(df["run"]).to_numpy(dtype=int)
    axes = coll.runs[["run", "algorithm", "model", "fp8", "clip"]].astype({"run": str})
    df = df.merge(axes, on="run", how="left").merge(run_settings(coll), on="run", how="left")
    df["mode"] = df["mode"].fillna("")
    df["lower_estimator"] = df["lower_estimator"].fillna("")
    df["method"] = [m if isinstance(m, str) else split_clip(str(c))[0] for m, c in zip(df["method"], df["clip"],
                                                                                       strict=True)]
    df["kind"] = [_kind(m, o, x) for m, o, x in zip(df["mode"], df["oos_n_neg"], df["xfit_steps"], strict=True)]
    for c, src in (("n_neg", "n_neg"), ("fp8_low", "fp8"), ("bf16_low", "bf16"), ("steps", "steps")):
        df[c] = [r[f"{k}_{src}"] for k, (_, r) in zip(df["kind"], df.iterrows(), strict=True)]
    return df[cols]


def tis_clip(arms: list[tuple[str, str]], fp8: str) -> str:
    """The block's TIS arm of FP8 setting ``fp8`` (``tis``, else its first TIS variant); ""."""
    clips = [c for f, c in arms if f == fp8 and split_clip(c)[0] == "tis"]
    return "tis" if "tis" in clips else (clips[0] if clips else "")


def heldout_rows(coll: Collection) -> tuple[pd.DataFrame, list[str]]:
    """One row per (algorithm, model, arm, calibration mode, kind) whose runs logged the held-out
    counts or ``shadow/grad_cos``, and the labels of the arms left out ("ALGO model: arm").

    Columns: ``algorithm, model, fp8, granularity, clip, method, mode, lower_estimator, arm, kind``
    (``out of sample`` / ``cross-fitted``), ``runs`` (runs with held-out counts), ``steps``,
    ``n_neg_tokens, bf16_tokens, fp8_tokens`` (sums), the ratio's :func:`analysis.counts.ci_columns`
    with prefix ``ratio``; ``grad_cos_runs, grad_cos_mean, grad_cos_lo, grad_cos_hi``;
    ``tis_clip`` (the TIS arm compared with), ``tis_pairs, tis_diff_mean, tis_diff_lo,
    tis_diff_hi, tis_diff_t`` (this arm's grad_cos minus TIS's, same seed).
    """
    per_run = run_heldout(coll)
    keyed = keyed_values(per_run, coll, "grad_cos") if len(per_run) else per_run
    rows, omitted = [], []
    for algo, model, arms in blocks(coll):
        for fp8, clip in arms:
            r_arm = select(per_run, algo, model, fp8, clip)
            groups = list(r_arm.groupby(["mode", "kind"], sort=True)) if len(r_arm) else []
            shown = False
            for (mode, kind), r in groups:
                has_counts = r["steps"] > 0
                has_cos = r["grad_cos_steps"] > 0
                if not (has_counts.any() or has_cos.any()):
                    continue
                shown = True
                c = r[has_counts]
                ci = ratio_ci(dict(zip(c["run"], c["fp8_low"], strict=True)),
                              dict(zip(c["run"], c["bf16_low"], strict=True))) if len(c) else None
                row = {"algorithm": algo, "model": model, "fp8": fp8, "granularity": FP8_LABELS.get(fp8, fp8),
                       "clip": clip, "method": split_clip(clip)[0], "mode": mode,
                       "lower_estimator": "/".join(sorted({e for e in r["lower_estimator"] if e})),
                       "arm": arm_label(fp8, clip), "kind": KIND_LABELS[kind], "runs": int(has_counts.sum()),
                       "steps": int(c["steps"].sum()),
                       "n_neg_tokens": float(c["n_neg"].sum(min_count=1)) if len(c) else math.nan,
                       "bf16_tokens": float(c["bf16_low"].sum()) if len(c) else math.nan,
                       "fp8_tokens": float(c["fp8_low"].sum()) if len(c) else math.nan,
                       **ci_columns("ratio", ci)}
                m, lo, hi, n = mean_ci(r["grad_cos"])
                row.update({"grad_cos_runs": n, "grad_cos_mean": m, "grad_cos_lo": lo, "grad_cos_hi": hi})
                row.update(_tis_diff(keyed, r, algo, model, fp8, clip, arms))
                rows.append(row)
            if not shown:
                omitted.append(f"{algo.upper()} {model}: {arm_label(fp8, clip)}")
    cols = ["algorithm", "model", "fp8", "granularity", "clip", "method", "mode", "lower_estimator", "arm", "kind",
            "runs", "steps", "n_neg_tokens", "bf16_tokens", "fp8_tokens", *ci_columns("ratio", None),
            "grad_cos_runs", "grad_cos_mean", "grad_cos_lo", "grad_cos_hi", "tis_clip", "tis_pairs",
            "tis_diff_mean", "tis_diff_lo", "tis_diff_hi", "tis_diff_t"]
    return pd.DataFrame(rows, columns=cols), omitted


def _tis_diff(keyed: pd.DataFrame, r: pd.DataFrame, algo: str, model: str, fp8: str, clip: str,
              arms: list[tuple[str, str]]) -> dict:
    """grad_cos of the runs ``r`` minus the TIS arm's of the same seed (see :func:`heldout_rows`)."""
    tis = tis_clip(arms, fp8)
    out = {"tis_clip": tis, "tis_pairs": 0, "tis_diff_mean": math.nan, "tis_diff_lo": math.nan,
           "tis_diff_hi": math.nan, "tis_diff_t": math.nan}
    if not tis or tis == clip:
        return out
    mine = keyed[keyed["run"].isin(set(r["run"]))]
    theirs = select(keyed, algo, model, fp8, tis)
    a = {k: v for k, v in zip(mine["key"], mine["value"], strict=True) if np.isfinite(v)}
    b: dict = {}
    for k, v in zip(theirs["key"], theirs["value"], strict=True):
        if np.isfinite(v):
            b.setdefault(k, []).append(v)
    d = [a[k] - b[k][0] for k in sorted(a, key=str) if k in b and len(b[k]) == 1]
    m, lo, hi, n = mean_ci(d)
    sd = float(np.std(d, ddof=1)) if n >= 2 else math.nan
    t = m / (sd / math.sqrt(n)) if n >= 2 and sd > 0 else math.nan
    out.update({"tis_pairs": n, "tis_diff_mean": m, "tis_diff_lo": lo, "tis_diff_hi": hi, "tis_diff_t": t})
    return out


def heldout_table(coll: Collection, *, name: str = "heldout_calibration") -> Table:
    """The held-out calibration error and the gradient agreement (see the module docstring)."""
    df, omitted = heldout_rows(coll)
    header = ["Granularity", "method", "mode", "held-out tokens", "seeds", "A<0 tokens", "BF16-clipped",
              "FP8-clipped", "FP8 / BF16-clipped (95% CI)", "grad_cos (95% CI)", "grad_cos − TIS (95% CI)",
              "pairs"]

    def num(x) -> str:
        return format(x, ".0f") if np.isfinite(x) else "n/a"

    def cells(r, latex: bool) -> list[str]:
        def esc(s):
            return s
        if r["tis_clip"] == r["clip"]:
            diff = "reference"
        elif not r["tis_clip"]:
            diff = "no TIS arm"
        else:
            diff = mean_text(r["tis_diff_mean"], r["tis_diff_lo"], r["tis_diff_hi"], r["tis_pairs"], signed=True)
        ratio = r["ratio_text"] or "n/a (not logged)"
        return [esc(r["granularity"]), esc(r["method"]), esc(r["mode"]), esc(r["kind"]), str(r["runs"]),
                num(r["n_neg_tokens"]), num(r["bf16_tokens"]), num(r["fp8_tokens"]), esc(ratio),
                esc(mean_text(r["grad_cos_mean"], r["grad_cos_lo"], r["grad_cos_hi"], r["grad_cos_runs"])),
                esc(diff), str(r["tis_pairs"]) if r["tis_clip"] and r["tis_clip"] != r["clip"] else ""]

    md, tex = render_blocks(df, header, cells, lambda a, m, g: (
        "held-out calibration error: A<0 tokens with a BF16 shadow whose bounds did not come from them "
        "(out of sample; same_batch: 2-fold cross-fitted), FP8-clipped (below the bound applied) over "
        "BF16-clipped (shadow below 1 - eps_low), summed over diagnostic steps and seeds, 95% CI over "
        "seeds: Fieller on the per-run sums, paired within each run; grad_cos: cosine of the policy "
        "gradient as trained and BF16's (shadow ratios, vanilla bounds), mean over seeds of run means, "
        "95% Student-t CI; − TIS: minus the same FP8 setting's TIS arm, paired by seed"))
    if not df.empty:
        note = ("Recall and precision of the clipped tokens for these arms: the agreement table "
                "(`tables/clip_agreement.md`, 'Which tokens are clipped').")
        if omitted:
            note += (" Omitted (no held-out counts or `shadow/grad_cos` logged, e.g. runs from before "
                     "them): " + "; ".join(omitted) + ".")
        md.append(note)
        tex.append(f"% {note}")
    return Table.from_lines(name, df, md, tex, empty=(
        "No run logged the held-out counts (`shadow/oos_*`, `shadow/xfit_*`) or `shadow/grad_cos`: "
        "runs from before them."))
