"""The OpenRLHF 0.11.2 worker plugin: our policy loss, Calibrated Clipping, FP8 training and rollout.

This is the **only** module of the project that touches OpenRLHF internals. It is pinned to
OpenRLHF 0.11.2 (:func:`check_version` raises on any other version before anything is
patched) and every name it rebinds is listed here:

==========================================================  ==========================================
upstream name (0.11.2)                                      what we bind there
==========================================================  ==========================================
``openrlhf.trainer.ray.ppo_actor.PolicyLoss``               :func:`make_policy_loss_class` subclass
                                                            (looked up by ``ActorPPOTrainer.__init__``)
``openrlhf.trainer.ray.ppo_actor.Actor``                    factory: upstream ``Actor``, then the
                                                            policy's Linears -> FP8 (trainer recipe)
``ActorPPOTrainer.ppo_train``                               wrapper: controller step, BF16 shadow of the
                                                            old policy on calibration steps
``ActorPPOTrainer.training_step``                           wrapper: metric sink, BF16 shadow of the
                                                            current policy on the measured micro-batch
``PolicyModelActor.save_checkpoint`` / ``init_model_...``  controller state in DeepSpeed client states
``openrlhf.trainer.ray.vllm_engine.RolloutRayActor``        (driver process) engine kwargs: FP8 model
                                                            path, ``quantization="fp8"``, our worker
                                                            extension :class:`Fp8WorkerWrap`
==========================================================  ==========================================

**Loss** (paper: the PPO-clip surrogate with the train/rollout IS weight). The subclass keeps
``PolicyLoss``'s constructor and ``forward`` signature and its 5-tuple
``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``, and computes it with
``fp8rl.rl.correction.corrected_ppo_token_loss`` + ``fp8rl.rl.aggregation.aggregate`` with the
bounds of our clip method (``vanilla``: ``1 -+ eps``; ``calibrated``: the controller's). With
calibration off it equals upstream (tested against the real 0.11.2 class). Upstream's IS options
map onto ours: token/clip/threshold ``(0, C)`` = TIS with cap C; token/mask = ICEPOP; off = none.
Other combinations (seq level, divergence gating, a clip threshold with low > 0) raise.

Extra metrics (the four clip cells, ratio quantiles, ``clip/low|high|alpha``, shadow metrics,
``rollout/mismatch_kl``) are written into ``experience.info`` of the micro-batch being trained
(the loss holds a reference to that dict, set by the ``training_step`` wrapper); upstream's
``training_step`` merges every 0-d tensor of ``info`` into the logged metrics (token-weighted
mean over micro-batches and ranks), so they appear in ``Global step N: {...}`` and TensorBoard.

**Calibrated Clipping across data-parallel ranks.** On a calibration step (controller step =
the number of ``ppo_train`` calls so far, saved with checkpoints):

1. before the first update, the actor computes BF16 log-probs of every replay-buffer sample
   under ``fp8_disabled`` (the old policy's shadow forward) and stores them in the sample's
   ``info`` (popped again before upstream's metric merge);
2. the measured micro-batch is the first one of the *second* optimizer step (the first point
   where the ratio carries the noise an update exposes, as in the mini backend); with a single
   optimizer step per rollout it is the first micro-batch, whose ratio only reflects the
   log-prob recomputation noise (a configuration where clipping does not bite anyway);
3. there, the wrapper runs the current policy once more under ``fp8_disabled`` (no grad) and
   hands the BF16 shadow ratios to the loss, which computes the FP8 ratios from its own inputs,
   **all-gathers** (ratio, shadow ratio, advantage) of the unmasked A != 0 tokens from every
   DP rank (variable lengths: sizes first, then padded tensors) and runs the controller on the
   concatenation. Every rank computes the same bounds from the same global tensors.

Accuracy: exact. The gathered tensors are the global batch, so alpha, the alpha-quantile and
the contribution solve are what a single process holding the whole micro-batch would compute
(tested with 2 and 4 simulated ranks). A histogram all-reduce would cost O(bins) instead of
O(tokens) but quantise the bound to the bin width; at 3 floats per token of one micro-batch per
rank every K steps the exact gather is negligible next to the forward passes.

**FP8 training**: the actor's ``nn.Linear`` layers are converted with
``fp8rl.quant.convert_to_fp8`` per the trainer recipe right after the model is created and
before DeepSpeed wraps it (LM head and embeddings stay BF16: the default module filter). The
EMA copy (created without LoRA arguments) is not converted. **Guess**: conversion before
``deepspeed.initialize`` under ZeRO-3 relies on the FP8 linear keeping the original weight
Parameter; unverified on GPUs here.

**FP8 rollout**: the driver pre-quantizes the HF checkpoint once per (model, rollout recipe)
into vLLM's fp8 layout (``fp8rl.quant.quantize_for_rollout``; :func:`prepare_rollout_checkpoint`)
and the engines load it (``quantization="fp8"``; blockwise checkpoints carry
``weight_block_size`` in their ``quantization_config``). Weight sync: :class:`Fp8WorkerWrap`
re-quantizes every BF16 tensor it receives with ``quantize_for_rollout`` and loads the FP8
weight and its scale (``weight_scale`` / ``weight_scale_inv``, the names of vLLM's fp8 loader)
through ``load_weights``. **Unverified on GPUs** (no vLLM on the CPU test machine): whether
vLLM 0.29's ``process_weights_after_loading`` keeps parameters reloadable (verl patches it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

#: The only OpenRLHF version this plugin binds into.
OPENRLHF_VERSION = "0.11.2"
#: Key of the plugin spec in the Ray runtime environment's env vars (set by the driver).
SPEC_ENV = "FP8RL_OPENRLHF_PLUGIN"
#: Key of the BF16 old log-probs in a replay-buffer sample's ``info`` (popped before logging).
SHADOW_OLD_KEY = "_fp8rl_shadow_old"
#: DeepSpeed client-state key of the controller state.
STATE_KEY = "fp8rl_clip"


class PluginVersionError(RuntimeError):
    """The installed OpenRLHF is not the version the plugin was written against."""


def check_version(installed: str | None = None) -> str:
    """Return the installed OpenRLHF version; raise :class:`PluginVersionError` unless 0.11.2."""
    if installed is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("openrlhf")
        except PackageNotFoundError as e:
            raise PluginVersionError(
                f"openrlhf is not installed; the paper-scale backend needs openrlhf[vllm]=="
                f"{OPENRLHF_VERSION} (pip install -e '.[cluster]')") from e
    if installed != OPENRLHF_VERSION:
        raise PluginVersionError(
            f"fp8rl's OpenRLHF plugin binds into OpenRLHF {OPENRLHF_VERSION} internals (PolicyLoss "
            f"signature and 5-tuple, ActorPPOTrainer.training_step, WorkerWrap.update_weight) but "
            f"openrlhf {installed} is installed; install openrlhf[vllm]=={OPENRLHF_VERSION} "
            "(the cluster extra pins it)")
    return installed


@dataclass(frozen=True)
class PluginSpec:
    """Everything the workers need that has no OpenRLHF flag (JSON round-trippable).

    Attributes:
        clip_method: ``vanilla`` or ``calibrated`` (``fp8rl.rl.clipping``).
        clip_options: constructor options of the clip method (``ClipConfig.clipper_options``).
        eps_low, eps_high: the vanilla epsilons (also passed to OpenRLHF as flags).
        trainer_recipe, rollout_recipe: ``fp8rl.quant.RECIPES`` names.
        trainer_impl: the trainer's FP8 implementation (``fp8.impl``: ``auto``, ``torchao``,
            ``fp8rl``, ``transformer_engine``; ``fp8rl.quant.convert_to_fp8``'s ``impl``).
        rollout_model: path of the pre-quantized FP8 rollout checkpoint (None for a bf16 rollout).
    """

    clip_method: str = "vanilla"
    clip_options: dict = field(default_factory=dict)
    eps_low: float = 0.2
    eps_high: float = 0.2
    trainer_recipe: str = "bf16"
    rollout_recipe: str = "bf16"
    rollout_model: str | None = None
    trainer_impl: str = "auto"

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        if "init_bounds" in d["clip_options"]:
            d["clip_options"]["init_bounds"] = list(d["clip_options"]["init_bounds"])
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PluginSpec:
        return cls(**json.loads(text))

    @classmethod
    def from_config(cls, cfg, rollout_model: str | None = None) -> PluginSpec:
        return cls(clip_method=cfg.clip.method, clip_options=dict(cfg.clip.clipper_options()),
                   eps_low=cfg.algorithm.eps_low, eps_high=cfg.algorithm.eps_high,
                   trainer_recipe=cfg.fp8.trainer_recipe, rollout_recipe=cfg.fp8.rollout_recipe,
                   rollout_model=rollout_model, trainer_impl=cfg.fp8.impl)

    def make_clipper(self):
        from fp8rl.rl.clipping import make_clipper

        opts = dict(self.clip_options)
        if "init_bounds" in opts:
            opts["init_bounds"] = tuple(opts["init_bounds"])
        return make_clipper(self.clip_method, self.eps_low, self.eps_high, **opts)


# --------------------------------------------------------------------------------------
# IS correction mapping and the loss
# --------------------------------------------------------------------------------------


def correction_from_upstream(level: str, mode: str, gating: str, threshold: Sequence[float]) -> tuple[str, dict]:
    """Upstream's ``is_correction_*`` options -> ``(our correction name, its params)``."""
    if level == "off":
        return "none", {}
    if level != "token" or gating != "ratio":
        raise ValueError(f"is_correction_level={level!r}, gating={gating!r} has no fp8rl equivalent; "
                         "use token level with ratio gating (TIS / ICEPOP)")
    low, high = (float(x) for x in threshold)
    if mode == "clip":
        if low != 0.0:
            raise ValueError(f"is_correction_mode=clip with threshold low {low} > 0 clamps the IS weight "
                             "from below, which TIS does not; pass --algo.advantage.is_correction_threshold 0 C")
        return "tis", {"cap": high}
    return "icepop", {"low": low, "high": high}


