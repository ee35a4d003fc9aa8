"""A mini RL step with the native ``fake_quantize`` kernels against the same step without them.

    python benchmarks/bench_native.py [--steps N] [--arms a,b,...] [key=value ...]

For each FP8 arm (default: the main table's ``rollout_only``, ``tensorwise``, ``rowwise``,
``blockwise``; the 14b slot with Calibrated Clipping, 16 prompts x 8, one thread: a main-table
cell's step), two trainers are built from the same configuration and warm start and run in
lockstep: step ``s`` of trainer A with the native kernels (``fp8rl.quant.native``), then step
``s`` of trainer B with ``fake_quantize``'s PyTorch code (the kernels switched off for that
call). The kernels give the same floats, so the two trainers compute the very same steps (the
same completions, lengths and updates: checked, every logged number of every step but the
wall times), and each step is a paired measurement on identical work. Printed per arm: the
median CPU time of the step's thread (``time.thread_time``: not the time other processes hold
the core) with and without the kernels, the per-step ratios' median (PyTorch code / native,
> 1: the kernels are faster) with their range, and ``fake_quantize``'s share of the step
without the kernels. The first ``--warmup`` steps are dropped (first-call costs: the kernels'
build, allocator warm-up).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ARMS = ("rollout_only", "tensorwise", "rowwise", "blockwise")
#: a main-table cell's step (its slot and clip arm; the mini default's generation batch)
DEFAULTS = ["model.slot=14b", "clip.arm=calibrated", "prompts_per_step=16"]


@contextlib.contextmanager
def pytorch_code():
    """``fake_quantize`` without the native kernels inside the block."""
    from fp8rl.quant import native

    on = native.enabled
    native.enabled = lambda: False
    try:
        yield
    finally:
        native.enabled = on


def _logged(row: dict) -> dict:
    """The logged numbers but the wall times, NaN as a string (NaN != NaN)."""
    return {k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()
            if not k.startswith("perf/")}


def bench_arm(arm: str, overrides: list[str], steps: int, warmup: int, cache: str) -> dict:
    from profile_mini_step import config

    import fp8rl.quant.fake as fake
    import fp8rl.quant.linear as linear
    import fp8rl.quant.rollout as rollout
    from fp8rl.backends.mini.runtime import torch_settings
    from fp8rl.backends.mini.trainer import MiniTrainer

    cfg = config(DEFAULTS + overrides, arm, 1, cache)
    with torch_settings(cfg.mini.deterministic, 1, cfg.mini.device):
        native_trainer = MiniTrainer(cfg, None, sft_cache=cache)
        torch_trainer = MiniTrainer(cfg, None, sft_cache=cache)
        fq = {"s": 0.0}
        orig = fake.fake_quantize

        def timed(*a, **k):
            t0 = time.thread_time()
            try:
                return orig(*a, **k)
            finally:
                fq["s"] += time.thread_time() - t0

        times: dict[str, list[float]] = {"native": [], "pytorch": [], "fq": []}
        for s in range(1, warmup + steps + 1):
            t0 = time.thread_time()
            a = native_trainer.train_step(s)
            t1 = time.thread_time()
            fq["s"] = 0.0
            with pytorch_code():
                linear.fake_quantize = rollout.fake_quantize = timed  # the modules that call it
                try:
                    b = torch_trainer.train_step(s)
                finally:
                    linear.fake_quantize = rollout.fake_quantize = orig
            t2 = time.thread_time()
            if _logged(a) != _logged(b):
                diff = sorted(k for k in _logged(a) if _logged(a)[k] != _logged(b).get(k))
                raise AssertionError(f"{arm} step {s}: the two trainers logged different numbers: {diff[:5]}")
            if s > warmup:
                times["native"].append(t1 - t0)
                times["pytorch"].append(t2 - t1)
                times["fq"].append(fq["s"] / (t2 - t1))
    ratios = [p / n for p, n in zip(times["pytorch"], times["native"], strict=True)]
    return {"arm": arm, "native_ms": 1e3 * statistics.median(times["native"]),
            "pytorch_ms": 1e3 * statistics.median(times["pytorch"]), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "fq_share": statistics.median(times["fq"]), "steps": steps}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--cache", default="runs/.cache/sft")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    import torch

    from fp8rl.quant import native

    if not native.enabled():
        raise SystemExit(f"the native kernels are {native.status()}: nothing to compare")
    print(f"# torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, one thread, "
          f"{args.steps} paired steps per arm after {args.warmup} warm-up; {' '.join(DEFAULTS + args.overrides)}")
    print("| arm | PyTorch code ms/step | native ms/step | PyTorch / native (per-step median, range) "
          "| fake_quantize share without |")
    print("|---|---|---|---|---|")
    rows = []
    for arm in args.arms.split(","):
        r = bench_arm(arm, args.overrides, args.steps, args.warmup, args.cache)
        rows.append(r)
        print(f"| {arm} | {r['pytorch_ms']:.0f} | {r['native_ms']:.0f} | **{r['ratio']:.2f}x** "
              f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {100 * r['fq_share']:.0f}% |", flush=True)
    return rows


if __name__ == "__main__":
    main()
