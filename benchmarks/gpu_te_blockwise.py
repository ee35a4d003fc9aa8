"""GPU check: Transformer Engine blockwise FP8 vs our emulated blockwise, and TE FP8 / BF16 step time.

    python benchmarks/gpu_te_blockwise.py                  # numerics + timing (H100/H200, ~1-2 min)
    python benchmarks/gpu_te_blockwise.py --check-only     # numerics only (seconds)
    python benchmarks/gpu_te_blockwise.py --out benchmarks/results/gpu_te_blockwise_h200.json

Status: written ready to run, **not run yet** (the session that wrote it had no GPU); record its
output in ``docs/quant.md`` ("Transformer Engine") when it runs. Needs CUDA, compute capability
>= 9.0 and ``transformer_engine`` importable (``pip install 'fp8rl[cluster]'``); otherwise it
prints why and exits with status 2.

1. **Numerics** (``check``): a small random Qwen3-architecture model (2 layers, hidden 512,
   intermediate 1536, 8 query / 4 KV heads of 64, vocab 2048, bfloat16, LM head in BF16) and
   three copies with identical weights: BF16, ``convert_to_fp8(..., "blockwise",
   impl="transformer_engine")`` and ``convert_to_fp8(..., "blockwise", impl="fp8rl",
   emulate=True)``. One forward + backward of the mean token cross-entropy on 4 x 250 random
   tokens (1000 tokens: not a multiple of 16, so TE's zero-row padding is exercised). Reported:
   relative Frobenius error ``|a - b| / |b|`` of the logits and of every parameter gradient,
   TE vs emulated and emulated vs BF16 (the size of FP8 noise). Pass: TE vs emulated is below
   ``--tol`` (2e-2) for the logits and every gradient, and below half of emulated vs BF16 for the
   logits (TE computes the same quantization; what is left is GEMM accumulation order and the
   BF16 rounding of outputs). Also checked: under ``fp8_disabled`` the TE model's logits equal
   the BF16 model's exactly.
2. **Step time** (``timing``): the same architecture at 8B-layer width (hidden 4096,
   intermediate 12288, 32 / 8 heads of 128, 2 layers, vocab 8192), 8 x 2048 tokens,
   forward + backward (no optimizer step), median of ``--iters`` CUDA-event-timed steps after
   ``--warmup``; BF16 vs TE blockwise. Reported: ms per step and the ratio TE FP8 / BF16
   (< 1 is a speed-up). Nothing is asserted about it: small models and short sequences can be
   slower in FP8 (quantization overhead; paper.md "Published speed-ups").
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

SMALL = {"hidden": 512, "intermediate": 1536, "heads": 8, "kv_heads": 4, "head_dim": 64,
         "layers": 2, "vocab": 2048}
BIG = {"hidden": 4096, "intermediate": 12288, "heads": 32, "kv_heads": 8, "head_dim": 128,
       "layers": 2, "vocab": 8192}


def build(spec: dict, seed: int = 0) -> nn.Module:
    """A random Qwen3-architecture causal LM in bfloat16 on the current GPU."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"], max_position_embeddings=4096,
        tie_word_embeddings=False, initializer_range=0.02, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).train()


def _variants(base: nn.Module) -> dict[str, nn.Module]:
    from fp8rl.quant import convert_to_fp8

    return {
        "bf16": base,
        "te": convert_to_fp8(copy.deepcopy(base), "blockwise", impl="transformer_engine"),
        "emulated": convert_to_fp8(copy.deepcopy(base), "blockwise", impl="fp8rl", emulate=True),
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(ids).logits
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return logits, loss


def check(tol: float = 2e-2, batch: int = 4, seq: int = 250) -> dict:
    """Numerics of TE blockwise against our emulation (see the module docstring)."""
    from fp8rl.quant import fp8_disabled, fp8_layers, te_skipped_layers

    base = build(SMALL)
    models = _variants(base)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, SMALL["vocab"], (batch, seq), device="cuda", generator=g)
    targets = torch.randint(0, SMALL["vocab"], (batch, seq), device="cuda", generator=g)
    logits, grads = {}, {}
    for name, m in models.items():
        m.zero_grad(set_to_none=True)
        lg, loss = _loss(m, ids, targets)
        loss.backward()
        logits[name] = lg.detach()
        grads[name] = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
    with torch.no_grad(), fp8_disabled(models["te"]):
        shadow_equal = bool(torch.equal(models["te"](ids).logits, base(ids).logits))
    names = sorted(grads["bf16"])
    out = {
        "tokens": batch * seq,
        "te_layers": len(fp8_layers(models["te"])),
        "te_skipped": te_skipped_layers(models["te"]),
        "logits_rel_te_vs_emulated": _rel(logits["te"], logits["emulated"]),
        "logits_rel_emulated_vs_bf16": _rel(logits["emulated"], logits["bf16"]),
        "logits_rel_te_vs_bf16": _rel(logits["te"], logits["bf16"]),
        "grad_rel_te_vs_emulated": {n: _rel(grads["te"][n], grads["emulated"][n]) for n in names},
        "grad_rel_emulated_vs_bf16": {n: _rel(grads["emulated"][n], grads["bf16"][n]) for n in names},
        "fp8_disabled_equals_bf16": shadow_equal,
    }
    worst = max(out["grad_rel_te_vs_emulated"].values())
    out["grad_rel_te_vs_emulated_max"] = worst
    out["passed"] = bool(
        out["logits_rel_te_vs_emulated"] < tol
        and out["logits_rel_te_vs_emulated"] < 0.5 * out["logits_rel_emulated_vs_bf16"]
        and worst < tol
        and shadow_equal
        and out["te_layers"] == 7 * SMALL["layers"]
    )
    return out


