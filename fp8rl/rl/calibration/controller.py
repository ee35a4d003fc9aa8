"""The Calibrated Clipping controller: modes, smoothing, state, metrics, agreement.

A small stateful object beside the math (docs/design.md), like a KL controller. The trainer asks it
whether a step measures the BF16 shadow (``measures``), hands it the measured tokens and asks
it for bounds; the estimation itself (alpha, the lower-bound quantile, the upper rules) is
``fp8rl.rl.calibration.estimators.calibrate_bounds``. The pieces:

- ``schedule``: the calibration modes (``CALIBRATION_MODES``: ``periodic``, ``pooled``,
  ``same_batch``; their docstring says which steps and mini-batches are measured and when the
  bounds apply) and which steps calibrate;
- ``state``: bounds in force, EMA, pooling window, counters, checkpoint state;
- ``metrics``: the metrics and the agreement tally (which tokens FP8 clips against which BF16
  would clip, ``agreement.agreement_counts``).

Use, ``periodic`` / ``pooled`` (one trainer step ``step``):

    low, high = ctl.bounds(step).as_tuple()          # in force for the whole step
    ... mini-batch updates; if ctl.measures(step): keep their FP8 and BF16 shadow ratios ...
    if ctl.is_calibration_step(step):
        ctl.update(step, ratio=r_fp8, shadow_ratio=r_bf16, advantages=adv, mask=mask)  # pooled
    log(ctl.metrics(step))                           # new bounds rule from step + 1

``same_batch`` (per mini-batch, before its loss):

    b = ctl.update_batch(step, ratio=r_fp8, shadow_ratio=r_bf16, advantages=adv, mask=mask)
    loss = ppo_token_loss(..., low=b.low, high=b.high)

Choices (the paper gives none of these; each is an option or documented):

- ``period`` (``periodic``): step s is a calibration step iff ``s % period == 0``; step 0
  calibrates unless ``calibrate_at_start=False`` (then ``init_bounds`` rule steps
  0..period-1). Steps count from 0. ``pooled`` and ``same_batch`` calibrate every step;
  ``period``, ``ema``, ``window`` and ``calibrate_at_start`` are ``periodic``'s options and
  raise when set to non-default values with another mode;
- the EMA acts on the **bounds**, not on alpha: ``new = prev + (1 - ema) (raw - prev)``,
  ``ema`` = weight of the previous bound, 0 = no smoothing; at the first calibration ``prev``
  is ``init_bounds``; L is clamped first, H is solved against that (raw, unsmoothed) L and
  clamped, then both bounds are smoothed. ``pooled`` and ``same_batch`` use the raw bounds;
- ``window`` (W >= 1, ``periodic``): the estimate pools the tokens of the last W calibrations
  (this one included): with alpha ~ 1e-4 the alpha-quantile of one calibration's few hundred
  A<0 tokens is just its minimum, which then clips about 1 / (n + 1) of the next batch
  (measured at mini scale: pooling the 4 mini-batches of a step cut the next step's fraction
  0.38% -> 0.15%, pooling 3-5 steps -> 0.10%; BF16 0.05-0.075%). A degenerate calibration
  adds nothing to the window;
- agreement: every measured token set (shadow reference) is counted with the bounds actually
  applied to it (``periodic``/``pooled``: the bounds in force during the step, i.e. before
  ``update``; ``same_batch``: the batch's own new bounds, or the kept ones if degenerate)
  against the vanilla bounds on the BF16 side; counts are summed over the step and reported
  by ``metrics(step)`` with recall/precision;
- data sufficiency is reported, not enforced: ``clip/n_neg`` is the number of A<0 tokens the
  estimate read and ``clip/low_data`` = 1 when alpha n < 5;
- ``init_bounds`` default = vanilla; the paper's ablation starts from wide (0.6, 1.8);
- clamps: L in [low_min, 1) and H in (1, high_max] (defaults 0.5 and 2.0); the vanilla and
  initial bounds must lie inside them;
- ``reference="static"``: no shadow pass; alpha is a constant taken from a BF16 baseline
  (e.g. its logged ``actor/clipfrac_neg_low``); with the contribution rule the BF16 p must
  then be given as ``p_target`` too; no agreement counts (nothing to compare with);
- degenerate input keeps the previous bounds, increments ``clip/degenerate_updates``, logs a
  warning and never raises; calling off-schedule, with the other mode's method, twice for one
  step (``update``), backwards, or without a shadow ratio (shadow reference) raises;
- defaults ``ema=0.5``, ``low_min=0.5``, ``high_max=2.0``, ``window=1`` are ours; ``period=20``
  is the paper's K; the default mode is ``schedule.DEFAULT_CALIBRATION_MODE`` (provisional);
- under data parallelism the caller gathers the calibration tensors first (the controller has
  no ``torch.distributed``), so bounds and agreement counts are global;
- checkpoints: ``state_dict`` version 2 holds the mode and the agreement tally; a version-1
  state (before the modes) loads as ``periodic``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from fp8rl.rl.calibration.estimators import Bounds, DegenerateCalibration, calibrate_bounds
from fp8rl.rl.calibration.metrics import LOW_DATA_TOKENS, AgreementTally, calibration_metrics
from fp8rl.rl.calibration.options import check_options
from fp8rl.rl.calibration.schedule import (
    CALIBRATION_MODES,
    DEFAULT_CALIBRATION_MODE,
    PERIODIC_DEFAULTS,
    resolve_lower_estimator,
)
from fp8rl.rl.calibration.schedule import is_calibration_step as _is_calibration_step
from fp8rl.rl.calibration.state import CalibrationState, Tokens, flat_tokens

__all__ = ["LOW_DATA_TOKENS", "CalibratedClipController"]

log = logging.getLogger("fp8rl.rl.calibration")

_STATE_VERSION = 2


class CalibratedClipController:
    """Calibrated Clipping bounds for the PPO loss, in one of the ``CALIBRATION_MODES``.

    See the module docstring for the use per mode, the method and every choice made.

    Args:
        eps_low, eps_high: the vanilla epsilons (0 < eps_low < 1, eps_high > 0).
        mode: ``periodic`` | ``pooled`` | ``same_batch`` (``CALIBRATION_MODES``).
        period: ``periodic``: K >= 1; calibration steps are ``step % K == 0``.
        ema: ``periodic``: weight of the previous bound in [0, 1); 0 = no smoothing.
        upper_rule: ``contribution`` | ``proportional`` | ``fixed`` (``UPPER_RULES``).
        init_bounds: bounds before the first calibration (``Bounds`` or ``(low, high)``);
            None = vanilla. The paper's ablation uses (0.6, 1.8).
        reference: ``shadow`` (BF16 shadow ratios each calibration) | ``static``.
        alpha: static reference only: the target lower-clip fraction in [0, 1).
        p_target: static reference with the contribution rule: the BF16 p (> 0).
        low_min: L is clamped to [low_min, 1); 0 < low_min <= 1 - eps_low.
        high_max: H is clamped to (1, high_max]; high_max >= 1 + eps_high.
        calibrate_at_start: ``periodic``: whether step 0 is a calibration step.
        window: ``periodic``: pool the tokens of the last ``window`` calibrations (>= 1).
        lower_estimator: the lower bound's estimator (``LOWER_ESTIMATORS``: ``in_sample``,
            ``unbiased``); None = the mode's own (``same_batch``: in_sample, exact on the tokens
            its bounds rule; ``periodic`` / ``pooled``: unbiased for the later tokens theirs rule).
    """

    def __init__(
        self,
        eps_low: float,
        eps_high: float,
        *,
        mode: str = DEFAULT_CALIBRATION_MODE,
        period: int = PERIODIC_DEFAULTS["period"],
        ema: float = PERIODIC_DEFAULTS["ema"],
        upper_rule: str = "contribution",
        init_bounds: Bounds | Sequence[float] | None = None,
        reference: str = "shadow",
        alpha: float | None = None,
        p_target: float | None = None,
        low_min: float = 0.5,
        high_max: float = 2.0,
        calibrate_at_start: bool = PERIODIC_DEFAULTS["calibrate_at_start"],
        window: int = PERIODIC_DEFAULTS["window"],
        lower_estimator: str | None = None,
    ) -> None:
        self.lower_estimator = resolve_lower_estimator(mode, lower_estimator)
        o = check_options(eps_low, eps_high, mode=mode, period=period, ema=ema, upper_rule=upper_rule,
                          init_bounds=init_bounds, reference=reference, alpha=alpha, p_target=p_target,
                          low_min=low_min, high_max=high_max, calibrate_at_start=calibrate_at_start,
                          window=window)
        eps_low, eps_high, ema, alpha, p_target = o["eps_low"], o["eps_high"], o["ema"], o["alpha"], o["p_target"]
        low_min, high_max, init, vanilla = o["low_min"], o["high_max"], o["init"], o["vanilla"]
        self.mode = mode
        self.eps_low, self.eps_high = eps_low, eps_high
        self.period, self.ema = period, ema
        self.upper_rule, self.reference = upper_rule, reference
        self.alpha, self.p_target = alpha, p_target
        self.low_min, self.high_max = low_min, high_max
        self.calibrate_at_start = calibrate_at_start
        self.window = window
        self.init_bounds = init
        self.vanilla_bounds = vanilla
        self._state = CalibrationState(init)
        self._agreement = AgreementTally()

    # ----- schedule ---------------------------------------------------------------------

    @staticmethod
    def _check_step(step: int) -> int:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0; got {step!r}")
        return step

    @property
    def per_batch(self) -> bool:
        """Whether each mini-batch gets its own bounds (``update_batch``; ``same_batch``)."""
        return CALIBRATION_MODES[self.mode].per_batch

    def is_calibration_step(self, step: int) -> bool:
        """Whether ``step`` measures calibration data (``periodic``: ``step % period == 0``, step 0
        only if ``calibrate_at_start``; ``pooled``, ``same_batch``: every step)."""
        step = self._check_step(step)
        return _is_calibration_step(self.mode, step, period=self.period, calibrate_at_start=self.calibrate_at_start)

    def measures(self, step: int) -> bool:
        """Whether the trainer runs the BF16 shadow on the mini-batches of ``step`` (all of them,
        the first included)."""
        return self.reference == "shadow" and self.is_calibration_step(step)

    def needs_shadow(self, step: int) -> bool:
        """Same as :meth:`measures` (the ``ClipMethod`` protocol's name)."""
        return self.measures(step)

    def bounds(self, step: int) -> Bounds:
        """``periodic``/``pooled``: the bounds in force at ``step`` (from the last ``update``
        before it); ``same_batch``: those of the last ``update_batch`` (the kept ones if it
        was degenerate)."""
        self._check_step(step)
        return self._state.bounds

    # ----- calibration ------------------------------------------------------------------

    def _estimate(self, parts: list[Tokens]):
        static = self.reference == "static"
        r = torch.cat([p[0] for p in parts])
        return calibrate_bounds(
            r,
            None if static else torch.cat([p[1] for p in parts]),  # type: ignore[misc]
            torch.cat([p[2] for p in parts]),
            torch.ones(r.numel(), dtype=torch.bool, device=r.device),
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            upper_rule=self.upper_rule,
            alpha=self.alpha if static else None,
            p_target=self.p_target if static else None,
            low_min=self.low_min,
            high_max=self.high_max,
            lower_estimator=self.lower_estimator,
        )

    def _tokens(self, ratio, shadow_ratio, advantages, mask) -> Tokens:
        static = self.reference == "static"
        if not static and shadow_ratio is None:
            raise ValueError("reference='shadow' needs shadow_ratio (the BF16 shadow ratios) on calibration steps")
        return flat_tokens(ratio, None if static else shadow_ratio, advantages, mask)

    def _count(self, step: int, tokens: Tokens, applied: Bounds) -> None:
        r, sh, adv = tokens
        if sh is not None:
            self._agreement.add(step, r, sh, adv, torch.ones_like(r, dtype=torch.bool), applied=applied,
                                vanilla=self.vanilla_bounds)

    def update(
        self,
        step: int,
        *,
        ratio: torch.Tensor,
        shadow_ratio: torch.Tensor | None = None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> Bounds:
        """``periodic``/``pooled``: recalibrate on the pooled measured tokens of calibration step
        ``step`` (measured with the bounds in force during it); returns the bounds that rule
        from the next step.

        Args: ``ratio`` (FP8) and ``shadow_ratio`` (BF16; ignored for ``static``) ``[B, T]`` (or
        flat ``[n]``), ``advantages`` ``[B, T]`` or ``[B]``, ``mask`` same shape as ``ratio``.
        Degenerate input keeps the previous bounds and is counted; calling off-schedule, in
        ``same_batch`` mode, twice for one step, backwards, without ``shadow_ratio`` (shadow
        reference) or with mismatched shapes raises.
        """
        step = self._check_step(step)
        if self.per_batch:
            raise ValueError(f"mode {self.mode!r} calibrates each mini-batch: call update_batch, not update")
        if not self.is_calibration_step(step):
            raise ValueError(
                f"step {step} is not a calibration step (period {self.period}, calibrate_at_start="
                f"{self.calibrate_at_start}); call update only when is_calibration_step(step)"
            )
        st = self._state
        if st.last_update_step is not None and step <= st.last_update_step:
            raise ValueError(f"update at step {step} after step {st.last_update_step}: steps must increase")
        tokens = self._tokens(ratio, shadow_ratio, advantages, mask)
        self._count(step, tokens, st.bounds)  # the bounds these tokens were clipped with
        parts = [*st.pool, tokens]
        try:
            cal = self._estimate(parts)
        except DegenerateCalibration as e:
            st.degenerate(step, str(e))
            log.warning("calibrated clipping: step %d skipped (%s); keeping bounds %s", step, e, st.bounds)
            return st.bounds
        ema = self.ema if self.mode == "periodic" else 0.0  # pooled: raw bounds
        return st.calibrated(step, cal, parts, window=self.window, ema=ema, low_min=self.low_min,
                             high_max=self.high_max)

    def update_batch(
        self,
        step: int,
        *,
        ratio: torch.Tensor,
        shadow_ratio: torch.Tensor | None = None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> Bounds:
        """``same_batch``: the bounds of one mini-batch of step ``step`` from its own tokens (raw:
        no EMA, no window), to be used by that mini-batch's loss. Call once per mini-batch,
        before its loss; arguments as :meth:`update`. Degenerate input keeps the previous bounds
        (counted); steps may repeat (several mini-batches) but not go backwards.
        """
        step = self._check_step(step)
        if not self.per_batch:
            raise ValueError(f"mode {self.mode!r} pools a step's tokens: call update once per step, not update_batch")
        st = self._state
        if st.last_update_step is not None and step < st.last_update_step:
            raise ValueError(f"update_batch at step {step} after step {st.last_update_step}: steps must not go back")
        tokens = self._tokens(ratio, shadow_ratio, advantages, mask)
        try:
            cal = self._estimate([tokens])
        except DegenerateCalibration as e:
            st.degenerate(step, str(e))
            log.warning("calibrated clipping: a mini-batch of step %d skipped (%s); keeping bounds %s",
                        step, e, st.bounds)
        else:
            st.calibrated(step, cal, [tokens], window=1, ema=0.0, low_min=self.low_min, high_max=self.high_max)
        self._count(step, tokens, st.bounds)  # the bounds this mini-batch's loss uses
        return st.bounds

    # ----- metrics and checkpoints ------------------------------------------------------

    def metrics(self, step: int | None = None) -> dict[str, float]:
        """Metrics as floats.

        Always: ``clip/low``, ``clip/high`` (in force; ``same_batch``: the last mini-batch's),
        ``clip/calibrations`` (``same_batch``: mini-batches calibrated), ``clip/degenerate_updates``,
        and ``clip/alpha`` once known. From the last successful calibration (only if ``step`` is
        None or equals that step, so a logger calling this every step gets them on calibration
        steps only): ``shadow/clipfrac_neg_low``, ``shadow/ratio_neg_q01`` (shadow reference),
        ``clip/low_raw``, ``clip/high_raw`` (before EMA), ``clip/alpha_achieved`` (FP8 A<0
        fraction below ``clip/low_raw``), and ``clip/p_target``, ``clip/p_achieved``
        (contribution rule), ``clip/n_neg`` (A<0 tokens the estimate read), ``clip/low_data``
        (1 when alpha n < 5) and ``clip/pooled_calibrations`` (calibrations in the estimate).
        The agreement of the tokens measured at ``step`` (or the last measured step if None):
        ``shadow/{low,high}_{bf16,fp8,both}_n`` summed over the step and
        ``shadow/{low,high}_{recall,precision}``.
        """
        st = self._state
        out = calibration_metrics(
            bounds=st.bounds, n_calibrations=st.n_calibrations, n_degenerate=st.n_degenerate, last=st.last,
            last_step=st.last_calibration_step, last_pooled=st.last_pooled, step=step,
            reference=self.reference, static_alpha=self.alpha, upper_rule=self.upper_rule)
        out.update(self._agreement.metrics(step))
        return out

    def _config(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
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
            "lower_estimator": self.lower_estimator,
        }

    def state_dict(self) -> dict[str, Any]:
        """State for checkpoints: plain Python (JSON friendly) plus, with ``window > 1``, the
        pooled tokens of earlier calibrations as tensors (``torch.save`` friendly)."""
        return {"version": _STATE_VERSION, "config": self._config(), **self._state.state_dict(),
                "agreement": self._agreement.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output; the configuration must match this controller's.
        A version-1 state (saved before the modes existed) is a ``periodic`` controller's."""
        version = state.get("version")
        if version not in (1, _STATE_VERSION):
            raise ValueError(f"unsupported calibration state version {version!r}; expected 1 or {_STATE_VERSION}")
        mine, theirs = self._config(), dict(state.get("config", {}))
        if version == 1:
            theirs.setdefault("mode", "periodic")
        theirs.setdefault("lower_estimator", "in_sample")  # saved before the estimator was an option
        diff = sorted(k for k in mine if mine[k] != theirs.get(k))
        if diff:
            detail = ", ".join(f"{k}: checkpoint {theirs.get(k)!r} vs now {mine[k]!r}" for k in diff)
            raise ValueError(f"calibration state was saved with a different configuration ({detail})")
        self._state.load_state_dict(state)
        self._agreement.load_state_dict(state.get("agreement"))

    def __repr__(self) -> str:
        return (
            f"CalibratedClipController(mode={self.mode!r}, eps_low={self.eps_low}, eps_high={self.eps_high}, "
            f"period={self.period}, ema={self.ema}, upper_rule={self.upper_rule!r}, reference={self.reference!r}, "
            f"bounds={self._state.bounds})"
        )
