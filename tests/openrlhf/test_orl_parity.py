"""Parity with OpenRLHF 0.11.2: its PolicyLoss (clip mode) and DAPO overlong penalty.

``openrlhf/models/loss.py`` is loaded by path from the installed wheel (``pip install
--no-deps openrlhf==0.11.2``), never imported as a package: ``openrlhf.models`` pulls in
deepspeed, flash-attn and peft. Upstream's own test (tests/test_loss_aggregation.py) loads
``loss.py`` and ``utils.py`` into a private package; ``utils.py`` imports deepspeed at the top,
so here the private package's ``utils`` is a stub holding only upstream's ``masked_mean``,
compiled from the function's own source text in ``utils.py`` (so it is upstream's code).
Missing openrlhf skips these tests, except under CI (``CI`` set), where it fails.
"""

import importlib.util
import inspect
import sys
import types

import pytest
import torch
from orl_helpers import load_upstream_loss, openrlhf_dir

from fp8rl.rl.aggregation import aggregate
from fp8rl.rl.correction import corrected_ppo_token_loss
from fp8rl.rl.dapo import overlong_penalty


@pytest.fixture
def upstream(monkeypatch):
    """Upstream's ``loss`` module (see ``orl_helpers.load_upstream_loss``) and the wheel's root."""
    from importlib.metadata import version

    root = openrlhf_dir()
    assert version("openrlhf") == "0.11.2", "parity is pinned to openrlhf 0.11.2"
    return types.SimpleNamespace(loss=load_upstream_loss(monkeypatch), root=root)


def test_upstream_signature_is_the_pinned_one(upstream):
    """Fails loudly if the loaded PolicyLoss is not 0.11.2's (forward args, 5 return values)."""
    params = list(inspect.signature(upstream.loss.PolicyLoss.forward).parameters)
    assert params == [
        "self", "log_probs", "old_log_probs", "advantages", "action_mask",
        "rollout_log_probs", "dp_size", "batch_num_tokens", "global_batch_size",
    ]
    init = inspect.signature(upstream.loss.PolicyLoss.__init__).parameters
    assert {"is_correction_level", "is_correction_mode", "is_correction_threshold"} <= set(init)


def random_batch(seed, B=16, T=40):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 4
    lp = (old + torch.randn(B, T, generator=g) * 0.3).requires_grad_(True)
    rollout = old + torch.randn(B, T, generator=g) * 0.6  # enough mismatch that some r_is > 2
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()  # GRPO-like per-sequence A
    adv[: B // 4] = torch.randn(B // 4, T, generator=g)  # and some per-token A
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return lp, old, rollout, adv, mask


CASES = [
    # (our correction, its params, upstream PolicyLoss kwargs)
    ("tis", {"cap": 2.0}, dict(is_correction_level="token", is_correction_mode="clip",
                              is_correction_threshold=(0.0, 2.0))),
    ("icepop", {"low": 0.5, "high": 5.0}, dict(is_correction_level="token", is_correction_mode="mask",
                                               is_correction_threshold=(0.5, 5.0))),
    ("none", {}, dict(is_correction_level="off")),
]


@pytest.mark.parametrize("correction, params, up_kwargs", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_policy_loss_token_mean_matches_openrlhf(upstream, correction, params, up_kwargs, dual_clip, seed):
    eps_low, eps_high = 0.2, 0.28
    lp, old, rollout, adv, mask = random_batch(seed)
    theirs = upstream.loss.PolicyLoss(
        clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip=dual_clip, token_level_loss=True, **up_kwargs
    )
    t_loss, t_clip, t_kl, t_vllm_kl, t_filter = theirs(lp, old, adv, mask.float(), rollout_log_probs=rollout)
    (t_grad,) = torch.autograd.grad(t_loss, lp)

    loss_mat, m = corrected_ppo_token_loss(
        lp, old, rollout, adv, mask, low=1 - eps_low, high=1 + eps_high, dual_clip=dual_clip,
        correction=correction, correction_params=params,
    )
    ours = aggregate(loss_mat, mask, "token-mean")
    (o_grad,) = torch.autograd.grad(ours, lp)

    assert float(m["actor/clipfrac"]) > 0.05  # the batch really clips
    torch.testing.assert_close(ours, t_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(o_grad, t_grad, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(m["actor/clipfrac"], t_clip, rtol=0, atol=1e-7)
    torch.testing.assert_close(m["actor/ppo_kl"], t_kl.detach(), rtol=1e-6, atol=1e-7)
    if correction == "none":
        assert t_vllm_kl is None and t_filter is None
    else:
        assert float(m["rollout/is_clipfrac"]) > 0  # some weights were truncated / masked
        torch.testing.assert_close(m["rollout/is_clipfrac"], t_filter, rtol=0, atol=1e-7)
        torch.testing.assert_close(m["rollout/mismatch_k1"], t_vllm_kl, rtol=1e-6, atol=1e-7)


def test_sharded_token_mean_matches_openrlhf_dp(upstream):
    """Our shard value x dp_size is OpenRLHF's per-rank loss with batch_num_tokens and dp_size."""
    lp, old, _, adv, mask = random_batch(7)
    theirs = upstream.loss.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28)
    total = mask.sum()
    dp = 2
    for rows in (slice(0, 5), slice(5, None)):
        t_loss, *_ = theirs(lp[rows], old[rows], adv[rows], mask[rows].float(), dp_size=dp, batch_num_tokens=total)
        loss_mat, _ = corrected_ppo_token_loss(lp[rows], old[rows], None, adv[rows], mask[rows], low=0.8, high=1.28)
        ours = aggregate(loss_mat, mask[rows], "token-mean", global_tokens=total)
        torch.testing.assert_close(ours * dp, t_loss, rtol=1e-6, atol=1e-7)


def test_seq_mean_token_mean_matches_openrlhf_aggregate_loss(upstream):
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(6, 10, generator=g)
    mask = torch.rand(6, 10, generator=g) > 0.4
    mask[2] = False  # a fully masked sequence is excluded by both
    theirs = upstream.loss.aggregate_loss(loss, mask.float(), token_level_loss=False)
    torch.testing.assert_close(aggregate(loss, mask, "seq-mean-token-mean"), theirs, rtol=1e-6, atol=1e-7)


def test_overlong_penalty_matches_openrlhf(upstream, monkeypatch):
    """DAPO soft overlong penalty vs OpenRLHF's apply_overlong_penalty (loaded by path)."""
    logging_stub = types.ModuleType("openrlhf.utils.logging_utils")
    logging_stub.init_logger = lambda name: None
    monkeypatch.setitem(sys.modules, "openrlhf.utils.logging_utils", logging_stub)
    path = upstream.root / "trainer" / "ppo_utils" / "length_penalty.py"
    spec = importlib.util.spec_from_file_location("_fp8rl_orl_models.length_penalty", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    max_len, cache_len, factor = 64, 16, 0.7
    lengths = torch.arange(0, 80)
    exp = types.SimpleNamespace(response_length=lengths, rewards=torch.zeros(len(lengths), dtype=torch.float64))
    mod.apply_overlong_penalty([exp], max_len, cache_len, factor)
    ours = overlong_penalty(lengths, max_len=max_len, cache_len=cache_len, factor=factor)
    torch.testing.assert_close(ours.double(), exp.rewards, rtol=1e-6, atol=1e-7)


def test_missing_openrlhf_skips_locally_and_fails_under_ci(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        openrlhf_dir()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="required under CI"):
        openrlhf_dir()
