"""Quantize to FP8 with dynamic scales, and back.

Method (torchao ``float8_utils.amax_to_scale`` / ``_ToFloat8ConstrFunc``, reproduced exactly):

    amax   = max |x| over the block                  (in x's dtype, exact)
    qscale = fp32( fmt.max / max(fp64(amax), EPS) )   (EPS = 1e-12; a block of zeros stays finite)
    qscale = 2 ** floor(log2(qscale))                 (only for power-of-two scales)
    q      = fp8( fp32(x) * qscale )                  (round to nearest even)
    scale  = 1 / qscale                               (returned: the *dequantization multiplier*)

so that ``x ~= q * scale`` (block-broadcast). The returned ``scale`` is what ``torch._scaled_mm``
takes as ``scale_a``/``scale_b`` and what vLLM stores as ``weight_scale`` / ``weight_scale_inv``
(the latter name notwithstanding, see ``rollout.py``); torchao stores the reciprocal
(``Float8TrainingTensor._scale`` is ``qscale``). For power-of-two scales ``1 / qscale`` is exact,
so dequantization is bit-identical to torchao's ``q / qscale``; otherwise the two differ by at
most one float32 rounding per element.

Choices made here (the spec was silent or sources differ):

- **Saturation.** With dynamic scales ``|x * qscale| <= fmt.max`` up to one float32 rounding,
  and round-to-nearest maps that to ``fmt.max``, so the explicit clamp torchao adds for
  PyTorch <= 2.11 is not needed on this path (finite huge values map to ``+-fmt.max``).
  ``quantize_with_scale`` (static, caller-given scales, e.g. vLLM ``input_scale``) clamps
  explicitly, so out-of-range values saturate to ``+-fmt.max`` on any PyTorch version.
- **Power-of-two (MX, E8M0) scales** round the quantization multiplier *down* (the dequant
  scale up), as torchao's ``round_scales_to_power_of_2`` and Transformer Engine's MXFP8 do, so
  no element saturates. The OCP MX spec's ``floor(log2(amax)) - emax`` rule would clip the
  largest values instead; we do not use it. Exponents are clamped to E8M0's [-127, 127].
- **Non-finite input raises** (``NonFiniteError``) naming the shape, the index of the first
  non-finite element and the count: FP8 casts would otherwise turn ``inf`` into ``448`` silently
  (PyTorch >= 2.12 saturates) and NaN would poison a whole block's scale.
- **Inputs**: float32, bfloat16 and float16 are quantized as is (upcast to float32 for the
  multiply, as torchao does); float64 is first cast to float32. Empty tensors raise.
"""

from __future__ import annotations

import functools
import math
import struct

import torch
import torch.nn.functional as F

from fp8rl.quant.formats import E4M3, Fp8Format
from fp8rl.quant.granularity import Granularity, PerTensor

__all__ = [
    "EPS",
    "NonFiniteError",
    "dequantize",
    "fake_quantize",
    "fp8_to_float32",
    "quantize",
    "quantize_with_scale",
    "round_to_fp8_grid",
    "sqnr_db",
]

#: Smallest amax used to compute a scale (torchao ``float8_utils.EPS``).
EPS = 1e-12
_E8M0_MAX_EXP = 127


class NonFiniteError(ValueError):
    """Quantization input holds inf or NaN; the message says where."""


def _as_2d(x: torch.Tensor, granularity: Granularity) -> tuple[torch.Tensor, tuple[int, int]]:
    """View ``x`` as ``[R, C]`` (leading dims folded into rows) and return its block shape."""
    if not x.is_floating_point() or x.dtype.itemsize == 1:
        raise TypeError(f"quantize needs a float32/bfloat16/float16 tensor, got {x.dtype}")
    if x.ndim == 0 or x.numel() == 0:
        raise ValueError(f"quantize needs a non-empty tensor with >= 1 dim, got shape {tuple(x.shape)}")
    if x.dtype == torch.float64:
        x = x.float()
    x2 = x.reshape(-1, x.shape[-1])
    br, _ = granularity.block_shape(*x2.shape)
    if br > 1 and x.ndim != 2 and not isinstance(granularity, PerTensor):
        raise ValueError(
            f"{granularity} has blocks of {br} rows, which needs a 2-D operand; got shape "
            f"{tuple(x.shape)}: reshape to [rows, cols] first (cols = contraction dim)"
        )
    return x2, _block_in(granularity, *x2.shape)


