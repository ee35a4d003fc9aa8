"""The ``sampled`` calibration mode's arithmetic: which sequences are measured, and how many.

``sampled`` measures a BF16 shadow on a seeded random subset of each step's sequences and lets the
estimate from that subset rule the rest of each optimizer step (``schedule``). Three pure parts:

1. **The draw** (:func:`draw_subset`). The eligible sequences are those with any A != 0 token (a
   sequence whose tokens all have A = 0 has zero loss and tells the estimate nothing). Of the
   ``m`` eligible sequences, ``round(share * m)`` are drawn uniformly without replacement (at least
   one when ``m > 0``) by a generator seeded with ``(seed, step, rank)`` only: a step's subset is
   re-drawn every step, the same on a resumed run (nothing to checkpoint beyond the seed and the
   step), and independent across data-parallel ranks.

2. **The design effect** (:class:`WindowStats`, :func:`design_effect`). The estimate rests on the
   A<0 tokens whose BF16 ratio is below ``1 - eps_low`` (k of n). Tokens of one sequence are
   correlated (a sequence whose policy moved has many tokens far from ratio 1), so n tokens carry
   fewer than n independent observations: n_eff = n / deff with the cluster-sampling design effect
   of the proportion p = k / n, clusters = sequences with m_i A<0 tokens, y_i of them clipped:

       V_cl  = c / (c - 1) * sum_i (y_i - p m_i)^2 / n^2      (c clusters; ratio estimator)
       V_srs = p (1 - p) / n
       deff  = V_cl / V_srs, clamped to [1, max_i m_i]

   (Kish 1965, ch. 6; the clamp keeps it between independent tokens and perfectly correlated
   sequences). With k = 0 it is undefined: deff = 1. Summaries of each window's measured tokens
   (sums of m, y, y^2, y m, m^2, clusters) are kept so the rule reads them without the tokens.

3. **The share rule** (:func:`choose_share`). Target: alpha x n_eff >= ``target`` (5 by default:
   five effectively independent BF16-clipped tokens behind the bound). From the recent windows'
   summaries: alpha_hat = (k + 1/2) / (n + 1) (a Jeffreys-style estimate that is > 0 before the
   first clipped token), deff_hat, and N_hat, the A<0 tokens of one whole window (measured count
   over the share that measured it). The estimate needs n_req = target * deff_hat / alpha_hat A<0
   tokens; measuring a share s of P windows gives s * N_hat * P. The rule takes the fewest pooled
   windows P in [1, ``pool``] for which the ceiling share suffices, then the smallest share in
   [``share_min``, ``share_max``] that reaches n_req with P windows; where even the ceiling and the
   full pool do not reach it, both stay at their maximum and the window is flagged
   (``clip/low_data``). Before anything was measured: the ceiling share and one window.

   At mini scale this is the flagged case: a window holds ~400 A<0 tokens of which BF16 clips
   ~0.1%, so alpha x n at the ceiling share of 1/8 is ~0.05 per window and ~0.4 with 8 pooled:
   the rule measures the ceiling share and pools the maximum, and the ``unbiased`` lower bound
   (which clips nothing when its tokens hold no BF16-clipped one, and correspondingly more when
   they do; ``lower.py``) stays unbiased in expectation but noisy from window to window.

Guesses (the paper has no sampled mode): the target 5, the Jeffreys-style alpha, deff from the
last ``memory`` windows, pooling whole windows (the pooled tokens come from earlier weights), the
share applied per rank at paper scale (each rank draws from its own sequences, so the global share
is the same).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

__all__ = ["ShareChoice", "WindowStats", "choose_share", "design_effect", "draw_holdout", "draw_subset", "window_stats"]

#: Windows whose summaries the share rule reads (alpha, deff, tokens per window).
MEMORY = 32


@torch.no_grad()
def draw_subset(eligible: torch.Tensor, share: float, *, seed: int, step: int, rank: int = 0) -> torch.Tensor:
    """The measured sequences of one step on one rank.

    Args:
        eligible: ``[N]`` bool, sequences with any A != 0 token.
        share: in (0, 1].
        seed, step, rank: the generator's seed parts (run seed, controller step, DP rank).

    Returns:
        ``[N]`` bool, True for the ``max(1, round(share * m))`` drawn sequences (m = eligible count;
        none when m = 0).
    """
    if eligible.dim() != 1 or eligible.dtype != torch.bool:
        raise ValueError(f"eligible must be a 1-D bool tensor, got {eligible.dtype} {tuple(eligible.shape)}")
    if not 0.0 < float(share) <= 1.0:
        raise ValueError(f"share must lie in (0, 1], got {share}")
    out = torch.zeros_like(eligible, device="cpu")
    idx = torch.nonzero(eligible.cpu(), as_tuple=False).flatten()
    m = idx.numel()
    if m == 0:
        return out.to(eligible.device)
    k = min(m, max(1, math.floor(share * m + 0.5)))
    g = torch.Generator().manual_seed(_seed(seed, step, rank))
    pick = idx[torch.randperm(m, generator=g)[:k]]
    out[pick] = True
    return out.to(eligible.device)


#: Mixed into the held-out draw's seed, so its stream is independent of ``sampled``'s draw.
HOLDOUT_STREAM = 0x4F1D_7A3B_C0DE_5EED


def draw_holdout(eligible: torch.Tensor, share: float, *, seed: int, step: int, rank: int = 0) -> torch.Tensor:
    """The held-out sequences of one step on one rank (``plan.StepPlan.holdout``): ``[N]`` bool,
    ``round(share * m)`` of the ``m`` eligible sequences (at least one when ``share > 0`` and
    ``m > 0``), drawn from ``(seed, step, rank)`` only, so every arm of a seed holds out the same
    rows; ``share = 0``: none."""
    if not 0.0 <= float(share) < 1.0:
        raise ValueError(f"the held-out share must lie in [0, 1), got {share}")
    if float(share) == 0.0:
        return torch.zeros_like(eligible, dtype=torch.bool)
    return draw_subset(eligible, share, seed=int(seed) ^ HOLDOUT_STREAM, step=step, rank=rank)


def _seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed from the parts (splitmix64-style mixing: neighbouring steps decorrelate)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9 + int(rank) * 0x94D049BB133111EB + 0x5151)
    x &= (1 << 64) - 1
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    return x & ((1 << 63) - 1)


@dataclass(frozen=True)
class WindowStats:
    """What one window's measured A<0 tokens say, for the share rule.

    ``n``/``k``: A<0 tokens and those BF16 clips; ``clusters``: sequences with A<0 tokens; ``sum_y2``,
    ``sum_ym``, ``sum_m2``, ``max_m``: cluster sums for the design effect; ``share``: the share of
    sequences that was measured (so ``n / share`` estimates the window's A<0 tokens).
    """

    n: float
    k: float
    clusters: float
    sum_y2: float
    sum_ym: float
    sum_m2: float
    max_m: float
    share: float

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def window_stats(shadow_ratio: torch.Tensor, advantages: torch.Tensor, seq: torch.Tensor, *, vanilla_low: float,
                 share: float) -> WindowStats:
    """Summaries of one window's measured tokens (flat ``[n]`` shadow ratios, advantages and
    sequence ids of the unmasked tokens)."""
    neg = advantages < 0
    s = seq[neg]
    y_tok = (shadow_ratio[neg] < vanilla_low).to(torch.float64)
    if s.numel() == 0:
        return WindowStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, float(share))
    _, inv = torch.unique(s, return_inverse=True)
    c = int(inv.max()) + 1
    m = torch.zeros(c, dtype=torch.float64).index_add_(0, inv.cpu(), torch.ones_like(y_tok).cpu())
    y = torch.zeros(c, dtype=torch.float64).index_add_(0, inv.cpu(), y_tok.cpu())
    return WindowStats(n=float(m.sum()), k=float(y.sum()), clusters=float(c), sum_y2=float((y * y).sum()),
                       sum_ym=float((y * m).sum()), sum_m2=float((m * m).sum()), max_m=float(m.max()),
                       share=float(share))


def design_effect(stats: list[WindowStats]) -> float:
    """The design effect of the pooled windows' clipped proportion (module docstring, part 2)."""
    n = sum(w.n for w in stats)
    k = sum(w.k for w in stats)
    c = sum(w.clusters for w in stats)
    if n <= 0 or k <= 0 or k >= n or c < 2:
        return 1.0
    p = k / n
    ss = sum(w.sum_y2 - 2 * p * w.sum_ym + p * p * w.sum_m2 for w in stats)
    v_cl = c / (c - 1) * max(ss, 0.0) / (n * n)
    v_srs = p * (1 - p) / n
    return min(max(v_cl / v_srs, 1.0), max(1.0, max(w.max_m for w in stats)))


