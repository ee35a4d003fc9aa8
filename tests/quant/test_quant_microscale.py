"""FP4 / FP6 formats (E2M1, E2M3, E3M2) with MX (OCP E8M0) and NVFP4 (two-level) scaling, bit for
bit against an independent reference: every grid is enumerated here from its bit fields, and
round-to-nearest-even is found by brute force on that list in float64 (``fp8rl.quant.microscale``
documents the formulas)."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from microscale_reference import EMAX, GRIDS, assert_bits, f32, reference

from fp8rl.quant import MX, NonFiniteError, OperandConfig, PerRow, PerTensor, fake_quantize
from fp8rl.quant.formats import E2M1, E2M3, E3M2, E4M3
from fp8rl.quant.granularity import NVBlock
from fp8rl.quant.microscale import dequantize_microscaled, quantize_microscaled

CASES = [(MX(32), E2M1), (MX(32), E2M3), (MX(32), E3M2), (NVBlock(16), E2M1)]
IDS = ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "nvfp4"]

# ------------------------------------------------------------------ the grids


@pytest.mark.parametrize("fmt", [E2M1, E2M3, E3M2], ids=lambda f: f.name)
def test_code_table_and_max_match_the_bit_fields(fmt):
    vals = GRIDS[fmt.name]
    assert fmt.values().tolist() == vals + [-v for v in vals]
    assert fmt.max == vals[-1] == {"e2m1": 6.0, "e2m3": 7.5, "e3m2": 28.0}[fmt.name]
    assert fmt.emax == EMAX[fmt.name]


@pytest.mark.parametrize("fmt", [E2M1, E2M3, E3M2], ids=lambda f: f.name)
def test_mx_every_representable_value_is_kept(fmt):
    """A block holding max (so its E8M0 scale is 1) keeps every grid value, subnormals and -0."""
    vals = GRIDS[fmt.name]
    row = ([fmt.max] + vals + [-v for v in vals])
    row += [0.0] * (-len(row) % 32)
    x = torch.tensor([row[i : i + 32] for i in range(0, len(row), 32)], dtype=torch.float32)
    x[:, 0] = fmt.max
    assert_bits(fake_quantize(x, MX(32), fmt), x)


@pytest.mark.parametrize("fmt", [E2M1, E2M3, E3M2], ids=lambda f: f.name)
def test_mx_ties_round_to_even_and_saturate(fmt):
    vals = GRIDS[fmt.name]
    mids = [(a + b) / 2 for a, b in itertools.pairwise(vals)]
    near = [m * (1 + s * 2**-20) for m in mids for s in (-1, 1)]
    row = [fmt.max] + mids + near + [-m for m in mids] + [fmt.max * 1.03, -fmt.max * 1.3, fmt.max * 1.99]
    row += [0.0] * (-len(row) % 32)
    x = torch.tensor(row, dtype=torch.float32).reshape(-1, 32)
    x[:, 0] = fmt.max  # scale 1 in every block
    assert_bits(fake_quantize(x, MX(32), fmt), reference(x, MX(32), fmt))


def test_e2m1_ties_known_values():
    """Hand-checked: nearest-even on 0, 0.5, 1, 1.5, 2, 3, 4, 6 (even codes 0, 1, 2, 4, 6 =
    0, 1, 2, 4; odd 0.5, 1.5, 3, 6), saturation above 6, the tiny halfway value to 0."""
    x = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, 0.24, 0.26] + [0.0] * 20])
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, 0.0, 0.5] + [0.0] * 20
    assert_bits(fake_quantize(x, MX(32), E2M1), torch.tensor([want]))


def test_subnormals_of_e3m2_and_e2m3():
    """Below the smallest normal the step is the subnormal one (E3M2 1/16, E2M3 1/8)."""
    x = torch.tensor([[28.0, 0.0625, 0.03125, 0.09375, 0.1875, 0.03126] + [0.0] * 26])
    assert fake_quantize(x, MX(32), E3M2)[0, 1:6].tolist() == [0.0625, 0.0, 0.125, 0.1875, 0.0625]
    y = torch.tensor([[7.5, 0.125, 0.0625, 0.1875, 0.0626] + [0.0] * 27])
    assert fake_quantize(y, MX(32), E2M3)[0, 1:5].tolist() == [0.125, 0.0, 0.25, 0.125]


def test_mx_scale_is_the_spec_floor_rule():
    """E8M0 exponent floor(log2(amax)) - emax (OCP MX 6.3): amax 5.9 -> 2^0; 8 -> 2^1; and an amax
    just below a power of two saturates (7.99 in E2M1 -> 6) where the FP8 rule would not."""
    for amax, e in ((5.9, 0), (8.0, 1), (1.0, -2), (2.0**-130, -127)):
        mt = quantize_microscaled(torch.tensor([[amax] + [0.0] * 31]), MX(32), E2M1)
        assert mt.block_scale.item() == 2.0**e and mt.tensor_scale is None
    assert fake_quantize(torch.tensor([[7.99] + [0.0] * 31]), MX(32), E2M1)[0, 0].item() == 6.0


# ------------------------------------------------------------------ NVFP4


def test_nvfp4_two_level_scales():
    """s_t = amax / (448 * 6) in FP32; block scales E4M3 values of amax_b / (6 s_t); a tensor far
    from 1 in magnitude keeps ~E2M1 precision (a one-level E4M3 scale would under/overflow)."""
    torch.manual_seed(1)
    for mag in (1e-5, 1.0, 3e4):
        x = torch.randn(3, 48) * mag
        x[1] *= 50  # blocks of different magnitude under one tensor scale
        mt = quantize_microscaled(x, NVBlock(16), E2M1)
        assert mt.tensor_scale.item() == f32(float(x.abs().max()) / 2688.0)
        assert set(mt.block_scale.flatten().tolist()) <= set(GRIDS["e4m3"])
        assert mt.block_scale.max().item() == 448.0  # the block holding the tensor's amax
        assert_bits(fake_quantize(x, NVBlock(16), E2M1), reference(x, NVBlock(16), E2M1))
        rel = float((fake_quantize(x, NVBlock(16), E2M1) - x).norm() / x.norm())
        assert rel < 0.15


def test_nvfp4_block_whose_scale_underflows_is_zero():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 1000.0, 1e-6  # second block: s_b = 1e-6/(6 * 1000/2688) < E4M3's 2^-10
    out = fake_quantize(x, NVBlock(16), E2M1)
    assert out[0, 0].item() == 1000.0 and out[0, 16].item() == 0.0
    assert_bits(out, reference(x, NVBlock(16), E2M1))


# ------------------------------------------------------------------ random operands, codes, refusals


@pytest.mark.parametrize(("gran", "fmt"), CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_operands_bit_exact(gran, fmt, dtype):
    torch.manual_seed(0)
    for shape in ((4, 64), (3, 40), (2, 3, 24), (5, 7)):  # ragged edges, 3-D, a row shorter than a block
        x = (torch.randn(shape) * torch.logspace(-3, 2, shape[-1])).to(dtype)
        got = fake_quantize(x, gran, fmt)
        assert_bits(got, reference(x, gran, fmt))
        mt = quantize_microscaled(x, gran, fmt)
        assert mt.codes.dtype == torch.uint8 and int(mt.codes.max()) < 2**fmt.bits
        assert_bits(dequantize_microscaled(mt, gran, fmt), got)
        xt = x.reshape(-1, shape[-1]).t()  # a transposed (wgrad) operand: same values as a copy
        assert_bits(fake_quantize(xt, gran, fmt), fake_quantize(xt.contiguous(), gran, fmt))


@pytest.mark.parametrize(("gran", "fmt"), CASES, ids=IDS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_refused(gran, fmt, bad):
    x = torch.ones(2, 32)
    x[1, 5] = bad
    with pytest.raises(NonFiniteError, match=r"index \(1, 5\)"):
        fake_quantize(x, gran, fmt)
    with pytest.raises(NonFiniteError):
        quantize_microscaled(x, gran, fmt)


def test_invalid_pairs_and_the_fp8_entry_points_refuse():
    from fp8rl.quant import quantize

    with pytest.raises(ValueError, match="microscaling granularity"):
        OperandConfig(PerTensor(), E2M1)
    with pytest.raises(ValueError, match=r"NVBlock.*E2M1"):
        OperandConfig(NVBlock(16), E4M3)
    with pytest.raises(TypeError, match="quantize_microscaled"):
        quantize(torch.ones(2, 32), MX(32), E2M1)
    with pytest.raises(ValueError, match="pow2_scale"):
        fake_quantize(torch.ones(2, 32), MX(32), E2M1, pow2_scale=True)
    assert OperandConfig(PerRow(), E4M3)  # FP8 pairs unchanged


# ------------------------------------------------------------------ recipes, engines, config


def test_recipes_refuse_kernels_and_run_emulated():
    from fp8rl.quant import RECIPES, Fp8UnsupportedError, check_supported, convert_for_rollout
    from fp8rl.quant.audit import build_tiny_qwen3
    from fp8rl.quant.rollout import Fp8InferenceLinear, sync_rollout_weights

    for name in ("nvfp4", "nvfp4_rn", "w4a16", "mxfp4", "mxfp6"):
        assert RECIPES[name].microscaled and not RECIPES["mxfp8"].microscaled
        for dev, cap in (("cpu", None), ("cuda", (10, 0))):
            with pytest.raises(Fp8UnsupportedError, match=r"Blackwell.*fp8\.emulate=true"):
                check_supported(RECIPES[name], impl="fp8rl", device_type=dev, capability=cap)
    model = build_tiny_qwen3(hidden=64, layers=1)
    engine = convert_for_rollout(copy.deepcopy(model), "nvfp4", emulate=True)
    sync_rollout_weights(engine, model.state_dict(), "nvfp4")
    lin = engine.model.layers[0].self_attn.q_proj
    assert isinstance(lin, Fp8InferenceLinear) and lin.weight.dtype == torch.uint8
    w = model.model.layers[0].self_attn.q_proj.weight
    assert_bits(lin.dequantized_weight(), fake_quantize(w.detach(), NVBlock(16, rows=16), E2M1))  # 16x16 tiles
    assert set(engine.state_dict()) >= {"model.layers.0.self_attn.q_proj.weight_scale_2"}


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "mxfp6"])
def test_fp4_arms_validate(name):
    from fp8rl.config.fp8 import Fp8Config

    cfg = Fp8Config(name=name, rollout_recipe=name, trainer_recipe=name, emulate=True)
    assert cfg.trainer.microscaled
    with pytest.raises(ValueError, match=f"fp8.name={name!r}"):
        Fp8Config(name=name, rollout_recipe=name, trainer_recipe="tensorwise", emulate=True)


def test_paper_scale_rollout_refusal_names_gpu_and_versions():
    from fp8rl.backends.openrlhf.plugin.fp8_rollout import check_rollout_recipe

    with pytest.raises(ValueError, match=r"'nvfp4' \(FP4/FP6\).*Blackwell.*sm100.*vLLM 0\.29"):
        check_rollout_recipe("nvfp4")
