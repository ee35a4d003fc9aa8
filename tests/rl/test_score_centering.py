"""Score Centering on a toy vocabulary where p, q and the sampler's tail are known exactly.

The identity checked (derived in ``fp8rl/rl/score_centering.py``): with logits z, p =
softmax(z), the sampler's head H (top-k ids of q), rho = (1 - sum_H q) / (1 - sum_H p) and
the modelled sampler q^ = q on H, rho p off H,

    grad_z C = sum_{v in V} q^(v) f(p(v)/q^(v)) grad_z log p(v)      (enumerated over V)

where f is the IS weight of the mode (none: 1, tis: clamp(., lo, hi), icepop:
x 1[lo <= x <= hi]). For f = 1 this is E_{y~q^}[grad log p(y)] = q^ - p in logit space.
When q's tail *is* rho p, q^ = q and the right side is the exact sampler-expected score.
Adding A * C to the loss therefore makes a constant advantage contribute no expected
gradient under q (``test_constant_advantage_has_zero_expected_gradient``).

References below are written out from the guide's formulas, in float64, without calling
the module's helpers (except the gather, which has its own test).
"""

import math

import pytest
import torch

from fp8rl.rl.aggregation import aggregate
from fp8rl.rl.policy_loss import ppo_token_loss
from fp8rl.rl.score_centering import (
    score_centering_coefficients,
    score_centering_loss_mat,
    score_centering_term,
    tail_mass_ratio,
    trainer_logp_at_sampler_topk,
)

D = torch.float64


