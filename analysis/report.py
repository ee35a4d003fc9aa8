"""``python -m analysis.report SWEEP_DIR [SWEEP_DIR ...] [--out DIR]``: the whole analysis.

Reads the sweep directories (never trains, never needs a GPU), then writes into ``--out``
(default ``<first SWEEP_DIR>/report``)::

    report.md                 the findings summary, the figures with captions, missing/failed/incomplete
                              cells, the tables, the surge rule
    .cache/                   parsed metrics per run (--no-cache to skip): reruns parse only new lines
    figures/<name>.png|csv    every figure of ALL_FIGURES that has data (the caption in the PNG
                              metadata); <name>.pdf too with --pdf
    tables/accuracy.md|tex|csv   the paper-layout accuracy table (avg@k at the evaluation temperature)
    tables/accuracy_greedy.*     the same for greedy decoding (runs that evaluated it)
    tables/paired_accuracy.*     gain from step 0 per arm and versus BF16, paired (analysis.paired)
    tables/paired_greedy.*       the same for greedy decoding
    tables/*_bf16.*              the four above scored by a BF16 engine on the same weights (runs whose
                                 evaluations have eval_bf16/ keys), the paired one with 95% intervals
    tables/entropy_paired.*      end entropy per arm minus BF16's and (calibrated) minus TIS's, paired by
                                 seed, 95% intervals; the share of TIS's excess removed (analysis.entropy_paired)
    tables/diagnostics.md|tex|csv
    tables/mechanism.md|tex|csv  A<0 tokens below the lower bound per arm, x BF16 (fraction and count), ratio q01, bounds
    tables/trajectory.md|tex|csv entropy, garbled fraction and eval accuracy, start vs end, per arm
    tables/calibration.md|tex|csv  calibrated arms: alpha, L, H at every calibration step
    tables/calibration_match.*   calibrated FP8 / BF16 per granularity, 95% CI, half-width criterion, S
    tables/by_construction.*     per arm: what its calibration numbers hold by construction, side by side
    tables/clip_agreement.*      which tokens FP8 clips vs the BF16 shadow: recall, precision, 95% CI
    tables/heldout_calibration.* held-out FP8 / BF16-clipped ratio and grad_cos per arm, 95% CI
    tables/cells.csv          one row per cell: sweep, run, axes, state, steps logged, why it is not ok
    tables/surges.csv         per run: diagnostics including the surge onset step

The report is built in a staging directory and moved in file by file (``analysis.staging``): a
report killed while it writes leaves no half-written file in ``--out``, and a rerun completes it.

A progress bar (tqdm, on stderr) is shown while collecting sweeps of 50 runs or more
(``--progress`` / ``--no-progress`` force it). The exit code is 0 even when cells are
missing (that is what the report is for); it is 2 when no run directory could be read at all or
a ``manifest.json`` is damaged (one line names it and the fix), and 3 when the runs come from two
or more (sweep, commit, CPU numerics) groups and neither ``--pool`` (pool them knowingly:
report.md lists the groups) nor ``--separate`` (one report per group, ``OUT/<group>/``) was given
(``analysis.pooling``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from analysis.bars import SUMMARY_NAMES, plot_summary, summary_spec
from analysis.calibration_report import calibration_match_sections
from analysis.clip_tables import calibration_table, mechanism_table
from analysis.collect import Collection, collect
from analysis.entropy_paired import entropy_paired_table
from analysis.evals import has_evals
from analysis.figures import FIGURE_NAMES, figure_spec, plot_figure
from analysis.paired import paired_accuracy_table, training_effect_lines
from analysis.pooling import (
    finished,
    group_subsets,
    groups,
    provenance_lines,
    refusal,
    unfinished,
    unfinished_note,
)
from analysis.replay import report_lines
from analysis.staging import write_staged
from analysis.summary import findings
from analysis.surge import SurgeRule
from analysis.tables import accuracy_table, diagnostics_table, run_diagnostics, trajectory_table
from fp8rl.runs import metrics as M
from fp8rl.runs.manifest import ManifestDamaged


def _md_table(df, columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for _, r in df.iterrows():
        cells = []
        for c in columns:
            v = r[c]
            cells.append("" if v is None or (isinstance(v, float) and v != v) else str(v).replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run_length(coll: Collection) -> int:
    """Last logged step of the longest run (1 when nothing was logged)."""
    steps = coll.steps["step"] if len(coll.steps) and "step" in coll.steps.columns else []
    return max(1, int(max(steps, default=1)))


#: The order figures appear in (names of ``analysis.figures`` and ``analysis.bars``).
FIGURE_ORDER: tuple[str, ...] = ("entropy", "entropy_vs_bf16", "eval_accuracy", "clipfrac_neg_low", "clipfrac_summary",
                                 "reward_accuracy", "response_length", "mismatch_kl", "clip_bounds",
                                 "ratio_quantiles")
ALL_FIGURES: tuple[str, ...] = (*FIGURE_ORDER,
                                *(n for n in FIGURE_NAMES + SUMMARY_NAMES if n not in FIGURE_ORDER))
#: ``--figures published``: the figures the published reports (docs/results, ``make results``)
#: keep in git; every other figure is one ``python -m analysis.report`` away.
PUBLISHED_FIGURES: tuple[str, ...] = ("entropy", "entropy_vs_bf16", "eval_accuracy", "clipfrac_summary")


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
        md += [f"### {spec.title}", "", f"![{spec.title}](figures/{name}.png)", "",
               f"*Figure {k}.* {paths.caption} {links}", ""]
    return md


def _pairs_with_bf16(spec) -> bool:
    """A figure of differences to the BF16 arm (same seed): skipped where no block has one."""
    return bool(getattr(spec, "paired", False)) or getattr(spec, "source", "") == "paired_gain"


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

    report.md is a list of :class:`Section`: the findings summary, the figures (each with its
    caption), the missing/failed cells, the tables (each also in ``tables/``), the method.
    """
    if rule is None:
        rule = SurgeRule.for_length(_run_length(coll))
    out = Path(out_dir)
    fig_dir, tab_dir = out / "figures", out / "tables"
    fig_dir.mkdir(parents=True, exist_ok=True)
    tab_dir.mkdir(parents=True, exist_ok=True)

    names = list(ALL_FIGURES) if figures is None else list(figures)
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

    has_greedy = has_evals(coll, M.EVAL_GREEDY)
    acc = accuracy_table(coll)
    paired = paired_accuracy_table(coll)
    acc_greedy = accuracy_table(coll, stat=M.EVAL_GREEDY, name="accuracy_greedy") if has_greedy else None
    paired_greedy = (paired_accuracy_table(coll, stat=M.EVAL_GREEDY, name="paired_greedy")
                     if has_greedy else None)
    bf16 = bf16_evaluation_tables(coll)
    entropy = entropy_paired_table(coll)
    done = finished(coll)
    diag = diagnostics_table(coll, rule)
    mech = mechanism_table(done)
    traj = trajectory_table(coll)
    cal = calibration_table(coll)
    for t in (acc, paired, acc_greedy, paired_greedy, *bf16.values(), entropy, diag, mech, traj, cal):
        if t is not None:
            t.write(tab_dir)
    # No ``path`` column: ``sweep`` + ``run`` name the directory, and a published table must not
    # carry the machine's paths (nor change when the sweep directory is moved).
    cells = coll.runs.drop(columns=["summary", "path", "run_dir"], errors="ignore")
    cells.to_csv(tab_dir / "cells.csv", index=False, lineterminator="\n")
    run_diagnostics(coll, rule).to_csv(tab_dir / "surges.csv", index=False, lineterminator="\n",
                                       float_format="%.6g")

    n = len(coll.runs)
    sweeps = ", ".join(sorted(coll.runs["sweep"].astype(str).unique())) if n else "(none)"
    summary = findings(coll, paired=paired.data, diagnostics=diag.data, mechanism=mech.data,
                       paired_bf16=bf16["paired_accuracy_bf16"].data if bf16 else None)
    replay, replay_differs = report_lines(coll.sweep_dirs)
    if replay_differs:
        summary.append("- **These numbers are this machine's, not the published ones** (another numerics "
                       "fingerprint draws other samples): see [which runs](#which-runs).")
    if len(coll.problems):
        summary.append(f"- {len(coll.problems)} cells are missing, failed or incomplete: "
                       "see [below](#missing-failed-and-incomplete-cells).")
    problems = (_md_table(coll.problems, ["run", "arm", "seed", "cell", "state", "last_step", "reason"])
                if len(coll.problems) else "None: every cell of the manifest finished.")
    problem_lines = [problems]
    if coll.notes:
        problem_lines += ["", "Data notes:", ""] + [f"- {x}" for x in coll.notes]
    tables = [("Accuracy", acc, acc_greedy), ("Accuracy gain, paired", paired, paired_greedy),
              ("End-of-training entropy, paired by seed", entropy, None), ("Diagnostics", diag, None), ("Mechanism: FP8 noise and the lower clip bound", mech, None),
              ("Start versus end of training", traj, None),
              ("Calibrated Clipping: the bounds over time", cal, None)]
    index = " · ".join(f"[{t.name}](tables/{t.name}.md)" for _, a, b in tables for t in (a, b) if t is not None)
    if bf16:
        index += " · " + " · ".join(f"[{n}](tables/{n}.md)" for n in bf16)
    sections = [
        Section("Summary", summary),
        Section("Figures", _figure_lines(figs, pdf)),
        *(Section(t, lines) for t, lines in calibration_match_sections(done, tab_dir)),
        Section("Which runs", provenance_lines(coll, pooled) + replay),
        Section("Missing, failed and incomplete cells", problem_lines),
        Section("Tables", [f"Each table is also in `tables/` as Markdown, LaTeX (booktabs) and CSV: {index}."]),
    ]
    for title, table, greedy in tables:
        lines = [table.markdown]
        if greedy is not None:
            lines += ["Greedy decoding:", "", greedy.markdown]
        lines += _bf16_lines(table.name, bf16)
        lines += _unfinished_lines(coll, table.name)
        sections.append(Section(title, lines))
    sections.append(Section("Method", [
        f"- {rule.describe()}.",
        "- Curves: per-run EMA, then mean over seeds; each figure's caption says what its band or "
        "error bars are.",
        "- Tables: `tables/` holds Markdown, LaTeX (booktabs) and CSV versions."]))
    path = out / "report.md"
    path.write_text(render(f"Report: {sweeps}", sections), encoding="utf-8")
    return path


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


