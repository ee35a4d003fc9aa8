"""``clip:`` -- the clip-method arm (vanilla, TIS, Calibrated Clipping) and its calibration options.

``ClipConfig``'s calibration fields are not declared here: they are derived from the fields of
``fp8rl.rl.calibration.CalibrationOptions`` (:func:`_calibration_fields`), so an option added
there is a ``clip.<name>`` key at once, with its type. Two things differ from the options, on
purpose, and only here:

- a name: ``CalibrationOptions.mode`` is ``clip.calibration_mode`` (:data:`CONFIG_NAMES`);
- four defaults (:data:`CONFIG_DEFAULTS`): ``init_bounds`` [0.6, 1.8], the paper's wide start,
  where the controller's own default (None) starts at the vanilla bounds; ``low_min`` 0.05,
  the floor of the lower bound, where the controller's 0.5 binds at mini scale (with it
  ``same_batch`` clipped up to 3x the BF16 shadow's count; docs/mini.md, "The floor"); and
  ``period`` and ``window`` None: the run's scale preset (:meth:`ClipConfig.settle`).

**Scale presets.** ``periodic``'s schedule depends on the run's length: the paper recalibrates
every 20 of its 200+ steps (the options' defaults, period 20, window 1), a 20-step mini run every 4
steps pooling the last 4 calibrations (the setting issue 46's held-out judgement chose). A run
config class names its preset (``RunConfig.CALIBRATION_PRESETS``); ``period`` / ``window`` left
None take it when the mode reads them, and the options' defaults otherwise, so choosing another
mode (``clip.calibration_mode=same_batch``) never trips the check that refuses an option the mode
would ignore. The resolved values are what the run's config, identity and ``config.yaml`` hold.

**Arms that do not calibrate** (vanilla, TIS, the controls) carry :data:`NEUTRAL_CALIBRATION`
whatever the config says (:meth:`ClipConfig.settle`): the options cannot change what they compute,
so they must not change their identity either. These are the values every such arm carried while
``same_batch`` was the default mode, so published run directories keep their names.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from fp8rl.config.validation import _check_registry, _require
from fp8rl.rl.calibration.options import CalibrationOptions
from fp8rl.rl.calibration.schedule import MODE_OPTION_DEFAULTS

#: ``CalibrationOptions`` field -> its ``clip.`` key, where the two names differ.
CONFIG_NAMES: dict[str, str] = {"mode": "calibration_mode"}
#: ``CalibrationOptions`` field -> the config's default, where it differs on purpose (module docstring).
CONFIG_DEFAULTS: dict[str, Any] = {"init_bounds": (0.6, 1.8), "low_min": 0.05, "period": None, "window": None}
#: The config's type of a field, where the option's does not suit a YAML key (a list, not a tuple;
#: None allowed for a scale preset).
_CONFIG_TYPES: dict[str, Any] = {"init_bounds": list[float], "period": int | None, "window": int | None}
#: The options a scale may preset (``RunConfig.CALIBRATION_PRESETS``): None in the config = preset.
PRESET_KEYS: tuple[str, ...] = ("period", "window")


def _calibration_fields() -> list[tuple[str, Any, Any]]:
    """``(clip key, type, field)`` of every ``CalibrationOptions`` field, in its order."""
    hints = typing.get_type_hints(CalibrationOptions)
    out = []
    for f in dataclasses.fields(CalibrationOptions):
        default = CONFIG_DEFAULTS.get(f.name, f.default)
        spec = (field(default_factory=lambda d=default: list(d)) if isinstance(default, (list, tuple))
                else field(default=default))
        out.append((CONFIG_NAMES.get(f.name, f.name), _CONFIG_TYPES.get(f.name, hints[f.name]), spec))
    return out


#: The calibration part of ``ClipConfig``: one field per ``CalibrationOptions`` field.
_CalibrationFields = dataclasses.make_dataclass("_CalibrationFields", _calibration_fields())

#: ``clip.<key>`` -> value of every calibration option for an arm that does not calibrate: the
#: config's defaults, with the mode and ``periodic``'s preset keys at the values such arms carried
#: while ``same_batch`` was the default mode (so published non-calibrating runs keep their identity).
NEUTRAL_CALIBRATION: dict[str, Any] = {
    **{f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
       for f in dataclasses.fields(_CalibrationFields)},
    "calibration_mode": "same_batch",
    **{k: MODE_OPTION_DEFAULTS[k] for k in PRESET_KEYS},
}


@dataclass
class ClipConfig(_CalibrationFields):
    """Clip-method arm and its options (``fp8rl.rl.clipping.CLIP_ARMS`` and the controller).

    Attributes:
        arm: ``vanilla`` (vanilla bounds, no IS correction), ``tis`` (vanilla bounds + token
            TIS) or ``calibrated`` (Calibrated Clipping + TIS); ``CLIP_ARMS`` maps the arm to
            (clip method, IS correction).
        tis_cap: TIS truncation C (paper: 2).
        score_centering_topk: k, the sampler's top-k ids and log-probs logged per generated
            token for the Score Centering arms (``score_centering``, ``score_centering_tis``);
            the other arms log none. Default 8 (our choice: the mini vocabulary has 3 specials +
            the alphabet; vLLM's default ``max_logprobs`` is 20).
        holdout_share: the share of each step's sequences (with A != 0) held out for every arm
            alike (issue 46): shadowed, never fed to a calibration, and scored against the bounds
            in force on them (``shadow/ho_*``: the deployed bound judged on tokens it never saw);
            drawn from the run seed and the step only, so every arm of a seed holds out the same
            rows. 0 (default): none, and no extra shadow.
        shadow_diagnostics: on a non-calibrated arm (vanilla, tis), also run the BF16 shadow on
            every step's mini-batches and log which tokens FP8 clips against which BF16 would
            clip (``shadow/*`` agreement metrics) without changing training. The calibrated arm
            logs them on its measured steps anyway.
        calibration_mode, and every other field of ``CalibrationOptions`` (``period``, ``ema``,
            ``window``, ``calibrate_at_start``, ``upper_rule``, ``init_bounds``, ``reference``,
            ``alpha``, ``p_target``, ``low_min``, ``high_max``, ``lower_estimator``,
            ``sample_*``): the calibration options, documented there; the config's defaults are
            the options' but for :data:`CONFIG_DEFAULTS` (``period`` / ``window`` None: the
            run's scale preset, module docstring). They are built into one validated
            ``CalibrationOptions`` for every arm (:meth:`calibration_options`): an option of one
            mode set with another raises; an arm that does not calibrate carries
            :data:`NEUTRAL_CALIBRATION` once its run config settles it (:meth:`settle`).
    """

    arm: str = "vanilla"
    tis_cap: float = 2.0
    score_centering_topk: int = 8
    holdout_share: float = 0.0
    shadow_diagnostics: bool = False

    def __post_init__(self) -> None:
        _check_registry("fp8rl.rl.clipping", "CLIP_ARMS", self.arm, "clip.arm")
        _check_registry("fp8rl.rl.calibration", "CALIBRATION_MODES", self.calibration_mode, "clip.calibration_mode")
        _check_registry("fp8rl.rl.calibration", "UPPER_RULES", self.upper_rule, "clip.upper_rule")
        if self.lower_estimator is not None:
            _check_registry("fp8rl.rl.calibration", "LOWER_ESTIMATORS", self.lower_estimator, "clip.lower_estimator")
        _require(self.tis_cap > 0, f"clip.tis_cap must be > 0 (inf = no truncation), got {self.tis_cap}")
        _require(isinstance(self.score_centering_topk, int) and not isinstance(self.score_centering_topk, bool)
                 and self.score_centering_topk >= 1,
                 f"clip.score_centering_topk must be an integer >= 1 (the sampler's top-k ids logged per "
                 f"token), got {self.score_centering_topk!r}")
        _require(not isinstance(self.holdout_share, bool) and isinstance(self.holdout_share, (int, float))
                 and 0.0 <= self.holdout_share < 1.0,
                 f"clip.holdout_share is a share of each step's sequences in [0, 1) (0 = none), got "
                 f"{self.holdout_share!r}")
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

    @property
    def score_centering(self) -> bool:
        """Whether the arm adds the Score Centering term to the loss."""
        from fp8rl.rl.clipping import CLIP_ARMS

        return CLIP_ARMS[self.arm].score_centering

    def score_centering_options(self) -> dict | None:
        """``{"mode", "bounds", "topk"}`` of the arm's Score Centering term (None: the arm has
        none): the mode is the arm's IS correction, the bounds its (tis: ``(0, tis_cap)``, as
        ``TIS`` never clamps from below; icepop: the correction's defaults)."""
        if not self.score_centering:
            return None
        from fp8rl.rl.score_centering import DEFAULT_BOUNDS

        mode = self.is_correction
        bounds = None if mode == "none" else ((0.0, float(self.tis_cap)) if mode == "tis" else DEFAULT_BOUNDS[mode])
        return {"mode": mode, "bounds": bounds, "topk": int(self.score_centering_topk)}

    def settle(self, presets: dict[str, dict[str, int]] | None = None) -> None:
        """Resolve the config for a run whose config class presets ``presets`` (mode -> {key:
        value} for :data:`PRESET_KEYS`; ``RunConfig.CALIBRATION_PRESETS``): an arm that does not
        calibrate takes :data:`NEUTRAL_CALIBRATION`; a calibrating arm's ``period`` / ``window``
        left None take the preset of its mode, or the options' defaults when the mode has none
        (module docstring). Idempotent."""
        from fp8rl.rl.clipping import method_calibrates

        if not method_calibrates(self.method):
            for key, value in NEUTRAL_CALIBRATION.items():
                setattr(self, key, list(value) if isinstance(value, (list, tuple)) else value)
        else:
            preset = (presets or {}).get(self.calibration_mode, {})
            for key in PRESET_KEYS:
                if getattr(self, key) is None:
                    setattr(self, key, preset.get(key, MODE_OPTION_DEFAULTS[key]))
        self.calibration_options()

    def calibration_options(self) -> CalibrationOptions:
        """The calibration options as one validated ``CalibrationOptions`` (built for every arm:
        the config carries them either way; errors name ``clip.<key>``). ``period`` / ``window``
        still None (a config no run settled) are the options' defaults."""
        values = {f.name: getattr(self, CONFIG_NAMES.get(f.name, f.name))
                  for f in dataclasses.fields(CalibrationOptions)}
        for key in PRESET_KEYS:
            if values[key] is None:
                values[key] = MODE_OPTION_DEFAULTS[key]
        try:
            return CalibrationOptions.from_dict(values, prefix="clip.")
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
