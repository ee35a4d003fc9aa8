"""Calibrated Clipping: PPO clip bounds for FP8 ratios, aligned with the BF16 ratio distribution.

The paper's fix for the FP8 entropy surge (arXiv 2609.22870, Sec. "Calibrated Clipping"):

- :mod:`~fp8rl.rl.calibration.estimators`: ``calibrate_bounds``, one calibration as a pure
  function (input checks, alpha from the BF16 shadow, then the lower and upper bound); the
  method and the choices shared by its parts are in its docstring. Its parts:

  - :mod:`~fp8rl.rl.calibration.bounds`: ``Bounds``, ``Calibration``, ``DegenerateCalibration``;
  - :mod:`~fp8rl.rl.calibration.order_stats`: dtype-exact order statistics and projections;
  - :mod:`~fp8rl.rl.calibration.lower`: the lower bound (``LOWER_ESTIMATORS``: ``unbiased``,
    matching BF16's clip fraction on *new* tokens in expectation, derived there; ``in_sample``,
    matching it exactly on the calibration tokens);
  - :mod:`~fp8rl.rl.calibration.upper`: the upper rules (``UPPER_RULES``: contribution,
    proportional, fixed) and the contribution solver;

- :mod:`~fp8rl.rl.calibration.controller`: ``CalibratedClipController``, the stateful part:
  schedule, pooling window, smoothing, degenerate-input guard, metrics, checkpoints;
- :mod:`~fp8rl.rl.calibration.agreement`: which A<0 / A>0 tokens FP8 clips against BF16.
"""

from fp8rl.rl.calibration.controller import CalibratedClipController
from fp8rl.rl.calibration.estimators import (
    LOWER_ESTIMATORS,
    REFERENCES,
    UPPER_RULES,
    Bounds,
    Calibration,
    DegenerateCalibration,
    calibrate_bounds,
    solve_upper_contribution,
)

__all__ = [
    "LOWER_ESTIMATORS",
    "REFERENCES",
    "UPPER_RULES",
    "Bounds",
    "CalibratedClipController",
    "Calibration",
    "DegenerateCalibration",
    "calibrate_bounds",
    "solve_upper_contribution",
]
