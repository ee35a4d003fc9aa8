"""Benchmark of the launcher: expanding + validating the main_table grid, submitting it to Slurm.

    python benchmarks/bench_launch.py [--repeat 3] [--slurm]

1. **Expand + validate** ``+sweep=main_table`` (90 cells) in this process, after the imports:
   Hydra composition of the primary config, grid expansion, the per-axis-value compositions,
   building and validating every cell's ``MiniRunConfig``, run identities, the state of each
   run directory. Target (issue): at most 5 s. Also reported: the first call (cold caches) and
   the same with every cell composed by Hydra in full (``exact=True``).
2. **Submit to Slurm** (``--slurm``; needs ``SLURM_CONF`` of a running cluster, e.g.
   ``slurm/local_cluster.sh``): the same 90 cells, validated, manifest written, and submitted as
   one array job, held (``sbatch --hold``) and cancelled right after, so nothing runs. The time
   is from the call to its return. Target: at most 10 s.

Prints one JSON line per measurement (seconds). Nothing is written outside a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _master(loader, overrides):
    from hydra.types import RunMode

    return loader.load_configuration("config", overrides=list(overrides), run_mode=RunMode.MULTIRUN)


def bench_plan(repeat: int, out_dir: str) -> list[dict]:
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import experiments.launch as launch
    from fp8rl.launch.grid import plan_sweep

    rows = []
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=launch.CONFIG_DIR, version_base=None):
        loader = GlobalHydra.instance().config_loader()
        args = ["+sweep=main_table", f"output_dir={out_dir}"]
        for exact in (False, True):
            for i in range(repeat if not exact else 1):
                t0 = time.perf_counter()
                cfg = _master(loader, args)
                plan = plan_sweep(cfg, loader, dict(cfg.hydra.sweeper.params), args, exact=exact)
                dt = time.perf_counter() - t0
                rows.append({"bench": "expand_validate_main_table", "exact": exact, "call": i,
                             "cells": len(plan.cells), "seconds": round(dt, 3)})
    GlobalHydra.instance().clear()
    return rows


def bench_submit(out_dir: str) -> dict:
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import experiments.launch as launch
    from fp8rl.launch.grid import plan_sweep
    from fp8rl.launch.sweep import execute
    from fp8rl.runs import read_manifest

    prof = Path(out_dir) / "held.yaml"
    local = (REPO / "slurm" / "profiles" / "local.yaml").read_text()
    prof.write_text(local + "\n# Submit held: nothing runs.\nadditional_parameters: {hold: true}\n")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=launch.CONFIG_DIR, version_base=None):
        loader = GlobalHydra.instance().config_loader()
        args = ["+sweep=main_table", f"output_dir={out_dir}/runs", "launcher=slurm", f"cluster={prof}",
                "progress=false"]
        t0 = time.perf_counter()
        cfg = _master(loader, args)
        plan = plan_sweep(cfg, loader, dict(cfg.hydra.sweeper.params), args)
        t1 = time.perf_counter()
        status = execute(plan)
        t2 = time.perf_counter()
    GlobalHydra.instance().clear()
    ids = sorted({c.job_id.split("_")[0] for c in read_manifest(Path(out_dir) / "runs" / "main_table").cells})
    subprocess.run(["scancel", *ids], check=False)
    return {"bench": "submit_main_table_slurm", "status": status, "arrays": ids, "cells": len(plan.cells),
            "validate_seconds": round(t1 - t0, 3), "submit_seconds": round(t2 - t1, 3),
            "total_seconds": round(t2 - t0, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--slurm", action="store_true", help="also submit to the Slurm cluster of SLURM_CONF")
    args = p.parse_args()
    t0 = time.perf_counter()
    import experiments.launch  # noqa: F401  (torch, hydra, the schema)
    import fp8rl.backends.mini  # noqa: F401

    print(json.dumps({"bench": "imports", "seconds": round(time.perf_counter() - t0, 3)}))
    tmp = tempfile.mkdtemp(prefix="bench_launch_")
    try:
        for row in bench_plan(args.repeat, tmp):
            print(json.dumps(row))
        if args.slurm:
            if not os.environ.get("SLURM_CONF"):
                raise SystemExit("--slurm needs SLURM_CONF (start slurm/local_cluster.sh)")
            print(json.dumps(bench_submit(tmp)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
