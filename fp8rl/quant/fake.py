"""Emulated FP8 operands: the FP8 value of every element, in float32, without an FP8 tensor.

What an emulated FP8 GEMM feeds its float32 matmul (``fp8rl.quant.linear``, the rollout
engines of ``fp8rl.quant.rollout``): ``fake_quantize(x, ...)`` equals
``dequantize(*quantize(x, ...))`` (``fp8rl.quant.quantize``, whose module docstring gives the
scale formula) bit for bit, in fewer passes:

- the rounding onto the FP8 grid is done in float32 arithmetic (:func:`round_to_fp8_grid`)
  instead of a cast to FP8 and back;
- three fast paths for CPU operands, taken where they give the same floats: on row-major
  ones, one E4M3 scale computed in Python floats (``_fake_quantize_one_scale``) and blocks of
  one row that tile it (``_fake_quantize_rows``: per row, ``1 x 128`` on rows up to 128 wide,
  MX on multiples of 32); on the transpose of a row-major tensor (the backward GEMMs'
  operands), blocks of one row that tile it, computed in its memory order
  (``_fake_quantize_transposed``); every other operand takes the tensor path
  (``_fake_quantize_tensor``).

Ahead of all of them, where they are built (``fp8rl.quant.native``: two C functions, compiled
on first use): float32 and BFloat16 CPU operands that are row-major (any blocks) or the
transpose of a row-major tensor (one scale, or blocks of one row) go to the native kernels
(``_fake_quantize_native``), which compute the same floats in the same layout as the path the
operand would otherwise take, in two passes over it. ``FP8RL_NATIVE=0`` (or no C compiler)
leaves the PyTorch code below.

Tested bit for bit against ``dequantize(quantize(...))`` and, for the fast paths, against the
tensor path (``tests/quant/test_quant_quantize.py``, ``tests/quant/test_quantize_grid.py``); the
native kernels against the PyTorch code, bits and strides (``tests/quant/test_quant_native_proc.py``);
timed by ``benchmarks/bench_fake_quant.py``.
"""

from __future__ import annotations

import math
import struct

import torch

import fp8rl.quant.native as native
from fp8rl.quant.formats import E4M3, Fp8Format, SubByteFormat
from fp8rl.quant.formats import round_magnitudes_ as _round_magnitudes_
from fp8rl.quant.granularity import Granularity, PerTensor
from fp8rl.quant.microscale import fake_quantize_microscaled, is_microscaled
from fp8rl.quant.quantize import (
    EPS,
    _as_2d,
    _block_scales,
    _blocked,
    _qscale,
    _raise_non_finite,
    _scale_one,
    _unblocked,
)

__all__ = ["fake_quantize", "round_to_fp8_grid"]


def round_to_fp8_grid(y: torch.Tensor, fmt: Fp8Format = E4M3) -> torch.Tensor:
    """``y.to(fmt.dtype).to(torch.float32)`` in float32 arithmetic, for ``|y| <= fmt.max``.

    Rounds to nearest even onto the format's grid without making an FP8 tensor: on the binade
    ``[2^e, 2^(e+1))`` the grid step is ``2^(e-m)`` (``m`` mantissa bits), and below the smallest
    normal ``2^emin`` it is the subnormal step ``2^(emin-m)``. With ``c = 2^(max(e, emin) + 23 - m)``
    the float32 sum ``|y| + c`` has exactly that step as its ulp, so float32's own rounding does
    the FP8 rounding, ties to even included, and subtracting ``c`` again is exact. The sign is
    copied back, so a negative value that rounds to zero gives ``-0.0``, as the FP8 ``-0`` does.

    Seven elementwise passes and no FP8 tensor, bit for bit the floats of the cast: checked
    against PyTorch's cast on every float32 value with ``|y| <= fmt.max * (1 + 2^-20)`` for E4M3
    and E5M2 (``tests/quant/test_quantize_grid.py``). Above that range it keeps rounding where
    the cast saturates; ``fake_quantize``'s dynamic scales never get there (``|x * qscale| <=
    fmt.max`` up to one float32 rounding). Any strides; the result has ``y``'s layout.

    In ``fake_quantize`` it replaces the cast followed by the 256-entry table, which on a
    transposed operand (the weight gradient's) fell back to PyTorch's element-by-element
    conversion (``benchmarks/bench_fake_quant.py``).

    Args:
        y: float32 tensor, finite, ``|y| <= fmt.max * (1 + 2^-20)``.
        fmt: ``E4M3`` or ``E5M2``.
    Returns:
        float32 tensor of ``y``'s shape.
    """
    if y.dtype != torch.float32:
        raise TypeError(f"round_to_fp8_grid needs float32, got {y.dtype}")
    return _round_magnitudes_(y.abs(), fmt).copysign_(y)


