"""The Calibrated Clipping controller: when to calibrate, what data, smoothing, state, metrics.

A small stateful object beside the math (docs/design.md), like a KL controller: the trainer asks it
for the bounds in force (``bounds(step)``), whether a step calibrates and needs the BF16
shadow pass (``is_calibration_step`` / ``needs_shadow``), and hands it the calibration tensors
of a calibration step (``update``); the estimation itself (alpha, the lower-bound quantile,
the upper rules) is ``fp8rl.rl.calibration.estimators.calibrate_bounds``.

Choices (the paper gives none of these; each is an option or documented):

- ``period``: step s is a calibration step iff ``s % period == 0``; step 0 calibrates unless
  ``calibrate_at_start=False`` (then ``init_bounds`` rule steps 0..period-1). Steps count
  from 0. The bounds computed by ``update`` are in force from the moment it returns; when in
  the step the trainer calls it (before the loss of the measured data, or after the step so
  that the bounds rule the next step) is the trainer's choice and documented there;
- the EMA acts on the **bounds**, not on alpha: ``new = prev + (1 - ema) (raw - prev)``,
  ``ema`` = weight of the previous bound, 0 = no smoothing; at the first calibration ``prev``
  is ``init_bounds`` (the bounds in force), so with ``ema > 0`` wide initial bounds decay
  towards calibrated ones; L is clamped first, H is solved against that (raw, unsmoothed) L
  and clamped, then both bounds are smoothed;
- ``window`` (W >= 1): the estimate pools the tokens of the last W calibrations (this one
  included): with alpha ~ 1e-4 the alpha-quantile of one calibration's few hundred A<0 tokens
  is just its minimum, which then clips about 1 / (n + 1) of the next batch (measured at mini
  scale: pooling the 4 mini-batches of a step cut the next step's fraction 0.38% -> 0.15%,
  pooling 3-5 steps -> 0.10%; BF16 0.05-0.075%). W = 1 pools nothing across calibrations;
  a degenerate calibration adds nothing to the window;
- data sufficiency is reported, not enforced: ``clip/n_neg`` is the number of A<0 tokens the
  estimate read and ``clip/low_data`` = 1 when alpha n < 5 (the quantile then rests on fewer
  than five tokens below it: essentially an order statistic near the minimum);
- ``init_bounds`` default = vanilla; the paper's ablation starts from wide (0.6, 1.8);
- clamps: L in [low_min, 1) and H in (1, high_max] (defaults 0.5 and 2.0); the vanilla and
  initial bounds must lie inside them;
- ``reference="static"``: no shadow pass; alpha is a constant taken from a BF16 baseline
  (e.g. its logged ``actor/clipfrac_neg_low``); with the contribution rule the BF16 p must
  then be given as ``p_target`` too;
- degenerate input keeps the previous bounds, increments ``clip/degenerate_updates``, logs a
  warning and never raises; calling off-schedule, twice for one step, backwards, or without a
  shadow ratio (shadow reference) raises;
- defaults ``ema=0.5``, ``low_min=0.5``, ``high_max=2.0``, ``window=1`` are ours; ``period=20``
  is the paper's K;
- under data parallelism the caller gathers the calibration tensors first (the controller has
  no ``torch.distributed``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from fp8rl.rl.calibration.estimators import (
    REFERENCES,
    UPPER_RULES,
    Bounds,
    Calibration,
    DegenerateCalibration,
    calibrate_bounds,
)

__all__ = ["CalibratedClipController"]

log = logging.getLogger("fp8rl.rl.calibration")

_STATE_VERSION = 1
#: ``clip/low_data`` flags a calibration whose alpha n (A<0 tokens below L) is under this.
LOW_DATA_TOKENS = 5


def _tokens(ratio: torch.Tensor, shadow_ratio: torch.Tensor | None, advantages: torch.Tensor,
            mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The unmasked tokens of one calibration, flat: ``(ratio [n], shadow [n] or None, adv [n])``.

    Shapes are checked by the estimator's rules (``[B, T]`` tensors; advantages ``[B, T]`` or
    ``[B]``); tokens with A == 0 are kept (the estimator ignores them).
    """
    from fp8rl.rl.calibration.estimators import _flat_inputs

    r, sh, adv, valid = _flat_inputs(ratio, shadow_ratio, advantages, mask)
    return r[valid], None if sh is None else sh[valid], adv[valid]


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


