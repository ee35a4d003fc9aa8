"""GPU check of the OpenRLHF plugin's trainer side on a small Qwen3-architecture model (NOT RUN yet).

    python benchmarks/gpu_openrlhf_plugin.py [--recipes tensorwise rowwise blockwise] [--out results.json]

Per FP8 trainer recipe, on one CUDA GPU (compute capability >= 8.9), with a random
Qwen3-architecture model (default 4 layers x 1024 hidden, bf16):

1. convert a copy with ``plugin.convert_trainer_model`` (what the worker does at model creation;
   LM head and embeddings stay BF16) and record how many Linears became FP8;
2. forward + backward of a token-mean PPO loss through the plugin's ``Fp8rlPolicyLoss`` (built on
   the real OpenRLHF 0.11.2 ``PolicyLoss``, loaded by path) vs the BF16 model: log-prob error,
   relative loss difference, cosine similarity of the gradients;
3. the shadow pass: the converted model under ``fp8_disabled`` must give the BF16 log-probs
   (max abs difference recorded; expected 0 up to kernel nondeterminism);
4. one calibration step: the loss with ``pending_shadow`` (BF16 shadow ratios after one SGD
   step) updates the calibrated controller; bounds and alpha recorded;
5. step time (forward + backward, median of ``--iters``) FP8 / BF16.

Writes a JSON report (``--out``, default ``$OUT/gpu_openrlhf_plugin.json`` when ``$OUT`` is set)
and prints it. Exits 1 if a correctness check fails (thresholds below), 2 without a suitable GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MAX_SHADOW_DIFF = 1e-2     # log-prob units; fp8_disabled must reproduce the BF16 model
MIN_GRAD_COS = 0.95        # FP8 vs BF16 gradient direction
MAX_LOSS_REL = 0.05        # FP8 vs BF16 PPO loss


def upstream_policy_loss():
    """openrlhf/models/loss.py by path (its package imports deepspeed and flash-attn)."""
    import ast
    import importlib.util
    import types
    from typing import Optional

    spec = importlib.util.find_spec("openrlhf")
    root = Path(spec.origin).parent / "models"
    pkg = types.ModuleType("_gpu_orl")
    pkg.__path__ = [str(root)]
    utils = types.ModuleType("_gpu_orl.utils")
    tree = ast.parse((root / "utils.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "masked_mean")
    ns = {"torch": torch, "Optional": Optional}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "utils.py", "exec"), ns)
    utils.masked_mean = ns["masked_mean"]
    sys.modules["_gpu_orl"], sys.modules["_gpu_orl.utils"] = pkg, utils
    s = importlib.util.spec_from_file_location("_gpu_orl.loss", root / "loss.py")
    mod = importlib.util.module_from_spec(s)
    sys.modules["_gpu_orl.loss"] = mod
    s.loader.exec_module(mod)
    return mod.PolicyLoss


def token_log_probs(model, ids):
    logits = model(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def timed(fn, iters):
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise", "blockwise"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("needs a CUDA GPU with compute capability >= 8.9", file=sys.stderr)
        return 2
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fp8rl.backends.openrlhf.plugin import (
        PluginSpec,
        convert_trainer_model,
        make_policy_loss_class,
    )
    from fp8rl.quant.convert import fp8_disabled, fp8_layers

    torch.manual_seed(0)
    dev = torch.device("cuda")
    cfg = Qwen3Config(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                      num_key_value_heads=max(1, args.hidden // 512), head_dim=128, tie_word_embeddings=False)
    base = Qwen3ForCausalLM(cfg).to(dev, torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev)
    mask = torch.ones(args.batch, args.seq - 1, device=dev)
    adv = torch.randn(args.batch, 1, device=dev).expand(-1, args.seq - 1).contiguous()
    PolicyLoss = upstream_policy_loss()
    report = {"device": torch.cuda.get_device_name(), "model": {"layers": args.layers, "hidden": args.hidden},
              "shape": [args.batch, args.seq], "recipes": {}}
    with torch.no_grad():
        old = token_log_probs(base, ids)

    def ppo_step(model, loss_fn):
        model.zero_grad(set_to_none=True)
        lp = token_log_probs(model, ids)
        loss = loss_fn(lp, old, adv, mask)[0]
        loss.backward()
        return lp.detach(), loss.detach()

    vanilla = make_policy_loss_class(PolicyLoss, PluginSpec())(clip_eps_low=0.2, clip_eps_high=0.2)
    bf16_lp, bf16_loss = ppo_step(base, vanilla)
    bf16_grad = torch.cat([p.grad.float().flatten() for p in base.parameters() if p.grad is not None])
    t_bf16 = timed(lambda: ppo_step(base, vanilla), args.iters)
    ok = True
    for name in args.recipes:
        r: dict = {}
        try:
            model = convert_trainer_model(copy.deepcopy(base), name)
        except Exception as e:  # an unsupported recipe is reported, not hidden
            report["recipes"][name] = {"error": f"{type(e).__name__}: {e}"}
            ok = False
            continue
        r["fp8_linears"] = len(list(fp8_layers(model)))
        lp, loss = ppo_step(model, vanilla)
        grad = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        r["logprob_max_abs_err"] = float((lp - bf16_lp).abs().max())
        r["loss_rel_diff"] = float((loss - bf16_loss).abs() / bf16_loss.abs().clamp_min(1e-12))
        r["grad_cos"] = float(torch.nn.functional.cosine_similarity(grad, bf16_grad, dim=0))
        with torch.no_grad(), fp8_disabled(model):
            shadow_lp = token_log_probs(model, ids)
        r["shadow_max_abs_diff"] = float((shadow_lp - old).abs().max())
        # calibration step: one SGD step on both, then FP8 vs BF16-shadow ratios
        spec = PluginSpec(clip_method="calibrated", clip_options={"period": 1, "ema": 0.0, "init_bounds": [0.6, 1.8]})
        cal = make_policy_loss_class(PolicyLoss, spec)(clip_eps_low=0.2, clip_eps_high=0.2)
        with torch.no_grad():
            for prm in model.parameters():
                if prm.grad is not None:
                    prm.add_(prm.grad, alpha=-1e-3)
            with fp8_disabled(model):
                s_cur = token_log_probs(model, ids)
        cal.pending_shadow = torch.exp((s_cur - old).clamp(-20, 20))
        ppo_step(model, cal)
        r["calibration"] = {k: float(v) for k, v in cal.last_metrics.items() if k.startswith(("clip/", "shadow/"))}
        t = timed(lambda m=model: ppo_step(m, vanilla), args.iters)
        r["step_s_fp8"], r["step_s_bf16"], r["step_time_ratio_fp8_over_bf16"] = t, t_bf16, t / t_bf16
        r["ok"] = (r["shadow_max_abs_diff"] <= MAX_SHADOW_DIFF and r["grad_cos"] >= MIN_GRAD_COS
                   and r["loss_rel_diff"] <= MAX_LOSS_REL)
        ok &= r["ok"]
        report["recipes"][name] = r
        del model
        torch.cuda.empty_cache()
    text = json.dumps(report, indent=2)
    print(text)
    out = args.out or (os.path.join(os.environ["OUT"], "gpu_openrlhf_plugin.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
