"""The BF16 shadow of one mini trainer step: what is measured, which bounds each loss uses.

Calibrated Clipping needs FP8 and BF16 ratios of the *same* tokens (the paper's shadow is two
extra BF16 forwards: old policy and current policy). On a measured step:

1. the old log-probs are also computed under ``fp8_disabled`` (BF16 old log-probs, the first
   shadow forward, on the weights theta_0 that sampled the batch, in the same micro-batches),
   once per step;
2. **every** mini-batch (the first included) is measured: before its update (weights
   theta_j) its training forward gives the FP8 log-probs and one more no-grad forward under
   ``fp8_disabled`` the BF16 current log-probs of the same tokens (the second shadow forward);
3. by ``clip.calibration_mode`` (``fp8rl.rl.calibration.CALIBRATION_MODES``):
   ``periodic`` / ``pooled``: after the step's updates the controller gets all measured tokens
   pooled (``update``) and its bounds rule from the next step; ``same_batch``: each
   mini-batch's bounds come from its own tokens (``update_batch``) and its own loss uses them.

``clip.shadow_diagnostics`` on a non-calibrated arm measures every step the same way and only
counts which tokens the loss clips (vanilla bounds) against which BF16 would clip; training is
unchanged. A trainer without FP8 layers (``bf16``, ``rollout_only``) computes BF16 already: its
own ratios are the shadow, no extra forward runs (recall = precision = 1, logged for the table).

Metrics: the agreement counts and rates (``shadow/*``; ``fp8rl.rl.calibration.agreement``) on
measured steps; ``perf/shadow_s`` = the shadow forwards and the controller's work; with
``same_batch`` ``clip/low`` / ``clip/high`` are the mean over the step's mini-batches of the
bounds their losses used (``clip/low_min_batch`` / ``clip/high_max_batch`` the extremes).
"""

from __future__ import annotations

import time

import torch

from fp8rl.rl.calibration import AgreementTally, Bounds
from fp8rl.runs import metrics as M

__all__ = ["StepShadow"]


class StepShadow:
    """The shadow / calibration work of one step (controller step ``ctl_step``, from 0).

    Attributes: ``measure`` (mini-batches get a shadow ratio), ``extra_forward`` (the shadow
    needs its own BF16 forwards: the trainer has FP8 layers), ``calibrate`` (the controller
    gets data this step), ``per_batch`` (``same_batch``).
    """

    def __init__(self, clipper, clip_cfg, ctl_step: int, *, has_fp8: bool) -> None:
        calibrated = clip_cfg.method == "calibrated"
        self.clipper, self.ctl_step = clipper, ctl_step
        self.calibrate = calibrated and clipper.is_calibration_step(ctl_step)
        self.per_batch = self.calibrate and clipper.per_batch
        self.diagnostic = not calibrated and clip_cfg.shadow_diagnostics
        self.measure = (self.calibrate and clipper.measures(ctl_step)) or self.diagnostic
        self.extra_forward = self.measure and has_fp8
        self.tally = AgreementTally()
        self.measured: list[dict] = []
        self.applied: list[Bounds] = []
        self.shadow_s = 0.0
        self.step_bounds = clipper.bounds(ctl_step)  # in force for the step (not same_batch)

    def bounds_for(self, ratio: torch.Tensor, shadow_ratio: torch.Tensor | None, adv: torch.Tensor,
                   mask: torch.Tensor) -> Bounds:
        """The bounds of one mini-batch's loss, given its FP8 ratios ``[n, T]`` (before its
        update) and, when measured, the BF16 shadow ratios of the same tokens; records what the
        step's metrics and the controller need."""
        t0 = time.perf_counter()
        if self.per_batch:
            b = self.clipper.update_batch(self.ctl_step, ratio=ratio, shadow_ratio=shadow_ratio, advantages=adv,
                                          mask=mask)
        else:
            b = self.step_bounds
            if self.calibrate:
                self.measured.append({"ratio": ratio, "shadow_ratio": shadow_ratio, "advantages": adv, "mask": mask})
            if self.diagnostic:
                vanilla = Bounds.vanilla(self.clipper.eps_low, self.clipper.eps_high)
                self.tally.add(self.ctl_step, ratio, shadow_ratio, adv, mask, applied=b, vanilla=vanilla)
        self.applied.append(b)
        if self.measure or self.calibrate:
            self.shadow_s += time.perf_counter() - t0
        return b

    def finish(self) -> dict:
        """After the step's updates: the pooled controller update (``periodic``/``pooled``) and
        the step's clip / shadow metrics."""
        from fp8rl.backends.mini.stats import pooled_calibration

        t0 = time.perf_counter()
        out: dict = {}
        ctl, step = self.clipper, self.ctl_step
        if self.per_batch:
            lows = [b.low for b in self.applied]
            highs = [b.high for b in self.applied]
            out.update({M.CLIP_LOW: sum(lows) / len(lows), M.CLIP_HIGH: sum(highs) / len(highs),
                        "clip/low_min_batch": min(lows), "clip/high_max_batch": max(highs)})
        else:
            out.update({M.CLIP_LOW: self.step_bounds.low, M.CLIP_HIGH: self.step_bounds.high})
        if self.calibrate:
            if not self.per_batch:
                new = ctl.update(step, **pooled_calibration(self.measured, self.measure))
                out.update({"clip/low_next": new.low, "clip/high_next": new.high})
            out.update({k: v for k, v in ctl.metrics(step).items() if k not in (M.CLIP_LOW, M.CLIP_HIGH)})
        elif hasattr(ctl, "mode"):  # calibrated, not measured this step: the running counters
            out.update({k: v for k, v in ctl.metrics().items()
                        if k in ("clip/calibrations", "clip/degenerate_updates", M.CLIP_ALPHA)})
        out.update(self.tally.metrics(step))
        if self.measure or self.calibrate:
            self.shadow_s += time.perf_counter() - t0
        if self.measure:
            out[M.PERF_SHADOW_S] = self.shadow_s
        return out