class CalibratedClipController:
    """Calibrated Clipping bounds for the PPO loss, recalibrated every ``period`` steps.

    Use (one trainer step ``step``):

        if ctl.is_calibration_step(step):          # == ctl.needs_shadow(step) for "shadow"
            ctl.update(step, ratio=r_fp8, shadow_ratio=r_bf16, advantages=adv, mask=mask)
        low, high = ctl.bounds(step).as_tuple()    # hand to ppo_token_loss
        log(ctl.metrics(step))

    Args:
        eps_low, eps_high: the vanilla epsilons (0 < eps_low < 1, eps_high > 0).
        period: K >= 1; calibration steps are ``step % K == 0``.
        ema: weight of the previous bound in [0, 1); 0 = no smoothing.
        upper_rule: ``contribution`` | ``proportional`` | ``fixed`` (``UPPER_RULES``).
        init_bounds: bounds before the first calibration (``Bounds`` or ``(low, high)``);
            None = vanilla. The paper's ablation uses (0.6, 1.8).
        reference: ``shadow`` (BF16 shadow ratios each calibration) | ``static``.
        alpha: static reference only: the target lower-clip fraction in [0, 1).
        p_target: static reference with the contribution rule: the BF16 p (> 0).
        low_min: L is clamped to [low_min, 1); 0 < low_min <= 1 - eps_low.
        high_max: H is clamped to (1, high_max]; high_max >= 1 + eps_high.
        calibrate_at_start: whether step 0 is a calibration step.
        window: pool the tokens of the last ``window`` calibrations (>= 1; 1 = this one only).

    See the module docstring for the method and every choice made.
    """

    def __init__(
        self,
        eps_low: float,
        eps_high: float,
        *,
        period: int = 20,
        ema: float = 0.5,
        upper_rule: str = "contribution",
        init_bounds: Bounds | Sequence[float] | None = None,
        reference: str = "shadow",
        alpha: float | None = None,
        p_target: float | None = None,
        low_min: float = 0.5,
        high_max: float = 2.0,
        calibrate_at_start: bool = True,
        window: int = 1,
    ) -> None:
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

        self.eps_low, self.eps_high = eps_low, eps_high
        self.period, self.ema = period, ema
        self.upper_rule, self.reference = upper_rule, reference
        self.alpha, self.p_target = alpha, p_target
        self.low_min, self.high_max = low_min, high_max
        self.calibrate_at_start = calibrate_at_start
        self.window = window
        # the tokens of the last window - 1 successful calibrations: (ratio, shadow or None, adv)
        self._pool: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self.init_bounds = init
        self.vanilla_bounds = vanilla
        self._bounds = init
        self._last_update_step: int | None = None
        self._last_calibration_step: int | None = None
        self._n_calibrations = 0
        self._n_degenerate = 0
        self._last_degenerate_reason: str | None = None
        self._last: Calibration | None = None
        self._last_pooled = 0

    # ----- schedule ---------------------------------------------------------------------

    @staticmethod
    def _check_step(step: int) -> int:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0; got {step!r}")
        return step

    def is_calibration_step(self, step: int) -> bool:
        """True iff ``step % period == 0`` (step 0 only if ``calibrate_at_start``)."""
        step = self._check_step(step)
        return step % self.period == 0 and (step > 0 or self.calibrate_at_start)

    def needs_shadow(self, step: int) -> bool:
        """Whether the trainer must run the BF16 shadow pass at ``step``."""
        return self.reference == "shadow" and self.is_calibration_step(step)

    def bounds(self, step: int) -> Bounds:
        """The bounds in force at ``step`` (after ``update`` on a calibration step)."""
        self._check_step(step)
        return self._bounds

    # ----- calibration ------------------------------------------------------------------

    def update(
        self,
        step: int,
        *,
        ratio: torch.Tensor,
        shadow_ratio: torch.Tensor | None = None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> Bounds:
        """Recalibrate on a calibration step; returns the bounds in force from this step on.

        Args: ``ratio`` (FP8) and ``shadow_ratio`` (BF16; ignored for ``static``) ``[B, T]``,
        ``advantages`` ``[B, T]`` or ``[B]``, ``mask`` ``[B, T]``. Degenerate input keeps the
        previous bounds and is counted; calling off-schedule, twice for one step, backwards,
        without ``shadow_ratio`` (shadow reference) or with mismatched shapes raises.
        """
        step = self._check_step(step)
        if not self.is_calibration_step(step):
            raise ValueError(
                f"step {step} is not a calibration step (period {self.period}, calibrate_at_start="
                f"{self.calibrate_at_start}); call update only when is_calibration_step(step)"
            )
        if self._last_update_step is not None and step <= self._last_update_step:
            raise ValueError(f"update at step {step} after step {self._last_update_step}: steps must increase")
        static = self.reference == "static"
        if not static and shadow_ratio is None:
            raise ValueError("reference='shadow' needs shadow_ratio (the BF16 shadow ratios) on calibration steps")
        r, sh, adv = _tokens(ratio, None if static else shadow_ratio, advantages, mask)
        parts = [*self._pool, (r, sh, adv)]
        try:
            cal = calibrate_bounds(
                torch.cat([p[0] for p in parts]),
                None if static else torch.cat([p[1] for p in parts]),  # type: ignore[misc]
                torch.cat([p[2] for p in parts]),
                torch.ones(sum(p[0].numel() for p in parts), dtype=torch.bool, device=r.device),
                eps_low=self.eps_low,
                eps_high=self.eps_high,
                upper_rule=self.upper_rule,
                alpha=self.alpha if static else None,
                p_target=self.p_target if static else None,
                low_min=self.low_min,
                high_max=self.high_max,
            )
        except DegenerateCalibration as e:
            self._last_update_step = step
            self._n_degenerate += 1
            self._last_degenerate_reason = str(e)
            log.warning("calibrated clipping: step %d skipped (%s); keeping bounds %s", step, e, self._bounds)
            return self._bounds
        self._pool = parts[len(parts) - self.window + 1:] if self.window > 1 else []
        self._last_pooled = len(parts)
        self._last_update_step = step
        prev = self._bounds
        if self.ema == 0.0:  # exact: no rounding from prev + (raw - prev)
            low, high = cal.low, cal.high
        else:
            w = 1.0 - self.ema
            low = prev.low + w * (cal.low - prev.low)
            high = prev.high + w * (cal.high - prev.high)
        low = min(max(low, self.low_min), math.nextafter(1.0, 0.0))
        high = min(max(high, math.nextafter(1.0, 2.0)), self.high_max)
        self._bounds = Bounds(low, high)
        self._last = cal
        self._last_calibration_step = step
        self._n_calibrations += 1
        return self._bounds

    # ----- metrics and checkpoints ------------------------------------------------------

    def metrics(self, step: int | None = None) -> dict[str, float]:
        """Metrics as floats.

        Always: ``clip/low``, ``clip/high`` (in force), ``clip/calibrations``,
        ``clip/degenerate_updates``, and ``clip/alpha`` once known. From the last successful
        calibration (only if ``step`` is None or equals that step, so a logger calling this
        every step gets them on calibration steps only): ``shadow/clipfrac_neg_low``,
        ``shadow/ratio_neg_q01`` (shadow reference), ``clip/low_raw``, ``clip/high_raw``
        (before EMA), ``clip/alpha_achieved`` (FP8 A<0 fraction below ``clip/low_raw``), and
        ``clip/p_target``, ``clip/p_achieved`` (contribution rule), ``clip/n_neg`` (A<0 tokens
        the estimate read), ``clip/low_data`` (1 when alpha n < 5: the lower bound rests on
        fewer than five tokens) and ``clip/pooled_calibrations`` (calibrations in the estimate).
        """
        out: dict[str, float] = {
            "clip/low": self._bounds.low,
            "clip/high": self._bounds.high,
            "clip/calibrations": float(self._n_calibrations),
            "clip/degenerate_updates": float(self._n_degenerate),
        }
        if self.reference == "static":
            out["clip/alpha"] = float(self.alpha)  # type: ignore[arg-type]
        elif self._last is not None:
            out["clip/alpha"] = self._last.alpha
        cal = self._last
        if cal is not None and (step is None or step == self._last_calibration_step):
            out["clip/low_raw"] = cal.low
            out["clip/high_raw"] = cal.high
            out["clip/alpha_achieved"] = cal.alpha_achieved
            out["clip/n_neg"] = float(cal.n_neg)
            out["clip/low_data"] = float(cal.alpha * cal.n_neg < LOW_DATA_TOKENS)
            out["clip/pooled_calibrations"] = float(self._last_pooled)
            if self.reference == "shadow":
                out["shadow/clipfrac_neg_low"] = cal.shadow_clipfrac_neg_low
                out["shadow/ratio_neg_q01"] = cal.shadow_ratio_neg_q01
            if self.upper_rule == "contribution":
                out["clip/p_target"] = cal.p_target
                out["clip/p_achieved"] = cal.p_achieved
        return out

    def _config(self) -> dict[str, Any]:
        return {
            "eps_low": self.eps_low,
            "eps_high": self.eps_high,
            "period": self.period,
            "ema": self.ema,
            "upper_rule": self.upper_rule,
            "reference": self.reference,
            "alpha": self.alpha,
            "p_target": self.p_target,
            "low_min": self.low_min,
            "high_max": self.high_max,
            "calibrate_at_start": self.calibrate_at_start,
            "init_bounds": list(self.init_bounds.as_tuple()),
            "window": self.window,
        }

    def state_dict(self) -> dict[str, Any]:
        """State for checkpoints: plain Python (JSON friendly) plus, with ``window > 1``, the
        pooled tokens of earlier calibrations as tensors (``torch.save`` friendly)."""
        return {
            "version": _STATE_VERSION,
            "config": self._config(),
            "bounds": list(self._bounds.as_tuple()),
            "last_update_step": self._last_update_step,
            "last_calibration_step": self._last_calibration_step,
            "n_calibrations": self._n_calibrations,
            "n_degenerate": self._n_degenerate,
            "last_degenerate_reason": self._last_degenerate_reason,
            "last": None if self._last is None else dict(self._last.__dict__),
            "last_pooled": self._last_pooled,
            "pool": [{"ratio": r.clone(), "shadow_ratio": None if sh is None else sh.clone(), "advantages": a.clone()}
                     for r, sh, a in self._pool],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output; the configuration must match this controller's."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported calibration state version {state.get('version')!r}; expected {_STATE_VERSION}")
        mine, theirs = self._config(), state.get("config", {})
        diff = sorted(k for k in mine if mine[k] != theirs.get(k))
        if diff:
            detail = ", ".join(f"{k}: checkpoint {theirs.get(k)!r} vs now {mine[k]!r}" for k in diff)
            raise ValueError(f"calibration state was saved with a different configuration ({detail})")
        self._bounds = Bounds(*state["bounds"])
        self._last_update_step = state["last_update_step"]
        self._last_calibration_step = state["last_calibration_step"]
        self._n_calibrations = int(state["n_calibrations"])
        self._n_degenerate = int(state["n_degenerate"])
        self._last_degenerate_reason = state["last_degenerate_reason"]
        self._last = None if state["last"] is None else Calibration(**state["last"])
        self._last_pooled = int(state.get("last_pooled", 0))
        self._pool = [(p["ratio"], p["shadow_ratio"], p["advantages"]) for p in state.get("pool", [])]

    def __repr__(self) -> str:
        return (
            f"CalibratedClipController(eps_low={self.eps_low}, eps_high={self.eps_high}, period={self.period}, "
            f"ema={self.ema}, upper_rule={self.upper_rule!r}, reference={self.reference!r}, bounds={self._bounds})"
        )
