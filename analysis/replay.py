"""Are these the published numbers? A sweep's runs compared value by value with a reference copy.

A mini run is deterministic on one machine, and its bits depend on the machine's numerics (torch's
kernel level, MKL's code path: ``fp8rl/backends/mini/numerics.py``, docs/numerics.md). So ``make
reproduce`` on the machine kind the published runs were made on logs exactly the published
numbers, and on another machine logs its own: as good a sample, not the same one. This module
says which case a sweep is in, by comparing, not by guessing from the CPU's name:

- runs are matched by their directory name (``<run name>-<config hash>``: the same name is the
  same configuration);
- every value both runs logged in ``metrics.jsonl`` and ``eval.jsonl`` is compared exactly, except
  ``perf/*`` (wall times); keys only one of them logged (added since the reference was published)
  are counted, not compared;
- a run equals the reference when every compared value is equal and both logged the same rows.

``python -m analysis.replay RUNS REFERENCE`` prints the verdict; ``analysis.report`` states it in
report.md when a published copy of the sweep exists (``docs/results/mini/runs/<sweep>``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fp8rl.runs.jsonl import read_jsonl

__all__ = ["PUBLISHED", "RunReplay", "SweepReplay", "compare_runs", "compare_sweeps", "published_copy",
           "report_lines", "verdict_lines"]

#: Where the published mini sweeps' run directories live in this repository.
PUBLISHED = Path(__file__).resolve().parents[1] / "docs" / "results" / "mini" / "runs"
FILES = ("metrics.jsonl", "eval.jsonl")


@dataclass
class RunReplay:
    """One run against its reference: ``compared`` values (both logged), ``differ`` of them,
    ``only_one`` values logged by one side only, ``rows_differ`` whether the row counts differ,
    and the ``first`` difference in words."""

    run: str
    compared: int = 0
    differ: int = 0
    only_one: int = 0
    rows_differ: bool = False
    first: str | None = None

    @property
    def equal(self) -> bool:
        return self.compared > 0 and self.differ == 0 and not self.rows_differ


@dataclass
class SweepReplay:
    runs: list[RunReplay] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)  # runs with no reference run of that name

    @property
    def equal(self) -> int:
        return sum(r.equal for r in self.runs)

    @property
    def compared(self) -> int:
        return sum(r.compared for r in self.runs)


def _same(a, b) -> bool:
    """Exactly equal (NaN equals NaN: a run that logged NaN where the reference did replays it)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare_runs(run: Path, reference: Path) -> RunReplay:
    """Every value of ``run``'s ``metrics.jsonl`` and ``eval.jsonl`` against ``reference``'s."""
    out = RunReplay(run=run.name)
    for name in FILES:
        mine, ref = read_jsonl(run / name), read_jsonl(reference / name)
        if len(mine) != len(ref):
            out.rows_differ = True
            out.first = out.first or f"{name}: {len(mine)} rows, reference {len(ref)}"
        for i, (a, b) in enumerate(zip(mine, ref, strict=False)):
            for k in sorted(set(a) | set(b)):
                if k.startswith("perf/"):
                    continue
                if k not in a or k not in b:
                    out.only_one += 1
                    continue
                out.compared += 1
                if not _same(a[k], b[k]):
                    out.differ += 1
                    if out.first is None:
                        out.first = f"{name} row {i} (step {a.get('step')}) {k}: {a[k]!r}, reference {b[k]!r}"
    return out


def _run_dirs(sweep: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted(sweep.iterdir()) if p.is_dir() and (p / "metrics.jsonl").exists()}


def compare_sweeps(runs: Path, reference: Path) -> SweepReplay:
    """Each run directory of ``runs`` against the one of the same name in ``reference``."""
    mine, ref = _run_dirs(Path(runs)), _run_dirs(Path(reference))
    out = SweepReplay()
    for name, path in mine.items():
        if name in ref:
            out.runs.append(compare_runs(path, ref[name]))
        else:
            out.unmatched.append(name)
    return out


def published_copy(sweep_dir: Path) -> Path | None:
    """The published copy of the sweep in ``sweep_dir`` (same directory name under
    :data:`PUBLISHED`), or None when there is none or ``sweep_dir`` is that copy."""
    cand = PUBLISHED / Path(sweep_dir).resolve().name
    if not cand.is_dir() or cand.resolve() == Path(sweep_dir).resolve():
        return None
    return cand


def verdict_lines(rep: SweepReplay, reference: str, *, where: str = "these runs") -> list[str]:
    """report.md's (and the CLI's) statement of the comparison."""
    n = len(rep.runs)
    if n == 0:
        return [f"None of {where} has a run of the same configuration in {reference}: nothing to compare."]
    lines = []
    if rep.equal == n:
        lines.append(f"All {n} runs compared log exactly the numbers of {reference} "
                     f"({rep.compared:,} values, wall times aside): these are the published numbers.")
    else:
        differ = [r for r in rep.runs if not r.equal]
        lines.append(f"{len(differ)} of {n} runs log other numbers than {reference} ({rep.equal} equal; "
                     f"{rep.compared:,} values compared): **these numbers are this machine's, not the published "
                     "ones**. A machine with other numerics (torch's kernel level, MKL's code path: "
                     "docs/numerics.md) draws other samples of the same experiment; compare them statistically, "
                     f"not bit for bit. First difference: {differ[0].run}: {differ[0].first}.")
    if rep.unmatched:
        lines.append(f"{len(rep.unmatched)} run(s) have no run of the same configuration there.")
    return lines


def report_lines(sweep_dirs) -> tuple[list[str], bool]:
    """report.md's lines on whether each sweep's runs log the published numbers, for the sweeps of
    ``sweep_dirs`` that have a published copy (and are not that copy), and whether any compared run
    logged other numbers."""
    lines: list[str] = []
    differs = False
    for sd in sweep_dirs:
        ref = published_copy(Path(sd))
        if ref is not None:
            rep = compare_sweeps(Path(sd), ref)
            differs |= rep.equal < len(rep.runs)
            rel = f"the published copy (docs/results/mini/runs/{ref.name})"
            lines += ["", *verdict_lines(rep, rel, where=f"the runs of {Path(sd).name}")]
    return lines, differs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compare a sweep's runs value by value with a reference copy "
                                            "(e.g. the published one).")
    p.add_argument("runs", type=Path, help="sweep directory (e.g. runs/main_table)")
    p.add_argument("reference", type=Path, nargs="?",
                   help="reference sweep directory (default: the published copy, docs/results/mini/runs/<name>)")
    p.add_argument("--json", action="store_true", help="print one JSON object per run instead of the verdict")
    a = p.parse_args(argv)
    ref = a.reference or published_copy(a.runs)
    for d, what in ((a.runs, "runs"), (ref, "reference")):
        if d is None or not Path(d).is_dir():
            print(f"analysis.replay: no {what} directory {d or '(no published copy of ' + a.runs.name + ')'}; "
                  "give it as an argument", file=sys.stderr)
            return 2
    rep = compare_sweeps(a.runs, ref)
    if a.json:
        for r in rep.runs:
            print(json.dumps({**r.__dict__, "equal": r.equal}))
    else:
        print("\n".join(verdict_lines(rep, str(ref))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
