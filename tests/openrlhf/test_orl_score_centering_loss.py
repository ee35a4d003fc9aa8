"""Score Centering at paper scale: the options from the config to the spec and the loss, the term
in our ``PolicyLoss`` against a reference from the pure functions around upstream 0.11.2's own
``PolicyLoss``, the ``sc/*`` step metrics, and the dry run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from orl_helpers import random_batch
from test_orl_cpu_job import smoke_config

from fp8rl.backends.openrlhf.command import plugin_lines
from fp8rl.backends.openrlhf.plugin import PluginSpec, StepMetrics, make_policy_loss_class
from fp8rl.backends.openrlhf.plugin.score_centering import engine_kwargs
from fp8rl.rl.score_centering import score_centering_loss_mat, score_centering_term, tail_mass_ratio
from fp8rl.runs import metrics as M

K = 4
TIS = dict(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.0, 2.0))


def _cell(tmp_path, arm: str, **clip):
    """The smoke job's Score Centering cell as ``arm``, at the paper's TIS cap 2 (the smoke cell
    itself runs 1.05 so that a clamp binds on its tiny model)."""
    cfg = smoke_config(tmp_path, "dapo_tensorwise_score_centering_tis")
    return dataclasses.replace(cfg, clip=dataclasses.replace(cfg.clip, arm=arm, **{"tis_cap": 2.0, **clip}))


@pytest.mark.parametrize("arm, mode, bounds", [("score_centering_tis", "tis", (0.0, 2.0)),
                                               ("score_centering", "none", None)])
def test_the_arms_options_reach_the_spec_its_json_and_the_engines(tmp_path, arm, mode, bounds):
    cfg = _cell(tmp_path, arm, score_centering_topk=K)
    spec = PluginSpec.from_config(cfg, run_dir=tmp_path / "run")
    assert spec.score_centering == cfg.clip.score_centering_options() == {"mode": mode, "bounds": bounds, "topk": K}
    back = PluginSpec.from_json(spec.to_json())
    assert back == spec and back.score_centering == spec.score_centering
    assert engine_kwargs(spec.score_centering) == {"logprobs_mode": "processed_logprobs", "max_logprobs": K}
    plain = PluginSpec.from_config(_cell(tmp_path, "tis"), run_dir=tmp_path / "run")
    assert plain.score_centering is None and engine_kwargs(plain.score_centering) == {}
    assert PluginSpec.from_json(plain.to_json()).score_centering is None


def test_bad_score_centering_options_are_refused_naming_the_field():
    ok = {"mode": "tis", "bounds": [0.0, 2.0], "topk": 3}
    for bad, match in [({**ok, "mode": "clip"}, "mode"), ({**ok, "topk": 0}, "topk"), ({**ok, "topk": True}, "topk"),
                       ({**ok, "bounds": None}, "bounds"), ({**ok, "bounds": [2.0, 1.0]}, "lo < hi"),
                       ({"mode": "none", "bounds": [0, 2], "topk": 3}, "no bounds"), ({"mode": "tis"}, "keys")]:
        with pytest.raises(ValueError, match=match):
            PluginSpec(seed=0, score_centering=bad)
    with pytest.raises(ValueError, match="needs a seed"):
        PluginSpec(score_centering=ok)


def test_the_dry_run_shows_the_options_reaching_the_spec(tmp_path):
    (line,) = plugin_lines(_cell(tmp_path, "score_centering_tis", score_centering_topk=K), tmp_path / "run")
    assert "score_centering mode=tis bounds=[0, 2] topk=4" in line
    assert "logprobs=4" in line and "logprobs_mode=processed_logprobs, max_logprobs=4" in line
    assert plugin_lines(_cell(tmp_path, "tis"), tmp_path / "run") == []


def _sc_batch(seed: int, B: int, T: int):
    """Trainer log p (with gradient) and sampler log q at k ids: full-vocabulary log-probs of a
    V = 9 toy vocabulary, the sampler a perturbed trainer."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, 9, generator=g) * 2
    lp_full = torch.log_softmax(z, -1)
    lq_full = torch.log_softmax(z + torch.randn(B, T, 9, generator=g) * 0.5, -1)
    ids = lq_full.topk(K, dim=-1).indices
    return lp_full.gather(-1, ids).requires_grad_(True), lq_full.gather(-1, ids), ids


