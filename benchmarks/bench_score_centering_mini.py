"""Cost of Score Centering at mini scale: a training step of ``score_centering_tis`` against ``tis``.

Two mini trainers with the mini defaults (``8b`` slot, 16 prompts x 8 samples, 4 mini-batches)
on the same FP8 arm (default ``mxfp4``, emulated), the same SFT warm start and seed: ``tis``
(the baseline) and ``score_centering_tis`` (the same loss plus the term: the engine's top-k per
token, the trainer's log-probs at those ids, ``A * C``). Round by round each trainer runs one
step (order alternating; one untimed warm-up round), and the benchmark prints the median over
rounds of the ratio ``score_centering_tis / tis`` of the step time, its rollout and training
parts, and the CPU time of the step. The trainers train, so their rollouts drift apart: the
mean response length of each is printed (rollout time follows it).

A second, isolated measure: the rollout engine of the ``tis`` trainer generating the same
prompts with the same generator seed with and without ``topk=k`` (interleaved repeats; the
samples are identical, so the ratio is the top-k's own cost).

    .venv/bin/python benchmarks/bench_score_centering_mini.py [--rounds 8] [--fp8 mxfp4] \\
        [--threads N] [--cache runs/.cache/sft]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

ARMS = ("tis", "score_centering_tis")


def bench(rounds: int, fp8: str, threads: int, cache: str) -> dict:
    from fp8rl.backends.mini.__main__ import parse_config
    from fp8rl.backends.mini.run import sft_cache_dir
    from fp8rl.backends.mini.runtime import seed_for, torch_settings
    from fp8rl.backends.mini.trainer import MiniTrainer
    from fp8rl.runs import metrics as M

    common = [f"fp8.name={fp8}", f"fp8.rollout_recipe={fp8}", f"fp8.trainer_recipe={fp8}",
              f"mini.cache_dir={cache}", f"mini.num_threads={threads}", "eval_every=0"]
    cfgs = {arm: parse_config([*common, f"clip.arm={arm}"])[0] for arm in ARMS}
    first = cfgs["tis"]
    per_round: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    gen_s: dict[str, list[float]] = {"plain": [], "topk": []}
    with torch_settings(first.mini.deterministic, first.mini.num_threads, first.mini.device):
        t0 = time.perf_counter()
        trainers = {arm: MiniTrainer(c, None, sft_cache=sft_cache_dir(c), bf16_eval=False) for arm, c in cfgs.items()}
        print(f"# 2 mini trainers built (SFT warm start included) in {time.perf_counter() - t0:.1f} s")
        for r in range(rounds + 1):  # round 0: warm-up, not timed
            order = ARMS if r % 2 == 0 else ARMS[::-1]
            for arm in order:
                c0 = time.thread_time()
                row = trainers[arm].train_step(r + 1)
                cpu_s = time.thread_time() - c0
                if r:
                    per_round[arm].append({"step_s": row[M.PERF_STEP_S], "rollout_s": row[M.PERF_ROLLOUT_S],
                                           "train_s": row[M.PERF_TRAIN_S], "cpu_s": cpu_s,
                                           "len": row[M.ROLLOUT_RESPONSE_LEN]})
        # the top-k's own cost: the same prompts, generator seed and engine, with and without it
        tr, cfg = trainers["tis"], first
        k = cfgs["score_centering_tis"].clip.score_centering_topk
        for r in range(rounds + 1):
            for kind in (("plain", "topk") if r % 2 == 0 else ("topk", "plain")):
                gen = torch.Generator(device=tr.device).manual_seed(seed_for(cfg.seed, "bench", r))
                orig = tr.engine.generate
                t0 = time.perf_counter()
                if kind == "topk":
                    tr.engine.generate = lambda *a, _o=orig, **kw: _o(*a, **{**kw, "topk": k})
                try:
                    tr.rollout(r + 1, 0, gen)
                finally:
                    tr.engine.generate = orig
                if r:
                    gen_s[kind].append(time.perf_counter() - t0)
    sc, base = per_round["score_centering_tis"], per_round["tis"]

    def ratio(key: str) -> tuple[float, float, float]:
        rs = [x[key] / b[key] for x, b in zip(sc, base, strict=True)]
        return statistics.median(rs), min(rs), max(rs)

    return {
        "step": ratio("step_s"), "rollout": ratio("rollout_s"), "train": ratio("train_s"), "cpu": ratio("cpu_s"),
        "step_s": {arm: statistics.median(x["step_s"] for x in per_round[arm]) for arm in ARMS},
        "len": {arm: statistics.mean(x["len"] for x in per_round[arm]) for arm in ARMS},
        "generate_topk": statistics.median(t / p for t, p in zip(gen_s["topk"], gen_s["plain"], strict=True)),
        "generate_s": statistics.median(gen_s["plain"]),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--fp8", default="mxfp4", help="the FP8 arm both trainers run (fp8=NAME; a full-FP8 recipe)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--cache", default="runs/.cache/sft")
    a = p.parse_args(argv)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, fp8={a.fp8}, "
          f"{a.rounds} rounds (one step per arm each)")
    res = bench(a.rounds, a.fp8, a.threads, a.cache)
    print("| score_centering_tis / tis | median | min | max |")
    print("|---|---|---|---|")
    for key in ("step", "rollout", "train", "cpu"):
        med, lo, hi = res[key]
        print(f"| {key} time | {med:.3f} | {lo:.3f} | {hi:.3f} |")
    print(f"# median step: tis {res['step_s']['tis']:.3f} s, score_centering_tis "
          f"{res['step_s']['score_centering_tis']:.3f} s; mean response length: tis {res['len']['tis']:.1f}, "
          f"score_centering_tis {res['len']['score_centering_tis']:.1f}")
    print(f"# same rollout with / without topk: {res['generate_topk']:.3f} (plain {res['generate_s']:.3f} s)")
    return res


if __name__ == "__main__":
    main()