def fake_quantize(
    x: torch.Tensor,
    granularity: Granularity,
    fmt: Fp8Format | SubByteFormat = E4M3,
    *,
    pow2_scale: bool = False,
    divide: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The FP8 value of every element of ``x``, in float32: quantize, then dequantize.

    FP4 / FP6 operands (a ``SubByteFormat``, or ``NVBlock``) go to
    ``microscale.fake_quantize_microscaled`` first (OCP MX and NVFP4 scale rules), never to the
    FP8 native kernels or fast paths below; ``generator`` rounds their elements stochastically
    (``fp8rl.quant.rounding``; FP8 operands always round to nearest even).

    What an emulated FP8 GEMM feeds its float32 matmul. ``divide=False`` dequantizes as
    :func:`dequantize` does, ``q * (1 / qscale)`` (the dequantization multiplier that
    ``torch._scaled_mm``, vLLM and Transformer Engine apply); ``divide=True`` as torchao's
    emulated GEMM does, ``q / qscale`` (``Float8TrainingTensor._data.float() / _scale``). The
    two differ by at most one float32 rounding per element unless the scale is a power of two.

    Args:
        x: ``[..., C]`` float tensor (``C`` the contraction dimension); shapes as ``quantize``.
    Returns:
        float32 tensor of ``x``'s shape: row-major for a row-major ``x``; the transpose of a
        row-major ``x`` with blocks of one row gives a column-major one (the tensor path's
        layout there too).
    Raises:
        NonFiniteError: ``x`` contains inf or NaN.
    """
    if is_microscaled(granularity, fmt):  # FP4 / FP6: never the FP8 native or fast paths
        if pow2_scale or divide:
            raise ValueError(
                f"fake_quantize: {granularity} with {fmt.name} elements has its scale rule fixed by "
                "the standard (fp8rl.quant.microscale); pow2_scale and divide do not apply"
            )
        return fake_quantize_microscaled(x, granularity, fmt, generator)
    if generator is not None:
        raise ValueError(f"fake_quantize: stochastic rounding is for FP4/FP6 operands; {fmt.name} rounds to "
                         "nearest even (pass generator=None)")
    if x.dtype in _NATIVE_DTYPES and x.device.type == "cpu" and x.ndim and native.enabled():
        pow2 = pow2_scale or granularity.power_of_two
        if x.is_contiguous():  # row-major: the tensor path's and the fast paths' layout
            x2, (br, bc) = _as_2d(x, granularity)
            return _fake_quantize_native(x2, br, bc, fmt, pow2, divide, x).view(x.shape)
        if x.ndim == 2 and x.t().is_contiguous():  # the transpose of a row-major y = x.t()
            _, (br, bc) = _as_2d(x, granularity)
            if type(granularity) is PerTensor:  # one block; column-major, as the tensor path
                return _fake_quantize_native(x.t(), x.shape[1], x.shape[0], fmt, pow2, divide, x).t()
            if br == 1:  # blocks of one row of x: of one column of y
                out = _fake_quantize_native(x.t(), bc, 1, fmt, pow2, divide, x).t()
                # the layouts of the other paths (and so of the GEMM that reads the result):
                # column-major where the blocks tile the rows (_fake_quantize_transposed),
                # row-major where the tensor path pads a ragged block and crops
                return out if x.shape[1] % bc == 0 else out.contiguous()
    if x.dtype in _FAST_DTYPES and x.device.type == "cpu" and x.ndim and x.is_contiguous():  # row-major
        if type(granularity) is PerTensor:
            if not pow2_scale and fmt.dtype == torch.float8_e4m3fn:
                return _fake_quantize_one_scale(x, fmt, divide)
        else:
            x2, (br, bc) = _as_2d(x, granularity)
            if br == 1 and x2.shape[1] % bc == 0:
                return _fake_quantize_rows(x2, bc, fmt, pow2_scale or granularity.power_of_two, divide).view(x.shape)
    elif (x.dtype in _FAST_DTYPES and x.device.type == "cpu" and x.ndim == 2 and x.t().is_contiguous()
          and type(granularity) is not PerTensor):  # the transpose of a row-major operand
        _, (br, bc) = _as_2d(x, granularity)
        if br == 1 and x.shape[1] % bc == 0:
            return _fake_quantize_transposed(x, bc, fmt, pow2_scale or granularity.power_of_two, divide)
    return _fake_quantize_tensor(x, granularity, fmt, pow2_scale, divide)


def _fake_quantize_native(x2: torch.Tensor, br: int, bc: int, fmt: Fp8Format, pow2: bool, divide: bool,
                          operand: torch.Tensor) -> torch.Tensor:
    """``fake_quantize`` of a row-major ``[R, C]`` operand with ``br x bc`` blocks by the C
    kernels of ``fp8rl.quant.native``: float32 ``[R, C]``, row-major, the tensor path's bits.

    Without a power of two, one call computes the block amaxes, the scales (``_qscale``'s
    float64 formula, which ``_one_qscale`` also computes) and the values; with one (MX), the
    scales come from ``_qscale`` itself (its ``log2`` is PyTorch's) between two calls.
    ``operand``: the caller's tensor (``x2`` is a view of it or of its transpose), named in the
    error on non-finite input."""
    if not pow2:  # one call: the scales too (the formula of _qscale and _one_qscale, in C)
        out = native.full(x2, br, bc, fmt, divide, EPS)
        if out is None:
            _raise_non_finite(operand, "fake_quantize")
        return out
    amax = native.block_amax(x2, br, bc)  # [gr, gc]
    if not math.isfinite(float(amax.max())):
        _raise_non_finite(operand, "fake_quantize")
    qscale = _qscale(amax, fmt.max, pow2)
    dq = qscale if divide else qscale.reciprocal()
    return native.apply(x2, br, bc, qscale, dq, divide, fmt)


def _fake_quantize_rows(x2: torch.Tensor, bc: int, fmt: Fp8Format, pow2: bool, divide: bool) -> torch.Tensor:
    """``fake_quantize`` of a row-major ``[R, C]`` operand whose blocks are ``1 x bc`` and tile
    its rows (``bc`` divides ``C``: per row, ``1 x 128`` on 128-wide rows, MX on multiples of 32).

    The tensor path's operations on the same values, without its 4-D block view: the amax a
    contiguous reduction along the row (a maximum is exact in any order), the same float64
    scale formula, the same products; the finiteness check reads one maximum.
    """
    rows, cols = x2.shape
    ax = x2.abs()
    xb, axb = (x2, ax) if bc == cols else (x2.view(rows, cols // bc, bc), ax.view(rows, cols // bc, bc))
    amax = axb.amax(dim=-1, keepdim=True)  # [R, 1] or [R, C / bc, 1]
    if not math.isfinite(float(amax.max())):
        _raise_non_finite(x2, "fake_quantize")
    qscale = _qscale(amax, fmt.max, pow2)
    qb = _round_magnitudes_(axb * qscale, fmt).copysign_(xb)
    return qb / qscale if divide else qb * qscale.reciprocal()


def _fake_quantize_transposed(x2: torch.Tensor, bc: int, fmt: Fp8Format, pow2: bool, divide: bool) -> torch.Tensor:
    """``fake_quantize`` with ``1 x bc`` blocks that tile the rows of ``x2 [R, C]``, the
    transpose of a row-major ``[C, R]`` tensor: the weight of a dgrad GEMM (``W.t()``), the
    activation and the gradient of a wgrad GEMM (``x.t()``, ``grad_y.t()``), per row
    (``rowwise``), MX, or ``1 x 128`` where 128 divides the token count.

    Works in the operand's own memory order: a block of ``x2``'s row ``r`` is a run of ``bc``
    rows of column ``r`` of ``y = x2.t()``, so the amaxes are reductions over ``y``'s rows
    (vectorised across its columns) and every elementwise pass runs over contiguous memory, in
    place on ``|y|``, viewed as ``[C / bc, bc, R]``. The tensor path works on strided 4-D
    views instead: the same operations on the same values (``x`` converted to float32 first,
    exactly, where the tensor path promotes it in each product), so the same floats, in the
    tensor path's layout (column-major), so the GEMM that reads them runs as before. A ragged
    operand (``bc`` not dividing ``C``) takes the tensor path, which was as fast there
    (``benchmarks/bench_fake_quant.py``).

    Returns:
        float32 ``[R, C]``, column-major.
    """
    rows, cols = x2.shape
    y = x2.t()  # [C, R], row-major
    y = y if y.dtype == torch.float32 else y.float()
    a = y.abs()  # becomes the result, in place
    ab, yb = a.view(cols // bc, bc, rows), y.view(cols // bc, bc, rows)
    amax = ab.amax(dim=1, keepdim=True)  # [C / bc, 1, R]
    if not math.isfinite(float(amax.max())):
        _raise_non_finite(x2, "fake_quantize")
    qscale = _qscale(amax, fmt.max, pow2)
    _round_magnitudes_(ab.mul_(qscale), fmt).copysign_(yb)
    ab.div_(qscale) if divide else ab.mul_(qscale.reciprocal())
    return a.t()


def _fake_quantize_tensor(x: torch.Tensor, granularity: Granularity, fmt: Fp8Format, pow2_scale: bool,
                          divide: bool) -> torch.Tensor:
    """``fake_quantize`` in tensor operations, every case (the scales too)."""
    x2, (br, bc) = _as_2d(x, granularity)
    xb = _blocked(x2, br, bc)  # [gr, br, gc, bc]
    ax, qscale, amax = _block_scales(xb, fmt.max, pow2_scale or granularity.power_of_two)
    if not bool(torch.isfinite(amax).all()):
        _raise_non_finite(x, "fake_quantize")
    # The FP8 values in float32 directly, bit for bit what quantize's cast and fp8_to_float32
    # give: round_to_fp8_grid of x * qscale, computed as |x| * qscale (the |x| amax was taken
    # of; rounding is symmetric in the sign, and a BF16 |x| promotes to float32 exactly) with
    # x's sign copied back: two passes over the operand fewer.
    if qscale.numel() == 1 and x2.is_contiguous() and fmt.dtype == torch.float8_e4m3fn and x.device.type == "cpu":
        # one scale on a row-major operand: the FP8 cast, then the 256-entry table with the
        # scale folded in, takes fewer passes (benchmarks/bench_fake_quant.py); the same floats
        q = (xb.to(torch.float32) * qscale.reshape(())).to(fmt.dtype)
        s = qscale.reshape(()) if divide else qscale.reshape(()).reciprocal()
        return _scale_one(q, s, divide).reshape(x.shape)
    a = ax * qscale[:, None, :, None]
    qb = _round_magnitudes_(a, fmt).copysign_(xb)  # [gr, br, gc, bc]
    s = (qscale if divide else qscale.reciprocal())[:, None, :, None]
    # broadcast over the blocks (ragged ones zero-padded: the padding is cropped after)
    out = qb / s if divide else qb * s
    return _unblocked(out, *x2.shape).reshape(x.shape)


#: input dtypes of the row-major fast paths
_FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: input dtypes of the native kernels (``fp8rl.quant.native``)
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _fake_quantize_one_scale(x: torch.Tensor, fmt: Fp8Format, divide: bool) -> torch.Tensor:
    """``fake_quantize`` with one E4M3 scale (``PerTensor``, no power of two) of a row-major CPU
    tensor: the same floats in 11 tensor operations instead of 25.

    A decode step of a tensorwise engine quantizes a ``[128, 80]`` input in a few microseconds
    of arithmetic and a few hundred of per-operation overhead, so the scale is computed in
    Python from the one amax: ``fl32(fmt.max * (1 / max(amax, EPS)))`` in float64, exactly
    what the tensor path computes (``fmt.max / t`` is ``t.reciprocal() * fmt.max`` in PyTorch;
    float64 division and product are correctly rounded either way), rounded to float32 once;
    the dequantization multiplier ``1 / qscale`` is rounded from float64 too, which equals the
    float32 division (24 <= 53 / 2 - 1: double rounding is innocuous for a quotient). A float
    scalar multiplies a float32 tensor in float32, as the 0-d tensor did.
    """
    a = float(x.abs().amax())
    if not math.isfinite(a):
        _raise_non_finite(x, "fake_quantize")
    qscale = _one_qscale(a, fmt.max)
    q = ((x if x.dtype == torch.float32 else x.float()) * qscale).to(fmt.dtype)
    return _scale_one(q, qscale if divide else _float32(1.0 / qscale), divide)


def _one_qscale(amax: float, fmt_max: float) -> float:
    """``_block_scales``' quantization scale of one block, in Python floats: the same float32."""
    return _float32(fmt_max * (1.0 / max(amax, EPS)))


def _float32(v: float) -> float:
    """``v`` rounded to float32 (to nearest, ties to even), as a Python float."""
    return struct.unpack("f", struct.pack("f", v))[0]
