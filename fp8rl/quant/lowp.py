"""High-precision GEMMs in a low-precision compute dtype (BF16): the paper's baseline arithmetic.

The paper's BF16 baseline is BF16 mixed precision, as verl/FSDP, DeepSpeed and vLLM run it:
fp32 master weights, a BF16 copy of them for compute, BF16 activations, and GEMMs that take
BF16 inputs, accumulate in fp32 and write BF16. ``matmul(a, b)`` and ``linear(x, w, b)`` compute
exactly that for BF16 (or FP16) ``a``/``x``, with the weight cast to the activation's dtype
(differentiably: the gradient reaches the fp32 master, as FSDP's mixed precision does):

- **CUDA**: the native BF16 GEMM (cuBLAS: fp32 accumulation);
- **CPU**: the same arithmetic, emulated exactly: the BF16 operands upcast to fp32 (exact), an
  fp32 GEMM (products of two BF16 numbers are exact in fp32; the sums accumulate in fp32), the
  result rounded to BF16. On CPUs without BF16 instructions PyTorch's native BF16 GEMM is ~5x
  slower than this (measured here: a 768x64x192 linear, 647 us vs 121 us), and it computes the
  same thing up to the order of the fp32 additions.

For fp32 inputs both are plain fp32 GEMMs (``F.linear`` / ``torch.matmul``), bit for bit.
Only the GEMMs are handled here; everything else runs in the tensors' own dtype (a BF16
elementwise op on CPU computes in fp32 and rounds, as on GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear", "matmul"]

_LOW = (torch.bfloat16, torch.float16)


def _emulate(t: torch.Tensor) -> bool:
    return t.dtype in _LOW and t.device.type == "cpu"


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, b)`` with fp32 accumulation in ``a``'s dtype (both operands that dtype)."""
    if not _emulate(a):
        return torch.matmul(a, b)
    return torch.matmul(a.float(), b.float()).to(a.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           weight_rounded: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` computed in ``x``'s dtype (``[..., K] x [N, K] -> [..., N]``).

    ``weight`` (the fp32 master, say) is cast to ``x.dtype`` first, the bias likewise.
    ``weight_rounded``: the weight already holds values of ``x.dtype`` (stored in fp32, e.g. a
    rollout engine's copy rounded once per weight sync), so the cast is skipped on CPU.
    """
    if x.dtype not in _LOW:
        return F.linear(x, weight, bias)
    b = None if bias is None else bias.to(x.dtype)
    if not _emulate(x):
        return F.linear(x, weight.to(x.dtype), b)
    if weight_rounded or weight.dtype == x.dtype:
        w = weight.float()  # exact (a no-op for an fp32 tensor of rounded values)
    else:
        w = weight.to(x.dtype).float()
    return F.linear(x.float(), w, None if b is None else b.float()).to(x.dtype)
