"""BF16 compute with fp32 masters: the GEMM arithmetic, gradients, FP8 layers and the shadow switch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fp8rl.quant import convert_to_fp8, fake_quantize, fp8_disabled, get_recipe
from fp8rl.quant.lowp import linear, matmul

BF16 = torch.bfloat16


def _data(m=96, k=160, n=72, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in BF16 units in the last place (both BF16)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ia - ib).abs()


def test_bf16_linear_is_bf16_inputs_fp32_accumulation_bf16_output():
    x, w, b = _data()
    xb = x.to(BF16)
    y = linear(xb, w, b)
    assert y.dtype == BF16
    # reference: the BF16 values of x and w, exact products and sums (float64), one rounding
    ref = (xb.double() @ w.to(BF16).double().t() + b.to(BF16).double()).to(BF16)
    d = _ulps(y, ref)
    assert int(d.max()) <= 1 and float((d > 0).float().mean()) < 0.02  # fp32 vs exact sums: rare ties
    assert not torch.equal(y.float(), (x @ w.t() + b))  # it is not the fp32 GEMM


def test_fp32_linear_and_matmul_are_plain_torch():
    x, w, b = _data()
    assert torch.equal(linear(x, w, b), nn.functional.linear(x, w, b))
    assert torch.equal(matmul(x, w.t()), x @ w.t())


def test_bf16_matmul_rounds_once_and_gradients_reach_fp32_masters():
    x, w, _ = _data()
    a, c = x.to(BF16), w.t().contiguous().to(BF16)
    out = matmul(a, c)
    assert out.dtype == BF16 and torch.equal(out, (a.float() @ c.float()).to(BF16))
    w = w.clone().requires_grad_(True)
    xb = x.to(BF16).requires_grad_(True)
    linear(xb, w, None).float().square().sum().backward()
    assert w.grad.dtype == torch.float32 and xb.grad.dtype == BF16
    assert torch.equal(w.grad, w.grad.to(BF16).float())  # the BF16 gradient, upcast


def test_weight_rounded_skips_the_cast_with_the_same_numbers():
    x, w, b = _data()
    xb = x.to(BF16)
    assert torch.equal(linear(xb, w.to(BF16).float(), b, weight_rounded=True), linear(xb, w, b))


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
def test_fp8_layer_in_bf16_quantizes_the_bf16_weight(name):
    """Under BF16 mixed precision an FP8 layer sees a BF16 weight: it quantizes from the
    master rounded to BF16 and writes BF16; with FP8 off it is the BF16 GEMM."""
    x, w, b = _data(k=256, n=128)
    lin = nn.Linear(256, 128)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    recipe = get_recipe(name)
    model = convert_to_fp8(nn.Sequential(copy.deepcopy(lin)), recipe, emulate=True,
                           module_filter=lambda m, f: isinstance(m, nn.Linear))
    xb = x.to(BF16)
    y = model(xb)
    assert y.dtype == BF16
    ci, cw = recipe.operands("fprop")
    divide = recipe.impl == "torchao"
    qx = fake_quantize(xb, ci.granularity, ci.fmt, pow2_scale=recipe.pow2_scales, divide=divide)
    qw = fake_quantize(w.to(BF16), cw.granularity, cw.fmt, pow2_scale=recipe.pow2_scales, divide=divide)
    assert torch.equal(y, (qx @ qw.t()).to(BF16) + b.to(BF16))
    with fp8_disabled(model):
        assert torch.equal(model(xb), linear(xb, w, b))
    xg = xb.clone().requires_grad_(True)
    model(xg).float().sum().backward()
    assert model[0].weight.grad.dtype == torch.float32 and xg.grad.dtype == BF16
