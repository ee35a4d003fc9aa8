"""Benchmark of the mini backend: one main-table run, rollout/training throughput, shadow share.

    python benchmarks/bench_mini.py [--steps N] [--threads T] [key=value ...]

Runs one configuration (default: the main-table cell ``grpo / 8b / full-FP8 tensorwise /
calibrated`` with the defaults of ``MiniRunConfig``, K = 20) into a temporary directory and
prints, as JSON:

- ``run_wall_s``: wall time of the run (SFT warm start from a warm cache, excluded and reported
  separately as ``sft_s``; model build, rollouts, updates, evaluations included);
- ``rollout_tokens_per_s``: generated response tokens / rollout time, over all steps;
- ``train_tokens_per_s``: trained response tokens / training time (old log-probs, updates, sync);
- ``shadow_share``: time in the BF16 shadow pass / total step time (target <= 10% at K = 20);
- ``step_s_mean`` and the run's final eval numbers.

The SFT cache lives in ``--cache`` (default ``runs/.cache/sft``) so repeated benchmarks reuse it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from fp8rl.backends.mini.__main__ import parse_config
from fp8rl.backends.mini.run import run_mini
from fp8rl.runs import RunDir
from fp8rl.runs import metrics as M

MAIN_TABLE = ["fp8.name=tensorwise", "fp8.rollout_recipe=tensorwise", "fp8.trainer_recipe=tensorwise",
              "clip.arm=calibrated", "clip.period=20"]


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default="runs/.cache/sft")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = [*MAIN_TABLE, f"output_dir={tmp}", f"mini.cache_dir={args.cache}",
                f"mini.num_threads={args.threads}", *args.overrides]
        # same task/SFT settings (hence the same SFT cache key) as the measured run
        warm, _, _ = parse_config([*base, "steps=1", "eval_every=0", f"run_dir={tmp}/warm", "eval_k=1"])
        t0 = time.perf_counter()
        run_mini(warm)  # trains or loads the SFT cache; not part of the measured run
        sft_s = time.perf_counter() - t0
        cfg, _, _ = parse_config(base)
        t0 = time.perf_counter()
        summary = run_mini(cfg)
        wall = time.perf_counter() - t0
        rows = RunDir(summary["run_dir"]).read_metrics()

    def total(key: str) -> float:
        return sum(r.get(key) or 0.0 for r in rows)

    gen_tokens = sum(r[M.PERF_TOKENS_PER_S] * r[M.PERF_STEP_S] for r in rows)
    train_tokens = sum(r["perf/train_tokens_per_s"] * (r[M.PERF_TRAIN_S] + (r.get(M.PERF_SHADOW_S) or 0))
                       for r in rows)
    out = {
        "config": MAIN_TABLE + args.overrides, "threads": args.threads, "steps": cfg.steps, "state": summary["state"],
        "run_wall_s": round(wall, 2), "sft_s (setup, cached after first)": round(sft_s, 2),
        "step_s_mean": round(total(M.PERF_STEP_S) / len(rows), 3),
        "rollout_tokens_per_s": round(gen_tokens / total(M.PERF_ROLLOUT_S), 1),
        "train_tokens_per_s": round(train_tokens / (total(M.PERF_TRAIN_S) + total(M.PERF_SHADOW_S)), 1),
        "shadow_s_total": round(total(M.PERF_SHADOW_S), 3),
        "shadow_share": round(total(M.PERF_SHADOW_S) / total(M.PERF_STEP_S), 4),
        "calibration_steps": sum(1 for r in rows if M.PERF_SHADOW_S in r),
        "eval_avg@k_final": summary.get(M.eval_key("arith", "avg@k")),
        "eval_avg@k_initial": summary.get(M.eval_key("arith", "avg@k") + "/initial"),
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
