"""The start-up refusal of FP8 cells on GPUs without FP8 tensor cores (``plugin.fp8_rollout``).

Below compute capability 8.9 vLLM 0.29 runs ``fp8_per_tensor`` / ``fp8_per_block`` as weight-only
FP8 (Marlin W8A16) without an error: not the paper's W8A8 rollout. The checks are pure (devices
are ``(name, (major, minor))`` tuples), and ``binding.install_driver`` runs them on the node's GPUs
before it touches any engine, which is tested with ``torch.cuda`` reporting stand-in GPUs.
"""

from __future__ import annotations

import sys

import pytest

from fp8rl.backends.openrlhf.plugin.fp8_rollout import (
    check_cell_hardware,
    check_node_hardware,
    check_rollout_hardware,
    check_rollout_recipe,
)
from fp8rl.backends.openrlhf.plugin.spec import PluginSpec
from fp8rl.quant.modules import Fp8UnsupportedError

A100 = ("NVIDIA A100-SXM4-80GB", (8, 0))
V100 = ("Tesla V100-SXM2-32GB", (7, 0))
T4 = ("Tesla T4", (7, 5))
L40S = ("NVIDIA L40S", (8, 9))
H100 = ("NVIDIA H100 80GB HBM3", (9, 0))
H200 = ("NVIDIA H200", (9, 0))
B200 = ("NVIDIA B200", (10, 0))
FP8_ROLLOUTS = ("tensorwise", "rowwise", "blockwise")


def cell(fp8: str) -> PluginSpec:
    """The plugin spec of a cell of arm ``fp8`` (sweeps/fp8/<fp8>.yaml)."""
    rollout, trainer = {"bf16": ("bf16", "bf16"), "rollout_only": ("tensorwise", "bf16"),
                        "tensorwise_delayed": ("tensorwise", "tensorwise_delayed")}.get(fp8, (fp8, fp8))
    return PluginSpec(rollout_recipe=rollout, trainer_recipe=trainer)


@pytest.mark.parametrize("gpu", [A100, V100, T4], ids=["A100", "V100", "T4"])
@pytest.mark.parametrize("recipe", FP8_ROLLOUTS)
def test_fp8_rollout_refused_below_sm89_naming_the_gpu_and_the_fix(gpu, recipe):
    name, (major, minor) = gpu
    with pytest.raises(Fp8UnsupportedError) as e:
        check_rollout_hardware(recipe, [gpu] * 4)
    msg = str(e.value)
    assert f"GPU 0-3 ({name}, sm{major}{minor}) lacks them" in msg
    assert f"fp8.rollout_recipe={recipe!r}" in msg and "compute capability >= 8.9" in msg
    assert "L40S, H100, H200, B200" in msg and "W8A16" in msg  # what it needs, what would happen
    assert "bf16 arm (fp8=bf16)" in msg and "partition or constraint" in msg  # what to do
    assert "blockwise training needs sm90+, mxfp8 sm100" in msg  # which recipes need more
    with pytest.raises(Fp8UnsupportedError, match=name):  # the whole cell, as install_driver checks it
        check_cell_hardware(cell(recipe), [gpu])


@pytest.mark.parametrize("gpu", [L40S, H100, H200, B200], ids=["L40S", "H100", "H200", "B200"])
@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise", "rollout_only", "tensorwise_delayed"])
def test_sm89_and_newer_run_tensorwise_and_rowwise_cells(gpu, fp8):
    check_rollout_hardware(cell(fp8).rollout_recipe, [gpu] * 8)
    check_cell_hardware(cell(fp8), [gpu] * 8)  # trainer: torchao (or TE delayed) from sm89


def test_blockwise_rolls_out_from_sm89_but_trains_from_sm90_only():
    check_rollout_hardware("blockwise", [L40S])  # vLLM's block W8A8 (Triton) runs on Ada
    with pytest.raises(Fp8UnsupportedError) as e:
        check_cell_hardware(cell("blockwise"), [L40S] * 2)
    msg = str(e.value)
    assert "fp8.trainer_recipe='blockwise' (transformer_engine)" in msg and "GPU 0-1 (NVIDIA L40S, sm89)" in msg
    assert ">= 9.0" in msg and "Float8BlockScaling" in msg
    for gpu in (H100, H200, B200):
        check_cell_hardware(cell("blockwise"), [gpu] * 8)
    with pytest.raises(Fp8UnsupportedError, match=r"10\.x"):  # mxfp8 trains on Blackwell only
        check_cell_hardware(PluginSpec(trainer_recipe="mxfp8"), [H100])
    check_cell_hardware(PluginSpec(trainer_recipe="mxfp8"), [B200])
    with pytest.raises(ValueError, match="supported FP8 rollout recipes"):  # no vLLM method at all
        check_rollout_hardware("mxfp8", [B200])
    assert check_rollout_recipe("blockwise") is None


