"""Calibrated Clipping, the result types: ``Bounds``, ``Calibration``, ``DegenerateCalibration``.

Kept apart from the estimation (``estimators.py``, ``lower.py``, ``upper.py``) so that every
estimation module can use them without importing another; ``estimators`` re-exports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["REFERENCES", "Bounds", "Calibration", "DegenerateCalibration"]

#: Where alpha (the BF16 clip fraction to match) comes from: the BF16 shadow pass on the same
#: tokens, or a constant from a BF16 baseline.
REFERENCES: tuple[str, ...] = ("shadow", "static")


@dataclass(frozen=True)
class Bounds:
    """A PPO clip-bound pair as ratios: tokens with A<0 and r < low, or A>0 and r > high, are clipped.

    Validates ``0 < low < 1 < high`` with both finite.
    """

    low: float
    high: float

    def __post_init__(self) -> None:
        try:
            low, high = float(self.low), float(self.high)
        except (TypeError, ValueError) as e:
            raise TypeError(f"Bounds(low, high) must be numbers, got {self.low!r}, {self.high!r}") from e
        if not (math.isfinite(low) and math.isfinite(high)):
            raise ValueError(f"Bounds must be finite, got low={low}, high={high}")
        if not 0.0 < low < 1.0 < high:
            raise ValueError(f"Bounds need 0 < low < 1 < high, got low={low}, high={high}")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)

    @classmethod
    def vanilla(cls, eps_low: float, eps_high: float) -> Bounds:
        """The PPO/DAPO bounds ``(1 - eps_low, 1 + eps_high)``."""
        return cls(1.0 - eps_low, 1.0 + eps_high)

    def as_tuple(self) -> tuple[float, float]:
        return (self.low, self.high)


class DegenerateCalibration(Exception):
    """The calibration input carries no usable information; the controller keeps its bounds."""


@dataclass(frozen=True)
class Calibration:
    """The result of one calibration, before smoothing (``low``/``high`` are clamped).

    ``alpha``: target fraction of A<0 tokens below L (for new tokens with the ``unbiased``
    lower estimator, for these tokens with ``in_sample``); ``alpha_achieved``: fraction of
    *these* A<0 FP8 ratios below ``low`` (in-sample; with ``unbiased`` it differs from alpha
    by design, see ``lower.py``); ``p_target``/``p_achieved``: the contribution balance (NaN
    for the other upper rules); ``n_pos``: A>0 tokens read (-1 when the rule reads none);
    ``shadow_*``: BF16 shadow measurements (NaN for ``static``); ``k``: the A<0 tokens whose
    BF16 shadow ratio is below the vanilla bound 1 - eps_low (what vanilla BF16 clips among the
    ``n_neg``; -1 for ``static``, which reads no shadow).
    """

    low: float
    high: float
    alpha: float
    alpha_achieved: float
    n_neg: int
    n_pos: int
    p_target: float
    p_achieved: float
    shadow_clipfrac_neg_low: float
    shadow_ratio_neg_q01: float
    k: int = -1
