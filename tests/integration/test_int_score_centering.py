"""Score Centering at paper scale, for real, on what ``make paper-smoke`` ran (``smoke_job``).

The smoke job's DAPO cell ``dapo-8b-tensorwise-score_centering_tis``
(``sweeps/smoke_cell/dapo_tensorwise_score_centering_tis.yaml``: full FP8 tensorwise, TIS, the
Score Centering term in its TIS mode with k = 4; tiny Qwen3, vLLM's CPU build, Ray, DeepSpeed
ZeRO-3, OpenRLHF 0.11.2, through Slurm, with DAPO's dynamic filtering and an episode end inside a
step) carries the sampler's top-k from the engines to the loss. The TIS-mode coefficient
``m - alpha p`` is 0 wherever no clamp binds (``fp8rl.rl.score_centering``): at the paper's cap 2
that was every token of this cell too (head p/q within 0.73-1.24, rho within 0.85-1.07), so the
cell runs ``clip.tis_cap = 1.05``, where both clamps (p > C q on a head id; C rho < 1) bind in
every micro-batch, and the term is checked non-zero at every step.
Shown: the train requests asked vLLM for ``logprobs=k`` and the engines answered them
(``max_logprobs`` raised from upstream's 1: vLLM refuses more than it); the sampler's top-k reached
every micro-batch's loss aligned with the tokens (the sampled token's rollout log-prob is a head
entry or below the head, and the trainer's log p gathered at that id equals upstream's own action
log-prob there); the term the loss added is the pure function's on those inputs; ``sc/*`` are
logged each step, finite, head mass in (0, 1], and equal the token means of the dumped terms.
The TIS and DAPO checks of the same cell are ``test_int_paper_smoke.py`` and
``test_int_smoke_algorithm.py``'s.

Without a launch: vLLM 0.29's own ``Logprob`` / ``CompletionOutput`` read by the plugin's
extraction (``support/sc_vllm_types.py``, seconds).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from int_ahead import Job
from smoke_job import STEPS, jsonl, loss_dumps, metrics

pytestmark = pytest.mark.integration

#: The smoke job's Score Centering cell and its k (sweeps/smoke_cell/dapo_tensorwise_score_centering_tis.yaml).
SC_CELL, K = "dapo-8b-tensorwise-score_centering_tis", 4
AHEAD = {"vllm_types": Job("vllm_types", "script", "sc_vllm_types", {"k": K}, timeout_s=300, expected_s=20)}


@pytest.fixture(scope="module")
def sc(runs):
    run = runs.get(SC_CELL)
    if run is None:
        pytest.skip(f"{SC_CELL} not in this (partial) smoke run")
    return run


def _clip(run) -> dict:
    return yaml.safe_load((run / "config.yaml").read_text())["clip"]


def test_extraction_reads_vllms_own_logprob_types(request, scenarios_ahead, integration_ready):
    v = scenarios_ahead.result(request, "vllm_types")
    vals, want = v["want"]
    assert v["logprob_type"] == "Logprob" and set(v["entries"]) == {K, K + 1}  # sampled in and outside the head
    assert torch.equal(v["ids"].long(), want) and torch.equal(v["lps"], vals)


def test_the_cell_asked_vllm_for_the_top_k_and_logged_sc_metrics_each_step(sc):
    clip = _clip(sc)
    assert clip["arm"] == "score_centering_tis" and clip["score_centering_topk"] == K
    spec = json.loads((sc / "openrlhf" / "plugin_spec.json").read_text())
    assert spec["score_centering"] == {"mode": "tis", "bounds": [0.0, float(clip["tis_cap"])], "topk": K}
    rows = metrics(sc)
    assert sorted(rows) == list(range(1, STEPS + 1))
    for step, r in rows.items():
        vals = [r.get(k) for k in ("sc/head_mass", "sc/rho", "sc/term_abs")]
        assert all(isinstance(x, float) and math.isfinite(x) for x in vals), (step, r)
        assert 0 < r["sc/head_mass"] <= 1 and r["sc/rho"] > 0, (step, r)
    assert all(r["sc/term_abs"] > 0 for r in rows.values()), rows  # some clamp bound in every step
    draws = [d for d in jsonl(sc / "openrlhf" / "dumps" / "rollout_draws.jsonl") if d.get("prompts")]
    train = [d for d in draws if d.get("purpose") == "train"]
    assert train and all(d["params"]["logprobs"] == K for d in train)  # every train request, replacements too
    assert all(d["params"].get("logprobs") != K for d in draws if d.get("purpose") == "eval")  # evaluation: none


def test_the_top_k_reached_every_loss_aligned_and_the_term_is_the_pure_functions(sc):
    """Every micro-batch the loss dumped (the DAPO steps' batches after filtering and the episode
    end): the top-k laid out on the action positions, aligned with the sampled tokens, the term and
    A * C the pure functions' on the dumped inputs, and each step's ``sc/*`` the token means of them."""
    from fp8rl.rl.score_centering import (
        score_centering_loss_mat,
        score_centering_term,
        tail_mass_ratio,
    )

    cap = float(_clip(sc)["tis_cap"])
    rows = metrics(sc)
    by_step = loss_dumps(sc)
    assert sorted(by_step) == list(range(1, STEPS + 1))
    matched = nonzero = head_bound = tail_bound = 0
    for step, recs in by_step.items():
        sums = dict.fromkeys(("head", "rho", "term", "tokens"), 0.0)
        for r in recs:
            where = (step, r["rank"], r["n"])
            m, ids = r["mask"].bool(), r["sc_topk_ids"]
            tl, sl, rl = r["sc_train_logp_topk"], r["sc_sampler_logp_topk"], r["rollout_log_probs"]
            assert ids.shape == (*m.shape, K) and tl.shape == sl.shape == ids.shape and int(m.sum()) > 0, where
            head = ids[m].sort(-1).values
            assert bool((head[:, 1:] != head[:, :-1]).all()), where  # k distinct ids at every response token
            mass = sl.exp().sum(-1)[m]
            assert bool((mass > 0).all() and (mass <= 1 + 1e-3).all()), where
            # the sampled id's head column: its rollout log-prob is one of the head's (the same dict)...
            hit = ((sl - rl.unsqueeze(-1)).abs() < 1e-6) & m.unsqueeze(-1)
            in_head = hit.any(-1)
            # ... or it lies below the head
            assert bool((rl[m & ~in_head] <= sl.min(-1).values[m & ~in_head] + 1e-6).all()), where
            # trainer log p at that id = upstream's action log-prob (where q ties, one tied column is it)
            lp = r["log_probs"].unsqueeze(-1).expand_as(tl)
            gap = torch.where(hit, (tl - lp).abs(), torch.full_like(tl, math.inf)).min(-1).values[in_head]
            assert bool((gap <= 1e-5).all()), (where, float(gap.max()))
            matched += int(in_head.sum())
            C = score_centering_term(tl, sl, "tis", bounds=(0.0, cap), mask=m)
            torch.testing.assert_close(r["sc_term"], C, rtol=1e-6, atol=1e-7)
            AC = score_centering_loss_mat(C, r["advantages"], m)
            torch.testing.assert_close(r["sc_loss_term"], AC, rtol=1e-6, atol=1e-7)
            nonzero += int((C[m] != 0).sum())
            rho = tail_mass_ratio(tl.double(), sl.double())
            head_bound += int(((tl - sl).exp() > cap).any(-1)[m].sum())  # m = C q < p on a head id
            tail_bound += int((cap * rho < 1)[m].sum())  # alpha = C rho < 1
            sums["head"] += float(mass.double().sum())
            sums["rho"] += float(rho[m].sum())
            sums["term"] += float(AC.double().abs()[m].sum())
            sums["tokens"] += float(m.sum())
        row = rows[step]
        for key, s in (("sc/head_mass", "head"), ("sc/rho", "rho"), ("sc/term_abs", "term")):
            assert row[key] == pytest.approx(sums[s] / sums["tokens"], rel=1e-4, abs=1e-9), (step, key)
    assert matched > 0 and nonzero > 0, (matched, nonzero)
    assert head_bound > 0 and tail_bound > 0, (head_bound, tail_bound)  # both clamps of the TIS mode bound
