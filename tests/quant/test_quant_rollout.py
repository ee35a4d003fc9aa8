"""Rollout FP8 weights: vLLM fp8 checkpoint layout, W8A8 inference linear, weight sync."""

import copy

import pytest
import torch
from torch import nn

from fp8rl.quant import (
    RECIPES,
    Fp8InferenceLinear,
    Fp8UnsupportedError,
    convert_for_rollout,
    convert_to_fp8,
    dequantize,
    fp8_mm,
    quantize_for_rollout,
    rollout_quant_config,
    sync_rollout_weights,
)
from fp8rl.quant.audit import build_tiny_qwen3


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_qwen3(seed=0, layers=1)


def test_tensorwise_layout_matches_vllm_fp8(tiny):
    sd = tiny.state_dict()
    out, cfg = quantize_for_rollout(sd, "tensorwise")
    assert cfg == {"quant_method": "fp8", "activation_scheme": "dynamic"}
    key = "model.layers.0.self_attn.q_proj"
    w, q, s = sd[f"{key}.weight"], out[f"{key}.weight"], out[f"{key}.weight_scale"]
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == ()
    # weight_scale is the dequantization multiplier amax / 448
    assert torch.isclose(s, w.abs().max() / 448, rtol=1e-6)
    assert f"{key}.input_scale" not in out  # dynamic activation scales
    # embeddings, norms and the LM head pass through unquantized
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert out[k] is sd[k]


