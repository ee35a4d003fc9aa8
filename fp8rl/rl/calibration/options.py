"""The controller's constructor checks: every option's type and range, and their combinations.

Raises ``ValueError`` / ``TypeError`` saying what is wrong and how to fix it (the messages of
``CalibratedClipController``'s options); returns the normalised values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fp8rl.rl.calibration.estimators import REFERENCES, UPPER_RULES, Bounds
from fp8rl.rl.calibration.schedule import CALIBRATION_MODES, check_periodic_options

__all__ = ["check_options"]


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def check_options(
    eps_low: float,
    eps_high: float,
    *,
    mode: str,
    period: int,
    ema: float,
    upper_rule: str,
    init_bounds: Bounds | Sequence[float] | None,
    reference: str,
    alpha: float | None,
    p_target: float | None,
    low_min: float,
    high_max: float,
    calibrate_at_start: bool,
    window: int,
) -> dict[str, Any]:
    """Check the controller's options (see ``CalibratedClipController``); returns
    ``{eps_low, eps_high, ema, alpha, p_target, low_min, high_max, init, vanilla}`` as floats
    and ``Bounds``."""
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a string, one of {', '.join(CALIBRATION_MODES)}; got {mode!r}")
    CALIBRATION_MODES.check(mode)
    eps_low = _finite("eps_low", eps_low)
    eps_high = _finite("eps_high", eps_high)
    if not 0.0 < eps_low < 1.0:
        raise ValueError(f"eps_low must lie in (0, 1) so that 1 - eps_low is a ratio in (0, 1); got {eps_low}")
    if not eps_high > 0.0:
        raise ValueError(f"eps_high must be > 0; got {eps_high}")
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"period must be an integer >= 1 (steps between calibrations); got {period!r}")
    ema = _finite("ema", ema)
    if not 0.0 <= ema < 1.0:
        raise ValueError(f"ema is the weight of the previous bound and must lie in [0, 1) (0 = no smoothing); got {ema}")
    UPPER_RULES.check(upper_rule)
    if reference not in REFERENCES:
        raise ValueError(f"unknown reference {reference!r}; valid values are: {', '.join(REFERENCES)}")
    low_min = _finite("low_min", low_min)
    high_max = _finite("high_max", high_max)
    if not 0.0 < low_min < 1.0:
        raise ValueError(f"low_min must lie in (0, 1) (clamp of the lower bound); got {low_min}")
    if not high_max > 1.0:
        raise ValueError(f"high_max must be > 1 (clamp of the upper bound); got {high_max}")
    vanilla = Bounds.vanilla(eps_low, eps_high)
    if not (low_min <= vanilla.low and vanilla.high <= high_max):
        raise ValueError(
            f"the vanilla bounds ({vanilla.low}, {vanilla.high}) must lie inside the clamps "
            f"[low_min={low_min}, 1) and (1, high_max={high_max}]; widen the clamps"
        )
    if reference == "static":
        if alpha is None:
            raise ValueError(
                "reference='static' needs alpha (the BF16 baseline's lower-clip fraction, "
                "e.g. its logged actor/clipfrac_neg_low)"
            )
        alpha = _finite("alpha", alpha)
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha must lie in [0, 1); got {alpha}")
        if upper_rule == "contribution":
            if p_target is None:
                raise ValueError(
                    "reference='static' with upper_rule='contribution' needs p_target (the BF16 "
                    "baseline's positive/negative contribution ratio); or use upper_rule="
                    "'proportional' or 'fixed'"
                )
            p_target = _finite("p_target", p_target)
            if not p_target > 0.0:
                raise ValueError(f"p_target must be > 0; got {p_target}")
        elif p_target is not None:
            raise ValueError("p_target is only used by upper_rule='contribution'")
    else:
        if alpha is not None or p_target is not None:
            raise ValueError(
                "alpha / p_target are only used with reference='static' (the shadow reference "
                "measures them on each calibration step)"
            )
    if init_bounds is None:
        init = vanilla
    elif isinstance(init_bounds, Bounds):
        init = init_bounds
    else:
        try:
            lo, hi = init_bounds
        except (TypeError, ValueError) as e:
            raise ValueError(f"init_bounds must be Bounds or a (low, high) pair; got {init_bounds!r}") from e
        init = Bounds(lo, hi)
    if not (low_min <= init.low and init.high <= high_max):
        raise ValueError(
            f"init_bounds ({init.low}, {init.high}) must lie inside the clamps "
            f"[low_min={low_min}, 1) and (1, high_max={high_max}]"
        )
    if not isinstance(calibrate_at_start, bool):
        raise TypeError(f"calibrate_at_start must be a bool; got {calibrate_at_start!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1 (calibrations pooled, 1 = none); got {window!r}")
    check_periodic_options(mode, period=period, ema=ema, window=window, calibrate_at_start=calibrate_at_start)

    return {"eps_low": eps_low, "eps_high": eps_high, "ema": ema, "alpha": alpha, "p_target": p_target,
            "low_min": low_min, "high_max": high_max, "init": init, "vanilla": vanilla}
