"""A DAPO cell across episode ends and a requeue, on two DP ranks of real OpenRLHF 0.11.2 (issue 20).

Each scenario (``support/scenarios.py``: ``episode_end_upstream``, ``episode_end_resume``) runs
what ``train_ppo_ray`` runs: the real ``PPOTrainer`` Ray actor (shipped by value) with its
``SamplesGenerator`` (dynamic filtering), ``RemoteExperienceMaker`` and ``RayActorGroup``, and two
real ``PolicyModelActor`` ranks (DeepSpeed ZeRO-3 on its CPU accelerator, gloo) training with
``ppo_train``; checkpoints through ``DeepspeedStrategy.save_ckpt``/``load_ckpt``. The cell is the
DAPO main-table cell's flags (``cell_flags``: dynamic filtering, clip-higher, TIS) shrunk to a
tiny Qwen3 and 4 prompts x 4 samples a step; the episode is 13 prompts, 11 of whose groups the
filter keeps: two full steps, then the prompts run out with 3 groups kept.

Stood in, and why:

- **vLLM generation and the reward** (``scenario_kit.scripted_engine``): the engine actor runs
  OpenRLHF's own ``SingleTurnAgentExecutor`` (prompt tokens, response record, rollout log-probs,
  reward function by path) but ``generate`` returns scripted letters and the reward function is
  a script (``keep`` groups score 0,1,0,1: kept; ``drop`` groups 0: filtered). The real vLLM CPU
  engine on the random tiny model would score every group 0 (no ``\\boxed``), so the filter
  would keep nothing; the test needs a known number of kept groups at the episode's end.
- **the weight sync to the engine** (``PPOTrainer.broadcast_to_vllm`` a no-op on the trainer
  instance): the scripted engine has no weights, and OpenRLHF's sync group is PyNccl-only.
- CUDA entry points (``cpu_cuda``) and the flash-attn import (``standins/``), as in the tier.

Shown: without the plugin the episode's partial batch is split 8/4 samples over the two ranks
(4 and 2 micro-batches) and the run hangs (bounded: a rank stuck in a ``ppo_train`` the other
has left, nothing trained for 60 s); with it, the partial batches are dropped, both ranks train 4
micro-batches in every step of two episodes and the run ends; a fresh run resuming the step-1
checkpoint (as a job requeued after a kill during step 2) draws the remaining prompts in the
same order, trains the same samples in every step and shuffles each rank's buffer into the same
micro-batch order as the uninterrupted run.
"""

from __future__ import annotations

import pytest
from int_ahead import Job

pytestmark = pytest.mark.integration

GROUP = 4  # samples per prompt; one rollout micro-batch per group (as the paper's 8 x 8)
MICRO = 2  # --train.micro_batch_size
FULL_STEP = 4 * GROUP  # 4 prompts x 4 samples
TAIL_GROUPS = 3  # kept groups left when the prompts run out (11 kept = 2 x 4 + 3)


#: The module's scenarios, started ahead (conftest ``Ahead``): the upstream one first, whose run
#: ends in a bounded 60 s hang.
AHEAD = {"upstream": Job("upstream", "scenario", "episode_end_upstream", timeout_s=600, expected_s=240),
         "plugin_runs": Job("plugin_runs", "scenario", "episode_end_resume", timeout_s=1500, expected_s=200)}


@pytest.fixture(scope="module")
def upstream(request, scenarios_ahead, integration_ready):
    return scenarios_ahead.result(request, "upstream")["upstream"]


@pytest.fixture(scope="module")
def plugin_runs(request, scenarios_ahead, integration_ready):
    return scenarios_ahead.result(request, "plugin_runs")


def _fits(run) -> dict:
    """``{(rank, fit): {"buffer", "planned", "micro": [ids per micro-batch], "ended"}}``."""
    fits: dict = {}
    for r in run["records"]:
        key = (r["rank"], r["fit"])
        if r["event"] == "fit_start":
            fits[key] = {"buffer": r["buffer"], "planned": r["planned"], "micro": [], "ended": False}
        elif r["event"] == "micro":
            assert r["step"] == len(fits[key]["micro"])
            fits[key]["micro"].append(r["ids"])
        else:
            fits[key]["ended"] = True
    return fits


