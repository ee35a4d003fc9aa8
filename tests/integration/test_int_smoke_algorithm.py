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
from smoke_job import STEPS, SWEEP, jsonl, metrics, syncs

pytestmark = pytest.mark.integration

DAPO = ("dapo-8b-tensorwise-tis", "dapo-8b-rollout_only-vanilla")
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
    rows = _dapo_rows()
    order = _seeded_order(len(rows), 0)
    dead = [i for i, r in enumerate(rows) if r["label"] == "none"]
    assert dead and sorted(order[-len(dead):]) == dead  # the data put them last in the loader's order
    for prefix, run in _dapo_runs(runs).items():
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
