"""Native CPU kernels for ``fake_quantize``: the same floats, in two passes over the operand.

At the mini model's sizes an emulated FP8 operand costs more in per-operation overhead and in
passes over memory than in arithmetic: the tensor code reads and writes a ``[1568, 240]``
BF16 gradient eight times (``abs``, a BF16 ``amax`` that PyTorch runs 5x slower than a float32
one on AVX2, the product with the scales with its BF16 -> float32 conversion, the three
integer operations and two float ones of the rounding, ``copysign`` with another conversion,
the dequantization), and a decode step's ``[128, 80]`` input pays ~10 operator calls of a few
microseconds each. Small C functions (``csrc/fake_quantize.c``) do the same work in two passes:

- ``fq_amax``: the amax of every block, as the integer maximum of the magnitudes' bit
  patterns (for non-negative floats the order of the bit patterns is the order of the
  values, so the maximum is exact and vectorises as integer code; a NaN or an infinity has
  the largest patterns and is reported as non-finite, as ``amax`` propagates it);
- ``fq_apply``: per element, ``|x| * qscale`` in float32, rounded onto the FP8 grid by
  ``(a + c) - c`` with ``c`` the format's spacing at ``a``'s binade times ``2^23`` (exactly
  ``formats.round_magnitudes_``), ``x``'s sign copied back, then ``* (1 / qscale)`` or
  ``/ qscale``;
- ``fq_full``: both passes in one call, with the scales computed in C (in double, as
  ``quantize._qscale`` computes them without a power of two), for the common case;
- ``mq_full``: the same for the FP4 / FP6 operands of ``fp8rl.quant.microscale`` (MX's E8M0 and
  NVFP4's two-level scales, computed as its tensor code computes them; elements rounded to
  nearest even, or stochastically with draws the caller takes from PyTorch), called through
  :func:`microscaled` by ``microscale.fake_quantize_microscaled``.

The scale formula has three homes, tested to agree bit for bit: ``quantize._qscale`` (the
tensor code, and the scales :func:`apply` is given), ``fake._one_qscale`` (one scale, in Python
floats) and ``fq_full``'s C. Every float operation in the C code is a basic IEEE operation (product, sum,
difference, quotient, sign copy) on float32, compiled with ``-ffp-contract=off`` (no fused
multiply-add) and without fast-math, so it rounds exactly as PyTorch's vectorised kernels
do; the bits are tested against the tensor path (``tests/quant/test_quant_native_proc.py``) and,
through whole runs, by the golden numbers (``tests/mini/test_mini_golden_proc.py``).

Built on first use with the C compiler (``$CC``, else ``cc``) into
``$FP8RL_NATIVE_CACHE`` (default ``~/.cache/fp8rl/native``), one shared library per
:func:`cache_key` (source text, compiler and its ``--version``, flags, platform), written under
a temporary name and renamed (worker processes building at
once do not collide), loaded with ``ctypes`` (which releases the GIL during a call). The
functions are compiled for the baseline x86-64 and for AVX2 (``target_clones``: the loader
picks by the CPU); the two round identically, being the same IEEE operations. Without a
compiler, or with ``FP8RL_NATIVE=0``, ``fake_quantize`` keeps its tensor code (the same
floats, slower) and :func:`status` says why. One thread: the mini runs use one torch thread
per process.

Inputs: float32 or BFloat16, row-major ``[R, C]`` with ``br x bc`` blocks tiling it (ragged
edge blocks allowed). Everything else (float16, float64, other layouts, other devices) stays
on the tensor code; every tensor is checked (dtype, device, layout, size) before its pointer
is passed, and a wrong one raises ``ValueError`` instead of being read as something else.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

#: The C source (a package file, built on first use).
SOURCE = Path(__file__).with_name("csrc") / "fake_quantize.c"

#: Compiler flags: IEEE float semantics (no contraction into fused multiply-adds, no
#: fast-math), position-independent shared library.
FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")

_lib: ctypes.CDLL | None = None
_why: str | None = None  # why the native kernels are off (None: not tried yet, or on)
_tried = False
#: Calls into the C code since the process started (tests check that a run used the kernels).
calls = {"fq_amax": 0, "fq_apply": 0, "fq_full": 0, "mq_full": 0}


def _cache_dir() -> Path:
    return Path(os.environ.get("FP8RL_NATIVE_CACHE") or Path.home() / ".cache" / "fp8rl" / "native")


def compiler_identity(cc: str) -> str:
    """``cc --version``'s first line (what the cache key holds: another compiler, or another
    version of it, builds its own library); raises ``OSError`` when ``cc`` does not run."""
    try:
        proc = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise OSError(f"{cc} --version failed: {e}") from e
    if proc.returncode != 0:
        raise OSError(f"{cc} --version failed ({proc.returncode}): {proc.stderr.strip()[-200:]}")
    return (proc.stdout.strip().splitlines() or [""])[0]


def cache_key(source: str, cc: str, identity: str) -> str:
    """16 hex digits of the source text, the compiler (its name and ``--version``), the flags and
    the platform (OS, machine, C library): what decides the library that is built."""
    plat = (sys.platform, platform.machine(), *platform.libc_ver())
    return hashlib.sha256("\0".join((source, cc, identity, *FLAGS, *plat)).encode()).hexdigest()[:16]


def _build(cc: str) -> Path:
    """Compile :data:`SOURCE` (once per :func:`cache_key`) and return the library."""
    source = SOURCE.read_text(encoding="utf-8")
    out = _cache_dir() / f"fq-{cache_key(source, cc, compiler_identity(cc))}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp) / "fq.c", Path(tmp) / "fq.so"
        src.write_text(source)
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
    u32, dbl = ctypes.c_uint32, ctypes.c_double
    lib.mq_full.argtypes = [vp, ctypes.c_int, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int32, dbl, dbl,
                            u32, u32, u32, ctypes.c_float, vp, i64, i64, vp]
    lib.mq_full.restype = u32
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
    rows, cols = _checked(x2, br, bc)
    out = torch.zeros(-(-rows // br), -(-cols // bc), dtype=torch.int32)
    _lib.fq_amax(x2.data_ptr(), int(x2.dtype == torch.bfloat16), rows, cols, br, bc, out.data_ptr())
    calls["fq_amax"] += 1
    return out.view(torch.float32)


def _checked(x2: torch.Tensor, br: int, bc: int) -> tuple[int, int]:
    """``x2``'s ``(R, C)`` once it is what the C code reads (a row-major float32 or BFloat16 CPU
    ``[R, C]`` tensor, blocks of positive size) and the kernels are loaded: a pointer to anything
    else would be read as if it were (:func:`supports` is the caller's test; this is the guard)."""
    if _lib is None:
        raise RuntimeError(f"fp8rl.quant.native: the kernels are {status()}")
    if not (x2.dtype in (torch.float32, torch.bfloat16) and x2.device.type == "cpu" and x2.ndim == 2
            and x2.is_contiguous()):
        raise ValueError("fp8rl.quant.native: the operand must be a row-major float32 or bfloat16 CPU [R, C] "
                         f"tensor, got {x2.dtype} {tuple(x2.shape)} strides {x2.stride()} on {x2.device}")
    if int(br) < 1 or int(bc) < 1:
        raise ValueError(f"fp8rl.quant.native: blocks must be at least 1 x 1, got {br} x {bc}")
    return x2.shape


def _grid(fmt) -> tuple[int, int]:
    """The rounding constants of ``formats.round_magnitudes_`` for ``fmt``: the exponent field of
    its smallest normal, and the shift from a binade to the grid's ``2^23``-scaled spacing."""
    got = _GRID.get(fmt.name)  # FP8 and sub-byte formats alike (the sub-byte ones have no dtype)
    if got is None:
        got = _GRID[fmt.name] = ((fmt.min_normal_exp + 127) << 23, (23 - fmt.mantissa_bits) << 23)
    return got


_GRID: dict = {}


def full(x2: torch.Tensor, br: int, bc: int, fmt, divide: bool, eps: float) -> torch.Tensor | None:
    """``fake_quantize`` of ``x2 [R, C]`` (``supports(x2)``) with ``br x bc`` blocks and the
    scales of ``quantize._qscale`` without a power of two, in one call: float32 row-major
    ``[R, C]``, or ``None`` when ``x2`` holds a non-finite value (nothing computed)."""
    rows, cols = _checked(x2, br, bc)
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
    rows, cols = _checked(x2, br, bc)
    blocks = -(-rows // br) * -(-cols // bc)
    for name, t in (("qscale", qscale), ("dq", dq)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != blocks:
            raise ValueError(f"fp8rl.quant.native.apply: {name} must be a contiguous float32 CPU tensor of "
                             f"{blocks} block values, got {t.dtype} {tuple(t.shape)} on {t.device}")
    out = torch.empty(rows, cols, dtype=torch.float32)
    min_bits, shift = _grid(fmt)
    _lib.fq_apply(x2.data_ptr(), int(x2.dtype == torch.bfloat16), rows, cols, br, bc,
                  qscale.data_ptr(), dq.data_ptr(), int(divide), min_bits, shift, out.data_ptr())
    calls["fq_apply"] += 1
    return out


def microscaled(x2: torch.Tensor, br: int, bc: int, fmt, nv: bool, eps: float, tensor_range: float,
                u: torch.Tensor | None = None, u_strides: tuple[int, int] = (0, 0)) -> torch.Tensor | None:
    """``microscale.fake_quantize_microscaled`` of ``x2 [R, C]`` (``supports(x2)``) with ``br x bc``
    blocks in one call: float32 row-major ``[R, C]``, or ``None`` when ``x2`` holds a non-finite
    value (nothing computed).

    Args:
        fmt: the element format (``SubByteFormat``: its grid, ``max`` and, for MX, ``emax``).
        nv: NVFP4's two-level scales (``eps`` and ``tensor_range`` its per-tensor scale's floor and
            range), else MX's E8M0 scales.
        u: float32 uniform draws for stochastic rounding (``None``: nearest even), contiguous; the
            draw of element ``(r, c)`` is ``u.view(-1)[r * u_strides[0] + c * u_strides[1]]``.
    """
    rows, cols = _checked(x2, br, bc)
    su_r, su_c = (int(s) for s in u_strides)
    if u is not None:
        last = (rows - 1) * su_r + (cols - 1) * su_c
        if (u.dtype != torch.float32 or u.device.type != "cpu" or not u.is_contiguous() or min(su_r, su_c) < 0
                or last >= u.numel()):
            raise ValueError(f"fp8rl.quant.native.microscaled: u must be a contiguous float32 CPU tensor holding "
                             f"element {last} (strides {u_strides} over {rows} x {cols}), got {u.dtype} "
                             f"{tuple(u.shape)} on {u.device}")
    out = torch.empty(rows, cols, dtype=torch.float32)
    min_bits, shift = _grid(fmt)
    worst = _lib.mq_full(x2.data_ptr(), int(x2.dtype == torch.bfloat16), rows, cols, br, bc, int(nv),
                         int(fmt.emax), eps, tensor_range, min_bits, shift, fmt.mantissa_bits << 23, fmt.max,
                         None if u is None else u.data_ptr(), su_r, su_c, out.data_ptr())
    calls["mq_full"] += 1
    if worst == 0xFFFFFFFF:
        raise MemoryError(f"fp8rl.quant.native: no memory for the block scales of a {rows} x {cols} operand")
    return None if worst >= 0x7F800000 else out
