"""The Calibrated Clipping controller: modes, smoothing, state, metrics.

A small stateful object beside the math (docs/design.md), like a KL controller. The backends drive
it through one plan per step (``plan.StepPlan``: which sequences get a BF16 shadow, which feed the
estimate, which bounds rule which tokens; ``begin_step``), the same way for every mode; the
estimation itself (alpha, the lower-bound quantile, the upper rules) is
``fp8rl.rl.calibration.estimators.calibrate_bounds``. The pieces:

- ``options``: ``CalibrationOptions``, every option in one frozen object validated once;
- ``schedule``: the calibration modes (``CALIBRATION_MODES``: ``periodic``, ``pooled``,
  ``same_batch``, ``sampled``; which steps and sequences are measured, which tokens the bounds
  rule);
- ``sampling``: ``sampled``'s draw and share rule;
- ``state``: bounds in force, EMA, pooling windows, counters, checkpoint state;
- ``plan``: the step and window plans both backends follow;
- ``metrics``, ``heldout``: the controller's metrics; which tokens FP8 clips against which BF16
  would clip; the out-of-sample and cross-fitted counts.

Use (one trainer step ``step``; the plan's docstring has the whole loop):

    plan = ctl.begin_step(step, eligible=seq_has_nonzero_adv)
    for rows in windows: w = plan.window(rows); ...; w.calibrate(...); ...; w.observe(...)
    log(plan.finish())

The lower-level calls the plan makes are public for tests and tools: ``update`` (``periodic`` /
``pooled``: one pooled calibration after a step; counts the agreement of the tokens with the
bounds in force) and ``update_batch`` (``same_batch``: one window's bounds from its own tokens).

Choices (the paper gives none of these; each is an option or documented):

- ``period`` (``periodic``): step s is a calibration step iff ``s % period == 0``; step 0
  calibrates unless ``calibrate_at_start=False`` (then ``init_bounds`` rule steps
  0..period-1). Steps count from 0. The other modes calibrate every step; options of one mode
  raise when set to non-default values with another (``options.ModeOptionError``);
- the EMA acts on the **bounds**, not on alpha: ``new = prev + (1 - ema) (raw - prev)``,
  ``ema`` = weight of the previous bound, 0 = no smoothing; at the first calibration ``prev``
  is ``init_bounds``; L is clamped first, H is solved against that (raw, unsmoothed) L and
  clamped, then both bounds are smoothed. The other modes use the raw bounds;
- ``window`` (W >= 1, ``periodic``): the estimate pools the tokens of the last W calibrations
  (this one included): with alpha ~ 1e-4 the alpha-quantile of one calibration's few hundred
  A<0 tokens is just its minimum, which then clips about 1 / (n + 1) of the next batch
  (measured at mini scale: pooling the 4 mini-batches of a step cut the next step's fraction
  0.38% -> 0.15%, pooling 3-5 steps -> 0.10%; BF16 0.05-0.075%). A degenerate calibration
  adds nothing to the window. ``sampled`` pools the measured tokens of its last ``pool``
  windows (the share rule's choice, at most ``sample_pool``), a degenerate one included;
- agreement: every shadowed token is counted with the bounds actually applied to it against the
  vanilla bounds on the BF16 side; counts are summed over the step;
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
  is the paper's K; the default mode is ``schedule.DEFAULT_CALIBRATION_MODE``;
- under data parallelism the caller gathers the calibration tensors first (the controller has
  no ``torch.distributed``), so bounds and counts are global; ``sampled`` draws per rank
  (``begin_step(rank=...)``) with the same share on every rank;
- checkpoints: ``state_dict`` version 3 adds ``sampled``'s pool and share history; version 2
  (no sampled state) and version 1 (before the modes: ``periodic``) load.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch

from fp8rl.rl.calibration.bounds import Bounds, DegenerateCalibration
from fp8rl.rl.calibration.estimators import calibrate_bounds
from fp8rl.rl.calibration.metrics import (
    LOW_DATA_TOKENS,
    AgreementTally,
    calibration_metrics,
    event_metrics,
)
from fp8rl.rl.calibration.options import CalibrationOptions, options_from
from fp8rl.rl.calibration.plan import StepPlan
from fp8rl.rl.calibration.sampling import (
    MEMORY,
    WindowStats,
    choose_share,
    draw_holdout,
    draw_subset,
    window_stats,
)
from fp8rl.rl.calibration.schedule import MODE_OPTION_DEFAULTS
from fp8rl.rl.calibration.schedule import is_calibration_step as _is_calibration_step
from fp8rl.rl.calibration.state import CalibrationState, Tokens, flat_tokens

__all__ = ["LOW_DATA_TOKENS", "CalibratedClipController"]

log = logging.getLogger("fp8rl.rl.calibration")

_STATE_VERSION = 3


class CalibratedClipController:
    """Calibrated Clipping bounds for the PPO loss, in one of the ``CALIBRATION_MODES``.

    See the module docstring for the use, the method and every choice made.

    Args:
        eps_low, eps_high: the vanilla epsilons (0 < eps_low < 1, eps_high > 0).
        options: a ``CalibrationOptions`` (every option; validated once when it was built), or
            None and the options as keyword arguments (``mode``, ``period``, ``ema``,
            ``upper_rule``, ``init_bounds``, ``reference``, ``alpha``, ``p_target``, ``low_min``,
            ``high_max``, ``calibrate_at_start``, ``window``, ``lower_estimator``, ``sample_*``:
            ``CalibrationOptions``' attributes).
        seed: seeds ``sampled``'s draw (with the step and the DP rank); the run's seed.
    """

    #: takes the run's calibration options and seed (``make_clipper(..., options=, seed=)``): both
    #: backends and the paper-scale plugin pass them because of this attribute, not its name
    calibrates: ClassVar[bool] = True

    def __init__(self, eps_low: float, eps_high: float, options: CalibrationOptions | None = None, *,
                 seed: int = 0, **kwargs: Any) -> None:
        if options is None:
            options = options_from(**kwargs)
        elif kwargs:
            raise TypeError(f"pass the options either as CalibrationOptions or as keywords, not both ({sorted(kwargs)})")
        if not isinstance(options, CalibrationOptions):
            raise TypeError(f"options must be CalibrationOptions, got {type(options).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.options = options
        self.seed = seed
        self.eps_low, self.eps_high, self.vanilla_bounds, self.init_bounds = options.check_eps(eps_low, eps_high)
        self.lower_estimator = options.resolved_lower_estimator
        self._state = CalibrationState(self.init_bounds)
        self._agreement = AgreementTally()
        self._pool: list[Tokens] = []  # sampled: the last windows' measured tokens
        self._history: list[WindowStats] = []  # sampled: their summaries (share rule)
        self._choice = None  # sampled: the current step's share decision
        self._steps: list[Tokens] = []  # windowed: the last window_max - 1 steps' measured tokens

    # ----- options ----------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # the options read as attributes: ctl.mode, ctl.period, ctl.upper_rule, ...
        opts = self.__dict__.get("options")
        if opts is not None and name in CalibrationOptions.__dataclass_fields__:
            return getattr(opts, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def mode_spec(self):
        """The mode object (``schedule.CalibrationMode``)."""
        return self.options.mode_spec

    @property
    def per_batch(self) -> bool:
        """Whether each window gets bounds from its own tokens (``in_window`` modes)."""
        return self.mode_spec.in_window

    # ----- schedule ---------------------------------------------------------------------

    @staticmethod
    def _check_step(step: int) -> int:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0; got {step!r}")
        return step

    def is_calibration_step(self, step: int) -> bool:
        """Whether ``step`` feeds the controller (``periodic``: ``step % period == 0``, step 0 only
        if ``calibrate_at_start``; the other modes: every step)."""
        step = self._check_step(step)
        return _is_calibration_step(self.mode, step, period=self.period, calibrate_at_start=self.calibrate_at_start)

    def measures(self, step: int) -> bool:
        """Whether ``step`` runs the BF16 shadow for calibration (on the measured sequences)."""
        return self.reference == "shadow" and self.is_calibration_step(step)

    def needs_shadow(self, step: int) -> bool:
        """Same as :meth:`measures` (the ``ClipMethod`` protocol's name)."""
        return self.measures(step)

    def bounds(self, step: int) -> Bounds:
        """The bounds in force at the start of ``step`` (the last calibration's; the kept ones
        after a degenerate one)."""
        self._check_step(step)
        return self._state.bounds

    def begin_step(self, step: int, *, eligible: torch.Tensor, diagnostics: bool = False, rank: int = 0,
                   holdout_share: float = 0.0, seed: int | None = None) -> StepPlan:
        """The plan of ``step`` (``plan.StepPlan``) over its ``N`` sequences.

        Args:
            eligible: ``[N]`` bool, sequences with any A != 0 token (``sampled`` draws among them).
            diagnostics: also shadow every sequence (``clip.shadow_diagnostics``; training unchanged).
            rank: the DP rank (``sampled``'s draw).
            holdout_share, seed: the held-out rows (``sampling.draw_holdout`` of the run seed
                ``seed``, default the controller's): shadowed, never measured, scored as
                ``shadow/ho_*`` against the bounds in force on them.
        """
        step = self._check_step(step)
        eligible = _check_eligible(eligible)
        n = eligible.numel()
        calibrates = self.is_calibration_step(step)
        choice = None
        if not calibrates:
            measured = torch.zeros_like(eligible)
        elif self.mode == "windowed":  # a fixed share; the window across steps makes up the events
            measured = draw_subset(eligible, self.window_share, seed=self.seed, step=step, rank=rank)
        elif self.mode_spec.subset:
            o = self.options
            choice = choose_share(self._history, target=o.sample_target, share_min=o.sample_min,
                                  share_max=o.sample_max, pool_max=o.sample_pool, fixed_share=o.sample_fraction)
            measured = draw_subset(eligible, choice.share, seed=self.seed, step=step, rank=rank)
        else:
            measured = torch.ones_like(eligible)
        self._choice = choice
        shadowed = torch.ones_like(eligible) if diagnostics else (measured if self.measures(step) else
                                                                   torch.zeros_like(eligible))
        holdout = draw_holdout(eligible, holdout_share, seed=self.seed if seed is None else seed, step=step, rank=rank)
        return StepPlan(self, step, n=n, measured=measured, shadowed=shadowed, calibrates=calibrates, choice=choice,
                        eligible=eligible, holdout=holdout)

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

    def estimate_flat(self, ratio: torch.Tensor, shadow_ratio: torch.Tensor, advantages: torch.Tensor) -> Bounds:
        """The raw (clamped) bounds of one estimate on flat tokens, no state change (cross-fitting)."""
        cal = self._estimate([(ratio, shadow_ratio, advantages)])
        return Bounds(cal.low, cal.high)

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

    def _check_pooled_call(self, step: int, what: str) -> None:
        if self.per_batch:
            raise ValueError(f"mode {self.mode!r} calibrates each mini-batch: call update_batch / the plan, not {what}")
        if not self.is_calibration_step(step):
            raise ValueError(
                f"step {step} is not a calibration step (period {self.period}, calibrate_at_start="
                f"{self.calibrate_at_start}); call update only when is_calibration_step(step)"
            )
        st = self._state
        if st.last_update_step is not None and step <= st.last_update_step:
            raise ValueError(f"update at step {step} after step {st.last_update_step}: steps must increase")

    def _windowed_parts(self, tokens: Tokens) -> list[Tokens]:
        """``windowed``: the fewest recent steps' tokens (this step's last) whose alpha n reaches
        ``window_target``, alpha the BF16 rate (or the static alpha) over the last ``window_max``
        steps; all of them when the target is out of reach. Keeps the last ``window_max - 1``."""
        recent = [*self._steps, tokens][-self.window_max:]
        self._steps = recent[1:] if len(recent) == self.window_max else recent
        v = self.vanilla_bounds.low
        neg = [p[2] < 0 for p in recent]
        ns = [int(m.sum()) for m in neg]
        if self.reference == "static":
            alpha = float(self.alpha)
        else:
            ks = [int((p[1][m] < v).sum()) for p, m in zip(recent, neg, strict=True)]
            alpha = sum(ks) / sum(ns) if sum(ns) else 0.0
        pooled = 0
        for w in range(1, len(recent) + 1):
            pooled += ns[-w]
            if alpha * pooled >= self.window_target:
                return recent[-w:]
        return recent

    def _pooled_update(self, step: int, tokens: Tokens) -> Bounds:
        st = self._state
        parts = self._windowed_parts(tokens) if self.mode == "windowed" else [*st.pool, tokens]
        try:
            cal = self._estimate(parts)
        except DegenerateCalibration as e:
            st.degenerate(step, str(e))
            log.warning("calibrated clipping: step %d skipped (%s); keeping bounds %s", step, e, st.bounds)
            return st.bounds
        ema = self.ema if self.mode == "periodic" else 0.0  # pooled: raw bounds
        return st.calibrated(step, cal, parts, window=self.window, ema=ema, low_min=self.low_min,
                             high_max=self.high_max)

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
        ``step`` (measured with the bounds in force during it, whose agreement is counted);
        returns the bounds that rule from the next step.

        Args: ``ratio`` (FP8) and ``shadow_ratio`` (BF16; ignored for ``static``) ``[B, T]`` (or
        flat ``[n]``), ``advantages`` ``[B, T]`` or ``[B]``, ``mask`` same shape as ``ratio``.
        Degenerate input keeps the previous bounds and is counted; calling off-schedule, in an
        in-window mode, twice for one step, backwards, without ``shadow_ratio`` (shadow
        reference) or with mismatched shapes raises.
        """
        step = self._check_step(step)
        self._check_pooled_call(step, "update")
        tokens = self._tokens(ratio, shadow_ratio, advantages, mask)
        self._count(step, tokens, self._state.bounds)  # the bounds these tokens were clipped with
        return self._pooled_update(step, tokens)

    def update_step(self, step: int, parts: list[Tokens]) -> Bounds:
        """The plan's pooled update of a step-level mode: the windows' tokens in order (agreement
        counted by the plan)."""
        self._check_pooled_call(step, "update_step")
        if not parts:
            raise ValueError(f"step {step} is a calibration step but no window was measured")
        if self.reference != "static" and any(p[1] is None for p in parts):
            raise ValueError("reference='shadow' needs shadow_ratio (the BF16 shadow ratios) on calibration steps")
        static = self.reference == "static"
        tokens = (torch.cat([p[0] for p in parts]), None if static else torch.cat([p[1] for p in parts]),
                  torch.cat([p[2] for p in parts]))
        return self._pooled_update(step, tokens)

    def calibrate_window(self, step: int, tokens: Tokens, *, seq: torch.Tensor | None = None) -> Bounds:
        """One window's bounds (in-window modes): from its measured tokens, pooled with the last
        windows' for ``sampled``; raw (no EMA). Degenerate input keeps the previous bounds."""
        step = self._check_step(step)
        if not self.per_batch:
            raise ValueError(f"mode {self.mode!r} pools a step's tokens: call update once per step, not update_batch")
        st = self._state
        if st.last_update_step is not None and step < st.last_update_step:
            raise ValueError(f"update_batch at step {step} after step {st.last_update_step}: steps must not go back")
        if self.reference != "static" and tokens[1] is None:
            raise ValueError("reference='shadow' needs shadow_ratio (the BF16 shadow ratios) on calibration steps")
        parts = [tokens]
        if self.mode_spec.subset:
            pool = self._choice.pool if self._choice is not None else 1
            parts = [*self._pool[len(self._pool) - (pool - 1):], tokens] if pool > 1 else [tokens]
            share = self._choice.share if self._choice is not None else 1.0
            seq = seq if seq is not None else torch.zeros_like(tokens[0], dtype=torch.long)
            self._history = [*self._history, window_stats(tokens[1], tokens[2], seq, vanilla_low=self.vanilla_bounds.low,
                                                          share=share)][-MEMORY:]
            keep = self.sample_pool - 1
            self._pool = [*self._pool, tokens][len(self._pool) + 1 - keep:] if keep > 0 else []
        try:
            cal = self._estimate(parts)
        except DegenerateCalibration as e:
            st.degenerate(step, str(e))
            log.warning("calibrated clipping: a mini-batch of step %d skipped (%s); keeping bounds %s",
                        step, e, st.bounds)
            return st.bounds
        st.calibrated(step, cal, parts, window=1, ema=0.0, low_min=self.low_min, high_max=self.high_max)
        return st.bounds

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
        no EMA, no window), to be used by that mini-batch's loss (agreement counted with them).
        Arguments as :meth:`update`; steps may repeat (several mini-batches) but not go back.
        """
        tokens = self._tokens(ratio, shadow_ratio, advantages, mask)
        b = self.calibrate_window(step, tokens)
        self._count(step, tokens, b)  # the bounds this mini-batch's loss uses
        return b

    # ----- metrics and checkpoints ------------------------------------------------------

    def metrics(self, step: int | None = None) -> dict[str, float]:
        """Metrics as floats.

        Always: ``clip/low``, ``clip/high`` (in force), ``clip/calibrations`` (in-window modes:
        windows calibrated), ``clip/degenerate_updates``, and ``clip/alpha`` once known. From the
        last successful calibration (only if ``step`` is None or equals that step, so a logger
        calling this every step gets them on calibration steps only): ``shadow/clipfrac_neg_low``,
        ``shadow/ratio_neg_q01`` (shadow reference), ``clip/low_raw``, ``clip/high_raw`` (before
        EMA), ``clip/alpha_achieved`` (FP8 A<0 fraction below ``clip/low_raw``), and
        ``clip/p_target``, ``clip/p_achieved`` (contribution rule), ``clip/n_neg`` (A<0 tokens the
        estimate read), ``clip/low_data`` (1 when alpha n < 5) and ``clip/pooled_calibrations``;
        the data of the step's calibrations (``metrics.event_metrics``: ``clip/k``, ``clip/n``,
        ``clip/alpha_n``, ``clip/k_zero``, ``clip/events``, ``clip/alpha_run``).
        The agreement counted by ``update`` / ``update_batch`` at ``step`` (the plan counts its
        own: ``StepPlan.finish``).
        """
        st = self._state
        out = calibration_metrics(
            bounds=st.bounds, n_calibrations=st.n_calibrations, n_degenerate=st.n_degenerate, last=st.last,
            last_step=st.last_calibration_step, last_pooled=st.last_pooled, step=step,
            reference=self.reference, static_alpha=self.alpha, upper_rule=self.upper_rule)
        if step is None or step == st.events_step:
            out.update(event_metrics(st.events, st.run_alpha))
        out.update(self._agreement.metrics(step))
        return out

    def _config(self) -> dict[str, Any]:
        cfg = self.options.to_dict()
        cfg.update({"eps_low": self.eps_low, "eps_high": self.eps_high,
                    "init_bounds": list(self.init_bounds.as_tuple()), "lower_estimator": self.lower_estimator,
                    "seed": self.seed})
        return cfg

    def state_dict(self) -> dict[str, Any]:
        """State for checkpoints: plain Python (JSON friendly) plus, with ``window > 1`` or
        ``sampled``'s pool, earlier windows' tokens as tensors (``torch.save`` friendly)."""
        return {"version": _STATE_VERSION, "config": self._config(), **self._state.state_dict(),
                "agreement": self._agreement.state_dict(),
                "sampled": {"pool": [{"ratio": r.clone(), "shadow_ratio": None if sh is None else sh.clone(),
                                      "advantages": a.clone()} for r, sh, a in self._pool],
                            "history": [w.to_dict() for w in self._history]},
                "windowed": [{"ratio": r.clone(), "shadow_ratio": None if sh is None else sh.clone(),
                              "advantages": a.clone()} for r, sh, a in self._steps]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output; the configuration must match this controller's.
        Version 2 has no ``sampled`` state; version 1 (before the modes) is a ``periodic`` one."""
        version = state.get("version")
        if version not in (1, 2, _STATE_VERSION):
            raise ValueError(f"unsupported calibration state version {version!r}; expected 1, 2 or {_STATE_VERSION}")
        mine, theirs = self._config(), dict(state.get("config", {}))
        if version == 1:
            theirs.setdefault("mode", "periodic")
        theirs.setdefault("lower_estimator", "in_sample")  # saved before the estimator was an option
        if version < 3:  # saved before sampled existed: its options were at their defaults, no seed
            for k in ("sample_fraction", "sample_min", "sample_max", "sample_pool", "sample_target"):
                theirs.setdefault(k, MODE_OPTION_DEFAULTS[k])
            theirs.setdefault("seed", self.seed)
        for k in ("window_target", "window_max", "window_share"):  # saved before the windowed mode existed
            theirs.setdefault(k, MODE_OPTION_DEFAULTS[k])
        diff = sorted(k for k in mine if mine[k] != theirs.get(k))
        if diff:
            detail = ", ".join(f"{k}: checkpoint {theirs.get(k)!r} vs now {mine[k]!r}" for k in diff)
            raise ValueError(f"calibration state was saved with a different configuration ({detail})")
        self._state.load_state_dict(state)
        self._agreement.load_state_dict(state.get("agreement"))
        sampled = state.get("sampled") or {}
        self._pool = [(p["ratio"], p["shadow_ratio"], p["advantages"]) for p in sampled.get("pool", [])]
        self._history = [WindowStats(**w) for w in sampled.get("history", [])]
        self._steps = [(p["ratio"], p["shadow_ratio"], p["advantages"]) for p in state.get("windowed", [])]

    def __repr__(self) -> str:
        return (
            f"CalibratedClipController(mode={self.mode!r}, eps_low={self.eps_low}, eps_high={self.eps_high}, "
            f"period={self.period}, ema={self.ema}, upper_rule={self.upper_rule!r}, reference={self.reference!r}, "
            f"bounds={self._state.bounds})"
        )


def _check_eligible(eligible: torch.Tensor) -> torch.Tensor:
    if not isinstance(eligible, torch.Tensor) or eligible.dim() != 1:
        raise ValueError("eligible must be a 1-D tensor: one flag per sequence of the step (any A != 0)")
    return eligible if eligible.dtype == torch.bool else eligible != 0