def toy(seed=0, B=2, T=3, V=7, k=3, spread=0.8, proportional_tail=False):
    """Trainer logits [B,T,V], exact sampler probs q [B,T,V], the sampler's top-k ids [B,T,k]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=D) * 1.2
    q = torch.softmax(logits + torch.randn(B, T, V, generator=g, dtype=D) * spread, dim=-1)
    ids = q.topk(k, dim=-1).indices
    if proportional_tail:  # make the paper's tail model exact: q = rho p off H
        p = torch.softmax(logits, -1)
        head = torch.zeros_like(q, dtype=torch.bool).scatter(-1, ids, True)
        Q = (q * head).sum(-1, keepdim=True)
        P = (p * head).sum(-1, keepdim=True)
        q = torch.where(head, q, (1 - Q) / (1 - P) * p)
    return logits, q, ids


def ref_qhat(p, q, ids):
    """q^ = q on H, rho p off H, with rho = (1 - sum_H q) / (1 - sum_H p)."""
    head = torch.zeros_like(q, dtype=torch.bool).scatter(-1, ids, True)
    rho = (1 - (q * head).sum(-1, keepdim=True)) / (1 - (p * head).sum(-1, keepdim=True))
    return torch.where(head, q, rho * p)


def f_none(x):
    return torch.ones_like(x)


def f_tis(lo, hi):
    return lambda x: x.clamp(lo, hi)


def f_icepop(lo, hi):
    return lambda x: torch.where((x >= lo) & (x <= hi), x, torch.zeros_like(x))


def enumerated_expected_score(logits, qhat, f):
    """grad_z sum_v q^(v) f(p(v)/q^(v)) log p(v), with q^ f(.) held fixed: the sampler-expected score."""
    z = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(z, -1)
    p = logp.exp().detach()
    ((qhat * f(p / qhat)).detach() * logp).sum().backward()
    return z.grad


def term_grad(logits, q, ids, mode, bounds=None):
    z = logits.clone().requires_grad_(True)
    train = trainer_logp_at_sampler_topk(z, ids)
    sampler = torch.log(q).gather(-1, ids)
    C = score_centering_term(train, sampler, mode, bounds=bounds)
    C.sum().backward()
    return C.detach(), z.grad


MODES = [
    ("none", None, lambda lo, hi: f_none),
    ("tis", (0.0, 2.0), f_tis),
    ("tis", (0.8, 1.25), f_tis),
    ("icepop", (0.5, 5.0), f_icepop),
    ("icepop", (0.8, 1.25), f_icepop),
]


@pytest.mark.parametrize("mode,bounds,make_f", MODES)
@pytest.mark.parametrize("proportional_tail", [True, False])
def test_gradient_is_the_sampler_expected_score(mode, bounds, make_f, proportional_tail):
    logits, q, ids = toy(seed=1, spread=1.0, proportional_tail=proportional_tail)
    p = torch.softmax(logits, -1)
    qhat = ref_qhat(p, q, ids)
    if proportional_tail:
        torch.testing.assert_close(qhat, q)  # the exact sampler is what the model assumes
    f = make_f(*bounds) if bounds else make_f(0, 0)
    _, grad = term_grad(logits, q, ids, mode, bounds)
    torch.testing.assert_close(
        grad, enumerated_expected_score(logits, qhat, f), rtol=1e-9, atol=1e-12
    )
    if mode == "none":
        torch.testing.assert_close(grad, qhat - p, rtol=1e-9, atol=1e-12)  # E_q^[e_y - p]
    assert grad.abs().max() > 1e-3  # not trivially zero


def test_tail_ratio_matters_to_the_gradient():
    """Guard for the test above: with rho = 1 instead of the true ratio the identity fails."""
    logits, q, ids = toy(seed=1, spread=1.0, proportional_tail=True)
    p = torch.softmax(logits, -1)
    head = torch.zeros_like(q, dtype=torch.bool).scatter(-1, ids, True)
    wrong = torch.where(head, q, p)  # rho = 1
    _, grad = term_grad(logits, q, ids, "none")
    assert (grad - (wrong - p)).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["none", "tis", "icepop"])
def test_constant_advantage_has_zero_expected_gradient(mode):
    """Sign convention: A * C is added to the loss that is minimised.

    One position, sampler q with an exact rho p tail, every y in V "sampled" with weight
    q(y): sum_y q(y) [w(y) ppo_loss(y) + A C] has zero gradient for a constant A, while the
    base loss alone has gradient -A sum_y q(y) w(y) grad log p(y) != 0 (the drift). The IS
    bounds are tight so that truncation is active (untruncated IS has no drift to cancel).
    """
    logits, q, ids = toy(seed=2, B=1, T=1, V=8, k=3, spread=1.0, proportional_tail=True)
    V, A = logits.shape[-1], 1.7
    bounds = None if mode == "none" else (0.8, 1.25)
    z = logits.clone().requires_grad_(True)
    logp_all = torch.log_softmax(z, -1)[0, 0]  # [V]
    p = logp_all.exp().detach()
    qy = q[0, 0]
    w = {
        "none": f_none,
        "tis": f_tis(*(bounds or (0, 0))),
        "icepop": f_icepop(*(bounds or (0, 0))),
    }[mode](p / qy)
    log_prob = logp_all.unsqueeze(-1)  # [V, 1]: row y holds token y
    loss_mat, _ = ppo_token_loss(
        log_prob,
        log_prob.detach(),
        torch.full((V, 1), A, dtype=D),
        torch.ones(V, 1),
        low=0.8,
        high=1.28,
    )
    base = (qy * w * loss_mat[:, 0]).sum()
    C = score_centering_term(
        trainer_logp_at_sampler_topk(z, ids), torch.log(q).gather(-1, ids), mode, bounds=bounds
    )
    sc = score_centering_loss_mat(C, torch.full((1, 1), A, dtype=D), torch.ones(1, 1)).sum()
    (g_base,) = torch.autograd.grad(base, z, retain_graph=True)
    (g_total,) = torch.autograd.grad(base + sc, z)
    assert g_base.abs().max() > 1e-3
    torch.testing.assert_close(g_total, torch.zeros_like(g_total), rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["none", "tis", "icepop"])
def test_vanishes_when_p_equals_q(mode):
    logits, _, ids = toy(seed=3)
    z = logits.clone().requires_grad_(True)
    train = trainer_logp_at_sampler_topk(z, ids)
    C = score_centering_term(train, train.detach(), mode)
    torch.testing.assert_close(C, torch.zeros_like(C), rtol=0, atol=1e-14)
    C.sum().backward()
    torch.testing.assert_close(z.grad, torch.zeros_like(z), rtol=0, atol=1e-14)


def _guide_reference(train, sampler, mode, lo=None, hi=None):
    """C, per token, from the guide's formulas written out in scalar Python."""
    B, T, _ = train.shape
    out = torch.zeros(B, T, dtype=D)
    for b in range(B):
        for t in range(T):
            lp = [float(x) for x in train[b, t]]
            p = [math.exp(x) for x in lp]
            q = [math.exp(float(x)) for x in sampler[b, t]]
            rho = (1 - sum(q)) / max(1 - sum(p), 1e-6)
            if mode == "none":
                m, alpha = q, rho
            elif (
                mode == "tis"
            ):  # q * clamp(p/q, lo, hi) = clamp(p, lo q, hi q); alpha = clamp(1, lo rho, hi rho)
                m = [min(max(pj, lo * qj), hi * qj) for pj, qj in zip(p, q, strict=True)]
                alpha = min(max(1.0, lo * rho), hi * rho)
            else:  # icepop: keep p where lo <= p/q <= hi; unit tail coefficient where lo <= 1/rho <= hi
                m = [pj if lo <= pj / qj <= hi else 0.0 for pj, qj in zip(p, q, strict=True)]
                alpha = 1.0 if (rho > 0 and lo <= 1 / rho <= hi) else 0.0
            out[b, t] = sum((mj - alpha * pj) * lj for mj, pj, lj in zip(m, p, lp, strict=True))
    return out


