"""Calibrated Clipping: PPO clip bounds for FP8 ratios, aligned with the BF16 ratio distribution.

The paper's fix for the FP8 entropy surge (arXiv 2609.22870, Sec. "Calibrated Clipping"),
in two parts:

- :mod:`~fp8rl.rl.calibration.estimators`: pure functions: alpha from the BF16 shadow, the
  lower bound as the alpha-quantile of the FP8 ratios over A<0 tokens, the upper rules
  (``UPPER_RULES``: contribution, proportional, fixed), ``calibrate_bounds``; the method and
  every estimation choice are in its docstring;
- :mod:`~fp8rl.rl.calibration.controller`: ``CalibratedClipController``, the stateful part,
  split by concern: ``schedule`` (the calibration modes ``CALIBRATION_MODES``: periodic,
  pooled, same_batch; which steps measure), ``state`` (bounds, EMA, window, checkpoints),
  ``metrics`` (its metrics and the agreement tally), ``options`` (constructor checks);
- :mod:`~fp8rl.rl.calibration.agreement`: which tokens FP8 clips against what BF16 would clip.
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
from fp8rl.rl.calibration.metrics import AgreementTally
from fp8rl.rl.calibration.schedule import (
    CALIBRATION_MODES,
    DEFAULT_CALIBRATION_MODE,
    PERIODIC_DEFAULTS,
    check_periodic_options,
)

__all__ = [
    "CALIBRATION_MODES",
    "DEFAULT_CALIBRATION_MODE",
    "PERIODIC_DEFAULTS",
    "REFERENCES",
    "UPPER_RULES",
    "AgreementTally",
    "Bounds",
    "CalibratedClipController",
    "Calibration",
    "DegenerateCalibration",
    "calibrate_bounds",
    "check_periodic_options",
    "solve_upper_contribution",
]
