"""When Calibrated Clipping measures and which tokens its bounds rule: the calibration modes.

The paper recalibrates every K steps and gives no more detail; the modes (registry
``CALIBRATION_MODES``, config ``clip.calibration_mode``) are the choices we can make. Words: a
*step* is one rollout batch (one ``ppo_train`` call at paper scale); a *window* is one optimizer
step inside it (a mini-batch at mini scale; ``accumulated_gradient`` micro-batches on every DP
rank at paper scale); *measured* tokens feed an estimate (their FP8 ratio and the BF16 shadow
ratio of the same tokens on the same weights).

- ``periodic``: step s is a calibration step iff ``s % period == 0`` (step 0 only if
  ``calibrate_at_start``). Every sequence of a calibration step is measured; after the step
  the controller pools them (``update``), smooths the bounds with ``ema`` and pools ``window``
  calibrations; the new bounds rule from the next step.
- ``pooled``: ``periodic`` with period 1, no EMA, window 1.
- ``windowed`` (issue 46): ``pooled`` on a seeded share ``window_share`` of each step's sequences
  with A != 0 (``sampling.draw_subset``; 1 = all), whose estimate pools the measured tokens of the
  last W steps, W chosen at each step as the fewest recent steps whose expected BF16-clipped count
  alpha n reaches ``window_target`` (alpha: the BF16 clip rate over the last ``window_max``
  steps' tokens; at most ``window_max`` steps). Why a target on alpha n: with ``alpha n`` expected
  BF16 events, the chance that a calibration sees none (k = 0, where the estimate has nothing to
  match) is about exp(-alpha n); ``window_target`` = 3 keeps it near 5% (ln 20 = 3.0), where a
  mini-batch at mini scale (alpha n ~ 0.2) sees none 80% of the time.
- ``same_batch``: every window's bounds come from all its own tokens, measured before its loss
  (on the weights before its update), and rule those same tokens. In-sample by construction:
  its FP8 clip count on the tokens it rules equals their BF16 shadow count (in_sample lower
  estimator); nothing it trains on is out of sample.
- ``sampled``: every window measures a seeded random subset of the step's sequences with A != 0
  (``sampling``: the share, the draw, pooling with the last few windows); the subset's FP8
  ratios come from its own loss forward, which runs first under the bounds in force (the last
  window's), and the estimate from the subset (``unbiased`` lower bound) rules the rest of the
  window: every token is ruled by bounds it did not feed (out of sample). The BF16 shadow runs
  on the subset only.

What a mode is, for the backends (``CalibrationMode``): ``every_step``, ``in_window`` (bounds
estimated per window from its measured tokens, else after the step), ``rules_measured`` (an
in-window estimate also rules the tokens it was estimated from: their FP8 ratios are needed
before their loss, which costs the paper-scale backend an FP8 pre-pass), ``subset`` (a subset of
the sequences is measured). Both backends drive every mode through the same plan
(``plan.StepPlan`` / ``plan.WindowPlan``) and read these flags, never a mode's name.

Cost (one shadow forward = a no-grad forward with FP8 off): ``periodic`` pays 2 (BF16 old and
current log-probs) on 1/period of the steps, ``pooled`` 2 every step, ``windowed`` 2 on its
share of every step's sequences, ``same_batch`` 2 every step
plus, at paper scale, its FP8 pre-pass, ``sampled`` 2 on its share of the sequences;
``fp8rl.rl.calibration.cost`` prices them at the paper's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fp8rl.registry import Registry

__all__ = [
    "CALIBRATION_MODES",
    "DEFAULT_CALIBRATION_MODE",
    "MODE_OPTIONS",
    "MODE_OPTION_DEFAULTS",
    "PERIODIC_DEFAULTS",
    "CalibrationMode",
    "is_calibration_step",
    "resolve_lower_estimator",
]


@dataclass(frozen=True)
class CalibrationMode:
    """One calibration mode (see the module docstring for the words).

    Attributes:
        every_step: every step measures (else every ``period`` steps).
        in_window: each window's bounds come from its own measured tokens (pooled with earlier
            windows' where the mode pools); else the step's measured tokens are pooled after the
            step and rule from the next step.
        rules_measured: (in_window) the window's bounds also rule the tokens they come from;
            False: the measured tokens' own loss runs first, under the bounds in force before.
        subset: a subset of the step's sequences is measured (else all of a measured step's).
        lower_estimator: the lower estimator when ``lower_estimator`` is not set: ``in_sample``
            where the bounds rule the tokens they come from, ``unbiased`` where they rule new ones.
        summary: one line for docs and error messages.
    """

    every_step: bool
    in_window: bool
    rules_measured: bool
    subset: bool
    lower_estimator: str
    summary: str


CALIBRATION_MODES: Registry[CalibrationMode] = Registry("calibration mode")
CALIBRATION_MODES.add("periodic", CalibrationMode(
    every_step=False, in_window=False, rules_measured=False, subset=False, lower_estimator="unbiased",
    summary="every `period` steps, the step's mini-batches pooled; bounds (EMA, window) rule from the next step"))
CALIBRATION_MODES.add("pooled", CalibrationMode(
    every_step=True, in_window=False, rules_measured=False, subset=False, lower_estimator="unbiased",
    summary="every step, its mini-batches pooled; raw bounds rule from the next step"))
CALIBRATION_MODES.add("windowed", CalibrationMode(
    every_step=True, in_window=False, rules_measured=False, subset=True, lower_estimator="unbiased",
    summary="every step, pooled with the fewest recent steps that reach alpha n >= window_target; "
            "raw bounds rule from the next step"))
CALIBRATION_MODES.add("same_batch", CalibrationMode(
    every_step=True, in_window=True, rules_measured=True, subset=False, lower_estimator="in_sample",
    summary="every mini-batch, bounds from its own tokens, used by its own loss"))
CALIBRATION_MODES.add("sampled", CalibrationMode(
    every_step=True, in_window=True, rules_measured=False, subset=True, lower_estimator="unbiased",
    summary="every mini-batch, bounds from a seeded subset of sequences rule the rest (out of sample)"))

#: The default of ``clip.calibration_mode`` and of the controller (issue 46's rule chose it: the cheapest
#: mode, as none met its held-out criteria; docs/mini.md "Calibration modes").
DEFAULT_CALIBRATION_MODE = "periodic"

#: Options that only one mode reads, with their defaults (the controller's and ClipConfig's).
MODE_OPTION_DEFAULTS: dict[str, Any] = {
    "period": 20, "ema": 0.5, "window": 1, "calibrate_at_start": True,
    "sample_fraction": None, "sample_min": 1.0 / 64, "sample_max": 0.125, "sample_pool": 8, "sample_target": 5.0,
    "window_target": 3.0, "window_max": 8, "window_share": 1.0,
}
#: Which mode reads which of them.
MODE_OPTIONS: dict[str, tuple[str, ...]] = {
    "periodic": ("period", "ema", "window", "calibrate_at_start"),
    "pooled": (),
    "windowed": ("window_target", "window_max", "window_share"),
    "same_batch": (),
    "sampled": ("sample_fraction", "sample_min", "sample_max", "sample_pool", "sample_target"),
}
#: ``periodic``'s options and defaults (ClipConfig's field defaults read them).
PERIODIC_DEFAULTS: dict[str, Any] = {k: MODE_OPTION_DEFAULTS[k] for k in MODE_OPTIONS["periodic"]}


def resolve_lower_estimator(mode: str, lower_estimator: str | None) -> str:
    """The lower estimator a controller in ``mode`` uses: ``lower_estimator`` when given (checked
    against ``LOWER_ESTIMATORS``), else the mode's own (``CalibrationMode.lower_estimator``)."""
    from fp8rl.rl.calibration.lower import LOWER_ESTIMATORS

    if lower_estimator is None:
        return CALIBRATION_MODES[mode].lower_estimator
    LOWER_ESTIMATORS.check(lower_estimator)
    return lower_estimator


def is_calibration_step(mode: str, step: int, *, period: int, calibrate_at_start: bool) -> bool:
    """Whether ``step`` (counted from 0) measures calibration data under ``mode``."""
    if CALIBRATION_MODES[mode].every_step:
        return True
    return step % period == 0 and (step > 0 or calibrate_at_start)
