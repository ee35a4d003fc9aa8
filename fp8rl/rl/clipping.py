"""Clip methods: where the PPO clip bounds (low, high) of each training step come from.

The PPO kernel (``fp8rl.rl.policy_loss.ppo_token_loss``) takes the bounds as plain numbers;
a clip method is the small stateful object that supplies them (docs/design.md, "Contracts"):

- ``vanilla``: the fixed PPO / DAPO clip-higher bounds ``(1 - eps_low, 1 + eps_high)``
  (PPO, Schulman et al. 2017; DAPO, Yu et al. 2025, Sec. 3.1: eps_low 0.2, eps_high 0.28).
- ``calibrated``: Calibrated Clipping (the FP8 paper, arXiv 2609.22870, Sec. "Calibrated
  Clipping"): ``fp8rl.rl.calibration.CalibratedClipController``, which recalibrates the
  bounds against BF16 shadow ratios every ``period`` steps.

Every clip method has the same interface (``ClipMethod``), so the trainer loop reads the same
for all of them: the step's plan (``fp8rl.rl.calibration.plan``) says which sequences get a BF16
shadow, which bounds rule which tokens, and collects the step's metrics:

    clipper = make_clipper(cfg.clip_method, eps_low, eps_high, **cfg.clip_options)
    plan = clipper.begin_step(step, eligible=seq_has_nonzero_adv, diagnostics=...)
    for rows in windows: w = plan.window(rows); ... w.calibrate(...) ... w.observe(...)
    metrics = plan.finish()

The paper's sweep axis ``clip`` has three arms, each a pair of independent choices (clip
method x train/rollout IS correction, ``fp8rl.rl.correction.IS_CORRECTIONS``), registered
in ``CLIP_ARMS``, and two controls for Calibrated Clipping that need no shadow (issue 46):

    vanilla       = ClipArm(method="vanilla",       is_correction="none")
    tis           = ClipArm(method="vanilla",       is_correction="tis")
    calibrated    = ClipArm(method="calibrated",    is_correction="tis")
    no_lower_clip = ClipArm(method="no_lower_clip", is_correction="tis")  # A<0 never clipped below
    wide_lower    = ClipArm(method="wide_lower",    is_correction="tis")  # lower bound fixed at 0.6

and Score Centering (issue 47; ``fp8rl.rl.score_centering``), an additive term on the loss that
composes with the arm's IS correction (its mode is the correction's name):

    score_centering     = ClipArm(method="vanilla", is_correction="none", score_centering=True)
    score_centering_tis = ClipArm(method="vanilla", is_correction="tis",  score_centering=True)

Choices made here: the vanilla method's ``update`` accepts and ignores calibration stats
(it never has calibration steps, so a generic loop never calls it); options a method does
not know raise ``TypeError`` naming the method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from fp8rl.registry import Registry
from fp8rl.rl.calibration import Bounds, CalibratedClipController, StepPlan
from fp8rl.rl.correction import IS_CORRECTIONS

__all__ = ["CLIP_ARMS", "CLIP_METHODS", "CalibratingMethod", "ClipArm", "ClipMethod", "NoLowerClip", "VanillaClip",
           "WideLowerClip", "make_clipper", "method_calibrates"]


@runtime_checkable
class ClipMethod(Protocol):
    """What the trainer needs from a clip method (see the module docstring for the loop)."""

    def needs_shadow(self, step: int) -> bool: ...

    def begin_step(self, step: int, *, eligible: torch.Tensor, diagnostics: bool = False,
                   rank: int = 0, holdout_share: float = 0.0, seed: int = 0) -> StepPlan: ...

    def is_calibration_step(self, step: int) -> bool: ...

    def bounds(self, step: int) -> Bounds: ...

    def update(
        self,
        step: int,
        *,
        ratio: torch.Tensor,
        shadow_ratio: torch.Tensor | None = None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> Bounds: ...

    def metrics(self, step: int | None = None) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class CalibratingMethod(ClipMethod, Protocol):
    """What :class:`~fp8rl.rl.calibration.StepPlan` also calls on a method whose class sets
    ``calibrates = True`` (:func:`method_calibrates`; ``CalibratedClipController`` is the one
    shipped): its public calibration API. A calibrating method takes ``options=`` (a
    ``CalibrationOptions``) and ``seed=`` and has state to checkpoint."""

    calibrates: ClassVar[bool]
    mode: str

    @property
    def mode_spec(self): ...  # the calibration mode's ModeSpec (fp8rl.rl.calibration.schedule)

    def measures(self, step: int) -> bool: ...

    def update_step(self, step: int, parts: list) -> Bounds: ...

    def calibrate_window(self, step: int, tokens: tuple, *, seq: torch.Tensor | None = None) -> Bounds: ...

    def estimate_flat(self, ratio: torch.Tensor, shadow_ratio: torch.Tensor, advantages: torch.Tensor) -> Bounds: ...


CLIP_METHODS: Registry[type] = Registry("clip method")


@CLIP_METHODS.register("vanilla")
class VanillaClip:
    """Fixed bounds ``(1 - eps_low, 1 + eps_high)``; stateless, never needs a shadow pass."""

    #: a method that takes no calibration options (see :func:`method_calibrates`)
    calibrates: ClassVar[bool] = False

    def __init__(self, eps_low: float, eps_high: float) -> None:
        for name, v in (("eps_low", eps_low), ("eps_high", eps_high)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name} must be a number, got {v!r}")
        if not 0.0 < eps_low < 1.0:
            raise ValueError(f"eps_low must lie in (0, 1) so that 1 - eps_low is a ratio in (0, 1); got {eps_low}")
        if not 0.0 < eps_high < float("inf"):
            raise ValueError(f"eps_high must be finite and > 0; got {eps_high}")
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        self._bounds = Bounds.vanilla(self.eps_low, self.eps_high)

    def needs_shadow(self, step: int) -> bool:
        return False

    def is_calibration_step(self, step: int) -> bool:
        return False

    def bounds(self, step: int) -> Bounds:
        return self._bounds

    def begin_step(self, step: int, *, eligible: torch.Tensor, diagnostics: bool = False, rank: int = 0,
                   holdout_share: float = 0.0, seed: int = 0) -> StepPlan:
        """A plan that measures nothing; with ``diagnostics`` every sequence gets a BF16 shadow
        (the agreement and out-of-sample counts of the vanilla bounds; training unchanged); with
        ``holdout_share`` the held-out rows of ``(seed, step, rank)`` get one
        (``sampling.draw_holdout``, the same rows as every other arm's)."""
        from fp8rl.rl.calibration.sampling import draw_holdout

        if not isinstance(eligible, torch.Tensor) or eligible.dim() != 1:
            raise ValueError("eligible must be a 1-D tensor: one flag per sequence of the step")
        eligible = eligible if eligible.dtype == torch.bool else eligible != 0
        none = torch.zeros(eligible.numel(), dtype=torch.bool, device=eligible.device)
        return StepPlan(self, step, n=eligible.numel(), measured=none,
                        shadowed=torch.ones_like(none) if diagnostics else none, calibrates=False,
                        eligible=eligible,
                        holdout=draw_holdout(eligible, holdout_share, seed=seed, step=step, rank=rank))

    def update(
        self,
        step: int,
        *,
        ratio: torch.Tensor | None = None,
        shadow_ratio: torch.Tensor | None = None,
        advantages: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> Bounds:
        return self._bounds

    def metrics(self, step: int | None = None) -> dict[str, float]:
        return {"clip/low": self._bounds.low, "clip/high": self._bounds.high}

    def state_dict(self) -> dict[str, Any]:
        return {"eps_low": self.eps_low, "eps_high": self.eps_high}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("eps_low"), state.get("eps_high")) != (self.eps_low, self.eps_high):
            raise ValueError(
                f"vanilla clip state was saved with eps ({state.get('eps_low')}, {state.get('eps_high')}), "
                f"this run has ({self.eps_low}, {self.eps_high})"
            )

    def __repr__(self) -> str:
        return f"VanillaClip(eps_low={self.eps_low}, eps_high={self.eps_high})"


#: ``no_lower_clip``'s lower bound: a ratio no FP8 noise reaches (log-ratio < -69), so the lower clip
#: is off in effect while ``Bounds`` keeps ``0 < low``.
NO_LOWER_CLIP_LOW = 1e-30
#: ``wide_lower``'s lower bound: the paper's wide start (``clip.init_bounds`` [0.6, 1.8]), held fixed.
WIDE_LOWER_LOW = 0.6


@CLIP_METHODS.register("no_lower_clip")
class NoLowerClip(VanillaClip):
    """A control for Calibrated Clipping (issue 46): A<0 tokens are never clipped below (the lower
    bound is :data:`NO_LOWER_CLIP_LOW`), the upper bound is vanilla's ``1 + eps_high``. Whatever
    calibration gains by moving the lower bound down, this arm gains without a shadow."""

    def __init__(self, eps_low: float, eps_high: float) -> None:
        super().__init__(eps_low, eps_high)
        self._bounds = Bounds(NO_LOWER_CLIP_LOW, 1.0 + self.eps_high)

    def __repr__(self) -> str:
        return f"NoLowerClip(eps_high={self.eps_high})"


@CLIP_METHODS.register("wide_lower")
class WideLowerClip(VanillaClip):
    """A control for Calibrated Clipping (issue 46): a fixed, wider lower bound
    (:data:`WIDE_LOWER_LOW`, the paper's wide start, i.e. eps_low = 0.4) and vanilla's upper bound;
    no shadow. Calibration earns credit only for what it does beyond a fixed wide bound."""

    def __init__(self, eps_low: float, eps_high: float) -> None:
        super().__init__(eps_low, eps_high)
        self._bounds = Bounds(min(WIDE_LOWER_LOW, 1.0 - self.eps_low), 1.0 + self.eps_high)

    def __repr__(self) -> str:
        return f"WideLowerClip(low={self._bounds.low}, eps_high={self.eps_high})"


CLIP_METHODS.add("calibrated", CalibratedClipController)


def method_calibrates(method: str) -> bool:
    """Whether the clip method ``method`` takes the run's calibration options and seed
    (``options=CalibrationOptions, seed=``): its class attribute ``calibrates`` (False when the
    class does not say). The configs of both scales and the paper-scale plugin ask this, never the
    method's name, so a method registered in ``CLIP_METHODS`` runs at both scales."""
    return bool(getattr(CLIP_METHODS[method], "calibrates", False))


def make_clipper(method: str, eps_low: float, eps_high: float, **options: Any) -> ClipMethod:
    """Build a clip method by registry name; ``options`` go to its constructor.

    ``make_clipper("calibrated", 0.2, 0.28, mode="periodic", period=20, init_bounds=(0.6, 1.8))``, or
    ``make_clipper("calibrated", 0.2, 0.28, options=CalibrationOptions(...), seed=run_seed)``.
    Unknown names raise listing the valid ones; options the method does not take raise.
    """
    cls = CLIP_METHODS[method]
    try:
        return cls(eps_low, eps_high, **options)
    except TypeError as e:
        if options and "unexpected keyword argument" in str(e):
            raise TypeError(f"clip method {method!r} does not take option(s) {sorted(options)}: {e}") from e
        raise


@dataclass(frozen=True)
class ClipArm:
    """One value of the sweep axis ``clip``: a clip method, a train/rollout IS correction and
    whether the loss adds the Score Centering term (``fp8rl.rl.score_centering``; its mode is
    the IS correction's name, so the term composes with the correction the arm applies)."""

    method: str
    is_correction: str
    score_centering: bool = False

    def __post_init__(self) -> None:
        from fp8rl.rl.score_centering import SCORE_CENTERING_MODES

        CLIP_METHODS.check(self.method)
        IS_CORRECTIONS.check(self.is_correction)
        if not isinstance(self.score_centering, bool):
            raise TypeError(f"score_centering must be True or False, got {self.score_centering!r}")
        if self.score_centering and self.is_correction not in SCORE_CENTERING_MODES:
            raise ValueError(f"Score Centering has no mode for the IS correction {self.is_correction!r}; "
                             f"its modes: {list(SCORE_CENTERING_MODES)}")


CLIP_ARMS: Registry[ClipArm] = Registry("clip arm")
CLIP_ARMS.add("vanilla", ClipArm(method="vanilla", is_correction="none"))
CLIP_ARMS.add("tis", ClipArm(method="vanilla", is_correction="tis"))
CLIP_ARMS.add("calibrated", ClipArm(method="calibrated", is_correction="tis"))
# controls for Calibrated Clipping (issue 46): no shadow, TIS like the calibrated arm
CLIP_ARMS.add("no_lower_clip", ClipArm(method="no_lower_clip", is_correction="tis"))
CLIP_ARMS.add("wide_lower", ClipArm(method="wide_lower", is_correction="tis"))
# Score Centering (issue 47): alone, and composed with TIS
CLIP_ARMS.add("score_centering", ClipArm(method="vanilla", is_correction="none", score_centering=True))
CLIP_ARMS.add("score_centering_tis", ClipArm(method="vanilla", is_correction="tis", score_centering=True))
