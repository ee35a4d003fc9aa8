"""Independent reference for FP4 / FP6 quantization (MX and NVFP4), in plain Python float64:
every grid is enumerated from its bit fields and round-to-nearest-even is found by brute force
on that list. Used by ``test_quant_microscale.py`` and ``test_quant_linear.py``."""

from __future__ import annotations

import bisect
import math

import numpy as np
import torch

from fp8rl.quant.granularity import NVBlock


def grid(exp_bits: int, man_bits: int, *, e4m3fn: bool = False) -> list[float]:
    """Positive values in code order (code = index), from the bit fields; ``e4m3fn`` drops the
    all-ones code (NaN in OCP FP8 E4M3)."""
    bias = 2 ** (exp_bits - 1) - 1
    out = []
    for ef in range(2**exp_bits):
        for mf in range(2**man_bits):
            if e4m3fn and ef == 2**exp_bits - 1 and mf == 2**man_bits - 1:
                continue
            frac = mf / 2**man_bits
            out.append(frac * 2.0 ** (1 - bias) if ef == 0 else (1 + frac) * 2.0 ** (ef - bias))
    assert out == sorted(out)
    return out


GRIDS = {"e2m1": grid(2, 1), "e2m3": grid(2, 3), "e3m2": grid(3, 2), "e4m3": grid(4, 3, e4m3fn=True)}
EMAX = {"e2m1": 2, "e2m3": 2, "e3m2": 4}


def rne_sat(v: float, vals: list[float]) -> float:
    """Nearest value of ``vals`` to ``v >= 0``, ties to the even code; saturating at the top."""
    if v >= vals[-1]:
        return vals[-1]
    i = bisect.bisect_right(vals, v) - 1
    lo, hi = vals[i], vals[i + 1]
    if v - lo < hi - v:
        return lo
    if v - lo > hi - v:
        return hi
    return lo if i % 2 == 0 else hi


def f32(v: float) -> float:
    return float(np.float32(v))


def ref_mx(row: list[float], fmt: str, block: int = 32) -> list[float]:
    vals, out = GRIDS[fmt], []
    for b in range(0, len(row), block):
        blk = row[b : b + block]
        amax = max(abs(x) for x in blk)
        e = -127 if amax == 0 else math.frexp(amax)[1] - 1 - EMAX[fmt]
        scale = 2.0 ** max(-127, min(127, e))
        out += [math.copysign(rne_sat(abs(x) / scale, vals) * scale, x) for x in blk]
    return out


def ref_nvfp4(rows: list[list[float]], block: int = 16, block_rows: int = 1) -> list[list[float]]:
    """NVFP4 of a 2-D list: ``block_rows x block`` tiles (ragged at the edges), each with its own
    E4M3 scale from the tile's amax, under one FP32 tensor scale."""
    amax_t = max(abs(x) for r in rows for x in r)
    s_t = f32(max(amax_t, 1e-12) / 2688.0)
    out = [[0.0] * len(r) for r in rows]
    for i0 in range(0, len(rows), block_rows):
        for b in range(0, len(rows[0]), block):
            tile = [(i, j) for i in range(i0, min(i0 + block_rows, len(rows))) for j in range(b, min(b + block, len(rows[0])))]
            s_b = rne_sat(f32(max(abs(rows[i][j]) for i, j in tile) / (6.0 * s_t)), GRIDS["e4m3"])
            d = f32(s_b * s_t)
            for i, j in tile:
                x = rows[i][j]
                q = 0.0 if d == 0 else rne_sat(abs(f32(x / d)), GRIDS["e2m1"])
                out[i][j] = math.copysign(f32(q * d), x)
    return out


def reference(x: torch.Tensor, gran, fmt) -> torch.Tensor:
    rows = x.float().reshape(-1, x.shape[-1]).tolist()
    if isinstance(gran, NVBlock):
        out = ref_nvfp4(rows, gran.block, gran.rows)
    else:
        out = [ref_mx(r, fmt.name, gran.block) for r in rows]
    return torch.tensor(out, dtype=torch.float32).reshape(x.shape)


def hadamard_reference(n: int = 16) -> np.ndarray:
    """The Sylvester Hadamard matrix by Kronecker products of [[1, 1], [1, -1]] (float64)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h


def rht_reference(x: torch.Tensor, signs) -> torch.Tensor:
    """``x [rows, M]`` (M zero-padded to a multiple of 16) times blockdiag(diag(signs) H / 4), float64."""
    n = len(signs)
    m = x.shape[1]
    pad = -m % n
    xp = np.pad(x.double().numpy(), ((0, 0), (0, pad)))
    r = np.diag(np.array(signs, dtype=np.float64)) @ hadamard_reference(n) / math.sqrt(n)
    blk = np.kron(np.eye((m + pad) // n), r)
    return torch.from_numpy(xp @ blk)


def assert_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    g, w = got.contiguous().view(torch.int32), want.contiguous().view(torch.int32)
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{len(bad)} mismatches, first at {bad[0].tolist()}: got {got[tuple(bad[0])]}, " \
                             f"want {want[tuple(bad[0])]}"
