"""The findings summary at the top of ``report.md``: the headline numbers, computed.

Per (algorithm, model) block, from the report's own tables (nothing here is hand-written):

- final accuracy (``analysis.paired``: avg@k averaged over the evaluation sets, last
  evaluation): the best and the lowest arm, and the block's BF16 reference arm, mean ± std
  over seeds;
- versus BF16, paired by seed: the arms with the largest gain and the largest loss relative to
  the BF16 arm's gain. Where a BF16 engine also scored the block's evaluations (``eval_bf16/``
  keys, the ``paired_bf16`` table), only its numbers, with 95% intervals: the training effect
  (``analysis.paired``); an FP8 arm's own engine mixes the evaluation's precision into the gain,
  so the own-engine difference is not printed then. Without them (sweeps from before the BF16
  engine) the own-engine difference (mean, t and pairs), labelled as such. The final-accuracy
  sentence stays the arms' own engines (what each arm's engine scores) and says so where the
  block also has BF16-scored numbers (the same rule as the ``eval_accuracy`` figure,
  ``analysis.bars.paired_differences``: BF16-scored per block where it has pairs);
- entropy surges (``analysis.tables.diagnostics_table``): how many runs surged, in which arms;
  the highest peak entropy against the BF16 arm's;
- the mechanism (``analysis.clip_tables.mechanism_table``): the range over FP8 arms of the
  share of A<0 tokens below the lower clip bound, as a multiple of the BF16 arm's.
"""

from __future__ import annotations

import math

import pandas as pd

from analysis.arms import panel_order_key
from analysis.collect import Collection


def _fin(x) -> bool:
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _pct(m, s=None) -> str:
    out = f"{100 * m:.1f}%"
    return out + (f" ± {100 * s:.1f}" if _fin(s) else "")


#: How the summary labels a gain scored by each arm's own engine (no BF16-engine evaluation).
OWN_ENGINE = "scored by each arm's own engine (no BF16-engine evaluation in these runs)"


def _block(df: pd.DataFrame, algo: str, model: str) -> pd.DataFrame:
    if df is None or df.empty or "algorithm" not in df.columns:
        return pd.DataFrame()
    return df[(df["algorithm"].astype(str) == algo) & (df["model"].astype(str) == model)]


def _accuracy_lines(p: pd.DataFrame, *, own_gains: bool = True, bf16_scored: bool = False) -> list[str]:
    """The final accuracy and (``own_gains``) the own-engine gain minus BF16's; ``bf16_scored``:
    the block also has BF16-scored numbers, so the final accuracy names its engine."""
    if p is None or p.empty or "last_mean" not in p.columns:  # no run evaluated
        return []
    p = p[p["last_mean"].map(_fin)]
    if p.empty:
        return []
    best, low = p.loc[p["last_mean"].idxmax()], p.loc[p["last_mean"].idxmin()]
    bf16 = p[p["fp8"].astype(str) == "bf16"]
    ref = f"; BF16 reference {bf16.iloc[0]['arm']} {_pct(bf16.iloc[0]['last_mean'], bf16.iloc[0]['last_std'])}" \
        if len(bf16) else ""
    engine = ", each arm's own engine" if bf16_scored else ""
    lines = [f"Final accuracy (avg@k{engine}, mean over sets and seeds): highest {best['arm']} "
             f"{_pct(best['last_mean'], best['last_std'])}, lowest {low['arm']} "
             f"{_pct(low['last_mean'], low['last_std'])}{ref}."]
    d = p[(p["vs_bf16_pairs"] > 0) & p["vs_bf16_mean"].map(_fin)]
    if own_gains and len(d):
        hi, lo = d.loc[d["vs_bf16_mean"].idxmax()], d.loc[d["vs_bf16_mean"].idxmin()]

        def vs(r) -> str:
            t = f", t = {r['vs_bf16_t']:.1f}" if _fin(r["vs_bf16_t"]) else ""
            return f"{r['arm']} {100 * r['vs_bf16_mean']:+.1f} pts ({int(r['vs_bf16_pairs'])} seed{'s' if r['vs_bf16_pairs'] != 1 else ''}{t})"

        lines.append(f"Gain from step 0 minus the BF16 arm's gain, paired by seed, {OWN_ENGINE}: "
                     f"largest {vs(hi)}, smallest {vs(lo)}.")
    return lines


