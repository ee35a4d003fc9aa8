"""The RL algorithm around the FP8 side, checked on what ``make paper-smoke`` ran.

Reads the smoke job's run directories and dumps (``smoke_job``): ``rollout_draws.jsonl`` (every
prompt the PPO trainer actor drew, in dispatch order, each group kept or filtered, the
replacements asked for and those that found no prompt left, and each batch handed to training),
the per-micro-batch loss inputs of every actor rank, the engines' weights after every sync and
``summary.json``. Each test names the event it needs and fails when the job did not produce it.
"""

from __future__ import annotations

import json

import pytest
import torch
from smoke_job import INTERRUPTED, REFERENCE, STEPS, SWEEP, jsonl, loss_dumps, metrics, syncs

pytestmark = pytest.mark.integration

DAPO = ("dapo-8b-tensorwise-score_centering_tis", "dapo-8b-rollout_only-vanilla")
TWO_RANKS = "dapo-8b-rollout_only-vanilla"  # sweeps/smoke_cell/dapo_rollout_only_vanilla.yaml
PROMPTS_PER_STEP, GROUP = 4, 4


def _draws(run) -> list[dict]:
    return jsonl(run / "openrlhf" / "dumps" / "rollout_draws.jsonl")


def _dapo_rows() -> list[dict]:
    """The DAPO train set as the job wrote it (sweeps/sweep/paper_smoke.yaml: ``smoke_dapo``)."""
    path = SWEEP.parent / ".cache" / "openrlhf_data" / "smoke_dapo.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _seeded_order(n: int, seed: int) -> list[int]:
    """The first episode's row order of OpenRLHF's own prompt loader (``StatefulDataLoader``,
    shuffled, as ``train_ppo_ray`` builds it) seeded as the plugin seeds it."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from fp8rl.backends.openrlhf.plugin.binding.rollout import seed_prompt_sampler

    loader = StatefulDataLoader(list(range(n)), batch_size=1, shuffle=True, drop_last=True)
    seed_prompt_sampler(loader, seed)
    return [int(i) for i in loader]


def _dapo_runs(runs) -> dict:
    got = {p: runs[p] for p in DAPO if p in runs}
    if not got:
        pytest.skip("no DAPO cell in this (partial) smoke run")
    return got


def test_dapo_cells_ran_out_of_prompts_inside_a_step(runs):
    """Issue 20's event, happening: the first episode's prompts all drawn in the seeded order, the
    last ones (unanswerable, always filtered) asking for replacements when no prompt was left, and
    the run going on into the next episode to its last step."""
    dapo = _dapo_runs(runs)
    rows = _dapo_rows()
    order = _seeded_order(len(rows), 0)
    dead = [i for i, r in enumerate(rows) if r["label"] == "none"]
    assert dead and sorted(order[-len(dead):]) == dead  # the data put them last in the loader's order
    for prefix, run in dapo.items():
        train = [d for d in _draws(run) if d.get("purpose") == "train"]
        end = next((i for i, d in enumerate(train) if d["exhausted"]), None)
        assert end is not None, (prefix, "no draw ran out of prompts", [len(d["prompts"]) for d in train])
        drawn = [p for d in train[:end + 1] for p in d["prompts"]]
        assert drawn == [rows[i]["input"] for i in order], prefix  # every prompt, in the seeded order
        last = train[end]
        assert last["missed"] >= 1 and last["replacements"] >= last["missed"], (prefix, last)
        assert sum(last["kept"]) < PROMPTS_PER_STEP, (prefix, last)  # the step could not be filled
        assert last["steps_done"] < STEPS and any(d["steps_done"] > last["steps_done"] for d in train), prefix
        assert sorted(metrics(run)) == list(range(1, STEPS + 1)), prefix


def test_the_partial_batch_at_the_episode_end_was_dropped_on_every_rank(runs):
    """The batch cut short by the episode end (fewer groups than a step) went to no rank; every
    trained step gave both ranks of the two-rank cell the same number of micro-batches."""
    for prefix, run in _dapo_runs(runs).items():
        batches = [d for d in _draws(run) if d.get("batch")]
        short = [b for b in batches if 0 < b["samples"] < b["full"]]
        assert short and all(b["trained"] == 0 and b["exhausted"] for b in short), (prefix, batches)
        assert all(b["trained"] in (0, PROMPTS_PER_STEP * GROUP) for b in batches), prefix
    run = runs.get(TWO_RANKS)
    if run is None:
        pytest.skip(f"{TWO_RANKS} not in this (partial) smoke run")
    per = {}
    for p in sorted((run / "openrlhf" / "dumps").glob("rank*-*.pt")):
        rec = torch.load(p, weights_only=False)
        key = (int(rec["step"]) + 1, int(rec["rank"]))  # the dump's step: steps done before it
        per[key] = per.get(key, 0) + 1
    for step in range(1, STEPS + 1):
        counts = [per.get((step, r), 0) for r in (0, 1)]
        assert counts[0] == counts[1] > 0, (step, counts)


def test_kept_group_frac_is_the_kept_share_of_the_prompts_drawn(runs):
    """``dapo/kept_group_frac`` is a fraction in [0, 1] (the mini backend's scale), and at every
    step it equals the kept groups over the prompts drawn for that step's batch."""
    for prefix, run in _dapo_runs(runs).items():
        rows = metrics(run)
        train = [d for d in _draws(run) if d.get("purpose") == "train" and d["prompts"]]
        by_step = {}
        for d in train:  # a step's batch: the draws made with that many steps done
            by_step.setdefault(d["steps_done"] + 1, []).append(d)
        for step, row in rows.items():
            frac = row["dapo/kept_group_frac"]
            draws = by_step[step]
            kept, drawn = sum(sum(d["kept"]) for d in draws[-1:]), sum(len(d["prompts"]) for d in draws[-1:])
            assert 0.0 <= frac <= 1.0 and frac == pytest.approx(kept / drawn), (prefix, step, frac, kept, drawn)
        assert not all(k for d in train for k in d["kept"]), prefix  # filtering happened in the job


def test_the_final_evaluation_scored_the_last_synced_weights(runs):
    """``summary.json`` names what the final evaluation scored: the last step's checkpoint, whose
    engine held exactly the parameters the rollout engines held after the run's last weight sync."""
    from fp8rl.backends.openrlhf.plugin.binding.vllm_worker import weights_digest

    for prefix, run in runs.items():
        final = json.loads((run / "summary.json").read_text())["final_eval"]
        (own,) = [w for w in final["weights"] if w["precision"] == "own"]
        assert (own["pass"], own["step"], own["model"]) == ("final", STEPS, "checkpoint/final"), (prefix, own)
        assert own["digest"] == weights_digest(syncs(run)[-1]["digest"]), prefix
        assert own["digest"] != weights_digest(syncs(run)[0]["digest"]), prefix  # the weights moved


# ------------------------------------------------------------------------------------------
# rewards, advantages, dynamic sampling, the loss: recomputed from what the trainer dumped
# ------------------------------------------------------------------------------------------


def _config(run) -> dict:
    from fp8rl.runs import RunDir

    return RunDir(run).config()


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SWEEP.parent / ".cache" / "openrlhf_data" / "smoke_model" / "model"))


