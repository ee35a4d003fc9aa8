"""``python -m analysis.report SWEEP_DIR [SWEEP_DIR ...] [--out DIR]``: the whole analysis.

Reads the sweep directories (never trains, never needs a GPU), then writes into ``--out``
(default ``<first SWEEP_DIR>/report``)::

    report.md                 the findings summary, the figures with captions, the headline tables,
                              the missing/failed/damaged/incomplete cells, the per-cell detail folded
                              (<details>), the surge rule (analysis.report_md writes it)
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
    tables/heldout_ratio.*, heldout_paired.*, heldout_rule.*, figures/heldout_ratio.png|csv
                              runs with held-out rows only (clip.holdout_share > 0): the deployed bound's
                              held-out ratio, the paired comparisons (Holm) and the default-mode rule
                              (analysis.heldout_report); without them the command prints "no held-out data"
    tables/dose.*, surge_dose.*, dose_comparisons.*, figures/entropy_dose.png, dose_response.png,
    share_vs_surge.png        finished runs of two or more FP precisions that log actor/ratio_std only:
                              the dose response of the entropy surge (analysis.dose_report)
    tables/cells.csv          one row per cell: sweep, run, axes, state, steps logged, why it is not ok
    tables/surges.csv         per run: diagnostics including the surge onset step

The report is built in a staging directory and moved in file by file (``analysis.staging``): a
report killed while it writes leaves no half-written file in ``--out``, and a rerun completes it.

Any set of sweep directories: one given twice is read once; two that carry one sweep name (a copy,
one sweep run on two machines) are told apart by the end of their paths (``analysis.collect``), so
``--separate`` and ``--pool`` work on them. A damaged cell (``analysis.damage``) is listed with the
file and the fix, and the report is written from the rest. A mistake in what was given (a sweep
directory that does not exist, a run directory or a folder of sweeps for a sweep, an unknown
figure) is one line naming it and the fix, exit status 2 (``analysis.report_inputs``).

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
import errno
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from analysis.collect import collect
from analysis.heldout_report import no_data_line
from analysis.pooling import group_subsets, groups, refusal
from analysis.report_inputs import ReportInputError, check_figures, check_sweep_dirs, no_runs
from analysis.report_md import (  # noqa: F401  (public here too: the tests and notebooks import them from here)
    ALL_FIGURES,
    FIGURE_ORDER,
    PUBLISHED_FIGURES,
    Section,
    bf16_evaluation_tables,
    render,
    run_length,
    write_report,
)
from analysis.staging import write_staged
from analysis.surge import SurgeRule
from fp8rl.runs.manifest import ManifestDamaged


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; every mistake a user can make (a sweep directory that does not exist, an
    empty one, an unknown figure), a damaged manifest and a full / read-only disk end in one line
    or a short block naming the value and the fix."""
    try:
        return _main(argv)
    except ReportInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ManifestDamaged as e:  # the file and the fix
        print(f"error: {e}; nothing was written", file=sys.stderr)
        return 2
    except ReportWriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


class ReportWriteError(Exception):
    """The report could not be written: the disk is full or read-only (one line, with the fix)."""


@contextlib.contextmanager
def _writing_report(out: Path, new: bool):
    """Turn a full / read-only disk while the report is written into :class:`ReportWriteError`
    naming ``out`` (the report builds in a staging directory, so ``out`` is left as it was).

    ``new``: ``out`` did not exist before this report; then nothing of it is left (its metrics
    cache included). Otherwise only the empty folders this report made go."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise
        if new:
            shutil.rmtree(out, ignore_errors=True)
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
    check_sweep_dirs(args.sweep_dirs)
    figures = check_figures(args.figures, ALL_FIGURES, PUBLISHED_FIGURES)
    out = args.out or (args.sweep_dirs[0] / "report")
    new = not out.exists()
    t0 = time.perf_counter()
    with _writing_report(out, new):
        coll = collect(args.sweep_dirs, workers=args.workers, progress=args.progress,
                       cache_dir=(out / ".cache") if args.cache else None)
    if coll.runs.empty:
        if new:
            shutil.rmtree(out, ignore_errors=True)
        raise ReportInputError(no_runs(args.sweep_dirs))
    show = args.progress if args.progress is not None else len(coll.runs) >= 50
    rule = SurgeRule.for_length(run_length(coll), k=args.surge_k, m=args.surge_m,
                                warmup=args.surge_warmup)
    several = len(groups(coll)) > 1
    if several and not (args.pool or args.separate):
        print(refusal(groups(coll)), file=sys.stderr)
        return 3
    parts = group_subsets(coll) if several and args.separate else [("", coll)]
    for slug, part in parts:
        dest = out / slug if slug else out
        with _writing_report(dest if not new else out, new):
            path = write_staged(dest, lambda staging, part=part: write_report(
                part, staging, rule=rule, smooth=args.smooth, progress=show, figures=figures, pdf=args.pdf,
                pooled=several and args.pool))
        print(f"{path}: {len(part.runs)} cells, {len(part.problems)} missing/failed/damaged/incomplete "
              f"({time.perf_counter() - t0:.1f} s)")
        if no_data_line(part):  # the held-out judgement's absence, said here: report.md stays as it was
            print(f"{path}: {no_data_line(part)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
