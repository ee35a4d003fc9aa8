"""Typed configuration of one run, shared by both backends.

Plain dataclasses of primitives (OmegaConf structured-config friendly: no unions of complex
types, lists of primitives only) that validate in ``__post_init__`` and raise ``ValueError``
with a message saying what is wrong and how to fix it. The axis configs mirror the Hydra
config groups (``algorithm/ model/ fp8/ clip/``); ``RunConfig`` composes them and runs the
cross-field checks in ``validate()`` (called from its ``__post_init__``). Nothing is rewritten
after validation: the logged config is the config that ran.

Registry-backed names (advantage estimator, loss aggregation, FP8 recipes, clip arms) are
checked against their registries when the config is built, so a typo in a sweep fails before
anything runs. Those registries live in ``fp8rl.rl`` / ``fp8rl.quant`` and are imported lazily
inside the checks.

Backend-specific settings (the mini backend's model sizes, task and SFT) live with the backend
(``fp8rl.backends.mini.config.MiniRunConfig`` extends ``RunConfig``).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import ClassVar

from fp8rl.rl.calibration.schedule import DEFAULT_CALIBRATION_MODE, PERIODIC_DEFAULTS

ALGORITHMS = ("grpo", "dapo", "dr_grpo")
MODEL_SLOTS = ("8b", "14b", "32b")


def _check_registry(module: str, attr: str, name: str, what: str) -> None:
    """Raise ``ValueError`` if ``name`` is not registered in ``module.attr``."""
    registry = getattr(importlib.import_module(module), attr)
    if name not in registry:
        raise ValueError(f"{what}: unknown name {name!r}; valid names are: {sorted(registry)}")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass
class AlgorithmConfig:
    """The RL algorithm (paper §Setup: GRPO for the 8B/32B models, DAPO for the 14B).

    Attributes:
        name: ``grpo``, ``dapo`` or ``dr_grpo`` (a label; the fields below are what runs).
        advantage_estimator: key of ``fp8rl.rl.advantages.ADVANTAGE_ESTIMATORS``.
        n_samples_per_prompt: responses per prompt (the group size).
        eps_low, eps_high: PPO clip range ``[1-eps_low, 1+eps_high]`` (DAPO clip-higher: 0.2/0.28).
        loss_agg_mode: key of ``fp8rl.rl.aggregation.LOSS_AGGREGATIONS``.
        dual_clip: dual-clip constant c > 1 for A<0 tokens, or ``None`` for off.
        dynamic_sampling: DAPO: drop groups whose rewards are all equal and resample.
        max_extra_rounds: DAPO: at most this many extra rollout rounds to refill the batch.
        overlong_buffer: DAPO soft overlong punishment buffer L_cache in tokens (0 = off).
        overlong_penalty: the penalty at and beyond the maximum length (DAPO: 1.0).
        kl_coef: KL-to-reference coefficient; the paper runs without KL, only 0.0 is supported.
    """

    name: str = "grpo"
    advantage_estimator: str = "grpo"
    n_samples_per_prompt: int = 8
    eps_low: float = 0.2
    eps_high: float = 0.2
    loss_agg_mode: str = "token-mean"
    dual_clip: float | None = None
    dynamic_sampling: bool = False
    max_extra_rounds: int = 0
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        _require(self.name in ALGORITHMS, f"algorithm.name {self.name!r} must be one of {ALGORITHMS}")
        _check_registry("fp8rl.rl.advantages", "ADVANTAGE_ESTIMATORS", self.advantage_estimator,
                        "algorithm.advantage_estimator")
        _check_registry("fp8rl.rl.aggregation", "LOSS_AGGREGATIONS", self.loss_agg_mode,
                        "algorithm.loss_agg_mode")
        _require(self.n_samples_per_prompt >= 1,
                 f"algorithm.n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
        _require(0 < self.eps_low < 1, f"algorithm.eps_low must be in (0, 1), got {self.eps_low}")
        _require(self.eps_high > 0, f"algorithm.eps_high must be > 0, got {self.eps_high}")
        _require(self.dual_clip is None or self.dual_clip > 1,
                 f"algorithm.dual_clip must be > 1 or null (off), got {self.dual_clip}")
        _require(self.max_extra_rounds >= 0,
                 f"algorithm.max_extra_rounds must be >= 0, got {self.max_extra_rounds}")
        _require(self.overlong_buffer >= 0,
                 f"algorithm.overlong_buffer must be >= 0 (0 = off), got {self.overlong_buffer}")
        _require(self.overlong_penalty >= 0,
                 f"algorithm.overlong_penalty must be >= 0, got {self.overlong_penalty}")
        _require(self.kl_coef == 0.0,
                 f"algorithm.kl_coef={self.kl_coef}: KL regularisation is not implemented "
                 "(the paper runs without KL); set algorithm.kl_coef=0")


@dataclass
class ModelConfig:
    """The model slot: ``8b``, ``14b`` or ``32b`` (each backend maps slots to its models)."""

    slot: str = "8b"

    def __post_init__(self) -> None:
        _require(self.slot in MODEL_SLOTS, f"model.slot {self.slot!r} must be one of {MODEL_SLOTS}")


#: ``fp8.compute_dtype`` values: the dtype of everything but FP8 GEMMs (torch dtypes below).
COMPUTE_DTYPES: tuple[str, ...] = ("bf16", "fp32")
#: Largest ``seed`` (seeds name run directories and seed torch/numpy generators: 32 bits).
MAX_SEED = 2**32 - 1


def torch_dtype(name: str):
    """``bf16`` / ``fp32`` -> the torch dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