def _time(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        model.zero_grad(set_to_none=True)
        _loss(model, ids, targets)[1].backward()
    times = []
    for _ in range(iters):
        model.zero_grad(set_to_none=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _loss(model, ids, targets)[1].backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def timing(batch: int = 8, seq: int = 2048, warmup: int = 3, iters: int = 10) -> dict:
    """Forward + backward time, BF16 vs TE blockwise, at 8B-layer width (see the module docstring)."""
    from fp8rl.quant import convert_to_fp8

    base = build(BIG)
    ids = torch.randint(0, BIG["vocab"], (batch, seq), device="cuda")
    targets = torch.randint(0, BIG["vocab"], (batch, seq), device="cuda")
    bf16_ms = _time(base, ids, targets, warmup, iters)
    te_model = convert_to_fp8(base, "blockwise", impl="transformer_engine")  # in place: same memory
    te_ms = _time(te_model, ids, targets, warmup, iters)
    return {"tokens": batch * seq, "bf16_ms": bf16_ms, "te_blockwise_ms": te_ms,
            "ratio_te_over_bf16": te_ms / bf16_ms, "spec": BIG}


def _unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    cap = torch.cuda.get_device_capability()
    if cap < (9, 0):
        return f"compute capability {cap} < 9.0 (Float8BlockScaling needs Hopper or newer)"
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine is not installed (pip install 'fp8rl[cluster]')"
    return None


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check-only", action="store_true", help="numerics only, no timing")
    p.add_argument("--tol", type=float, default=2e-2, help="TE vs emulated relative error bound")
    p.add_argument("--batch", type=int, default=8, help="timing: sequences per step")
    p.add_argument("--seq", type=int, default=2048, help="timing: tokens per sequence")
    p.add_argument("--warmup", type=int, default=3, help="timing: untimed steps")
    p.add_argument("--iters", type=int, default=10, help="timing: timed steps (median reported)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    why = _unavailable()
    if why:
        print(f"gpu_te_blockwise: cannot run: {why}", file=sys.stderr)
        raise SystemExit(2)
    import transformer_engine

    res = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformer_engine": getattr(transformer_engine, "__version__", "?")}
    res["check"] = check(tol=a.tol)
    c = res["check"]
    print(f"numerics ({c['tokens']} tokens, {c['te_layers']} TE layers): logits rel err TE vs emulated "
          f"{c['logits_rel_te_vs_emulated']:.2e}, emulated vs BF16 {c['logits_rel_emulated_vs_bf16']:.2e}; "
          f"worst grad rel err TE vs emulated {c['grad_rel_te_vs_emulated_max']:.2e}; "
          f"fp8_disabled == BF16: {c['fp8_disabled_equals_bf16']} -> {'PASS' if c['passed'] else 'FAIL'}")
    if not a.check_only:
        torch.cuda.empty_cache()
        res["timing"] = t = timing(a.batch, a.seq, a.warmup, a.iters)
        print(f"step time ({t['tokens']} tokens, fwd+bwd): BF16 {t['bf16_ms']:.1f} ms, TE blockwise "
              f"{t['te_blockwise_ms']:.1f} ms, ratio TE/BF16 {t['ratio_te_over_bf16']:.3f}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=2, sort_keys=True))
    return res


if __name__ == "__main__":
    result = main()
    raise SystemExit(0 if result["check"]["passed"] else 1)
