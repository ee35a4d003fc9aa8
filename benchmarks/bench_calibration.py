"""Cost of Calibrated Clipping: the controller update against the PPO loss, and a mini step per mode.

Two parts (``--part controller|modes|all``, default all), each measured against a baseline in
the same run, interleaved so that load from other processes hits every side alike.

**controller**: for 1M, 4M and 16M tokens, repeat by repeat:

- ``loss``: ``fp8rl.rl.policy_loss.ppo_token_loss`` forward with vanilla bounds (0.8, 1.28),
  including its clip-table and ratio-quantile metrics, under ``torch.no_grad``;
- ``kernel``: the bare vanilla PPO expression ``max(-A r, -A clip(r, L, H))`` with the mask
  (no metrics), for reference;
- ``update``: one ``CalibratedClipController.update`` (shadow reference, contribution rule)
  on the FP8 and BF16 ratios of the same tokens.

It prints median times (warm-up first), the median of the per-repeat ratios update/loss,
and the growth of the update time normalised by n log n relative to the smallest size
(<= 1 means growth no worse than n log n). Targets (issue 2): update/loss <= 5 at 1M tokens.

**modes**: one mini trainer per arm (the mini defaults, ``8b`` slot, full-FP8
tensorwise, emulated), all from the same SFT warm start and seed: ``none`` (the ``tis`` arm:
TIS, no calibration, no shadow; the baseline) and the calibrated arm in each
``clip.calibration_mode`` (``periodic`` with period 4, ``pooled``, ``same_batch``, ``sampled`` at a
share of 1/8 of the sequences, ``sampled`` with its share rule, ``windowed`` measuring every
sequence (its default ``clip.window_share`` 1) and at a share of 1/8; ``--modes`` picks a subset,
e.g. ``--modes windowed windowed_0.125``). Round by
round, each trainer runs the same block of 4 steps (mode order rotated every round; one
untimed warm-up round first), so ``periodic`` has exactly one calibration step per block and
its cost is amortised over 4 steps. Per mode it prints the median over rounds of: the block's
step time per step (``perf/step_s``), its ratio to ``none``'s block of the same round, and the
shadow's share of the step (sum of ``perf/shadow_s`` / sum of ``perf/step_s``). The trainers
train (their policies drift apart a little over the rounds), so the mean response length per
mode is printed too: rollout time follows it. Target (the calibration issue): ``sampled`` at a share
of 1/8 within 1.05x of ``none``.

    .venv/bin/python benchmarks/bench_calibration.py [--part all] [--sizes 1 4 16] [--repeats 7] \\
        [--rounds 5] [--threads N] [--cache runs/.cache/sft]

On a loaded machine, intra-op threads that wait on each other slow both sides down a lot;
``--threads 1`` gives steadier numbers there.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time

import torch

from fp8rl.rl.calibration import CalibratedClipController
from fp8rl.rl.policy_loss import ppo_token_loss

LOW, HIGH = 0.8, 1.28


def make_batch(n_tokens: int, seed: int = 0):
    """[B, T] log-probs (BF16 shadow and FP8 = shadow + noise), token advantages, mask."""
    T = 1024
    B = n_tokens // T
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g) * 0.5 - 2.0
    shadow_lp = old + torch.randn(B, T, generator=g) * 0.1
    fp8_lp = shadow_lp + torch.randn(B, T, generator=g) * 0.1
    adv = torch.randn(B, generator=g)[:, None].expand(B, T).contiguous()
    mask = torch.rand(B, T, generator=g) > 0.1
    return fp8_lp, shadow_lp, old, adv, mask


def bare_kernel(log_prob, old_log_prob, adv, mask):
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20, 20))
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, LOW, HIGH))
    return torch.where(mask, loss, 0.0)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(n_tokens: int, repeats: int) -> dict[str, float]:
    fp8_lp, shadow_lp, old, adv, mask = make_batch(n_tokens)
    ratio = torch.exp(fp8_lp - old)
    shadow_ratio = torch.exp(shadow_lp - old)
    ctl = CalibratedClipController(0.2, 0.28, mode="periodic", period=1, ema=0.5, upper_rule="contribution")
    step = [0]

    def loss():
        with torch.no_grad():
            ppo_token_loss(fp8_lp, old, adv, mask, low=LOW, high=HIGH)

    def kernel():
        with torch.no_grad():
            bare_kernel(fp8_lp, old, adv, mask)

    def update():
        ctl.update(step[0], ratio=ratio, shadow_ratio=shadow_ratio, advantages=adv, mask=mask)
        step[0] += 1

    for f in (loss, kernel, update):  # warm-up
        f()
    t_loss, t_kernel, t_update = [], [], []
    for _ in range(repeats):
        t_loss.append(timed(loss))
        t_kernel.append(timed(kernel))
        t_update.append(timed(update))
    assert ctl.metrics()["clip/degenerate_updates"] == 0
    return {
        "n": n_tokens,
        "loss": statistics.median(t_loss),
        "kernel": statistics.median(t_kernel),
        "update": statistics.median(t_update),
        "ratio": statistics.median(u / lo for u, lo in zip(t_update, t_loss, strict=True)),
        "ratio_kernel": statistics.median(u / k for u, k in zip(t_update, t_kernel, strict=True)),
        "low": ctl.bounds(step[0]).low,
        "high": ctl.bounds(step[0]).high,
    }


#: The mini arm every mode trainer runs (``bench_mini.py``'s main-table cell, without the clip arm).
FP8_ARM = ["fp8.name=tensorwise", "fp8.rollout_recipe=tensorwise", "fp8.trainer_recipe=tensorwise"]
#: Overrides per mode; ``none`` (TIS without calibration) is the baseline. The rows of the other
#: modes set ``periodic``'s options to their defaults (period 20, window 1), the values the mode
#: check accepts for a mode that does not read them (an option of another mode set away from its
#: default is refused), so that a change of the mini defaults cannot leak into them.
#: ``windowed``: its defaults (``window_target`` 3, ``window_max`` 8, ``window_share`` 1).
MODES: dict[str, list[str]] = {
    "none": ["clip.arm=tis"],
    "periodic": ["clip.arm=calibrated", "clip.calibration_mode=periodic", "clip.period=4", "clip.window=4"],
    "pooled": ["clip.arm=calibrated", "clip.calibration_mode=pooled", "clip.period=20", "clip.window=1"],
    "same_batch": ["clip.arm=calibrated", "clip.calibration_mode=same_batch", "clip.period=20", "clip.window=1"],
    "sampled_0.125": ["clip.arm=calibrated", "clip.calibration_mode=sampled", "clip.period=20", "clip.window=1",
                      "clip.sample_fraction=0.125"],
    "sampled_rule": ["clip.arm=calibrated", "clip.calibration_mode=sampled", "clip.period=20", "clip.window=1"],
    "windowed": ["clip.arm=calibrated", "clip.calibration_mode=windowed", "clip.period=20", "clip.window=1"],
    "windowed_0.125": ["clip.arm=calibrated", "clip.calibration_mode=windowed", "clip.period=20", "clip.window=1",
                       "clip.window_share=0.125"],
}
#: The issue's target: sampled at a share of 1/8 within 5% of the uncalibrated step.
SAMPLED_TARGET = ("sampled_0.125", 1.05)
BLOCK = 4  # steps per mode per round: one periodic calibration (period 4) per block


def bench_modes(rounds: int, threads: int, cache: str, modes: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Median over ``rounds`` of per-step time, ratio to ``none`` and shadow share, per mode
    (``modes``: a subset of ``MODES``; ``none``, the baseline, always runs)."""
    from fp8rl.backends.mini.__main__ import parse_config
    from fp8rl.backends.mini.run import sft_cache_dir
    from fp8rl.backends.mini.runtime import torch_settings
    from fp8rl.backends.mini.trainer import MiniTrainer
    from fp8rl.runs import metrics as M

    common = [*FP8_ARM, f"mini.cache_dir={cache}", f"mini.num_threads={threads}", "eval_every=0"]
    chosen = {m: o for m, o in MODES.items() if m == "none" or modes is None or m in modes}
    cfgs = {m: parse_config([*common, *o])[0] for m, o in chosen.items()}
    first = next(iter(cfgs.values()))
    per_round: dict[str, list[dict[str, float]]] = {m: [] for m in chosen}
    with torch_settings(first.mini.deterministic, first.mini.num_threads, first.mini.device):
        t0 = time.perf_counter()
        trainers = {m: MiniTrainer(c, None, sft_cache=sft_cache_dir(c)) for m, c in cfgs.items()}
        print(f"# {len(trainers)} mini trainers built (SFT warm start included) in {time.perf_counter() - t0:.1f} s")
        names = list(chosen)
        for r in range(rounds + 1):  # round 0: warm-up, not timed
            steps = range(r * BLOCK + 1, (r + 1) * BLOCK + 1)
            order = names[r % len(names):] + names[:r % len(names)]
            for m in order:
                c0 = time.thread_time()
                rows = [trainers[m].train_step(k) for k in steps]
                cpu_s = time.thread_time() - c0
                if r == 0:
                    continue
                step_s = sum(row[M.PERF_STEP_S] for row in rows)
                shadow_s = sum(row.get(M.PERF_SHADOW_S) or 0.0 for row in rows)
                per_round[m].append({
                    "step_s": step_s / BLOCK, "cpu_s": cpu_s / BLOCK, "shadow_share": shadow_s / step_s,
                    "share": statistics.mean(row.get("clip/sample_share", float("nan")) for row in rows),
                    "measured": sum(1 for row in rows if M.PERF_SHADOW_S in row),
                    "response_len": statistics.mean(row[M.ROLLOUT_RESPONSE_LEN] for row in rows),
                })
    out = {}
    base = per_round["none"]
    for m, rs in per_round.items():
        cpu = [x["cpu_s"] / b["cpu_s"] for x, b in zip(rs, base, strict=True)]
        out[m] = {
            "cpu_ratio": statistics.median(cpu), "cpu_ratio_min": min(cpu), "cpu_ratio_max": max(cpu),
            "step_s": statistics.median(x["step_s"] for x in rs),
            "ratio": statistics.median(x["step_s"] / b["step_s"] for x, b in zip(rs, per_round["none"], strict=True)),
            "ratio_min": min(x["step_s"] / b["step_s"] for x, b in zip(rs, per_round["none"], strict=True)),
            "ratio_max": max(x["step_s"] / b["step_s"] for x, b in zip(rs, per_round["none"], strict=True)),
            # windowed logs no share (a fixed one, not the share rule's): its option
            "share": (cfgs[m].clip.window_share if cfgs[m].clip.calibration_mode == "windowed"
                      else statistics.mean(x["share"] for x in rs)),
            "shadow_share": statistics.median(x["shadow_share"] for x in rs),
            "measured": statistics.median(x["measured"] for x in rs),
            "response_len": statistics.mean(x["response_len"] for x in rs),
        }
    return out


