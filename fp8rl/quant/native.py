"""Native CPU kernels for ``fake_quantize``: the same floats, in two passes over the operand.

At the mini model's sizes an emulated FP8 operand costs more in per-operation overhead and in
passes over memory than in arithmetic: the tensor code reads and writes a ``[1568, 240]``
BF16 gradient eight times (``abs``, a BF16 ``amax`` that PyTorch runs 5x slower than a float32
one on AVX2, the product with the scales with its BF16 -> float32 conversion, the three
integer operations and two float ones of the rounding, ``copysign`` with another conversion,
the dequantization), and a decode step's ``[128, 80]`` input pays ~10 operator calls of a few
microseconds each. Two small C functions do the same work in two passes:

- ``fq_amax``: the amax of every block, as the integer maximum of the magnitudes' bit
  patterns (for non-negative floats the order of the bit patterns is the order of the
  values, so the maximum is exact and vectorises as integer code; a NaN or an infinity has
  the largest patterns and is reported as non-finite, as ``amax`` propagates it);
- ``fq_apply``: per element, ``|x| * qscale`` in float32, rounded onto the FP8 grid by
  ``(a + c) - c`` with ``c`` the format's spacing at ``a``'s binade times ``2^23`` (exactly
  ``fake._round_magnitudes_``), ``x``'s sign copied back, then ``* (1 / qscale)`` or
  ``/ qscale``.

The scales between the two passes are computed in Python, by the very functions the tensor
code uses (``quantize._qscale``; ``fake._one_qscale`` for one scale), so the scale formula has
one home. Every float operation in the C code is a basic IEEE operation (product, sum,
difference, quotient, sign copy) on float32, compiled with ``-ffp-contract=off`` (no fused
multiply-add) and without fast-math, so it rounds exactly as PyTorch's vectorised kernels
do; the bits are tested against the tensor path (``tests/quant/test_quant_native.py``) and,
through whole runs, by the golden numbers (``tests/mini/test_mini_golden.py``).

Built on first use with the C compiler (``$CC``, else ``cc``) into
``$FP8RL_NATIVE_CACHE`` (default ``~/.cache/fp8rl/native``), one shared library per source
text and flags, written under a temporary name and renamed (worker processes building at
once do not collide), loaded with ``ctypes`` (which releases the GIL during a call). The
functions are compiled for the baseline x86-64 and for AVX2 (``target_clones``: the loader
picks by the CPU); the two round identically, being the same IEEE operations. Without a
compiler, or with ``FP8RL_NATIVE=0``, ``fake_quantize`` keeps its tensor code (the same
floats, slower) and :func:`status` says why. One thread: the mini runs use one torch thread
per process.

Inputs: float32 or BFloat16, row-major ``[R, C]`` with ``br x bc`` blocks tiling it (ragged
edge blocks allowed). Everything else (float16, float64, other layouts, other devices) stays
on the tensor code.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CLONES __attribute__((target_clones("avx2", "default")))

static inline uint32_t mag_bits(const void *x, int bf16, int64_t i) {
    if (bf16) return ((uint32_t)(((const uint16_t *)x)[i] & 0x7FFFu)) << 16;
    return ((const uint32_t *)x)[i] & 0x7FFFFFFFu;
}

/* out[gr * gc] (zeroed by the caller): the bit pattern of max |x| over each br x bc block. */
CLONES void fq_amax(const void *x, int bf16, int64_t R, int64_t C, int64_t br, int64_t bc,
                    uint32_t *out) {
    int64_t gc = (C + bc - 1) / bc;
    for (int64_t r = 0; r < R; r++) {
        uint32_t *m = out + (r / br) * gc;
        int64_t row = r * C;
        if (bc == 1) {
            for (int64_t c = 0; c < C; c++) {
                uint32_t b = mag_bits(x, bf16, row + c);
                m[c] = b > m[c] ? b : m[c];
            }
            continue;
        }
        for (int64_t g = 0; g < gc; g++) {
            int64_t c0 = g * bc, c1 = c0 + bc < C ? c0 + bc : C;
            uint32_t best = 0;
            for (int64_t c = c0; c < c1; c++) {
                uint32_t b = mag_bits(x, bf16, row + c);
                best = b > best ? b : best;
            }
            m[g] = best > m[g] ? best : m[g];
        }
    }
}

static inline float as_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t as_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* One element: |x| * q rounded onto the FP8 grid, x's sign, then * d (or / d). */
static inline float fq_one(const void *x, int bf16, int64_t i, float q, float d, int divide,
                           uint32_t min_bits, uint32_t shift) {
    uint32_t xb = bf16 ? ((uint32_t)((const uint16_t *)x)[i]) << 16 : ((const uint32_t *)x)[i];
    float a = as_float(xb & 0x7FFFFFFFu) * q;
    uint32_t e = as_bits(a) & 0x7F800000u;
    e = (e < min_bits ? min_bits : e) + shift;
    float c = as_float(e);
    float r = (a + c) - c;
    r = as_float(as_bits(r) | (xb & 0x80000000u));  /* copysign: r >= 0 */
    return divide ? r / d : r * d;
}

/* out[R * C] = the FP8 value of x (row-major, br x bc blocks), with per-block quantization
   scales q[gr * gc] and dequantization factors d (multipliers, or divisors when divide). */
CLONES void fq_apply(const void *x, int bf16, int64_t R, int64_t C, int64_t br, int64_t bc,
                     const float *q, const float *d, int divide, uint32_t min_bits,
                     uint32_t shift, float *out) {
    int64_t gc = (C + bc - 1) / bc;
    for (int64_t r = 0; r < R; r++) {
        const float *qr = q + (r / br) * gc, *dr = d + (r / br) * gc;
        int64_t row = r * C;
        if (bc == 1) {
            for (int64_t c = 0; c < C; c++)
                out[row + c] = fq_one(x, bf16, row + c, qr[c], dr[c], divide, min_bits, shift);
            continue;
        }
        for (int64_t g = 0; g < gc; g++) {
            int64_t c0 = g * bc, c1 = c0 + bc < C ? c0 + bc : C;
            float qs = qr[g], ds = dr[g];
            for (int64_t c = c0; c < c1; c++)
                out[row + c] = fq_one(x, bf16, row + c, qs, ds, divide, min_bits, shift);
        }
    }
}

/* The whole fake quantization with the scales of quantize._qscale (no power of two):
   qscale = fl32((1 / max(amax, eps)) * fmt_max) in double (PyTorch computes fmt_max / t as
   t.reciprocal() * fmt_max), the multiplier fl32(1 / qscale) (or qscale itself to divide).
   Returns the largest magnitude's bit pattern; when it is not finite (>= 0x7F800000) nothing
   is written to out. */
uint32_t fq_full(const void *x, int bf16, int64_t R, int64_t C, int64_t br, int64_t bc,
                 double fmt_max, double eps, int divide, uint32_t min_bits, uint32_t shift,
                 float *out) {
    int64_t n = ((R + br - 1) / br) * ((C + bc - 1) / bc);
    uint32_t small[2 * 64], *m = n <= 64 ? small : calloc((size_t)n, 2 * sizeof(uint32_t));
    if (!m) return 0xFFFFFFFFu;
    memset(m, 0, (size_t)n * sizeof(uint32_t));
    fq_amax(x, bf16, R, C, br, bc, m);
    uint32_t worst = 0;
    for (int64_t i = 0; i < n; i++) worst = m[i] > worst ? m[i] : worst;
    if (worst < 0x7F800000u) {
        float *q = (float *)m, *d = (float *)(m + n);
        for (int64_t i = 0; i < n; i++) {
            double a = (double)as_float(m[i]);
            float qs = (float)((1.0 / (a < eps ? eps : a)) * fmt_max);
            q[i] = qs;
            d[i] = divide ? qs : 1.0f / qs;
        }
        fq_apply(x, bf16, R, C, br, bc, q, d, divide, min_bits, shift, out);
    }
    if (m != small) free(m);
    return worst;
}
"""

