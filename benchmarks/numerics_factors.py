"""What decides a mini run's bits on this CPU: the golden cells under each setting, in fresh processes.

For each setting (an environment change, or the thread count), one fresh process runs every golden
cell of ``tests/mini/tiny_cells.py`` (SFT warm start into its own empty cache, 3 RL steps, two
evaluations) and records its numerics fingerprint (``fp8rl/backends/mini/numerics.py``). The table
says, per setting, whether the probe digest and the cells' logged numbers equal the baseline's
(this machine as it is, measured twice to show the process itself decides nothing), and the first
difference. A setting whose cells differ while its probe does not would be a hole in the
fingerprint: the last column flags it.

    python benchmarks/numerics_factors.py [--out FILE.json] [--only NAME ...]

The settings stand in for other machines where a variable can force another code path on this one:
``ATEN_CPU_CAPABILITY`` (torch's kernel level), ``MKL_CBWR`` (MKL's conditional-reproducibility
modes: other GEMM code paths, like MKL on another CPU), ``MKL_ENABLE_INSTRUCTIONS`` (a cap on MKL's
ISA), ``ONEDNN_MAX_CPU_ISA`` (oneDNN's ISA), ``FP8RL_NATIVE=0`` (the native fake-quantize kernels
off) and two threads per cell. Results: docs/numerics.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "mini"))

from tiny_cells import CELLS, first_difference  # noqa: E402

#: name -> (environment changes, threads per cell)
SETTINGS: dict[str, tuple[dict, int]] = {
    "baseline": ({}, 1),
    "baseline, again": ({}, 1),
    "ATEN_CPU_CAPABILITY=avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, 1),
    "ATEN_CPU_CAPABILITY=default": ({"ATEN_CPU_CAPABILITY": "default"}, 1),
    "MKL_CBWR=COMPATIBLE": ({"MKL_CBWR": "COMPATIBLE"}, 1),
    "MKL_CBWR=AVX2": ({"MKL_CBWR": "AVX2"}, 1),
    "MKL_ENABLE_INSTRUCTIONS=AVX2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, 1),
    "ONEDNN_MAX_CPU_ISA=AVX2": ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, 1),
    "FP8RL_NATIVE=0": ({"FP8RL_NATIVE": "0"}, 1),
    "2 threads per cell": ({}, 2),
}


def run_setting(env: dict, threads: int, work: Path) -> dict:
    work.mkdir(parents=True)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "mini" / "tiny_cells.py"), "--cache",
                           str(work / "sft"), "--runs", str(work / "runs"), "--out", str(work / "out.json"),
                           "--threads", str(threads)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env}, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"setting {env} threads={threads} failed:\n{proc.stderr[-3000:]}")
    out = json.loads((work / "out.json").read_text())
    out["seconds"] = time.monotonic() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="also write every setting's fingerprint and verdict as JSON")
    p.add_argument("--only", nargs="*", choices=list(SETTINGS), help="run these settings (baseline always)")
    a = p.parse_args(argv)
    names = ["baseline"] + [n for n in SETTINGS if n != "baseline" and (not a.only or n in a.only)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="fp8rl-numerics-") as tmp:
        for i, name in enumerate(names):
            env, threads = SETTINGS[name]
            results[name] = run_setting(env, threads, Path(tmp) / str(i))
            print(f"... {name}: {results[name]['seconds']:.0f} s", file=sys.stderr, flush=True)
    base = results["baseline"]
    rows = []
    for name in names:
        r = results[name]
        fp = r["fingerprint"]
        diffs = {c: first_difference(base["cells"][c], r["cells"][c]) for c in CELLS}
        n_equal = sum(d is None for d in diffs.values())
        first = next((f"{c}: {d}" for c, d in diffs.items() if d is not None), "")
        same_probe = fp["probe"] == base["fingerprint"]["probe"]
        hole = same_probe and n_equal < len(CELLS) and threads_of(name) == 1
        rows.append({"setting": name, "aten": fp["aten"], "mkl": fp["mkl"], "probe": fp["probe"],
                     "probe_as_baseline": same_probe, "cells_equal": n_equal, "cells": len(CELLS),
                     "first_difference": first, "fingerprint_hole": hole})
    cpu = base["fingerprint"]["cpu"]
    print(f"# {cpu.get('vendor')} {cpu.get('model')} ({' '.join(cpu.get('flags') or [])}); "
          f"torch {base['fingerprint']['torch']}, transformers {base['fingerprint']['transformers']}")
    print("| setting | ATen level | MKL code path | probe | probe = baseline | cells equal to baseline | first difference |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        flag = " **(hole: cells differ, probe does not)**" if r["fingerprint_hole"] else ""
        print(f"| {r['setting']} | {r['aten']} | {r['mkl']} | `{r['probe']}` | {'yes' if r['probe_as_baseline'] else 'no'} "
              f"| {r['cells_equal']}/{r['cells']}{flag} | {r['first_difference'][:90]} |")
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def threads_of(name: str) -> int:
    return SETTINGS[name][1]


if __name__ == "__main__":
    sys.exit(main())