def print_modes(res: dict[str, dict[str, float]], rounds: int) -> None:
    print(f"# mini step per calibration mode: {rounds} rounds of {BLOCK} steps per mode, medians over rounds")
    print(f"| mode | measured steps / {BLOCK} | measured share of sequences | step (s) | step / none (min-max) | "
          "CPU time / none (min-max) | shadow share of step | mean response len |")
    print("|---|---|---|---|---|---|---|---|")
    for m, r in res.items():
        share = "all" if m in ("periodic", "pooled", "same_batch") else ("-" if m == "none" else f"{r['share']:.3f}")
        print(f"| {m} | {r['measured']:.0f} | {share} | {r['step_s']:.3f} | {r['ratio']:.3f} "
              f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | {r['cpu_ratio']:.3f} "
              f"({r['cpu_ratio_min']:.3f}-{r['cpu_ratio_max']:.3f}) | {100 * r['shadow_share']:.1f}% | "
              f"{r['response_len']:.1f} |")
    name, target = SAMPLED_TARGET
    if name in res:
        verdict = "meets" if res[name]["ratio"] <= target else "misses"
        print(f"# target {name} step / none <= {target}: {verdict} ({res[name]['ratio']:.3f}; "
              f"CPU time {res[name]['cpu_ratio']:.3f})")


