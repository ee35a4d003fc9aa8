"""The binding: the one place of the project that touches OpenRLHF 0.11.2 internals.

A package by concern: ``actor`` (the PPO actors: strategy, loss, ``ActorPPOTrainer``),
``trainer`` (the PPO trainer actor: the step limit), ``driver`` (engine kwargs, the attestation
before training), ``vllm_worker`` (the weight-sync extension of the vLLM workers), ``agent`` (the
vLLM engine actors' response: Score Centering's top-k); this module
holds the entry points and the checks shared by them.

Every upstream object the plugin changes, where it is reached, and why that place:

=============================================  ======================  ===========================================
upstream object (0.11.2)                       process                 what the plugin does there
=============================================  ======================  ===========================================
``openrlhf.trainer.ray.ppo_actor.PolicyLoss``  PPO actors              rebound to ``loss.make_policy_loss_class``'s
(module attribute)                                                     subclass; ``ActorPPOTrainer.__init__`` reads
                                                                       it from this module's dict at call time
``ActorPPOTrainer.__init__``                   PPO actors              after upstream: FP8 guard, controller state
                                                                       restored from the loaded checkpoint
``ActorPPOTrainer.ppo_train``                  PPO actors              controller step, BF16 shadow of the old
                                                                       policy, step metrics from global counts;
                                                                       runs on the rank's own RNG stream (the
                                                                       replay-buffer shuffle resumes exactly)
``ActorPPOTrainer.training_step``              PPO actors              BF16 shadow of the current policy on every
                                                                       micro-batch of a measured step (periodic,
                                                                       pooled); Score Centering: the micro-batch's
                                                                       top-k to the loss, log p at its ids from a
                                                                       forward hook on the actor (its one forward)
``ppo_actor.iter_grad_accum_global_norm``      PPO actors              ``same_batch``: before each optimizer-step
(module attribute)                                                     window, the no-grad pre-pass and the window's
                                                                       bounds; ``ppo_train`` reads the name from
                                                                       this module's dict at call time
``DeepspeedStrategy._ds_init_train_model``     PPO actors              the policy's Linears -> FP8 right before
                                                                       ``deepspeed.initialize`` (+ FP8 guard)
``DeepspeedStrategy.save_ckpt`` / ``load_ckpt`` PPO actors             controller state + step, every rank's
                                                                       RNG stream in DeepSpeed's client state,
                                                                       and back
``DeepspeedStrategy.get_ds_train_config``      PPO actors (CPU job)    DeepSpeed's ``torch_adam`` option: the
                                                                       CPU FusedAdam does not resume exactly
                                                                       (``cpu_support``)
``BasePPOTrainer.init_checkpoint_states`` /    PPO trainer actor       count the steps done (from the checkpoint on
``train_step``                                                         resume, then per step)
``SamplesGenerator.generate_samples``          PPO trainer actor       reports the prompts exhausted once the cell's
                                                                       ``steps`` are done (OpenRLHF has no step limit);
                                                                       drops the partial batch at an episode's end
                                                                       (unevenly split over the DP ranks, it hangs)
``SamplesGenerator.__init__`` /                PPO trainer actor       seeded rollouts (``rollout``): the prompt
``_generate_vllm`` / ``generate_eval_samples``                         sampler's seed, one seeded request per
                                                                       sample, groups in dispatch order
``vllm_engine.RolloutRayActor`` (attribute)    driver                  engine kwargs: vLLM online FP8 quantization,
                                                                       our worker extension; Score Centering
                                                                       cells: ``processed_logprobs``, k logprobs
``SingleTurnAgentExecutor.execute``            vLLM engine actors      Score Centering cells: the sampler's top-k
                                                                       ids and log-probs added to the response
                                                                       (``agent``; ``plugin.score_centering``)
``RayActorGroup.async_init_model_from_pretrained``  driver             waits for the policy actors, then asks each
                                                                       one (``attest``) whether the plugin is bound
                                                                       and FP8 is in place; raises before training
``vllm_worker_wrap.WorkerWrap`` (subclassed)   vLLM workers            ``Fp8WorkerWrap``: weight sync through
                                                                       vLLM's layer-wise reload (``vllm_sync``)
=============================================  ======================  ===========================================

Why these and not ``PolicyModelActor``'s methods or ``ppo_actor.Actor``: Ray ships
``@ray.remote`` classes by value; cloudpickle gives each method of ``PolicyModelActor`` a globals
dict of its own, so rebinding a module attribute in the worker, or replacing methods of the
remote class, never reaches ``init_model_from_pretrained`` or ``save_checkpoint`` (measured with
real Ray 2.55 workers; ``tests/integration``). What those methods reach is resolved by
reference: the classes ``ActorPPOTrainer`` and ``DeepspeedStrategy`` (the strategy object is
shipped from the driver, its class by reference) and ``ppo_actor``'s module dict read by
``ActorPPOTrainer.__init__``; likewise the by-value ``PPOTrainer`` reaches ``BasePPOTrainer``
(its base class) and ``SamplesGenerator`` by reference. The worker setup hook (``hook``) binds
lazily: only processes that import one of ``hook.TARGETS`` are touched.

Every wrapped signature is checked against what this module was written for when it binds
(:class:`UpstreamChangedError` names what moved); ``check_version`` refuses any other OpenRLHF.
A binding never applies twice: rebinding with another spec (tests) starts from the originals.

Calibration plan (``calibrate``; the modes of ``fp8rl.rl.calibration``): the controller step
is the number of ``ppo_train`` calls so far (saved with checkpoints); at its start the clip
method's ``begin_step`` says which replay-buffer samples get a BF16 shadow and which feed the
estimate (every sample of a calibration step, or ``sampled``'s seeded subset); their BF16 old
log-probs are computed under ``fp8_disabled`` before the first update. Each optimizer-step window
is then run in the order and with the calibration point the plan asks for (``same_batch``: an
FP8 pre-pass and the calibration before its first micro-batch; ``sampled``: the subset's
micro-batches first, the calibration after them; ``periodic`` / ``pooled``: the window's tokens
collected, one pooled update after the step); ``calibrate``'s docstring gives the choices, their
cost and their deviations.

Whole steps only (``trainer``): the last rollout batch of an episode, short when the prompts run
out mid-batch (DAPO's dynamic filtering at every episode end), is dropped rather than trained:
``RayActorGroup.async_run_method_batch`` deals its rollout micro-batches out in chunks of
``ceil(n / ranks)``, so the DP ranks would run different numbers of micro-batches and hang in a
collective; the data plan counts whole steps. Exact resumes (``actor``): ``ppo_train``'s shuffle
draws from the rank's torch CPU generator, which OpenRLHF does not checkpoint; the plugin gives
``ppo_train`` a stream of its own and checkpoints every rank's.
"""

