"""Copy a sweep's run directories for publication (no checkpoints, no machine paths).

    python -m experiments.publish runs/main_table docs/results/mini/runs/main_table [--replace]

Thin shell over ``fp8rl.runs.publish`` (what is kept and what is rewritten is documented there).
"""

from __future__ import annotations

import argparse
import sys

from fp8rl.runs.publish import publish_sweep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.publish", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  python -m experiments.publish runs/main_table docs/results/mini/runs/main_table --replace")
    p.add_argument("sweep_dir", help="a sweep directory (holding manifest.json), e.g. runs/main_table")
    p.add_argument("dest", help="where the copy goes (must not exist, or be empty)")
    p.add_argument("--root", action="append", default=None,
                   help="absolute path to strip from config/provenance text (default: the current "
                        "directory); repeat it for a sweep whose output_dir lay outside the checkout")
    p.add_argument("--replace", action="store_true", help="overwrite an earlier published copy at DEST")
    args = p.parse_args(argv)
    try:
        res = publish_sweep(args.sweep_dir, args.dest, root=args.root, replace=args.replace)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{res.dest}: {res.runs} runs, {res.files} files, {res.bytes / 1e6:.2f} MB "
          f"({res.rewritten} files had the root's path replaced)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
