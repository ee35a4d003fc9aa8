"""Quantizers: round trip, SQNR floors, outliers, scale shapes, edge cases, torchao parity."""

import math

import pytest
import torch

from fp8rl.quant import (
    E4M3,
    E5M2,
    EPS,
    MX,
    NonFiniteError,
    PerBlock,
    PerRow,
    PerTensor,
    dequantize,
    fake_quantize,
    native,
    quantize,
    quantize_with_scale,
    sqnr_db,
)

GRANS = {
    "tensor": PerTensor(),
    "row": PerRow(),
    "block1x128": PerBlock(1, 128),
    "block128x128": PerBlock(128, 128),
    "mx32": MX(32),
}

# Measured on N(0, 1) [512, 1024], seed 0 (see docs/quant.md): e4m3 31.5-31.8 dB, e5m2 25.5-25.8 dB
# for every granularity; the floors sit ~1 dB below.
SQNR_FLOOR_DB = {E4M3.name: 30.5, E5M2.name: 24.5}


def _normal(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("gname", GRANS)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_round_trip_exact_for_representable_values(gname, fmt):
    # Values that are already FP8 numbers times a power of two survive exactly when the block's
    # amax maps onto fmt.max (scale = amax / max is then a power of two).
    g = GRANS[gname]
    codes = _normal(256, 256, seed=1).clamp(-fmt.max, fmt.max).to(fmt.dtype).to(torch.float32)
    codes[:, ::32] = fmt.max  # every row, 1x32 group and block holds +max
    x = codes * 2.0**-7
    q, s = quantize(x, g, fmt)
    assert torch.equal(dequantize(q, s, g), x)


@pytest.mark.parametrize("gname", GRANS)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_sqnr_above_floor_on_normal_data(gname, fmt):
    g = GRANS[gname]
    x = _normal(512, 1024)
    q, s = quantize(x, g, fmt)
    assert sqnr_db(x, dequantize(q, s, g)) > SQNR_FLOOR_DB[fmt.name]


def test_e4m3_tensorwise_above_25db_bf16_input():
    x = _normal(256, 512).to(torch.bfloat16)
    q, s = quantize(x, PerTensor(), E4M3)
    assert sqnr_db(x.float(), dequantize(q, s, PerTensor())) > 25


def _non_outlier_sqnr(x, g, mask):
    q, s = quantize(x, g, E4M3)
    return sqnr_db(x[mask], dequantize(q, s, g)[mask])


def test_per_row_outliers_rowwise_and_blockwise_beat_tensorwise():
    # Every 37th row 1e4x larger (LLM "massive activations"): one tensor scale pushes the other
    # rows into E4M3's subnormal range. Measured: tensor 25.7 dB, row 31.6, 1x128 31.8, mx 31.5.
    x = _normal(512, 1024)
    x[::37] *= 1e4
    mask = torch.ones(512, dtype=torch.bool)
    mask[::37] = False
    tensor = _non_outlier_sqnr(x, PerTensor(), mask)
    for g in (PerRow(), PerBlock(1, 128), MX(32)):
        assert _non_outlier_sqnr(x, g, mask) > tensor + 4


def test_outlier_block_rows_128x128_blocks_beat_tensorwise():
    # Weights with one outlier block-row (rows 0..127): 128x128 blocks isolate it.
    # Measured: tensor 24.8 dB, 128x128 31.5 dB.
    x = _normal(512, 1024)
    x[:128] *= 1e4
    mask = torch.ones(512, dtype=torch.bool)
    mask[:128] = False
    assert _non_outlier_sqnr(x, PerBlock(128, 128), mask) > _non_outlier_sqnr(x, PerTensor(), mask) + 4


@pytest.mark.parametrize(
    ("g", "shape", "scale_shape"),
    [
        (PerTensor(), (6, 300), ()),
        (PerRow(), (6, 300), (6, 1)),
        (PerRow(), (2, 3, 300), (2, 3, 1)),
        (PerBlock(1, 128), (6, 300), (6, 3)),
        (PerBlock(1, 128), (2, 3, 300), (2, 3, 3)),
        (PerBlock(128, 128), (300, 200), (3, 2)),
        (MX(32), (6, 300), (6, 10)),
        (MX(32), (2, 3, 64), (2, 3, 2)),
    ],
)
def test_scale_shapes(g, shape, scale_shape):
    x = _normal(*shape)
    q, s = quantize(x, g)
    assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn
    assert tuple(s.shape) == scale_shape and s.dtype == torch.float32


def _slow_block_reference(x, br, bc, fmt):
    """Explicit loop over blocks: ragged edges get their own scale."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    scales = torch.empty(math.ceil(rows / br), math.ceil(cols / bc))
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            blk = x[i : i + br, j : j + bc]
            amax = max(float(blk.abs().max()), EPS)
            qscale = torch.tensor(fmt.max / amax, dtype=torch.float64).float()
            q = (blk * qscale).to(fmt.dtype)
            out[i : i + br, j : j + bc] = q.float() * qscale.reciprocal()
            scales[i // br, j // bc] = qscale.reciprocal()
    return out, scales


@pytest.mark.parametrize("shape", [(256, 256), (200, 300), (130, 129)])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_block_quantize_matches_slow_loop_including_ragged_edges(shape, fmt):
    x = _normal(*shape) * 3
    x[-1, -1] = 40.0  # a ragged corner block with its own amax
    ref, ref_s = _slow_block_reference(x, 128, 128, fmt)
    q, s = quantize(x, PerBlock(128, 128), fmt)
    assert torch.equal(s, ref_s)
    assert torch.equal(dequantize(q, s, PerBlock(128, 128)), ref)


def test_zeros_give_finite_scale_and_zero_output():
    for g in GRANS.values():
        x = torch.zeros(130, 256)
        x[0, :5] = 1.0  # one non-zero block/row, the rest all zeros
        q, s = quantize(x, g)
        assert torch.isfinite(s).all() and (s > 0).all()
        assert torch.equal(dequantize(q, s, g), x)
    q, s = quantize(torch.zeros(4, 8), PerTensor())
    assert float(s) == pytest.approx(EPS / E4M3.max)


@pytest.mark.parametrize("gname", GRANS)
def test_huge_values_map_to_max(gname):
    g = GRANS[gname]
    x = _normal(128, 128)
    x[3, 7], x[5, 9] = 3e38, -3e38
    q, s = quantize(x, g)
    if g.power_of_two:  # a power-of-two scale maps amax into (224, 448], not onto 448
        assert 224 <= q[3, 7].float() <= E4M3.max and -E4M3.max <= q[5, 9].float() <= -224
    else:
        assert q[3, 7].float() == E4M3.max and q[5, 9].float() == -E4M3.max
    xh = dequantize(q, s, g)
    assert torch.isfinite(xh).all()
    assert abs(float(xh[3, 7]) / 3e38 - 1) < 1 / 16 and abs(float(xh[5, 9]) / -3e38 - 1) < 1 / 16


def test_quantize_with_scale_saturates():
    x = torch.tensor([[1.0, -1.0, 1e6, -1e6, 0.5]])
    q = quantize_with_scale(x, torch.tensor(1.0 / 448), PerTensor())
    assert q.float().tolist() == [[448.0, -448.0, 448.0, -448.0, 224.0]]
    q = quantize_with_scale(x, torch.tensor(1.0), PerTensor(), E5M2)
    assert q.float()[0, 2] == E5M2.max


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_raises_with_index(bad):
    x = torch.ones(4, 6, 8)
    x[2, 3, 5] = bad
    x[3, 0, 0] = bad
    for g in (PerTensor(), PerRow(), MX(8)):
        with pytest.raises(NonFiniteError, match=r"index \(2, 3, 5\).*first of 2"):
            quantize(x, g)
    with pytest.raises(NonFiniteError, match=r"shape \(4, 6, 8\)"):
        quantize_with_scale(x, torch.tensor(1.0), PerTensor())


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="non-empty"):
        quantize(torch.zeros(0, 4), PerTensor())
    with pytest.raises(TypeError, match="float32"):
        quantize(torch.ones(4, 4, dtype=torch.int32), PerTensor())
    with pytest.raises(ValueError, match="2-D operand"):
        quantize(torch.ones(2, 4, 8), PerBlock(2, 4))
    with pytest.raises(ValueError, match="positive"):
        PerBlock(0, 128)
    with pytest.raises(ValueError, match="one element"):
        dequantize(torch.zeros(2, 2, dtype=torch.float8_e4m3fn), torch.ones(2), PerTensor())


def test_mx_scales_are_powers_of_two_and_nothing_saturates():
    x = _normal(64, 256) * 7
    q, s = quantize(x, MX(32))
    assert torch.equal(s, torch.exp2(torch.round(torch.log2(s))))
    assert torch.equal(s.to(torch.float8_e8m0fnu).float(), s)  # exactly representable in E8M0
    blocks = q.float().abs().reshape(64, 8, 32).amax(-1)
    assert (blocks <= E4M3.max).all() and (blocks >= E4M3.max / 2).all()  # ceil rule: [224, 448]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [False, True])
def test_bits_and_scales_match_torchao(dtype, pow2):
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    x = (_normal(64, 96) * 5).to(dtype)
    for ours, tao, dim in ((PerTensor(), ScalingGranularity.TENSORWISE, None),
                           (PerRow(), ScalingGranularity.AXISWISE, -1)):
        for fmt in (E4M3, E5M2):
            t = hp_tensor_to_float8_dynamic(
                x, fmt.dtype, LinearMMConfig(), scaling_granularity=tao, axiswise_dim=dim,
                round_scales_to_power_of_2=pow2,
            )
            q, s = quantize(x, ours, fmt, pow2_scale=pow2)
            assert torch.equal(q.view(torch.uint8), t._data.view(torch.uint8))
            assert torch.equal(s.reshape(t._scale.shape), t._scale.reciprocal())


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_fp8_to_float32_equals_torch_conversion_for_every_bit_pattern(fmt):
    from fp8rl.quant.quantize import fp8_to_float32

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype).reshape(16, 16)
    for q in (codes, codes.t()):  # the table path (contiguous) and the fallback
        ref = q.to(torch.float32)
        out = fp8_to_float32(q)
        assert torch.equal(out.view(torch.int32), ref.contiguous().view(torch.int32))  # NaN, -0 too


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("gname", GRANS)
@pytest.mark.parametrize("shape", [(96, 160), (300, 200), (4, 7, 64)])
def test_fake_quantize_equals_dequantize_of_quantize(gname, fmt, shape):
    from fp8rl.quant import fake_quantize

    g = GRANS[gname]
    x = _normal(*shape) * torch.linspace(0.01, 40.0, shape[-1])  # scales vary across blocks
    if isinstance(g, PerBlock) and g.rows > 1 and len(shape) != 2:
        with pytest.raises(ValueError, match=r"needs a 2-D operand.*reshape to"):  # said, not guessed
            quantize(x, g, fmt)
        return
    q, s = quantize(x, g, fmt)
    assert torch.equal(_bits(fake_quantize(x, g, fmt)), _bits(dequantize(q, s, g)))
    if x.ndim == 2:  # a transposed view, as the weight-gradient GEMM quantizes its operands
        xt = x.t().contiguous().t()
        assert torch.equal(_bits(fake_quantize(xt, g, fmt)), _bits(dequantize(*quantize(xt, g, fmt), g)))
    # divide=True is torchao's arithmetic: q / qscale with qscale = fmt.max / amax (float32)
    x2 = x.reshape(-1, shape[-1])
    br, bc = g.block_shape(*x2.shape)
    qs = torch.empty_like(x2)
    for i in range(0, x2.shape[0], br):
        for j in range(0, x2.shape[1], bc):
            amax = float(x2[i:i + br, j:j + bc].abs().max())
            v = torch.tensor(fmt.max / max(amax, EPS), dtype=torch.float64).float()
            qs[i:i + br, j:j + bc] = torch.exp2(torch.floor(torch.log2(v))) if g.power_of_two else v
    ref = q.reshape(x2.shape).to(torch.float32) / qs
    assert torch.equal(fake_quantize(x, g, fmt, divide=True).reshape(x2.shape), ref)


@pytest.mark.parametrize("gran", [PerBlock(1, 128), PerBlock(128, 128), MX(32)])
@pytest.mark.parametrize("shape", [(192, 64), (5, 64), (130, 200), (1, 20)])
def test_blocks_longer_than_the_operand_equal_zero_padding(gran, shape):
    """A block dimension longer than the operand is clamped to it (no padding is computed):
    the result equals quantizing the operand zero-padded to whole blocks, then cropping."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * 5
    br, bc = gran.block_shape(*shape)
    rows, cols = -(-shape[0] // br) * br, -(-shape[1] // bc) * bc
    padded = torch.nn.functional.pad(x, (0, cols - shape[1], 0, rows - shape[0]))
    ref = fake_quantize(padded, gran)[: shape[0], : shape[1]]
    assert torch.equal(fake_quantize(x, gran), ref)
    q, s = quantize(x, gran)
    qp, sp = quantize(padded, gran)
    assert torch.equal(q.view(torch.uint8), qp[: shape[0], : shape[1]].view(torch.uint8))
    assert torch.equal(dequantize(q, s, gran), dequantize(qp, sp, gran)[: shape[0], : shape[1]])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns of ``t`` (bit for bit: ``-0.0`` differs from ``0.0``)."""
    return t.contiguous().view(torch.int32)


def _count_calls(mp: pytest.MonkeyPatch, module, name: str) -> list:
    """Wrap ``module.name`` (a fast path) so that each call appends to the returned list."""
    calls: list = []
    fast = getattr(module, name)

    def counted(*a, **kw):
        calls.append(1)
        return fast(*a, **kw)

    mp.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("divide", [False, True])
def test_one_scale_fast_path_equals_the_tensor_path(dtype, divide):
    """A row-major ``PerTensor`` E4M3 operand takes ``_fake_quantize_one_scale`` (the scale in
    Python floats); its transposed view takes the tensor path: the same bits, over amaxes from
    1e-30 to 1e30 (the EPS clamp included), signed zeros and subnormal inputs."""
    import importlib

    qmod = importlib.import_module("fp8rl.quant.fake")

    g = torch.Generator().manual_seed(7)
    scales = [0.0, 1e-30, 1e-13, 1e-6, 0.37, 1.0, 448.0, 3e5, 1e20]
    if dtype != torch.float32:
        scales = [s for s in scales if s == 0 or 1e-4 < s < 6e4]  # finite and normal in fp16
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "enabled", lambda: False)  # PyTorch's code (the kernels: test_quant_native_proc.py)
        calls = _count_calls(mp, qmod, "_fake_quantize_one_scale")
        for i, scale in enumerate(scales):
            x = (torch.randn(24, 40, generator=g) * scale).to(dtype)
            x[0, :3] = torch.tensor([0.0, -0.0, 1e-40 * scale])
            xt = x.t().contiguous().t()  # same values, column-major: the tensor path
            n = len(calls)
            out = fake_quantize(x, PerTensor(), E4M3, divide=divide)
            assert len(calls) == n + 1
            ref = fake_quantize(xt, PerTensor(), E4M3, divide=divide)
            assert len(calls) == n + 1, "the transposed operand must take the tensor path"
            assert torch.equal(_bits(out), _bits(ref)), (dtype, scale)
            if not divide:
                assert torch.equal(_bits(out), _bits(dequantize(*quantize(x, PerTensor(), E4M3), PerTensor())))
            if i == 3:  # N-D operands too
                x3 = x.reshape(4, 6, 40)
                assert torch.equal(_bits(fake_quantize(x3, PerTensor(), E4M3, divide=divide)), _bits(ref).reshape(4, 6, 40))
    with pytest.raises(NonFiniteError, match="non-finite"):
        fake_quantize(torch.tensor([1.0, float("inf")]), PerTensor(), E4M3)


def test_one_scale_in_python_floats_equals_the_tensor_formula():
    """``_one_qscale`` against ``_block_scales``' float64 tensor formula on 100,000 amaxes spread
    over float32's range, the EPS clamp included."""
    import importlib

    qmod = importlib.import_module("fp8rl.quant.fake")
    g = torch.Generator().manual_seed(11)
    amax = torch.exp2(torch.empty(100_000, dtype=torch.float64).uniform_(-60, 60, generator=g)).float()
    amax[:3] = torch.tensor([0.0, 1e-30, EPS])
    for fmt in (E4M3, E5M2):
        ref = (fmt.max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
        ours = torch.tensor([qmod._one_qscale(a, fmt.max) for a in amax.tolist()], dtype=torch.float32)
        assert torch.equal(ours, ref)


@pytest.mark.parametrize("gname", ["row", "block1x128", "mx32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("divide", [False, True])
@pytest.mark.parametrize("pow2", [False, True])
def test_row_block_fast_path_equals_the_tensor_path(gname, dtype, divide, pow2):
    """A row-major operand whose ``1 x bc`` blocks tile its rows takes ``_fake_quantize_rows``;
    the same bits as the tensor path (``_fake_quantize_tensor``) on the same operand, with
    row scales from 1e-30 to 1e20, zero rows and signed zeros; a ragged width takes the tensor
    path."""
    import importlib

    qmod = importlib.import_module("fp8rl.quant.fake")
    g = GRANS[gname]
    gen = torch.Generator().manual_seed(5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "enabled", lambda: False)  # PyTorch's code (the kernels: test_quant_native_proc.py)
        calls = _count_calls(mp, qmod, "_fake_quantize_rows")
        for shape in [(40, 128), (6, 5, 256), (33, 96 if gname == "mx32" else 128)]:
            x = torch.randn(*shape, generator=gen) * torch.logspace(-30, 20, shape[-2])[:, None]
            x = x.to(dtype) if dtype == torch.float32 else x.clamp(-1e30, 1e30).to(dtype)
            x.view(-1, shape[-1])[0] = 0.0
            x.view(-1, shape[-1])[1, :2] = torch.tensor([0.0, -0.0])
            n = len(calls)
            out = fake_quantize(x, g, E4M3, pow2_scale=pow2, divide=divide)
            assert len(calls) == n + 1
            ref = qmod._fake_quantize_tensor(x, g, E4M3, pow2, divide)
            assert torch.equal(_bits(out), _bits(ref)), shape
        ragged = torch.randn(8, 200, generator=gen)  # 200 = 1 x 128 + a ragged 72, or MX 6 x 32 + 8
        n = len(calls)
        fake_quantize(ragged, g, E4M3)
        assert len(calls) == n + (gname == "row")
        with pytest.raises(NonFiniteError, match="non-finite"):
            fake_quantize(torch.tensor([[1.0, float("nan")]] * 2), g, E4M3)


@pytest.mark.parametrize("gname", ["row", "block1x128", "mx32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("divide", [False, True])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_transposed_operand_path_equals_the_tensor_path(gname, dtype, divide, fmt):
    """The transpose of a row-major operand (a backward GEMM's) whose ``1 x bc`` blocks tile its
    rows takes ``_fake_quantize_transposed``: the same bits and the same strides (column-major)
    as the tensor path on the same operand, with row scales from 1e-30 to 1e20, zero rows and
    signed zeros; a ragged one (1 x 128 over 200 tokens) takes the tensor path."""
    import importlib

    qmod = importlib.import_module("fp8rl.quant.fake")
    g = GRANS[gname]
    gen = torch.Generator().manual_seed(9)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "enabled", lambda: False)  # PyTorch's code (the kernels: test_quant_native_proc.py)
        calls = _count_calls(mp, qmod, "_fake_quantize_transposed")
        for rows, cols in [(40, 128), (80, 256), (33, 96 if gname == "mx32" else 128), (7, 1)]:
            y = torch.randn(cols, rows, generator=gen) * torch.logspace(-30, 20, rows)[None, :]
            y = y.to(dtype) if dtype == torch.float32 else y.clamp(-1e30, 1e30).to(dtype)
            y[:, 0] = 0.0
            y[:2, 1 % rows] = torch.tensor([0.0, -0.0])[: min(2, cols)]
            x = y.t()  # [rows, cols], column-major
            n = len(calls)
            out = fake_quantize(x, g, fmt, divide=divide)
            assert len(calls) == n + (cols > 1)  # one column: x is row-major too (the row path)
            ref = qmod._fake_quantize_tensor(x, g, fmt, False, divide)
            assert out.dtype == torch.float32 and out.shape == x.shape
            assert torch.equal(_bits(out), _bits(ref)), (rows, cols)
            assert out.stride() == ref.stride(), (out.stride(), ref.stride())
        ragged = torch.randn(200, 8, generator=gen).to(dtype).t()  # 200 = 128 + 72, or 6 x 32 + 8
        n = len(calls)
        fake_quantize(ragged, g, fmt)
        assert len(calls) == n + (gname == "row")
        with pytest.raises(NonFiniteError, match="non-finite"):
            fake_quantize(torch.tensor([[1.0, float("nan")]] * 2).t(), g, fmt)
