"""Our FP8 linear: fprop/dgrad/wgrad against a slow emulated reference, and against torchao."""

import copy
from dataclasses import replace

import pytest
import torch
from microscale_reference import reference, rht_reference
from torch import nn

from fp8rl.quant import RECIPES, Fp8Linear, convert_to_fp8, fp8_linear, get_recipe
from fp8rl.quant.fake import fake_quantize
from fp8rl.quant.quantize import EPS


def _slow_dequant(t, g, fmt, pow2):
    """Loop over blocks: amax -> scale -> FP8 -> back, the textbook way."""
    if fmt.dtype is None:  # FP4 / FP6: the independent reference of test_quant_microscale.py
        return reference(t, g, fmt)
    rows, cols = t.shape
    br, bc = g.block_shape(rows, cols)
    out = torch.empty_like(t, dtype=torch.float32)
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            blk = t[i : i + br, j : j + bc].float()
            qscale = torch.tensor(fmt.max / max(float(blk.abs().max()), EPS), dtype=torch.float64).float()
            if pow2 or g.power_of_two:
                qscale = torch.exp2(torch.floor(torch.log2(qscale)))
            out[i : i + br, j : j + bc] = (blk * qscale).to(fmt.dtype).float() / qscale
    return out


def nearest(recipe):
    """``recipe`` with every operand rounded to nearest even (the slow reference has no random
    draws; stochastic rounding is tested on its own in test_quant_rounding.py)."""
    fields = ("input", "weight", "grad_output", "weight_for_dgrad", "input_for_wgrad", "grad_output_for_wgrad")
    return replace(recipe, **{f: replace(getattr(recipe, f), rounding="nearest") for f in fields
                              if getattr(recipe, f) is not None})


def _ref_operands(recipe, gemm, a, b):
    """The two operands the reference multiplies: the wgrad RHT (an independent float64 Hadamard)
    where the recipe has it, each FP8/FP4 operand dequantized by the slow loop, a weight-only
    recipe's high-precision operand as it is."""
    from fp8rl.quant.hadamard import SIGNS

    if gemm == "wgrad" and recipe.wgrad_rht:
        a, b = rht_reference(a, SIGNS).float(), rht_reference(b, SIGNS).float()
    ca, cb = recipe.operands(gemm)
    da = a.float() if ca is None else _slow_dequant(a, ca.granularity, ca.fmt, recipe.pow2_scales)
    db = _slow_dequant(b, cb.granularity, cb.fmt, recipe.pow2_scales)
    return da, db


def _ref_mm(recipe, gemm, a, b):
    if not getattr(recipe, gemm):
        return a.float() @ b.float().t()
    da, db = _ref_operands(recipe, gemm, a, b)
    return da.double() @ db.double().t()