def _entropy_lines(dg: pd.DataFrame) -> list[str]:
    if dg.empty:
        return []
    runs, surged = int(dg["runs"].sum()), int(dg["surged"].sum())
    arms = [f"{r['arm']} ({int(r['surged'])}/{int(r['runs'])})" for _, r in dg.iterrows() if r["surged"]]
    lines = [f"Entropy surges: {surged} of {runs} runs" + (f", in {', '.join(arms)}." if arms else ".")]
    pk = dg[dg["peak_entropy"].map(_fin)]
    if len(pk):
        top = pk.loc[pk["peak_entropy"].idxmax()]
        bf16 = pk[pk["fp8"].astype(str) == "bf16"]
        ref = f" (BF16 arms: {bf16['peak_entropy'].max():.3g})" if len(bf16) else ""
        lines.append(f"Highest peak entropy: {top['arm']} {top['peak_entropy']:.3g} nats/token{ref}.")
    return lines


def _mechanism_lines(mc: pd.DataFrame) -> list[str]:
    if mc.empty or "x_bf16" not in mc.columns:
        return []
    fp8 = mc[(mc["fp8"].astype(str) != "bf16") & mc["x_bf16"].map(_fin)]
    if fp8.empty:
        return []
    lo, hi = fp8.loc[fp8["x_bf16"].idxmin()], fp8.loc[fp8["x_bf16"].idxmax()]
    text = (f"A<0 tokens below the lower clip bound, FP8 arms as a multiple of {lo['bf16_reference']}: "
            f"{lo['x_bf16']:.1f}x ({lo['arm']}) to {hi['x_bf16']:.1f}x ({hi['arm']})")
    if "count_x_bf16" in mc.columns:  # the same as a count of tokens (actor/n_neg_low)
        cnt = fp8[fp8["count_x_bf16"].map(_fin)]
        if cnt.empty:
            text += "; as a count of tokens: n/a (runs without `actor/n_neg_low`)"
        else:
            clo, chi = cnt.loc[cnt["count_x_bf16"].idxmin()], cnt.loc[cnt["count_x_bf16"].idxmax()]
            text += (f"; as a count of tokens: {clo['count_x_bf16']:.1f}x ({clo['arm']}) to "
                     f"{chi['count_x_bf16']:.1f}x ({chi['arm']})")
    return [text + "."]


def _training_effect_lines(p: pd.DataFrame) -> list[str]:
    """From the BF16-evaluated paired table: the arms with the largest and smallest effect."""
    if p is None or p.empty or "vs_bf16_lo" not in p.columns:
        return []
    d = p[(p["vs_bf16_pairs"] > 0) & p["vs_bf16_mean"].map(_fin)]
    if d.empty:
        return []
    hi, lo = d.loc[d["vs_bf16_mean"].idxmax()], d.loc[d["vs_bf16_mean"].idxmin()]

    def vs(r) -> str:
        ci = f" [{100 * r['vs_bf16_lo']:+.1f}, {100 * r['vs_bf16_hi']:+.1f}]" if _fin(r["vs_bf16_lo"]) else ""
        n = int(r["vs_bf16_pairs"])
        return f"{r['arm']} {100 * r['vs_bf16_mean']:+.1f} pts{ci} ({n} seed{'s' if n != 1 else ''})"

    return [f"Training effect (the BF16-evaluated paired gain: gain from step 0 scored by a BF16 engine "
            f"minus the BF16 arm's, 95% interval): largest {vs(hi)}, smallest {vs(lo)}."]


def findings(coll: Collection, *, paired: pd.DataFrame, diagnostics: pd.DataFrame,
             mechanism: pd.DataFrame, paired_bf16: pd.DataFrame | None = None) -> list[str]:
    """Markdown lines of the summary (a bullet list per (algorithm, model) block); with
    ``paired_bf16`` (``analysis.paired`` of the BF16 engine) the gains versus BF16 of every block
    it pairs are the training effect, BF16-scored, in place of the own-engine ones."""
    runs = coll.runs
    counts = runs["cell"].value_counts().to_dict()
    out = [f"- {len(runs)} cells: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + "."]
    blocks = runs[["algorithm", "model"]].dropna().astype(str).drop_duplicates().to_numpy().tolist()
    for algo, model in sorted(map(tuple, blocks), key=lambda b: panel_order_key(*b)):
        effect = _training_effect_lines(_block(paired_bf16, algo, model))
        lines = (_accuracy_lines(_block(paired, algo, model), own_gains=not effect, bf16_scored=bool(effect))
                 + effect
                 + _entropy_lines(_block(diagnostics, algo, model)) + _mechanism_lines(_block(mechanism, algo, model)))
        if not lines:
            continue
        n_arms = int(_block(runs, algo, model).groupby(["fp8", "clip"]).ngroups)
        out.append(f"- **{algo.upper()} · {model}** ({n_arms} arms):")
        out += [f"  - {x}" for x in lines]
    return out