def print_controller(sizes: list[int], repeats: int) -> None:
    rows = [bench(s << 20, repeats) for s in sizes]
    base = rows[0]
    print("| tokens | loss fwd (ms) | bare kernel (ms) | update (ms) | update / loss | update / bare kernel | update growth / (n log n growth) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        nlogn = (r["n"] * math.log(r["n"])) / (base["n"] * math.log(base["n"]))
        growth = (r["update"] / base["update"]) / nlogn
        print(
            f"| {r['n'] >> 20}M | {r['loss'] * 1e3:.1f} | {r['kernel'] * 1e3:.1f} | {r['update'] * 1e3:.1f} | "
            f"{r['ratio']:.2f} | {r['ratio_kernel']:.2f} | {growth:.2f} |"
        )
    verdict = "meets" if base["ratio"] <= 5 and base["n"] == 1 << 20 else "check"
    print(f"# target update/loss <= 5 at 1M tokens: {verdict} ({base['ratio']:.2f})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("controller", "modes", "all"), default="all")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16], help="token counts in units of 2**20")
    ap.add_argument("--repeats", type=int, default=7, help="controller part: timed repeats per size")
    ap.add_argument("--rounds", type=int, default=5, help=f"modes part: timed rounds of {BLOCK} steps per mode")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)"
    )
    ap.add_argument("--cache", default="runs/.cache/sft", help="modes part: the mini SFT warm-start cache")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=None,
                    help="modes part: the modes to run (default all; none, the baseline, always runs)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.rounds < 1:
        ap.error("--repeats and --rounds must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"{platform.machine()} {platform.system()}"
    )
    if args.part in ("controller", "all"):
        print_controller(args.sizes, args.repeats)
    if args.part in ("modes", "all"):
        print_modes(bench_modes(args.rounds, args.threads or 0, args.cache, args.modes), args.rounds)


if __name__ == "__main__":
    main()
