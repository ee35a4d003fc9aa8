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

- :mod:`~fp8rl.rl.calibration.controller`: ``CalibratedClipController``, the stateful part,
  split by concern: ``options`` (``CalibrationOptions``, every option in one frozen object
  validated once), ``schedule`` (the calibration modes ``CALIBRATION_MODES``: periodic, pooled,
  same_batch, sampled; which steps and sequences measure, which tokens the bounds rule),
  ``sampling`` (sampled's draw and share rule), ``plan`` (``StepPlan`` / ``WindowPlan``: the one
  schedule both backends follow), ``state`` (bounds, EMA, window, checkpoints), ``metrics`` (its
  metrics and the agreement tally);
- :mod:`~fp8rl.rl.calibration.agreement`: which tokens FP8 clips against what BF16 would clip;
- :mod:`~fp8rl.rl.calibration.heldout`: the calibration's error on tokens it did not see (out
  of sample; cross-fitted for same_batch).
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
from fp8rl.rl.calibration.metrics import AgreementTally
from fp8rl.rl.calibration.options import CalibrationOptions, ModeOptionError
from fp8rl.rl.calibration.plan import StepPlan, WindowPlan
from fp8rl.rl.calibration.schedule import (
    CALIBRATION_MODES,
    DEFAULT_CALIBRATION_MODE,
    MODE_OPTION_DEFAULTS,
    PERIODIC_DEFAULTS,
)

__all__ = [
    "CALIBRATION_MODES",
    "DEFAULT_CALIBRATION_MODE",
    "LOWER_ESTIMATORS",
    "MODE_OPTION_DEFAULTS",
    "PERIODIC_DEFAULTS",
    "REFERENCES",
    "UPPER_RULES",
    "AgreementTally",
    "Bounds",
    "CalibratedClipController",
    "Calibration",
    "CalibrationOptions",
    "DegenerateCalibration",
    "ModeOptionError",
    "StepPlan",
    "WindowPlan",
    "calibrate_bounds",
    "solve_upper_contribution",
]
