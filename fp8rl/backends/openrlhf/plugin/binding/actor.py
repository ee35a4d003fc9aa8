"""The binding in the PPO actors: FP8 conversion and checkpoints (``DeepspeedStrategy``), our
loss and the calibration schedule (``ActorPPOTrainer``). See the package docstring for why these
objects are reached in Ray's by-value ``PolicyModelActor``.

**The replay-buffer shuffle resumes exactly.** ``ActorPPOTrainer.ppo_train`` builds a fresh
``DataLoader(replay_buffer, shuffle=True)`` each step; its ``RandomSampler`` (generator ``None``)
draws its seed, and the loader iterator its base seed, from the process's global torch CPU
generator, seeded once with ``--train.seed`` in ``setup_distributed``. So the order of the
micro-batches of step ``k`` depends on every draw since start-up, and OpenRLHF's checkpoint keeps
none of it (client state: episode, global step, consumed prompts, the prompt loader's state): a
requeued run re-seeds and shuffles step ``k + 1`` as an uninterrupted run shuffled its first step.
The plugin runs ``ppo_train`` on a CPU-generator stream of its own (the global state swapped in
and out around it; a fresh run's first stream state is the global one, so it shuffles as
upstream), saves every rank's stream state with each checkpoint (:data:`RNG_KEY`, all ranks
gathered: ZeRO-3 writes one client state per rank, ZeRO-1/2 rank 0's only) and a resumed rank
continues its own stream at its first ``ppo_train``.
"""

from __future__ import annotations

import inspect
import logging
import weakref

import torch

from fp8rl.backends.openrlhf.plugin.binding import calibrate
from fp8rl.backends.openrlhf.plugin.binding.common import (
    PluginNotActiveError,
    ResumeError,
    UpstreamChangedError,
    _check_params,
    _originals,
)
from fp8rl.backends.openrlhf.plugin.calibration import varlen_all_gather
from fp8rl.backends.openrlhf.plugin.fp8_training import (
    convert_trainer_model,
    count_fp8_layers,
    require_conversion,
)
from fp8rl.backends.openrlhf.plugin.loss import make_policy_loss_class
from fp8rl.backends.openrlhf.plugin.metrics import StepMetrics
from fp8rl.backends.openrlhf.plugin.spec import STATE_KEY, PluginSpec, check_version

log = logging.getLogger(__name__)
#: strategy -> weak reference to the ActorPPOTrainer built on it (whose controller ``save_ckpt`` saves)
_TRAINERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: DeepSpeed client-state key of the policy ranks' ``ppo_train`` RNG streams (``{"ranks": [state, ...]}``).
RNG_KEY = "fp8rl_rng"


def bind_strategy(ds_module, spec: PluginSpec) -> None:
    check_version()
    cls, actor_cls = ds_module.DeepspeedStrategy, ds_module.Actor
    orig = _originals(cls, ("_ds_init_train_model", "save_ckpt", "load_ckpt", "get_ds_train_config"))
    _check_params(orig["_ds_init_train_model"], ("self", "model", "cfg"), "DeepspeedStrategy._ds_init_train_model")
    _check_params(orig["get_ds_train_config"], ("self", "optim_dict"), "DeepspeedStrategy.get_ds_train_config")
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
            state[RNG_KEY] = gather_rng_streams(trainer)  # a collective: every rank saves together
            bound.arguments["client_state"] = state
        return orig["save_ckpt"](*bound.args, **bound.kwargs)

    def load_ckpt(self, model, load_dir, *args, **kwargs):
        load_path, states = orig["load_ckpt"](self, model, load_dir, *args, **kwargs)
        self._fp8rl_checkpoint = {"path": load_path, "state": (states or {}).get(STATE_KEY),
                                  "rng": (states or {}).get(RNG_KEY)}
        return load_path, states

    cls._ds_init_train_model, cls.save_ckpt, cls.load_ckpt = _ds_init_train_model, save_ckpt, load_ckpt
    cls.get_ds_train_config = orig["get_ds_train_config"]
    if spec.device == "cpu":  # torch's AdamW: DeepSpeed's CPU FusedAdam does not resume exactly (cpu_support)
        from fp8rl.backends.openrlhf.plugin.cpu_support import torch_adam

        def get_ds_train_config(self, *args, **kwargs):
            return torch_adam(orig["get_ds_train_config"](self, *args, **kwargs))

        cls.get_ds_train_config = get_ds_train_config


