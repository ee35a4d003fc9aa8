"""Cost of the BF16 evaluation of the mini backend (``eval_bf16/`` keys) for an FP8-rollout cell.

Every evaluation of an FP8-rollout arm is scored twice: by the arm's FP8 rollout engine and by a
BF16 engine on the same weights (``fp8rl.backends.mini.trainer``; a BF16 arm reuses its own).
The step-0 evaluation of both engines comes from the cache beside the warm start (computed once
per sweep, the BF16 engine's entry shared with the BF16 arm), so in a sweep the extra work of an
FP8 cell is the BF16 engine's evaluations after step 0 (one at the mini defaults: the last step).
Two parts, each against its baseline in the same run, interleaved so that load from other
processes hits both sides alike:

- **cell**: one default mini cell (``8b``, full-FP8 tensorwise, ``clip=tis`` unless overridden;
  20 steps, evaluation at step 0 and at the end) run whole by ``MiniTrainer.run`` with and
  without the BF16 evaluation (``bf16_eval=False``), the two alternating round by round (order
  swapped every round), after one untimed warm-up run that fills the step-0 cache;
- **evaluation**: on the trained policy of one cell, the arm's evaluation (FP8 engine) and the
  BF16 engine's (its weight sync included), alternating.

Prints medians over rounds, the median of the per-round ratios with their range, in wall time
and in the process's CPU time (``time.process_time``: with one torch thread, the work done,
which other processes on a shared machine do not inflate as they inflate wall time).

    .venv/bin/python benchmarks/bench_eval_bf16.py [--rounds 3] [--threads 1] [--cache runs/.cache/sft] \\
        [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

CELL = ["fp8.name=tensorwise", "fp8.rollout_recipe=tensorwise", "fp8.trainer_recipe=tensorwise", "clip.arm=tis"]


def _spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.3f} (range {min(xs):.3f}-{max(xs):.3f}, {len(xs)} rounds)"


def main(argv: list[str] | None = None) -> dict:
    from fp8rl.backends.mini.__main__ import parse_config
    from fp8rl.backends.mini.run import sft_cache_dir
    from fp8rl.backends.mini.runtime import torch_settings
    from fp8rl.backends.mini.trainer import MiniTrainer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the launcher's cells: 1)")
    p.add_argument("--cache", default="runs/.cache/sft")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = parse_config([*CELL, f"mini.cache_dir={args.cache}", f"mini.num_threads={args.threads}",
                        *args.overrides])[0]
    walls: dict[bool, list[float]] = {True: [], False: []}
    cpus: dict[bool, list[float]] = {True: [], False: []}
    evals: dict[str, list[float]] = {"own": [], "bf16": []}
    eval_cpus: dict[str, list[float]] = {"own": [], "bf16": []}
    with torch_settings(cfg.mini.deterministic, cfg.mini.num_threads, cfg.mini.device):
        t0 = time.perf_counter()
        MiniTrainer(cfg, None, sft_cache=sft_cache_dir(cfg)).run()  # warm-up: SFT and step-0 cache
        print(f"# warm-up cell (SFT warm start and step-0 cache if missing): {time.perf_counter() - t0:.1f} s")
        for r in range(args.rounds):
            for with_bf16 in ((True, False) if r % 2 == 0 else (False, True)):
                t0, c0 = time.perf_counter(), time.process_time()
                trainer = MiniTrainer(cfg, None, sft_cache=sft_cache_dir(cfg), bf16_eval=with_bf16)
                assert trainer.run()["state"] == "DONE"
                walls[with_bf16].append(time.perf_counter() - t0)
                cpus[with_bf16].append(time.process_time() - c0)
        step = trainer.step
        for r in range(args.rounds):
            for which in (("own", "bf16") if r % 2 == 0 else ("bf16", "own")):
                t0, c0 = time.perf_counter(), time.process_time()
                if which == "own":
                    trainer._engine_row(step, trainer.engine)
                else:
                    trainer._engine_row(step, trainer.bf16_eval_engine())
                evals[which].append(time.perf_counter() - t0)
                eval_cpus[which].append(time.process_time() - c0)

    def ratios(a: list[float], b: list[float]) -> list[float]:
        return [x / y for x, y in zip(a, b, strict=True)]

    out = {"cell_with_s": walls[True], "cell_without_s": walls[False], "cell_ratio": ratios(walls[True], walls[False]),
           "cell_with_cpu_s": cpus[True], "cell_without_cpu_s": cpus[False],
           "cell_cpu_ratio": ratios(cpus[True], cpus[False]),
           "eval_own_s": evals["own"], "eval_bf16_s": evals["bf16"], "eval_ratio": ratios(evals["bf16"], evals["own"]),
           "eval_own_cpu_s": eval_cpus["own"], "eval_bf16_cpu_s": eval_cpus["bf16"],
           "eval_cpu_ratio": ratios(eval_cpus["bf16"], eval_cpus["own"])}
    print(f"# cell: {' '.join(CELL + args.overrides)}, {cfg.steps} steps, evaluations at step 0 (cached) "
          f"and {cfg.steps}, {cfg.mini.n_eval} problems x {cfg.eval_k} samples + greedy")
    for unit, key in (("wall", ""), ("CPU", "_cpu")):
        print(f"cell {unit} with BF16 evaluation (s):  {_spread(out[f'cell_with{key}_s'])}")
        print(f"cell {unit} without (s):               {_spread(out[f'cell_without{key}_s'])}")
        print(f"  ratio with / without:             {_spread(out[f'cell{key}_ratio'])}")
        print(f"one evaluation {unit}, FP8 engine (s): {_spread(out[f'eval_own{key}_s'])}")
        print(f"one evaluation {unit}, BF16 engine (s):{_spread(out[f'eval_bf16{key}_s'])}")
        print(f"  ratio BF16 / FP8 evaluation:      {_spread(out[f'eval{key}_ratio'])}")
    print("# per round: " + json.dumps({k: [round(x, 3) for x in v] for k, v in out.items()}))
    sys.stdout.flush()
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
