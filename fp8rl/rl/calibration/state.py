"""The controller's state: bounds in force, EMA smoothing, the pooling window, counters, checkpoints.

Pure bookkeeping beside ``fp8rl.rl.calibration.estimators`` (which estimates one calibration's
raw bounds) and ``schedule`` (which steps measure). Choices, as in the controller's docstring:

- the EMA acts on the **bounds**: ``new = prev + (1 - ema) (raw - prev)`` (``ema`` = weight of
  the previous bound; 0 = the raw bounds exactly); then L is clamped to ``[low_min, 1)`` and H
  to ``(1, high_max]``;
- the window keeps the tokens of the last ``window - 1`` successful calibrations; a degenerate
  calibration adds nothing to it and keeps the bounds;
- the data of each calibration (issue 46): ``k`` (its A<0 tokens BF16 clips below 1 - eps_low),
  ``n`` (its A<0 tokens) and ``alpha_n``, the BF16-clipped count to expect among ``n`` tokens:
  the run's BF16 clip rate so far (sum of k over sum of n of every successful calibration, this
  one included; a pooled token counts once per calibration it feeds) times ``n``. It is read
  from the BF16 shadow only, never from FP8 ratios; with a static alpha (no shadow) it is
  ``alpha n``. A calibration with ``alpha_n`` near 0 has almost no BF16 events to match.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fp8rl.rl.calibration.estimators import Bounds, Calibration, flat_inputs

__all__ = ["CalibrationState", "Tokens", "flat_tokens", "smooth_bounds"]

#: One calibration's unmasked tokens, flat: ``(ratio [n], shadow ratio [n] or None, adv [n])``.
Tokens = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor]


def flat_tokens(ratio: torch.Tensor, shadow_ratio: torch.Tensor | None, advantages: torch.Tensor,
                mask: torch.Tensor) -> Tokens:
    """The unmasked tokens, flat (``Tokens``), in float32 or wider.

    Args: ``ratio`` ``[B, T]`` (or any shape), ``shadow_ratio`` same shape or None,
    ``advantages`` same shape or ``[B]`` for 2-D inputs, ``mask`` same shape (bool or numeric,
    nonzero = token). Wrong types or shapes raise (caller bugs); tokens with A == 0 are kept.
    """
    r, s, adv, valid = flat_inputs(ratio, shadow_ratio, advantages, mask)
    return r[valid], None if s is None else s[valid], adv[valid]


def smooth_bounds(prev: Bounds, raw: Bounds, *, ema: float, low_min: float, high_max: float) -> Bounds:
    """``prev + (1 - ema) (raw - prev)`` per bound (exactly ``raw`` for ``ema == 0``), clamped
    to ``[low_min, 1)`` and ``(1, high_max]``."""
    if ema == 0.0:  # exact: no rounding from prev + (raw - prev)
        low, high = raw.low, raw.high
    else:
        w = 1.0 - ema
        low = prev.low + w * (raw.low - prev.low)
        high = prev.high + w * (raw.high - prev.high)
    low = min(max(low, low_min), math.nextafter(1.0, 0.0))
    high = min(max(high, math.nextafter(1.0, 2.0)), high_max)
    return Bounds(low, high)


class CalibrationState:
    """Bounds in force, the pooling window and counters (mutable; the controller owns one)."""

    def __init__(self, init: Bounds) -> None:
        self.bounds = init
        #: tokens of the last window - 1 successful calibrations
        self.pool: list[Tokens] = []
        self.last_update_step: int | None = None
        self.last_calibration_step: int | None = None
        self.n_calibrations = 0
        self.n_degenerate = 0
        self.last_degenerate_reason: str | None = None
        self.last: Calibration | None = None
        self.last_pooled = 0
        #: running sums of k and n over the successful shadow calibrations (the run's BF16 rate)
        self.k_total = 0
        self.n_total = 0
        #: ``(step, [(k, n, alpha_n), ...])``: the calibrations of the last step that calibrated
        self.events_step: int | None = None
        self.events: list[tuple[int, int, float]] = []

    def degenerate(self, step: int, reason: str) -> None:
        """A calibration at ``step`` that could not estimate: bounds and window unchanged."""
        self.last_update_step = step
        self.n_degenerate += 1
        self.last_degenerate_reason = reason

    def calibrated(self, step: int, cal: Calibration, parts: list[Tokens], *, window: int, ema: float,
                   low_min: float, high_max: float) -> Bounds:
        """Record a successful calibration on the pooled ``parts`` (window included, this one
        last) and return the new bounds (smoothed and clamped)."""
        self.pool = parts[len(parts) - window + 1:] if window > 1 else []
        self.last_pooled = len(parts)
        self.last_update_step = step
        self.bounds = smooth_bounds(self.bounds, Bounds(cal.low, cal.high), ema=ema, low_min=low_min,
                                    high_max=high_max)
        self.last = cal
        self.last_calibration_step = step
        self.n_calibrations += 1
        self._record(step, cal)
        return self.bounds

    def _record(self, step: int, cal: Calibration) -> None:
        """Add ``cal``'s ``(k, n, alpha_n)`` to its step's events (module docstring)."""
        if cal.k >= 0:  # shadow reference: the BF16 rate pooled over the run
            self.k_total += int(cal.k)
            self.n_total += int(cal.n_neg)
            rate = self.k_total / self.n_total
        else:  # static reference: the configured alpha
            rate = float(cal.alpha)
        if step != self.events_step:
            self.events_step, self.events = step, []
        self.events.append((int(cal.k), int(cal.n_neg), rate * int(cal.n_neg)))

    @property
    def run_alpha(self) -> float:
        """The run's BF16 clip rate so far (sum k / sum n; NaN before any shadow calibration)."""
        return self.k_total / self.n_total if self.n_total else math.nan

    def state_dict(self) -> dict[str, Any]:
        """Plain Python plus, with a window, the pooled tokens as tensors."""
        return {
            "bounds": list(self.bounds.as_tuple()),
            "last_update_step": self.last_update_step,
            "last_calibration_step": self.last_calibration_step,
            "n_calibrations": self.n_calibrations,
            "n_degenerate": self.n_degenerate,
            "last_degenerate_reason": self.last_degenerate_reason,
            "last": None if self.last is None else dict(self.last.__dict__),
            "last_pooled": self.last_pooled,
            "k_total": self.k_total,
            "n_total": self.n_total,
            "events_step": self.events_step,
            "events": [list(e) for e in self.events],
            "pool": [{"ratio": r.clone(), "shadow_ratio": None if sh is None else sh.clone(), "advantages": a.clone()}
                     for r, sh, a in self.pool],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bounds = Bounds(*state["bounds"])
        self.last_update_step = state["last_update_step"]
        self.last_calibration_step = state["last_calibration_step"]
        self.n_calibrations = int(state["n_calibrations"])
        self.n_degenerate = int(state["n_degenerate"])
        self.last_degenerate_reason = state["last_degenerate_reason"]
        self.last = None if state["last"] is None else Calibration(**state["last"])
        self.last_pooled = int(state.get("last_pooled", 0))
        self.k_total = int(state.get("k_total", 0))
        self.n_total = int(state.get("n_total", 0))
        self.events_step = state.get("events_step")
        self.events = [(int(k), int(n), float(a)) for k, n, a in state.get("events", [])]
        self.pool = [(p["ratio"], p["shadow_ratio"], p["advantages"]) for p in state.get("pool", [])]
