"""Calibrated Clipping's options: one frozen object, validated once.

``CalibrationOptions`` holds every option of the controller (``CalibratedClipController``) and of
the calibration modes (``schedule.CALIBRATION_MODES``). It checks each value's type and range and
their combinations when it is built (as torchao's float8 configs do), so the config layer
(``fp8rl.config.ClipConfig.calibration_options``), the OpenRLHF plugin spec (``to_dict`` /
``from_dict``, JSON) and the controller all hand the same validated object around instead of
keyword arguments checked in several places. The checks that need the algorithm's epsilons
(the vanilla and initial bounds inside the clamps) are :meth:`CalibrationOptions.check_eps`,
called by the controller, the one place where both meet.

Errors are ``ValueError`` / ``TypeError`` saying what is wrong and how to fix it; ``prefix``
(``"clip."`` from the config) names the config section in them.

Options that only one mode reads (``schedule.MODE_OPTIONS``: ``periodic``'s period, ema, window,
calibrate_at_start; ``sampled``'s sample_fraction, sample_min, sample_max, sample_pool,
sample_target) raise when set to a non-default value with another mode: that mode would ignore
them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fp8rl.rl.calibration.bounds import REFERENCES, Bounds
from fp8rl.rl.calibration.schedule import (
    CALIBRATION_MODES,
    DEFAULT_CALIBRATION_MODE,
    MODE_OPTION_DEFAULTS,
    MODE_OPTIONS,
)

__all__ = ["CalibrationOptions", "ModeOptionError", "options_from"]


class ModeOptionError(ValueError):
    """An option of one mode set to a non-default value with another mode (which would ignore it)."""

    def __init__(self, mode: str, bad: dict[str, Any], prefix: str = "") -> None:
        self.mode, self.bad, self.prefix = mode, bad, prefix
        owners = sorted({m for k in bad for m, opts in MODE_OPTIONS.items() if k in opts})
        it = "it" if len(bad) == 1 else "them"
        got = ", ".join(f"{prefix}{k}={v!r}" for k, v in bad.items())
        names = ", ".join(prefix + k for k in bad)
        dflt = ", ".join(f"{prefix}{k}={MODE_OPTION_DEFAULTS[k]!r}" for k in bad)
        need = " or ".join(f"{prefix}calibration_mode={m}" for m in owners)
        super().__init__(
            f"{got}: only {need} uses {names}; {prefix}calibration_mode={mode!r} "
            f"({CALIBRATION_MODES[mode].summary}) would ignore {it}. Set {need}, or leave {it} at the "
            f"default ({dflt})")


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def _int(name: str, value: Any, minimum: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} ({what}); got {value!r}")
    return value


@dataclass(frozen=True)
class CalibrationOptions:
    """Every option of Calibrated Clipping (defaults are the controller's; ``ClipConfig``
    derives its ``clip.`` keys from these fields and states the two defaults it changes,
    ``fp8rl.config.clip.CONFIG_DEFAULTS``).

    Attributes:
        mode: when the controller measures and which tokens its bounds rule
            (``CALIBRATION_MODES``: ``periodic``, ``pooled``, ``same_batch``, ``sampled``).
        upper_rule: ``contribution`` | ``proportional`` | ``fixed`` (``UPPER_RULES``).
        init_bounds: ``(low, high)`` before the first calibration; None = vanilla.
        reference: ``shadow`` (BF16 shadow ratios) | ``static`` (a given alpha).
        alpha: static reference only: the target lower-clip fraction in [0, 1).
        p_target: static reference with the contribution rule: the BF16 p (> 0).
        low_min: L is clamped to ``[low_min, 1)``.
        high_max: H is clamped to ``(1, high_max]``.
        lower_estimator: ``in_sample`` | ``unbiased`` (``LOWER_ESTIMATORS``); None = the mode's own
            (``CalibrationMode.lower_estimator``).
        period, ema, window, calibrate_at_start: ``periodic``'s options (controller docstring).
        sample_fraction: ``sampled``: the measured share of a step's sequences with A != 0, in
            (0, 1]; None = the share rule (``sampling.choose_share``).
        sample_min, sample_max: ``sampled``: the floor and ceiling of the rule's share.
        sample_pool: ``sampled``: the most optimizer steps whose measured tokens one estimate may
            pool (the rule pools as few as reach its target).
        sample_target: ``sampled``: the rule's target for alpha x n_eff (BF16-clipped A<0 tokens
            the estimate reads, n_eff discounting the correlation within a sequence).
        window_target, window_max: ``windowed``: the alpha n an estimate aims at (> 0; 3 keeps the
            chance of a calibration without BF16 events near 5%) and the most steps it pools;
        window_share: ``windowed``: the share of each step's sequences with A != 0 it shadows, (0, 1].
    """

    mode: str = DEFAULT_CALIBRATION_MODE
    upper_rule: str = "contribution"
    init_bounds: tuple[float, float] | None = None
    reference: str = "shadow"
    alpha: float | None = None
    p_target: float | None = None
    low_min: float = 0.5
    high_max: float = 2.0
    lower_estimator: str | None = None
    period: int = MODE_OPTION_DEFAULTS["period"]
    ema: float = MODE_OPTION_DEFAULTS["ema"]
    window: int = MODE_OPTION_DEFAULTS["window"]
    calibrate_at_start: bool = MODE_OPTION_DEFAULTS["calibrate_at_start"]
    sample_fraction: float | None = MODE_OPTION_DEFAULTS["sample_fraction"]
    sample_min: float = MODE_OPTION_DEFAULTS["sample_min"]
    sample_max: float = MODE_OPTION_DEFAULTS["sample_max"]
    sample_pool: int = MODE_OPTION_DEFAULTS["sample_pool"]
    sample_target: float = MODE_OPTION_DEFAULTS["sample_target"]
    window_target: float = MODE_OPTION_DEFAULTS["window_target"]
    window_max: int = MODE_OPTION_DEFAULTS["window_max"]
    window_share: float = MODE_OPTION_DEFAULTS["window_share"]

    def __post_init__(self) -> None:
        self.check()

    # ----- construction ---------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any], prefix: str = "") -> CalibrationOptions:
        """Build from plain values (JSON, a config); unknown keys raise naming the valid ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise TypeError(f"unknown calibration option(s) {[prefix + k for k in unknown]}; "
                            f"valid options are: {sorted(prefix + n for n in names)}")
        d = dict(data)
        if d.get("init_bounds") is not None:
            d["init_bounds"] = tuple(d["init_bounds"])
        try:
            return cls(**d)
        except ModeOptionError as e:
            raise ModeOptionError(e.mode, e.bad, prefix) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON friendly: ``init_bounds`` a list)."""
        d = dataclasses.asdict(self)
        if d["init_bounds"] is not None:
            d["init_bounds"] = list(d["init_bounds"])
        return d

    def replace(self, **changes: Any) -> CalibrationOptions:
        return dataclasses.replace(self, **changes)

    # ----- derived --------------------------------------------------------------------------

    @property
    def mode_spec(self):
        """The mode object (``schedule.CalibrationMode``)."""
        return CALIBRATION_MODES[self.mode]

    @property
    def resolved_lower_estimator(self) -> str:
        """``lower_estimator``, or the mode's own when None."""
        return self.lower_estimator if self.lower_estimator is not None else self.mode_spec.lower_estimator

    # ----- checks ---------------------------------------------------------------------------

    def check(self) -> None:
        """Types, ranges and combinations that need no epsilons (raises)."""
        from fp8rl.rl.calibration.lower import LOWER_ESTIMATORS
        from fp8rl.rl.calibration.upper import UPPER_RULES

        if not isinstance(self.mode, str):
            raise TypeError(f"mode must be a string, one of {', '.join(CALIBRATION_MODES)}; got {self.mode!r}")
        CALIBRATION_MODES.check(self.mode)
        if not isinstance(self.upper_rule, str):
            raise TypeError(f"upper_rule must be a string; got {self.upper_rule!r}")
        UPPER_RULES.check(self.upper_rule)
        if self.reference not in REFERENCES:
            raise ValueError(f"unknown reference {self.reference!r}; valid values are: {', '.join(REFERENCES)}")
        if self.lower_estimator is not None:
            LOWER_ESTIMATORS.check(self.lower_estimator)
        low_min = _finite("low_min", self.low_min)
        high_max = _finite("high_max", self.high_max)
        if not 0.0 < low_min < 1.0:
            raise ValueError(f"low_min must lie in (0, 1) (clamp of the lower bound); got {low_min}")
        if not high_max > 1.0:
            raise ValueError(f"high_max must be > 1 (clamp of the upper bound); got {high_max}")
        if self.reference == "static":
            self._check_static()
        elif self.alpha is not None or self.p_target is not None:
            raise ValueError("alpha / p_target are only used with reference='static' (the shadow reference "
                             "measures them on each calibration step)")
        if self.init_bounds is not None:
            init = self.init
            if not (low_min <= init.low and init.high <= high_max):
                raise ValueError(f"init_bounds ({init.low}, {init.high}) must lie inside the clamps "
                                 f"[low_min={low_min}, 1) and (1, high_max={high_max}]")
        self._check_mode_options()

    def _check_static(self) -> None:
        if self.alpha is None:
            raise ValueError("reference='static' needs alpha (the BF16 baseline's lower-clip fraction, "
                             "e.g. its logged actor/clipfrac_neg_low)")
        if not 0.0 <= _finite("alpha", self.alpha) < 1.0:
            raise ValueError(f"alpha must lie in [0, 1); got {self.alpha}")
        if self.upper_rule == "contribution":
            if self.p_target is None:
                raise ValueError("reference='static' with upper_rule='contribution' needs p_target (the BF16 "
                                 "baseline's positive/negative contribution ratio); or use upper_rule="
                                 "'proportional' or 'fixed'")
            if not _finite("p_target", self.p_target) > 0.0:
                raise ValueError(f"p_target must be > 0; got {self.p_target}")
        elif self.p_target is not None:
            raise ValueError("p_target is only used by upper_rule='contribution'")
        if self.mode_spec.subset:
            raise ValueError(f"mode {self.mode!r} measures a BF16 shadow on a subset of the tokens; "
                             "reference='static' runs no shadow: use mode 'pooled' or 'periodic' with it")

    def _check_mode_options(self) -> None:
        _int("period", self.period, 1, "steps between calibrations")
        ema = _finite("ema", self.ema)
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema is the weight of the previous bound and must lie in [0, 1) (0 = no smoothing); "
                             f"got {ema}")
        _int("window", self.window, 1, "calibrations pooled, 1 = none")
        if not isinstance(self.calibrate_at_start, bool):
            raise TypeError(f"calibrate_at_start must be a bool; got {self.calibrate_at_start!r}")
        if self.sample_fraction is not None:
            f = _finite("sample_fraction", self.sample_fraction)
            if not 0.0 < f <= 1.0:
                raise ValueError(f"sample_fraction is a share of sequences in (0, 1] (null = the share rule); got {f}")
        lo, hi = _finite("sample_min", self.sample_min), _finite("sample_max", self.sample_max)
        if not 0.0 < lo <= hi <= 1.0:
            raise ValueError(f"sample_min and sample_max must satisfy 0 < sample_min <= sample_max <= 1 (the floor "
                             f"and ceiling of the share rule); got {lo}, {hi}")
        _int("sample_pool", self.sample_pool, 1, "optimizer steps one estimate may pool")
        if not _finite("sample_target", self.sample_target) > 0.0:
            raise ValueError(f"sample_target (alpha x n_eff the share rule aims at) must be > 0; "
                             f"got {self.sample_target}")
        if not _finite("window_target", self.window_target) > 0.0:
            raise ValueError(f"window_target (the alpha n a windowed estimate aims at) must be > 0; "
                             f"got {self.window_target}")
        _int("window_max", self.window_max, 1, "steps one windowed estimate may pool")
        share = _finite("window_share", self.window_share)
        if not 0.0 < share <= 1.0:
            raise ValueError(f"window_share is the share of a step's sequences a windowed calibration shadows, "
                             f"in (0, 1]; got {share}")
        mine = set(MODE_OPTIONS[self.mode])
        bad = {k: getattr(self, k) for k in MODE_OPTION_DEFAULTS
               if k not in mine and getattr(self, k) != MODE_OPTION_DEFAULTS[k]}
        if bad:
            raise ModeOptionError(self.mode, bad)

    @property
    def init(self) -> Bounds | None:
        """``init_bounds`` as ``Bounds`` (None = vanilla)."""
        if self.init_bounds is None:
            return None
        if isinstance(self.init_bounds, Bounds):
            return self.init_bounds
        try:
            lo, hi = self.init_bounds
        except (TypeError, ValueError) as e:
            raise ValueError(f"init_bounds must be a (low, high) pair; got {self.init_bounds!r}") from e
        return Bounds(lo, hi)

    def check_eps(self, eps_low: float, eps_high: float) -> tuple[float, float, Bounds, Bounds]:
        """The checks that need the algorithm's epsilons; returns ``(eps_low, eps_high, vanilla,
        init)`` (init = vanilla when ``init_bounds`` is None)."""
        eps_low = _finite("eps_low", eps_low)
        eps_high = _finite("eps_high", eps_high)
        if not 0.0 < eps_low < 1.0:
            raise ValueError(f"eps_low must lie in (0, 1) so that 1 - eps_low is a ratio in (0, 1); got {eps_low}")
        if not eps_high > 0.0:
            raise ValueError(f"eps_high must be > 0; got {eps_high}")
        vanilla = Bounds.vanilla(eps_low, eps_high)
        if not (self.low_min <= vanilla.low and vanilla.high <= self.high_max):
            raise ValueError(
                f"the vanilla bounds ({vanilla.low}, {vanilla.high}) must lie inside the clamps "
                f"[low_min={self.low_min}, 1) and (1, high_max={self.high_max}]; widen the clamps")
        init = self.init or vanilla
        return eps_low, eps_high, vanilla, init


def options_from(init_bounds: Bounds | Sequence[float] | None = None, **kw: Any) -> CalibrationOptions:
    """``CalibrationOptions`` from keyword arguments (``init_bounds`` may be ``Bounds``)."""
    if isinstance(init_bounds, Bounds):
        init_bounds = init_bounds.as_tuple()
    elif init_bounds is not None:
        try:
            init_bounds = tuple(float(x) for x in init_bounds)
        except (TypeError, ValueError) as e:
            raise ValueError(f"init_bounds must be Bounds or a (low, high) pair; got {init_bounds!r}") from e
        if len(init_bounds) != 2:
            raise ValueError(f"init_bounds must be Bounds or a (low, high) pair; got {init_bounds!r}")
        Bounds(*init_bounds)
    return CalibrationOptions(init_bounds=init_bounds, **kw)
