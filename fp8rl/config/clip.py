"""``clip:`` -- the clip-method arm (vanilla, TIS, Calibrated Clipping) and its calibration options."""

from __future__ import annotations

from dataclasses import dataclass, field

from fp8rl.config.validation import _check_registry, _require
from fp8rl.rl.calibration.schedule import DEFAULT_CALIBRATION_MODE, MODE_OPTION_DEFAULTS


@dataclass
class ClipConfig:
    """Clip-method arm and its options (``fp8rl.rl.clipping.CLIP_ARMS`` and the controller).

    Attributes:
        arm: ``vanilla`` (vanilla bounds, no IS correction), ``tis`` (vanilla bounds + token
            TIS) or ``calibrated`` (Calibrated Clipping + TIS); ``CLIP_ARMS`` maps the arm to
            (clip method, IS correction).
        tis_cap: TIS truncation C (paper: 2).
        calibration_mode: when the calibrated arm measures and which tokens its bounds rule
            (``fp8rl.rl.calibration.CALIBRATION_MODES``: ``periodic``, ``pooled``,
            ``same_batch``, ``sampled``; default ``DEFAULT_CALIBRATION_MODE``).
        period, ema, window, calibrate_at_start: ``periodic``'s options; setting one to a
            non-default value with another mode raises.
        sample_fraction, sample_min, sample_max, sample_pool, sample_target: ``sampled``'s options
            (``fp8rl.rl.calibration.CalibrationOptions``; ``sampling`` has the share rule);
            setting one to a non-default value with another mode raises.
        upper_rule, init_bounds, reference, alpha, p_target, low_min, high_max: the other
            options of ``fp8rl.rl.calibration.CalibratedClipController`` (used by
            ``calibrated`` only; see that class). ``init_bounds`` default [0.6, 1.8] is the
            paper's wide start.
        lower_estimator: the lower bound's estimator (``fp8rl.rl.calibration.LOWER_ESTIMATORS``:
            ``in_sample``, ``unbiased``); null = the mode's own (same_batch: in_sample, exact on
            the tokens its bounds rule; periodic, pooled: unbiased for the later tokens).
        shadow_diagnostics: on a non-calibrated arm (vanilla, tis), also run the BF16 shadow on
            every step's mini-batches and log which tokens FP8 clips against which BF16 would
            clip (``shadow/*`` agreement metrics) without changing training. The calibrated arm
            logs them on its measured steps anyway.
    """

    arm: str = "vanilla"
    tis_cap: float = 2.0
    calibration_mode: str = DEFAULT_CALIBRATION_MODE
    period: int = MODE_OPTION_DEFAULTS["period"]
    ema: float = MODE_OPTION_DEFAULTS["ema"]
    upper_rule: str = "contribution"
    init_bounds: list[float] = field(default_factory=lambda: [0.6, 1.8])
    reference: str = "shadow"
    alpha: float | None = None
    p_target: float | None = None
    low_min: float = 0.05
    high_max: float = 2.0
    calibrate_at_start: bool = MODE_OPTION_DEFAULTS["calibrate_at_start"]
    window: int = MODE_OPTION_DEFAULTS["window"]
    shadow_diagnostics: bool = False
    lower_estimator: str | None = None
    sample_fraction: float | None = MODE_OPTION_DEFAULTS["sample_fraction"]
    sample_min: float = MODE_OPTION_DEFAULTS["sample_min"]
    sample_max: float = MODE_OPTION_DEFAULTS["sample_max"]
    sample_pool: int = MODE_OPTION_DEFAULTS["sample_pool"]
    sample_target: float = MODE_OPTION_DEFAULTS["sample_target"]

    def __post_init__(self) -> None:
        _check_registry("fp8rl.rl.clipping", "CLIP_ARMS", self.arm, "clip.arm")
        _check_registry("fp8rl.rl.calibration", "CALIBRATION_MODES", self.calibration_mode, "clip.calibration_mode")
        _check_registry("fp8rl.rl.calibration", "UPPER_RULES", self.upper_rule, "clip.upper_rule")
        if self.lower_estimator is not None:
            _check_registry("fp8rl.rl.calibration", "LOWER_ESTIMATORS", self.lower_estimator, "clip.lower_estimator")
        _require(self.tis_cap > 0, f"clip.tis_cap must be > 0 (inf = no truncation), got {self.tis_cap}")
        _require(isinstance(self.shadow_diagnostics, bool),
                 f"clip.shadow_diagnostics must be true or false, got {self.shadow_diagnostics!r}")
        b = list(self.init_bounds)
        _require(len(b) == 2 and 0 < b[0] < 1 < b[1],
                 f"clip.init_bounds must be [low, high] with 0 < low < 1 < high, got {b}")
        self.calibration_options()  # every calibration option, checked once (CalibrationOptions)

    @property
    def method(self) -> str:
        """The clip method of the arm (``vanilla`` or ``calibrated``)."""
        from fp8rl.rl.clipping import CLIP_ARMS

        return CLIP_ARMS[self.arm].method

    @property
    def is_correction(self) -> str:
        """The train/rollout IS correction of the arm (``none`` or ``tis``)."""
        from fp8rl.rl.clipping import CLIP_ARMS

        return CLIP_ARMS[self.arm].is_correction

    def calibration_options(self):
        """The calibration options as one validated ``fp8rl.rl.calibration.CalibrationOptions``
        (built for every arm: the config carries them either way; errors name ``clip.<key>``)."""
        from fp8rl.rl.calibration import CalibrationOptions

        try:
            return CalibrationOptions.from_dict({
                "mode": self.calibration_mode, "period": self.period, "ema": self.ema,
                "upper_rule": self.upper_rule, "init_bounds": tuple(self.init_bounds), "reference": self.reference,
                "alpha": self.alpha, "p_target": self.p_target, "low_min": self.low_min, "high_max": self.high_max,
                "calibrate_at_start": self.calibrate_at_start, "window": self.window,
                "lower_estimator": self.lower_estimator, "sample_fraction": self.sample_fraction,
                "sample_min": self.sample_min, "sample_max": self.sample_max, "sample_pool": self.sample_pool,
                "sample_target": self.sample_target}, prefix="clip.")
        except (TypeError, ValueError) as e:
            if str(e).startswith("clip."):
                raise
            raise type(e)(f"clip options: {e}") from e

    def clipper_options(self, seed: int = 0) -> dict:
        """Constructor options of the arm's clip method (``make_clipper``): for a method that
        calibrates (``fp8rl.rl.clipping.method_calibrates``: ``calibrated``) the
        ``CalibrationOptions`` and the run's ``seed`` (``sampled``'s draw); empty otherwise."""
        from fp8rl.rl.clipping import method_calibrates

        if not method_calibrates(self.method):
            return {}
        return {"options": self.calibration_options(), "seed": int(seed)}

    def correction_params(self) -> dict:
        """Parameters of the arm's IS correction (``{"cap": tis_cap}`` for tis)."""
        return {"cap": self.tis_cap} if self.is_correction == "tis" else {}
