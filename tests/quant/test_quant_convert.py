"""Recipes, model conversion, the hardware check and fp8_disabled (the BF16 shadow pass)."""

import copy

import pytest
import torch
from torch import nn

from fp8rl.quant import (
    E4M3,
    E5M2,
    RECIPES,
    Fp8UnsupportedError,
    OperandConfig,
    PerBlock,
    PerTensor,
    Recipe,
    check_supported,
    convert_to_fp8,
    fp8_disabled,
    fp8_layers,
    get_recipe,
    to_torchao_config,
)
from fp8rl.quant.audit import build_tiny_qwen3
from fp8rl.registry import RegistryError

# delayed scaling has no emulation (Transformer Engine only: tests/quant/test_quant_te.py)
FP8_NAMES = [n for n in RECIPES if n != "bf16" and RECIPES[n].scaling == "dynamic"]


def _impls(name):
    return ["torchao", "fp8rl"] if RECIPES[name].impl == "torchao" else ["fp8rl"]


CASES = [(n, impl) for n in FP8_NAMES for impl in _impls(n)]


# ---------------------------------------------------------------- recipes


def test_registry_has_the_paper_arms():
    assert set(RECIPES) == {"bf16", "tensorwise", "tensorwise_delayed", "rowwise", "rowwise_with_gw_hp",
                            "blockwise", "mxfp8", "nvfp4", "nvfp4_rn", "w4a16", "mxfp4", "mxfp6"}
    with pytest.raises(RegistryError, match="valid names are: bf16, blockwise"):
        RECIPES["block"]


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_torchao_config_equals_upstream_recipe(name):
    # Fails loudly if torchao's recipe definitions move (pinned torchao==0.18.0).
    from torchao.float8.config import Float8LinearConfig

    assert to_torchao_config(RECIPES[name]) == Float8LinearConfig.from_recipe_name(name)


def test_torchao_config_rejects_block_scales():
    with pytest.raises(ValueError, match="impl='fp8rl'"):
        to_torchao_config(RECIPES["blockwise"])


def test_hybrid_switches_grad_format_and_name():
    rw = RECIPES["rowwise"]
    assert not rw.hybrid and RECIPES["tensorwise"].hybrid
    h = get_recipe("rowwise", hybrid=True)
    assert h.hybrid and h.short_str() == "rowwise_hybrid"
    assert h.grad_output.fmt == E5M2 and h.input.fmt == E4M3
    assert get_recipe("rowwise", hybrid=False) is rw
    assert get_recipe("tensorwise", hybrid=False).short_str() == "tensorwise_e4m3g"
    assert get_recipe("bf16", hybrid=True) is RECIPES["bf16"]


def test_recipe_operands_and_validation():
    gw = RECIPES["rowwise_with_gw_hp"]
    assert gw.operands("dgrad")[1].granularity == PerTensor()
    assert not gw.wgrad and "wgrad: high precision" in gw.describe()
    assert RECIPES["blockwise"].operands("fprop")[1].granularity == PerBlock(128, 128)
    with pytest.raises(ValueError, match="operand has no config"):
        Recipe("broken", input=OperandConfig(PerTensor()), fprop=True)
    with pytest.raises(TypeError, match="Granularity instance"):
        OperandConfig(PerTensor)  # the class, not an instance
    with pytest.raises(ValueError, match="unknown GEMM"):
        gw.operands("fwd")


# ---------------------------------------------------------------- hardware check


def test_check_supported_cpu_rules():
    for name in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        check_supported(RECIPES[name], impl="torchao", device_type="cpu")
    for name in ("blockwise", "mxfp8"):
        with pytest.raises(Fp8UnsupportedError, match=r"fp8\.emulate=true.*emulate=True"):
            check_supported(RECIPES[name], impl="fp8rl", device_type="cpu")
        check_supported(RECIPES[name], impl="fp8rl", device_type="cpu", emulate=True)
    check_supported(RECIPES["bf16"], impl="none", device_type="mps")


def test_check_supported_cuda_capability_is_an_argument():
    check_supported(RECIPES["tensorwise"], impl="torchao", device_type="cuda", capability=(9, 0))
    with pytest.raises(Fp8UnsupportedError, match=r"capability >= 8\.9.*emulate=True"):
        check_supported(RECIPES["tensorwise"], impl="torchao", device_type="cuda", capability=(8, 0))
    with pytest.raises(Fp8UnsupportedError, match="PerBlock"):
        check_supported(RECIPES["blockwise"], impl="fp8rl", device_type="cuda", capability=(9, 0))
    with pytest.raises(Fp8UnsupportedError, match="'mps'"):
        check_supported(RECIPES["rowwise"], impl="fp8rl", device_type="mps")


def test_convert_raises_naming_the_fix_on_cpu():
    with pytest.raises(Fp8UnsupportedError, match="emulate=True"):
        convert_to_fp8(build_tiny_qwen3(layers=1), "blockwise")


