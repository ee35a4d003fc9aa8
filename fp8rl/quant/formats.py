"""FP8 number formats (the OCP FP8 pair) as small frozen dataclasses.

``E4M3`` (``torch.float8_e4m3fn``, largest finite 448, no infinities) is used for weights and
activations; ``E5M2`` (``torch.float8_e5m2``, largest finite 57344) has more range and less
precision and is used for gradients in "hybrid" recipes (Transformer Engine's ``Format.HYBRID``;
torchao's ``tensorwise`` recipe casts ``grad_output`` to E5M2 by default). Paper section
"FP8 scaling granularities" in ``reference/paper.md``.

The ROCm ``fnuz`` variants are deliberately absent (the project targets NVIDIA and CPU);
adding them is a new registry entry, not a code change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8rl.registry import Registry

__all__ = ["E4M3", "E5M2", "FORMATS", "Fp8Format"]


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


FORMATS: Registry[Fp8Format] = Registry("FP8 format")
E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2)
FORMATS.add(E4M3.name, E4M3)
FORMATS.add(E5M2.name, E5M2)