def _data(k=160, n=144, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    gy = torch.randn(3, 5, n, generator=g)
    return x, w, b, gy


def _run(fn, x, w, b, gy):
    x, w, b = (t.clone().requires_grad_(True) for t in (x, w, b))
    y = fn(x, w, b)
    y.backward(gy)
    return y.detach(), x.grad, w.grad, b.grad


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("name", [n for n in RECIPES if n != "bf16"])
@pytest.mark.parametrize("hybrid", [None, True])
def test_fprop_dgrad_wgrad_match_slow_reference(name, hybrid):
    if hybrid and RECIPES[name].microscaled:
        with pytest.raises(ValueError, match="FP4/FP6; hybrid"):
            get_recipe(name, hybrid=hybrid)
        return
    recipe = nearest(get_recipe(name, hybrid=hybrid))
    x, w, b, gy = _data()
    y, gx, gw, gb = _run(lambda x, w, b: fp8_linear(x, w, b, recipe, emulate=True), x, w, b, gy)
    x2, g2 = x.reshape(-1, x.shape[-1]), gy.reshape(-1, gy.shape[-1])
    ref_y = _ref_mm(recipe, "fprop", x2, w) + b
    ref_gx = _ref_mm(recipe, "dgrad", g2, w.t())
    ref_gw = _ref_mm(recipe, "wgrad", g2.t(), x2.t())
    # float32 accumulation vs float64 reference: measured max relative error <= 6e-7
    assert _rel(y.reshape(-1, y.shape[-1]), ref_y) < 2e-6
    assert _rel(gx.reshape(-1, gx.shape[-1]), ref_gx) < 2e-6
    assert _rel(gw, ref_gw) < 2e-6
    assert torch.allclose(gb, g2.sum(0))
    # and FP8 actually happened: the high-precision answer differs
    assert _rel(y, (x @ w.t() + b)) > 1e-4


def _abs_mm(recipe, gemm, a, b):
    """|A| |B|^T of the operands the reference multiplies (dequantized where the GEMM is FP8)."""
    if not getattr(recipe, gemm):
        return a.double().abs() @ b.double().abs().t()
    da, db = _ref_operands(recipe, gemm, a, b)
    return da.double().abs() @ db.double().abs().t()


@pytest.mark.parametrize("name", [n for n in RECIPES if n != "bf16"])
def test_every_gemm_is_within_the_float32_summation_bound_on_any_cpu(name):
    """A check of the GEMM emulation that holds on every CPU, whatever order its kernels sum in (the
    golden numbers hold only where they were recorded): each element of fprop, dgrad and wgrad is
    within gamma_K * (|A||B|)_ij of the float64 product of the same quantized operands, gamma_K =
    K u / (1 - K u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed.,
    eq. 3.13: any summation order, FMA or not). A GEMM on unquantized operands, or on other
    scales, misses the float64 product by far more than this."""
    recipe = nearest(get_recipe(name))
    x, w, b, gy = _data(k=160, n=144, seed=3)
    y, gx, gw, _ = _run(lambda x, w, b: fp8_linear(x, w, None, recipe, emulate=True), x, w, b, gy)
    x2, g2 = x.reshape(-1, x.shape[-1]), gy.reshape(-1, gy.shape[-1])
    u = 2.0 ** -24
    for got, gemm, a, bb in ((y.reshape(-1, y.shape[-1]), "fprop", x2, w), (gx.reshape(-1, gx.shape[-1]), "dgrad", g2, w.t()),
                             (gw, "wgrad", g2.t(), x2.t())):
        k = a.shape[1]
        gamma = k * u / (1 - k * u)
        bound = gamma * _abs_mm(recipe, gemm, a, bb) + 1e-30
        err = (got.double() - _ref_mm(recipe, gemm, a, bb)).abs()
        assert bool((err <= bound).all()), (gemm, float((err / bound).max()))
        if getattr(recipe, gemm):  # FP8 happened: the unquantized product is outside the bound
            assert not bool(((got.double() - a.double() @ bb.double().t()).abs() <= bound).all()), gemm


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_scaled_mm_kernel_path_matches_emulation(name):
    x, w, b, gy = _data(k=128, n=64)
    recipe = RECIPES[name]
    kern = _run(lambda x, w, b: fp8_linear(x, w, b, recipe, emulate=False), x, w, b, gy)
    emu = _run(lambda x, w, b: fp8_linear(x, w, b, recipe, emulate=True), x, w, b, gy)
    for a, e in zip(kern, emu, strict=True):
        assert _rel(a, e) < 1e-6


def _torchao_vs_ours(recipe, emulate, k=128, n=96):
    x, w, b, gy = _data(k=k, n=n)
    out = {}
    for impl in ("torchao", "fp8rl"):
        lin = nn.Linear(k, n)
        with torch.no_grad():
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        model = convert_to_fp8(nn.Sequential(lin), recipe, impl=impl, emulate=emulate,
                               module_filter=lambda m, f: isinstance(m, nn.Linear))
        xx = x.clone().requires_grad_(True)
        y = model(xx)
        y.backward(gy)
        out[impl] = (y.detach(), xx.grad, model[0].weight.grad, model[0].bias.grad)
    return out["torchao"], out["fp8rl"]


@pytest.mark.parametrize("hybrid", [None, True, False])
@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_emulation_equals_torchao_float8linear_emulated_bit_for_bit(name, hybrid):
    """The default emulator of the torchao recipes computes what torchao's own emulation does:
    forward output, input gradient and weight gradient, exactly (torchao's real code)."""
    tao, ours = _torchao_vs_ours(get_recipe(name, hybrid=hybrid), emulate=True)
    for a, o in zip(tao, ours, strict=True):
        assert torch.equal(o, a)


@pytest.mark.parametrize("name", [n for n in RECIPES if n not in ("bf16", "tensorwise_delayed")])
def test_backward_reuse_of_quantized_operands_equals_requantizing(name):
    """Emulated, the backward reuses forward-quantized operands where the recipe allows
    (tensorwise, square weight blocks); the gradients equal the three GEMMs computed one by one
    (each quantizing its own operands) exactly."""
    from fp8rl.quant.hadamard import rht
    from fp8rl.quant.linear import fp8_mm

    recipe = nearest(RECIPES[name])
    x, w, b, gy = _data(k=256, n=160)
    y, gx, gw, _ = _run(lambda x, w, b: fp8_linear(x, w, b, recipe, emulate=True), x, w, b, gy)
    x2, g2 = x.reshape(-1, x.shape[-1]), gy.reshape(-1, gy.shape[-1])
    divide = recipe.impl == "torchao"

    def fq(t, c):
        return t.float() if c is None else fake_quantize(t, c.granularity, c.fmt, pow2_scale=recipe.pow2_scales,
                                                         divide=divide)

    def gemm(gemm, a, bb):
        if not getattr(recipe, gemm):
            return a @ bb.t()
        ca, cb = recipe.operands(gemm)
        if gemm == "wgrad" and recipe.wgrad_rht:
            a, bb = rht(a), rht(bb)
        return fq(a, ca) @ fq(bb, cb).t()

    assert torch.equal(y.reshape(-1, y.shape[-1]), gemm("fprop", x2, w) + b)
    assert torch.equal(gx.reshape(-1, gx.shape[-1]), gemm("dgrad", g2, w.t()))
    assert torch.equal(gw, gemm("wgrad", g2.t(), x2.t()))
    if not divide and not recipe.weight_only:  # block/MX recipes: quantize -> dequantize -> matmul
        ca, cb = recipe.operands("fprop")
        ref = fp8_mm(x2, ca, w, cb, pow2_scales=recipe.pow2_scales, emulate=True)
        assert torch.equal(y.reshape(-1, y.shape[-1]), ref + b)


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_agrees_with_torchao_float8linear_scaled_mm_on_cpu(name):
    tao, ours = _torchao_vs_ours(name, emulate=False)
    # tensorwise: the same _scaled_mm calls, bit-identical. Row-scaled: torchao writes the GEMM
    # output in bfloat16 for float32 models (a CUDA kernel limit it applies everywhere), we write
    # float32 on CPU, so agreement is to bfloat16 rounding (2^-8 relative) for one layer.
    tol = 0.0 if name == "tensorwise" else 2**-8
    for a, o in zip(tao, ours, strict=True):
        assert _rel(o, a) <= tol


def test_gradients_flow_to_master_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    params = list(model.parameters())
    convert_to_fp8(model, "blockwise", emulate=True, module_filter=lambda m, f: isinstance(m, nn.Linear))
    assert isinstance(model[0], Fp8Linear) and isinstance(model[2], Fp8Linear)
    assert all(p is q for p, q in zip(params, model.parameters(), strict=True))  # no copies
    model(torch.randn(8, 64)).pow(2).mean().backward()
    for p in params:
        assert p.grad is not None and p.grad.dtype == p.dtype and p.grad.abs().sum() > 0
    before = [p.detach().clone() for p in params]
    torch.optim.SGD(params, lr=0.1).step()
    assert all(not torch.equal(a, p) for a, p in zip(before, params, strict=True))


def test_bf16_master_weights_keep_dtype():
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    fp8 = convert_to_fp8(copy.deepcopy(lin), "rowwise", impl="fp8rl")
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    y = fp8(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert fp8.weight.grad.dtype == torch.bfloat16