def _coef_grad(train, sampler, mode, bounds):
    x = train.clone().requires_grad_(True)
    C = score_centering_term(x, sampler, mode, bounds=bounds)
    C.sum().backward()
    return C.detach(), x.grad


def _wide_batch(seed, spread):
    logits, q, ids = toy(seed=seed, B=4, T=5, V=8, k=3, spread=spread)
    train = torch.log_softmax(logits, -1).gather(-1, ids)
    return train, torch.log(q).gather(-1, ids)


@pytest.mark.parametrize("bounds", [(0.0, 2.0), (0.8, 1.25), (0.5, 1.5)])
def test_tis_matches_guide_formula(bounds):
    train, sampler = _wide_batch(4, spread=1.5)
    lo, hi = bounds
    C, dC = _coef_grad(train, sampler, "tis", bounds)
    torch.testing.assert_close(
        C, _guide_reference(train, sampler, "tis", lo, hi), rtol=1e-10, atol=1e-12
    )
    # stop-gradient: dC / d log p(v) is exactly the coefficient m(v) - alpha p(v)
    p, q = train.exp(), sampler.exp()
    rho = (1 - q.sum(-1, keepdim=True)) / (1 - p.sum(-1, keepdim=True)).clamp(min=1e-6)
    m = torch.minimum(torch.maximum(p, lo * q), hi * q)
    alpha = torch.minimum(torch.maximum(torch.ones_like(rho), lo * rho), hi * rho)
    torch.testing.assert_close(dC, m - alpha * p, rtol=1e-10, atol=1e-12)
    ratio = p / q  # the data exercise both sides of the clamp
    if lo > 0:
        assert (
            bool((ratio < lo).any())
            and bool((ratio > hi).any())
            and bool(((ratio >= lo) & (ratio <= hi)).any())
        )


def test_untruncated_is_cancels_the_term():
    train, sampler = _wide_batch(5, spread=1.0)
    C, dC = _coef_grad(train, sampler, "tis", (0.0, math.inf))
    assert float(C.abs().max()) < 1e-12 and float(dC.abs().max()) < 1e-12


@pytest.mark.parametrize("bounds", [(0.5, 5.0), (0.8, 1.25), (0.7, 1.1)])
def test_icepop_matches_guide_formula(bounds):
    train, sampler = _wide_batch(6, spread=1.5)
    lo, hi = bounds
    C, dC = _coef_grad(train, sampler, "icepop", bounds)
    torch.testing.assert_close(
        C, _guide_reference(train, sampler, "icepop", lo, hi), rtol=1e-10, atol=1e-12
    )
    p, q = train.exp(), sampler.exp()
    rho = (1 - q.sum(-1, keepdim=True)) / (1 - p.sum(-1, keepdim=True)).clamp(min=1e-6)
    keep = (p / q >= lo) & (p / q <= hi)
    alpha = ((1 / rho >= lo) & (1 / rho <= hi)).to(D)
    torch.testing.assert_close(dC, torch.where(keep, p, 0 * p) - alpha * p, rtol=1e-10, atol=1e-12)
    if bounds != (0.5, 5.0):  # both branches of both indicators occur
        assert bool(keep.any()) and bool((~keep).any())
        assert bool((alpha == 1).any()) and bool((alpha == 0).any())


def test_coefficients_table():
    train, sampler = _wide_batch(7, spread=1.0)
    q = sampler.exp()
    m, alpha, rho = score_centering_coefficients(train, sampler, "none")
    torch.testing.assert_close(m, q)
    torch.testing.assert_close(alpha, rho)


def test_tail_mass_ratio_reference():
    logits, q, ids = toy(seed=8, B=3, T=4, V=7, k=2, spread=1.0)
    p = torch.softmax(logits, -1)
    train, sampler = p.log().gather(-1, ids), q.log().gather(-1, ids)
    P, Q = p.gather(-1, ids).sum(-1), q.gather(-1, ids).sum(-1)
    rho = tail_mass_ratio(train, sampler)
    torch.testing.assert_close(rho, (1 - Q) / (1 - P), rtol=1e-10, atol=1e-12)
    assert float((rho - 1).abs().min()) > 1e-3  # P_H != Q_H everywhere here
    assert not rho.requires_grad