def _bf16_lines(section_table: str, bf16: dict) -> list[str]:
    """What a section of report.md adds for the BF16 engine: its tables next to the arm's own, and
    under the paired gains the statement of the training effect."""
    if section_table == "accuracy" and "accuracy_bf16" in bf16:
        lines = ["Scored by a BF16 engine on the same weights (every arm in one precision):", "",
                 bf16["accuracy_bf16"].markdown]
        if "accuracy_greedy_bf16" in bf16:
            lines += ["Greedy decoding, BF16 engine:", "", bf16["accuracy_greedy_bf16"].markdown]
        return lines
    if section_table == "paired_accuracy" and "paired_accuracy_bf16" in bf16:
        lines = ["Scored by a BF16 engine on the same weights (every arm in one precision):", "",
                 bf16["paired_accuracy_bf16"].markdown]
        if "paired_greedy_bf16" in bf16:
            lines += ["Greedy decoding, BF16 engine:", "", bf16["paired_greedy_bf16"].markdown]
        return [*lines, *training_effect_lines(bf16["paired_accuracy_bf16"].data), ""]
    return []


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; a damaged manifest or a full / read-only disk end in one line."""
    try:
        return _main(argv)
    except ManifestDamaged as e:  # the file and the fix
        print(f"error: {e}; nothing was written", file=sys.stderr)
        return 2
    except ReportWriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


class ReportWriteError(Exception):
    """The report could not be written: the disk is full or read-only (one line, with the fix)."""


@contextlib.contextmanager
def _writing_report(out: Path):
    """Turn a full / read-only disk while the report is written into :class:`ReportWriteError`
    naming ``out`` (the report builds in a staging directory, so ``out`` is left as it was)."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise
        for d in sorted((p for p in [out, *out.rglob("*")] if p.is_dir()), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()  # empty folders this report made (.cache/); nothing with a file in it
        raise ReportWriteError(
            f"{os.strerror(e.errno).lower()} writing the report into {out}: free space (or give --out on a "
            "writable disk) and rerun; what --out held is unchanged") from e


def _main(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m analysis.report", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The whole analysis of one or more sweeps: figures, tables and report.md in OUT (default\n"
                    "SWEEP_DIR/report). Reads the run directories only; never trains.",
        epilog="examples:\n  python -m analysis.report runs/main_table              # -> runs/main_table/report/report.md\n"
               "  python -m analysis.report runs/quick --figures entropy,clipfrac_neg_low --out /tmp/r")
    p.add_argument("sweep_dirs", nargs="+", type=Path, help="sweep directories (with manifest.json)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default SWEEP_DIR/report)")
    p.add_argument("--workers", type=int, default=None, help="parser processes (default: auto)")
    p.add_argument("--no-cache", dest="cache", action="store_false",
                   help="do not keep parsed metrics in OUT/.cache (default: keep, so a rerun "
                        "parses only the lines appended since)")
    p.add_argument("--figures", default=None,
                   help="comma-separated subset of figures, or 'published' for "
                        f"{','.join(PUBLISHED_FIGURES)} (default all: "
                        f"{','.join(ALL_FIGURES)})")
    p.add_argument("--pdf", action="store_true", help="also write every figure as PDF (not published)")
    p.add_argument("--smooth", type=float, default=None, help="EMA span in steps (default: auto)")
    p.add_argument("--surge-k", type=float, default=SurgeRule.k)
    p.add_argument("--surge-m", type=int, default=None,
                   help=f"consecutive elevated steps (default {SurgeRule.m}, fewer for runs under "
                        "40 steps: SurgeRule.for_length)")
    p.add_argument("--surge-warmup", type=int, default=None,
                   help=f"steps ignored at the start (default {SurgeRule.warmup}, fewer for runs "
                        "under 80 steps)")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--pool", action="store_true",
                      help="pool runs of different sweeps, commits or CPU numerics (report.md lists the groups)")
    pool.add_argument("--separate", action="store_true",
                      help="one report per (sweep, commit, CPU numerics) group, in OUT/<group>/")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None)
    g.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    out = args.out or (args.sweep_dirs[0] / "report")
    t0 = time.perf_counter()
    with _writing_report(out):
        coll = collect(args.sweep_dirs, workers=args.workers, progress=args.progress,
                       cache_dir=(out / ".cache") if args.cache else None)
    if coll.runs.empty:
        print(f"no run directories or manifest cells found in {', '.join(map(str, args.sweep_dirs))}",
              file=sys.stderr)
        return 2
    show = args.progress if args.progress is not None else len(coll.runs) >= 50
    figures = None if args.figures is None else [f.strip() for f in args.figures.split(",") if f.strip()]
    if figures == ["published"]:
        figures = list(PUBLISHED_FIGURES)
    rule = SurgeRule.for_length(_run_length(coll), k=args.surge_k, m=args.surge_m,
                                warmup=args.surge_warmup)
    several = len(groups(coll)) > 1
    if several and not (args.pool or args.separate):
        print(refusal(groups(coll)), file=sys.stderr)
        return 3
    parts = group_subsets(coll) if several and args.separate else [("", coll)]
    for slug, part in parts:
        dest = out / slug if slug else out
        with _writing_report(dest):
            path = write_staged(dest, lambda staging, part=part: write_report(
                part, staging, rule=rule, smooth=args.smooth, progress=show, figures=figures, pdf=args.pdf,
                pooled=several and args.pool))
        print(f"{path}: {len(part.runs)} cells, {len(part.problems)} missing/failed/incomplete "
              f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
