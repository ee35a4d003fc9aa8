"""FP8 number formats (the OCP FP8 pair) as small frozen dataclasses.

``E4M3`` (``torch.float8_e4m3fn``, largest finite 448, no infinities) is used for weights and
activations; ``E5M2`` (``torch.float8_e5m2``, largest finite 57344) has more range and less
precision and is used for gradients in "hybrid" recipes (Transformer Engine's ``Format.HYBRID``;
torchao's ``tensorwise`` recipe casts ``grad_output`` to E5M2 by default). Paper section
"FP8 scaling granularities" in ``reference/paper.md``.

The ROCm ``fnuz`` variants are deliberately absent (the project targets NVIDIA and CPU);
adding them is a new registry entry, not a code change.

Sub-byte element formats (``SubByteFormat``): FP4 ``E2M1`` and FP6 ``E2M3`` / ``E3M2`` of the OCP
Microscaling Formats (MX) Specification v1.0, section 5.3 (tables 4 and 5; ``E2M1`` is also the
element of NVIDIA's NVFP4). They have no one-byte torch dtype (CPU torch 2.13 has only the
packed ``torch.float4_e2m1fn_x2``, two codes per byte, with no arithmetic), so a
``SubByteFormat`` is defined by its bit fields alone: 1 sign bit, ``exp_bits`` exponent bits
with bias ``2^(exp_bits-1) - 1``, ``man_bits`` mantissa bits, subnormals at exponent field 0,
and **no Inf or NaN encoding**: every code is a finite number (MX v1.0 5.3), so the largest
finite value is the all-ones exponent and mantissa (E2M1 6, E2M3 7.5, E3M2 28). Conversion to
them saturates: a value above the largest finite one becomes it (MX v1.0 5.3 and 6.3: "clamped
to the maximum normal"), which ``fp8rl.quant.microscale`` applies after rounding to nearest
even. Codes are stored unpacked, one per ``uint8`` (``SubByteFormat.values()`` decodes them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8rl.registry import Registry

__all__ = ["E2M1", "E2M3", "E3M2", "E4M3", "E5M2", "FORMATS", "ElementFormat", "Fp8Format", "SubByteFormat",
           "round_magnitudes_", "round_magnitudes_stochastic_"]


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 element format.

    Attributes:
        name: short name used in run names and configs (``"e4m3"``, ``"e5m2"``).
        dtype: the torch storage dtype.
    """

    name: str
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not (self.dtype.is_floating_point and self.dtype.itemsize == 1):
            raise ValueError(
                f"Fp8Format {self.name!r} needs a 1-byte floating dtype, got {self.dtype}; "
                "use torch.float8_e4m3fn or torch.float8_e5m2"
            )

    @property
    def max(self) -> float:
        """Largest finite value (448 for E4M3, 57344 for E5M2)."""
        return float(torch.finfo(self.dtype).max)

    @property
    def mantissa_bits(self) -> int:
        """Explicit mantissa bits (3 for E4M3, 2 for E5M2)."""
        return -int(math.log2(torch.finfo(self.dtype).eps))

    @property
    def min_normal_exp(self) -> int:
        """Exponent of the smallest normal value (-6 for E4M3, -14 for E5M2)."""
        return int(math.log2(torch.finfo(self.dtype).smallest_normal))

    def short_str(self) -> str:
        return self.name


