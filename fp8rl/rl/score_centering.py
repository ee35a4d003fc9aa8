"""Score Centering: an additive, stop-gradient term that cancels train/rollout drift.

Source: Marek and Ryabinin, "Score Centering Stabilizes Off-policy Reinforcement Learning"
(arXiv 2609.20807; abstract on the paper's Hugging Face page), as written out in NeMo-RL's
nightly guide "Score Centering" (docs.nvidia.com/nemo/rl/nightly/guides/score-centering.html)
and the API page of ``nemo_rl.algorithms.loss.score_centering.compute_score_centering_term``
(which cites the paper's Eq. 14). The full paper text was not available to us; everything
below is from those two pages plus the derivation given under "Why it works".

Notation at one generated position: p(v) the current trainer policy, q(v) the rollout
sampler, H the sampler's top-k token ids (the sampler logs ids *and* log-probs for H; the
trainer computes log p at the same ids, normalised over the full vocabulary). Quoted from
the guide::

    rho = (1 - sum_H q(v)) / max(1 - sum_H p(v), 1e-6)
    q(v) ~= rho * p(v) outside H
    C = sum_H stop_gradient(m(v) - alpha * p(v)) * log p(v)
    L = L_base + A * C

"Here A is the token advantage and L_base is the existing actor objective, including its
clipping and configured importance-sampling correction." The per-mode coefficients, from the
API page ("w = clamp(p / q, lo, hi) ... q * w = clamp(p, lo * q, hi * q) on the head and
alpha * p on the tail with alpha = clamp(1, lo * rho, hi * rho) ... Untruncated IS makes this
coefficient zero. ICEPOP instead retains p_v only where p_v/q_v is in bounds, and retains the
unit tail coefficient only whe[n] ..."):

    ======== ====================================== ==================================
    mode     m(v) on H                              alpha
    ======== ====================================== ==================================
    none     q(v)                                   rho
    tis      q(v) clamp(p/q, lo, hi)                clamp(1, lo rho, hi rho)
             = clamp(p(v), lo q(v), hi q(v))        = rho clamp(1/rho, lo, hi)
    icepop   p(v) 1[lo <= p(v)/q(v) <= hi]          1[lo <= 1/rho <= hi]
    ======== ====================================== ==================================

Why it works (the identity the tests check). Write s_v = grad log p(v) and q^ for the
modelled sampler: q^ = q on H, rho p off H (it sums to 1). For an IS weight function f
(none: f = 1; tis: clamp; icepop: x 1[lo <= x <= hi]) the sampler-expected weighted score is

    mu = sum_v q^(v) f(p(v)/q^(v)) s_v
       = sum_H q f(p/q) s_v + rho f(1/rho) sum_{v not in H} p(v) s_v        (p/q^ = 1/rho off H)
       = sum_H [q f(p/q) - rho f(1/rho) p(v)] s_v                            (sum_v p s_v = 0)
       = sum_H (m(v) - alpha p(v)) s_v = grad C,

so C's gradient is the drift E_{y~q^}[w(y) grad log p(y)] that a token-level, IS-weighted
policy gradient picks up even when every advantage is equal, and A * C added to the *loss*
(minimised) subtracts it: the sampled loss -A w(y) log p(y) + A C has, for a constant A, zero
expected gradient under q^. The rows of the table are m = q f(p/q), alpha = rho f(1/rho) for
the three f; the icepop alpha is the guide's truncated sentence completed by this
derivation. With p = q (and lo <= 1 <= hi) every coefficient is 0, so C = 0.

Where we guessed (the guide and API page leave these open, or we could not read them):

1. Sign: we read "L = L_base + A * C" as a loss to *minimise* (NeMo's convention); the
   derivation above agrees (with the opposite sign the term would double the drift).
2. p inside m and alpha is the *current* trainer probability, detached ("Let p(v) be the
   current training policy"), not the old-policy ratio our ``correction.py`` uses for its
   weights. The IS bounds default to our own correction defaults: tis (lo, hi) = (0, 2) as
   ``TIS(cap=2)`` (Yao et al. TIS has no lower clamp; the guide's lo is kept as a parameter),
   icepop (0.5, 5) as ``ICEPOP``; both inclusive.
3. Aggregation: the term is per token and added to the per-token loss before the batch
   reduction, so ``score_centering_loss_mat`` returns ``A * C`` masked like
   ``ppo_token_loss``'s ``loss_mat`` and the caller reduces the sum with the same
   ``fp8rl.rl.aggregation.aggregate`` mode. PPO's ratio clipping does not gate the term
   (NeMo's API has optional "adaptive_ppo_clip" arguments we did not reproduce).
4. Numerics: 1 - sum_H q is clamped at 0 (a head sum can round above 1); the 1e-6 floor is
   the guide's. Where the trainer's head holds all its mass, rho is 0 and so is alpha's
   contribution; the gradient is unaffected, since sum_H p s_v = 0 then.
5. Top-p / "Sampling filters" renormalisation (the guide says p is then renormalised over
   the filtered support) is out of scope: pass log-probs that are already on one support.
"""