@pytest.mark.parametrize("arm", ["score_centering_tis", "score_centering"])
def test_the_loss_adds_a_times_c_before_the_reduction(upstream_loss, tmp_path, arm):
    """Our loss with the spec of a Score Centering cell = upstream's ``PolicyLoss`` (the same IS
    correction) + the token mean of ``A * C`` from ``fp8rl.rl.score_centering``; the gradient
    into the trainer's top-k log-probs is ``A * (m - alpha p)`` / tokens; ``sc/*`` from the sums."""
    cfg = _cell(tmp_path, arm, score_centering_topk=K)
    spec = dataclasses.replace(PluginSpec.from_config(cfg, run_dir=tmp_path / "r"), dump_dir=None)
    corr = TIS if arm == "score_centering_tis" else dict(is_correction_level="off")
    kw = dict(clip_eps_low=spec.eps_low, clip_eps_high=spec.eps_high, token_level_loss=True, **corr)
    ours, theirs = make_policy_loss_class(upstream_loss.PolicyLoss, spec)(**kw), upstream_loss.PolicyLoss(**kw)
    lp, old, rollout, adv, mask = random_batch(4)
    B, T = lp.shape
    train_lp, sampler_lp, ids = _sc_batch(5, B, T)
    metrics = StepMetrics()
    ours.sc_inputs, ours.step_metrics = (train_lp, sampler_lp, ids), metrics
    got = ours(lp, old, adv, mask, rollout_log_probs=rollout)[0]
    assert ours.sc_inputs is None  # consumed: the next micro-batch needs its own
    want_base = theirs(lp, old, adv, mask, rollout_log_probs=rollout)[0]
    opts = spec.score_centering
    C = score_centering_term(train_lp, sampler_lp, opts["mode"], bounds=opts["bounds"], mask=mask)
    ac = score_centering_loss_mat(C, adv, mask)
    want = want_base + (ac * mask).sum() / mask.sum()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert abs(float((want - want_base).detach())) > 1e-4  # the term is really there
    (g_got,) = torch.autograd.grad(got, train_lp)
    (g_want,) = torch.autograd.grad(want, train_lp)
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-8)
    out = metrics.finalize()
    m = mask.bool()
    head = sampler_lp.exp().sum(-1)
    assert 0 < out[M.SC_HEAD_MASS] <= 1
    assert out[M.SC_HEAD_MASS] == pytest.approx(float(head[m].mean()), rel=1e-6)
    assert out[M.SC_RHO] == pytest.approx(float(tail_mass_ratio(train_lp, sampler_lp)[m].mean()), rel=1e-6)
    assert out[M.SC_TERM_ABS] == pytest.approx(float(ac.detach().abs()[m].mean()), rel=1e-6)


def test_the_loss_refuses_a_micro_batch_without_top_k_and_a_mode_unlike_its_correction(upstream_loss):
    spec = PluginSpec(seed=0, score_centering={"mode": "tis", "bounds": [0.0, 2.0], "topk": K})
    cls = make_policy_loss_class(upstream_loss.PolicyLoss, spec)
    loss = cls(clip_eps_low=0.2, clip_eps_high=0.2, **TIS)
    lp, old, rollout, adv, mask = random_batch(1)
    with pytest.raises(RuntimeError, match="no top-k"):
        loss(lp, old, adv, mask, rollout_log_probs=rollout)
    with pytest.raises(ValueError, match="disagrees with the IS correction"):
        cls(clip_eps_low=0.2, clip_eps_high=0.2, is_correction_level="off")
    with pytest.raises(ValueError, match="TIS cap"):
        cls(clip_eps_low=0.2, clip_eps_high=0.2, **{**TIS, "is_correction_threshold": (0.0, 3.0)})


def test_sc_metrics_are_token_means_over_micro_batches_and_ranks():
    def sums(head, rho, term, n):
        return {k: torch.tensor(float(v), dtype=torch.float64)
                for k, v in zip(("sc_head", "sc_rho", "sc_term_abs", "sc_tokens"), (head, rho, term, n), strict=True)}

    a, b = StepMetrics(), StepMetrics()
    a.add_score_centering(sums(3.0, 6.0, 0.3, 4))
    a.add_score_centering(sums(1.5, 1.0, 0.1, 2))
    b.add_score_centering(sums(3.5, 1.0, 0.6, 4))
    ones = torch.ones(1, 1)
    for s in (a, b):
        s.add(ones, ones, ones.bool(), low=0.8, high=1.2)
    packed = []
    b.finalize(lambda t: packed.append(t.clone()) or t)  # rank b's vector, as the all-reduce sees it
    reduce = lambda t: t + packed[0]  # noqa: E731 -- two ranks: a's vector plus b's
    out = a.finalize(reduce)
    assert out[M.SC_HEAD_MASS] == pytest.approx(8.0 / 10) and out[M.SC_RHO] == pytest.approx(8.0 / 10)
    assert out[M.SC_TERM_ABS] == pytest.approx(1.0 / 10)
    assert M.SC_HEAD_MASS not in StepMetrics().finalize()  # arms without the term log none
    with pytest.raises(KeyError, match="sc_tokens"):
        a.add_score_centering({"sc_head": torch.tensor(1.0)})