def test_tail_mass_floor():
    """The trainer's head holds all its mass (k = V): the denominator is floored at 1e-6."""
    train = torch.log(torch.tensor([[[0.5, 0.5]]], dtype=D))
    sampler = torch.log(torch.tensor([[[0.6, 0.3]]], dtype=D))
    torch.testing.assert_close(
        tail_mass_ratio(train, sampler), torch.tensor([[0.1 / 1e-6]], dtype=D)
    )


def test_gather_at_sampler_topk_per_position():
    logits, _, ids = toy(seed=9, B=2, T=4, V=6, k=3)
    got = trainer_logp_at_sampler_topk(logits * 2, ids, temperature=2.0)
    ref = torch.zeros_like(got)
    for b in range(2):
        for t in range(4):
            lp = torch.log_softmax(logits[b, t], -1)
            for j in range(3):
                ref[b, t, j] = lp[ids[b, t, j]]
    torch.testing.assert_close(got, ref)
    assert not torch.equal(ids[:, 0], ids[:, 1])  # positions differ, so misalignment would show


def test_padding_is_ignored():
    train, sampler = _wide_batch(10, spread=1.0)
    mask = torch.ones(train.shape[:2], dtype=torch.bool)
    mask[0, 2:] = False
    mask[3, :] = False
    train, sampler = train.clone(), sampler.clone()
    train[~mask] = float("nan")
    sampler[~mask] = -float("inf")
    x = train.requires_grad_(True)
    C = score_centering_term(x, sampler, "tis", mask=mask)
    assert bool((C[~mask] == 0).all()) and bool(torch.isfinite(C).all())
    C.sum().backward()
    assert bool((x.grad[~mask] == 0).all()) and bool(torch.isfinite(x.grad).all())


def test_loss_mat_is_advantage_times_term_masked():
    train, sampler = _wide_batch(11, spread=1.0)
    C = score_centering_term(train, sampler, "none")
    adv = torch.randn(C.shape, dtype=D, generator=torch.Generator().manual_seed(0)).requires_grad_(
        True
    )
    mask = torch.rand(C.shape, generator=torch.Generator().manual_seed(1)) > 0.3
    out = score_centering_loss_mat(C, adv, mask)
    torch.testing.assert_close(out, torch.where(mask, adv.detach() * C, torch.zeros_like(C)))
    assert not out.requires_grad  # advantages are detached; C here carries no graph
    aggregate(out, mask, "token-mean")  # reducible like ppo_token_loss's loss_mat


@pytest.mark.parametrize(
    "make,err",
    [
        (lambda t, s: (t[..., 0], s[..., 0]), "3-D"),
        (lambda t, s: (t, s[..., :2]), "shape"),
        (lambda t, s: (t[..., :0], s[..., :0]), "k "),
        (lambda t, s: (t.long(), s), "floating"),
        (lambda t, s: ([1.0], s), "torch.Tensor"),
        (lambda t, s: (torch.where(t < -1, float("nan"), t), s), "non-finite"),
        (lambda t, s: (t, torch.full_like(s, -0.1)), "sum to"),
        (lambda t, s: (t + 1.0, s), "<= 0"),
    ],
)
def test_bad_input_refused(make, err):
    train, sampler = _wide_batch(12, spread=1.0)
    t, s = make(train, sampler)
    with pytest.raises((ValueError, TypeError), match=err):
        score_centering_term(t, s, "none")


@pytest.mark.parametrize(
    "mode,bounds,err",
    [
        ("ppo", None, "unknown score-centering mode"),
        ("none", (0.5, 2.0), "no bounds"),
        ("tis", (2.0, 1.0), "lo < hi"),
        ("icepop", (-0.1, 2.0), "lo < hi"),
        ("tis", (float("nan"), 2.0), "lo < hi"),
    ],
)
def test_bad_mode_or_bounds_refused(mode, bounds, err):
    train, sampler = _wide_batch(13, spread=1.0)
    with pytest.raises(ValueError, match=err):
        score_centering_term(train, sampler, mode, bounds=bounds)


def test_bad_ids_and_masks_refused():
    logits, _, ids = toy(seed=14, V=6, k=3)
    with pytest.raises(ValueError, match="distinct"):
        trainer_logp_at_sampler_topk(logits, torch.zeros_like(ids))
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        trainer_logp_at_sampler_topk(logits, ids + 6)
    with pytest.raises(TypeError, match="int"):
        trainer_logp_at_sampler_topk(logits, ids.double())
    with pytest.raises(ValueError, match="B, T"):
        trainer_logp_at_sampler_topk(logits, ids[:, :1])
    train, sampler = _wide_batch(15, spread=1.0)
    with pytest.raises(ValueError, match="mask"):
        score_centering_term(train, sampler, "none", mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match="shape"):
        score_centering_loss_mat(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
