"""Microscaled FP4 / FP6 operands: MXFP4 and MXFP6 (OCP MX v1.0) and NVIDIA's NVFP4.

A microscaled operand is ``[rows, cols]`` with ``cols`` the contraction dimension (the one axis
convention of ``granularity.py``), cut into ``1 x block`` groups along ``cols``; every group
shares one scale and every element is a sub-byte float (``formats.SubByteFormat``). What this
module computes, per group of elements ``x_i`` with ``amax = max |x_i|``:

**MX** (``MX(32)`` with ``E2M1`` = MXFP4, ``E2M3`` / ``E3M2`` = MXFP6; OCP Microscaling Formats
(MX) Specification v1.0, section 6.3, "Conversion from vector of scalar floats to MX format"):

    e     = floor(log2(amax)) - emax_elem        (emax_elem: 2 for E2M1/E2M3, 4 for E3M2)
    e     = clamp(e, -127, 127)                  (the E8M0 scale's range; amax = 0 gives -127)
    X     = 2^e                                  (the E8M0 shared scale, float32, exact)
    q_i   = sat(rne(x_i / X))                    (x_i / X exact: a power of two)
    x^_i  = q_i * X

``floor(log2(amax))`` is read exactly from the float32 exponent (``torch.frexp``), not from a
rounded ``log2``. With this rule the largest element of a group lands in ``[2^emax, 2^(emax+1))``
and may exceed the element's largest finite value (E2M1: amax / X in [4, 8), max 6), where it
saturates: ``sat`` clamps to ``+-max`` after rounding (MX v1.0 6.3: values above the largest
normal are clamped to it; the sub-byte formats have no Inf/NaN, 5.3). This is the spec's rule,
not the one ``mxfp8`` uses (``quantize.py``: the scale rounded up so that nothing saturates, as
torchao and Transformer Engine do for MXFP8); the FP8 recipes keep theirs.

**NVFP4** (``NVBlock(16)`` with ``E2M1``; NVIDIA, "Pretraining Large Language Models with NVFP4",
arXiv:2509.25149, section 2 and appendix "NVFP4 quantization"; Transformer Engine's NVFP4
quantizer): two levels, an FP32 scale for the whole operand and an E4M3 scale per 16 elements,

    s_t   = fp32(amax_tensor / (448 * 6))        (per-tensor FP32 decode scale; amax >= EPS)
    s_b   = e4m3(fp32(amax_block / (6 * s_t)))   (per-block decode scale, rounded to nearest even
                                                  onto E4M3, saturating at 448; float64 inside)
    d_b   = fp32(s_b * s_t)                      (the block's float32 decode scale)
    q_i   = sat(rne(fp32(x_i / d_b)))            (a block whose s_b rounds to 0 gives zeros)
    x^_i  = fp32(q_i * d_b)

so the largest element of a block maps to about 6 and the block scales use E4M3's range below
448. ``s_b`` is an E4M3 value and ``q_i`` an E2M1 one: ``q_i * s_b`` is exact, so ``x^_i`` is the
one float32 rounding of the real product ``q_i * s_b * s_t``, which is what a GEMM applying the
two scales one after the other in float32 computes up to accumulation order.

``rne`` is round to nearest, ties to even, on the element grid (subnormals included), computed
by ``formats.round_magnitudes_`` (the FP8 grid rounding; it only needs the mantissa width and the
smallest normal exponent). Inputs are converted to float32 first (exactly, from BF16/FP16).

Choices and deviations [G]:

- **Non-finite input raises** ``NonFiniteError``, as every FP8 path here does. The MX spec maps a
  NaN/Inf in a group to a NaN scale (E8M0 ``0xFF``) and NVFP4 kernels propagate NaN; refusing is
  what the issue allows ("refused or mapped as the spec says") and keeps one policy.
- The MX spec leaves the element rounding to the implementation (6.3: "rounding is
  implementation defined"); we use nearest-even, as OCP's reference ``microxcaling`` library's
  default ``round="nearest"`` mode is for elements. No stochastic rounding is implemented: no
  recipe here prescribes it (see ``recipes.py`` for what NVIDIA's NVFP4 *training* recipe adds).
- NVFP4's per-tensor scale is taken over the operand as it enters the GEMM (the 2-D operand in the
  GEMM's orientation), dynamically, like every other scale in this package.
- ``EPS`` (1e-12) bounds the per-tensor amax from below so an all-zero operand has finite scales.
- Codes (``quantize_microscaled``) are stored unpacked, one ``uint8`` per element with the sign
  as the top bit of the format's ``bits``; scales as float32 (E8M0 / E4M3 values, exactly).

``fake.fake_quantize`` sends every sub-byte operand here before it looks at its FP8 native
kernels or fast paths. Here, a float32 or BF16 CPU operand that is row-major, or the transpose of
a row-major 2-D one, goes to the C kernel ``native.microscaled`` (``mq_full``): the same formulas
as the tensor code below, the same floats and layout (tested bit for bit, stochastic draws and
the generator's final state included: ``tests/quant/test_quant_native_microscale.py``); other
operands, ``FP8RL_NATIVE=0`` and ``native.disabled()`` keep the tensor code. ``quantize_microscaled``
(codes and scales) always runs the tensor code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import fp8rl.quant.native as native
from fp8rl.quant.formats import (
    E2M1,
    E4M3,
    ElementFormat,
    SubByteFormat,
    round_magnitudes_,
    round_magnitudes_stochastic_,
)
from fp8rl.quant.granularity import MX, Granularity, NVBlock
from fp8rl.quant.quantize import EPS, _as_2d, _block_in, _blocked, _raise_non_finite, _unblocked

__all__ = [
    "MicroscaledTensor",
    "check_microscaled",
    "dequantize_microscaled",
    "fake_quantize_microscaled",
    "is_microscaled",
    "quantize_microscaled",
]

#: NVFP4's per-tensor scale maps the tensor's amax to E4M3 max x E2M1 max.
NVFP4_TENSOR_RANGE = 448.0 * 6.0
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127


def is_microscaled(granularity: Granularity, fmt: ElementFormat) -> bool:
    """True for an operand this module quantizes (a sub-byte format, or NVFP4's granularity)."""
    return isinstance(fmt, SubByteFormat) or isinstance(granularity, NVBlock)


def check_microscaled(granularity: Granularity, fmt: ElementFormat) -> None:
    """Raise ``ValueError`` for a granularity / format pair no standard defines."""
    if isinstance(granularity, NVBlock):
        if fmt != E2M1:
            raise ValueError(f"NVBlock (NVFP4 two-level scaling) takes E2M1 elements, got {fmt.name}")
        return
    if isinstance(fmt, SubByteFormat) and not isinstance(granularity, MX):
        raise ValueError(
            f"sub-byte format {fmt.name} needs a microscaling granularity: MX(32) (OCP MX, E8M0 "
            f"scales) or, for E2M1, NVBlock(16) (NVFP4); got {granularity}"
        )


@dataclass
class MicroscaledTensor:
    """Quantized operand: ``codes`` uint8 (x's shape), ``block_scale`` float32 ``(*lead, ceil(C /
    block))`` (E8M0 or E4M3 values), ``tensor_scale`` float32 ``()`` (NVFP4) or ``None`` (MX)."""

    codes: torch.Tensor
    block_scale: torch.Tensor
    tensor_scale: torch.Tensor | None


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2^e`` as float32 for int32 ``e`` in [-127, 127], built from bits (exact; 2^-127 is the
    float32 subnormal ``0x00400000``)."""
    bits = torch.where(e >= -126, (e + 127) << 23, torch.full_like(e, 1 << 22))
    return bits.view(torch.float32)


def _round_grid(a: torch.Tensor, fmt) -> torch.Tensor:
    """``sat(rne(a))`` for float32 ``a >= 0``, in place: nearest even on ``fmt``'s grid, then
    clamped to ``fmt.max`` (values above ``2 max`` are clamped first: they saturate either way, and
    the grid rounding's constant stays inside float32's range)."""
    return round_magnitudes_(a.clamp_(max=2 * fmt.max), fmt).clamp_(max=fmt.max)


def _block_decode_scales(axb: torch.Tensor, granularity: Granularity, fmt: SubByteFormat,
                         operand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(d, block_scale, tensor_scale)`` of blocks ``|x|`` viewed as ``[gr, br, gc, bc]``: ``d`` the
    float32 decode scale per block ``[gr, 1, gc, 1]``."""
    amax = axb.amax(dim=(1, 3), keepdim=True)  # [gr, 1, gc, 1]
    if not math.isfinite(float(amax.max())):
        _raise_non_finite(operand, "quantize (microscaled)")
    if isinstance(granularity, MX):
        e = torch.frexp(amax).exponent - 1 - fmt.emax  # floor(log2(amax)) - emax, exact
        e = torch.where(amax == 0, _E8M0_MIN_EXP, e).clamp_(_E8M0_MIN_EXP, _E8M0_MAX_EXP)
        d = _pow2(e.to(torch.int32))
        return d, d, None
    # NVFP4: per-tensor FP32 decode scale, then E4M3 block scales relative to it
    s_t64 = max(float(amax.max()), EPS) / NVFP4_TENSOR_RANGE
    s_t = torch.tensor(s_t64, dtype=torch.float32)
    s_b = (amax.to(torch.float64) / (6.0 * float(s_t))).to(torch.float32)
    s_b = _round_grid(s_b, E4M3)
    return s_b * s_t, s_b, s_t


def _check_generator(generator: torch.Generator | None, fmt: ElementFormat) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"stochastic rounding to {fmt.name} needs a torch.Generator (the quantizer state's, "
                        f"fp8rl.quant.rounding.QuantizerState), got {type(generator).__name__}")


