"""The 16 x 16 random Hadamard transform (RHT) of NVIDIA's NVFP4 training recipe.

NVIDIA ("Pretraining Large Language Models with NVFP4", arXiv:2509.25149 section 4.2) multiplies
both operands of the weight-gradient GEMM ``grad_W = grad_y.T @ x`` along their contraction
dimension (the tokens) by a random orthogonal matrix before quantizing them to NVFP4, which
spreads block outliers over the 16 elements of a block; Transformer Engine's
``NVFP4BlockScaling`` does it for the column-wise (wgrad) use of the input and the gradient
only (``random_hadamard_transform=True`` on ``fp4_quant_fwd_inp`` and ``fp4_quant_bwd_grad``,
applied to column-wise usage). Here:

    R = diag(s) H_16 / 4            (H_16 the Sylvester Hadamard matrix, entries +-1; s a fixed
                                     vector of random signs; R R^T = I)
    a' = a R_blk,  b' = b R_blk     (``[rows, M]`` operands, ``R_blk`` = R on every run of 16
                                     along M; M zero-padded to a multiple of 16)
    a' b'^T = a R_blk R_blk^T b^T = a b^T     in exact arithmetic

so the transform changes only what the quantizer sees. ``SIGNS`` is one fixed draw, the same
for every layer and step [G] (TE also uses one fixed sign vector; its bits are not ours). The
transform is computed in float32 (exact for the +-1/4 entries up to float32 additions).
"""

from __future__ import annotations

import torch

__all__ = ["RHT_SIZE", "SIGNS", "hadamard", "rht", "rht_matrix"]

RHT_SIZE = 16
#: The fixed random signs of the RHT (one draw, written out so that it never changes).
SIGNS = (1, -1, -1, 1, 1, 1, -1, 1, -1, -1, 1, -1, 1, 1, -1, -1)


def hadamard(n: int = RHT_SIZE) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix (entries +-1, ``H H^T = n I``), float32; ``n`` a power of 2."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix has a power-of-two size, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rht_matrix(signs: tuple[int, ...] = SIGNS) -> torch.Tensor:
    """``R = diag(signs) H / sqrt(n)``, float32 ``[n, n]``, orthogonal."""
    n = len(signs)
    s = torch.tensor(signs, dtype=torch.float32)
    return (s[:, None] * hadamard(n)) / n**0.5


def rht(x: torch.Tensor, signs: tuple[int, ...] = SIGNS) -> torch.Tensor:
    """``x [rows, M]`` times ``R`` on every run of ``len(signs)`` columns: float32 ``[rows, ceil(M / n) * n]``
    (zero-padded along M, the contraction dimension; zero columns add nothing to a product)."""
    if x.ndim != 2:
        raise ValueError(f"rht takes a 2-D GEMM operand [rows, contraction], got shape {tuple(x.shape)}")
    n = len(signs)
    rows, m = x.shape
    pad = -m % n
    xf = x.to(torch.float32)
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    r = rht_matrix(signs).to(xf.device)
    return (xf.reshape(rows, -1, n) @ r).reshape(rows, m + pad)
