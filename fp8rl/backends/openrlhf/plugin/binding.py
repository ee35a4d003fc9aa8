"""The binding: the one module of the project that touches OpenRLHF 0.11.2 internals.

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
                                                                       policy, step metrics from global counts
``ActorPPOTrainer.training_step``              PPO actors              BF16 shadow of the current policy on the
                                                                       measured micro-batch (calibration steps)
``DeepspeedStrategy._ds_init_train_model``     PPO actors              the policy's Linears -> FP8 right before
                                                                       ``deepspeed.initialize`` (+ FP8 guard)
``DeepspeedStrategy.save_ckpt`` / ``load_ckpt`` PPO actors             controller state + step in DeepSpeed's
                                                                       client state, and back
``BasePPOTrainer.init_checkpoint_states`` /    PPO trainer actor       count the steps done (from the checkpoint on
``train_step``                                                         resume, then per step)
``SamplesGenerator.generate_samples``          PPO trainer actor       reports the prompts exhausted once the cell's
                                                                       ``steps`` are done (OpenRLHF has no step limit)
``vllm_engine.RolloutRayActor`` (attribute)    driver                  engine kwargs: vLLM online FP8 quantization,
                                                                       our worker extension
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

Calibration schedule (unchanged): the controller step is the number of ``ppo_train`` calls so
far (saved with checkpoints); on a calibration step the BF16 log-probs of every replay-buffer
sample are computed under ``fp8_disabled`` before the first update (stored in the sample's
``info`` under :data:`SHADOW_OLD_KEY`, popped before upstream sees it), and the measured
micro-batch is the first one of the *second* optimizer step (the first where the ratio carries
the noise an update exposes, as in the mini backend; with one optimizer step per rollout, the
first micro-batch). The loss calibrates there (``loss``), on the tokens of all DP ranks.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable

import torch

from fp8rl.backends.openrlhf.plugin.fp8_training import (
    Fp8ConversionError,
    convert_trainer_model,
    count_fp8_layers,
    require_conversion,
)
from fp8rl.backends.openrlhf.plugin.loss import make_policy_loss_class, varlen_all_gather
from fp8rl.backends.openrlhf.plugin.metrics import StepMetrics
from fp8rl.backends.openrlhf.plugin.spec import STATE_KEY, PluginSpec, check_version

log = logging.getLogger(__name__)

#: Key of the BF16 old log-probs in a replay-buffer sample's ``info`` (popped before upstream sees it).
SHADOW_OLD_KEY = "_fp8rl_shadow_old"
_ORIG = "_fp8rl_originals"
#: strategy -> weak reference to the ActorPPOTrainer built on it (whose controller ``save_ckpt`` saves)
_TRAINERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class UpstreamChangedError(RuntimeError):
    """An OpenRLHF object the plugin wraps no longer has the shape it was written for."""


class PluginNotActiveError(RuntimeError):
    """A policy actor runs without the plugin bound as the cell asks (found by the driver)."""


class ResumeError(RuntimeError):
    """A checkpoint cannot resume the clip controller exactly."""


# ------------------------------------------------------------------------------------------
# entry points
# ------------------------------------------------------------------------------------------


def bind_module(name: str, module, spec_json: str) -> None:
    """Bind the plugin into OpenRLHF module ``name`` (called by the import hook and by :func:`install`)."""
    spec = PluginSpec.from_json(spec_json)
    binders = {"openrlhf.utils.deepspeed.deepspeed": bind_strategy, "openrlhf.trainer.ray.ppo_actor": bind_ppo_actor,
               "openrlhf.trainer.ppo_trainer": bind_ppo_trainer,
               "openrlhf.trainer.ppo_utils.samples_generator": bind_samples_generator}
    if name not in binders:
        raise ValueError(f"fp8rl binds into {sorted(binders)}, not {name!r}")
    binders[name](module, spec)
    module._fp8rl_spec_json = spec_json
    module._fp8rl_bound_at = {"pid": os.getpid(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def install(spec: PluginSpec, modules: dict | None = None) -> None:
    """Bind now into the given modules (``{"deepspeed": ..., "ppo_actor": ...}``), else import both."""
    import importlib

    from fp8rl.backends.openrlhf.plugin.hook import TARGETS

    modules = modules or {n: importlib.import_module(n) for n in TARGETS}
    short = {"deepspeed": TARGETS[0], "ppo_actor": TARGETS[1], "ppo_trainer": TARGETS[2],
             "samples_generator": TARGETS[3]}
    for key, module in modules.items():
        bind_module(short.get(key, key), module, spec.to_json())


def _check_params(obj, expected: tuple[str, ...], what: str) -> None:
    params = tuple(inspect.signature(obj).parameters)[: len(expected)]
    if params != expected:
        raise UpstreamChangedError(
            f"OpenRLHF {what} has parameters {params}, fp8rl's binding was written for {expected}; "
            "the installed OpenRLHF is not the 0.11.2 the plugin binds into")


def _originals(cls, names: tuple[str, ...]) -> dict[str, Callable]:
    """The upstream functions of ``cls`` (saved on first binding, so rebinding never stacks)."""
    saved = cls.__dict__.get(_ORIG)
    if saved is None:
        saved = {n: cls.__dict__[n] for n in names}
        setattr(cls, _ORIG, saved)
    return saved


# ------------------------------------------------------------------------------------------
# DeepspeedStrategy: FP8 conversion before deepspeed.initialize; controller state in checkpoints
# ------------------------------------------------------------------------------------------


def bind_strategy(ds_module, spec: PluginSpec) -> None:
    check_version()
    cls, actor_cls = ds_module.DeepspeedStrategy, ds_module.Actor
    orig = _originals(cls, ("_ds_init_train_model", "save_ckpt", "load_ckpt"))
    _check_params(orig["_ds_init_train_model"], ("self", "model", "cfg"), "DeepspeedStrategy._ds_init_train_model")
    save_sig = inspect.signature(orig["save_ckpt"])
    _check_params(orig["save_ckpt"], ("self", "model", "save_dir", "tag", "max_num", "max_mem", "client_state"),
                  "DeepspeedStrategy.save_ckpt")
    _check_params(orig["load_ckpt"], ("self", "model", "load_dir"), "DeepspeedStrategy.load_ckpt")

    def _ds_init_train_model(self, model, cfg):
        if isinstance(model, actor_cls):  # the policy (a critic is no Actor); EMA/ref go to _ds_init_eval_model
            convert_trainer_model(model.model, spec)
            require_conversion(spec, count_fp8_layers(model.model), "DeepspeedStrategy._ds_init_train_model")
        return orig["_ds_init_train_model"](self, model, cfg)

    def save_ckpt(self, *args, **kwargs):
        bound = save_sig.bind(self, *args, **kwargs)
        ref = _TRAINERS.get(self)
        trainer = ref() if ref is not None else None
        if trainer is not None:
            state = dict(bound.arguments.get("client_state") or {})
            state[STATE_KEY] = controller_state(trainer)
            bound.arguments["client_state"] = state
        return orig["save_ckpt"](*bound.args, **bound.kwargs)

    def load_ckpt(self, model, load_dir, *args, **kwargs):
        load_path, states = orig["load_ckpt"](self, model, load_dir, *args, **kwargs)
        self._fp8rl_checkpoint = {"path": load_path, "state": (states or {}).get(STATE_KEY)}
        return load_path, states

    cls._ds_init_train_model, cls.save_ckpt, cls.load_ckpt = _ds_init_train_model, save_ckpt, load_ckpt


def controller_state(trainer) -> dict:
    """What a checkpoint keeps of the plugin: the clip controller's state and its step."""
    return {"clipper": trainer.actor_loss_fn.clipper.state_dict(), "step": int(trainer._fp8rl_step)}


