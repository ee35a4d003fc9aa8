"""One-GPU smoke test of the paper-scale actor: ZeRO-3 steps of the FP8-converted model, FP8 vs BF16.

    python benchmarks/gpu_paper_smoke.py [--recipes tensorwise blockwise] [--out report.json]
    python benchmarks/gpu_paper_smoke.py --dry-run     # CPU: the same path on a tiny model, no timings
    python benchmarks/gpu_paper_smoke.py --whole-job   # make paper-smoke's job on one GPU (cluster extra)

What the OpenRLHF plugin does to the policy, without OpenRLHF around it (the integration tier runs
it inside OpenRLHF's own actor on CPU; this settles what only a GPU can): a random
Qwen3-architecture model is written as a BF16 checkpoint, then per recipe (``bf16`` first):

1. loaded under DeepSpeed ZeRO-3 the way ``openrlhf.models.Actor`` loads it
   (``HfDeepSpeedConfig`` -> ``from_pretrained`` partitions the parameters at creation);
2. converted with ``plugin.fp8_training.convert_trainer_model`` and checked with
   ``require_conversion`` -- exactly what ``DeepspeedStrategy._ds_init_train_model`` does in the
   binding -- and its parameter names compared with the BF16 model's (the weight sync sends
   parameters by name: Transformer Engine layers must not add or rename any);
3. wrapped by ``deepspeed.initialize`` (ZeRO-3, bf16, AdamW, gradient clipping 1.0);
4. trained for ``--warmup + --iters`` steps of a token-mean PPO loss (``fp8rl.rl.policy_loss``)
   on random tokens and advantages; step time = median over ``--iters`` (forward + backward +
   optimizer step, CUDA-synchronized);
5. checked: the loss is finite, the parameters moved, the log-probs at step 0 are close to BF16's
   (``MAX_LOGPROB_ERR``), and the BF16 shadow (``fp8_disabled``) reproduces the BF16 model's
   step-0 log-probs (``MAX_SHADOW_DIFF``).

Recipes use their paper-scale implementation (``fp8.impl=auto``: torchao for tensorwise/rowwise,
Transformer Engine for blockwise); a recipe whose implementation cannot load (e.g. Transformer
Engine not installed) is reported with its error and the run exits 1. ``--emulate-block`` runs
block/MX recipes with the emulated ``Fp8Linear`` instead (correctness only: no speed meaning).

Needs torch, transformers, deepspeed (``DS_BUILD_OPS=0`` is enough), torchao and this repository;
Transformer Engine for blockwise. Writes a JSON report (``--out``; default
``$OUT/gpu_paper_smoke.json`` when ``$OUT`` is set) and prints it. Exit codes: 0 all checks
passed, 1 a check failed or a recipe could not run, 2 no suitable GPU (without ``--dry-run``).

**Not run yet**: no GPU was lent to the session that wrote it; ``--dry-run`` runs on CPU in the
integration tier (``tests/integration/test_int_gpu_smoke.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MAX_LOGPROB_ERR = 0.5     # |FP8 - BF16| token log-prob at step 0, mean over tokens (nats)
MAX_SHADOW_DIFF = 1e-2    # fp8_disabled vs the BF16 model at step 0, max over tokens (nats)


def ds_config(zero_stage: int, lr: float) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "bf16": {"enabled": True}, "zero_optimization": {"stage": zero_stage, "overlap_comm": False},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "wall_clock_breakdown": False, "steps_per_print": 10**9,
    }


def write_checkpoint(path: Path, a) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // a.head_dim,
                      num_key_value_heads=max(1, a.hidden // a.head_dim // 4), head_dim=a.head_dim,
                      tie_word_embeddings=False, max_position_embeddings=max(4096, a.seq))
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def token_log_probs(model, ids):
    import torch

    logits = model(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def run_recipe(recipe: str, ckpt: Path, a, device, data, bf16_ref) -> dict:
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    from fp8rl.backends.openrlhf.plugin.fp8_training import (
        convert_trainer_model,
        count_fp8_layers,
        require_conversion,
    )
    from fp8rl.backends.openrlhf.plugin.spec import PluginSpec
    from fp8rl.quant.convert import fp8_disabled
    from fp8rl.quant.recipes import get_recipe
    from fp8rl.rl.aggregation import aggregate
    from fp8rl.rl.policy_loss import ppo_token_loss

    block = get_recipe(recipe).enabled and recipe not in ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    emulate = bool(a.dry_run or (a.emulate_block and block))
    spec = PluginSpec(trainer_recipe=recipe, trainer_impl="fp8rl" if (emulate and block) else "auto",
                      trainer_emulate=emulate and block)
    cfg = ds_config(3, a.lr)
    dschf = HfDeepSpeedConfig(cfg)  # noqa: F841  (must stay alive: from_pretrained partitions under it)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16, attn_implementation="sdpa")
    names_before = [n for n, _ in model.named_parameters()]
    out: dict = {"impl": spec.trainer_impl, "emulate": spec.trainer_emulate}
    convert_trainer_model(model, spec)
    out["fp8_layers"] = count_fp8_layers(model)
    require_conversion(spec, out["fp8_layers"], "gpu_paper_smoke")
    out["param_names_unchanged"] = [n for n, _ in model.named_parameters()] == names_before
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg)
    ids, old, adv, mask = data
    first = {}
    with torch.no_grad():
        first["lp"] = token_log_probs(engine, ids)
        with fp8_disabled(engine.module):
            first["shadow"] = token_log_probs(engine, ids)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())[:4]):
        before = [p.detach().float().clone() for p in list(engine.module.parameters())[:4]]
    times, losses = [], []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(a.warmup + a.iters):
        sync()
        t0 = time.perf_counter()
        lp = token_log_probs(engine, ids)
        loss_mat, _ = ppo_token_loss(lp, old, adv, mask, low=0.8, high=1.28)
        loss = aggregate(loss_mat, mask, "token-mean")
        engine.backward(loss)
        engine.step()
        sync()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())[:4]):
        after = [p.detach().float() for p in list(engine.module.parameters())[:4]]
    out.update(step_s=statistics.median(times), losses=losses, loss_finite=all(map(lambda x: x == x, losses)),
               params_moved=any(not torch.equal(x, y) for x, y in zip(before, after, strict=True)))
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if bf16_ref is not None:
        out["logprob_err_mean"] = float((first["lp"] - bf16_ref).abs().mean())
        out["shadow_max_diff"] = float((first["shadow"] - bf16_ref).abs().max())
    out["_lp0"] = first["lp"]
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


#: The whole smoke job on one GPU machine (``--whole-job``): the CPU job's sweep with GPUs instead.
WHOLE_JOB = ["+sweep=paper_smoke", "scale=paper", "cluster=workstation", "gpus_per_node=1", "workers=1",
             "openrlhf.device=cuda", "openrlhf.gpu_memory_utilization=0.5"]


def whole_job(out: Path, dry_run: bool) -> int:
    """``make paper-smoke``'s job on this machine's first GPU (``cluster=workstation``), then the
    checks of its output (``tests/integration/test_int_paper_smoke.py``, partial: no interrupted
    cell). Needs the cluster extra (OpenRLHF, vLLM, DeepSpeed) installed."""
    import subprocess

    cmd = [sys.executable, "-m", "experiments.launch", *WHOLE_JOB, f"output_dir={out}",
           *(["dry_run=true"] if dry_run else [])]
    print(" ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=REPO).returncode
    if rc or dry_run:
        return rc
    env = {**os.environ, "FP8RL_PAPER_SMOKE_DIR": str(out / "paper_smoke"), "FP8RL_PAPER_SMOKE_PARTIAL": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "integration",
                           "tests/integration/test_int_paper_smoke.py", "-k", "not interrupted"], cwd=REPO,
                          env=env).returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--whole-job", action="store_true",
                   help="run the paper-smoke sweep on one GPU (cluster=workstation) and check its output")
    p.add_argument("--recipes", nargs="+", default=["tensorwise", "blockwise"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--emulate-block", action="store_true", help="block/MX recipes via the emulated Fp8Linear")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, emulated block recipes, no timings")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.whole_job:
        return whole_job(Path(a.out or os.environ.get("OUT", "runs")) / "gpu_smoke_runs", a.dry_run)
    if a.dry_run:
        os.environ["DS_ACCELERATOR"] = "cpu"
        a.layers, a.hidden, a.intermediate, a.head_dim, a.vocab = 2, 128, 256, 32, 64
        a.batch, a.seq, a.warmup, a.iters = 2, 32, 0, 2
    import torch

    if not a.dry_run and (not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9)):
        print("needs a CUDA GPU with compute capability >= 8.9 (or --dry-run)", file=sys.stderr)
        return 2
    import deepspeed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29512"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    device = torch.device("cpu") if a.dry_run else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="gloo" if a.dry_run else "nccl")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(device)
    mask = torch.ones(a.batch, a.seq - 1, device=device)
    adv = torch.randn(a.batch, 1, generator=g).to(device).expand(-1, a.seq - 1).contiguous()
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
                    "dry_run": a.dry_run, "model": {k: getattr(a, k) for k in ("layers", "hidden", "intermediate",
                                                                               "vocab", "batch", "seq")},
                    "zero_stage": 3, "recipes": {}}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        write_checkpoint(ckpt, a)
        old = None
        ref = None
        for recipe in ["bf16", *[r for r in a.recipes if r != "bf16"]]:
            try:
                if old is None:  # the BF16 model's log-probs are the "old" policy of every run
                    from transformers import AutoModelForCausalLM

                    base = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16,
                                                                attn_implementation="sdpa").to(device)
                    with torch.no_grad():
                        old = token_log_probs(base, ids)
                    del base
                res = run_recipe(recipe, ckpt, a, device, (ids, old, adv, mask), ref)
            except Exception as e:  # a recipe that cannot run is reported, and fails the run
                report["recipes"][recipe] = {"error": f"{type(e).__name__}: {e}"}
                ok = False
                continue
            lp0 = res.pop("_lp0")
            if recipe == "bf16":
                ref = lp0
            res["checks"] = {"fp8_layers": (res["fp8_layers"] > 0) == (recipe != "bf16"),
                             "param_names_unchanged": res["param_names_unchanged"],
                             "loss_finite": res["loss_finite"], "params_moved": res["params_moved"]}
            if recipe != "bf16":
                res["checks"]["logprob_err"] = res["logprob_err_mean"] <= MAX_LOGPROB_ERR
                res["checks"]["shadow_is_bf16"] = res["shadow_max_diff"] <= MAX_SHADOW_DIFF
                if not a.dry_run:
                    res["speedup_vs_bf16"] = report["recipes"]["bf16"]["step_s"] / res["step_s"]
            ok &= all(res["checks"].values())
            report["recipes"][recipe] = res
    report["passed"] = ok
    text = json.dumps(report, indent=2, default=float)
    print(text)
    out = a.out or (os.path.join(os.environ["OUT"], "gpu_paper_smoke.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
