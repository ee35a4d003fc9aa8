"""``algorithm:`` -- the RL algorithm (GRPO, DAPO, Dr. GRPO) and its PPO / DAPO options."""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl.config.validation import _check_registry, _require

ALGORITHMS = ("grpo", "dapo", "dr_grpo")


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