# ---------------------------------------------------------------- conversion


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_qwen3(seed=0, layers=2)


def _ids(vocab=64, seed=0):
    return torch.randint(0, vocab, (4, 24), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("name", "impl"), CASES)
def test_default_filter_keeps_lm_head_and_converts_the_rest(tiny, name, impl):
    model = convert_to_fp8(copy.deepcopy(tiny), name, impl=impl, emulate=True, seed=0)
    converted = {f for f, m in model.named_modules() if m in fp8_layers(model)}
    assert "lm_head" not in converted and type(model.lm_head) is nn.Linear
    assert len(converted) == 2 * 7  # q, k, v, o, gate, up, down per layer
    with pytest.raises(ValueError, match="already has FP8 layers"):
        convert_to_fp8(model, name, impl=impl, emulate=True, seed=0)


@pytest.mark.parametrize(("name", "impl"), CASES)
def test_fp8_disabled_equals_unconverted_model_exactly(tiny, name, impl):
    ids = _ids()
    ref_model = copy.deepcopy(tiny)
    model = convert_to_fp8(copy.deepcopy(tiny), name, impl=impl, emulate=True, seed=0)
    with torch.no_grad():
        ref = ref_model(input_ids=ids).logits
        fp8 = model(input_ids=ids).logits
        with fp8_disabled(model):
            off = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert torch.equal(off, ref)
    assert not torch.equal(fp8, ref)  # FP8 was on outside the block ...
    assert torch.equal(again, fp8)  # ... and is on again after it


def test_fp8_disabled_with_autograd_matches_unconverted_grads(tiny):
    ids = _ids()
    ref_model = copy.deepcopy(tiny)
    model = convert_to_fp8(copy.deepcopy(tiny), "tensorwise", emulate=False)
    ref_model(input_ids=ids).logits.logsumexp(-1).mean().backward()
    with fp8_disabled(model):
        model(input_ids=ids).logits.logsumexp(-1).mean().backward()
    for (n, p), (_, q) in zip(ref_model.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


def test_fp8_disabled_is_reentrant_and_exception_safe(tiny):
    ids = _ids()
    model = convert_to_fp8(copy.deepcopy(tiny), "rowwise", emulate=True)
    with torch.no_grad():
        fp8 = model(input_ids=ids).logits
        with fp8_disabled(model):
            off = model(input_ids=ids).logits
            with fp8_disabled(model):
                assert torch.equal(model(input_ids=ids).logits, off)
            assert torch.equal(model(input_ids=ids).logits, off)  # inner exit keeps FP8 off
        with pytest.raises(RuntimeError, match="boom"), fp8_disabled(model):
            raise RuntimeError("boom")
        assert torch.equal(model(input_ids=ids).logits, fp8)
    for m in fp8_layers(model):
        assert "forward" not in m.__dict__ and not any("depth" in k for k in m.__dict__)


def test_bf16_recipe_convert_and_disable_are_no_ops(tiny):
    ids = _ids()
    model = copy.deepcopy(tiny)
    modules_before = list(model.modules())
    assert convert_to_fp8(model, "bf16") is model
    assert list(model.modules()) == modules_before and fp8_layers(model) == []
    with torch.no_grad():
        ref = tiny(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, ref)
        with fp8_disabled(model):
            assert torch.equal(model(input_ids=ids).logits, ref)


def test_bf16_model_shadow_pass_stays_bf16(tiny):
    """The shadow of a BF16 model computes in BF16: no FP8 GEMM runs, the output is BF16 and
    within BF16 rounding of the unconverted model's. Not bit-equal: the disabled FP8 layer's BF16
    GEMM and ``nn.Linear``'s may take different CPU kernels (oneDNN picks by ISA -- AMX, AVX512 --
    and by thread layout), which round differently; FP8 would differ far more."""
    from collections import Counter

    from fp8rl.backends.openrlhf.plugin.kernels import count_matmuls

    ids = _ids()
    ref_model = copy.deepcopy(tiny).to(torch.bfloat16)
    model = convert_to_fp8(copy.deepcopy(ref_model), "blockwise", emulate=True)
    calls = Counter()
    with torch.no_grad(), fp8_disabled(model), count_matmuls(calls):
        off = model(input_ids=ids).logits
    with torch.no_grad():
        ref = ref_model(input_ids=ids).logits
        fp8 = model(input_ids=ids).logits
    assert off.dtype == torch.bfloat16 and not any(k.startswith("_scaled_mm") for k in calls)
    assert sum(calls.values()) > 0
    err, fp8_err = (off.float() - ref.float()).abs().max(), (fp8.float() - ref.float()).abs().max()
    assert err <= 0.05 * ref.float().abs().max()
    assert err < fp8_err  # the check can tell BF16 from FP8


def test_custom_module_filter_replaces_default(tiny):
    model = convert_to_fp8(copy.deepcopy(tiny), "rowwise", module_filter=lambda m, fqn: fqn.endswith("down_proj"))
    assert len(fp8_layers(model)) == 2