#: Compiler flags: IEEE float semantics (no contraction into fused multiply-adds, no
#: fast-math), position-independent shared library.
FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")

_lib: ctypes.CDLL | None = None
_why: str | None = None  # why the native kernels are off (None: not tried yet, or on)
_tried = False
#: Calls into the C code since the process started (tests check that a run used the kernels).
calls = {"fq_amax": 0, "fq_apply": 0, "fq_full": 0}


def _cache_dir() -> Path:
    return Path(os.environ.get("FP8RL_NATIVE_CACHE") or Path.home() / ".cache" / "fp8rl" / "native")


def _build(cc: str) -> Path:
    """Compile the source (once per source text, flags and compiler) and return the library."""
    key = hashlib.sha256("\0".join((_SOURCE, cc, *FLAGS)).encode()).hexdigest()[:16]
    out = _cache_dir() / f"fq-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp) / "fq.c", Path(tmp) / "fq.so"
        src.write_text(_SOURCE)
        proc = subprocess.run([cc, *FLAGS, "-o", str(lib), str(src)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise OSError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
        os.replace(lib, out)
    return out


def _load() -> ctypes.CDLL | None:
    global _lib, _why, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("FP8RL_NATIVE", "1") == "0":
        _why = "off (FP8RL_NATIVE=0)"
        return None
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        _why = f"off (built for x86-64 Linux only; this is {sys.platform} {os.uname().machine})"
        return None
    cc = os.environ.get("CC") or "cc"
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        _why = f"off (could not build with {cc!r}: {e}); fake_quantize uses its tensor code"
        return None
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.fq_amax.argtypes = [vp, ctypes.c_int, i64, i64, i64, i64, vp]
    lib.fq_amax.restype = None
    lib.fq_apply.argtypes = [vp, ctypes.c_int, i64, i64, i64, i64, vp, vp, ctypes.c_int,
                             ctypes.c_uint32, ctypes.c_uint32, vp]
    lib.fq_apply.restype = None
    lib.fq_full.argtypes = [vp, ctypes.c_int, i64, i64, i64, i64, ctypes.c_double, ctypes.c_double,
                            ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32, vp]
    lib.fq_full.restype = ctypes.c_uint32
    _lib = lib
    return lib


def enabled() -> bool:
    """Whether ``fake_quantize`` uses the native kernels in this process (built on first call;
    ``False`` inside :func:`disabled`)."""
    return not _held_off and _load() is not None


_held_off = 0


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """``fake_quantize`` runs its PyTorch code inside the block (the same floats: for
    comparisons and benchmarks)."""
    global _held_off
    _held_off += 1
    try:
        yield
    finally:
        _held_off -= 1


def status() -> str:
    """``on`` or ``off (why)``."""
    return "on" if enabled() else str(_why)


def supports(x2: torch.Tensor) -> bool:
    """Whether the kernels take ``x2``: a row-major CPU float32 or BFloat16 ``[R, C]`` tensor,
    with the kernels built and not :func:`disabled`."""
    return (x2.dtype in (torch.float32, torch.bfloat16) and x2.device.type == "cpu" and x2.ndim == 2
            and x2.is_contiguous() and enabled())


def block_amax(x2: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """float32 ``[ceil(R / br), ceil(C / bc)]``: ``max |x|`` over each ``br x bc`` block of
    ``x2 [R, C]`` (ragged edge blocks included); ``inf`` or ``nan`` where a block holds a
    non-finite value (``supports(x2)`` must hold)."""
    rows, cols = x2.shape
    out = torch.zeros(-(-rows // br), -(-cols // bc), dtype=torch.int32)
    _lib.fq_amax(x2.data_ptr(), int(x2.dtype == torch.bfloat16), rows, cols, br, bc, out.data_ptr())
    calls["fq_amax"] += 1
    return out.view(torch.float32)


def _grid(fmt) -> tuple[int, int]:
    """The rounding constants of ``fake._round_magnitudes_`` for ``fmt``: the exponent field of
    its smallest normal, and the shift from a binade to the grid's ``2^23``-scaled spacing."""
    got = _GRID.get(fmt.dtype)
    if got is None:
        got = _GRID[fmt.dtype] = ((fmt.min_normal_exp + 127) << 23, (23 - fmt.mantissa_bits) << 23)
    return got


_GRID: dict = {}


def full(x2: torch.Tensor, br: int, bc: int, fmt, divide: bool, eps: float) -> torch.Tensor | None:
    """``fake_quantize`` of ``x2 [R, C]`` (``supports(x2)``) with ``br x bc`` blocks and the
    scales of ``quantize._qscale`` without a power of two, in one call: float32 row-major
    ``[R, C]``, or ``None`` when ``x2`` holds a non-finite value (nothing computed)."""
    rows, cols = x2.shape
    out = torch.empty(rows, cols, dtype=torch.float32)
    min_bits, shift = _grid(fmt)
    worst = _lib.fq_full(x2.data_ptr(), int(x2.dtype == torch.bfloat16), rows, cols, br, bc, fmt.max, eps,
                         int(divide), min_bits, shift, out.data_ptr())
    calls["fq_full"] += 1
    if worst == 0xFFFFFFFF:  # magnitudes have no sign bit: only the scratch allocation fails so
        raise MemoryError(f"fp8rl.quant.native: no memory for the block scales of a {rows} x {cols} operand")
    return None if worst >= 0x7F800000 else out


def apply(x2: torch.Tensor, br: int, bc: int, qscale: torch.Tensor, dq: torch.Tensor, divide: bool,
          fmt) -> torch.Tensor:
    """float32 row-major ``[R, C]``: ``round_to_fp8_grid(|x| * qscale)`` with ``x``'s sign, times
    ``dq`` (or divided by it when ``divide``), per ``br x bc`` block of ``x2 [R, C]``.

    Args:
        qscale, dq: float32 ``[ceil(R / br), ceil(C / bc)]`` contiguous (a 0-d / 1-element
            tensor for one block).
        fmt: the FP8 format (``Fp8Format``).
    """
    rows, cols = x2.shape
    out = torch.empty(rows, cols, dtype=torch.float32)
    min_bits, shift = _grid(fmt)
    _lib.fq_apply(x2.data_ptr(), int(x2.dtype == torch.bfloat16), rows, cols, br, bc,
                  qscale.data_ptr(), dq.data_ptr(), int(divide), min_bits, shift, out.data_ptr())
    calls["fq_apply"] += 1
    return out
