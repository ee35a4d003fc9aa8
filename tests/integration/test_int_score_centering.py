"""Score Centering at paper scale, for real: vLLM 0.29's own logprob types, and one
``score_centering_tis`` cell through the launcher on the CPU job (tiny Qwen3, vLLM's CPU build,
Ray, DeepSpeed ZeRO-3, OpenRLHF 0.11.2; ``support/score_centering_run.py``).

The cell is the paper-smoke GRPO BF16 cell on the ``score_centering_tis`` arm with k = 4, two
steps, no evaluation, and ``clip.tis_cap = 1.01``: with the paper's cap 2 the TIS-mode coefficient
``m - alpha p`` is exactly 0 wherever no clamp binds (``fp8rl.rl.score_centering``), which on the
BF16 smoke model (rollout and trainer one set of weights, alpha = 1 for rho ~ 0.99 >= 1/2) is
every token: the term would be 0 and show nothing. At 1.01, alpha = 1.01 rho < 1 and the term is
non-zero. Shown: the train requests asked vLLM for ``logprobs=k`` and the engines answered them
(``max_logprobs`` raised from upstream's 1: vLLM refuses more than it); the sampler's top-k reached
every micro-batch's loss aligned with the tokens (the sampled token's rollout log-prob is a head
entry or below the head, and the trainer's log p gathered at that id equals upstream's own action
log-prob there); the term the loss added is the pure function's on those inputs; ``sc/*`` are
logged each step, finite, head mass in (0, 1].
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from int_ahead import Job

pytestmark = pytest.mark.integration

K, TIS_CAP, STEPS = 4, 1.01, 2
AHEAD = {"sc_run": Job("sc_run", "script", "score_centering_run",
                       {"k": K, "tis_cap": TIS_CAP, "steps": STEPS}, timeout_s=900, expected_s=150)}


@pytest.fixture(scope="module")
def sc_run(request, scenarios_ahead, integration_ready):
    return scenarios_ahead.result(request, "sc_run")


def test_extraction_reads_vllms_own_logprob_types(sc_run):
    v = sc_run["vllm_types"]
    vals, want = v["want"]
    assert v["logprob_type"] == "Logprob" and set(v["entries"]) == {K, K + 1}  # sampled in and outside the head
    assert torch.equal(v["ids"].long(), want) and torch.equal(v["lps"], vals)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def test_the_cell_ran_and_logged_sc_metrics_each_step(sc_run):
    run = Path(sc_run["run_dir"])
    assert json.loads((run / "status.json").read_text())["state"] == "DONE"
    spec = json.loads((run / "openrlhf" / "plugin_spec.json").read_text())
    assert spec["score_centering"] == {"mode": "tis", "bounds": [0.0, TIS_CAP], "topk": K}
    rows = _jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        vals = [r.get(k) for k in ("sc/head_mass", "sc/rho", "sc/term_abs")]
        assert all(isinstance(x, float) and math.isfinite(x) for x in vals), r
        assert 0 < r["sc/head_mass"] <= 1 and r["sc/rho"] > 0, r
    assert max(r["sc/term_abs"] for r in rows) > 0
    draws = [d for d in _jsonl(run / "openrlhf" / "dumps" / "rollout_draws.jsonl") if d.get("purpose") == "train"]
    assert draws and all(d["params"]["logprobs"] == K for d in draws)  # vLLM was asked for the top-k


def test_the_top_k_reached_every_loss_aligned_and_the_term_is_the_pure_functions(sc_run):
    from fp8rl.rl.score_centering import score_centering_loss_mat, score_centering_term

    dumps = sorted((Path(sc_run["run_dir"]) / "openrlhf" / "dumps").glob("rank*-*.pt"))
    assert len(dumps) >= 2 * STEPS
    matched = 0
    for path in dumps:
        r = torch.load(path, weights_only=False)
        m, ids = r["mask"].bool(), r["sc_topk_ids"]
        tl, sl, rl = r["sc_train_logp_topk"], r["sc_sampler_logp_topk"], r["rollout_log_probs"]
        assert ids.shape == (*m.shape, K) and tl.shape == sl.shape == ids.shape and int(m.sum()) > 0
        head = ids[m]
        assert bool((head.sort(-1).values[:, 1:] != head.sort(-1).values[:, :-1]).all())  # k distinct ids
        mass = sl.exp().sum(-1)[m]
        assert bool((mass > 0).all() and (mass <= 1 + 1e-3).all())
        hit = ((sl - rl.unsqueeze(-1)).abs() < 1e-6) & m.unsqueeze(-1)  # the sampled id's head column
        in_head = hit.any(-1)
        assert bool((rl[m & ~in_head] <= sl.min(-1).values[m & ~in_head] + 1e-6).all())  # else below the head
        lp = r["log_probs"].unsqueeze(-1).expand_as(tl)
        torch.testing.assert_close(tl[hit], lp[hit], rtol=0, atol=1e-5)  # trainer log p at that id = upstream's
        matched += int(hit.sum())
        C = score_centering_term(tl, sl, "tis", bounds=(0.0, TIS_CAP), mask=m)
        torch.testing.assert_close(r["sc_term"], C, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(r["sc_loss_term"], score_centering_loss_mat(C, r["advantages"], m),
                                   rtol=1e-6, atol=1e-7)
    assert matched > 0