def _boxed(text: str) -> str | None:
    """The last ``\\boxed{...}`` of ``text`` (balanced braces), written here, not the reward's."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def _correct(response: str, label: str) -> bool:
    """An a+b answer is right when its box holds the label's integer (the smoke task's answers)."""
    got = _boxed(response)
    if got is None or label == "none":
        return False
    try:
        return int(got.strip()) == int(label)
    except ValueError:
        return got.strip() == label.strip()


def _experiences(run) -> dict[int, list[dict]]:
    """Step -> the samples the trainer built that step (each: tokens, response, reward, score,
    advantage per token, index, prompt, label), the last attempt's where a step ran twice."""
    by_step: dict[int, dict] = {}
    for p in sorted((run / "openrlhf" / "dumps").glob("experiences-step*.pt")):
        rec = torch.load(p, weights_only=False)
        step = rec["steps_done"] + 1
        if step not in by_step or rec["time"] > by_step[step]["time"]:
            by_step[step] = rec
    tok = _tokenizer()
    out = {}
    for step, rec in by_step.items():
        samples = []
        for e in rec["experiences"]:
            for b in range(e["sequences"].shape[0]):
                ids = [t for t in e["sequences"][b].tolist() if t != tok.pad_token_id]
                n_prompt = len(tok(e["prompts"][b], add_special_tokens=False).input_ids)
                samples.append({"prompt": e["prompts"][b], "label": e["labels"][b], "index": e["index"][b],
                                "response": tok.decode(ids[n_prompt:]), "length": len(ids) - n_prompt,
                                "dumped_length": int(e["response_length"][b]), "reward": float(e["rewards"][b]),
                                "score": float(e["scores"][b]),
                                "advantages": e["advantages"][b][e["action_mask"][b].bool()]})
        out[step] = samples
    return out


