"""The report's "Dose response" section (issue 48): four tables, three figures, sentences from the numbers.

The numbers and every method choice are :mod:`analysis.dose`'s and :mod:`analysis.dose_accuracy`'s, the figures
:mod:`analysis.dose_figures`'; this module renders them:

- ``tables/dose.*``: per (algorithm, model) block, per precision arm ordered by its measured dose
  (BF16 first) with its nominal rank beside it, per clip arm: the precision's dose (its vanilla
  runs' mean of per-run median ``actor/ratio_std``, 95% t interval over seeds), the arm's own mean
  and its A<0 share below the bound (ratio of sums over runs and steps);
- ``tables/surge_dose.*``: per arm the runs, the surged runs (the report's surge rule, stated in
  the caption), the surge probability with Wilson's 95% interval, the onset's median and range,
  the garbled fraction (all steps; from the onset on), the held-out clip ratio to BF16 (Fieller's
  paired 95% interval) and the BF16-scored accuracy at the last evaluation (95% t interval);
- ``tables/dose_comparisons.*``: Fisher's exact test of each non-vanilla clip arm against the
  same dose's vanilla arm and of each FP arm against BF16 vanilla, raw and Holm-adjusted p (the
  family: every comparison of the section);
- ``tables/dose_accuracy.*``: the same comparisons on the BF16-scored avg@k gain, paired by seed:
  mean difference with its 95% t interval, paired t, raw and Holm-adjusted p (the family: every
  accuracy comparison of the section);
- the figures ``entropy_dose``, ``dose_response`` and ``share_vs_surge``.

Sentences are generated from the numbers (``"3 of 24 FP runs surged (Wilson 95%: 4-31%)"``); none
states a conclusion the numbers do not carry. A collection without finished runs of at least two FP
precisions that log ``actor/ratio_std`` (every sweep before issue 48) gets no section and no file
(:func:`dose_sections` returns []), so the reports published before it stay byte for byte what
they were.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.arms import CLIP_LABELS, split_clip
from analysis.collect import Collection
from analysis.dose import (
    FWER,
    NOMINAL_DOSES,
    REFERENCE_CLIP,
    dose_arms,
    fp_runs,
    has_dose,
    is_fp,
    label,
    wilson,
)
from analysis.dose_accuracy import accuracy_comparison_rows
from analysis.dose_figures import plot_dose_response, plot_entropy_dose, plot_share_vs_surge
from analysis.heldout import mean_text
from analysis.pooling import unfinished
from analysis.surge import SurgeRule
from analysis.tabulate import Table, render_blocks

TITLE = "Dose response"


def _num(x, fmt: str) -> str:
    return format(float(x), fmt) if x is not None and np.isfinite(float(x)) else "n/a"


def _pct(x) -> str:
    return _num(100 * float(x), ".0f") if x is not None and np.isfinite(float(x)) else "n/a"


def wilson_text(k: int, n: int, what: str = "runs surged") -> str:
    """``"3 of 24 FP runs surged (Wilson 95%: 4-31%)"`` (``what`` = ``"FP runs surged"``)."""
    _, lo, hi = wilson(k, n)
    return f"{k} of {n} {what}" + (f" (Wilson 95%: {_pct(lo)}-{_pct(hi)}%)" if n else "")


def _clip_text(clip: str) -> str:
    base, variant = split_clip(clip)
    return CLIP_LABELS.get(base, base) + (f" [{variant}]" if variant else "")


def dose_table(arms: pd.DataFrame, *, name: str = "dose") -> Table:
    header = ["measured rank", "nominal rank", "precision", "dose: ratio_std (95% CI)", "clip", "runs",
              "arm's ratio_std (95% CI)", "A<0 below bound / A<0", "share below bound (%)"]

    def cells(r, latex: bool) -> list[str]:
        dose = mean_text(r["dose_mean"], r["dose_lo"], r["dose_hi"], int(r["dose_n"]))
        if r["dose_from"] != REFERENCE_CLIP:
            dose += " (all arms)"
        return [str(int(r["dose_rank"])), str(int(r["nominal_rank"])), label(r["fp8"]), dose, _clip_text(r["clip"]),
                str(int(r["runs"])),
                mean_text(r["arm_dose_mean"], r["arm_dose_lo"], r["arm_dose_hi"], int(r["runs"])),
                f"{_num(r['n_neg_low'], '.0f')} / {_num(r['n_neg'], '.0f')}", _num(100 * r["share"], ".3f")]

    nominal = " < ".join(label(f) for f in NOMINAL_DOSES)
    md, tex = render_blocks(arms, header, cells, lambda a, m, g: (
        "precision arms ordered by the measured dose (measured rank; BF16 0); dose: the mean over the precision's "
        "vanilla runs of each run's median `actor/ratio_std` over its steps (standard deviation of r − 1 over a step's response "
        "tokens), 95% Student-t interval over those runs (seeds); \"(all arms)\": a precision without a finished "
        f"vanilla run, defined by all its runs; nominal rank: the sweep's order {nominal} (1 weakest); arm's "
        "ratio_std: the same mean over this arm's runs; share below bound: sum over runs and steps of "
        "`actor/n_neg_low` / sum of `actor/n_neg` (a ratio of sums, not a mean of per-run fractions)"))
    return Table.from_lines(name, arms, md, tex, empty="No finished run logged actor/ratio_std.")


def surge_table(arms: pd.DataFrame, rule: SurgeRule, *, name: str = "surge_dose") -> Table:
    header = ["precision", "clip", "runs", "surged", "P(surge) (Wilson 95%)", "onset: median (range)",
              "garbled (%)", "garbled from onset (%)", "held-out ratio to BF16 (95% CI)", "BF16 avg@k, last eval (%)"]

    def cells(r, latex: bool) -> list[str]:
        onset = ("-" if not np.isfinite(r["onset_median"]) else
                 f"{r['onset_median']:g} ({r['onset_min']:g}-{r['onset_max']:g})")
        acc = mean_text(100 * r["acc_mean"], 100 * r["acc_lo"], 100 * r["acc_hi"], int(r["acc_n"]), fmt=".1f")
        return [label(r["fp8"]), _clip_text(r["clip"]), str(int(r["runs"])), str(int(r["surged"])),
                f"{_pct(r['p_surge'])}% [{_pct(r['p_lo'])}, {_pct(r['p_hi'])}]", onset,
                _num(100 * r["garbled"], ".2f"), _num(100 * r["garbled_after"], ".2f"),
                mean_text(r["ho_ratio"], r["ho_lo"], r["ho_hi"], int(r["ho_n"]), fmt=".3f"), acc]

    md, tex = render_blocks(arms, header, cells, lambda a, m, g: (
        f"surged: runs with an {rule.describe()} (k = {rule.k:g}, m = {rule.m}, warm-up {rule.warmup}, EMA span "
        f"{rule.span:g}, min_rise {rule.min_rise:g} nats); P(surge): surged / runs with Wilson's 95% score "
        "interval over the runs (seeds); onset: median and range of the surged runs' onset steps; garbled: mean "
        "`rollout/garbled_frac` over every step of every run, and over the surged runs' steps from their onset on "
        "(\"n/a\": no run surged); held-out ratio: held-out A<0 tokens FP8 puts below the bound in force / those "
        "the BF16 shadow puts below 1 − eps_low (`shadow/ho_*`), ratio of sums over seeds, Fieller's 95% interval "
        "paired by seed (\"n/a\": no held-out counts or no BF16-clipped one); BF16 avg@k: the BF16 engine's "
        "`eval_bf16/<dataset>/avg@k` at each run's last evaluation, averaged over the evaluation sets, mean over "
        "runs with its 95% t interval; finished runs only"))
    return Table.from_lines(name, arms, md, tex, empty="No finished run logged actor/ratio_std.")


def comparison_table(comp: pd.DataFrame, *, name: str = "dose_comparisons") -> Table:
    header = ["precision", "clip", "against", "surged", "reference surged", "P(surge) − reference (pp)",
              "p (Fisher, two-sided)", "p (Holm)", f"survives (Holm p < {FWER:g})"]

    def cells(r, latex: bool) -> list[str]:
        return [label(r["fp8"]), _clip_text(r["clip"]), _against(r), f"{r['surged']}/{r['runs']}",
                f"{r['ref_surged']}/{r['ref_runs']}", _num(100 * r["diff"], "+.0f"), _num(r["p"], ".3g"),
                _num(r["p_holm"], ".3g"), "yes" if r["survives"] else "no"]

    n = len(comp)
    md, tex = render_blocks(comp, header, cells, lambda a, m, g: (
        "surge probability of each non-vanilla clip arm against the vanilla arm of the same precision, and of each "
        "FP arm against BF16 vanilla: Fisher's exact test on the 2x2 table (surged, not surged) x (arm, reference), "
        f"two-sided; Holm's step-down correction over all {n} comparison{'s' if n != 1 else ''} of this section "
        f"(every block); survives: Holm-adjusted p < {FWER:g}"))
    return Table.from_lines(name, comp, md, tex, empty="No comparison: no arm had a reference arm with runs.")


def _against(r) -> str:
    return f"{label(r['fp8'])} vanilla" if r["against"] == REFERENCE_CLIP else "BF16 vanilla"


def accuracy_table(acc: pd.DataFrame, *, name: str = "dose_accuracy") -> Table:
    header = ["precision", "clip", "against", "seeds", "gain (pts)", "reference gain (pts)",
              "difference (pts, 95% CI)", "t", "p (paired t)", "p (Holm)", f"survives (Holm p < {FWER:g})"]

    def cells(r, latex: bool) -> list[str]:
        ci = (f"{_num(100 * r['diff_mean'], '+.1f')} [{_num(100 * r['diff_lo'], '+.1f')}, "
              f"{_num(100 * r['diff_hi'], '+.1f')}]")
        return [label(r["fp8"]), _clip_text(r["clip"]), _against(r), str(int(r["pairs"])),
                _num(100 * r["gain"], "+.1f"), _num(100 * r["ref_gain"], "+.1f"), ci, _num(r["t"], ".2f"),
                _num(r["p"], ".3g"), _num(r["p_holm"], ".3g"), "yes" if r["survives"] else "no"]

    n = int(np.isfinite(acc["p"].to_numpy(dtype=float)).sum()) if len(acc) else 0
    md, tex = render_blocks(acc, header, cells, lambda a, m, g: (
        "avg@k gain scored by a BF16 engine on the same weights (last evaluation minus step 0, averaged over the "
        "evaluation sets; finished runs) of each non-vanilla clip arm against the vanilla arm of the same "
        "precision, and of each FP arm against BF16 vanilla, paired by seed: gain and reference gain over the "
        "seeds both arms finished, the mean per-seed difference arm − reference with its 95% Student-t interval, "
        f"paired t and its two-sided p; Holm's step-down correction over all {n} accuracy comparison"
        f"{'s' if n != 1 else ''} of this section (every block); survives: Holm-adjusted p < {FWER:g}"))
    return Table.from_lines(name, acc, md, tex, empty="No comparison: no arm had a reference arm with runs.")


def accuracy_lines(acc: pd.DataFrame) -> list[str]:
    """One bullet: how many accuracy comparisons survive Holm, and which (direction, interval)."""
    if not len(acc):
        return []
    tested = acc[np.isfinite(acc["p"].to_numpy(dtype=float))]
    surv = acc[acc["survives"]]
    return [f"- {len(surv)} of {len(tested)} paired comparisons of the BF16-scored avg@k gain have a Holm-adjusted "
            f"p below {FWER:g}" + (": " + "; ".join(
                f"{label(r['fp8'])} {_clip_text(r['clip'])} against {_against(r)} "
                f"{_num(100 * r['diff_mean'], '+.1f')} pts [{_num(100 * r['diff_lo'], '+.1f')}, "
                f"{_num(100 * r['diff_hi'], '+.1f')}] (Holm p {r['p_holm']:.3g})"
                for _, r in surv.iterrows()) if len(surv) else "") + "."]


def summary_lines(runs: pd.DataFrame, levels: pd.DataFrame, comp: pd.DataFrame) -> list[str]:
    """Bullets generated from the numbers, per block: the measured against the nominal order,
    the FP runs (every clip arm) and BF16 vanilla runs that surged, per clip arm over the FP doses,
    and how many comparisons survive Holm."""
    lines = []
    many = len(levels[["algorithm", "model"]].drop_duplicates()) > 1
    for (algo, model), lv in levels.groupby(["algorithm", "model"], sort=False):
        pre = f"{algo.upper()} · {model}: " if many else ""
        blk = runs[(runs["algorithm"] == algo) & (runs["model"] == model)]
        lv = lv.sort_values("dose_rank")
        measured = " < ".join(f"{label(r.fp8)} ({_num(r.dose_mean, '.4g')})" for r in lv.itertuples(index=False))
        fp_lv = lv[[is_fp(f) for f in lv["fp8"]]]
        nominal = fp_lv.sort_values(["nominal_rank", "fp8"])["fp8"].tolist()
        same = nominal == fp_lv["fp8"].tolist()
        lines.append(f"- {pre}measured dose order (median `actor/ratio_std`): {measured}; nominal order of these FP "
                     f"precisions: {' < '.join(label(f) for f in nominal)}; the two orders "
                     + ("agree." if same else "differ."))
        fp = fp_runs(blk)
        n_prec = fp["fp8"].nunique()
        lines.append(f"- {pre}{wilson_text(int(fp['surged'].sum()), len(fp), 'FP runs surged')} ({n_prec} "
                     "precisions, every clip arm); by clip arm: "
                     + "; ".join(f"{_clip_text(c)} {wilson_text(int(g['surged'].sum()), len(g), 'surged')}"
                                 for c, g in sorted(fp.groupby("clip"), key=lambda kv: list(CLIP_LABELS).index(
                                     split_clip(kv[0])[0]) if split_clip(kv[0])[0] in CLIP_LABELS else 99)) + ".")
        ref = blk[(blk["fp8"] == "bf16") & (blk["clip"] == REFERENCE_CLIP)]
        if len(ref):
            lines.append(f"- {pre}{wilson_text(int(ref['surged'].sum()), len(ref), 'BF16 vanilla runs surged')}.")
    if len(comp):
        surv = comp[comp["survives"]]
        lines.append(f"- {len(surv)} of {len(comp)} comparisons of surge probability have a Holm-adjusted p "
                     f"below {FWER:g}" + (": " + "; ".join(
                         f"{label(r.fp8)} {_clip_text(r.clip)} against "
                         f"{'its vanilla arm' if r.against == REFERENCE_CLIP else 'BF16 vanilla'} "
                         f"({r.surged}/{r.runs} vs {r.ref_surged}/{r.ref_runs}, p {r.p:.3g}, Holm {r.p_holm:.3g})"
                         for r in surv.itertuples(index=False)) if len(surv) else "") + ".")
    return lines


def method_lines(rule: SurgeRule, n_comp: int) -> list[str]:
    return [
        "What is computed (finished runs only; `analysis.dose`):",
        "",
        "- **dose** of a precision: the mean over its vanilla runs of each run's median `actor/ratio_std` "
        "over its steps (the standard deviation of r − 1 over a step's response tokens; the median, as "
        "at FP4 a single step's can exceed the run's typical step by 10^4), with the 95% Student-t interval "
        "over those runs (seeds); the precisions are ordered by it, BF16 first;",
        "- **share below the bound**: sum over runs and steps of `actor/n_neg_low` / sum of `actor/n_neg`, "
        "per (precision, clip) arm;",
        f"- **surge**: {rule.describe()} (k = {rule.k:g}, m = {rule.m}, warm-up {rule.warmup}, span {rule.span:g}, "
        f"min_rise {rule.min_rise:g} nats); surge probability with Wilson's 95% interval over runs (seeds);",
        "- **held-out ratio to BF16**: held-out A<0 tokens below the bound in force over those the BF16 shadow "
        "puts below 1 − eps_low, ratio of sums over seeds, Fieller's paired 95% interval;",
        f"- **comparisons**: Fisher's exact test (two-sided) on surge counts, Holm-corrected over the {n_comp} "
        "comparisons of this section; the same comparisons on the BF16-scored avg@k gain by the paired t test "
        "over seeds, Holm-corrected over the section's accuracy comparisons (`analysis.dose_accuracy`).",
        "",
    ]


def dose_sections(coll: Collection, tab_dir: str | os.PathLike, fig_dir: str | os.PathLike | None = None, *,
                  rule: SurgeRule | None = None, smooth: float | None = None,
                  pdf: bool = False) -> list[tuple[str, list[str]]]:
    """Write the dose tables (and the figures when ``fig_dir`` is given) and return the report's
    section; [] when :func:`analysis.dose.has_dose` is false (module docstring). ``rule``: the
    report's surge rule (default ``SurgeRule.for_length`` of the last logged step)."""
    if not has_dose(coll):
        return []
    if rule is None:
        last = coll.steps["step"].max() if len(coll.steps) else 1
        rule = SurgeRule.for_length(max(1, int(last)))
    runs, levels, arms, comp = dose_arms(coll, rule)
    acc = accuracy_comparison_rows(coll, arms)
    tables = [dose_table(arms), surge_table(arms, rule), comparison_table(comp), accuracy_table(acc)]
    for t in tables:
        t.write(tab_dir)
    lines = [*method_lines(rule, len(comp)), *summary_lines(runs, levels, comp), *accuracy_lines(acc), ""]
    u = unfinished(coll)
    if len(u):
        lines += [f"Left out (unfinished): {', '.join(u['run'].astype(str))}.", ""]
    titles = ("Doses, ordered by the measured dose", "Surges per arm", "Surge probability compared (Fisher, Holm)",
              "Accuracy gain compared, paired by seed (t, Holm)")
    for title, t in zip(titles, tables, strict=True):
        lines += [f"**{title}** (tables/{t.name}.md)", "", t.markdown, ""]
    if fig_dir is not None:
        Path(fig_dir).mkdir(parents=True, exist_ok=True)
        figs = [("Entropy per dose", plot_entropy_dose(coll, levels, fig_dir, smooth=smooth, pdf=pdf)),
                ("Surge probability against the measured dose", plot_dose_response(coll, arms, fig_dir, rule=rule,
                                                                                   pdf=pdf)),
                ("Share below the bound against the entropy rise",
                 plot_share_vs_surge(coll, runs, levels, fig_dir, rule=rule, pdf=pdf))]
        for alt, paths in figs:
            if paths is not None:
                name = paths["png"].stem
                lines += [f"![{alt}](figures/{name}.png)", "", f"*{paths.caption}* [data](figures/{name}.csv)", ""]
    return [(TITLE, lines)]

