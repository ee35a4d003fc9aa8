"""The binding in the PPO trainer actor: stop after exactly the cell's steps; train whole steps only.

OpenRLHF 0.11.2 has no step limit; ``PPOTrainer`` (by value in its Ray worker) reaches its base
class ``BasePPOTrainer`` and ``SamplesGenerator`` by reference.

**The last partial rollout batch of an episode is dropped** (``generate_samples``). When the
prompts run out mid-batch (with DAPO's dynamic filtering at every episode end: dropped groups are
refilled until the prompt loader is empty), ``SamplesGenerator.generate_samples`` returns the
groups kept so far, fewer than ``rollout.batch_size x n_samples_per_prompt`` samples.
``RemoteExperienceMaker.split_rollout_samples`` cuts them into rollout micro-batches and
``RayActorGroup.async_run_method_batch`` deals those out in chunks of ``ceil(len / DP ranks)``,
so the ranks' replay buffers differ in size (with fewer chunks than ranks it raises), each rank's
``ppo_train`` runs ``len(buffer) // micro_train_batch_size`` micro-batches, and the rank with
more waits in a collective (the step's loss normaliser, ZeRO-3's gathers) that the other never
enters: the job hangs until the process-group timeout (60 minutes). Dropping the remainder keeps
every step a full step of ``prompts_per_step`` prompts, the unit ``config.data_plan`` counts
(``size // (prompts_per_step x rounds)`` whole steps per episode), and equal on every rank;
carrying it into the next episode would need the sample buffer checkpointed (OpenRLHF saves only
the prompt loader's state) and would train the groups one policy update late.
"""

from __future__ import annotations

import logging

from fp8rl.backends.openrlhf.plugin.binding.common import _check_params, _originals
from fp8rl.backends.openrlhf.plugin.binding.rollout import (
    STEP_FILTERING,
    _record,
    bind_seeded_rollout,
)
from fp8rl.backends.openrlhf.plugin.spec import PluginSpec, check_version
from fp8rl.runs import metrics as M

log = logging.getLogger(__name__)
_STEPS_DONE = {"n": 0}
#: The episode tails dropped in this process: ``{"samples", "full", "steps_done"}`` each.
DROPPED_TAILS: list[dict] = []


def bind_ppo_trainer(ppo_trainer, spec: PluginSpec) -> None:
    """``BasePPOTrainer`` (by reference from the by-value ``PPOTrainer``): count the steps done; log
    dynamic filtering's counts per step (``dapo/filtered_groups``, ``dapo/replacements``: the
    seeded rollout counts them, so with ``PluginSpec.seed`` only, as every fp8rl cell has)."""
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
        if spec.dump_dir:
            _dump_experiences_of(self.experience_maker, spec.dump_dir)
        status, step = orig["train_step"](self, rollout_samples, global_step)
        _STEPS_DONE["n"] = int(step)
        if self.args.algo.dynamic_filtering_enable:  # what filtering did to draw this step's batch
            status[M.DAPO_FILTERED_GROUPS] = STEP_FILTERING["filtered"]
            status[M.DAPO_REPLACEMENTS] = STEP_FILTERING["replacements"]
        STEP_FILTERING.update(filtered=0, replacements=0)
        return status, step

    cls.init_checkpoint_states, cls.train_step = init_checkpoint_states, train_step


def _dump_experiences_of(maker, directory: str) -> None:
    """Wrap ``maker.make_experience_batch`` (this instance, once) to dump what it returns.

    File ``<directory>/experiences-step<NNN>-<pid>.pt`` per step (``NNN``: steps done before it):
    per experience (a rollout micro-batch) the token ids, action mask, the rewards after DAPO's
    length penalty (what the advantages were computed from), the 0/1 scores, response lengths,
    truncation flags, the per-token advantages, the samples' indices in the batch (their group is
    ``index // n_samples_per_prompt``), prompts and labels. The smoke job's tests regrade the
    samples, recompute the penalty and the group-normalised advantages from these files."""
    if getattr(maker, "_fp8rl_dumping", False):
        return
    make = maker.make_experience_batch

    def make_experience_batch(rollout_samples):
        experiences = make(rollout_samples)
        _dump_experiences(directory, _STEPS_DONE["n"], experiences)
        return experiences

    maker.make_experience_batch, maker._fp8rl_dumping = make_experience_batch, True


