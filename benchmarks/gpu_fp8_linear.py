"""GPU check: FP8 linear vs BF16, forward + backward, at Llama/Qwen-8B layer shapes.

    python benchmarks/gpu_fp8_linear.py                        # H100/H200: M=8192, K=4096, N in {12288, 4096}
    python benchmarks/gpu_fp8_linear.py --check-only           # numerics only, small shapes (seconds)
    python benchmarks/gpu_fp8_linear.py --out benchmarks/results/gpu_fp8_linear_h200.json

Status: written ready to run, **not run yet** (the sessions that built it had no GPU); the
numbers go into ``docs/quant.md`` and the ``--out`` JSON when it is run. Needs CUDA capability
>= 8.9 (9.0 for blockwise kernels); on a machine without CUDA it exits with status 2 and says so.

What it times (median of ``--iters`` CUDA-event-timed ``y = layer(x); y.backward(g)`` steps after
``--warmup`` steps; weights and activations bfloat16, no bias, ``torch.compile`` on by default as
torchao's published numbers use it):

- ``bf16``: ``nn.Linear``.
- ``tensorwise`` / ``rowwise``: ``fp8rl.quant.convert_to_fp8(impl="torchao")`` -- torchao's
  ``Float8Linear`` (the paper's training stack).
- ``blockwise``: torchao's prototype ``Float8BlockwiseLinear`` (``F.scaled_mm`` with
  ``BlockWise1x128`` x ``BlockWise128x128`` scales on SM90; the same 1x128 / 128x128 / 128x1
  tiling as our ``blockwise`` recipe), and, for reference, our emulated ``Fp8Linear``
  (``emulate=True``; expected *slower* than BF16 -- it is a numerics tool, not a kernel).

Before timing, every FP8 variant is checked against our emulated FP8 linear on a small shape
(forward output and both input gradients, relative max error < 2e-2 in bfloat16). Target from
issue 3: tensorwise >= 1.5x over BF16 (the paper reports up to 1.5x training throughput).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

from fp8rl.quant import RECIPES, convert_to_fp8, fp8_linear

TARGET_TENSORWISE_X = 1.5


def _variants(recipe: str, capability: tuple[int, int]) -> dict:
    """name -> function(nn.Linear) -> module, for one recipe."""
    only = {"module_filter": lambda m, fqn: isinstance(m, nn.Linear)}
    if recipe == "bf16":
        return {"bf16": lambda lin: lin}
    if recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        return {f"{recipe}/torchao": lambda lin: convert_to_fp8(nn.Sequential(lin), recipe, impl="torchao", **only)}
    if recipe == "blockwise":
        out = {"blockwise/fp8rl-emulated": lambda lin: convert_to_fp8(nn.Sequential(lin), recipe, emulate=True, **only)}
        if capability >= (9, 0):
            def tao_block(lin):
                from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

                return Float8BlockwiseLinear.from_float(lin)

            out["blockwise/torchao-prototype"] = tao_block
        return out
    return {f"{recipe}/fp8rl-emulated": lambda lin: convert_to_fp8(nn.Sequential(lin), recipe, emulate=True, **only)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def check(recipe: str, make, m: int = 256, k: int = 512, n: int = 384) -> dict:
    """Compare one variant with our emulated FP8 linear on a small bf16 problem."""
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ref_w = lin.weight.detach().clone().requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    y_ref = fp8_linear(xr, ref_w, None, RECIPES[recipe], emulate=True)
    y_ref.backward(g)
    mod = make(copy.deepcopy(lin))
    xv = x.clone().requires_grad_(True)
    y = mod(xv)
    y.backward(g)
    w = next(mod.parameters())
    errs = {"y": _rel(y, y_ref), "grad_x": _rel(xv.grad, xr.grad), "grad_w": _rel(w.grad, ref_w.grad)}
    return {"max_rel_err": max(errs.values()), **errs}


def time_fwd_bwd(mod: nn.Module, m: int, k: int, n: int, *, iters: int, warmup: int, compile: bool) -> float:
    """Median milliseconds of one forward + backward step."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(mod) if compile else mod
    for _ in range(warmup):
        fn(x).backward(g)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x).backward(g)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=8192, help="tokens")
    p.add_argument("--k", type=int, default=4096, help="in features")
    p.add_argument("--n", type=int, nargs="+", default=[12288, 4096], help="out features")
    p.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise", "blockwise"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--check-only", action="store_true", help="numerics checks only, no timing")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_fp8_linear: needs a CUDA GPU; not run on this machine", file=sys.stderr)
        sys.exit(2)
    cap = torch.cuda.get_device_capability()
    device = f"{torch.cuda.get_device_name()} (sm{cap[0]}{cap[1]}), torch {torch.__version__}"
    print(f"# {device}")
    rows: list[dict] = []
    for recipe in a.recipes:
        for name, make in _variants(recipe, cap).items():
            try:
                rows.append({"variant": name, "check": check(recipe, make)})
            except Exception as e:  # report and go on: one missing kernel must not hide the rest
                rows.append({"variant": name, "check": {"error": f"{type(e).__name__}: {e}"}})
            print(f"check {name}: {rows[-1]['check']}", flush=True)
    if not a.check_only:
        timed = []
        for n in a.n:
            torch.manual_seed(0)
            base = nn.Linear(a.k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            t_bf16 = time_fwd_bwd(copy.deepcopy(base), a.m, a.k, n, iters=a.iters, warmup=a.warmup, compile=a.compile)
            timed.append({"variant": "bf16", "m": a.m, "k": a.k, "n": n, "ms": t_bf16, "speedup": 1.0})
            for recipe in a.recipes:
                for name, make in _variants(recipe, cap).items():
                    row = {"variant": name, "m": a.m, "k": a.k, "n": n}
                    try:
                        ms = time_fwd_bwd(make(copy.deepcopy(base)), a.m, a.k, n,
                                          iters=a.iters, warmup=a.warmup, compile=a.compile)
                        row.update(ms=ms, speedup=t_bf16 / ms)
                    except Exception as e:
                        row.update(error=f"{type(e).__name__}: {e}")
                    timed.append(row)
        print("| variant | M | K | N | fwd+bwd ms | speedup vs bf16 |")
        print("|---|---|---|---|---|---|")
        for r in timed:
            ms = f"{r['ms']:.3f}" if "ms" in r else r.get("error", "")
            sp = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
            print(f"| {r['variant']} | {r['m']} | {r['k']} | {r['n']} | {ms} | {sp} |")
        tw = [r["speedup"] for r in timed if r["variant"] == "tensorwise/torchao" and "speedup" in r]
        if tw:
            print(f"tensorwise target >= {TARGET_TENSORWISE_X}x: {'met' if min(tw) >= TARGET_TENSORWISE_X else 'NOT met'} "
                  f"(min {min(tw):.2f}x)")
        rows += timed
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"device": device, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
