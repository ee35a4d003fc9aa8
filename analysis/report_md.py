"""``report.md`` and everything it links: :func:`write_report` (``python -m analysis.report`` is the
command line around it, ``analysis.report``).

report.md, in order: the findings summary; the figures, each with its caption; the headline
tables (accuracy, the paired accuracy gain, the paired end-of-training entropy, the mechanism);
the calibration analyses (``analysis.calibration_report``); the dose response of sweeps whose FP
arms log ``actor/ratio_std`` (``analysis.dose_report``; absent otherwise); which runs; the missing, failed,
damaged and incomplete cells; the per-cell detail (diagnostics per arm, start versus end, the
calibration bounds at every step), folded in ``<details>`` blocks; the method. A secondary variant
of a headline table (greedy decoding, the BF16 engine) and a problem list of more than
:data:`FOLD_ROWS` cells are folded too. Every table is also in ``tables/`` (Markdown, LaTeX, CSV).

The tables are listed once, in :func:`_tables`: what is written into ``tables/``, the index line
and the sections all come from that list.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from analysis.bars import SUMMARY_NAMES, plot_summary, summary_spec
from analysis.calibration_report import calibration_match_sections
from analysis.clip_tables import calibration_table, mechanism_table
from analysis.collect import Collection
from analysis.dose_report import dose_sections
from analysis.entropy_paired import entropy_paired_table
from analysis.evals import has_evals
from analysis.figures import FIGURE_NAMES, figure_spec, plot_figure
from analysis.paired import paired_accuracy_table, training_effect_lines
from analysis.pooling import finished, provenance_lines, unfinished, unfinished_note
from analysis.replay import report_lines
from analysis.summary import findings
from analysis.surge import SurgeRule
from analysis.tables import accuracy_table, diagnostics_table, run_diagnostics, trajectory_table
from fp8rl.runs import metrics as M

#: The order figures appear in (names of ``analysis.figures`` and ``analysis.bars``).
FIGURE_ORDER: tuple[str, ...] = ("entropy", "entropy_vs_bf16", "eval_accuracy", "clipfrac_neg_low", "clipfrac_summary",
                                 "reward_accuracy", "response_length", "mismatch_kl", "clip_bounds",
                                 "ratio_quantiles")
ALL_FIGURES: tuple[str, ...] = (*FIGURE_ORDER,
                                *(n for n in FIGURE_NAMES + SUMMARY_NAMES if n not in FIGURE_ORDER))
#: ``--figures published``: the figures the published reports (docs/results, ``make results``)
#: keep in git; every other figure is one ``python -m analysis.report`` away.
PUBLISHED_FIGURES: tuple[str, ...] = ("entropy", "entropy_vs_bf16", "eval_accuracy", "clipfrac_summary")
#: A list of problem cells longer than this is folded (``<details>``) in report.md.
FOLD_ROWS = 20
PROBLEMS_TITLE = "Missing, failed and incomplete cells"


@dataclasses.dataclass
class Section:
    """One ``## title`` section of report.md: its Markdown lines."""

    title: str
    lines: list[str]


def render(title: str, sections: Sequence[Section]) -> str:
    md = [f"# {title}", ""]
    for s in sections:
        md += [f"## {s.title}", "", *s.lines, ""]
    return "\n".join(md).rstrip() + "\n"


def fold(summary: str, lines: Sequence[str]) -> list[str]:
    """``lines`` in a ``<details>`` block (GitHub renders the Markdown inside; blank lines around it)."""
    return ["<details>", f"<summary>{summary}</summary>", "", *lines, "", "</details>", ""]