def _quantize_values(x: torch.Tensor, granularity: Granularity, fmt: ElementFormat,
                     generator: torch.Generator | None = None):
    """``(q, d, block_scale, tensor_scale, rows, cols)``: ``q`` the element values (float32
    ``[gr, br, gc, bc]``, zero-padded), ``d`` the decode scale per block ``[gr, 1, gc, 1]``.
    ``generator``: stochastic rounding of the elements with draws from it (``None``: nearest even)."""
    check_microscaled(granularity, fmt)
    _check_generator(generator, fmt)
    assert isinstance(fmt, SubByteFormat)
    x2, (br, bc) = _as_2d(x, granularity)
    rows, cols = x2.shape
    xb = _blocked(x2.to(torch.float32), br, bc)  # [gr, br, gc, bc]
    axb = xb.abs()
    d, block_scale, tensor_scale = _block_decode_scales(axb, granularity, fmt, x)
    # a block whose scale is 0 (NVFP4: s_b under E4M3's half subnormal) holds zeros: divide by inf
    a = axb.div_(torch.where(d == 0, torch.inf, d))
    if generator is None:
        q = _round_grid(a, fmt)
    else:  # stochastic: one uniform draw per element (padding included), from the caller's generator
        u = torch.rand(a.shape, generator=generator, dtype=torch.float32, device=generator.device)
        q = round_magnitudes_stochastic_(a.clamp_(max=fmt.max), fmt, u.to(a.device)).clamp_(max=fmt.max)
    q = q.copysign_(xb)
    return q, d, block_scale, tensor_scale, rows, cols