from __future__ import annotations

import importlib
import os

from fp8rl.backends.openrlhf.plugin.binding.common import (
    SHADOW_OLD_KEY,
    PluginNotActiveError,
    ResumeError,
    UpstreamChangedError,
)
from fp8rl.backends.openrlhf.plugin.fp8_training import Fp8ConversionError
from fp8rl.backends.openrlhf.plugin.spec import TARGETS, PluginSpec

#: The OpenRLHF module -> ``(submodule, binder)`` that binds into it when it is imported.
BINDERS = {
    "openrlhf.utils.deepspeed.deepspeed": ("actor", "bind_strategy"),
    "openrlhf.trainer.ray.ppo_actor": ("actor", "bind_ppo_actor"),
    "openrlhf.trainer.ppo_trainer": ("trainer", "bind_ppo_trainer"),
    "openrlhf.trainer.ppo_utils.samples_generator": ("trainer", "bind_samples_generator"),
    "openrlhf.utils.agent": ("agent", "bind_agent"),
}


def bind_module(name: str, module, spec_json: str) -> None:
    """Bind the plugin into OpenRLHF module ``name`` (called by the import hook and by :func:`install`)."""
    spec = PluginSpec.from_json(spec_json)
    if name not in BINDERS:
        raise ValueError(f"fp8rl binds into {sorted(BINDERS)}, not {name!r}")
    sub, binder = BINDERS[name]
    getattr(importlib.import_module(f"{__name__}.{sub}"), binder)(module, spec)
    module._fp8rl_spec_json = spec_json
    module._fp8rl_bound_at = {"pid": os.getpid(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def install(spec: PluginSpec, modules: dict | None = None) -> None:
    """Bind now into the given modules (``{"deepspeed": ..., "ppo_actor": ...}``), else import all targets."""
    modules = modules or {n: importlib.import_module(n) for n in TARGETS}
    short = {"deepspeed": TARGETS[0], "ppo_actor": TARGETS[1], "ppo_trainer": TARGETS[2],
             "samples_generator": TARGETS[3], "agent": TARGETS[4]}
    for key, module in modules.items():
        bind_module(short.get(key, key), module, spec.to_json())


def __getattr__(name: str):
    """``Fp8WorkerWrap`` (vLLM resolves ``worker_extension_cls`` by this name) and the driver's
    entry points, imported on first use (``vllm_worker`` needs vLLM, only where engines run)."""
    if name == "Fp8WorkerWrap":
        from fp8rl.backends.openrlhf.plugin.binding.vllm_worker import fp8_worker_wrap

        return fp8_worker_wrap()
    lazy = {"attest": "driver", "check_attestations": "driver", "install_driver": "driver",
            "controller_state": "actor"}
    if name in lazy:
        return getattr(importlib.import_module(f"{__name__}.{lazy[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SHADOW_OLD_KEY", "Fp8ConversionError", "PluginNotActiveError", "ResumeError", "UpstreamChangedError",
           "attest", "bind_module", "check_attestations", "controller_state", "install", "install_driver"]
