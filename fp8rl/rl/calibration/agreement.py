"""Which tokens are clipped, not only how many: FP8 clipping against what BF16 would clip.

Calibrated Clipping matches the *number* of A<0 tokens FP8 clips to the BF16 shadow's; this
module measures whether they are the *same* tokens. On a pass where both the FP8 ratio (the
loss's) and the BF16 shadow ratio of the same tokens are known:

- lower side, over unmasked A<0 tokens: ``bf16`` = tokens whose shadow ratio is below the
  vanilla bound ``1 - eps_low`` (what a BF16 run would clip), ``fp8`` = tokens whose FP8
  ratio is below the bound in force ``L`` (what this update clips), ``both`` = the
  intersection. ``recall = both / bf16`` (share of BF16's clipped tokens FP8 clips too),
  ``precision = both / fp8`` (share of FP8's clipped tokens BF16 would clip);
- upper side, over unmasked A>0 tokens, the same with ``shadow > 1 + eps_high`` and
  ``fp8 > H``.

A ratio exactly on a bound is not clipped (as in ``fp8rl.rl.diagnostics``). Comparisons run in
float32 or wider, like the loss's clamp.

Counts are returned as one int64 tensor so that callers can pool them: summed over the
mini-batches of a step, over calibration passes, or all-reduced over data-parallel ranks,
before :func:`agreement_metrics` turns them into rates. A rate with an empty denominator is NaN
(written as ``null`` in ``metrics.jsonl``); the counts are logged next to it so the analysis
pools ratios of sums over steps and seeds instead of averaging noisy per-step rates.
"""

from __future__ import annotations

import torch

from fp8rl.runs import metrics as M

#: Order of the entries of :func:`agreement_counts`'s result.
COUNT_KEYS: tuple[str, ...] = (
    M.SHADOW_LOW_BF16_N,
    M.SHADOW_LOW_FP8_N,
    M.SHADOW_LOW_BOTH_N,
    M.SHADOW_HIGH_BF16_N,
    M.SHADOW_HIGH_FP8_N,
    M.SHADOW_HIGH_BOTH_N,
)


@torch.no_grad()
def agreement_counts(
    ratio: torch.Tensor,
    shadow_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
    vanilla_low: float,
    vanilla_high: float,
) -> torch.Tensor:
    """Counts of clipped tokens, FP8 (bounds in force) against BF16 (vanilla bounds).

    Args:
        ratio: ``[B, T]`` (or any shape) FP8 importance ratios, the loss's.
        shadow_ratio: same shape, the BF16 shadow ratios of the same tokens.
        advantages: same shape, or ``[B]`` for 2-D inputs (broadcast over T).
        mask: same shape as ``ratio``; bool or numeric (nonzero = response token).
        low, high: the bounds this update clips with (``L``, ``H``).
        vanilla_low, vanilla_high: ``1 - eps_low``, ``1 + eps_high``.

    Returns:
        ``[6]`` int64: low bf16, low fp8, low both, high bf16, high fp8, high both
        (the order of :data:`COUNT_KEYS`).
    """
    shape = ratio.shape
    for name, t in (("shadow_ratio", shadow_ratio), ("mask", mask)):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, ratio has {tuple(shape)}")
    adv = advantages.detach()
    if adv.shape != shape:
        if ratio.dim() == 2 and adv.shape == shape[:1]:
            adv = adv[:, None].expand(shape)
        else:
            raise ValueError(f"advantages has shape {tuple(adv.shape)}; expected {tuple(shape)} "
                             f"or {tuple(shape[:1])} (one per sequence, 2-D inputs only)")
    if not (0.0 < vanilla_low < 1.0 < vanilla_high):
        raise ValueError(f"vanilla bounds must satisfy 0 < 1 - eps_low < 1 < 1 + eps_high, "
                         f"got ({vanilla_low}, {vanilla_high})")
    dtype = torch.promote_types(torch.promote_types(ratio.dtype, shadow_ratio.dtype), torch.float32)
    r = ratio.detach().reshape(-1).to(dtype)
    s = shadow_ratio.detach().reshape(-1).to(dtype)
    a = adv.reshape(-1)
    valid = mask.detach().reshape(-1)
    valid = valid if valid.dtype == torch.bool else valid != 0
    neg = valid & (a < 0)
    pos = valid & (a > 0)
    b_low = neg & (s < vanilla_low)
    f_low = neg & (r < low)
    b_high = pos & (s > vanilla_high)
    f_high = pos & (r > high)
    return torch.stack([
        b_low.sum(), f_low.sum(), (b_low & f_low).sum(),
        b_high.sum(), f_high.sum(), (b_high & f_high).sum(),
    ]).to(torch.int64).cpu()


def agreement_metrics(counts: torch.Tensor) -> dict[str, float]:
    """Metrics of (pooled) counts: the six counts and the four rates.

    Args:
        counts: ``[6]`` as returned by :func:`agreement_counts` (or a sum of such).

    Returns:
        ``{shadow/low_bf16_n: ..., ..., shadow/low_recall: ..., shadow/low_precision: ...,
        shadow/high_recall: ..., shadow/high_precision: ...}``; a rate whose denominator is 0
        is NaN.
    """
    if counts.shape != (len(COUNT_KEYS),):
        raise ValueError(f"counts must have shape ({len(COUNT_KEYS)},), got {tuple(counts.shape)}")
    c = [int(x) for x in counts.tolist()]
    out: dict[str, float] = {k: float(v) for k, v in zip(COUNT_KEYS, c, strict=True)}

    def rate(num: int, den: int) -> float:
        return num / den if den else float("nan")

    out[M.SHADOW_LOW_RECALL] = rate(c[2], c[0])
    out[M.SHADOW_LOW_PRECISION] = rate(c[2], c[1])
    out[M.SHADOW_HIGH_RECALL] = rate(c[5], c[3])
    out[M.SHADOW_HIGH_PRECISION] = rate(c[5], c[4])
    return out
