"""``python -m experiments.status SWEEP_DIR [--no-slurm] [--json]``: where a sweep stands.

Prints one line per cell of the sweep's manifest (run state, step, last rollout reward and
policy entropy, Slurm job id and ``sacct`` state where there is one), the count per state, and
the failed cells with their reasons (and the cells whose process died: ``DIED``, or whose run
files cannot be read, or that say DONE while ``metrics.jsonl`` is missing or short: ``DAMAGED``). Exit status: 0 if every cell is DONE, 1 if any FAILED, DIED
or DAMAGED, 2 if cells are still missing or running. ``fp8rl.launch.status`` holds the logic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def main(argv: list[str] | None = None) -> int:
    from fp8rl.launch.status import failed_cells, format_table, sweep_status
    from fp8rl.runs.manifest import ManifestDamaged

    p = argparse.ArgumentParser(
        prog="python -m experiments.status", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Where a sweep stands: one line per cell of its manifest (state, step, last reward and\n"
                    "entropy, Slurm job and state), a count per state, and the failed cells with their reasons.",
        epilog="exit status: 0 every cell DONE, 1 any FAILED/DIED/DAMAGED, 2 cells still missing or running\n"
               "examples:\n  python -m experiments.status runs/main_table\n"
               "  python -m experiments.status runs/main_table --no-slurm --json")
    p.add_argument("sweep_dir", help="a sweep directory, e.g. runs/main_table")
    p.add_argument("--no-slurm", action="store_true", help="do not ask sacct")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    try:
        rows = sweep_status(args.sweep_dir, query_slurm=not args.no_slurm)
    except (FileNotFoundError, ManifestDamaged) as e:  # one line: the file and the fix
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    else:
        print(format_table(rows))
        failed = failed_cells(rows)
        if failed:
            print(f"\nFAILED, DIED or DAMAGED cells ({len(failed)}):")
            for name, reason in failed:
                print(f"  {name}: {reason}")
    states = {r.state for r in rows}
    if states & {"FAILED", "DIED", "DAMAGED"}:
        return 1
    return 0 if states <= {"DONE"} else 2


if __name__ == "__main__":
    raise SystemExit(main())