from __future__ import annotations

import math

import torch

from fp8rl.rl.diagnostics import _as_bool_mask

__all__ = [
    "DEFAULT_BOUNDS",
    "SCORE_CENTERING_MODES",
    "TAIL_MASS_FLOOR",
    "score_centering_coefficients",
    "score_centering_loss_mat",
    "score_centering_sums",
    "score_centering_term",
    "tail_mass_ratio",
    "trainer_logp_at_sampler_topk",
]

SCORE_CENTERING_MODES = ("none", "tis", "icepop")
DEFAULT_BOUNDS: dict[str, tuple[float, float]] = {"tis": (0.0, 2.0), "icepop": (0.5, 5.0)}
TAIL_MASS_FLOOR = 1e-6  # the guide's max(1 - sum_H p, 1e-6)
HEAD_MASS_TOL = 1e-3  # how far above 1 a head's summed probability may round


def _check_topk(train_logp_topk: torch.Tensor, sampler_logp_topk: torch.Tensor) -> None:
    for name, t in (("train_logp_topk", train_logp_topk), ("sampler_logp_topk", sampler_logp_topk)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point tensor of log-probs, got dtype {t.dtype}"
            )
        if t.dim() != 3:
            raise ValueError(f"{name} must be [B, T, k] (3-D), got shape {tuple(t.shape)}")
    if train_logp_topk.shape != sampler_logp_topk.shape:
        raise ValueError(
            f"train_logp_topk has shape {tuple(train_logp_topk.shape)} but sampler_logp_topk has "
            f"{tuple(sampler_logp_topk.shape)}; both are log-probs at the sampler's top-k ids"
        )
    if train_logp_topk.shape[-1] < 1:
        raise ValueError("k (the last dimension) must be >= 1: the sampler logged no top-k tokens")


def _token_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return torch.ones(like.shape[:2], dtype=torch.bool, device=like.device)
    return _as_bool_mask(mask, like[..., 0], "mask")


def _check_values(name: str, logp: torch.Tensor, m: torch.Tensor) -> None:
    """Finite, <= 0, and a head mass of at most 1 (+ tolerance) at response tokens."""
    v = logp.detach()[m]
    if not bool(torch.isfinite(v).all()):
        raise ValueError(f"{name} has non-finite values at response tokens (mask the padding)")
    if v.numel() and float(v.max()) > HEAD_MASS_TOL:
        raise ValueError(f"{name} must be log-probabilities (<= 0); max is {float(v.max()):.4g}")
    head = torch.logsumexp(v.to(torch.promote_types(v.dtype, torch.float32)), dim=-1)
    if head.numel() and float(head.max()) > math.log1p(HEAD_MASS_TOL):
        raise ValueError(
            f"{name}: the top-k probabilities sum to {math.exp(float(head.max())):.6g} > 1 at some "
            "token; pass full-vocabulary log-probs at k distinct ids"
        )


def _bounds(mode: str, bounds: tuple[float, float] | None) -> tuple[float, float]:
    if mode not in SCORE_CENTERING_MODES:
        raise ValueError(
            f"unknown score-centering mode {mode!r}; valid: {list(SCORE_CENTERING_MODES)}"
        )
    if mode == "none":
        if bounds is not None:
            raise ValueError("mode 'none' takes no bounds (they belong to 'tis' or 'icepop')")
        return (0.0, math.inf)
    lo, hi = DEFAULT_BOUNDS[mode] if bounds is None else (float(bounds[0]), float(bounds[1]))
    if math.isnan(lo) or math.isnan(hi) or not 0.0 <= lo < hi or math.isinf(lo):
        raise ValueError(f"{mode} bounds need 0 <= lo < hi (hi may be inf), got {bounds}")
    return lo, hi