def _dump_experiences(directory: str, steps_done: int, experiences) -> None:
    import os
    import time

    import torch

    def cpu(t):
        return t.detach().to("cpu").clone() if isinstance(t, torch.Tensor) else t

    recs = [{"sequences": cpu(e.sequences), "action_mask": cpu(e.action_mask), "rewards": cpu(e.rewards),
             "scores": cpu(e.scores), "response_length": cpu(e.response_length), "truncated": cpu(e.truncated),
             "advantages": cpu(e.advantages), "index": list(e.index or []), "prompts": list(e.prompts),
             "labels": list(e.labels)} for e in experiences]
    os.makedirs(directory, exist_ok=True)
    torch.save({"steps_done": int(steps_done), "pid": os.getpid(), "time": time.time(), "experiences": recs},
               os.path.join(directory, f"experiences-step{int(steps_done):03d}-{os.getpid()}.pt"))


def full_step_samples(args) -> int:
    """Samples of one full step: ``rollout.batch_size`` prompt groups of ``n_samples_per_prompt``."""
    return int(args.rollout.batch_size) * int(args.rollout.n_samples_per_prompt)


def whole_steps_only(args, generated: tuple) -> tuple:
    """``generate_samples``'s 4-tuple with a short batch at the end of the prompts dropped.

    ``(samples, pass_rate, prompts_consumed, exhausted)``: a batch shorter than a full step comes
    back as ``([], pass_rate, prompts_consumed, True)``, so ``PPOTrainer.fit`` ends the episode
    without a step (its prompt count still advances). A short batch before the prompts are
    exhausted comes only from ``--rollout.vllm_generate_batch_size`` below the rollout batch,
    which fp8rl's command never sets; it raises instead of training unevenly split steps.
    """
    samples, pass_rate, consumed, exhausted = generated
    full = full_step_samples(args)
    if not samples or len(samples) >= full:
        return generated
    if not exhausted:
        raise RuntimeError(
            f"SamplesGenerator returned {len(samples)} samples, fewer than one step's {full}, before the "
            "prompts ran out (--rollout.vllm_generate_batch_size below --rollout.batch_size?); fp8rl trains "
            "whole steps only: an uneven batch leaves the DP ranks with different numbers of micro-batches")
    n = max(1, int(args.rollout.n_samples_per_prompt))
    log.warning("fp8rl: the prompts ran out mid-batch: dropping the episode's last partial rollout batch "
                "(%d of %d prompt groups, %d samples); every step trains a full batch",
                len(samples) // n, int(args.rollout.batch_size), len(samples))
    DROPPED_TAILS.append({"samples": len(samples), "full": full, "steps_done": _STEPS_DONE["n"]})
    return [], pass_rate, consumed, True


def bind_samples_generator(samples_generator, spec: PluginSpec) -> None:
    """``SamplesGenerator.generate_samples``: whole steps only, and the prompts "exhausted" once
    ``max_steps`` are done; seeded rollouts in dispatch order (``rollout``) when the spec has a seed.

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
        generated = orig(self, **generate_kwargs)
        out = whole_steps_only(self.args, generated)
        _record(spec, {"batch": True, "steps_done": _STEPS_DONE["n"], "samples": len(generated[0]),
                       "full": full_step_samples(self.args), "trained": len(out[0]), "consumed": int(generated[2]),
                       "exhausted": bool(out[3])})
        return out

    cls.generate_samples = generate_samples
    bind_seeded_rollout(samples_generator, spec, steps_done=lambda: _STEPS_DONE["n"])
