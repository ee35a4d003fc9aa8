"""The rollout engine's decode with finished rows dropped from the batch, against computing every row.

    python benchmarks/bench_live_rows.py [--reps 10] [--slot 14b] [--cache runs/.cache/sft]

``fp8rl.backends.mini.live_rows``: the engine computes only the rows still generating (in
32-row granules, where that changes no number). This times ``RolloutEngine.generate`` on a
warm-started policy (the slot's SFT warm start from ``--cache``, trained first if absent, as a
run trains it) with dropping on and off (``live_rows.ENABLED``), interleaved repeat by repeat
in one process (one thread, a mini run's torch settings), for a training rollout's batch (16
prompts x 8 samples = 128 rows) and an evaluation's (512 problems x 4 = 2,048 rows), per
engine: BF16, rowwise and blockwise FP8 (rows dropped), tensorwise FP8 (a per-tensor activation
scale: every row kept, so about 1.0 is expected). Checks that both give the same tokens and
log-probs; prints the medians of the thread's CPU time, the share of decoded rows that were
live, and the ratio off / on (> 1: dropping is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--slot", default="14b")
    p.add_argument("--cache", default="runs/.cache/sft")
    a = p.parse_args(argv)
    from fp8rl.backends.mini import live_rows
    from fp8rl.backends.mini.__main__ import parse_config
    from fp8rl.backends.mini.batch import left_pad
    from fp8rl.backends.mini.rollout import RolloutEngine
    from fp8rl.backends.mini.runtime import torch_settings
    from fp8rl.backends.mini.sft import warm_start
    from fp8rl.backends.mini.task import make_splits
    from fp8rl.backends.mini.tokenizer import CharTokenizer

    cfg = parse_config([f"model.slot={a.slot}", f"mini.cache_dir={a.cache}", "mini.num_threads=1"])[0]
    rows_out = []
    with torch_settings(True, 1, "cpu"):
        tok, mini = CharTokenizer(), cfg.mini
        train, evals = make_splits(mini.data_seed, mini.n_train, mini.n_eval, min_terms=mini.min_terms,
                                   max_terms=mini.max_terms, max_operand=mini.max_operand)
        model = warm_start(a.slot, train, tok, mini, a.cache)[0]
        print(f"# torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, one thread, slot "
              f"{a.slot}, median of {a.reps} interleaved calls, max {cfg.max_response_len} new tokens")
        print("| engine | rows | live share | every row ms | live rows ms | every row / live rows |")
        print("|---|---|---|---|---|---|")
        for recipe in ("bf16", "rowwise", "blockwise", "tensorwise"):
            engine = RolloutEngine(model, recipe, emulate=True, dtype=torch.bfloat16)
            engine.sync(model)
            for n in (128, 2048):
                probs = (evals * (n // len(evals) + 1))[:n]
                ids, mask = left_pad([tok.encode(q.prompt, bos=True) for q in probs], tok.pad_id)
                times: dict[bool, list[float]] = {True: [], False: []}
                outs = {}
                for r in range(a.reps + 1):
                    for on in ((True, False) if r % 2 else (False, True)):
                        live_rows.ENABLED = on
                        t = time.thread_time()
                        outs[on] = engine.generate(ids, mask, max_new_tokens=cfg.max_response_len, temperature=1.0,
                                                   eos_id=tok.eos_id, pad_id=tok.pad_id,
                                                   generator=torch.Generator().manual_seed(r))
                        if r:  # the first round warms up
                            times[on].append(time.thread_time() - t)
                    assert torch.equal(outs[True].response_ids, outs[False].response_ids)
                    assert torch.equal(outs[True].rollout_log_probs, outs[False].rollout_log_probs)
                live_rows.ENABLED = True
                off, on = statistics.median(times[False]), statistics.median(times[True])
                row = {"engine": recipe, "rows": n, "live_share": float(outs[True].response_mask.float().mean()),
                       "every_row_ms": off * 1e3, "live_rows_ms": on * 1e3, "ratio": off / on}
                rows_out.append(row)
                print(f"| {recipe} | {n} | {row['live_share']:.2f} | {row['every_row_ms']:.0f} | "
                      f"{row['live_rows_ms']:.0f} | {row['ratio']:.2f} |", flush=True)
    return rows_out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