def controller_state(trainer) -> dict:
    """What a checkpoint keeps of the plugin: the clip controller's state and its step."""
    return {"clipper": trainer.actor_loss_fn.clipper.state_dict(), "step": int(trainer._fp8rl_step)}


def _world():
    """``(rank, world size)`` of the default process group (``(0, 1)`` without one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rng_stream(trainer) -> torch.Tensor:
    """The CPU-generator state this rank's next ``ppo_train`` starts from."""
    state = getattr(trainer, "_fp8rl_rng", None)
    return (state if state is not None else resumed_rng_stream(trainer.strategy)).clone()


def gather_rng_streams(trainer) -> dict:
    """Every rank's :func:`rng_stream`, in global rank order (an all-gather: call on all ranks)."""
    import torch.distributed as dist

    mine = rng_stream(trainer)
    _, world = _world()
    if world == 1:
        return {"ranks": [mine]}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    return {"ranks": ranks}


def resumed_rng_stream(strategy) -> torch.Tensor:
    """This rank's stream from the loaded checkpoint; the global CPU-generator state without one."""
    ck = getattr(strategy, "_fp8rl_checkpoint", None)
    if ck is None or ck["path"] is None:
        return torch.get_rng_state()
    rank, world = _world()
    ranks = (ck.get("rng") or {}).get("ranks")
    if ranks is None:
        log.warning("checkpoint %s has no %r: the replay-buffer order after this resume differs from an "
                    "uninterrupted run's (written without the plugin's RNG streams)", ck["path"], RNG_KEY)
        return torch.get_rng_state()
    if len(ranks) != world:
        log.warning("checkpoint %s holds the RNG streams of %d ranks, this job has %d: the replay-buffer order "
                    "after this resume differs from an uninterrupted run's", ck["path"], len(ranks), world)
        return torch.get_rng_state()
    return ranks[rank]


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

    # the calibration plan's windows: ppo_train reads this name from the module's dict at call time
    upstream_iter = getattr(ppo_actor.iter_grad_accum_global_norm, "_fp8rl_upstream",
                            ppo_actor.iter_grad_accum_global_norm)
    _check_params(upstream_iter, ("data_iter", "strategy", "accumulated_gradient", "mask_fn"),
                  "loss_utils.iter_grad_accum_global_norm")

    def iter_grad_accum_global_norm(data_iter, strategy, accumulated_gradient, mask_fn):
        windows = upstream_iter(data_iter, strategy, accumulated_gradient, mask_fn)
        ref = _TRAINERS.get(strategy)
        trainer = ref() if ref is not None else None
        plan = None if trainer is None else getattr(trainer, "_fp8rl_plan", None)
        if not calibrate.runs_windows(trainer, plan):  # calibrates, or holds rows out (their shadow)
            return windows
        return calibrate.plan_windows(trainer, windows, accumulated_gradient)

    iter_grad_accum_global_norm._fp8rl_upstream = upstream_iter
    ppo_actor.iter_grad_accum_global_norm = iter_grad_accum_global_norm
    cpu = _originals(cls, ("_init_vllm_sync_group", "broadcast_to_vllm"))
    if spec.device == "cpu":  # no NCCL, no CUDA IPC: the tensors go through Ray (binding.cpu_sync)
        from fp8rl.backends.openrlhf.plugin.binding import cpu_sync

        _check_params(cpu["_init_vllm_sync_group"], ("self", "backend"), "ActorPPOTrainer._init_vllm_sync_group")
        _check_params(cpu["broadcast_to_vllm"], ("self",), "ActorPPOTrainer.broadcast_to_vllm")
        cls._init_vllm_sync_group, cls.broadcast_to_vllm = cpu_sync.init_vllm_sync_group, cpu_sync.broadcast_to_vllm
    else:
        cls._init_vllm_sync_group, cls.broadcast_to_vllm = cpu["_init_vllm_sync_group"], cpu["broadcast_to_vllm"]


