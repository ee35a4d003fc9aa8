"""``RunConfig`` -- one run: the four axis configs, seed, schedule, batch sizes, optimiser, eval
cadence, outputs, live logging -- and the cross-field checks; ``IDENTITY_EXCLUDE``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from fp8rl.config.algorithm import AlgorithmConfig
from fp8rl.config.clip import ClipConfig
from fp8rl.config.fp8 import Fp8Config
from fp8rl.config.model import ModelConfig
from fp8rl.config.validation import _require

#: Largest ``seed`` (seeds name run directories and seed torch/numpy generators: 32 bits).
MAX_SEED = 2**32 - 1
#: Steps a run may take: the paper's runs take hundreds; a typo's 10^20 would be accepted and run
#: "for ever" (an ETA of quadrillions of hours), so the bound names what the value would cost.
MAX_STEPS = 1_000_000


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

    #: The backend's own config keys left out of the run identity, besides :data:`IDENTITY_EXCLUDE`.
    BACKEND_IDENTITY_EXCLUDE: ClassVar[tuple[str, ...]] = ()
    #: Calibration mode -> the values its ``clip.period`` / ``clip.window`` take when left None
    #: (``ClipConfig.settle``); a mode not named here takes the options' defaults (the paper's
    #: ``periodic``: every 20 steps, no pooling).
    CALIBRATION_PRESETS: ClassVar[dict[str, dict[str, int]]] = {}

    def __post_init__(self) -> None:
        self.clip.settle(self.CALIBRATION_PRESETS)
        self.validate()

    def resolve_run_dir(self) -> Path:
        """The run directory: ``run_dir``, or ``<output_dir>/<run name>-<hash8>`` from the run
        identity (``fp8rl.runs.identity``: the config's hash minus ``DEFAULT_EXCLUDE``,
        :data:`IDENTITY_EXCLUDE` and ``BACKEND_IDENTITY_EXCLUDE``, options at their
        :data:`IDENTITY_LATE_DEFAULTS` dropped)."""
        import dataclasses

        from fp8rl.runs.identity import (
            DEFAULT_EXCLUDE,
            config_hash,
            drop_defaults,
            run_dir_name,
            run_name,
        )

        if self.run_dir:
            return Path(self.run_dir)
        name = run_name(self.algorithm.name, self.model.slot, self.fp8.name, self.clip.arm, self.seed)
        h = config_hash(drop_defaults(dataclasses.asdict(self), IDENTITY_LATE_DEFAULTS),
                        exclude=(*DEFAULT_EXCLUDE, *IDENTITY_EXCLUDE, *self.BACKEND_IDENTITY_EXCLUDE))
        return Path(self.output_dir) / run_dir_name(name, h)

    def validate(self) -> None:
        """Field ranges and cross-field checks; raises ``ValueError`` naming the fix."""
        a = self.algorithm
        _require(isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed <= MAX_SEED,
                 f"seed must be an integer >= 0 and <= {MAX_SEED}, got {self.seed!r}")
        _require(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        _require(self.steps <= MAX_STEPS,
                 f"steps={self.steps} is more than a run can take: it would sample {self.steps * self.prompts_per_step * a.n_samples_per_prompt:.3g} "
                 f"responses ({self.prompts_per_step} prompts x {a.n_samples_per_prompt} samples per step); "
                 f"give 1 <= steps <= {MAX_STEPS}")
        _require(isinstance(self.output_dir, str) and self.output_dir.strip() != "",
                 f"output_dir is empty ({self.output_dir!r}): give the runs root (default runs); an empty "
                 "path would write into the current directory")
        _require(self.prompts_per_step >= 1, f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        _require(self.num_mini_batches >= 1, f"num_mini_batches must be >= 1, got {self.num_mini_batches}")
        n_seq = self.prompts_per_step * a.n_samples_per_prompt
        _require(n_seq % self.num_mini_batches == 0,
                 f"the rollout batch ({self.prompts_per_step} prompts x {a.n_samples_per_prompt} "
                 f"samples = {n_seq}) must split evenly into num_mini_batches={self.num_mini_batches}")
        share = self.clip.sample_fraction
        _require(share is None or share * n_seq >= 1,
                 f"clip.sample_fraction={share!r} measures {share * n_seq if share else 0:.3g} of the {n_seq} sequences "
                 f"of a step ({self.prompts_per_step} prompts x {a.n_samples_per_prompt} samples): fewer than one "
                 f"per calibration. Give clip.sample_fraction >= {1 / n_seq:.6g} (1/{n_seq}: one sequence), or "
                 f"null for the share rule")
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

#: Options added after published runs were made, with their defaults: at the default they are
#: left out of the run-identity hash and of a resume's config comparison
#: (``fp8rl.runs.identity.drop_defaults``), so those runs keep their directories.
IDENTITY_LATE_DEFAULTS: dict[str, object] = {
    "clip.sample_fraction": None,
    "clip.sample_min": 1.0 / 64,
    "clip.sample_max": 0.125,
    "clip.sample_pool": 8,
    "clip.sample_target": 5.0,
    "clip.score_centering_topk": 8,
    "clip.window_target": 3.0,
    "clip.window_max": 8,
    "clip.window_share": 1.0,
    "clip.holdout_share": 0.0,
    "mini.sft_slip_rate": 0.0,
}
