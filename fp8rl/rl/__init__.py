"""The RL objective: advantages, the PPO clip loss, IS correction, clip methods, Calibrated Clipping."""

from fp8rl.rl.advantages import ADVANTAGE_ESTIMATORS, broadcast_to_tokens, dr_grpo, grpo
from fp8rl.rl.aggregation import LOSS_AGGREGATIONS, aggregate
from fp8rl.rl.calibration import (
    UPPER_RULES,
    Bounds,
    CalibratedClipController,
    Calibration,
    DegenerateCalibration,
    calibrate_bounds,
)
from fp8rl.rl.clipping import (
    CLIP_ARMS,
    CLIP_METHODS,
    ClipArm,
    ClipMethod,
    VanillaClip,
    make_clipper,
)
from fp8rl.rl.correction import (
    IS_CORRECTIONS,
    corrected_ppo_token_loss,
    is_weights,
    make_correction,
)
from fp8rl.rl.dapo import GroupFilter, dynamic_sampling_filter, overlong_penalty
from fp8rl.rl.diagnostics import (
    clip_counts,
    clip_table,
    fractions_from_counts,
    masked_mean,
    masked_quantiles,
    masked_sum,
    ratio_quantiles,
    token_entropy,
)
from fp8rl.rl.policy_loss import check_bounds, ppo_token_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CLIP_ARMS",
    "CLIP_METHODS",
    "IS_CORRECTIONS",
    "LOSS_AGGREGATIONS",
    "UPPER_RULES",
    "Bounds",
    "CalibratedClipController",
    "Calibration",
    "ClipArm",
    "ClipMethod",
    "DegenerateCalibration",
    "GroupFilter",
    "VanillaClip",
    "aggregate",
    "broadcast_to_tokens",
    "calibrate_bounds",
    "check_bounds",
    "clip_counts",
    "clip_table",
    "corrected_ppo_token_loss",
    "dr_grpo",
    "dynamic_sampling_filter",
    "fractions_from_counts",
    "grpo",
    "is_weights",
    "make_clipper",
    "make_correction",
    "masked_mean",
    "masked_quantiles",
    "masked_sum",
    "overlong_penalty",
    "ppo_token_loss",
    "ratio_quantiles",
    "token_entropy",
]