# ------------------------------------------------------------------------------------------
# ppo_actor: our PolicyLoss; ActorPPOTrainer's constructor, ppo_train and training_step
# ------------------------------------------------------------------------------------------


def bind_ppo_actor(ppo_actor, spec: PluginSpec) -> None:
    check_version()
    upstream_loss = getattr(ppo_actor.PolicyLoss, "_fp8rl_upstream", ppo_actor.PolicyLoss)
    _check_params(upstream_loss.forward, ("self", "log_probs", "old_log_probs", "advantages", "action_mask",
                                          "rollout_log_probs", "dp_size", "batch_num_tokens", "global_batch_size"),
                  "PolicyLoss.forward")
    loss_cls = make_policy_loss_class(upstream_loss, spec)
    loss_cls._fp8rl_upstream = upstream_loss
    ppo_actor.PolicyLoss = loss_cls

    cls = ppo_actor.ActorPPOTrainer
    orig = _originals(cls, ("__init__", "ppo_train", "training_step"))
    _check_params(orig["__init__"], ("self", "strategy", "actor", "ema_model", "actor_optim", "actor_scheduler"),
                  "ActorPPOTrainer.__init__")
    _check_params(orig["ppo_train"], ("self", "kl_ctl"), "ActorPPOTrainer.ppo_train")
    _check_params(orig["training_step"], ("self", "experience", "kl_ctl", "step", "loss_batch_info"),
                  "ActorPPOTrainer.training_step")

    def __init__(self, strategy, actor, *args, **kwargs):
        orig["__init__"](self, strategy, actor, *args, **kwargs)
        _init_trainer(self, strategy, spec)

    def ppo_train(self, kl_ctl):
        return _ppo_train(self, kl_ctl, orig["ppo_train"])

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        return _training_step(self, experience, kl_ctl, step, loss_batch_info, orig["training_step"])

    cls.__init__, cls.ppo_train, cls.training_step = __init__, ppo_train, training_step