def _init_trainer(trainer, strategy, spec: PluginSpec) -> None:
    loss = trainer.actor_loss_fn
    if getattr(type(loss), "_fp8rl_upstream", None) is None:
        raise PluginNotActiveError("ActorPPOTrainer built an upstream PolicyLoss: ppo_actor.PolicyLoss is not ours")
    require_conversion(spec, count_fp8_layers(trainer.actor), "ActorPPOTrainer.__init__")
    trainer._fp8rl_step, trainer._fp8rl_plan, trainer._fp8rl_items = 0, None, None
    ck = getattr(strategy, "_fp8rl_checkpoint", None)
    if ck is not None and ck["path"] is not None:
        if ck["state"] is not None:
            loss.clipper.load_state_dict(ck["state"]["clipper"])
            trainer._fp8rl_step = int(ck["state"]["step"])
        elif getattr(loss.clipper, "calibrates", False):  # a method with state of its own to restore
            raise ResumeError(
                f"checkpoint {ck['path']} has no fp8rl controller state ({STATE_KEY!r} in the DeepSpeed "
                f"client state): it was written without the plugin, so the {spec.clip_method} bounds cannot "
                "resume; start the run afresh (remove the checkpoint directory)")
        else:
            log.warning("checkpoint %s has no fp8rl state; the %s clip method has none to restore", ck["path"],
                        spec.clip_method)
    _TRAINERS[strategy] = weakref.ref(trainer)


