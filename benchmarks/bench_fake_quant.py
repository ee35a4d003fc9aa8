"""An emulated FP8 GEMM operand: ``fake_quantize`` against the cast-and-table path it replaced.

    python benchmarks/bench_fake_quant.py               # the mini model's operand shapes, BF16
    python benchmarks/bench_fake_quant.py --repeats 60

``fake_quantize`` (what the mini trainer and rollout engine feed their emulated GEMMs) rounds
to the FP8 grid in float32 arithmetic (``round_to_fp8_grid``). The baseline is the library's
other path to the same floats, bit for bit (``tests/quant/test_quant_quantize.py``): the FP8
cast (``quantize``), then the 256-entry table (``dequantize``), as ``fake_quantize`` computed
them before. Both are timed interleaved in one loop (a noisy, shared machine slows both alike)
on one thread, on the shapes of a 14b-slot mini cell (32 x 50-token micro-batches: 1,600
rows; widths 80 and 240), contiguous and transposed (the weight-gradient GEMM quantizes its
operands along the tokens), and on a decode step's 128 x 80, with a mini run's allocator setting
(``keep_freed_memory``). Prints the medians and their
ratio, baseline / ours (> 1: ours is faster).

A second table times ``fake_quantize``'s fast paths for row-major operands against its tensor
path on the same operand (``_fake_quantize_tensor``, what it computed before; the same floats,
checked): one E4M3 scale (``PerTensor``: the scale in Python floats, ``_fake_quantize_one_scale``)
and blocks of one row that tile it (``_fake_quantize_rows``: per row, ``1 x 128`` on rows up to
128 wide, MX on multiples of 32).

A third table times the path for transposed operands (``_fake_quantize_transposed``: the
weight of a dgrad GEMM, the activation and gradient of a wgrad GEMM, with blocks that tile
their rows: per row, MX, ``1 x 128`` on a multiple of 128 tokens) against the tensor path on
the same operand (the same floats, checked; ragged operands take the tensor path).

The second and third tables time PyTorch code on both sides (the native kernels off). A fourth
times the native kernels (``fp8rl.quant.native``: C, two passes over the operand) against that
PyTorch code (``fake_quantize`` with the kernels off: the fast paths above, or the tensor path
where none applies), on every operand of the three tables; the same floats and strides,
checked. The first table's ``fake_quantize`` is whatever the process uses (the header says
whether the native kernels are on).

A fifth times the native kernel of the FP4 / FP6 operands (``native.microscaled``: NVFP4 1 x 16
with nearest-even or stochastic elements, NVFP4's 16 x 16 weight tiles, MXFP6's E2M3 and E3M2)
against their PyTorch code (``microscale``'s tensor path, the kernels off), on the operands of a
long-regime 8b-slot cell (``scale=long``: a mini-batch of ~3,840 tokens, widths 64 and 192;
the wgrad operands transposed; a 192 x 64 weight; a decode step's 128 x 64): the same floats,
strides and draws, checked (a stochastic operand's two sides draw from generators seeded
alike, so both time the same ``torch.rand``).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch

from fp8rl.backends.mini.runtime import keep_freed_memory
from fp8rl.quant import (
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    MX,
    PerBlock,
    PerRow,
    PerTensor,
    dequantize,
    fake_quantize,
    native,
    quantize,
)
from fp8rl.quant.granularity import NVBlock

GRANULARITIES = {"tensor": PerTensor(), "row": PerRow(), "block1x128": PerBlock(1, 128), "mx32": MX(32)}
#: (rows, cols, transposed): the mini 14b slot's operands
SHAPES = [(1600, 240, False), (1600, 240, True), (1600, 80, True), (128, 80, False)]
#: (rows, cols, dtype, granularity): a decode step's inputs (BF16 engine; 2,048 rows in an
#: evaluation; 64 and 192 wide in the 8b slot) and a trainer micro-batch's
FAST_PATH_CASES = [(128, 80, torch.bfloat16, "tensor"), (128, 240, torch.bfloat16, "tensor"),
                   (2048, 80, torch.bfloat16, "tensor"), (1600, 240, torch.bfloat16, "tensor"),
                   (128, 80, torch.float32, "tensor"), (128, 80, torch.bfloat16, "row"),
                   (2048, 80, torch.bfloat16, "row"), (1600, 240, torch.bfloat16, "row"),
                   (128, 80, torch.bfloat16, "block1x128"), (128, 64, torch.bfloat16, "mx32"),
                   (128, 192, torch.bfloat16, "mx32")]

#: (rows, cols, granularity): a 14b-slot cell's transposed operands: a dgrad GEMM's 80 x 80
#: weight, a wgrad GEMM's activations and gradients over 1,536-1,696 tokens (1,696 is ragged
#: for 1 x 128: both sides take the tensor path there)
TRANSPOSED_CASES = [(80, 80, "row"), (80, 1600, "row"), (240, 1600, "row"), (240, 1536, "block1x128"),
                    (240, 1696, "block1x128"), (80, 1600, "mx32")]


#: (rows, cols, transposed): a long-regime 8b-slot cell's FP4 / FP6 operands (see the docstring)
MICRO_SHAPES = [(3840, 64, False), (3840, 192, False), (64, 3840, True), (192, 3840, True), (192, 64, False),
                (128, 64, False)]
#: name -> (granularity, element format, stochastic): the operands of the nvfp4 and mxfp6 recipes
MICRO_OPERANDS = {"nvfp4": (NVBlock(16), E2M1, False), "nvfp4 stochastic": (NVBlock(16), E2M1, True),
                  "nvfp4 16x16": (NVBlock(16, rows=16), E2M1, False), "mxfp6 e2m3": (MX(32), E2M3, False),
                  "mxfp6 e3m2": (MX(32), E3M2, False)}


def measure_microscaled(x: torch.Tensor, gran, fmt, stochastic: bool, repeats: int) -> dict:
    """``native.microscaled`` against the PyTorch code on ``x``: same bits, strides and draws."""
    def call(gen):
        return lambda: fake_quantize(x, gran, fmt, generator=gen)

    def fresh():
        return torch.Generator().manual_seed(0) if stochastic else None

    a, b = fresh(), fresh()
    got, want = call(a)(), without_native(call(b))()
    assert got.stride() == want.stride() and torch.equal(got.contiguous().view(torch.int32),
                                                         want.contiguous().view(torch.int32))
    assert not stochastic or torch.equal(a.get_state(), b.get_state())
    calls = native.calls["mq_full"]
    m = measure(x, gran, repeats, without_native(call(fresh())), call(fresh()))
    if native.calls["mq_full"] == calls:
        raise AssertionError(f"the microscaled kernel did not run on {tuple(x.shape)} {gran}")
    return m


def without_native(fn):
    def run():
        with native.disabled():
            return fn()
    return run


def operand(rows: int, cols: int, transposed: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if transposed:
        return torch.randn(cols, rows, generator=g).to(torch.bfloat16).t()
    return torch.randn(rows, cols, generator=g).to(torch.bfloat16)


def measure(x: torch.Tensor, gran, repeats: int, baseline=None, ours=None) -> dict:
    def cast_and_table():
        q, s = quantize(x, gran)
        return dequantize(q, s, gran)

    baseline = baseline or cast_and_table

    def ours_default():
        return fake_quantize(x, gran)

    ours = ours or ours_default

    b, o = baseline(), ours()
    assert torch.equal(b.contiguous().view(torch.int32), o.contiguous().view(torch.int32))
    times: dict[str, list[float]] = {"baseline": [], "ours": []}
    for i in range(repeats + 3):
        for name, fn in (("baseline", baseline), ("ours", ours)) if i % 2 else (("ours", ours), ("baseline", baseline)):
            t = time.perf_counter()
            fn()
            if i >= 3:  # warm-up
                times[name].append(time.perf_counter() - t)
    b, o = statistics.median(times["baseline"]), statistics.median(times["ours"])
    return {"baseline_us": b * 1e6, "ours_us": o * 1e6, "ratio": b / o}


def _add_row(rows: list[dict], m: dict) -> None:
    """Keep ``m`` and print it as a table row."""
    rows.append(m)
    print(f"| {m['operand']} | {m['granularity']} | {m['baseline_us']:.0f} | {m['ours_us']:.0f} | {m['ratio']:.2f} |",
          flush=True)


def measure_native(x: torch.Tensor, gran, pow2: bool, repeats: int) -> dict:
    """The native kernels against ``fake_quantize``'s PyTorch code on ``x``: same bits, same strides."""
    def ours():
        return fake_quantize(x, gran, E4M3, pow2_scale=pow2)

    baseline = without_native(ours)
    assert baseline().stride() == ours().stride()
    calls = sum(native.calls.values())
    m = measure(x, gran, repeats, baseline, ours)
    if sum(native.calls.values()) == calls:
        raise AssertionError(f"the native kernels did not run on {tuple(x.shape)} {gran}")
    return m


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=40)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_memory()  # as a mini run sets its allocator (fp8rl.backends.mini.runtime)
    print(f"# torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, one thread, "
          f"median of {a.repeats} interleaved calls, BF16 input; native kernels {native.status()}")
    print("| operand | granularity | cast + table us | fake_quantize us | baseline / ours |")
    print("|---|---|---|---|---|")
    rows = []
    for r, c, t in SHAPES:
        x = operand(r, c, t)
        for name, gran in GRANULARITIES.items():
            m = {"operand": f"{r} x {c}{' transposed' if t else ''}", "granularity": name,
                 **measure(x, gran, a.repeats)}
            _add_row(rows, m)
    print("\n| operand (row-major) | granularity | tensor path us | torch fast path us | baseline / ours |")
    print("|---|---|---|---|---|")
    tensor_path = importlib.import_module("fp8rl.quant.fake")._fake_quantize_tensor
    for r, c, dtype, name in FAST_PATH_CASES:
        x, gran = operand(r, c, False).to(dtype), GRANULARITIES[name]
        pow2 = name == "mx32"
        m = {"operand": f"{r} x {c} {str(dtype).removeprefix('torch.')}", "granularity": name,
             **measure(x, gran, a.repeats, lambda x=x, g=gran, p=pow2: tensor_path(x, g, E4M3, p, False),
                       without_native(lambda x=x, g=gran, p=pow2: fake_quantize(x, g, E4M3, pow2_scale=p)))}
        _add_row(rows, m)
    print("\n| operand (transposed) | granularity | tensor path us | transposed path us | baseline / ours |")
    print("|---|---|---|---|---|")
    for r, c, name in TRANSPOSED_CASES:
        x, gran = operand(r, c, True), GRANULARITIES[name]
        pow2 = name == "mx32"
        m = {"operand": f"{r} x {c} transposed", "granularity": name,
             **measure(x, gran, a.repeats, lambda x=x, g=gran, p=pow2: tensor_path(x, g, E4M3, p, False),
                       without_native(lambda x=x, g=gran, p=pow2: fake_quantize(x, g, E4M3, pow2_scale=p)))}
        _add_row(rows, m)
    if not native.enabled():
        print(f"\nnative kernels {native.status()}: no fourth table")
        return rows
    print("\n| operand | granularity | PyTorch code us | native kernels us | baseline / ours |")
    print("|---|---|---|---|---|")
    cases = [(operand(r, c, t), f"{r} x {c}{' transposed' if t else ''}", n) for r, c, t in SHAPES for n in GRANULARITIES]
    cases += [(operand(r, c, False).to(d), f"{r} x {c} {str(d).removeprefix('torch.')}", n) for r, c, d, n in FAST_PATH_CASES]
    cases += [(operand(r, c, True), f"{r} x {c} transposed", n) for r, c, n in TRANSPOSED_CASES]
    for x, label, name in cases:
        m = {"operand": label, "granularity": name, "table": "native",
             **measure_native(x, GRANULARITIES[name], name == "mx32", a.repeats)}
        _add_row(rows, m)
    print("\n| operand (FP4 / FP6) | format | PyTorch code us | native kernel us | baseline / ours |")
    print("|---|---|---|---|---|")
    for r, c, t in MICRO_SHAPES:
        for name, (gran, fmt, stochastic) in MICRO_OPERANDS.items():
            if name == "nvfp4 16x16" and (r, c) != (192, 64):
                continue  # the weights' tiles
            m = {"operand": f"{r} x {c}{' transposed' if t else ''}", "granularity": name, "table": "microscaled",
                 **measure_microscaled(operand(r, c, t), gran, fmt, stochastic, a.repeats)}
            _add_row(rows, m)
    return rows


if __name__ == "__main__":
    main()