@dataclass(frozen=True)
class SubByteFormat:
    """One OCP MX sub-byte float element format (FP4 / FP6), defined by its bit fields.

    Attributes:
        name: short name (``"e2m1"``, ``"e2m3"``, ``"e3m2"``).
        exp_bits, man_bits: exponent and explicit mantissa bits (1 sign bit besides).

    No torch dtype: values are float32 on the format's grid, codes ``uint8`` (one per byte).
    """

    name: str
    exp_bits: int
    man_bits: int

    def __post_init__(self) -> None:
        if self.exp_bits < 1 or self.man_bits < 0 or 1 + self.exp_bits + self.man_bits > 8:
            raise ValueError(
                f"SubByteFormat {self.name!r}: need exp_bits >= 1, man_bits >= 0 and at most 8 bits "
                f"in all, got E{self.exp_bits}M{self.man_bits}"
            )

    #: no torch storage dtype (the codes are uint8, one per byte)
    dtype = None

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exp_bits - 1) - 1

    @property
    def mantissa_bits(self) -> int:
        return self.man_bits

    @property
    def min_normal_exp(self) -> int:
        """Exponent of the smallest normal value, ``1 - bias`` (0 for E2M1/E2M3, -2 for E3M2)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest normal value (2 for E2M1/E2M3, 4 for E3M2; MX v1.0 table 4)."""
        return 2**self.exp_bits - 1 - self.bias

    @property
    def max(self) -> float:
        """Largest finite value: all exponent and mantissa bits set (no Inf/NaN codes)."""
        return (2.0 - 2.0 ** -self.man_bits) * 2.0**self.emax

    def values(self) -> torch.Tensor:
        """float32 ``[2**bits]``: the value of every code (sign bit the top bit), from the bit
        fields: ``(-1)^s 2^(1-bias) (m / 2^M)`` at exponent field 0, else
        ``(-1)^s 2^(e-bias) (1 + m / 2^M)``."""
        out = []
        for code in range(2**self.bits):
            sign = -1.0 if code >> (self.bits - 1) else 1.0
            e = (code >> self.man_bits) & (2**self.exp_bits - 1)
            m = code & (2**self.man_bits - 1)
            frac = m / 2.0**self.man_bits
            mag = 2.0 ** (1 - self.bias) * frac if e == 0 else 2.0 ** (e - self.bias) * (1 + frac)
            out.append(sign * mag)
        return torch.tensor(out, dtype=torch.float32)

    def short_str(self) -> str:
        return self.name


#: What an operand may be cast to: an FP8 format or a sub-byte OCP MX element format.
ElementFormat = Fp8Format | SubByteFormat

FORMATS: Registry[ElementFormat] = Registry("element format")
E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2)
FORMATS.add(E4M3.name, E4M3)
FORMATS.add(E5M2.name, E5M2)
E2M1 = SubByteFormat("e2m1", 2, 1)
E2M3 = SubByteFormat("e2m3", 2, 3)
E3M2 = SubByteFormat("e3m2", 3, 2)
for _f in (E2M1, E2M3, E3M2):
    FORMATS.add(_f.name, _f)


def round_magnitudes_(a: torch.Tensor, fmt) -> torch.Tensor:
    """Round a float32 tensor ``a >= 0`` (or ``-0.0``) to ``fmt``'s grid, nearest even, in place;
    returns ``a`` (no saturation). ``fmt``: any format with ``min_normal_exp`` and
    ``mantissa_bits`` (FP8, FP6, FP4). Adding and subtracting ``c = 2^(e + 23 - m)`` (``e`` the
    value's exponent, at least the smallest normal's) leaves the float32 addition to round at the
    format's last mantissa bit, ties to even, subnormals included (``fake.round_to_fp8_grid``,
    ``microscale``)."""
    c_bits = a.view(torch.int32) & 0x7F800000  # |y|'s exponent field: 2^e
    c_bits.clamp_(min=(fmt.min_normal_exp + 127) << 23).add_((23 - fmt.mantissa_bits) << 23)
    c = c_bits.view(torch.float32)
    return a.add_(c).sub_(c)


def round_magnitudes_stochastic_(a: torch.Tensor, fmt, u: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of a float32 tensor ``a >= 0`` onto ``fmt``'s grid, in place; returns ``a``
    (no saturation). ``u``: float32 uniform draws in ``[0, 1)``, ``a``'s shape.

    With ``step = 2^(max(e, emin) - m)`` the grid spacing at ``a`` (``e`` its exponent, ``emin`` the
    smallest normal's, ``m`` mantissa bits), ``lo = floor(a / step) * step`` the grid value at or
    below ``a`` and ``p = (a - lo) / step`` in ``[0, 1)``, the result is ``lo + step`` when
    ``u < p``, else ``lo``: one of the two neighbouring grid values, with mean ``a`` (every step
    is exact in float32: ``step`` is a power of two, ``lo`` and ``a`` share a binade). The draws
    are multiples of 2^-24 (``torch.rand``), so ``p`` is honoured exactly down to 2^-24; only a
    magnitude below ``2^-24 step`` (far under the subnormal grid) rounds up less often than it
    should. A grid value (``p = 0``) never moves."""
    step_bits = a.view(torch.int32) & 0x7F800000  # 2^e
    step_bits = step_bits.clamp_(min=(fmt.min_normal_exp + 127) << 23).sub_(fmt.mantissa_bits << 23)
    step = step_bits.view(torch.float32)
    lo = torch.floor(a / step).mul_(step)
    p = (a - lo).div_(step)
    return a.copy_(lo.add_(step * (u < p)))
