"""When Calibrated Clipping measures and where its bounds apply: the calibration modes.

The paper recalibrates every K steps and gives no more detail; the modes (registry
``CALIBRATION_MODES``, config ``clip.calibration_mode``) are the choices we can make:

- ``periodic``: step s is a calibration step iff ``s % period == 0`` (step 0 only if
  ``calibrate_at_start``). Every mini-batch of a calibration step (the first included) is
  measured: its FP8 ratios (the loss's) and the BF16 shadow ratios of the same tokens. After
  the step's updates the controller gets the measured tokens pooled (``update``), smooths the
  bounds with ``ema`` and pools ``window`` calibrations; the new bounds rule from the next step.
  Options ``period``, ``ema``, ``window``, ``calibrate_at_start`` belong to this mode only.
- ``pooled``: ``periodic`` with period 1, no EMA, window 1: every step is a calibration step,
  its mini-batches' tokens pooled, the raw bounds rule from the next step.
- ``same_batch``: every mini-batch of every step gets bounds from its own tokens, measured
  before its loss (on the weights before its update): ``update_batch`` returns the raw bounds
  and that mini-batch's loss uses them. One extra BF16 forward per mini-batch, no lag.

Cost (one shadow forward = a no-grad forward of the mini-batch with FP8 off): ``periodic`` pays
it on 1/period of the steps, ``pooled`` and ``same_batch`` on every step; the BF16 old
log-probs (one more no-grad forward of the whole batch) are paid once per measured step.

``DEFAULT_CALIBRATION_MODE`` is the one place the default lives (``ClipConfig`` and the
controller read it); it is provisional until a seeds sweep over the modes settles it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fp8rl.registry import Registry

__all__ = [
    "CALIBRATION_MODES",
    "DEFAULT_CALIBRATION_MODE",
    "PERIODIC_DEFAULTS",
    "CalibrationMode",
    "check_periodic_options",
    "is_calibration_step",
]


@dataclass(frozen=True)
class CalibrationMode:
    """One calibration mode.

    Attributes:
        every_step: every step is a calibration step (else every ``period`` steps).
        per_batch: each mini-batch's bounds come from its own tokens (``update_batch``);
            else the step's measured tokens are pooled after the step (``update``).
        summary: one line for docs and error messages.
    """

    every_step: bool
    per_batch: bool
    summary: str


CALIBRATION_MODES: Registry[CalibrationMode] = Registry("calibration mode")
CALIBRATION_MODES.add("periodic", CalibrationMode(
    every_step=False, per_batch=False,
    summary="every `period` steps, the step's mini-batches pooled; bounds (EMA, window) rule from the next step"))
CALIBRATION_MODES.add("pooled", CalibrationMode(
    every_step=True, per_batch=False,
    summary="every step, its mini-batches pooled; raw bounds rule from the next step"))
CALIBRATION_MODES.add("same_batch", CalibrationMode(
    every_step=True, per_batch=True,
    summary="every mini-batch, bounds from its own tokens, used by its own loss"))

#: The default of ``clip.calibration_mode`` and of the controller (provisional).
DEFAULT_CALIBRATION_MODE = "same_batch"

#: The options only ``periodic`` reads, with their defaults (the controller's and ClipConfig's).
PERIODIC_DEFAULTS: dict[str, Any] = {"period": 20, "ema": 0.5, "window": 1, "calibrate_at_start": True}


def check_periodic_options(mode: str, prefix: str = "", **options: Any) -> None:
    """Raise ``ValueError`` if ``mode`` is not ``periodic`` and an option of ``periodic``
    (``PERIODIC_DEFAULTS``) is set to a non-default value; ``prefix`` names the config
    section in the message (``"clip."``)."""
    CALIBRATION_MODES.check(mode)
    unknown = sorted(set(options) - set(PERIODIC_DEFAULTS))
    if unknown:
        raise TypeError(f"not options of the periodic mode: {unknown}")
    if mode == "periodic":
        return
    bad = {k: v for k, v in options.items() if v != PERIODIC_DEFAULTS[k]}
    if bad:
        got = ", ".join(f"{prefix}{k}={v!r}" for k, v in bad.items())
        dflt = ", ".join(f"{prefix}{k}={PERIODIC_DEFAULTS[k]!r}" for k in bad)
        raise ValueError(
            f"{got}: only {prefix}calibration_mode=periodic uses {', '.join(prefix + k for k in bad)}; "
            f"{prefix}calibration_mode={mode!r} ({CALIBRATION_MODES[mode].summary}) would ignore "
            f"{'it' if len(bad) == 1 else 'them'}. Set {prefix}calibration_mode=periodic, or leave "
            f"{'it' if len(bad) == 1 else 'them'} at the default ({dflt})"
        )


def is_calibration_step(mode: str, step: int, *, period: int, calibrate_at_start: bool) -> bool:
    """Whether ``step`` (counted from 0) measures calibration data under ``mode``."""
    if CALIBRATION_MODES[mode].every_step:
        return True
    return step % period == 0 and (step > 0 or calibrate_at_start)


def resolve_lower_estimator(mode: str, lower_estimator: str | None) -> str:
    """The lower-bound estimator a controller in ``mode`` uses: ``lower_estimator`` when given
    (checked against ``LOWER_ESTIMATORS``), else the mode's own: ``in_sample`` for ``same_batch``
    (its bounds rule the very tokens they are computed from, where clipping exactly the BF16
    shadow's count is exact) and ``unbiased`` for ``periodic`` / ``pooled`` (their bounds rule
    later tokens; ``fp8rl.rl.calibration.lower`` derives why the in-sample bound over-clips
    those)."""
    from fp8rl.rl.calibration.lower import LOWER_ESTIMATORS

    if lower_estimator is None:
        return "in_sample" if CALIBRATION_MODES[mode].per_batch else "unbiased"
    LOWER_ESTIMATORS.check(lower_estimator)
    return lower_estimator
