"""Quantize-to-FP8 cost per granularity, relative to ``clone()`` of the same tensor.

    python benchmarks/bench_quant.py                 # 4096 x 4096 float32, eager and compiled
    python benchmarks/bench_quant.py --dtype bfloat16 --repeats 20 --no-compile

For every granularity it times ``fp8rl.quant.quantize`` (FP8 values + scales) and ``x.clone()``
*interleaved* in the same loop (so a noisy, shared machine slows both alike) and reports
median(quantize) / median(clone). Target (issue 3): within 4x of clone for every granularity on
CPU. ``torch.compile`` time is reported separately and excluded from the per-call numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fp8rl.quant import E4M3, MX, PerBlock, PerRow, PerTensor, quantize

GRANULARITIES = {
    "tensor": PerTensor(),
    "row": PerRow(),
    "block1x128": PerBlock(1, 128),
    "block128x128": PerBlock(128, 128),
    "mx32": MX(32),
}
TARGET_X = 4.0


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(x: torch.Tensor, g, *, compile: bool, repeats: int) -> dict:
    t0 = time.perf_counter()
    for _ in range(2):  # warm-up (and compilation)
        quantize(x, g, E4M3, compile=compile)
    warm = time.perf_counter() - t0
    tq, tc = [], []
    for _ in range(repeats):
        tc.append(_time(lambda: x.clone()))
        tq.append(_time(lambda: quantize(x, g, E4M3, compile=compile)))
    q, c = statistics.median(tq), statistics.median(tc)
    return {"quant_ms": q * 1e3, "clone_ms": c * 1e3, "ratio": q / c, "warmup_s": warm}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    a = p.parse_args(argv)
    x = torch.randn(a.size, a.size, generator=torch.Generator().manual_seed(0)).to(getattr(torch, a.dtype))
    modes = [False, True] if a.compile else [False]
    rows = []
    print(f"# {a.size}x{a.size} {a.dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"median of {a.repeats} interleaved runs")
    print("| granularity | mode | quantize ms | clone ms | quantize / clone | within 4x | warm-up s |")
    print("|---|---|---|---|---|---|---|")
    for name, g in GRANULARITIES.items():
        for compile in modes:
            r = {"granularity": name, "mode": "compiled" if compile else "eager",
                 **measure(x, g, compile=compile, repeats=a.repeats)}
            rows.append(r)
            print(f"| {name} | {r['mode']} | {r['quant_ms']:.1f} | {r['clone_ms']:.1f} | {r['ratio']:.2f} | "
                  f"{'yes' if r['ratio'] <= TARGET_X else 'NO'} | {r['warmup_s']:.1f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
