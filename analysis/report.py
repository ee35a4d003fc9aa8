"""``python -m analysis.report SWEEP_DIR [SWEEP_DIR ...] [--out DIR]``: the whole analysis.

Reads the sweep directories (never trains, never needs a GPU), then writes into ``--out``
(default ``<first SWEEP_DIR>/report``)::

    report.md                 figures, tables, the surge rule, missing/failed/incomplete cells
    .cache/                   parsed metrics per run (--no-cache to skip): reruns parse only new lines
    figures/<name>.png|pdf|csv   every figure of analysis.figures.FIGURES that has data
    tables/accuracy.md|tex|csv   the paper-layout accuracy table (avg@k at the evaluation temperature)
    tables/accuracy_greedy.*     the same for greedy decoding (runs that evaluated it)
    tables/paired_accuracy.*     gain from step 0 per arm and versus BF16, paired (analysis.paired)
    tables/paired_greedy.*       the same for greedy decoding
    tables/diagnostics.md|tex|csv
    tables/mechanism.md|tex|csv  A<0 tokens below the lower bound per arm, x BF16, ratio q01, bounds
    tables/trajectory.md|tex|csv entropy, garbled fraction and eval accuracy, start vs end, per arm
    tables/calibration.md|tex|csv  calibrated arms: alpha, L, H at every calibration step
    tables/cells.csv          one row per cell: sweep, run, axes, state, steps logged, why it is not ok
    tables/surges.csv         per run: diagnostics including the surge onset step

The report is built in a staging directory and moved in file by file (``analysis.staging``): a
report killed while it writes leaves no half-written file in ``--out``, and a rerun completes it.

A progress bar (tqdm, on stderr) is shown while collecting sweeps of 50 runs or more
(``--progress`` / ``--no-progress`` force it). The exit code is 0 even when cells are
missing (that is what the report is for); it is 2 when no run directory could be read at all.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from analysis.bars import SUMMARY_NAMES, plot_summary, summary_spec
from analysis.clip_tables import calibration_table, mechanism_table
from analysis.collect import Collection, collect
from analysis.figures import FIGURE_NAMES, figure_spec, plot_figure
from analysis.paired import paired_accuracy_table
from analysis.staging import write_staged
from analysis.surge import SurgeRule
from analysis.tables import accuracy_table, diagnostics_table, run_diagnostics, trajectory_table
from fp8rl.runs import metrics as M


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


def write_report(
    coll: Collection,
    out_dir: str | os.PathLike,
    *,
    rule: SurgeRule | None = None,
    smooth: float | None = None,
    progress: bool = False,
    figures: Sequence[str] | None = None,
) -> Path:
    """Write figures, tables and ``report.md`` for ``coll`` into ``out_dir``; returns report.md.

    ``rule``: the surge rule (default: ``SurgeRule.for_length`` of the longest run's last step).

    ``figures``: names from ``analysis.figures.FIGURE_NAMES`` to draw (default: all).
    """
    if rule is None:
        rule = SurgeRule.for_length(_run_length(coll))
    out = Path(out_dir)
    fig_dir, tab_dir = out / "figures", out / "tables"
    fig_dir.mkdir(parents=True, exist_ok=True)
    tab_dir.mkdir(parents=True, exist_ok=True)

    names = list(FIGURE_NAMES + SUMMARY_NAMES) if figures is None else list(figures)
    specs = [summary_spec(n) if n in SUMMARY_NAMES else figure_spec(n) for n in names]
    it = specs
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(specs, desc="figures", unit="fig", leave=False)
    figs = {}
    for spec in it:
        if spec.name in SUMMARY_NAMES:
            figs[spec.name] = (spec, plot_summary(coll, spec, fig_dir), (spec.metric,))
        else:
            figs[spec.name] = (spec, plot_figure(coll, spec, fig_dir, smooth=smooth, surge_rule=rule),
                               spec.metrics)

    acc = accuracy_table(coll)
    acc.write(tab_dir)
    has_greedy = len(coll.evals) > 0 and (coll.evals["stat"] == M.EVAL_GREEDY).any()
    acc_greedy = accuracy_table(coll, stat=M.EVAL_GREEDY, name="accuracy_greedy") if has_greedy else None
    paired = paired_accuracy_table(coll)
    paired.write(tab_dir)
    paired_greedy = (paired_accuracy_table(coll, stat=M.EVAL_GREEDY, name="paired_greedy")
                     if has_greedy else None)
    for t in (acc_greedy, paired_greedy):
        if t is not None:
            t.write(tab_dir)
    diag = diagnostics_table(coll, rule)
    diag.write(tab_dir)
    mech = mechanism_table(coll)
    mech.write(tab_dir)
    traj = trajectory_table(coll)
    traj.write(tab_dir)
    cal = calibration_table(coll)
    cal.write(tab_dir)
    # No ``path`` column: ``sweep`` + ``run`` name the directory, and a published table must not
    # carry the machine's paths (nor change when the sweep directory is moved).
    cells = coll.runs.drop(columns=["summary", "path", "run_dir"], errors="ignore")
    cells.to_csv(tab_dir / "cells.csv", index=False, lineterminator="\n")
    run_diagnostics(coll, rule).to_csv(tab_dir / "surges.csv", index=False, lineterminator="\n",
                                       float_format="%.6g")

    n = len(coll.runs)
    counts = coll.runs["cell"].value_counts().to_dict()
    sweeps = ", ".join(sorted(coll.runs["sweep"].astype(str).unique())) if n else "(none)"
    md = [f"# Report: {sweeps}", ""]
    md.append(f"{n} cells: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + ".")
    md.append("")
    md.append("## Missing, failed and incomplete cells")
    md.append("")
    if len(coll.problems):
        md.append(_md_table(coll.problems, ["run", "arm", "seed", "cell", "state", "last_step", "reason"]))
    else:
        md.append("None: every cell of the manifest finished.")
    if coll.notes:
        md += ["", "Data notes:", ""] + [f"- {x}" for x in coll.notes]
    md += ["", "## Accuracy", "", acc.markdown]
    if acc_greedy is not None:
        md += ["Greedy decoding:", "", acc_greedy.markdown]
    md += ["## Accuracy gain, paired", "", paired.markdown]
    if paired_greedy is not None:
        md += ["Greedy decoding:", "", paired_greedy.markdown]
    md += ["## Diagnostics", "", diag.markdown,
           "## Mechanism: FP8 noise and the lower clip bound", "", mech.markdown,
           "## Start versus end of training", "", traj.markdown,
           "## Calibrated Clipping: the bounds over time", "", cal.markdown]
    md += ["## Figures", ""]
    for name, (spec, paths, metrics) in figs.items():
        if paths is None:
            md.append(f"- *{spec.title}*: no run logged {', '.join(metrics)}; figure skipped.")
            md.append("")
            continue
        md.append(f"### {spec.title}")
        md.append("")
        md.append(f"![{spec.title}](figures/{name}.png)")
        md.append("")
        md.append(f"[PDF](figures/{name}.pdf) · [data](figures/{name}.csv)")
        md.append("")
    md += ["## Method", "", f"- {rule.describe()}.",
           "- Curves: per-run EMA, then mean over seeds; bands are ±1 std over seeds.",
           "- Tables: `tables/` holds Markdown, LaTeX (booktabs) and CSV versions."]
    path = out / "report.md"
    path.write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    return path


def main(argv: Sequence[str] | None = None) -> int:
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
                   help="comma-separated subset of figures (default all: "
                        f"{','.join(FIGURE_NAMES + SUMMARY_NAMES)})")
    p.add_argument("--smooth", type=float, default=None, help="EMA span in steps (default: auto)")
    p.add_argument("--surge-k", type=float, default=SurgeRule.k)
    p.add_argument("--surge-m", type=int, default=None,
                   help=f"consecutive elevated steps (default {SurgeRule.m}, fewer for runs under "
                        "40 steps: SurgeRule.for_length)")
    p.add_argument("--surge-warmup", type=int, default=None,
                   help=f"steps ignored at the start (default {SurgeRule.warmup}, fewer for runs "
                        "under 80 steps)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None)
    g.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    out = args.out or (args.sweep_dirs[0] / "report")
    t0 = time.perf_counter()
    coll = collect(args.sweep_dirs, workers=args.workers, progress=args.progress,
                   cache_dir=(out / ".cache") if args.cache else None)
    if coll.runs.empty:
        print(f"no run directories or manifest cells found in {', '.join(map(str, args.sweep_dirs))}",
              file=sys.stderr)
        return 2
    show = args.progress if args.progress is not None else len(coll.runs) >= 50
    figures = None if args.figures is None else [f.strip() for f in args.figures.split(",") if f.strip()]
    rule = SurgeRule.for_length(_run_length(coll), k=args.surge_k, m=args.surge_m,
                                warmup=args.surge_warmup)
    path = write_staged(out, lambda staging: write_report(coll, staging, rule=rule, smooth=args.smooth,
                                                          progress=show, figures=figures))
    n_bad = len(coll.problems)
    print(f"{path}: {len(coll.runs)} cells, {n_bad} missing/failed/incomplete "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