@torch.no_grad()
def tail_mass_ratio(train_logp_topk: torch.Tensor, sampler_logp_topk: torch.Tensor) -> torch.Tensor:
    """rho = (1 - sum_H q) / max(1 - sum_H p, 1e-6), detached, ``[B, T]``.

    ``train_logp_topk`` is log p (trainer), ``sampler_logp_topk`` log q (sampler), both
    ``[B, T, k]`` at the same ids. The sampler's tail 1 - sum_H q is clamped at 0.
    """
    dtype = torch.promote_types(train_logp_topk.dtype, torch.float32)
    sampler_tail = (-torch.expm1(torch.logsumexp(sampler_logp_topk.to(dtype), dim=-1))).clamp(
        min=0.0
    )
    train_tail = -torch.expm1(torch.logsumexp(train_logp_topk.to(dtype), dim=-1))
    return sampler_tail / train_tail.clamp(min=TAIL_MASS_FLOOR)


@torch.no_grad()
def score_centering_coefficients(
    train_logp_topk: torch.Tensor,
    sampler_logp_topk: torch.Tensor,
    mode: str = "none",
    *,
    bounds: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The detached ``(m [B,T,k], alpha [B,T], rho [B,T])`` of the table in the module docstring."""
    lo, hi = _bounds(mode, bounds)
    dtype = torch.promote_types(train_logp_topk.dtype, torch.float32)
    p = torch.exp(train_logp_topk.detach().to(dtype))
    q = torch.exp(sampler_logp_topk.detach().to(dtype))
    rho = tail_mass_ratio(train_logp_topk, sampler_logp_topk)
    inf = torch.full((), math.inf, dtype=dtype, device=p.device)
    if mode == "none":
        return q, rho, rho
    q_hi = q * hi if math.isfinite(hi) else inf.expand_as(q)  # avoids inf * 0
    rho_hi = rho * hi if math.isfinite(hi) else inf.expand_as(rho)
    if mode == "tis":
        m = torch.minimum(torch.maximum(p, q * lo), q_hi)  # q clamp(p/q, lo, hi)
        alpha = torch.minimum(
            torch.maximum(torch.ones_like(rho), rho * lo), rho_hi
        )  # rho clamp(1/rho, lo, hi)
        return m, alpha, rho
    # icepop, bounds inclusive; both written without dividing by q or rho
    keep = (p >= q * lo) & (p <= q_hi)
    m = torch.where(keep, p, torch.zeros((), dtype=dtype, device=p.device))
    alpha = ((rho * lo <= 1.0) & (rho_hi >= 1.0)).to(dtype)
    return m, alpha, rho


def score_centering_term(
    train_logp_topk: torch.Tensor,
    sampler_logp_topk: torch.Tensor,
    mode: str = "none",
    *,
    bounds: tuple[float, float] | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token C = sum_H stop_grad(m(v) - alpha p(v)) log p(v), ``[B, T]``.

    Args:
        train_logp_topk: ``[B, T, k]`` trainer log p at the sampler's top-k ids, normalised
            over the full vocabulary; carries the gradient (see ``trainer_logp_at_sampler_topk``).
        sampler_logp_topk: ``[B, T, k]`` sampler log q at the same ids (no gradient is taken).
        mode: ``none`` | ``tis`` | ``icepop`` (the IS correction the base loss uses).
        bounds: ``(lo, hi)`` for tis / icepop (defaults ``DEFAULT_BOUNDS``); ``hi = inf``
            with ``lo = 0`` under tis is untruncated IS, for which C is 0.
        mask: ``[B, T]`` response-token mask; C is 0 (with zero gradient) elsewhere, and
            padding may hold any value.

    Returns:
        C ``[B, T]`` in at least float32. Its gradient w.r.t. the trainer's parameters is the
        sampler-expected (IS-weighted) score at each token; add ``A * C`` to the loss.
    """
    _check_topk(train_logp_topk, sampler_logp_topk)
    m = _token_mask(mask, train_logp_topk)
    _bounds(mode, bounds)
    _check_values("train_logp_topk", train_logp_topk, m)
    _check_values("sampler_logp_topk", sampler_logp_topk, m)
    dtype = torch.promote_types(train_logp_topk.dtype, torch.float32)
    k = train_logp_topk.shape[-1]
    fill = torch.full((), -math.log(k + 1.0), dtype=dtype, device=train_logp_topk.device)
    m3 = m.unsqueeze(-1)
    logp = torch.where(m3, train_logp_topk.to(dtype), fill)  # padding -> a valid head, no gradient
    logq = torch.where(m3, sampler_logp_topk.detach().to(dtype), fill)
    coef_m, alpha, _ = score_centering_coefficients(logp, logq, mode, bounds=bounds)
    coef = (coef_m - alpha.unsqueeze(-1) * torch.exp(logp.detach())).detach()
    term = (coef * logp).sum(dim=-1)
    return torch.where(m, term, torch.zeros((), dtype=dtype, device=term.device))


def score_centering_loss_mat(
    term: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``A * C`` per token, 0 at masked tokens, ``[B, T]``: add it to ``ppo_token_loss``'s
    ``loss_mat`` (after any IS weighting of that loss) and reduce with ``aggregate``.

    ``term`` is ``score_centering_term``'s C ``[B, T]``; ``advantages`` ``[B, T]`` (detached here).
    """
    for name, t in (("term", term), ("advantages", advantages)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor")
        if t.dim() != 2:
            raise ValueError(f"{name} must be [B, T] (2-D), got shape {tuple(t.shape)}")
    if advantages.shape != term.shape:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}, expected {tuple(term.shape)} like term"
        )
    m = _as_bool_mask(mask, term)
    dtype = torch.promote_types(term.dtype, torch.float32)
    adv = advantages.detach().to(dtype)
    if not bool(torch.isfinite(adv[m]).all()):
        raise ValueError("advantages has non-finite values at response tokens")
    out = adv * term.to(dtype)
    return torch.where(m, out, torch.zeros((), dtype=dtype, device=out.device))


def trainer_logp_at_sampler_topk(
    logits: torch.Tensor, topk_ids: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at the sampler's top-k ids: ``[B, T, k]``.

    ``logits`` ``[B, T, V]`` must already be aligned with the response tokens (row t is the
    distribution token t was drawn from); ``topk_ids`` ``[B, T, k]`` are the sampler's ids for
    the same position t, distinct within a position. The gradient flows into ``logits``.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != 3:
        raise ValueError("logits must be a floating-point [B, T, V] tensor")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError("topk_ids must be an int32/int64 tensor of token ids")
    if topk_ids.dim() != 3 or topk_ids.shape[:2] != logits.shape[:2]:
        raise ValueError(
            f"topk_ids must be [B, T, k] with the logits' [B, T] = {tuple(logits.shape[:2])}, "
            f"got {tuple(topk_ids.shape)}"
        )
    k, V = topk_ids.shape[-1], logits.shape[-1]
    if k < 1 or k > V:
        raise ValueError(f"need 1 <= k <= V, got k={k}, V={V}")
    if bool(((topk_ids < 0) | (topk_ids >= V)).any()):
        raise ValueError(f"topk_ids must lie in [0, {V})")
    s = topk_ids.sort(dim=-1).values
    if k > 1 and bool((s[..., 1:] == s[..., :-1]).any()):
        raise ValueError("topk_ids repeat an id within a position; the head must be k distinct ids")
    if not (float(temperature) > 0 and math.isfinite(float(temperature))):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(dtype) / float(temperature), dim=-1)
    return logp.gather(-1, topk_ids.long())


@torch.no_grad()
def score_centering_sums(train_logp_topk: torch.Tensor, sampler_logp_topk: torch.Tensor, loss_term: torch.Tensor,
                         mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """A (micro-)batch's sums for the ``sc/*`` metrics of both scales (0-d float64): ``sc_head``
    (sum_H q), ``sc_rho``, ``sc_term_abs`` (|A * C|), each summed over response tokens, and
    ``sc_tokens``.

    ``train_logp_topk``, ``sampler_logp_topk`` ``[B, T, k]``; ``loss_term`` ``[B, T]`` (A * C);
    ``mask`` ``[B, T]``."""
    m = mask.bool()
    head = torch.exp(torch.logsumexp(sampler_logp_topk.detach().double(), dim=-1))
    rho = tail_mass_ratio(train_logp_topk.detach().double(), sampler_logp_topk.detach().double())
    return {"sc_head": head[m].sum(), "sc_rho": rho[m].sum(),
            "sc_term_abs": loss_term.detach().double().abs()[m].sum(), "sc_tokens": m.sum().double()}