def _varlen_all_gather(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """All-gather 1-D tensors of different lengths (sizes first, then padded payloads)."""
    import torch.distributed as dist

    n = torch.tensor([t.numel()], device=t.device, dtype=torch.long)
    world = dist.get_world_size(group)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    top = int(max(int(s) for s in sizes))
    padded = torch.zeros(top, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    outs = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(outs, padded, group=group)
    return [o[: int(s)] for o, s in zip(outs, sizes, strict=True)]


def calibration_tokens(ratio, shadow_ratio, advantages, mask) -> dict[str, torch.Tensor]:
    """The tokens a calibration reads, flattened: unmasked tokens with A != 0 (``[n]`` each)."""
    m = mask.bool() & (advantages != 0)
    out = {"ratio": ratio.detach()[m].float(), "adv": advantages.detach()[m].float()}
    if shadow_ratio is not None:
        out["shadow"] = shadow_ratio.detach()[m].float()
    return out


def gather_calibration(local: dict[str, torch.Tensor],
                       all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None) -> dict[str, torch.Tensor]:
    """Concatenate every rank's calibration tokens (rank order); ``all_gather=None``: this rank only."""
    if all_gather is None:
        return dict(local)
    return {k: torch.cat(all_gather(v.contiguous())) for k, v in local.items()}


def global_update(clipper, step: int, local: dict[str, torch.Tensor],
                  all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None):
    """Run the clip method's ``update`` on the tokens of all ranks; returns the new bounds."""
    g = gather_calibration(local, all_gather)
    ones = torch.ones_like(g["ratio"], dtype=torch.bool)
    return clipper.update(step, ratio=g["ratio"], shadow_ratio=g.get("shadow"), advantages=g["adv"], mask=ones)


def make_policy_loss_class(base: type, spec: PluginSpec) -> type:
    """A subclass of upstream ``PolicyLoss`` (``base``) computing the loss with our kernel.

    The class has upstream's constructor and ``forward`` signature; ``spec`` fixes the clip
    method. Instances expose ``clipper``, ``step`` (the controller step, set by the trainer
    wrapper), ``sink`` (a dict receiving extra metrics) and ``pending_shadow`` (BF16 shadow
    ratios for the next forward, which then calibrates).
    """
    from fp8rl.rl.aggregation import aggregate
    from fp8rl.rl.correction import corrected_ppo_token_loss

    class Fp8rlPolicyLoss(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.policy_loss_type != "ppo":
                raise ValueError(f"fp8rl's loss implements policy_loss_type='ppo' only, got {self.policy_loss_type!r}")
            if (self.clip_eps_low, self.clip_eps_high) != (spec.eps_low, spec.eps_high):
                raise ValueError(f"--actor.eps_clip_low_high ({self.clip_eps_low}, {self.clip_eps_high}) "
                                 f"disagrees with the plugin spec ({spec.eps_low}, {spec.eps_high})")
            self.correction, self.correction_params = correction_from_upstream(
                self.is_correction_level, self.is_correction_mode, self.is_correction_gating,
                self.is_correction_threshold)
            self.agg_mode = "token-mean" if self.token_level_loss else "seq-mean-token-mean"
            self.clipper = spec.make_clipper()
            self.step = 0
            self.sink: dict | None = None
            self.pending_shadow: torch.Tensor | None = None
            self.all_gather: Callable | None = None
            self.last_metrics: dict[str, torch.Tensor] = {}

        def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None,
                    dp_size=1, batch_num_tokens=None, global_batch_size=None):
            if action_mask is None:
                action_mask = torch.ones_like(log_probs, dtype=torch.bool)
            extra: dict[str, torch.Tensor] = {}
            if self.pending_shadow is not None:
                shadow, self.pending_shadow = self.pending_shadow, None
                with torch.no_grad():
                    ratio = torch.exp((log_probs.detach() - old_log_probs).clamp(-20, 20))
                local = calibration_tokens(ratio, shadow, advantages, action_mask)
                global_update(self.clipper, self.step, local, self.all_gather)
            low, high = self.clipper.bounds(self.step).as_tuple()
            corr = self.correction if rollout_log_probs is not None else "none"
            loss_mat, m = corrected_ppo_token_loss(
                log_probs, old_log_probs, rollout_log_probs if corr != "none" else None, advantages,
                action_mask, low=low, high=high, dual_clip=self.dual_clip, correction=corr,
                correction_params=self.correction_params if corr != "none" else None)
            if batch_num_tokens is None and global_batch_size is None:
                loss = aggregate(loss_mat, action_mask, self.agg_mode)
            else:
                loss = aggregate(loss_mat, action_mask, self.agg_mode, global_tokens=batch_num_tokens,
                                 global_seqs=global_batch_size) * dp_size
            vllm_kl = m.get("rollout/mismatch_k1")
            is_filter = m.get("rollout/is_clipfrac")
            for k, v in m.items():
                if k.startswith(("actor/clipfrac_", "actor/ratio_neg_")) or k == "rollout/mismatch_kl":
                    extra[k] = v.detach()
            for k, v in self.clipper.metrics(self.step).items():
                extra[k] = torch.tensor(float(v))
            self.last_metrics = extra
            if self.sink is not None:
                self.sink.update(extra)
            return loss, m["actor/clipfrac"], m["actor/ppo_kl"], vllm_kl, is_filter

    Fp8rlPolicyLoss.__qualname__ = Fp8rlPolicyLoss.__name__ = "Fp8rlPolicyLoss"
    return Fp8rlPolicyLoss


# --------------------------------------------------------------------------------------
# Worker installation (GPU processes only; thin)
# --------------------------------------------------------------------------------------


def install_from_env() -> None:
    """Ray ``worker_process_setup_hook``: read the spec from :data:`SPEC_ENV` and install."""
    import os

    text = os.environ.get(SPEC_ENV)
    if not text:
        raise RuntimeError(f"{SPEC_ENV} is not set: the fp8rl driver sets it in the Ray runtime env")
    install(PluginSpec.from_json(text))


_INSTALLED: dict[str, PluginSpec] = {}


def install(spec: PluginSpec, modules: dict[str, Any] | None = None) -> None:
    """Bind the plugin into OpenRLHF (idempotent per process).

    ``modules`` maps ``"ppo_actor"`` (and optionally ``"vllm_engine"``) to module objects; by
    default the real ``openrlhf.trainer.ray.*`` modules are imported (GPU machines). Tests pass
    ``ppo_actor`` executed from upstream source with heavy imports stubbed.
    """
    if _INSTALLED.get("spec") == spec:
        return
    check_version()
    if modules is None:
        import importlib

        modules = {"ppo_actor": importlib.import_module("openrlhf.trainer.ray.ppo_actor")}
    ppo_actor = modules["ppo_actor"]
    upstream_loss = getattr(ppo_actor.PolicyLoss, "_fp8rl_upstream", ppo_actor.PolicyLoss)
    loss_cls = make_policy_loss_class(upstream_loss, spec)
    loss_cls._fp8rl_upstream = upstream_loss
    ppo_actor.PolicyLoss = loss_cls
    _patch_trainer(ppo_actor.ActorPPOTrainer, spec)
    _patch_actor(ppo_actor, spec)
    _INSTALLED["spec"] = spec


def _dp_all_gather(strategy) -> Callable | None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    group = None
    mesh = getattr(strategy, "ds_device_mesh", None)
    if mesh is not None:
        try:
            group = mesh["dp"].get_group()
        except (KeyError, RuntimeError, AttributeError):
            group = None
    return lambda t: _varlen_all_gather(t, group)


def _shadow_log_probs(trainer, experience) -> torch.Tensor:
    """BF16 log-probs of ``experience`` under the current weights (``fp8_disabled``, no grad)."""
    from fp8rl.quant.convert import fp8_disabled

    with torch.no_grad(), fp8_disabled(trainer.actor.model):
        return trainer.actor(experience.sequences, experience.action_mask,
                             attention_mask=experience.attention_mask,
                             ring_attn_group=trainer.strategy.ring_attn_group)


def _patch_trainer(cls, spec: PluginSpec) -> None:
    if getattr(cls, "_fp8rl_patched", False):
        return
    orig_ppo_train, orig_training_step = cls.ppo_train, cls.training_step

    def ppo_train(self, kl_ctl):
        loss = self.actor_loss_fn
        step = getattr(self, "_fp8rl_step", 0)
        loss.step = step
        loss.all_gather = _dp_all_gather(self.strategy)
        self._fp8rl_shadow = loss.clipper.needs_shadow(step)
        self._fp8rl_micro = 0
        if self._fp8rl_shadow:  # the old policy's BF16 shadow forward, in micro-batches
            items = self.replay_buffer.items
            size = max(1, int(self.micro_train_batch_size))
            for i in range(0, len(items), size):
                chunk = items[i:i + size]
                batch = self.replay_buffer.collate_fn(chunk)
                batch.to_device(torch.cuda.current_device())
                lp = _shadow_log_probs(self, batch).to("cpu")
                for j, item in enumerate(chunk):
                    item.info[SHADOW_OLD_KEY] = lp[j, : item.action_mask.shape[0]]
        try:
            return orig_ppo_train(self, kl_ctl)
        finally:
            self._fp8rl_step = step + 1
            for item in self.replay_buffer.items:
                item.info.pop(SHADOW_OLD_KEY, None)

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
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

                old_bf16 = pad_sequence(list(shadow_old), batch_first=True).to(experience.action_mask.device)
                old_bf16 = old_bf16[:, : experience.action_mask.shape[1]]
                cur_bf16 = _shadow_log_probs(self, experience)
                shadow_ratio = torch.exp((cur_bf16 - old_bf16).clamp(-20, 20))
            loss.pending_shadow = shadow_ratio if shadow_ratio is not None else torch.ones_like(
                experience.action_log_probs)
        loss.sink = experience.info
        try:
            return orig_training_step(self, experience, kl_ctl, step, loss_batch_info)
        finally:
            loss.sink = None

    cls.ppo_train, cls.training_step = ppo_train, training_step
    cls._fp8rl_patched = True


def _patch_actor(ppo_actor, spec: PluginSpec) -> None:
    """FP8 conversion at model creation; controller state in checkpoints."""
    actor_cls = ppo_actor.PolicyModelActor
    if getattr(actor_cls, "_fp8rl_patched", False):
        return
    upstream_actor = ppo_actor.Actor

    def make_actor(*args, **kwargs):
        model = upstream_actor(*args, **kwargs)
        if "lora_rank" in kwargs:  # the trained policy (the EMA copy is created without LoRA args)
            convert_trainer_model(model.model, spec.trainer_recipe, spec.trainer_impl)
        return model

    ppo_actor.Actor = make_actor
    orig_init, orig_save = actor_cls.init_model_from_pretrained, actor_cls.save_checkpoint

    def init_model_from_pretrained(self, *args, **kwargs):
        out = orig_init(self, *args, **kwargs)
        state = (self.checkpoint_states or {}).get(STATE_KEY)
        if state:
            self.trainer.actor_loss_fn.clipper.load_state_dict(state["clipper"])
            self.trainer._fp8rl_step = int(state["step"])
        return out

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        client_states = dict(client_states or {})
        client_states[STATE_KEY] = {"clipper": self.trainer.actor_loss_fn.clipper.state_dict(),
                                    "step": getattr(self.trainer, "_fp8rl_step", 0)}
        return orig_save(self, tag, client_states, metric_value, metric_key)

    actor_cls.init_model_from_pretrained = init_model_from_pretrained
    actor_cls.save_checkpoint = save_checkpoint
    actor_cls._fp8rl_patched = True


def convert_trainer_model(model: torch.nn.Module, recipe_name: str, impl: str = "auto") -> torch.nn.Module:
    """FP8 training GEMMs per ``recipe_name`` with implementation ``impl`` (loud if unsupported).

    The model may still sit on the CPU (DeepSpeed moves it later), so the hardware check uses
    the CUDA device this process will train on (``convert_to_fp8(device=)``); the conversion is
    in place. With ``impl`` resolving to ``transformer_engine`` every converted layer runs its
    forward inside ``te.autocast`` with the recipe (the actor's training and old-log-prob
    forwards alike) and ``fp8_disabled`` runs it without.
    """
    from fp8rl.quant.convert import convert_to_fp8

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    return convert_to_fp8(model, recipe_name, impl=impl, device=device)


# --------------------------------------------------------------------------------------
# FP8 rollout: pre-quantized checkpoint, engine kwargs, weight sync
# --------------------------------------------------------------------------------------


def rollout_engine_kwargs(spec: PluginSpec) -> dict:
    """Extra ``vllm.AsyncEngineArgs`` kwargs of the rollout engines (empty for a bf16 rollout)."""
    from fp8rl.quant.recipes import get_recipe

    if not get_recipe(spec.rollout_recipe).enabled:
        return {}
    if not spec.rollout_model:
        raise ValueError("an FP8 rollout recipe needs the pre-quantized checkpoint (spec.rollout_model)")
    return {"model": spec.rollout_model, "quantization": "fp8",
            "worker_extension_cls": f"{__name__}.Fp8WorkerWrap"}


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


def install_driver(spec: PluginSpec, vllm_engine=None) -> None:
    """Driver process: make ``create_vllm_engines`` build FP8 engines (no-op for bf16 rollout)."""
    extra = rollout_engine_kwargs(spec)
    if not extra:
        return
    check_version()
    if vllm_engine is None:
        import importlib

        vllm_engine = importlib.import_module("openrlhf.trainer.ray.vllm_engine")
    actor = vllm_engine.RolloutRayActor
    if isinstance(actor, _InjectingActorClass):
        actor = actor._cls
    vllm_engine.RolloutRayActor = _InjectingActorClass(actor, extra)


def prepare_rollout_checkpoint(src: str, dst: str, recipe_name: str) -> str:
    """Write an FP8 copy of HF checkpoint ``src`` into ``dst`` in vLLM's fp8 layout (idempotent).

    Every ``*.safetensors`` shard is quantized with ``quantize_for_rollout`` (LM head and
    embeddings kept), ``config.json`` gets the recipe's ``quantization_config``, other files
    (tokenizer, generation config) are copied. ``src`` may be a local directory or an HF id
    (downloaded with ``huggingface_hub.snapshot_download``). Returns ``dst``.
    """
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from fp8rl.quant.rollout import quantize_for_rollout

    out = Path(dst)
    if (out / ".fp8rl_done").exists():
        return str(out)
    src_dir = Path(src)
    if not src_dir.is_dir():
        from huggingface_hub import snapshot_download

        src_dir = Path(snapshot_download(src))
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    qcfg = None
    index: dict[str, str] = {}
    for f in sorted(src_dir.iterdir()):
        if f.suffix == ".safetensors":
            sd, qcfg = quantize_for_rollout(load_file(str(f)), recipe_name)
            save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp / f.name), metadata={"format": "pt"})
            index.update({k: f.name for k in sd})
        elif f.is_file() and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, tmp / f.name)
    config = json.loads((src_dir / "config.json").read_text())
    if qcfg is not None:
        config["quantization_config"] = qcfg
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if (src_dir / "model.safetensors.index.json").exists():
        idx = json.loads((src_dir / "model.safetensors.index.json").read_text())
        idx["weight_map"] = index
        (tmp / "model.safetensors.index.json").write_text(json.dumps(idx, indent=2))
    (tmp / ".fp8rl_done").write_text(recipe_name + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return str(out)


def _worker_wrap_base():
    try:
        from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap
    except ImportError:  # CPU machines: the class is only defined for the vLLM worker processes
        return object
    return WorkerWrap


class Fp8WorkerWrap(_worker_wrap_base()):  # type: ignore[misc]
    """vLLM worker extension: upstream's ``WorkerWrap`` whose weight sync re-quantizes to FP8.

    The rollout recipe is read from the loaded model's ``quantization_config``
    (``weight_block_size`` -> blockwise, else per-tensor); see ``fp8rl.quant.rollout``.
    """

    def _fp8_recipe(self) -> str:
        qc = getattr(self.model_config.hf_config, "quantization_config", None) or {}
        return "blockwise" if qc.get("weight_block_size") else "tensorwise"

    def _load_fp8(self, name: str, weight: torch.Tensor) -> None:
        from fp8rl.quant.rollout import quantize_for_rollout

        sd, _ = quantize_for_rollout({name: weight}, self._fp8_recipe())
        self.model_runner.model.load_weights(weights=list(sd.items()))

    def update_weight(self, name, dtype, shape, empty_cache=False):
        weight = torch.empty(shape, dtype=dtype, device="cuda")
        if self._model_update_with_ray:
            import ray.util.collective as collective

            collective.broadcast(weight, 0, group_name=self._model_update_group)
        else:
            self._model_update_group.broadcast(weight, src=0, stream=torch.cuda.current_stream())
        self._load_fp8(name, weight)
        del weight

    def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles=None, empty_cache=False):
        from openrlhf.trainer.ray.utils import get_physical_gpu_id

        func, args = ipc_handles[get_physical_gpu_id()]
        list_args = list(args)
        list_args[6] = self.device.index
        self._load_fp8(name, func(*list_args))
        torch.cuda.synchronize()