def md_table(df, columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for _, r in df.iterrows():
        cells = []
        for c in columns:
            v = r[c]
            cells.append("" if v is None or (isinstance(v, float) and v != v) else str(v).replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_length(coll: Collection) -> int:
    """Last logged step of the longest run (1 when nothing was logged)."""
    steps = coll.steps["step"] if len(coll.steps) and "step" in coll.steps.columns else []
    return max(1, int(max(steps, default=1)))


def _pairs_with_bf16(spec) -> bool:
    """A figure of differences to the BF16 arm (same seed): skipped where no block has one."""
    return bool(getattr(spec, "paired", False)) or getattr(spec, "source", "") == "paired_gain"


def _figure_lines(figs: dict, pdf: bool) -> list[str]:
    md, k = [], 0
    for name, (spec, paths, metrics) in figs.items():
        if paths is None:
            why = (f"no run logged {', '.join(metrics)}" if not _pairs_with_bf16(spec)
                   else "no finished run has a BF16 reference run of the same seed in its block to pair with")
            md += [f"- *{spec.title}*: {why}; figure skipped.", ""]
            continue
        k += 1
        links = f"[data](figures/{name}.csv)" + (f" · [PDF](figures/{name}.pdf)" if pdf else "")
        md += [f"### {spec.title}", ""]
        for png, part in getattr(paths, "parts", None) or [(paths["png"], "")]:
            alt = f"{spec.title} — {part}" if part else spec.title
            md += [f"![{alt}](figures/{Path(png).name})", ""]
        if getattr(paths, "parts", None) and pdf:
            links = f"[data](figures/{name}.csv) · PDF: " + ", ".join(
                f"[{part}](figures/{Path(png).with_suffix('.pdf').name})" for png, part in paths.parts)
        md += [f"*Figure {k}.* {paths.caption} {links}", ""]
    return md


def _figures(coll: Collection, fig_dir: Path, names, rule, smooth, progress, pdf) -> dict:
    specs = [summary_spec(n) if n in SUMMARY_NAMES else figure_spec(n) for n in names]
    it = specs
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(specs, desc="figures", unit="fig", leave=False)
    figs = {}
    for spec in it:
        if spec.name in SUMMARY_NAMES:
            figs[spec.name] = (spec, plot_summary(coll, spec, fig_dir, pdf=pdf), (spec.metric,))
        else:
            figs[spec.name] = (spec, plot_figure(coll, spec, fig_dir, smooth=smooth, surge_rule=rule, pdf=pdf),
                               spec.metrics)
    return figs


@dataclasses.dataclass
class Entry:
    """One table of the report: its section, the table, its variants ``(label, table, folded)`` and
    whether it is per-cell detail (folded)."""

    title: str
    table: object
    variants: list = dataclasses.field(default_factory=list)
    detail: bool = False
    extra: list = dataclasses.field(default_factory=list)  # lines under the table (not folded)


def _tables(coll: Collection, done: Collection, rule: SurgeRule) -> list[Entry]:
    """Every table of the report, once, in report order (headline tables first, then the detail)."""
    greedy = has_evals(coll, M.EVAL_GREEDY)
    bf16 = bf16_evaluation_tables(coll)
    engine = "scored by a BF16 engine on the same weights (every arm in one precision)"
    acc_v = ([("Greedy decoding", accuracy_table(coll, stat=M.EVAL_GREEDY, name="accuracy_greedy"), True)]
             if greedy else [])
    paired_v = ([("Greedy decoding", paired_accuracy_table(coll, stat=M.EVAL_GREEDY, name="paired_greedy"), True)]
                if greedy else [])
    # The BF16-evaluated paired gain is the training effect (analysis.paired): shown, not folded.
    for name, label, folded, into in (("accuracy_bf16", f"S{engine[1:]}", True, acc_v),
                                      ("accuracy_greedy_bf16", f"Greedy decoding, {engine}", True, acc_v),
                                      ("paired_accuracy_bf16", f"S{engine[1:]}", False, paired_v),
                                      ("paired_greedy_bf16", f"Greedy decoding, {engine}", True, paired_v)):
        if name in bf16:
            into.append((label, bf16[name], folded))
    paired = paired_accuracy_table(coll)
    effect = ([*training_effect_lines(bf16["paired_accuracy_bf16"].data), ""] if "paired_accuracy_bf16" in bf16
              else [])
    return [
        Entry("Accuracy", accuracy_table(coll), acc_v),
        Entry("Accuracy gain, paired", paired, paired_v, extra=effect),
        Entry("End-of-training entropy, paired by seed", entropy_paired_table(coll)),
        Entry("Mechanism: FP8 noise and the lower clip bound", mechanism_table(done)),
        Entry("Diagnostics", diagnostics_table(coll, rule), detail=True),
        Entry("Start versus end of training", trajectory_table(coll), detail=True),
        Entry("Calibrated Clipping: the bounds over time", calibration_table(coll), detail=True),
    ]


def _section(coll: Collection, e: Entry) -> Section:
    rows = len(e.table.data) if getattr(e.table, "data", None) is not None else 0
    what = f"{e.title}: {rows} row{'s' if rows != 1 else ''} (also tables/{e.table.name}.md, .tex, .csv)"
    lines = fold(what, [e.table.markdown]) if e.detail else [e.table.markdown, ""]
    for label, t, folded in e.variants:
        lines += (fold(f"{label} (tables/{t.name}.md)", [t.markdown]) if folded
                  else [f"{label}:", "", t.markdown, ""])
    lines += e.extra
    lines += _unfinished_lines(coll, e.table.name)
    return Section(e.title, lines)


def write_report(
    coll: Collection,
    out_dir: str | os.PathLike,
    *,
    rule: SurgeRule | None = None,
    smooth: float | None = None,
    progress: bool = False,
    figures: Sequence[str] | None = None,
    pdf: bool = False,
    pooled: bool = False,
) -> Path:
    """Write figures, tables and ``report.md`` for ``coll`` into ``out_dir``; returns report.md.

    ``rule``: the surge rule (default: ``SurgeRule.for_length`` of the longest run's last step).

    ``figures``: names from :data:`ALL_FIGURES` to draw (default: all). ``pdf``: also write
    each figure as PDF (default: PNG and CSV only). ``pooled``: the runs span several groups
    (``analysis.pooling``) and the user asked to pool them (``--pool``); report.md says so.

    Headline ratios (the mechanism table's x BF16, the half-width criterion, the summary) use the
    finished runs only (``analysis.pooling.finished``); the diagnostics table and the line
    figures keep the unfinished ones and name them.
    """
    if rule is None:
        rule = SurgeRule.for_length(run_length(coll))
    out = Path(out_dir)
    fig_dir, tab_dir = out / "figures", out / "tables"
    fig_dir.mkdir(parents=True, exist_ok=True)
    tab_dir.mkdir(parents=True, exist_ok=True)
    figs = _figures(coll, fig_dir, list(ALL_FIGURES) if figures is None else list(figures), rule, smooth,
                    progress, pdf)
    done = finished(coll)
    entries = _tables(coll, done, rule)
    written = [t for e in entries for t in (e.table, *(v for _, v, _ in e.variants))]
    for t in written:
        t.write(tab_dir)
    # No ``path`` column: ``sweep`` + ``run`` name the directory, and a published table must not
    # carry the machine's paths (nor change when the sweep directory is moved).
    cells = coll.runs.drop(columns=["summary", "path", "run_dir"], errors="ignore")
    cells.to_csv(tab_dir / "cells.csv", index=False, lineterminator="\n")
    run_diagnostics(coll, rule).to_csv(tab_dir / "surges.csv", index=False, lineterminator="\n",
                                       float_format="%.6g")

    by_name = {t.name: t for t in written}
    sweeps = ", ".join(sorted(coll.runs["sweep"].astype(str).unique())) if len(coll.runs) else "(none)"
    summary = findings(coll, paired=by_name["paired_accuracy"].data, diagnostics=by_name["diagnostics"].data,
                       mechanism=by_name["mechanism"].data,
                       paired_bf16=by_name["paired_accuracy_bf16"].data if "paired_accuracy_bf16" in by_name else None)
    replay, replay_differs = report_lines(coll.sweep_dirs)
    if replay_differs:
        summary.append("- **These numbers are this machine's, not the published ones** (another numerics "
                       "fingerprint draws other samples): see [which runs](#which-runs).")
    if len(coll.problems):
        summary.append(f"- {len(coll.problems)} cells are missing, failed, damaged or incomplete: "
                       "see [below](#missing-failed-and-incomplete-cells).")
    index = " · ".join(f"[{t.name}](tables/{t.name}.md)" for t in written)
    headline = [e for e in entries if not e.detail]
    sections = [
        Section("Summary", summary),
        Section("Figures", _figure_lines(figs, pdf)),
        Section("Tables", [f"Each table is also in `tables/` as Markdown, LaTeX (booktabs) and CSV: {index}. "
                           "Per cell: [tables/cells.csv](tables/cells.csv); per run: "
                           "[tables/surges.csv](tables/surges.csv)."]),
        *(_section(coll, e) for e in headline),
        *(Section(t, lines) for t, lines in calibration_match_sections(done, tab_dir, fig_dir, pdf=pdf)),
        *(Section(t, lines) for t, lines in dose_sections(coll, tab_dir, fig_dir, rule=rule, smooth=smooth, pdf=pdf)),
        Section("Which runs", provenance_lines(coll, pooled) + replay),
        Section(PROBLEMS_TITLE, _problem_lines(coll)),
        *(_section(coll, e) for e in entries if e.detail),
        Section("Method", [
            f"- {rule.describe()}.",
            "- Curves: per-run EMA, then mean over seeds; each figure's caption says what its band or "
            "error bars are.",
            "- Tables: `tables/` holds Markdown, LaTeX (booktabs) and CSV versions."]),
    ]
    path = out / "report.md"
    path.write_text(render(f"Report: {sweeps}", sections), encoding="utf-8")
    return path


def _problem_lines(coll: Collection) -> list[str]:
    if not len(coll.problems):
        lines = ["None: every cell of the manifest finished."]
    else:
        table = md_table(coll.problems, ["run", "arm", "seed", "cell", "state", "last_step", "reason"])
        n = len(coll.problems)
        lines = fold(f"{n} cells (every cell: tables/cells.csv)", [table]) if n > FOLD_ROWS \
            else [table]
    if coll.notes:
        lines += ["", "Data notes:", ""] + [f"- {x}" for x in coll.notes]
    return lines


def _unfinished_lines(coll: Collection, table: str) -> list[str]:
    """Under a table, which unfinished runs it counts (diagnostics) or leaves out (the ratios)."""
    if unfinished(coll).empty:
        return []
    if table == "diagnostics":
        return ["", unfinished_note(coll, "These rows (runs: finished/cells)")]
    if table == "mechanism":
        names = ", ".join(unfinished(coll)["run"].astype(str))
        return ["", f"Unfinished runs are left out of this table and of every x BF16 ratio: {names}."]
    return []


def bf16_evaluation_tables(coll: Collection) -> dict:
    """The accuracy tables and the paired-accuracy tables of the BF16 engine (``eval_bf16/`` keys),
    by name; empty when no run has them (runs made before the BF16 evaluation existed)."""
    out = {}
    for stat, suffix in ((M.EVAL_AVG, ""), (M.EVAL_GREEDY, "_greedy")):
        if has_evals(coll, stat, M.EVAL_BF16):
            out[f"accuracy{suffix}_bf16"] = accuracy_table(coll, stat=stat, name=f"accuracy{suffix}_bf16",
                                                           precision=M.EVAL_BF16)
            paired_name = "paired_accuracy_bf16" if stat == M.EVAL_AVG else "paired_greedy_bf16"
            out[paired_name] = paired_accuracy_table(coll, stat=stat, name=paired_name, precision=M.EVAL_BF16)
    return out