def _groups(samples: list[dict], n: int) -> list[list[dict]]:
    by = {}
    for s in samples:
        by.setdefault(s["index"] // n, []).append(s)
    return [sorted(g, key=lambda s: s["index"]) for _, g in sorted(by.items())]


def test_dynamic_sampling_trained_only_groups_with_mixed_rewards(runs):
    """DAPO: every group that reached the trainer has some right and some wrong samples; the job
    filtered groups and asked for replacements (``rollout_draws.jsonl``)."""
    for prefix, run in _dapo_runs(runs).items():
        exps = _experiences(run)
        assert sorted(exps) == list(range(1, STEPS + 1)), prefix
        for step, samples in exps.items():
            groups = _groups(samples, GROUP)
            assert len(groups) == PROMPTS_PER_STEP and all(len(g) == GROUP for g in groups), (prefix, step)
            for g in groups:
                assert len({s["score"] for s in g}) == 2, (prefix, step, [s["score"] for s in g])
        train = [d for d in _draws(run) if d.get("purpose") == "train"]
        assert sum(d["replacements"] for d in train) > 0 and not all(k for d in train for k in d["kept"]), prefix
        # and logged per step: the groups dropped and replacements asked for while drawing its batch
        for step, row in metrics(run).items():
            mine = [d for d in train if d["steps_done"] == step - 1]
            assert row["dapo/filtered_groups"] == sum(d["kept"].count(False) for d in mine), (prefix, step)
            assert row["dapo/replacements"] == sum(d["replacements"] for d in mine), (prefix, step)


def test_the_rewards_the_trainer_saw_equal_an_independent_grading_with_the_penalty(runs):
    """Each sample's reward in the trainer equals its decoded response graded here (GRPO 1/0,
    DAPO +1/-1) minus DAPO's overlong penalty recomputed from its length; some DAPO sample in
    the job was penalised and some was right."""
    for prefix, run in runs.items():
        cfg = _config(run)
        a = cfg["algorithm"]
        right, wrong = (1.0, -1.0) if a["name"] == "dapo" else (1.0, 0.0)
        buffer = float(cfg["openrlhf"]["overlong_buffer_len"]) if a["name"] == "dapo" else 0.0
        limit = int(cfg["max_response_len"])
        penalised = correct = 0
        for step, samples in _experiences(run).items():
            for s in samples:
                assert s["length"] == s["dumped_length"], (prefix, step, s["response"])
                ok = _correct(s["response"], s["label"])
                want = right if ok else wrong
                if buffer:
                    exceed = min(s["length"] - (limit - buffer), buffer)
                    if exceed > 0:
                        want -= exceed / buffer * float(a["overlong_penalty"])
                        penalised += 1
                correct += ok
                assert s["score"] == float(ok), (prefix, step, s["response"], s["label"])
                assert s["reward"] == pytest.approx(want, abs=1e-6), (prefix, step, s["response"], s["label"])
        assert correct > 0, prefix
        if buffer:
            assert penalised > 0, prefix


def test_advantages_are_the_group_normalised_rewards_and_reached_the_loss(runs):
    """GRPO/DAPO advantages: (r - group mean) / (group std + 1e-9), on every response token,
    recomputed from the rewards; the advantages the loss received in that step are the same
    values (one per sequence, over both ranks' micro-batches)."""
    for prefix, run in runs.items():
        cfg = _config(run)
        n = int(cfg["algorithm"]["n_samples_per_prompt"])
        assert cfg["algorithm"]["advantage_estimator"] == "grpo", prefix  # the group-normalised estimator
        loss_adv = _loss_advantages(run)
        for step, samples in _experiences(run).items():
            want = []
            for g in _groups(samples, n):
                r = torch.tensor([s["reward"] for s in g], dtype=torch.float32)
                adv = (r - r.mean()) / (r.std() + 1e-9)
                for s, x in zip(g, adv.tolist(), strict=True):
                    assert torch.allclose(s["advantages"], torch.full_like(s["advantages"], x), atol=1e-5), \
                        (prefix, step, s["index"])
                    want.append(x)
            got = loss_adv[step]
            assert len(got) == len(want) and torch.allclose(torch.tensor(sorted(got)), torch.tensor(sorted(want)),
                                                            atol=1e-5), (prefix, step)


def _loss_advantages(run) -> dict[int, list[float]]:
    out = {}
    for step, recs in loss_dumps(run).items():
        vals = []
        for r in recs:
            mask = r["mask"].bool()
            for b in range(mask.shape[0]):
                if mask[b].any():
                    vals.append(float(r["advantages"][b][mask[b]][0]))
        out[step] = vals
    return out


def test_the_loss_is_the_token_mean_ppo_loss_under_the_configured_bounds(runs):
    """Every dumped micro-batch: the per-token loss is -min(r A, clip(r, low, high) A) (times the
    IS weights where a correction ran, plus A * C where the Score Centering term ran) under the
    arm's bounds 1 - eps_low, 1 + eps_high (the calibrated cell's: the controller's, inside the
    configured limits), and the micro-batch's loss
    is its share of one token mean over the optimizer step: its token-loss sum x DP size / N with
    N the response tokens of all micro-batches of the step's window on every rank / their count per
    rank (DeepSpeed divides each backward by that count and averages the ranks)."""
    for prefix, run in runs.items():
        cfg = _config(run)
        a, calibrated = cfg["algorithm"], cfg["clip"]["arm"] == "calibrated"
        windows = int(cfg["num_mini_batches"])
        assert a["loss_agg_mode"] == "token-mean" and a["dual_clip"] is None, prefix
        for step, recs in loss_dumps(run).items():
            window_tokens: dict[int, float] = {}
            place = {}
            for rank in {r["rank"] for r in recs}:
                mine = sorted((r for r in recs if r["rank"] == rank), key=lambda r: r["n"])
                assert len(mine) % windows == 0, (prefix, step, rank, len(mine))
                gas = len(mine) // windows
                for i, r in enumerate(mine):
                    place[id(r)] = (i // gas, gas)
                    window_tokens[i // gas] = window_tokens.get(i // gas, 0.0) + float(r["mask"].sum())
            for r in recs:
                low, high = float(r["low"]), float(r["high"])
                if calibrated:
                    assert cfg["clip"]["low_min"] <= low < 1.0 < high <= cfg["clip"]["high_max"], (prefix, step)
                else:
                    assert (low, high) == pytest.approx((1 - a["eps_low"], 1 + a["eps_high"])), (prefix, step)
                ratio, adv, mask = r["ratio"].double(), r["advantages"].double(), r["mask"].bool()
                pg = -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
                if r["is_weights"] is not None:
                    pg = pg * r["is_weights"].double()
                if r.get("sc_loss_term") is not None:  # the Score Centering cell's A * C (test_int_score_centering.py)
                    pg = pg + r["sc_loss_term"].double()
                assert torch.allclose(r["token_loss"].double()[mask], pg[mask], atol=1e-5), (prefix, step)
                w, gas = place[id(r)]
                tokens = window_tokens[w] / gas
                assert float(r["batch_num_tokens"]) == pytest.approx(tokens), (prefix, step, w)
                want = (r["token_loss"].double() * mask).sum() / tokens * r["dp_size"]
                assert float(r["loss"]) == pytest.approx(float(want), rel=1e-5, abs=1e-7), (prefix, step)


# ------------------------------------------------------------------------------------------
# evaluation
# ------------------------------------------------------------------------------------------


def test_evaluations_ran_with_the_configured_settings_and_their_scores_recompute(runs):
    """The final evaluation's engine sampled ``eval_k`` responses per problem at
    ``eval_temperature``, top-p 1, up to ``max_response_len`` tokens, over exactly the configured
    evaluation sets; avg@k and pass@k recomputed from its dumped responses equal ``summary.json``.
    OpenRLHF's evaluation during training asked the engines for the same settings."""
    for prefix, run in runs.items():
        cfg = _config(run)
        k, temp, limit = int(cfg["eval_k"]), float(cfg["eval_temperature"]), int(cfg["max_response_len"])
        rows = jsonl(run / "openrlhf" / "dumps" / "final_eval.jsonl")
        own = [r for r in rows if r["model"] == "checkpoint/final" and r["quantization"] == _own_quant(cfg)]
        assert sorted(r["dataset"] for r in own) == sorted(cfg["openrlhf"]["eval_sets"]), prefix
        summary = json.loads((run / "summary.json").read_text())
        for r in own:
            assert r["params"]["n"] == k and r["params"]["temperature"] == temp, (prefix, r["params"])
            assert r["params"]["top_p"] == 1.0 and r["params"]["max_tokens"] == limit, (prefix, r["params"])
            data = [json.loads(ln) for ln in (SWEEP.parent / ".cache" / "openrlhf_data" / f"{r['dataset']}.jsonl")
                    .read_text().splitlines() if ln.strip()]
            assert r["prompts"] == [d["input"] for d in data] and r["labels"] == [d["label"] for d in data]
            hits = [[_correct(x, lab) for x in resp] for resp, lab in zip(r["responses"], r["labels"], strict=True)]
            assert all(len(h) == k for h in hits), prefix
            avg = sum(sum(h) / k for h in hits) / len(hits)
            pas = sum(any(h) for h in hits) / len(hits)
            assert summary[f"eval/{r['dataset']}/avg@k"] == pytest.approx(avg), prefix
            assert summary[f"eval/{r['dataset']}/pass@k"] == pytest.approx(pas), prefix
        evals = [d for d in _draws(run) if d.get("purpose") == "eval" and d["prompts"]]
        assert evals, prefix
        for d in evals:
            assert d["n"] == k and d["params"]["temperature"] == temp and d["params"]["top_p"] == 1.0, (prefix, d)


def _own_quant(cfg) -> str | None:
    from fp8rl.backends.openrlhf.plugin.fp8_rollout import VLLM_QUANTIZATION

    return VLLM_QUANTIZATION.get(cfg["fp8"]["rollout_recipe"])


# ------------------------------------------------------------------------------------------
# resume
# ------------------------------------------------------------------------------------------


def test_the_resume_kept_the_step_counter_the_lr_schedule_and_the_prompt_position(runs):
    """The interrupted cell after its resume: the same steps, the learning rate of the same
    point of the warm-up (``openrlhf.lr_warmup_ratio`` makes it differ from step to step), and the
    same prompts drawn for every step, in the same order, as its uninterrupted twin."""
    import os

    if INTERRUPTED not in runs:
        pytest.skip(f"{INTERRUPTED} not in this (partial) smoke run")
    twin = next((p for p in REFERENCE.glob(INTERRUPTED + "-s0-*") if (p / "config.yaml").exists()), None)
    if twin is None:
        if os.environ.get("FP8RL_REQUIRE_PAPER_SMOKE"):
            pytest.fail(f"{REFERENCE} lacks the uninterrupted {INTERRUPTED}")
        pytest.skip(f"{REFERENCE} lacks the uninterrupted {INTERRUPTED}")
    run = runs[INTERRUPTED]
    got, want = metrics(run), metrics(twin)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    lrs = [want[s]["openrlhf/actor_lr"] for s in sorted(want)]
    assert len(set(lrs)) > 1, lrs  # the schedule moves within the run, so a reset would show
    assert [got[s]["openrlhf/actor_lr"] for s in sorted(got)] == lrs

    def drawn(path):  # per step, the last attempt's draw (a killed attempt may have drawn for it too)
        last = {}
        for d in _draws(path):
            if d.get("purpose") == "train" and d["prompts"]:
                last[d["steps_done"]] = (d["prompts"], d["kept"])
        return last

    assert drawn(run) == drawn(twin) and len(drawn(twin)) == STEPS
    assert len({p for d in _draws(run) if d.get("purpose") == "train" for p in [d["pid"]]}) >= 2  # two attempts drew
