"""A mini RL step with a speed change against the same step without it, on identical work.

    python benchmarks/bench_lockstep.py [--switch native|shared_prefill] [--steps N] [--arms a,b,...] [key=value ...]

``--switch`` picks the change: ``native``, the native ``fake_quantize`` kernels
(``fp8rl.quant.native``; default arms: the main table's FP8 ones), or ``shared_prefill``, each
distinct prompt of a rollout prefilled once (``fp8rl.backends.mini.shared_prefill``; default
arms: ``bf16`` and the main table's FP8 ones). For each arm (the 14b slot with Calibrated
Clipping, 16 prompts x 8, one thread: a main-table cell's step), two trainers are built from the
same configuration and warm start and run in lockstep: step ``s`` of trainer A with the change,
then step ``s`` of trainer B without it (switched off for that call). Neither change alters a
number, so the two trainers compute the very same steps (the same completions, lengths and
updates: checked, every logged number of every step but the wall times), and each step is a
paired measurement on identical work. Printed per arm: the median CPU time of the step's thread
(``time.thread_time``: not the time other processes hold the core) without and with the
change, the per-step ratios' median (without / with, > 1: the change is faster) with their range;
for ``native``, ``fake_quantize``'s share of the step without the kernels; for
``shared_prefill``, one final evaluation (the run's engine) by each trainer after the steps,
twice: the first includes the shared prefill's check of a new batch shape (as in the first
cell of a sweep's worker), the second does not (as in the worker's other cells). The first
``--warmup`` steps are dropped (first-call costs: the kernels' build, allocator warm-up, the
checks of new shapes).
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

ARMS = {"native": ("rollout_only", "tensorwise", "rowwise", "blockwise"),
        "shared_prefill": ("bf16", "rollout_only", "tensorwise", "rowwise", "blockwise")}
#: a main-table cell's step (its slot and clip arm; the mini default's generation batch)
DEFAULTS = ["model.slot=14b", "clip.arm=calibrated", "prompts_per_step=16"]


@contextlib.contextmanager
def without(switch: str):
    """The change ``switch`` off inside the block."""
    if switch == "native":
        from fp8rl.quant import native

        with native.disabled():
            yield
    else:
        from fp8rl.backends.mini import shared_prefill

        shared_prefill.ENABLED = False
        try:
            yield
        finally:
            shared_prefill.ENABLED = True


def _logged(row: dict) -> dict:
    """The logged numbers but the wall times, NaN as a string (NaN != NaN)."""
    return {k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()
            if not k.startswith("perf/")}


def bench_arm(switch: str, arm: str, overrides: list[str], steps: int, warmup: int, cache: str) -> dict:
    from profile_mini_step import config

    import fp8rl.quant.fake as fake
    import fp8rl.quant.linear as linear
    import fp8rl.quant.rollout as rollout
    from fp8rl.backends.mini.runtime import torch_settings
    from fp8rl.backends.mini.trainer import MiniTrainer

    cfg = config(DEFAULTS + overrides, arm, 1, cache)
    with torch_settings(cfg.mini.deterministic, 1, cfg.mini.device):
        with_trainer = MiniTrainer(cfg, None, sft_cache=cache)
        without_trainer = MiniTrainer(cfg, None, sft_cache=cache)
        fq = {"s": 0.0}
        orig = fake.fake_quantize

        def timed(*a, **k):
            t0 = time.thread_time()
            try:
                return orig(*a, **k)
            finally:
                fq["s"] += time.thread_time() - t0

        times: dict[str, list[float]] = {"with": [], "without": [], "fq": []}
        for s in range(1, warmup + steps + 1):
            t0 = time.thread_time()
            a = with_trainer.train_step(s)
            t1 = time.thread_time()
            fq["s"] = 0.0
            with without(switch):
                linear.fake_quantize = rollout.fake_quantize = timed  # the modules that call it
                try:
                    b = without_trainer.train_step(s)
                finally:
                    linear.fake_quantize = rollout.fake_quantize = orig
            t2 = time.thread_time()
            if _logged(a) != _logged(b):
                diff = sorted(k for k in _logged(a) if _logged(a)[k] != _logged(b).get(k))
                raise AssertionError(f"{arm} step {s}: the two trainers logged different numbers: {diff[:5]}")
            if s > warmup:
                times["with"].append(t1 - t0)
                times["without"].append(t2 - t1)
                times["fq"].append(fq["s"] / (t2 - t1))
        evals = {}
        if switch == "shared_prefill":  # a final evaluation each, twice: with the check, without
            for k in ("first", "again"):
                t0 = time.thread_time()
                a = with_trainer._engine_row(warmup + steps, with_trainer.engine)
                t1 = time.thread_time()
                with without(switch):
                    b = without_trainer._engine_row(warmup + steps, without_trainer.engine)
                t2 = time.thread_time()
                if _logged(a) != _logged(b):
                    raise AssertionError(f"{arm}: the two evaluations differ")
                evals[k] = (t2 - t1, t1 - t0)
    ratios = [p / n for p, n in zip(times["without"], times["with"], strict=True)]
    return {"arm": arm, "with_ms": 1e3 * statistics.median(times["with"]),
            "without_ms": 1e3 * statistics.median(times["without"]), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "fq_share": statistics.median(times["fq"]), "steps": steps, "evals": evals}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--switch", choices=sorted(ARMS), default="native")
    p.add_argument("--arms", default=None, help="comma-separated (default: the switch's arms)")
    p.add_argument("--cache", default="runs/.cache/sft")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    import torch

    from fp8rl.quant import native

    if args.switch == "native" and not native.enabled():
        raise SystemExit(f"the native kernels are {native.status()}: nothing to compare")
    print(f"# {args.switch}: torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, one thread, "
          f"{args.steps} paired steps per arm after {args.warmup} warm-up; {' '.join(DEFAULTS + args.overrides)}")
    extra = {"native": "fake_quantize share without", "shared_prefill": "final evaluation without / with, s "
             "(first: with the check; again)"}[args.switch]
    print(f"| arm | without ms/step | with ms/step | without / with (per-step median, range) | {extra} |")
    print("|---|---|---|---|---|")
    rows = []
    for arm in (args.arms.split(",") if args.arms else ARMS[args.switch]):
        r = bench_arm(args.switch, arm, args.overrides, args.steps, args.warmup, args.cache)
        rows.append(r)
        if args.switch == "native":
            last = f"{100 * r['fq_share']:.0f}%"
        else:
            last = "; ".join(f"{k} {w:.2f} / {n:.2f}" for k, (w, n) in r["evals"].items())
        print(f"| {arm} | {r['without_ms']:.0f} | {r['with_ms']:.0f} | **{r['ratio']:.2f}x** "
              f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {last} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