def test_blockwise_layout_weight_scale_inv_is_the_dequant_multiplier():
    w = torch.randn(300, 200)
    out, cfg = quantize_for_rollout({"mlp.up_proj.weight": w}, "blockwise")
    assert cfg == {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    s = out["mlp.up_proj.weight_scale_inv"]
    assert s.shape == (3, 2) and s.dtype == torch.float32  # [ceil(N/128), ceil(K/128)]
    assert torch.isclose(s[0, 0], w[:128, :128].abs().max() / 448, rtol=1e-6)
    assert torch.isclose(s[2, 1], w[256:, 128:].abs().max() / 448, rtol=1e-6)  # ragged corner
    # Naming trap: vLLM multiplies by weight_scale_inv at dequantization (w ~= q * s).
    q = out["mlp.up_proj.weight"].float()
    deq = q * s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert (deq - w).abs().max() < 0.07 * w.abs().max()


def test_other_recipes_layout_and_bf16_passthrough():
    sd = {"a.weight": torch.randn(64, 96), "a.bias": torch.randn(64)}
    out, cfg = quantize_for_rollout(sd, "rowwise")
    assert out["a.weight_scale"].shape == (64, 1) and cfg["fp8rl_weight_granularity"] == "row"
    out, cfg = quantize_for_rollout(sd, "mxfp8")
    assert out["a.weight_scale_inv"].shape == (64, 3) and cfg["fp8rl_weight_granularity"] == "mx32"
    out, cfg = quantize_for_rollout(sd, "bf16")
    assert cfg is None and out == sd
    assert rollout_quant_config("bf16") is None
    out, _ = quantize_for_rollout(sd, "tensorwise", linear_names=set())
    assert out["a.weight"] is sd["a.weight"]


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
def test_inference_linear_is_w8a8_with_dynamic_activation_scales(name):
    recipe = RECIPES[name]
    torch.manual_seed(0)
    lin = nn.Linear(160, 96)
    inf = Fp8InferenceLinear.from_linear(lin, recipe, emulate=True)
    x = torch.randn(2, 7, 160)
    ref = fp8_mm(x.reshape(-1, 160), recipe.input, lin.weight.detach(), recipe.weight,
                 pow2_scales=recipe.pow2_scales, emulate=True) + lin.bias.detach()
    assert torch.allclose(inf(x).reshape(-1, 96), ref, rtol=0, atol=1e-6)
    # the stored weight dequantizes to the layer's weight within FP8 precision
    w = dequantize(inf.weight, inf.scale, recipe.weight.granularity)
    assert (w - lin.weight).abs().max() < 0.07 * lin.weight.abs().max()
    # state_dict is the vLLM layout and loads back into a fresh layer
    fresh = Fp8InferenceLinear(160, 96, recipe=recipe, bias=True, emulate=True)
    fresh.load_state_dict(inf.state_dict())
    assert torch.equal(fresh(x), inf(x))


def test_convert_and_sync_rollout_model(tiny):
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    rollout = convert_for_rollout(copy.deepcopy(tiny), "tensorwise")
    assert isinstance(rollout.model.layers[0].mlp.down_proj, Fp8InferenceLinear)
    assert type(rollout.lm_head) is nn.Linear
    # trainer: FP8-converted (torchao), takes a step; the sync must quantize its new weights
    trainer = convert_to_fp8(copy.deepcopy(tiny), "tensorwise")
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    sync_rollout_weights(rollout, trainer.state_dict(), "tensorwise")
    # expectation: an unconverted copy holding the trainer's weights, converted for rollout
    plain = copy.deepcopy(tiny)
    plain.load_state_dict(trainer.state_dict())
    expected = convert_for_rollout(plain, "tensorwise")
    # converting a copy of the FP8 trainer itself gives the same rollout model
    from_trainer = convert_for_rollout(copy.deepcopy(trainer), "tensorwise")
    with torch.no_grad():
        assert torch.equal(rollout(input_ids=ids).logits, expected(input_ids=ids).logits)
        assert torch.equal(from_trainer(input_ids=ids).logits, expected(input_ids=ids).logits)
    with pytest.raises(ValueError, match="not 'blockwise'"):
        sync_rollout_weights(rollout, trainer.state_dict(), "blockwise")
    with pytest.raises(KeyError, match="lacks"):
        sync_rollout_weights(rollout, {"lm_head.weight": tiny.lm_head.weight})


def test_rollout_bf16_is_plain_copy_and_block_needs_emulate(tiny):
    rollout = convert_for_rollout(copy.deepcopy(tiny), "bf16")
    assert not any(isinstance(m, Fp8InferenceLinear) for m in rollout.modules())
    with pytest.raises(Fp8UnsupportedError, match="emulate=True"):
        convert_for_rollout(copy.deepcopy(tiny), "blockwise")
    convert_for_rollout(copy.deepcopy(tiny), "blockwise", emulate=True)


@pytest.mark.parametrize("name", ["tensorwise", "blockwise"])
def test_inference_linear_weight_cache_is_bit_identical_and_follows_the_buffers(name):
    """The emulated forward dequantizes the weight once per weight version: equal bit for bit to
    ``scaled_gemm`` on the buffers, and refreshed by ``load_hp_weight`` / ``load_state_dict``."""
    from fp8rl.quant.linear import scaled_gemm
    from fp8rl.quant.quantize import quantize

    recipe = RECIPES[name]
    torch.manual_seed(0)
    lin, other = nn.Linear(160, 96), nn.Linear(160, 96)
    inf = Fp8InferenceLinear.from_linear(lin, recipe, emulate=True)
    x = torch.randn(5, 160)

    def reference(layer):
        qx, sx = quantize(x, recipe.input.granularity, recipe.input.fmt, pow2_scale=recipe.pow2_scales)
        return scaled_gemm(qx, sx, recipe.input.granularity, layer.weight, layer.scale,
                           recipe.weight.granularity, out_dtype=torch.float32, emulate=True) + layer.bias

    assert torch.equal(inf(x), reference(inf))
    assert torch.equal(inf(x), reference(inf))  # cached path
    inf.load_hp_weight(other.weight, other.bias)  # a sync: in-place copy into the buffers
    assert torch.equal(inf(x), reference(inf))
    assert torch.equal(inf(x), Fp8InferenceLinear.from_linear(other, recipe, emulate=True)(x))
    inf.load_state_dict(Fp8InferenceLinear.from_linear(lin, recipe, emulate=True).state_dict())
    assert torch.equal(inf(x), reference(inf))
    assert not torch.equal(inf(x), Fp8InferenceLinear.from_linear(other, recipe, emulate=True)(x))
