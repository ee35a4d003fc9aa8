"""Unit level (imports stubbed): whole steps only at an episode's end; the ``ppo_train`` RNG stream.

The logic of the two binding changes of issue 20. The real systems (OpenRLHF 0.11.2's
``PPOTrainer``, two ``PolicyModelActor`` ranks under DeepSpeed ZeRO-3, real Ray, the checkpoint
through DeepSpeed and back) are ``tests/integration/test_int_episode_end.py``'s.
"""

import json
import types

import pytest
import torch
from test_orl_plugin_bind import _Strategy, _trainer, load_ppo_actor

from fp8rl.backends.openrlhf import plugin
from fp8rl.backends.openrlhf.plugin import PluginSpec
from fp8rl.backends.openrlhf.plugin.binding import actor as actor_binding
from fp8rl.backends.openrlhf.plugin.binding import trainer as trainer_binding
from fp8rl.backends.openrlhf.plugin.binding.rollout import DRAWS_FILE

ns = types.SimpleNamespace


def _args(prompts=4, n=4):
    return ns(rollout=ns(batch_size=prompts, n_samples_per_prompt=n))


def test_a_full_batch_passes_and_the_short_tail_of_the_prompts_is_dropped(monkeypatch):
    monkeypatch.setattr(trainer_binding, "DROPPED_TAILS", [])
    full = (list(range(16)), 80.0, 5, False)
    assert trainer_binding.whole_steps_only(_args(), full) is full
    last_full = (list(range(16)), 80.0, 5, True)  # the prompts ran out exactly at a step
    assert trainer_binding.whole_steps_only(_args(), last_full) is last_full
    assert trainer_binding.whole_steps_only(_args(), ([], None, 0, True)) == ([], None, 0, True)
    tail = (list(range(12)), 75.0, 4, True)  # 3 of 4 groups kept when the prompts ran out
    assert trainer_binding.whole_steps_only(_args(), tail) == ([], 75.0, 4, True)
    assert trainer_binding.DROPPED_TAILS == [{"samples": 12, "full": 16, "steps_done": trainer_binding._STEPS_DONE["n"]}]


def test_a_short_batch_before_the_prompts_run_out_fails_loudly():
    with pytest.raises(RuntimeError, match="vllm_generate_batch_size"):
        trainer_binding.whole_steps_only(_args(), (list(range(12)), None, 3, False))


def test_bound_generate_samples_drops_the_tail_and_keeps_the_step_limit(monkeypatch, tmp_path):
    monkeypatch.setattr(trainer_binding, "DROPPED_TAILS", [])
    monkeypatch.setitem(trainer_binding._STEPS_DONE, "n", 0)
    batches = iter([(list(range(16)), None, 4, False), (list(range(8)), None, 6, True)])

    class SamplesGenerator:  # upstream's shape: (samples, pass rate, prompts consumed, exhausted)
        args = _args()

        def generate_samples(self, **generate_kwargs):
            return next(batches)

    module = ns(SamplesGenerator=SamplesGenerator)
    trainer_binding.bind_samples_generator(module, PluginSpec(max_steps=2, dump_dir=str(tmp_path)))
    gen = SamplesGenerator()
    assert len(gen.generate_samples()[0]) == 16
    assert gen.generate_samples() == ([], None, 6, True)  # PPOTrainer.fit ends the episode, no step
    monkeypatch.setitem(trainer_binding._STEPS_DONE, "n", 2)
    assert gen.generate_samples() == ([], None, 0, True)  # the step limit, before generating
    # each batch handed to training, in the dump the smoke job's tests read (the limit's is no batch)
    recs = [json.loads(ln) for ln in (tmp_path / DRAWS_FILE).read_text().splitlines()]
    assert [(r["samples"], r["full"], r["trained"], r["exhausted"]) for r in recs] == [(16, 16, 16, False),
                                                                                        (8, 16, 0, True)]


def _stream_trainers(monkeypatch):
    """``make(strategy=None)``: trainers whose upstream ``ppo_train`` (stood in) draws as its
    DataLoader shuffle does, appending each step's permutation to ``trainer.drawn``."""
    ppo_actor, _ = load_ppo_actor(monkeypatch)

    def fake_ppo_train(self, kl_ctl):
        self.drawn.append(torch.randperm(8).tolist())
        return {"policy_loss": 0.0}

    monkeypatch.setattr(ppo_actor.ActorPPOTrainer, "ppo_train", fake_ppo_train)
    plugin.install(PluginSpec(eps_low=0.2, eps_high=0.28), modules={"ppo_actor": ppo_actor})

    def make(strategy=None):
        trainer = _trainer(ppo_actor, strategy)
        trainer.drawn = []
        return trainer

    return make


def _run(trainer, steps: int, seed: int = 0) -> list:
    torch.manual_seed(seed)  # the process's global generator, as setup_distributed seeds it
    for _ in range(steps):
        trainer.ppo_train(0.0)
    return trainer.drawn


def test_ppo_train_shuffles_from_a_stream_that_resumes_where_the_checkpoint_left_it(monkeypatch):
    make = _stream_trainers(monkeypatch)
    drawn = _run(make(), 3)
    torch.manual_seed(0)
    assert drawn[0] == torch.randperm(8).tolist()  # a fresh run's first step shuffles as upstream
    assert drawn[0] != drawn[1] != drawn[2]
    stopped = make()  # a run stopped after step 1: its checkpoint holds the stream
    assert _run(stopped, 1) == drawn[:1]
    saved = actor_binding.gather_rng_streams(stopped)  # one process, no process group: its own only
    strategy = _Strategy()
    strategy._fp8rl_checkpoint = {"path": "ckpt/global_step1", "state": None, "rng": saved}
    resumed = make(strategy)  # the requeued process, re-seeded
    assert _run(resumed, 2) == drawn[1:]
    after = torch.get_rng_state()
    torch.manual_seed(0)
    assert torch.equal(after, torch.get_rng_state())  # ppo_train leaves the global generator as it found it


def test_a_checkpoint_without_streams_or_from_another_world_size_resumes_from_the_global_state(caplog):
    torch.manual_seed(1)
    here = torch.get_rng_state()
    for rng, why in ((None, "has no 'fp8rl_rng'"), ({"ranks": [here, here]}, "holds the RNG streams of 2 ranks")):
        strategy = ns(_fp8rl_checkpoint={"path": "ckpt/global_step3", "state": None, "rng": rng})
        assert torch.equal(actor_binding.resumed_rng_stream(strategy), here)
        assert why in caplog.text
    assert torch.equal(actor_binding.resumed_rng_stream(ns()), here)  # no checkpoint loaded