@dataclass
class Fp8Config:
    """Precision arm: a rollout recipe and a trainer recipe (keys of ``fp8rl.quant.RECIPES``)
    and the compute dtype of everything that is not an FP8 GEMM.

    ``bf16``: no FP8 (both recipes ``bf16``); ``rollout_only``: FP8 rollout recipe, ``bf16``
    trainer; full FP8: both FP8; ``fp32``: no FP8 and fp32 compute (an extra arm: the old mini
    "BF16", which was fp32). ``compute_dtype`` (``bf16`` | ``fp32``) is the dtype the trainer and
    the rollout engine compute in outside FP8 GEMMs: ``bf16`` is BF16 mixed precision as the paper
    trains (fp32 master weights, BF16 activations and high-precision GEMMs with fp32
    accumulation, ``fp8rl.quant.lowp``; FP8 GEMMs quantize from the BF16 values); the BF16 shadow
    of Calibrated Clipping is that forward with FP8 off. ``emulate=True`` computes FP8 by
    quantize-dequantize in high precision (CPU tests); a recipe the hardware cannot run raises,
    naming ``fp8.emulate=true`` as the fix.

    ``impl`` is the trainer's FP8 implementation (``fp8rl.quant.IMPLEMENTATIONS``: ``torchao``,
    ``fp8rl``, ``transformer_engine``), or ``auto`` for the recipe's default
    (``fp8rl.quant.default_impl``): on FP8 kernels tensorwise/rowwise -> torchao (as the paper),
    blockwise and mxfp8 -> transformer_engine, tensorwise_delayed -> transformer_engine; with
    ``emulate=true`` our emulated linear for every recipe (for the torchao recipes with torchao's
    own arithmetic, bit for bit). The issue's ``emulated`` is
    ``emulate=true``. Checked here without hardware: the implementation must express the trainer
    recipe (``fp8rl.quant.resolve_impl``); whether the GPU and Transformer Engine can run it is
    checked when the trainer converts its model, before the first step, naming the fix.
    The rollout engine has its own path (``fp8rl.quant.rollout``) and ignores ``impl``.
    """

    name: str = "bf16"
    rollout_recipe: str = "bf16"
    trainer_recipe: str = "bf16"
    emulate: bool = False
    impl: str = "auto"
    compute_dtype: str = "bf16"

    def __post_init__(self) -> None:
        _require(bool(self.name), "fp8.name must be a non-empty label (e.g. bf16, tensorwise)")
        _require(self.compute_dtype in COMPUTE_DTYPES,
                 f"fp8.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        for f in ("rollout_recipe", "trainer_recipe"):
            _check_registry("fp8rl.quant", "RECIPES", getattr(self, f), f"fp8.{f}")
        from fp8rl.quant import get_recipe, resolve_impl

        try:
            resolve_impl(self.trainer_recipe, self.impl, emulate=self.emulate)
        except (KeyError, ValueError) as e:  # RegistryError is a KeyError
            raise ValueError(
                f"fp8.impl={self.impl!r} cannot run fp8.trainer_recipe={self.trainer_recipe!r} with "
                f"fp8.emulate={str(self.emulate).lower()}: {e}"
            ) from e
        _require(get_recipe(self.rollout_recipe).scaling == "dynamic",
                 f"fp8.rollout_recipe={self.rollout_recipe!r} uses delayed scaling, a training "
                 f"recipe; the rollout engine quantizes with dynamic scales (vLLM's fp8 online "
                 f"mode): use fp8.rollout_recipe=tensorwise")
        self._check_name_matches_recipes()

    def _check_name_matches_recipes(self) -> None:
        """The arm name goes into run names and figure legends: it must say what runs.

        ``bf16`` means both recipes bf16; ``rollout_only`` an FP8 rollout recipe with a bf16
        trainer; a recipe name (``tensorwise``, ``blockwise``, ...) full FP8 with that trainer
        recipe and an FP8 rollout recipe. Any other name is a free label for a custom arm.
        """
        from fp8rl.quant import RECIPES

        name, rollout, trainer = self.name, self.rollout_recipe, self.trainer_recipe
        how = "(the launcher's fp8=<arm> config group sets these together)"
        if name == "fp32":
            _require(rollout == "bf16" and trainer == "bf16" and self.compute_dtype == "fp32",
                     f"fp8.name='fp32' needs no FP8 (fp8.rollout_recipe=bf16, fp8.trainer_recipe=bf16) "
                     f"and fp8.compute_dtype=fp32, got rollout {rollout!r}, trainer {trainer!r}, compute "
                     f"{self.compute_dtype!r} {how}")
            return
        if name in ("bf16", "rollout_only") or name in RECIPES:
            _require(self.compute_dtype == "bf16",
                     f"fp8.name={name!r} computes in BF16 outside FP8 GEMMs; fp8.compute_dtype="
                     f"{self.compute_dtype!r} would run something else under that name: use "
                     f"fp8=fp32 for the fp32 arm, or give a custom arm its own fp8.name")
        if name == "bf16":
            _require(rollout == "bf16" and trainer == "bf16",
                     f"fp8.name='bf16' needs fp8.rollout_recipe=bf16 and fp8.trainer_recipe=bf16, "
                     f"got rollout {rollout!r}, trainer {trainer!r} {how}")
        elif name == "rollout_only":
            _require(trainer == "bf16" and rollout != "bf16",
                     f"fp8.name='rollout_only' needs an FP8 fp8.rollout_recipe and "
                     f"fp8.trainer_recipe=bf16, got rollout {rollout!r}, trainer {trainer!r} {how}")
        elif name in RECIPES:
            _require(trainer == name and rollout != "bf16",
                     f"fp8.name={name!r} names the full-FP8 {name} arm: set "
                     f"fp8.trainer_recipe={name} and an FP8 fp8.rollout_recipe (e.g. "
                     f"fp8.rollout_recipe={'tensorwise' if name == 'tensorwise_delayed' else name}), "
                     f"got rollout {rollout!r}, trainer {trainer!r} {how}")


@dataclass
class ClipConfig:
    """Clip-method arm and its options (``fp8rl.rl.clipping.CLIP_ARMS`` and the controller).

    Attributes:
        arm: ``vanilla`` (vanilla bounds, no IS correction), ``tis`` (vanilla bounds + token
            TIS) or ``calibrated`` (Calibrated Clipping + TIS); ``CLIP_ARMS`` maps the arm to
            (clip method, IS correction).
        tis_cap: TIS truncation C (paper: 2).
        calibration_mode: when the calibrated arm measures and where its bounds apply
            (``fp8rl.rl.calibration.CALIBRATION_MODES``: ``periodic``, ``pooled``,
            ``same_batch``; default ``DEFAULT_CALIBRATION_MODE``, provisional).
        period, ema, window, calibrate_at_start: ``periodic``'s options; setting one to a
            non-default value with another mode raises.
        upper_rule, init_bounds, reference, alpha, p_target, low_min, high_max: the other
            options of ``fp8rl.rl.calibration.CalibratedClipController`` (used by
            ``calibrated`` only; see that class). ``init_bounds`` default [0.6, 1.8] is the
            paper's wide start.
        shadow_diagnostics: on a non-calibrated arm (vanilla, tis), also run the BF16 shadow on
            every step's mini-batches and log which tokens FP8 clips against which BF16 would
            clip (``shadow/*`` agreement metrics) without changing training. The calibrated arm
            logs them on its measured steps anyway.
    """

    arm: str = "vanilla"
    tis_cap: float = 2.0
    calibration_mode: str = DEFAULT_CALIBRATION_MODE
    period: int = PERIODIC_DEFAULTS["period"]
    ema: float = PERIODIC_DEFAULTS["ema"]
    upper_rule: str = "contribution"
    init_bounds: list[float] = field(default_factory=lambda: [0.6, 1.8])
    reference: str = "shadow"
    alpha: float | None = None
    p_target: float | None = None
    low_min: float = 0.5
    high_max: float = 2.0
    calibrate_at_start: bool = PERIODIC_DEFAULTS["calibrate_at_start"]
    window: int = PERIODIC_DEFAULTS["window"]
    shadow_diagnostics: bool = False

    def __post_init__(self) -> None:
        _check_registry("fp8rl.rl.clipping", "CLIP_ARMS", self.arm, "clip.arm")
        _check_registry("fp8rl.rl.calibration", "CALIBRATION_MODES", self.calibration_mode, "clip.calibration_mode")
        _check_registry("fp8rl.rl.calibration", "UPPER_RULES", self.upper_rule, "clip.upper_rule")
        _require(self.tis_cap > 0, f"clip.tis_cap must be > 0 (inf = no truncation), got {self.tis_cap}")
        _require(self.period >= 1, f"clip.period must be >= 1, got {self.period}")
        _require(self.window >= 1, f"clip.window must be >= 1 (calibrations pooled; 1 = none), got {self.window}")
        _require(0 <= self.ema < 1, f"clip.ema is the weight of the previous bound and must be in [0, 1) "
                 f"(0 = no smoothing), got {self.ema}")
        _require(isinstance(self.shadow_diagnostics, bool),
                 f"clip.shadow_diagnostics must be true or false, got {self.shadow_diagnostics!r}")
        from fp8rl.rl.calibration import check_periodic_options

        check_periodic_options(self.calibration_mode, "clip.", period=self.period, ema=self.ema,
                               window=self.window, calibrate_at_start=self.calibrate_at_start)
        b = list(self.init_bounds)
        _require(len(b) == 2 and 0 < b[0] < 1 < b[1],
                 f"clip.init_bounds must be [low, high] with 0 < low < 1 < high, got {b}")

    @property
    def method(self) -> str:
        """The clip method of the arm (``vanilla`` or ``calibrated``)."""
        from fp8rl.rl.clipping import CLIP_ARMS

        return CLIP_ARMS[self.arm].method

    @property
    def is_correction(self) -> str:
        """The train/rollout IS correction of the arm (``none`` or ``tis``)."""
        from fp8rl.rl.clipping import CLIP_ARMS

        return CLIP_ARMS[self.arm].is_correction

    def clipper_options(self) -> dict:
        """Constructor options of the arm's clip method (empty for ``vanilla``)."""
        if self.method != "calibrated":
            return {}
        return {
            "mode": self.calibration_mode, "period": self.period, "ema": self.ema, "upper_rule": self.upper_rule,
            "init_bounds": tuple(self.init_bounds), "reference": self.reference,
            "alpha": self.alpha, "p_target": self.p_target, "low_min": self.low_min,
            "high_max": self.high_max, "calibrate_at_start": self.calibrate_at_start,
            "window": self.window,
        }

    def correction_params(self) -> dict:
        """Parameters of the arm's IS correction (``{"cap": tis_cap}`` for tis)."""
        return {"cap": self.tis_cap} if self.is_correction == "tis" else {}


@dataclass
class LoggingConfig:
    """Live views of a run besides ``metrics.jsonl`` (``fp8rl.runs.live``; not part of the run's
    identity: ``logging`` is in ``fp8rl.runs.identity.DEFAULT_EXCLUDE``).

    Attributes:
        tensorboard: write TensorBoard event files to ``<run-dir>/tensorboard/`` (watch with
            ``tensorboard --logdir runs/``).
        wandb_project: also log to Weights & Biases under this project (``None`` = off; needs
            the ``wandb`` package).
        wandb_entity: the W&B entity (team or user); ``None`` = the account's default.
        wandb_mode: ``online`` or ``offline`` (files only; ``wandb sync`` uploads them later).
    """

    tensorboard: bool = True
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_mode: str = "online"

    def __post_init__(self) -> None:
        _require(self.wandb_mode in ("online", "offline"),
                 f"logging.wandb_mode must be 'online' or 'offline', got {self.wandb_mode!r}")
        if self.wandb_project is not None:
            import importlib.util

            _require(bool(self.wandb_project), "logging.wandb_project must be a non-empty name or null")
            _require(importlib.util.find_spec("wandb") is not None,
                     "logging.wandb_project is set but the wandb package is not installed: "
                     "pip install wandb (or pip install -e '.[wandb]'), or leave logging.wandb_project unset")


@dataclass
class RunConfig:
    """One run: the four axes, seed, schedule, batch sizes, optimiser, eval cadence, outputs.

    Attributes:
        steps: RL steps (one rollout batch each).
        prompts_per_step: prompts per rollout batch (the batch has ``prompts_per_step *
            n_samples_per_prompt`` responses).
        num_mini_batches: optimizer updates per rollout batch (1 = on-policy: ratio == 1).
        logprob_micro_batch: rows per forward when the trainer recomputes old log-probs, in
            rollout order (OpenRLHF's ``--rollout.micro_batch_size``, verl's
            ``log_prob_micro_batch_size``): not the updates' shuffled mini-batches.
        lr, weight_decay, max_grad_norm, adam_betas: AdamW and gradient clipping.
        lr_lm_head, lr_final_norm: learning rates of the LM head and of the final norm's scale
            (``None`` = ``lr``); every other parameter (the body) trains at ``lr``. A learning
            rate of 0 freezes that group (for ablations).
        temperature: rollout sampling temperature (trainer log-probs use the same).
        max_response_len: generation cap in tokens.
        eval_every: evaluate every N steps (and at the end); 0 = only at the end.
        eval_k: samples per eval prompt (avg@k and pass@k); eval_temperature: their temperature.
        eval_greedy: also decode each eval prompt greedily (``eval/<ds>/greedy``). Evaluations are
            paired: every evaluation of a run samples with the same seed.
        checkpoint_every, samples_every: cadence of checkpoints and decoded samples (0 = off).
        max_bad_steps: consecutive skipped (non-finite) steps after which the run FAILS.
        output_dir: the runs root; run_dir: the run directory (``None`` = derived from identity).
        logging: TensorBoard / W&B live views (``LoggingConfig``; not part of the identity).
    """

    #: Whether ``eval_temperature == 0`` (greedy decoding) is a valid value for this backend.
    GREEDY_EVAL_TEMPERATURE: ClassVar[bool] = False


    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    clip: ClipConfig = field(default_factory=ClipConfig)
    seed: int = 0
    steps: int = 50
    prompts_per_step: int = 16
    num_mini_batches: int = 4
    logprob_micro_batch: int = 16
    lr: float = 1e-4
    lr_lm_head: float | None = None
    lr_final_norm: float | None = None
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    temperature: float = 1.0
    max_response_len: int = 48
    eval_every: int = 10
    eval_k: int = 4
    eval_temperature: float = 1.0
    eval_greedy: bool = True
    checkpoint_every: int = 10
    samples_every: int = 10
    max_bad_steps: int = 5
    output_dir: str = "runs"
    run_dir: str | None = None
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Field ranges and cross-field checks; raises ``ValueError`` naming the fix."""
        a = self.algorithm
        _require(isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed <= MAX_SEED,
                 f"seed must be an integer >= 0 and <= {MAX_SEED}, got {self.seed!r}")
        _require(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        _require(self.prompts_per_step >= 1, f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        _require(self.num_mini_batches >= 1, f"num_mini_batches must be >= 1, got {self.num_mini_batches}")
        n_seq = self.prompts_per_step * a.n_samples_per_prompt
        _require(n_seq % self.num_mini_batches == 0,
                 f"the rollout batch ({self.prompts_per_step} prompts x {a.n_samples_per_prompt} "
                 f"samples = {n_seq}) must split evenly into num_mini_batches={self.num_mini_batches}")
        _require(self.lr >= 0 and math.isfinite(self.lr), f"lr must be a number >= 0 (0 = body frozen), got {self.lr}")
        for f in ("lr_lm_head", "lr_final_norm"):
            v = getattr(self, f)
            _require(v is None or (v >= 0 and math.isfinite(v)),
                     f"{f} must be a number >= 0 (0 = frozen) or null (= lr), got {v}")
        _require(self.logprob_micro_batch >= 1, f"logprob_micro_batch must be >= 1, got {self.logprob_micro_batch}")
        _require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        _require(self.max_grad_norm > 0, f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        _require(len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
                 f"adam_betas must be two numbers in [0, 1), got {list(self.adam_betas)}")
        _require(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
        if self.GREEDY_EVAL_TEMPERATURE:  # 0 = greedy decoding (vLLM's convention)
            _require(self.eval_temperature >= 0, f"eval_temperature must be >= 0 (0 = greedy), got "
                     f"{self.eval_temperature}")
        else:
            _require(self.eval_temperature > 0, f"eval_temperature must be > 0 (greedy evaluation is "
                     f"eval_greedy=true), got {self.eval_temperature}")
        _require(self.max_response_len >= 1, f"max_response_len must be >= 1, got {self.max_response_len}")
        for f in ("eval_every", "checkpoint_every", "samples_every"):
            _require(getattr(self, f) >= 0, f"{f} must be >= 0 (0 = off), got {getattr(self, f)}")
        _require(self.eval_k >= 1, f"eval_k must be >= 1, got {self.eval_k}")
        _require(self.max_bad_steps >= 1, f"max_bad_steps must be >= 1, got {self.max_bad_steps}")
        # every algorithm here uses a group baseline
        _require(a.n_samples_per_prompt > 1,
                 f"algorithm {a.name!r} with the {a.advantage_estimator!r} estimator needs "
                 f"n_samples_per_prompt > 1 (a group of one has zero advantage: training would "
                 f"be a silent no-op); got {a.n_samples_per_prompt}")
        _require(not a.dynamic_sampling or a.n_samples_per_prompt > 1,
                 "algorithm.dynamic_sampling needs n_samples_per_prompt > 1")
        _require(a.overlong_buffer < self.max_response_len,
                 f"algorithm.overlong_buffer ({a.overlong_buffer}) must be smaller than "
                 f"max_response_len ({self.max_response_len})")
        # build the clip method once: its constructor checks the calibration options against
        # the algorithm's epsilons (e.g. init_bounds inside the clamps)
        from fp8rl.rl.clipping import make_clipper

        try:
            make_clipper(self.clip.method, a.eps_low, a.eps_high, **self.clip.clipper_options())
        except (TypeError, ValueError) as e:
            raise ValueError(f"clip options do not fit clip.arm={self.clip.arm!r}: {e}") from e


#: Config keys left out of the run-identity hash besides ``fp8rl.runs.identity.DEFAULT_EXCLUDE``:
#: where outputs go and how often checkpoints are written do not change what a run computes.
IDENTITY_EXCLUDE: tuple[str, ...] = ("output_dir", "run_dir", "checkpoint_every", "mini.cache_dir")