def _crop(yb: torch.Tensor, rows: int, cols: int, shape: torch.Size) -> torch.Tensor:
    y = _unblocked(yb, rows, cols)
    return y.reshape(shape)


def fake_quantize_microscaled(x: torch.Tensor, granularity: Granularity, fmt: ElementFormat,
                              generator: torch.Generator | None = None) -> torch.Tensor:
    """``dequantize_microscaled(quantize_microscaled(x, ...))`` in float32 without the codes:
    what an emulated FP4/FP6 GEMM feeds its matmul. ``x``: ``[..., C]`` (C the contraction dim);
    2-D tiles (``NVBlock(16, rows=16)``) need a 2-D ``x``. ``generator``: stochastic rounding of
    the elements, drawing from it (``None``: nearest even; the scales are always nearest even).

    Raises:
        NonFiniteError: ``x`` holds inf or NaN.
        ValueError: no standard defines ``granularity`` with ``fmt`` (``check_microscaled``).
    """
    if x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu" and x.ndim and native.enabled():
        out = _fake_quantize_native(x, granularity, fmt, generator)
        if out is not None:
            return out
    q, d, _, _, rows, cols = _quantize_values(x, granularity, fmt, generator)
    return _crop(q.mul_(d), rows, cols, x.shape)


def _fake_quantize_native(x: torch.Tensor, granularity: Granularity, fmt: ElementFormat,
                          generator: torch.Generator | None) -> torch.Tensor | None:
    """``fake_quantize_microscaled`` by the C kernel (``native.microscaled``): the tensor path's
    floats and layout, in two passes over the operand, for a row-major ``x`` or the transpose of
    a row-major 2-D one (the backward GEMMs' operands); ``None`` for any other layout.

    The transpose is worked on in its memory order: ``y = x.t()`` is row-major, ``x``'s ``br x bc``
    blocks are ``y``'s ``bc x br`` ones. The tensor path returns such an operand column-major,
    or row-major where it zero-pads a ragged block; so does this. Stochastic draws are the tensor
    path's: one ``torch.rand`` of the padded blocked shape from ``generator`` (the same stream),
    element ``(r, c)`` of ``x`` reading draw ``r * C_padded + c``."""
    check_microscaled(granularity, fmt)
    _check_generator(generator, fmt)
    assert isinstance(fmt, SubByteFormat)
    transposed = not x.is_contiguous()
    if transposed and not (x.ndim == 2 and x.t().is_contiguous()):
        return None
    x2, (br, bc) = _as_2d(x, granularity)
    rows, cols = x2.shape
    gr, gc = -(-rows // br), -(-cols // bc)
    u = None
    if generator is not None:  # the tensor path's draw: the padded blocked shape, in its order
        u = torch.rand((gr, br, gc, bc), generator=generator, dtype=torch.float32,
                       device=generator.device).to(x.device).reshape(-1)
    nv = isinstance(granularity, NVBlock)
    if not transposed:
        out = native.microscaled(x2, br, bc, fmt, nv, EPS, NVFP4_TENSOR_RANGE, u, (gc * bc, 1))
    else:
        out = native.microscaled(x2.t(), bc, br, fmt, nv, EPS, NVFP4_TENSOR_RANGE, u, (1, gc * bc))
    if out is None:
        _raise_non_finite(x, "quantize (microscaled)")
    if not transposed:
        return out.view(x.shape)
    out = out.t()
    return out.contiguous() if gr * br != rows or gc * bc != cols else out


def _positive_values(fmt: SubByteFormat) -> torch.Tensor:
    return fmt.values()[: 2 ** (fmt.bits - 1)]


def _scale_shape(x: torch.Tensor, granularity: Granularity, gr: int, gc: int) -> tuple[int, ...]:
    br, _ = granularity.block_shape(*x.reshape(-1, x.shape[-1]).shape)
    return (*x.shape[:-1], gc) if br == 1 else (gr, gc)


def quantize_microscaled(x: torch.Tensor, granularity: Granularity, fmt: ElementFormat,
                         generator: torch.Generator | None = None) -> MicroscaledTensor:
    """Quantize ``x [..., C]`` to codes and scales (see the module docstring for the formulas)."""
    q, _, block_scale, tensor_scale, rows, cols = _quantize_values(x, granularity, fmt, generator)
    assert isinstance(fmt, SubByteFormat)
    mag = torch.searchsorted(_positive_values(fmt), q.abs().contiguous())  # exact: q is on the grid
    codes = mag.to(torch.uint8) | (torch.signbit(q).to(torch.uint8) << (fmt.bits - 1))
    codes = _crop(codes, rows, cols, x.shape)
    gr, gc = block_scale.shape[0], block_scale.shape[2]
    return MicroscaledTensor(codes, block_scale.reshape(_scale_shape(x, granularity, gr, gc)), tensor_scale)


def dequantize_microscaled(mt: MicroscaledTensor, granularity: Granularity, fmt: ElementFormat) -> torch.Tensor:
    """float32 values of a ``MicroscaledTensor``: ``q * d`` per block, ``d`` = ``X`` (MX) or
    ``fp32(s_b * s_t)`` (NVFP4), bit for bit ``fake_quantize_microscaled``'s result."""
    assert isinstance(fmt, SubByteFormat)
    codes = mt.codes.reshape(-1, mt.codes.shape[-1])
    rows, cols = codes.shape
    br, bc = _block_in(granularity, rows, cols)
    q = fmt.values().index_select(0, codes.reshape(-1).to(torch.int32)).view(rows, cols)
    qb = _blocked(q, br, bc)  # [gr, br, gc, bc]
    d = mt.block_scale.reshape(qb.shape[0], 1, qb.shape[2], 1).to(torch.float32)
    if mt.tensor_scale is not None:
        d = d * mt.tensor_scale.reshape(())
    return _crop(qb * d, rows, cols, mt.codes.shape)
