"""The native kernel of the microscaled operands (``native.microscaled``, FP4 / FP6: MX and NVFP4)
against the PyTorch code it replaces (``microscale._quantize_values``, itself tested bit for bit
against a brute-force reference in ``test_quant_microscale.py``): the same bits and strides on
both layouts the GEMMs feed it (row-major, and the transpose of a row-major operand), nearest
even and stochastic rounding (the same draws from the same generator, which ends in the same
state), every edge the formulas have (zero blocks, subnormals, NVFP4 blocks whose E4M3 scale
underflows, saturation, ragged blocks, 2-D tiles), and that it ran.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from fp8rl.quant import MX, NonFiniteError, fake_quantize, native
from fp8rl.quant.formats import E2M1, E2M3, E3M2
from fp8rl.quant.granularity import NVBlock

microscale = importlib.import_module("fp8rl.quant.microscale")

CASES = [(MX(32), E2M1), (MX(32), E2M3), (MX(32), E3M2), (NVBlock(16), E2M1), (NVBlock(16, rows=16), E2M1)]
IDS = ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "nvfp4", "nvfp4_16x16"]

pytestmark = pytest.mark.skipif(not native.enabled(), reason=f"native kernels {native.status()}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _pytorch(x, gran, fmt, generator=None):
    with native.disabled():
        return fake_quantize(x, gran, fmt, generator=generator)


def _operand(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows scaled from 1e-38 to 1e20 (subnormal blocks; BF16 keeps float32's range), a zero row,
    signed zeros, a subnormal, and one block whose values are far below its tensor's amax (NVFP4:
    its E4M3 scale underflows to zero)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-38, 20, rows)[:, None]
    x[0] = 0.0
    if rows > 2:
        x[1, : min(3, cols)] = torch.tensor([0.0, -0.0, -1e-40])[: min(3, cols)]
        x[2] = torch.randn(cols, generator=gen)
        x[2, : min(16, cols)] *= 1e-12  # NVFP4: a block under E4M3's smallest scale
    return x.to(dtype)


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize(("gran", "fmt"), CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["rne", "sr"])
def test_same_bits_strides_and_draws_as_the_pytorch_code(gran, fmt, dtype, stochastic):
    for seed, (rows, cols) in enumerate([(48, 64), (37, 40), (32, 96), (5, 7), (16, 16), (1, 33)]):
        x = _operand(rows, cols, dtype, seed)
        for name, t in (("row-major", x), ("transposed", x.t().contiguous().t())):
            before = native.calls["mq_full"]
            g1 = torch.Generator().manual_seed(seed) if stochastic else None
            g2 = torch.Generator().manual_seed(seed) if stochastic else None
            got = fake_quantize(t, gran, fmt, generator=g1)
            assert native.calls["mq_full"] == before + 1, name
            _check(got, _pytorch(t, gran, fmt, g2))
            if stochastic:  # the same draws: the generators end in the same state
                assert torch.equal(g1.get_state(), g2.get_state())


@pytest.mark.parametrize(("gran", "fmt"), CASES[:4], ids=IDS[:4])
def test_three_dimensional_operands(gran, fmt):
    x = _operand(24, 48, torch.bfloat16, 7).reshape(2, 12, 48)
    _check(fake_quantize(x, gran, fmt), _pytorch(x, gran, fmt))


@pytest.mark.parametrize(("gran", "fmt"), CASES, ids=IDS)
def test_every_bfloat16_magnitude_and_saturation(gran, fmt):
    """Every finite positive BF16 pattern, signed, in blocks with one large element (saturating
    the grid's top, down to flushing to zero), on both layouts."""
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    n = (bits.numel() // 256) * 256
    x = bits[:n].reshape(-1, 256) * torch.where(torch.arange(256) % 2 == 0, 1.0, -1.0)
    x[:, 5] = x.abs().amax(dim=1) * 1.7  # a block maximum between grid points
    x[:, 200] = 1e30  # NVFP4: everything else far below the tensor's amax
    for t in (x, x.t().contiguous().t(), x.to(torch.bfloat16)):
        _check(fake_quantize(t, gran, fmt), _pytorch(t, gran, fmt))


def test_other_layouts_and_dtypes_keep_the_pytorch_code():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    before = native.calls["mq_full"]
    for t in (x[:, ::2], x.to(torch.float16), x.to(torch.float64)):
        _check(fake_quantize(t, MX(32), E2M1), _pytorch(t, MX(32), E2M1))
    assert native.calls["mq_full"] == before


@pytest.mark.parametrize(("gran", "fmt"), CASES, ids=IDS)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_input_raises_with_its_index(gran, fmt, bad):
    x = torch.ones(32, 48)
    x[17, 5] = bad
    for t, idx in ((x, r"\(17, 5\)"), (x.t().contiguous().t(), r"\(17, 5\)")):
        with pytest.raises(NonFiniteError, match=idx):
            fake_quantize(t, gran, fmt)


def test_draws_are_checked_before_their_pointer_is_passed():
    x = torch.ones(4, 32)
    short = torch.rand(4 * 32 - 1)
    with pytest.raises(ValueError, match="u must be a contiguous float32"):
        native.microscaled(x, 1, 32, E2M1, False, 1e-12, 2688.0, short, (32, 1))
    with pytest.raises(ValueError, match="u must be a contiguous float32"):
        native.microscaled(x, 1, 32, E2M1, False, 1e-12, 2688.0, torch.rand(4 * 32, dtype=torch.float64), (32, 1))
    with pytest.raises(ValueError, match="row-major"):
        native.microscaled(x.t(), 1, 32, E2M1, False, 1e-12, 2688.0)


def test_stochastic_rounding_edges_of_the_draw():
    """A grid value never moves, even on a draw of 0; an element moves up only when its draw is
    strictly below its distance to the grid value below (``u < p``, as the tensor code): on a draw
    equal to that distance it stays, one draw step lower it moves (MX E2M1 with amax 6: the block
    scale is 1, so the elements are the values)."""
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    between = [(0.75, 0.5, 0.5), (1.25, 1.0, 0.5), (2.5, 2.0, 0.5), (3.5, 3.0, 0.5), (1.75, 1.5, 0.5), (5.0, 4.0, 0.5)]
    x, u, want = [], [], []
    for v in grid:  # u = 0: a grid value stays
        x.append(v), u.append(0.0), want.append(v)
    for v, lo, p in between:
        step = (v - lo) / p
        x += [v, v, -v]
        u += [p, p - 2.0**-24, 0.0]
        want += [lo, lo + step, -(lo + step)]
    pad = 32 - len(x)
    x, u, want = x + [0.0] * pad, u + [0.0] * pad, want + [0.0] * pad
    got = native.microscaled(torch.tensor([x]), 1, 32, E2M1, False, 1e-12, 2688.0, torch.tensor(u), (32, 1))
    assert got[0].tolist() == want