def _init_trainer(trainer, strategy, spec: PluginSpec) -> None:
    loss = trainer.actor_loss_fn
    if getattr(type(loss), "_fp8rl_upstream", None) is None:
        raise PluginNotActiveError("ActorPPOTrainer built an upstream PolicyLoss: ppo_actor.PolicyLoss is not ours")
    require_conversion(spec, count_fp8_layers(trainer.actor), "ActorPPOTrainer.__init__")
    trainer._fp8rl_step, trainer._fp8rl_micro, trainer._fp8rl_shadow = 0, 0, False
    ck = getattr(strategy, "_fp8rl_checkpoint", None)
    if ck is not None and ck["path"] is not None:
        if ck["state"] is not None:
            loss.clipper.load_state_dict(ck["state"]["clipper"])
            trainer._fp8rl_step = int(ck["state"]["step"])
        elif spec.clip_method != "vanilla":
            raise ResumeError(
                f"checkpoint {ck['path']} has no fp8rl controller state ({STATE_KEY!r} in the DeepSpeed "
                f"client state): it was written without the plugin, so the {spec.clip_method} bounds cannot "
                "resume; start the run afresh (remove the checkpoint directory)")
        else:
            log.warning("checkpoint %s has no fp8rl state; the vanilla clip method has none to restore", ck["path"])
    _TRAINERS[strategy] = weakref.ref(trainer)


