"""The binding in the PPO trainer actor: stop after exactly the cell's steps.

OpenRLHF 0.11.2 has no step limit; ``PPOTrainer`` (by value in its Ray worker) reaches its base
class ``BasePPOTrainer`` and ``SamplesGenerator`` by reference."""

from __future__ import annotations

from fp8rl.backends.openrlhf.plugin.binding.common import _check_params, _originals
from fp8rl.backends.openrlhf.plugin.spec import PluginSpec, check_version

_STEPS_DONE = {"n": 0}


def bind_ppo_trainer(ppo_trainer, spec: PluginSpec) -> None:
    """``BasePPOTrainer`` (by reference from the by-value ``PPOTrainer``): count the steps done."""
    check_version()
    cls = ppo_trainer.BasePPOTrainer
    orig = _originals(cls, ("init_checkpoint_states", "train_step"))
    _check_params(orig["init_checkpoint_states"], ("self",), "BasePPOTrainer.init_checkpoint_states")
    _check_params(orig["train_step"], ("self", "rollout_samples", "global_step"), "BasePPOTrainer.train_step")

    def init_checkpoint_states(self):
        states = orig["init_checkpoint_states"](self)
        _STEPS_DONE["n"] = int(states.get("global_step", 0) or 0)
        return states

    def train_step(self, rollout_samples, global_step):
        status, step = orig["train_step"](self, rollout_samples, global_step)
        _STEPS_DONE["n"] = int(step)
        return status, step

    cls.init_checkpoint_states, cls.train_step = init_checkpoint_states, train_step


def bind_samples_generator(samples_generator, spec: PluginSpec) -> None:
    """``SamplesGenerator.generate_samples`` reports the prompts exhausted once ``max_steps`` are done.

    ``PPOTrainer.fit`` then leaves every remaining episode at once, closes its loggers and the
    driver saves the final model, as at the natural end of the data.
    """
    check_version()
    cls = samples_generator.SamplesGenerator
    orig = _originals(cls, ("generate_samples",))["generate_samples"]
    _check_params(orig, ("self",), "SamplesGenerator.generate_samples")

    def generate_samples(self, **generate_kwargs):
        if spec.max_steps is not None and _STEPS_DONE["n"] >= spec.max_steps:
            return [], None, 0, True
        return orig(self, **generate_kwargs)

    cls.generate_samples = generate_samples
