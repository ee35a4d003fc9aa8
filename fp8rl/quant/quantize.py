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

The emulated operands (``fake_quantize``: these FP8 values in float32, without an FP8 tensor)
are in ``fp8rl.quant.fake``.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from fp8rl.quant.formats import E4M3, Fp8Format
from fp8rl.quant.granularity import Granularity, PerTensor

__all__ = [
    "EPS",
    "NonFiniteError",
    "dequantize",
    "fp8_to_float32",
    "quantize",
    "quantize_with_scale",
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
    if fmt.dtype is None:
        raise TypeError(
            f"quantize: {fmt.name} has no torch dtype; FP4/FP6 operands are quantized by "
            "fp8rl.quant.microscale.quantize_microscaled (codes and scales)"
        )
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