def _dp_group(strategy):
    """``(group, active)``: OpenRLHF's DP process group (device mesh ``dp``) and whether it has >1 rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None, False
    mesh = getattr(strategy, "ds_device_mesh", None)
    group = mesh["dp"].get_group() if mesh is not None else None
    return group, dist.get_world_size(group) > 1


def _shadow_log_probs(trainer, experience) -> torch.Tensor:
    """BF16 log-probs ``[B, T]`` of ``experience`` under the current weights (``fp8_disabled``, no grad)."""
    from fp8rl.quant.convert import fp8_disabled

    with torch.no_grad(), fp8_disabled(trainer.actor.model):
        return trainer.actor(experience.sequences, experience.action_mask,
                             attention_mask=experience.attention_mask,
                             ring_attn_group=trainer.strategy.ring_attn_group)


def _ppo_train(self, kl_ctl, orig_ppo_train):
    import torch.distributed as dist

    loss = self.actor_loss_fn
    step = self._fp8rl_step
    group, active = _dp_group(self.strategy)
    loss.step = step
    loss.all_gather = (lambda t: varlen_all_gather(t, group)) if active else None
    metrics = StepMetrics()
    self._fp8rl_shadow = loss.clipper.needs_shadow(step)
    self._fp8rl_micro = 0
    items = self.replay_buffer.items
    if self._fp8rl_shadow:  # the old policy's BF16 shadow forward, in micro-batches
        t0 = time.perf_counter()
        size = max(1, int(self.micro_train_batch_size))
        for i in range(0, len(items), size):
            chunk = items[i:i + size]
            batch = self.replay_buffer.collate_fn(chunk)
            batch.to_device(torch.cuda.current_device())
            lp = _shadow_log_probs(self, batch).to("cpu")
            for j, item in enumerate(chunk):
                item.info[SHADOW_OLD_KEY] = lp[j, : item.action_mask.shape[0]]
        metrics.shadow_s += time.perf_counter() - t0
    loss.step_metrics = metrics
    self._fp8rl_metrics = metrics
    try:
        status = orig_ppo_train(self, kl_ctl)
    finally:
        loss.step_metrics = None
        for item in items:
            item.info.pop(SHADOW_OLD_KEY, None)

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    status = dict(status)
    status.update(metrics.finalize(reduce_sum if active else None, loss.all_gather))
    status.update(loss.clipper.metrics(step))
    self._fp8rl_step = step + 1
    return status


def _training_step(self, experience, kl_ctl, step, loss_batch_info, orig_training_step):
    loss = self.actor_loss_fn
    shadow_old = experience.info.pop(SHADOW_OLD_KEY, None)
    micro = self._fp8rl_micro
    self._fp8rl_micro += 1
    accum = max(1, int(getattr(self.strategy, "accumulated_gradient", 1)))
    n_micro = len(self.replay_buffer) // max(1, self.replay_buffer.sample_batch_size)
    measure = accum if n_micro > accum else 0  # first micro-batch of the 2nd optimizer step
    if loss.clipper.is_calibration_step(loss.step) and micro == measure:
        shadow_ratio = None
        if self._fp8rl_shadow and shadow_old is not None:
            from torch.nn.utils.rnn import pad_sequence

            t0 = time.perf_counter()
            old_bf16 = pad_sequence(list(shadow_old), batch_first=True).to(experience.action_mask.device)
            old_bf16 = old_bf16[:, : experience.action_mask.shape[1]]
            cur_bf16 = _shadow_log_probs(self, experience)
            shadow_ratio = torch.exp((cur_bf16 - old_bf16).clamp(-20, 20))
            self._fp8rl_metrics.shadow_s += time.perf_counter() - t0
        loss.pending_shadow = shadow_ratio if shadow_ratio is not None else torch.ones_like(
            experience.action_log_probs)
    return orig_training_step(self, experience, kl_ctl, step, loss_batch_info)


# ------------------------------------------------------------------------------------------
# the PPO trainer process: stop after exactly `max_steps` steps
# ------------------------------------------------------------------------------------------

#: Steps done in this process (the PPO trainer actor runs one training): from the checkpoint the
#: trainer resumes, then from every ``train_step``.
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


# ------------------------------------------------------------------------------------------
# the driver: FP8 engine kwargs; refuse to train unless every policy actor runs the plugin
# ------------------------------------------------------------------------------------------


def attest(actor) -> dict:
    """Run inside a ``PolicyModelActor`` (``handle.__ray_call__.remote(attest)``): what is bound there."""
    from fp8rl.backends.openrlhf.plugin.hook import TARGETS, installed_spec_json

    trainer = getattr(actor, "trainer", None)
    return {
        "pid": os.getpid(),
        "hook_spec": installed_spec_json(),
        "bound": {n: getattr(sys.modules.get(n), "_fp8rl_spec_json", None) for n in TARGETS[:2]},
        "loss": type(trainer.actor_loss_fn).__name__ if trainer is not None else None,
        "fp8_layers": count_fp8_layers(trainer.actor) if trainer is not None else None,
        "step": getattr(trainer, "_fp8rl_step", None),
    }


def check_attestations(spec: PluginSpec, reports: list[dict]) -> None:
    """Raise :class:`PluginNotActiveError` / ``Fp8ConversionError`` unless every actor runs ``spec``."""
    want = spec.to_json()
    for rank, r in enumerate(reports):
        where = f"policy actor rank {rank} (pid {r.get('pid')})"
        if r.get("hook_spec") is None:
            raise PluginNotActiveError(f"{where}: the fp8rl worker setup hook did not run (no import hook); "
                                       "was the driver's Ray runtime env replaced?")
        unbound = [n for n, s in r["bound"].items() if s != want]
        if unbound:
            raise PluginNotActiveError(f"{where}: the plugin is not bound into {unbound} with this cell's spec")
        if r.get("loss") != "Fp8rlPolicyLoss":
            raise PluginNotActiveError(f"{where}: the trainer uses {r.get('loss')}, not fp8rl's loss")
        require_conversion(spec, int(r["fp8_layers"]), where)


def install_driver(spec: PluginSpec, modules: dict | None = None) -> None:
    """Driver process: FP8 engines (``RolloutRayActor`` kwargs) and the pre-training attestation.

    ``modules``: ``{"vllm_engine", "launcher", "ppo_actor"}`` module objects (default: imported).
    """
    import importlib

    from fp8rl.backends.openrlhf.plugin.fp8_rollout import rollout_engine_kwargs

    check_version()
    names = {"vllm_engine": "openrlhf.trainer.ray.vllm_engine", "launcher": "openrlhf.trainer.ray.launcher",
             "ppo_actor": "openrlhf.trainer.ray.ppo_actor"}
    modules = dict(modules or {})
    for key, name in names.items():
        if key not in modules:
            modules[key] = importlib.import_module(name)
    extra = rollout_engine_kwargs(spec)
    vllm_engine = modules["vllm_engine"]
    actor = vllm_engine.RolloutRayActor
    if isinstance(actor, _InjectingActorClass):
        actor = actor._cls
    vllm_engine.RolloutRayActor = _InjectingActorClass(actor, extra) if extra else actor

    group_cls, policy_cls = modules["launcher"].RayActorGroup, modules["ppo_actor"].PolicyModelActor
    orig = _originals(group_cls, ("async_init_model_from_pretrained",))["async_init_model_from_pretrained"]

    def async_init_model_from_pretrained(self, *args, **kwargs):
        refs = orig(self, *args, **kwargs)
        if getattr(self, "ray_actor_type", None) is policy_cls:
            import ray

            ray.get(refs)
            reports = ray.get([h.__ray_call__.remote(attest) for h in self._actor_handlers])
            check_attestations(spec, reports)
        return refs

    group_cls.async_init_model_from_pretrained = async_init_model_from_pretrained


class _InjectingActorClass:
    """Stands in for ``RolloutRayActor`` in the driver: ``.options(...).remote(**kw)`` adds kwargs."""

    def __init__(self, actor_class, extra: dict) -> None:
        self._cls, self._extra = actor_class, dict(extra)

    def options(self, **opts):
        handle = self._cls.options(**opts)
        extra = self._extra

        class _Remote:
            @staticmethod
            def remote(*args, **kwargs):
                return handle.remote(*args, **{**kwargs, **extra})

        return _Remote()

    def __getattr__(self, name):
        return getattr(self._cls, name)


# ------------------------------------------------------------------------------------------
# vLLM workers: the weight-sync extension (built on first access: upstream's WorkerWrap module
# imports vLLM through its package, which only exists where the engines run)
# ------------------------------------------------------------------------------------------


def _make_fp8_worker_wrap() -> type:
    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

    _check_params(WorkerWrap.update_weight, ("self", "name", "dtype", "shape", "empty_cache"),
                  "WorkerWrap.update_weight")
    _check_params(WorkerWrap.update_weight_cuda_ipc, ("self", "name", "dtype", "shape", "ipc_handles",
                                                      "empty_cache"), "WorkerWrap.update_weight_cuda_ipc")

    class Fp8WorkerWrap(WorkerWrap):
        """Upstream's ``WorkerWrap`` whose weight sync goes through vLLM's layer-wise reload.

        Receives each BF16 tensor exactly as upstream does (broadcast or CUDA IPC) and hands it to
        ``vllm_sync.LayerwiseSync``; ``empty_cache=True`` marks the last tensor of a sync.
        """

        def _fp8rl_sync(self):
            sync = getattr(self, "_fp8rl_layerwise", None)
            if sync is None:
                from fp8rl.backends.openrlhf.plugin.spec import check_vllm_version
                from fp8rl.backends.openrlhf.plugin.vllm_sync import LayerwiseSync

                check_vllm_version()
                sync = self._fp8rl_layerwise = LayerwiseSync(self.model_runner.get_model, self.vllm_config)
            return sync

        def update_weight(self, name, dtype, shape, empty_cache=False):
            if dtype != self.model_config.dtype:
                raise ValueError(f"weight sync dtype {dtype} != the engine's {self.model_config.dtype}")
            weight = torch.empty(shape, dtype=dtype, device="cuda")
            if self._model_update_with_ray:
                import ray.util.collective as collective

                collective.broadcast(weight, 0, group_name=self._model_update_group)
            else:
                self._model_update_group.broadcast(weight, src=0, stream=torch.cuda.current_stream())
            self._fp8rl_sync().load(name, weight, last=bool(empty_cache))

        def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles=None, empty_cache=False):
            from openrlhf.trainer.ray.utils import get_physical_gpu_id

            if dtype != self.model_config.dtype:
                raise ValueError(f"weight sync dtype {dtype} != the engine's {self.model_config.dtype}")
            func, args = ipc_handles[get_physical_gpu_id()]
            list_args = list(args)
            list_args[6] = self.device.index
            # a copy: the layer-wise reload may buffer it until its layer is complete, after the
            # trainer has dropped the tensor the IPC handle points at
            self._fp8rl_sync().load(name, func(*list_args).clone(), last=bool(empty_cache))
            torch.cuda.synchronize()

    Fp8WorkerWrap.__module__, Fp8WorkerWrap.__qualname__ = __name__, "Fp8WorkerWrap"
    return Fp8WorkerWrap


_LAZY: dict[str, type] = {}


def __getattr__(name: str):
    if name == "Fp8WorkerWrap":
        if name not in _LAZY:
            _LAZY[name] = _make_fp8_worker_wrap()
        return _LAZY[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Fp8ConversionError", "PluginNotActiveError", "ResumeError", "UpstreamChangedError", "attest",
           "bind_module", "check_attestations", "install", "install_driver"]