def _uneven_split(groups: int, ranks: int = 2) -> list[int]:
    """Samples per rank as ``RayActorGroup.async_run_method_batch`` deals out ``groups`` rollout
    micro-batches of one group: chunks of ``ceil(groups / ranks)``."""
    chunk = -(-groups // ranks)
    return [GROUP * max(0, min(chunk, groups - r * chunk)) for r in range(ranks)]


def test_upstream_splits_the_episodes_partial_batch_unevenly_and_hangs(upstream):
    """The defect, with OpenRLHF 0.11.2 alone: the last rollout batch of the episode (3 groups
    kept when the prompts ran out) reaches rank 0 with 8 samples and rank 1 with 4; rank 1 trains
    its 2 micro-batches and leaves ``ppo_train``, rank 0 trains 2 of its 4 and waits in the next
    collective (the step's loss normaliser) for a rank that never comes."""
    assert upstream["outcome"] == "hung", upstream.get("error", {}).get("text", upstream["outcome"])
    fits = _fits(upstream)
    assert sorted(fits) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    for rank in (0, 1):
        for fit in (1, 2):  # the full steps: 16 samples, 8 a rank, 4 micro-batches each
            f = fits[rank, fit]
            assert len(f["buffer"]) == FULL_STEP // 2 and f["planned"] == len(f["micro"]) == 4 and f["ended"]
    tail = [fits[0, 3], fits[1, 3]]
    assert [len(f["buffer"]) for f in tail] == _uneven_split(TAIL_GROUPS) == [8, 4]
    assert [f["planned"] for f in tail] == [8 // MICRO, 4 // MICRO] == [4, 2]
    assert [len(f["micro"]) for f in tail] == [2, 2]  # rank 0 stopped after rank 1's last micro-batch
    assert [f["ended"] for f in tail] == [False, True]
    assert upstream["open"] == [[0, 3]] and upstream["stalled_s"] >= 60


def test_with_the_plugin_every_step_is_full_on_both_ranks_across_two_episode_ends(plugin_runs):
    """The fix: each episode's partial batch (3 groups, 12 samples) is dropped in the trainer's
    ``SamplesGenerator.generate_samples``; every step trains 16 samples, 8 on each rank in 4
    micro-batches (2 optimizer steps), and the run ends after 2 steps per episode."""
    full = plugin_runs["full"]
    assert full["outcome"] == "finished", full.get("error", {}).get("text", full["outcome"])
    fits = _fits(full)
    assert sorted(fits) == [(r, f) for r in (0, 1) for f in (1, 2, 3, 4)]
    for f in fits.values():
        assert len(f["buffer"]) == FULL_STEP // 2 and f["planned"] == len(f["micro"]) == 4 and f["ended"]
        assert all(len(m) == MICRO for m in f["micro"])
        assert sorted(i for m in f["micro"] for i in m) == sorted(f["buffer"])
    assert full["dropped"] == [{"samples": TAIL_GROUPS * GROUP, "full": FULL_STEP, "steps_done": s} for s in (2, 4)]
    for fit in (1, 2, 3, 4):  # the two ranks train different samples of the same step
        assert not set(fits[0, fit]["buffer"]) & set(fits[1, fit]["buffer"])
    episode = [set(fits[r, f]["buffer"]) for r in (0, 1) for f in (1, 2)]
    assert len(set().union(*episode)) == 2 * FULL_STEP  # 8 distinct groups per episode trained


def _order(fit) -> list[int]:
    """Positions in the replay buffer of the samples in micro-batch order (the shuffle)."""
    return [fit["buffer"].index(i) for m in fit["micro"] for i in m]


def _step_samples(fits, fit) -> set:
    return set(fits[0, fit]["buffer"]) | set(fits[1, fit]["buffer"])


def test_a_requeued_run_trains_the_remaining_steps_in_the_uninterrupted_order(plugin_runs):
    """Issue 20, item 2: a fresh run resuming from the step-1 checkpoint (``--ckpt.load_enable``;
    the directory as a kill during step 2 leaves it) draws the remaining prompts in the
    uninterrupted run's order (OpenRLHF's prompt-loader state), trains the same samples in each
    step, and every rank shuffles each step's replay buffer into micro-batches exactly as the
    uninterrupted run did (the plugin's checkpointed RNG stream). Which rank a kept group reaches
    follows the order finished requests are collected in (``ray.wait``), not an RNG: the order
    is compared as the permutation of each rank's buffer."""
    for name in ("full", "resumed"):
        assert plugin_runs[name]["outcome"] == "finished", (name, plugin_runs[name].get("error", {}).get("text"))
    full, resumed = _fits(plugin_runs["full"]), _fits(plugin_runs["resumed"])
    assert sorted(resumed) == [(r, f) for r in (0, 1) for f in (1, 2, 3)]
    asked, asked_again = plugin_runs["full"]["requests"], plugin_runs["resumed"]["requests"]
    step1 = len(asked) - len(asked_again)  # 4 prompts and one refill per filtered group
    assert 4 <= step1 <= 6 and asked_again == asked[step1:]
    for fit in (1, 2, 3):
        assert _step_samples(resumed, fit) == _step_samples(full, fit + 1)  # the same samples each step
        for rank in (0, 1):
            got, want = resumed[rank, fit], full[rank, fit + 1]
            assert _order(got) == _order(want)  # the same shuffle of the rank's buffer into micro-batches
            if got["buffer"] == want["buffer"]:
                assert got["micro"] == want["micro"]
    # Not vacuous: the shuffle is on, differs from step to step, and the order of step 2 is not
    # the one a freshly seeded process draws (that of step 1): a resumed rank without its stream
    # would train step 2 so.
    orders = [_order(full[0, f]) for f in (1, 2, 3, 4)]
    assert orders[0] != sorted(orders[0]) and len({tuple(o) for o in orders}) == 4
    assert _order(resumed[0, 1]) != orders[0] and _order(resumed[1, 1]) != _order(full[1, 1])
    assert plugin_runs["resumed"]["dropped"] == [{"samples": TAIL_GROUPS * GROUP, "full": FULL_STEP, "steps_done": s}
                                                 for s in (2, 4)]
