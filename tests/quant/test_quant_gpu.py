"""GPU-only: FP8 kernels against our emulation (benchmarks/gpu_fp8_linear.py --check-only)."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _bench_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_fp8_linear.py"
    spec = importlib.util.spec_from_file_location("gpu_fp8_linear", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fp8_kernels_match_emulation_on_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 kernels need compute capability >= 8.9")
    rows = _bench_module().main(["--check-only", "--recipes", "tensorwise", "rowwise", "blockwise"])
    for row in rows:
        assert "error" not in row["check"], row
        assert row["check"]["max_rel_err"] < 2e-2, row


def test_our_linear_runs_on_gpu_with_scaled_mm():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 kernels need compute capability >= 8.9")
    from fp8rl.quant import RECIPES, fp8_linear

    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16) / 512**0.5
    for name in ("tensorwise", "rowwise"):
        kern = fp8_linear(x, w, None, RECIPES[name], emulate=False)
        emu = fp8_linear(x, w, None, RECIPES[name], emulate=True)
        assert (kern.float() - emu.float()).abs().max() <= 1e-2 * emu.float().abs().max()
