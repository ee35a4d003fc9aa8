"""Scaling granularities: which elements of a tensor share one FP8 scale.

The one meaning of "axis" in this package
-----------------------------------------
Every granularity is defined on a **2-D GEMM operand laid out as ``[rows, cols]`` where
``cols`` is the contraction dimension K** of the GEMM the operand feeds (``y = a @ b.T`` with
``a: [M, K]``, ``b: [N, K]``). Leading dimensions of an N-D tensor fold into ``rows``.
A scale is shared by a *block* of ``block_rows x block_cols`` elements; the scale tensor
has one entry per block, so "per row" means "one scale per row, reduced over the
contraction dimension". No other axis convention is used anywhere in ``fp8rl.quant``.

For ``nn.Linear`` (``y = x @ W.T``, ``x: [M, K]``, ``W: [N, K]``) this gives the usual names:

=============  ====================  ======================  ==========================
granularity    activation x          weight W                scale shape of ``[R, C]``
=============  ====================  ======================  ==========================
PerTensor      one scale             one scale               ``()``
PerRow         per token             per output channel      ``(R, 1)``
PerBlock(1,128)  1x128 tiles         --                      ``(R, ceil(C/128))``
PerBlock(128,128)  --                128x128 blocks          ``(ceil(R/128), ceil(C/128))``
MX(32)         1x32, E8M0 scale      1x32, E8M0 scale        ``(R, ceil(C/32))``
NVBlock(16)    1x16, E4M3 scale      1x16, E4M3 scale        ``(R, ceil(C/16))`` + one FP32
NVBlock(16,16) --                    16x16, E4M3 scale       ``(ceil(R/16), ceil(C/16))`` + FP32
=============  ====================  ======================  ==========================

The backward GEMMs reuse the convention: for dgrad (``grad_x = grad_y @ W``) the weight enters
as ``W.T: [K, N]``, so "per row" of the weight there means per *input* channel; for wgrad
(``grad_W = grad_y.T @ x``) both operands enter transposed and "per row" means per output /
input channel, reduced over tokens. This is exactly torchao's ``axiswise_dim`` choice in
``matmul_with_hp_or_float8_args`` and DeepSeek-V3's 1x128 / 128x1 tiling.

Ragged shapes: a dimension that is not a multiple of the block has a **ragged edge** -- the
last block is smaller and gets its own scale from its own amax (the scale tensor has
``ceil`` entries). This is the layout vLLM's block-quantized checkpoints use
(``weight_scale_inv: [ceil(N/128), ceil(K/128)]``). Internally the edge is zero-padded to
compute the amax, which zeros cannot change, so padding and ragged edge are the same thing.

Scale shapes for N-D inputs: granularities whose block has one row (PerTensor aside) keep the
leading dimensions (``(*lead, n_col_blocks)``); a block with more than one row needs a 2-D
input (flatten it yourself: which leading dims to mix is a modelling choice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from fp8rl.registry import Registry

__all__ = ["GRANULARITIES", "MX", "Granularity", "NVBlock", "PerBlock", "PerRow", "PerTensor"]


class Granularity:
    """Base class: subclasses give the block shape for a ``[rows, cols]`` operand."""

    #: Scales are powers of two (E8M0) regardless of the operand config.
    power_of_two: ClassVar[bool] = False

    def block_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """Block ``(block_rows, block_cols)`` that shares one scale in a ``[rows, cols]`` operand."""
        raise NotImplementedError

    def grid(self, rows: int, cols: int) -> tuple[int, int]:
        """Number of blocks ``(ceil(rows / block_rows), ceil(cols / block_cols))``."""
        br, bc = self.block_shape(rows, cols)
        return math.ceil(rows / br), math.ceil(cols / bc)

    def short_str(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class PerTensor(Granularity):
    """One scale for the whole tensor. Scale shape ``()``."""

    def block_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return max(rows, 1), max(cols, 1)

    def short_str(self) -> str:
        return "t"


@dataclass(frozen=True)
class PerRow(Granularity):
    """One scale per row (per token for activations, per output channel for weights).

    Scale shape ``(*lead, 1)``: the amax is reduced over the contraction dimension.
    """

    def block_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return 1, max(cols, 1)

    def short_str(self) -> str:
        return "r"


@dataclass(frozen=True)
class PerBlock(Granularity):
    """One scale per ``rows x cols`` tile (DeepSeek-V3: 1x128 activations, 128x128 weights).

    Scale shape ``(ceil(R / rows), ceil(C / cols))``; ragged edges get their own scale.
    """

    rows: int = 128
    cols: int = 128

    def __post_init__(self) -> None:
        if self.rows < 1 or self.cols < 1:
            raise ValueError(
                f"PerBlock needs positive block sides, got {self.rows}x{self.cols}; "
                "DeepSeek-V3 style is PerBlock(1, 128) for activations, PerBlock(128, 128) for weights"
            )

    def block_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return self.rows, self.cols

    def short_str(self) -> str:
        return f"b{self.rows}x{self.cols}"


@dataclass(frozen=True)
class MX(Granularity):
    """OCP microscaling: ``1 x block`` groups along the contraction dim with E8M0 scales.

    Scale shape ``(*lead, ceil(C / block))``; every scale is a power of two (stored as
    float32 here, exactly representable in ``torch.float8_e8m0fnu``).
    """

    block: int = 32
    power_of_two: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ValueError(f"MX block must be positive, got {self.block}; the OCP MX spec uses 32")

    def block_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return 1, self.block

    def short_str(self) -> str:
        return f"mx{self.block}"


@dataclass(frozen=True)
class NVBlock(Granularity):
    """NVIDIA NVFP4 two-level scaling: ``rows x block`` tiles (``1 x 16`` along the contraction dim;
    ``16 x 16`` for weights in NVIDIA's training recipe), each with an E4M3 scale, under one FP32
    scale for the whole tensor.

    Block scale shape ``(*lead, ceil(C / block))`` for one-row blocks, ``(ceil(R / rows),
    ceil(C / block))`` for 2-D tiles, plus the per-tensor scale; the formula is in
    ``fp8rl.quant.microscale``. Only with the ``E2M1`` element format (``NVFP4``). A square tile
    (``rows == block``) quantizes ``W`` and ``W.T`` to the same values, transposed, so the
    forward and the dgrad GEMM see one quantized weight (NVIDIA, arXiv:2509.25149 section 4.3).
    """

    block: int = 16
    rows: int = 1

    def __post_init__(self) -> None:
        if self.block < 1 or self.rows < 1:
            raise ValueError(f"NVBlock block and rows must be positive, got {self.rows}x{self.block}; NVFP4 uses "
                             f"1x16 (activations, gradients) and 16x16 (weights)")

    def block_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return self.rows, self.block

    def short_str(self) -> str:
        return f"nv{self.block}" if self.rows == 1 else f"nv{self.rows}x{self.block}"


GRANULARITIES: Registry[type[Granularity]] = Registry("scaling granularity")
GRANULARITIES.add("tensor", PerTensor)
GRANULARITIES.add("row", PerRow)
GRANULARITIES.add("block", PerBlock)
GRANULARITIES.add("mx", MX)
GRANULARITIES.add("nv", NVBlock)
