"""Where the time of one mini RL step goes: CPU time per phase, and the busiest torch ops.

    python benchmarks/profile_mini_step.py [--steps N] [--warmup W] [--ops] [--arm fp32] [key=value ...]

Builds the trainer of ``benchmarks/bench_peer_trl.py`` (the issue-33 settings by default:
8 prompts x 8 completions, 4 mini-batch updates, the ``8b`` slot, the ``fp32`` arm, one
thread, one learning rate), runs ``--warmup`` untimed steps, then ``--steps`` timed ones,
and prints per phase the **CPU time of this thread** (``time.thread_time``: on a shared
machine it does not count the time other processes hold the core, unlike wall time) per
step, median over steps, and its share of the step:

- ``rollout/prefill+decode``: ``RolloutEngine.generate`` (prefill, the decode loop, stacking);
- ``rollout/score``: decoding to text and grading;
- ``train/old_log_probs``: the no-grad pass over the batch, split into ``.forward``
  (``forward_logits``), ``.logprobs`` (``token_logprobs``) and the rest (entropy);
- ``train/minibatch``: the four updates, split into ``.forward``, ``.logprobs``,
  ``.backward``, ``.clip_grad``, ``.optimizer`` (AdamW) and the rest (ratio, bounds, loss,
  clip counts and the metric syncs);
- ``train/is_weights``, ``train/stats`` (the step's metrics from the mini-batch results,
  ``UpdateStats.result``), ``train/sync`` (the engine's weight copy), ``train/check_finite``;
  ``step/other``: the rest of ``train_step`` (advantages, shuffling, rollout metrics, ...).

``--ops`` adds a ``torch.profiler`` table of one step: op counts (all levels, and those called
from Python or the autograd engine rather than from inside another op) and the ops with the
most self CPU time (the op count is what costs at this size: each op is a few microseconds;
unlike times, counts do not depend on the machine's load).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch


class PhaseClock:
    """Accumulates ``time.thread_time`` per phase name; nested phases are subtracted from
    their parent so that the phases of a step add up to the step."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            full = (self.stack[-1][0] if self.stack else "") + name if name.startswith(".") else name
            self.stack.append([full, 0.0])
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                dt = time.thread_time() - t0
                _, child = self.stack.pop()
                self.totals[full] += dt - child
                if self.stack:
                    self.stack[-1][1] += dt
        return timed

    def take(self) -> dict[str, float]:
        out, self.totals = dict(self.totals), defaultdict(float)
        return out


def instrument(trainer, clock: PhaseClock) -> None:
    """Wrap the trainer's phases (instance attributes shadow the class methods)."""
    import fp8rl.backends.mini.batch as batch_mod
    import fp8rl.backends.mini.stats as stats_mod
    import fp8rl.backends.mini.updates as upd
    import fp8rl.rl.correction as corr

    t = trainer
    t.engine.generate = clock.wrap("rollout/prefill+decode", t.engine.generate)
    t.score = clock.wrap("rollout/score", t.score)
    t.old_log_probs = clock.wrap("train/old_log_probs", t.old_log_probs)
    t.minibatch_update = clock.wrap("train/minibatch", t.minibatch_update)
    t.forward_logits = clock.wrap(".forward", t.forward_logits)
    t.engine.sync = clock.wrap("train/sync", t.engine.sync)
    t.check_finite_parameters = clock.wrap("train/check_finite", t.check_finite_parameters)
    t.optimizer.step = clock.wrap(".optimizer", t.optimizer.step)
    upd.token_logprobs = clock.wrap(".logprobs", batch_mod.token_logprobs)
    corr.is_weights = clock.wrap("train/is_weights", corr.is_weights)
    stats_mod.UpdateStats.result = clock.wrap("train/stats", stats_mod.UpdateStats.result)
    torch.Tensor.backward = clock.wrap(".backward", torch.Tensor.backward)
    torch.nn.utils.clip_grad_norm_ = clock.wrap(".clip_grad", torch.nn.utils.clip_grad_norm_)


def config(argv_overrides: list[str], arm: str, threads: int, cache: str):
    """The ``MiniRunConfig`` of ``bench_peer_trl.py`` for ``arm`` (its very overrides)."""
    from bench_peer_trl import config_overrides, parse

    return parse(config_overrides(arm, threads, cache, argv_overrides))


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--arm", default="fp32")
    p.add_argument("--cache", default="runs/.cache/sft")
    p.add_argument("--ops", action="store_true", help="also a torch.profiler op table of one step")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    from fp8rl.backends.mini.runtime import torch_settings

    cfg = config(args.overrides, args.arm, args.threads, args.cache)
    # the torch settings of a mini run (threads, deterministic algorithms, no NaN fill)
    with torch_settings(cfg.mini.deterministic, args.threads, cfg.mini.device):
        return profile(args, cfg)


def profile(args: argparse.Namespace, cfg) -> dict:
    from fp8rl.backends.mini.trainer import MiniTrainer

    trainer = MiniTrainer(cfg, None, sft_cache=args.cache)
    clock = PhaseClock()
    step_fn = clock.wrap("step/other", trainer.train_step)
    instrument(trainer, clock)
    for s in range(1, args.warmup + 1):
        step_fn(s)
    clock.take()
    rows, walls = [], []
    for s in range(args.warmup + 1, args.warmup + args.steps + 1):
        w0 = time.perf_counter()
        step_fn(s)
        walls.append(time.perf_counter() - w0)
        rows.append(clock.take())
    names = sorted({k for r in rows for k in r})
    per = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in names}
    total = statistics.median(sum(r.values()) for r in rows)
    print(f"{'phase':32s} {'cpu ms/step':>12s} {'share':>7s}")
    for k in names:
        print(f"{k:32s} {1e3 * per[k]:12.2f} {100 * per[k] / total:6.1f}%")
    print(f"{'step (cpu, median)':32s} {1e3 * total:12.2f}")
    print(f"{'step (wall, median)':32s} {1e3 * statistics.median(walls):12.2f}")
    out = {"phases_ms": {k: round(1e3 * v, 3) for k, v in per.items()}, "step_cpu_ms": round(1e3 * total, 3),
           "step_wall_ms": round(1e3 * statistics.median(walls), 3)}
    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step_fn(args.warmup + args.steps + 1)
        events = prof.key_averages()
        n_ops = sum(e.count for e in events if e.key.startswith("aten::"))
        # ops called from Python (not from inside another op): what costs dispatch overhead
        top = sum(1 for e in prof.events() if e.name.startswith("aten::") and (
            e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
        print(f"\naten ops in one step: {n_ops} (all levels), {top} called from Python or autograd")
        print(events.table(sort_by="self_cpu_time_total", row_limit=25))
        out["aten_ops"], out["aten_ops_top"] = n_ops, top
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
