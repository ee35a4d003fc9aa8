"""Calibrated Clipping, exact order statistics: dtype-aware comparisons, selections, projections.

Bounds are compared with the ratios in the ratio's dtype (float32 for bf16/fp16/float32
inputs, float64 for float64), as ``torch.clamp`` and the loss kernel do, so a returned bound is
exact in that sense. ``torch.quantile`` is not used (it refuses more than 2**24 elements):
order statistics come from ``torch.kthvalue`` (O(n)) and masked min/max; a batch of rows
(``[R, n]``, used by the simulation tests) is sorted once instead.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

__all__ = [
    "INF",
    "in_dtype",
    "lower_interval",
    "next_down",
    "next_up",
    "order_stat",
    "order_stats",
    "project_lower",
    "sorted_quantile",
]

INF = float("inf")


@functools.lru_cache(maxsize=256)  # pure in (x, dtype); called per calibration with the same few values
def in_dtype(x: float, dtype: torch.dtype) -> float:
    """``x`` rounded to ``dtype`` (what torch does when comparing a tensor with a Python float)."""
    return float(torch.tensor(x, dtype=dtype))


@functools.lru_cache(maxsize=256)  # pure in (x, dtype); called per calibration with the same few values
def next_up(x: float, dtype: torch.dtype) -> float:
    """Smallest ``dtype`` number above ``x`` (``x`` representable in ``dtype``)."""
    return float(torch.nextafter(torch.tensor(x, dtype=dtype), torch.tensor(INF, dtype=dtype)))


@functools.lru_cache(maxsize=256)  # pure in (x, dtype); called per calibration with the same few values
def next_down(x: float, dtype: torch.dtype) -> float:
    """Largest ``dtype`` number below ``x`` (``x`` representable in ``dtype``)."""
    return float(torch.nextafter(torch.tensor(x, dtype=dtype), torch.tensor(-INF, dtype=dtype)))


def order_stat(x: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """The ``rank``-th smallest element of each row (1-based, ties counted with multiplicity).

    Args:
        x: ``[R, n]`` finite values, n >= 1.
        rank: ``[R]`` integer ranks in 1..n.

    Returns:
        ``[R]`` in x's dtype. One row: ``torch.kthvalue`` (O(n), no copy of a 2**24+ tensor
        into a sort); several rows: one sort and a gather (same values; tested).
    """
    return order_stats(x)(rank)


def order_stats(x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``order_stat`` for many ranks of the same rows: sorts ``[R, n]`` once when R > 1."""
    if x.dim() != 2:
        raise ValueError(f"order_stat needs x [R, n], got {tuple(x.shape)}")
    if x.shape[0] == 1:
        def select(rank: torch.Tensor) -> torch.Tensor:
            _check_rank(x, rank)
            j = int(rank[0])
            if j in (1, x.shape[1]):  # the extremes: one pass without a selection
                return (x[0].min() if j == 1 else x[0].max()).reshape(1)
            return torch.kthvalue(x[0], j).values.reshape(1)
        return select
    xs = torch.sort(x, dim=1).values

    def gather(rank: torch.Tensor) -> torch.Tensor:
        _check_rank(x, rank)
        return xs.gather(1, (rank.long() - 1)[:, None]).squeeze(1)
    return gather


def _check_rank(x: torch.Tensor, rank: torch.Tensor) -> None:
    if rank.shape != x.shape[:1]:
        raise ValueError(f"order_stat needs x [R, n] and rank [R], got {tuple(x.shape)} and {tuple(rank.shape)}")


def lower_interval(x: torch.Tensor, k: int) -> tuple[float, float, int]:
    """The bounds L with #(x < L) = k*: returns ``(a, b, k*)``, L valid iff a < L <= b.

    ``x``: 1-D, nonempty, finite. k* = k unless ties straddle the k-th/(k+1)-th order
    statistic; then k* is the achievable count nearest k (the smaller on a tie).
    a = largest x below the bound (-inf if k* = 0), b = smallest x at or above it (+inf if
    k* = n). O(n): one or two ``kthvalue`` selections plus masked min/max.
    """
    n = x.numel()
    if k <= 0:
        return -INF, float(x.min()), 0
    if k >= n:
        return float(x.max()), INF, n
    a = torch.kthvalue(x, k).values  # k-th smallest (1-based)
    n_le = int((x <= a).sum())
    if n_le == k:  # no tie across the boundary
        return float(a), float(torch.where(x > a, x, INF).min()), k
    lo = int((x < a).sum())  # the tied value a occupies ranks lo+1 .. n_le
    if k - lo <= n_le - k:
        below = float(torch.where(x < a, x, -INF).max()) if lo > 0 else -INF
        return below, float(a), lo
    above = float(torch.where(x > a, x, INF).min()) if n_le < n else INF
    return float(a), above, n_le


def project_lower(target: float, a: float, b: float, dtype: torch.dtype) -> float:
    """The point of (a, b] nearest ``target``, in ``dtype`` comparison semantics."""
    t = in_dtype(target, dtype)
    if a < t <= b:
        return target
    if t <= a:
        return next_up(a, dtype)
    return b


def sorted_quantile(x: torch.Tensor, q: float, hint: float | None = None, n_below: int = 0) -> float:
    """Linear-interpolation quantile of 1-D ``x`` (numpy's default) via kthvalue.

    ``hint``, ``n_below``: ``n_below`` = #(x < hint); when the needed order statistics lie
    below ``hint`` only those elements are searched (cheap for low quantiles).
    """
    n = x.numel()
    h = q * (n - 1)
    lo = min(math.floor(h), n - 1)
    hi = min(lo + 1, n - 1)
    frac = h - lo
    src = x
    if hint is not None and n_below >= hi + 1:
        src = x[x < hint]
    v_lo = float(torch.kthvalue(src, lo + 1).values)
    v_hi = float(torch.kthvalue(src, hi + 1).values) if hi != lo else v_lo
    return v_lo + frac * (v_hi - v_lo)
