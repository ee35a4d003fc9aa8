"""Diagnostics that make the paper's failure visible: entropy, masked reductions, clip table.

The FP8 paper (Towards Full Pipeline FP8 RL, Sec. on the failure analysis) explains the
mid-training entropy surge by FP8 noise in the PPO ratio r = pi_theta / pi_old pushing
negative-advantage tokens below the lower clip bound, where their gradient is zero. The
quantities needed to watch that happen live here, each with one implementation:

- ``token_entropy``: per-token policy entropy from logits, computed chunk by chunk in float32
  so that a ``[B, T, V]`` bf16 logits tensor never gets a full float32 copy.
- ``masked_sum`` / ``masked_mean``: reductions over response tokens.
- ``clip_table``: the four-cell clip table (advantage sign x which bound the ratio crossed)
  plus the overall PPO clip fraction; ``fp8rl.rl.policy_loss`` and the calibration code use
  this same function, so there is exactly one definition of each cell.
- ``masked_quantiles`` / ``ratio_quantiles``: quantiles of the ratio over A<0 tokens without
  ``torch.quantile`` (which refuses inputs above 16M elements).

Conventions (chosen here; the paper does not define them):

- Metric values are **0-d detached float32 tensors** on the input's device (no host sync
  inside the math); call ``float()`` when logging.
- A fraction or mean over an empty set is **NaN** ("undefined"), never 0: a step with no
  A<0 tokens must not look like a step where nothing was clipped. Analysis treats NaN as
  missing.
- Tokens with A == 0 belong to neither sign: they count in ``clipfrac``'s denominator (all
  response tokens) but in no cell's denominator. Their loss and gradient are zero anyway.
- "Clipped" means strictly beyond the bound: ``r < low`` or ``r > high``. A ratio exactly at
  a bound is not clipped (there the clipped and unclipped surrogates are equal). Bounds
  are compared in the ratio's dtype, as ``torch.clamp`` does.
- Quantiles use linear interpolation between order statistics (numpy's and torch.quantile's
  default, "type 7"): for n sorted values x_0..x_{n-1} and level q, h = q (n - 1),
  Q(q) = x_floor(h) + (h - floor(h)) (x_floor(h)+1 - x_floor(h)).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

__all__ = [
    "clip_counts",
    "clip_table",
    "fractions_from_counts",
    "masked_mean",
    "masked_quantiles",
    "masked_sum",
    "neg_counts",
    "ratio_dev_sums",
    "ratio_quantiles",
    "ratio_std_from_sums",
    "token_entropy",
]

# The three ratio quantiles logged for A<0 tokens (metric suffixes q01, q50, q99).
RATIO_QUANTILES: tuple[tuple[str, float], ...] = (("q01", 0.01), ("q50", 0.50), ("q99", 0.99))


def _as_bool_mask(mask: torch.Tensor, like: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """Return ``mask`` as a bool tensor after checking shape (== like) and 0/1 values."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != like.shape:
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but the values have shape "
            f"{tuple(like.shape)}; pass one mask entry per token"
        )
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_complex():  # integer or floating: must be 0/1
        if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"{name} must hold only 0/1 (or be bool); got other values")
        return mask != 0
    raise TypeError(f"{name} must be bool, integer or floating 0/1, got dtype {mask.dtype}")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is true; masked entries never propagate NaN/inf.

    Shapes: ``values`` and ``mask`` the same shape; result reduced over ``dim`` (all if None).
    """
    m = _as_bool_mask(mask, values)
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    picked = torch.where(m, values, zeros)
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over entries where ``mask`` is true; NaN where there are none.

    Shapes: ``values`` and ``mask`` the same shape; result reduced over ``dim`` (all if None).
    The result dtype is ``values``' dtype promoted to at least float32.
    """
    m = _as_bool_mask(mask, values)
    dtype = torch.promote_types(values.dtype, torch.float32)
    total = masked_sum(values.to(dtype), m, dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.to(dtype)  # 0 / 0 = NaN: an empty mean is undefined


@torch.no_grad()
def token_entropy(
    logits: torch.Tensor, *, temperature: float = 1.0, chunk_size: int = 256
) -> torch.Tensor:
    """Per-token entropy H = -sum_v p_v log p_v of softmax(logits / temperature).

    Args:
        logits: ``[..., V]`` in any floating dtype (bf16, fp16, fp32, ...).
        temperature: the sampling temperature (> 0); the entropy is that of the policy
            that was sampled from.
        chunk_size: rows (tokens) converted to float32 at once. Peak extra memory is a few
            ``[chunk_size, V]`` float32 buffers, never a second ``[..., V]`` float32 copy.

    Returns:
        ``[...]`` float32 entropies (nats), detached (for logging, not for an entropy bonus).

    Computed per chunk as ``logsumexp(z) - sum(softmax(z) * z)`` with z the float32 logits,
    which is exact and stable for any logit scale. A non-contiguous ``logits`` is iterated
    row-chunk by row-chunk without flattening it, so no copy is made either.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point torch.Tensor")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocabulary) dim, got {tuple(logits.shape)}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lead = logits.shape[:-1]
    out = torch.empty(lead, dtype=torch.float32, device=logits.device)
    rows = logits.view(-1, logits.shape[-1]) if logits.is_contiguous() else None
    if rows is not None:
        flat_out = out.view(-1)
        for start in range(0, rows.shape[0], chunk_size):
            flat_out[start:start + chunk_size] = _entropy_rows(rows[start:start + chunk_size], temperature)
        return out
    # Non-contiguous: walk the leading index space, chunking the second-to-last dim.
    for idx in _leading_indices(lead[:-1]):
        src, dst = logits[idx], out[idx]
        for start in range(0, src.shape[0], chunk_size):
            dst[start:start + chunk_size] = _entropy_rows(src[start:start + chunk_size], temperature)
    return out


def _entropy_rows(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[n, V]`` logits (any dtype) -> ``[n]`` float32 entropies."""
    z = chunk.to(torch.float32)
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    return lse - (p * z).sum(dim=-1)


def _leading_indices(shape: torch.Size) -> itertools.product:
    """All index tuples over ``shape`` (just the empty tuple for a 0-d shape)."""
    return itertools.product(*(range(n) for n in shape))


def _check_clip_inputs(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if not isinstance(ratio, torch.Tensor) or not isinstance(advantages, torch.Tensor):
        raise TypeError("ratio and advantages must be torch.Tensors")
    if ratio.shape != advantages.shape:
        raise ValueError(
            f"ratio has shape {tuple(ratio.shape)} but advantages have {tuple(advantages.shape)}; "
            "broadcast per-sequence advantages with broadcast_to_tokens first"
        )
    return _as_bool_mask(mask, ratio)


@torch.no_grad()
def clip_counts(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, low: float, high: float
) -> dict[str, torch.Tensor]:
    """Token counts behind the clip table (0-d int64 tensors), for DP-correct reductions.

    Keys: ``tokens`` (response tokens), ``neg`` / ``pos`` (tokens with A<0 / A>0), and
    ``neg_low``, ``neg_high``, ``pos_low``, ``pos_high`` (e.g. neg_low = #(A<0 and r<low)).
    Summing these counts over data-parallel ranks and then dividing gives the global table.
    """
    m = _check_clip_inputs(ratio, advantages, mask)
    r = ratio.detach()
    neg = m & (advantages < 0)
    pos = m & (advantages > 0)
    below = r < low  # strict: a ratio exactly at the bound is not clipped
    above = r > high
    return {
        "tokens": m.sum(),
        "neg": neg.sum(),
        "pos": pos.sum(),
        "neg_low": (neg & below).sum(),
        "neg_high": (neg & above).sum(),
        "pos_low": (pos & below).sum(),
        "pos_high": (pos & above).sum(),
    }


def fractions_from_counts(counts: dict[str, torch.Tensor], prefix: str = "actor/") -> dict[str, torch.Tensor]:
    """Turn ``clip_counts`` output (possibly summed over ranks) into the clip-table metrics.

    ``{prefix}clipfrac`` = #(A<0, r<low) + #(A>0, r>high) over all response tokens: the
    tokens whose surrogate was clipped, i.e. whose PPO-clip gradient is zero. This is the
    quantity OpenRLHF 0.11.2 logs as ``ppo_clip_ratio`` (``masked_mean(surr2 < surr1)``);
    the two definitions agree except where ``clip(r) * A`` and ``r * A`` round to the same
    float although ``r`` is beyond the bound (e.g. a subnormal A). Tokens zeroed by the
    dual clip (A<0, r > c) are not counted here (``actor/dualclipfrac``).
    The four cells are fractions within their advantage sign.
    """

    def frac(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        return num.to(torch.float32) / den.to(torch.float32)  # 0/0 -> NaN by convention

    return {
        f"{prefix}clipfrac": frac(counts["neg_low"] + counts["pos_high"], counts["tokens"]),
        f"{prefix}clipfrac_neg_low": frac(counts["neg_low"], counts["neg"]),
        f"{prefix}clipfrac_neg_high": frac(counts["neg_high"], counts["neg"]),
        f"{prefix}clipfrac_pos_low": frac(counts["pos_low"], counts["pos"]),
        f"{prefix}clipfrac_pos_high": frac(counts["pos_high"], counts["pos"]),
    }


def neg_counts(counts: dict[str, torch.Tensor], prefix: str = "actor/") -> dict[str, torch.Tensor]:
    """The A<0 token counts behind ``{prefix}clipfrac_neg_low`` (``clip_counts`` output, possibly
    summed over ranks): ``{prefix}n_neg`` (its denominator) and ``{prefix}n_neg_low`` (its
    numerator), as float64 0-d tensors. Logged beside the fraction because two runs' fractions
    divide different numbers of A<0 tokens: the ratio of their counts is not the ratio of their
    fractions when one run makes more A<0 tokens."""
    return {f"{prefix}n_neg": counts["neg"].to(torch.float64), f"{prefix}n_neg_low": counts["neg_low"].to(torch.float64)}


def ratio_dev_sums(ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums behind ``actor/ratio_std`` over the response tokens of ``ratio`` / ``mask`` ``[B, T]``:
    ``{"dev_n": n, "dev_sum": sum(r - 1), "dev_sq": sum((r - 1)^2)}`` (float64 0-d tensors), to be
    added over micro-batches and ranks before :func:`ratio_std_from_sums`."""
    m = _as_bool_mask(mask, ratio)
    d = torch.where(m, ratio.detach().to(torch.float64) - 1.0, torch.zeros((), dtype=torch.float64, device=ratio.device))
    return {"dev_n": m.sum().to(torch.float64), "dev_sum": d.sum(), "dev_sq": (d * d).sum()}


def ratio_std_from_sums(sums: dict[str, torch.Tensor], prefix: str = "actor/") -> dict[str, torch.Tensor]:
    """``{prefix}ratio_std``: the standard deviation (population, over the step's response tokens)
    of r - 1, from :func:`ratio_dev_sums` summed over micro-batches and ranks; NaN without tokens.
    The precision-noise dose of a run (issue 48): near 0 on-policy in BF16, larger as the
    trainer's format adds noise to the ratio; it includes the policy's own change over the step's
    updates, which BF16's value measures."""
    n = sums["dev_n"].to(torch.float64)
    if float(n) <= 0:
        return {f"{prefix}ratio_std": torch.tensor(float("nan"), dtype=torch.float64)}
    mean = sums["dev_sum"].to(torch.float64) / n
    var = torch.clamp(sums["dev_sq"].to(torch.float64) / n - mean * mean, min=0.0)
    return {f"{prefix}ratio_std": var.sqrt()}


def clip_table(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
    prefix: str = "actor/",
) -> dict[str, torch.Tensor]:
    """The four-cell clip table plus the overall clip fraction, as 0-d float32 tensors.

    Args:
        ratio: ``[B, T]`` PPO ratios pi_theta / pi_old (any float dtype).
        advantages: ``[B, T]`` per-token advantages.
        mask: ``[B, T]`` response-token mask (bool or 0/1).
        low, high: the clip bounds as ratios (e.g. 0.8, 1.28).
        prefix: metric namespace, ``"actor/"`` for the trainer, ``"shadow/"`` for the BF16
            shadow pass.

    Returns keys ``{prefix}clipfrac`` and ``{prefix}clipfrac_{neg,pos}_{low,high}``:
    ``clipfrac_neg_low`` = #(A<0, r<low) / #(A<0) (the paper's signal: gradient zeroed),
    ``clipfrac_neg_high`` = #(A<0, r>high) / #(A<0), ``clipfrac_pos_low`` =
    #(A>0, r<low) / #(A>0), ``clipfrac_pos_high`` = #(A>0, r>high) / #(A>0) (gradient
    zeroed). NaN for a sign with no tokens; A == 0 tokens are in no cell.
    """
    return fractions_from_counts(clip_counts(ratio, advantages, mask, low=low, high=high), prefix)


@torch.no_grad()
def masked_quantiles(values: torch.Tensor, mask: torch.Tensor, qs: Sequence[float]) -> torch.Tensor:
    """Quantiles of ``values[mask]`` (linear interpolation, numpy's default), via kthvalue.

    Works on any number of elements (``torch.quantile`` refuses more than 2**24). Returns a
    float32 tensor ``[len(qs)]``; all NaN if the mask selects nothing.
    """
    m = _as_bool_mask(mask, values)
    for q in qs:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile levels must lie in [0, 1], got {q}")
    x = values.detach()[m].to(torch.float32)
    n = x.numel()
    if n == 0:
        return torch.full((len(qs),), float("nan"), dtype=torch.float32, device=values.device)
    # Order statistics needed (0-based), each found once with an O(n) selection.
    needed: dict[int, torch.Tensor] = {}
    plan = []
    for q in qs:
        h = q * (n - 1)
        lo = min(math.floor(h), n - 1)
        hi = min(lo + 1, n - 1)
        plan.append((lo, hi, h - lo))
        for k in (lo, hi):
            if k not in needed:
                needed[k] = torch.kthvalue(x, k + 1).values  # kthvalue is 1-based
    out = [needed[lo] + frac * (needed[hi] - needed[lo]) for lo, hi, frac in plan]
    return torch.stack(out)


def ratio_quantiles(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, prefix: str = "actor/"
) -> dict[str, torch.Tensor]:
    """``{prefix}ratio_neg_q01|q50|q99``: ratio quantiles over response tokens with A<0."""
    m = _check_clip_inputs(ratio, advantages, mask)
    qv = masked_quantiles(ratio, m & (advantages < 0), [q for _, q in RATIO_QUANTILES])
    return {f"{prefix}ratio_neg_{name}": qv[i] for i, (name, _) in enumerate(RATIO_QUANTILES)}
