"""Calibrated Clipping: PPO clip bounds for FP8 ratios, aligned with the BF16 ratio distribution.

The paper's fix for the FP8 entropy surge (arXiv 2609.22870, Sec. "Calibrated Clipping"),
in two parts:

- :mod:`~fp8rl.rl.calibration.estimators`: pure functions: alpha from the BF16 shadow, the
  lower bound as the alpha-quantile of the FP8 ratios over A<0 tokens, the upper rules
  (``UPPER_RULES``: contribution, proportional, fixed), ``calibrate_bounds``; the method and
  every estimation choice are in its docstring;
- :mod:`~fp8rl.rl.calibration.controller`: ``CalibratedClipController``, the stateful part:
  schedule, pooling window, smoothing, degenerate-input guard, metrics, checkpoints.
"""

from fp8rl.rl.calibration.controller import CalibratedClipController
from fp8rl.rl.calibration.estimators import (
    REFERENCES,
    UPPER_RULES,
    Bounds,
    Calibration,
    DegenerateCalibration,
    calibrate_bounds,
    solve_upper_contribution,
)

__all__ = [
    "REFERENCES",
    "UPPER_RULES",
    "Bounds",
    "CalibratedClipController",
    "Calibration",
    "DegenerateCalibration",
    "calibrate_bounds",
    "solve_upper_contribution",
]