@dataclass(frozen=True)
class ShareChoice:
    """The rule's decision for one step: ``share`` of the eligible sequences, ``pool`` windows per
    estimate, and what it read (``alpha``, ``deff``, ``window_tokens`` = N_hat, ``needed`` =
    n_req, ``expected`` = alpha x n_eff it expects, ``low_data`` = below target at the maximum)."""

    share: float
    pool: int
    alpha: float
    deff: float
    window_tokens: float
    needed: float
    expected: float
    low_data: bool


def choose_share(history: list[WindowStats], *, target: float, share_min: float, share_max: float, pool_max: int,
                 fixed_share: float | None = None) -> ShareChoice:
    """The share rule (module docstring, part 3). ``history``: the last windows' summaries, oldest
    first (the rule reads the last :data:`MEMORY`). ``fixed_share`` (``sample_fraction``): the share
    is given; the rule only chooses the pool."""
    recent = [w for w in history[-MEMORY:] if w.share > 0]
    n = sum(w.n for w in recent)
    k = sum(w.k for w in recent)
    if not recent or n <= 0:
        share = fixed_share if fixed_share is not None else share_max
        return ShareChoice(share, 1, float("nan"), 1.0, float("nan"), float("inf"), float("nan"), True)
    alpha = (k + 0.5) / (n + 1.0)
    deff = design_effect(recent)
    n_window = sum(w.n / w.share for w in recent) / len(recent)
    needed = target * deff / alpha
    top = fixed_share if fixed_share is not None else share_max
    pool = min(pool_max, max(1, math.ceil(needed / max(top * n_window, 1e-300))))
    if fixed_share is not None:
        share = fixed_share
    else:
        share = min(share_max, max(share_min, needed / (n_window * pool)))
    expected = alpha * share * n_window * pool / deff
    return ShareChoice(share, pool, alpha, deff, n_window, needed, expected, expected < target * (1 - 1e-9))