def _dp_group(strategy):
    """``(group, active)``: OpenRLHF's DP process group (device mesh ``dp``) and whether it has >1 rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None, False
    mesh = getattr(strategy, "ds_device_mesh", None)
    group = mesh["dp"].get_group() if mesh is not None else None
    return group, dist.get_world_size(group) > 1


def _ppo_train(self, kl_ctl, orig_ppo_train):
    import torch.distributed as dist

    loss = self.actor_loss_fn
    step = self._fp8rl_step
    group, active = _dp_group(self.strategy)
    loss.step = step
    loss.all_gather = (lambda t: varlen_all_gather(t, group)) if active else None
    device = calibrate._device()

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    def reduce_max(n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    self._fp8rl_reduce_max = reduce_max if active else None
    metrics = StepMetrics()
    if loss.spec.dump_dir:  # which GEMMs this step ran (plugin.kernels; the smoke job's tests)
        from collections import Counter

        # "rows": samples per shadow forward (the shadow's share of the work); "plan": the step's rows
        self._fp8rl_kernels = {"train": Counter(), "shadow": Counter(), "rows": Counter(), "plan": {}}
    self._fp8rl_metrics = metrics
    outer_rng = torch.get_rng_state()
    try:
        calibrate.begin_step(self, step)  # the step's plan; the BF16 old log-probs of its shadowed samples
        loss.step_metrics = metrics
        torch.set_rng_state(rng_stream(self))  # the replay-buffer shuffle draws from this rank's stream
        try:
            with calibrate.counting(getattr(self, "_fp8rl_kernels", None), "train"):
                status = orig_ppo_train(self, kl_ctl)
        finally:
            self._fp8rl_rng = torch.get_rng_state()
            torch.set_rng_state(outer_rng)
        # the plan's pooled update (periodic / pooled) and its metrics, counts summed over ranks
        plan_metrics = calibrate.end_step(self, step, (lambda t: reduce_sum(t.to(device)).cpu()) if active else None)
    finally:
        calibrate.abort_step(self)
        loss.step_metrics = None

    status = dict(status)
    status.update(metrics.finalize(reduce_sum if active else None, loss.all_gather))
    status.update(plan_metrics)
    counters = getattr(self, "_fp8rl_kernels", None)
    if counters is not None:
        from fp8rl.backends.openrlhf.plugin.kernels import write_counts

        write_counts(loss.spec.dump_dir, dist.get_rank() if dist.is_initialized() else 0, step, counters)
        self._fp8rl_kernels = None
    self._fp8rl_step = step + 1
    return status


def _training_step(self, experience, kl_ctl, step, loss_batch_info, orig_training_step):
    calibrate.before_micro_batch(self, experience)  # the plan's view of this micro-batch for the loss
    loss = self.actor_loss_fn
    if loss.spec.score_centering is None:
        return orig_training_step(self, experience, kl_ctl, step, loss_batch_info)
    handle = score_centering_hook(self, experience)
    try:
        return orig_training_step(self, experience, kl_ctl, step, loss_batch_info)
    finally:
        handle.remove()
        loss.sc_inputs = None


#: ``Actor.forward``'s leading parameters, as the Score Centering hook reads its call.
ACTOR_FORWARD_PARAMS = ("self", "sequences", "action_mask", "attention_mask", "return_output")


def score_centering_hook(trainer, experience):
    """Score Centering's view of one micro-batch: pop the sampler's top-k from its ``info``
    (``plugin.score_centering.take_sampler_topk``) and register a forward hook on the actor that,
    at ``training_step``'s one forward, hands the loss ``sc_inputs = (log p [B, A, k] with gradient,
    log q [B, A, k], ids [B, A, k])`` computed from that forward's logits and action log-probs
    (``trainer_logp_at_topk``: gathers, no second log-softmax). Returns the hook's handle."""
    from fp8rl.backends.openrlhf.plugin.score_centering import (
        take_sampler_topk,
        trainer_logp_at_topk,
    )

    actor, loss = trainer.actor, trainer.actor_loss_fn
    _check_params(type(actor).forward, ACTOR_FORWARD_PARAMS, "Actor.forward")
    k = int(loss.spec.score_centering["topk"])
    ids, sampler_logp = take_sampler_topk(experience, k)
    loss.sc_inputs = None
    calls = []

    def hook(module, args, kwargs, output):
        calls.append(1)
        if len(calls) > 1:
            raise UpstreamChangedError("ActorPPOTrainer.training_step ran the actor forward twice: fp8rl's Score "
                                       "Centering hook reads its one forward (the binding was written for 0.11.2)")
        bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
        call = bound.arguments
        if call.get("ring_attn_group") is not None:
            raise ValueError("Score Centering at paper scale does not take ring attention (sliced sequences)")
        if not (isinstance(output, tuple) and len(output) == 2 and "logits" in output[1]):
            raise UpstreamChangedError("Actor.forward(return_output=True) did not return (action_log_probs, output "
                                       "with logits): fp8rl's Score Centering hook reads them (openrlhf 0.11.2)")
        action_log_probs, out = output
        if action_log_probs.shape != experience.action_mask.shape:
            raise UpstreamChangedError(f"the actor's action log-probs {tuple(action_log_probs.shape)} do not match "
                                       f"the micro-batch's action mask {tuple(experience.action_mask.shape)}")
        train_logp = trainer_logp_at_topk(out["logits"], action_log_probs, call["sequences"], ids,
                                          attention_mask=call.get("attention_mask"),
                                          packed=bool(getattr(module, "packing_samples", False)))
        loss.sc_inputs = (train_logp, sampler_logp, ids)

    return actor.register_forward_hook(hook, with_kwargs=True)