@pytest.mark.parametrize("gpu", [A100, V100, T4, L40S, H100], ids=["A100", "V100", "T4", "L40S", "H100"])
def test_bf16_rollout_is_never_refused(gpu):
    check_rollout_hardware("bf16", [gpu] * 8)
    check_cell_hardware(cell("bf16"), [gpu] * 8)
    check_node_hardware(cell("bf16"), [gpu])


def test_mixed_node_is_refused_naming_the_bad_device_only():
    node = [H100] * 5 + [A100, H100, T4]
    with pytest.raises(Fp8UnsupportedError) as e:
        check_rollout_hardware("tensorwise", node)
    msg = str(e.value)
    assert f"GPU 5 ({A100[0]}, sm80), GPU 7 ({T4[0]}, sm75) lacks them" in msg
    assert H100[0] not in msg
    with pytest.raises(Fp8UnsupportedError, match=r"GPU 5 \(NVIDIA A100"):
        check_cell_hardware(cell("rowwise"), node)
    check_cell_hardware(cell("tensorwise"), [H100] * 7 + [L40S])


def _fake_cuda(monkeypatch, devices, available=True):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: devices[i][0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: devices[i][1])


def _stand_in_modules():
    class FakeActor:
        @staticmethod
        def options(**opts):
            return FakeActor

        @staticmethod
        def remote(**kw):
            return kw

    class Group:
        def async_init_model_from_pretrained(self, *a, **k):
            return []

    vllm_engine, launcher, ppo_actor = type(sys)("vllm_engine"), type(sys)("launcher"), type(sys)("ppo_actor")
    vllm_engine.RolloutRayActor = FakeActor
    launcher.RayActorGroup, ppo_actor.PolicyModelActor = Group, object
    return {"vllm_engine": vllm_engine, "launcher": launcher, "ppo_actor": ppo_actor}, FakeActor


def test_install_driver_refuses_an_a100_node_before_building_anything(monkeypatch):
    """The driver's ``install_driver`` reads the node's GPUs with torch.cuda and refuses there."""
    from fp8rl.backends.openrlhf.plugin.binding import install_driver

    _fake_cuda(monkeypatch, [A100] * 8)
    modules, actor = _stand_in_modules()
    with pytest.raises(Fp8UnsupportedError, match=r"GPU 0-7 \(NVIDIA A100-SXM4-80GB, sm80"):
        install_driver(cell("tensorwise"), modules=modules)
    assert modules["vllm_engine"].RolloutRayActor is actor  # no engine kwargs were injected
    assert "_fp8rl_originals" not in vars(modules["launcher"].RayActorGroup)
    install_driver(cell("bf16"), modules=modules)  # a BF16 cell runs on A100s

    _fake_cuda(monkeypatch, [H100] * 8)
    modules, actor = _stand_in_modules()
    install_driver(cell("tensorwise"), modules=modules)
    assert modules["vllm_engine"].RolloutRayActor.options().remote(model="m")["quantization"] == "fp8_per_tensor"


def test_install_driver_does_not_refuse_without_cuda(monkeypatch):
    """CPU smoke runs: no CUDA at all, nothing to check (and no device is queried)."""
    import torch

    from fp8rl.backends.openrlhf.plugin.binding import install_driver

    _fake_cuda(monkeypatch, [], available=False)

    def boom(*a):
        raise AssertionError("no device may be queried without CUDA")

    monkeypatch.setattr(torch.cuda, "get_device_name", boom)
    modules, _ = _stand_in_modules()
    install_driver(cell("tensorwise"), modules=modules)


def test_refusal_is_quoted_whole_into_the_failed_reason(tmp_path):
    """run.plugin_error quotes the driver log's Fp8UnsupportedError line into status.json's reason."""
    from fp8rl.backends.openrlhf.run import PLUGIN_ERRORS, plugin_error

    node = [V100, A100, T4, L40S, H100, H200, A100, V100]  # a worst case for the message's length
    with pytest.raises(Fp8UnsupportedError) as e:
        check_rollout_hardware("blockwise", node)
    log = tmp_path / "driver.1.log"
    log.write_text("[fp8rl driver] logging\nTraceback (most recent call last):\n"
                   '  File "driver.py", line 73, in main\n'
                   f"fp8rl.quant.modules.Fp8UnsupportedError: {e.value}\n", encoding="utf-8")
    assert "Fp8UnsupportedError" in PLUGIN_ERRORS
    assert plugin_error(log) == f"Fp8UnsupportedError: {e.value}"  # whole: under the 500-character cap