def _block_in(granularity: Granularity, rows: int, cols: int) -> tuple[int, int]:
    """The block shape of ``granularity`` on ``[rows, cols]``, clamped to the operand.

    A block dimension longer than the operand's (a 128 x 128 block on the mini model's 64-wide
    weights) holds one block along it either way; clamping it skips the zero padding, which
    changes no amax, no scale and no quantized value, and halves the work of ``blockwise`` on
    64-wide operands.
    """
    br, bc = granularity.block_shape(rows, cols)
    return min(br, max(rows, 1)), min(bc, max(cols, 1))


def _raise_non_finite(x: torch.Tensor, where: str) -> None:
    bad = ~torch.isfinite(x)
    idx = tuple(int(i) for i in bad.nonzero()[0].tolist())
    raise NonFiniteError(
        f"{where}: input of shape {tuple(x.shape)} and dtype {x.dtype} has a non-finite value "
        f"({x[idx].item()}) at index {idx} (first of {int(bad.sum())} non-finite elements); "
        "FP8 scaling needs finite input -- look at what produced this tensor (overflow, "
        "a division by zero, a bad learning rate)"
    )


def _blocked(x2: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """Zero-pad ``[R, C]`` to whole blocks and view it as ``[gr, br, gc, bc]``."""
    rows, cols = x2.shape
    gr, gc = math.ceil(rows / br), math.ceil(cols / bc)
    if gr * br != rows or gc * bc != cols:
        x2 = F.pad(x2, (0, gc * bc - cols, 0, gr * br - rows))
    return x2.reshape(gr, br, gc, bc)


def _block_scales(
    xb: torch.Tensor, fmt_max: float, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(|xb|, qscale, amax)`` of blocks ``xb [gr, br, gc, bc]``: ``qscale`` and ``amax`` ``[gr, gc]``."""
    ax = xb.abs()
    # abs + amax: measured 4-14x faster than linalg.vector_norm(ord=inf) on CPU (torch 2.13,
    # one thread, the mini model's GEMM operands); the same maximum, bit for bit
    amax = ax.amax(dim=(1, 3))
    return ax, _qscale(amax, fmt_max, pow2), amax


def _qscale(amax: torch.Tensor, fmt_max: float, pow2: bool) -> torch.Tensor:
    """float32 quantization scales ``fmt_max / max(amax, EPS)`` (computed in float64), rounded
    down to a power of two when ``pow2``; ``amax``'s shape."""
    qscale = (fmt_max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    if pow2:
        qscale = torch.exp2(torch.floor(torch.log2(qscale)).clamp(-_E8M0_MAX_EXP, _E8M0_MAX_EXP))
    return qscale


def _unblocked(yb: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``[gr, br, gc, bc]`` back to ``[rows, cols]``, the padding cropped (contiguous then)."""
    y = yb.reshape(yb.shape[0] * yb.shape[1], yb.shape[2] * yb.shape[3])
    return y if y.shape == (rows, cols) else y[:rows, :cols].contiguous()


def _quantize_blocks(
    x2: torch.Tensor, br: int, bc: int, fmt_max: float, pow2: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Core of ``quantize`` on ``[R, C]`` with ``br x bc`` blocks: ``(q [R, C], qscale, amax)``.

    ``qscale`` and ``amax`` are ``[gr, gc]``. Pure tensor code without data-dependent control
    flow, so ``torch.compile`` fuses it (``quantize(..., compile=True)``).
    """
    xb = _blocked(x2, br, bc)  # [gr, br, gc, bc]
    _, qscale, amax = _block_scales(xb, fmt_max, pow2)
    # float32 multiply (as torchao), round-to-nearest-even cast; see the module docstring on saturation
    q = (xb.to(torch.float32) * qscale[:, None, :, None]).to(dtype)
    return _unblocked(q, *x2.shape), qscale, amax


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


def _round_magnitudes_(a: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """``round_to_fp8_grid`` of a float32 tensor ``a >= 0`` (or ``-0.0``), in place; returns ``a``."""
    c_bits = a.view(torch.int32) & 0x7F800000  # |y|'s exponent field: 2^e
    c_bits.clamp_(min=(fmt.min_normal_exp + 127) << 23).add_((23 - fmt.mantissa_bits) << 23)
    c = c_bits.view(torch.float32)
    return a.add_(c).sub_(c)


@functools.cache
def _compiled_quantize_blocks():
    return torch.compile(_quantize_blocks, dynamic=False)


def quantize(
    x: torch.Tensor,
    granularity: Granularity,
    fmt: Fp8Format = E4M3,
    *,
    pow2_scale: bool = False,
    compile: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to FP8 with one dynamic scale per block of ``granularity``.

    Args:
        x: ``[..., C]`` float tensor; ``C`` is the contraction dimension (see ``granularity.py``).
        granularity: ``PerTensor()``, ``PerRow()``, ``PerBlock(r, c)`` or ``MX(32)``.
        fmt: ``E4M3`` or ``E5M2``.
        pow2_scale: round scales to powers of two (always on for ``MX``).
        compile: run the core through ``torch.compile`` (one compilation per shape and
            granularity; worth it for repeated fixed shapes, see ``benchmarks/bench_quant.py``).

    Returns:
        ``(q, scale)``: ``q`` has ``x``'s shape and ``fmt.dtype``; ``scale`` is float32, the
        dequantization multiplier per block, of shape ``()`` (PerTensor), ``(*lead, ceil(C/bc))``
        (one-row blocks: PerRow gives ``(*lead, 1)``), or ``(ceil(R/br), ceil(C/bc))``.

    Raises:
        NonFiniteError: ``x`` contains inf or NaN (the message gives the first index).
    """
    x2, (br, bc) = _as_2d(x, granularity)
    core = _compiled_quantize_blocks() if compile else _quantize_blocks
    q, qscale, amax = core(x2, br, bc, fmt.max, pow2_scale or granularity.power_of_two, fmt.dtype)
    if not bool(torch.isfinite(amax).all()):
        _raise_non_finite(x, "quantize")
    scale = qscale.reciprocal()
    if isinstance(granularity, PerTensor):
        scale = scale.reshape(())
    elif br == 1:
        scale = scale.reshape(*x.shape[:-1], scale.shape[-1])
    return q.reshape(x.shape), scale


@functools.cache
def _float32_table(dtype: torch.dtype) -> torch.Tensor:
    """``[256]`` float32: the value of every FP8 bit pattern (PyTorch's own conversion of each)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)


def _table_ok(q: torch.Tensor) -> bool:
    return q.dtype == torch.float8_e4m3fn and q.device.type == "cpu" and q.is_contiguous()


def _lookup(q: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``table[bits of q]``: ``[256]`` float32 table, contiguous FP8 ``q`` -> float32, q's shape."""
    codes = q.view(torch.uint8).reshape(-1).to(torch.int32)
    return table.index_select(0, codes).view(q.shape)


def fp8_to_float32(q: torch.Tensor) -> torch.Tensor:
    """``q.to(torch.float32)`` for an FP8 tensor, bit for bit, faster on CPU for E4M3.

    PyTorch converts ``float8_e4m3fn`` to float32 element by element on CPU (~5 ns per element,
    the slowest elementwise op of an emulated FP8 GEMM); a table of all 256 values indexed by
    the bit pattern gives the same floats 4-7x faster (``benchmarks/bench_quant.py``). The
    table *is* PyTorch's conversion applied to every code, so the result is identical,
    NaN and -0 included. Contiguous CPU E4M3 input only; anything else takes ``.to``.
    """
    if not _table_ok(q):
        return q.to(torch.float32)
    return _lookup(q, _float32_table(q.dtype))


def _scale_one(q: torch.Tensor, s: torch.Tensor | float, divide: bool) -> torch.Tensor:
    """``fp32(q) * s`` (or ``/ s``) for one scalar scale ``s`` (a 0-d float32 tensor, or a
    Python float holding a float32 value: the same product).

    On the table path the scale is folded into the 256-entry table first: entry ``v`` becomes
    ``fl(v * s)``, the very float the per-element product gives, so one pass over ``q`` less.
    """
    if _table_ok(q):
        t = _float32_table(q.dtype)
        return _lookup(q, t / s if divide else t * s)
    qf = q.to(torch.float32)
    return qf / s if divide else qf * s


def _expand_scale(scale: torch.Tensor, rows: int, cols: int, br: int, bc: int) -> torch.Tensor:
    """Broadcast a ``[gr, gc]`` block scale to ``[rows, cols]`` (ragged edges cropped)."""
    return scale.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    granularity: Granularity,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``quantize``: ``q * scale`` broadcast over blocks, cast to ``dtype``.

    Args:
        q: FP8 tensor ``[..., C]`` as returned by ``quantize``.
        scale: its dequantization scale (shape as documented in ``quantize``).
        granularity: the granularity ``q`` was quantized with.
        dtype: output dtype; the multiply is done in float32.
    """
    q2 = q.reshape(-1, q.shape[-1])
    rows, cols = q2.shape
    br, bc = _block_in(granularity, rows, cols)
    gr, gc = granularity.grid(rows, cols)
    if isinstance(granularity, PerTensor):
        if scale.numel() != 1:
            raise ValueError(f"PerTensor scale must have one element, got shape {tuple(scale.shape)}")
        return _scale_one(q, scale.reshape(()).to(torch.float32), divide=False).to(dtype)
    s2 = scale.reshape(gr, gc) if br > 1 else scale.reshape(rows, gc)
    if br == 1 and gc * bc == cols:  # fast path: broadcast without materialising the scale
        out = fp8_to_float32(q2).reshape(rows, gc, bc) * s2[:, :, None]
    else:
        out = fp8_to_float32(q2) * _expand_scale(s2, rows, cols, br, bc)
    return out.reshape(q.shape).to(dtype)


def fake_quantize(
    x: torch.Tensor,
    granularity: Granularity,
    fmt: Fp8Format = E4M3,
    *,
    pow2_scale: bool = False,
    divide: bool = False,
) -> torch.Tensor:
    """The FP8 value of every element of ``x``, in float32: quantize, then dequantize.

    What an emulated FP8 GEMM feeds its float32 matmul. ``divide=False`` dequantizes as
    :func:`dequantize` does, ``q * (1 / qscale)`` (the dequantization multiplier that
    ``torch._scaled_mm``, vLLM and Transformer Engine apply); ``divide=True`` as torchao's
    emulated GEMM does, ``q / qscale`` (``Float8TrainingTensor._data.float() / _scale``). The
    two differ by at most one float32 rounding per element unless the scale is a power of two.

    Args:
        x: ``[..., C]`` float tensor (``C`` the contraction dimension); shapes as ``quantize``.
    Returns:
        float32 tensor of ``x``'s shape (row-major).
    Raises:
        NonFiniteError: ``x`` contains inf or NaN.
    """
    if x.dtype in _FAST_DTYPES and x.device.type == "cpu" and x.ndim and x.is_contiguous():  # row-major
        if type(granularity) is PerTensor:
            if not pow2_scale and fmt.dtype == torch.float8_e4m3fn:
                return _fake_quantize_one_scale(x, fmt, divide)
        else:
            x2, (br, bc) = _as_2d(x, granularity)
            if br == 1 and x2.shape[1] % bc == 0:
                return _fake_quantize_rows(x2, bc, fmt, pow2_scale or granularity.power_of_two, divide).view(x.shape)
    return _fake_quantize_tensor(x, granularity, fmt, pow2_scale, divide)


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


def quantize_with_scale(
    x: torch.Tensor,
    scale: torch.Tensor,
    granularity: Granularity,
    fmt: Fp8Format = E4M3,
) -> torch.Tensor:
    """Quantize with a caller-given (static) dequantization ``scale``; saturates to ``+-fmt.max``.

    Used where the scale is not computed from ``x`` itself (vLLM's static ``input_scale``).
    Shapes as in ``quantize``. Raises ``NonFiniteError`` on inf/NaN input.
    """
    x2, (br, bc) = _as_2d(x, granularity)
    if not bool(torch.isfinite(x2).all()):
        _raise_non_finite(x, "quantize_with_scale")
    rows, cols = x2.shape
    gr, gc = granularity.grid(rows, cols)
    if isinstance(granularity, PerTensor):
        s = scale.reshape(()).to(torch.float32)
    else:
        s2 = scale.reshape(gr, gc) if br > 1 else scale.reshape(rows, gc)
        s = _expand_scale(s2.to(torch.float32), rows, cols, br, bc)
    y = (x2.to(torch.float32) / s).clamp(-fmt.max, fmt.max)
    return y.to(fmt.dtype).reshape(x.shape)


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``20 log10(||x|| / ||x - x_hat||)`` in dB (torchao ``compute_error``)."""
    x = x.to(torch.float64)
    noise = torch.linalg.vector_norm(x - x_hat.to(torch.float64))
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(torch.linalg.vector_norm(x) / noise))
