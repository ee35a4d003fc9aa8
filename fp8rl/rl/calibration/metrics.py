"""The controller's metrics: its bounds, its last calibration, and the step's clip agreement.

- :func:`calibration_metrics`: ``clip/*`` and ``shadow/*`` numbers of the controller's state
  (see ``CalibratedClipController.metrics``);
- :class:`AgreementTally`: sums ``agreement.agreement_counts`` over the measured token sets of
  one step (mini-batches, pooled calibrations) and reports them with recall/precision
  (``agreement.agreement_metrics``). Used by the controller and by a trainer's diagnostic
  shadow on non-calibrated runs (bounds in force = vanilla), so both log the same keys.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8rl.rl.calibration.agreement import COUNT_KEYS, agreement_counts, agreement_metrics
from fp8rl.rl.calibration.estimators import Bounds, Calibration
from fp8rl.runs import metrics as M

__all__ = ["LOW_DATA_TOKENS", "AgreementTally", "calibration_metrics", "event_metrics"]

#: ``clip/low_data`` flags a calibration whose alpha n (A<0 tokens below L) is under this.
LOW_DATA_TOKENS = 5


class AgreementTally:
    """Agreement counts summed over one step (a new step starts a new sum).

    ``add(step, ratio, shadow_ratio, advantages, mask, applied=Bounds, vanilla=Bounds)``
    counts one token set (shapes as ``agreement_counts``); ``metrics(step)`` returns the
    counts and rates of ``step`` ({} if nothing was counted at that step).
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self.counts = torch.zeros(len(COUNT_KEYS), dtype=torch.int64)

    def add_counts(self, step: int, counts: torch.Tensor) -> None:
        if step != self.step:
            self.step, self.counts = step, torch.zeros(len(COUNT_KEYS), dtype=torch.int64)
        self.counts = self.counts + counts.to(torch.int64).cpu()

    def add(self, step: int, ratio: torch.Tensor, shadow_ratio: torch.Tensor, advantages: torch.Tensor,
            mask: torch.Tensor, *, applied: Bounds, vanilla: Bounds) -> torch.Tensor:
        """Count one token set clipped with ``applied`` (FP8) against ``vanilla`` (BF16); returns
        its ``[6]`` counts."""
        c = agreement_counts(ratio, shadow_ratio, advantages, mask, low=applied.low, high=applied.high,
                             vanilla_low=vanilla.low, vanilla_high=vanilla.high)
        self.add_counts(step, c)
        return c

    def metrics(self, step: int | None = None) -> dict[str, float]:
        if self.step is None or (step is not None and step != self.step):
            return {}
        return agreement_metrics(self.counts)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "counts": [int(x) for x in self.counts.tolist()]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.step = state.get("step")
        self.counts = torch.tensor(state.get("counts", [0] * len(COUNT_KEYS)), dtype=torch.int64)


def event_metrics(events: list[tuple[int, int, float]], run_alpha: float) -> dict[str, float]:
    """How much data the calibrations of one step had (issue 46), means over them:

    ``clip/k`` (A<0 tokens BF16 clips below 1 - eps_low; not for a static alpha), ``clip/n``
    (A<0 tokens measured), ``clip/alpha_n`` (the BF16-clipped count to expect among them,
    ``CalibrationState``), ``clip/k_zero`` (share of the step's calibrations with k = 0),
    ``clip/events`` (calibrations counted) and ``clip/alpha_run`` (the run's BF16 rate so far).
    ``events``: ``[(k, n, alpha_n)]``, k = -1 for a static reference."""
    if not events:
        return {}
    m = len(events)
    out = {M.CLIP_N: sum(e[1] for e in events) / m, M.CLIP_ALPHA_N: sum(e[2] for e in events) / m,
           M.CLIP_EVENTS: float(m)}
    ks = [e[0] for e in events if e[0] >= 0]
    if ks:
        out.update({M.CLIP_K: sum(ks) / len(ks), M.CLIP_K_ZERO: sum(k == 0 for k in ks) / len(ks),
                    M.CLIP_ALPHA_RUN: run_alpha})
    return out


def calibration_metrics(*, bounds: Bounds, n_calibrations: int, n_degenerate: int, last: Calibration | None,
                        last_step: int | None, last_pooled: int, step: int | None, reference: str,
                        static_alpha: float | None, upper_rule: str) -> dict[str, float]:
    """The ``clip/*`` / ``shadow/*`` metrics of a controller state (its ``metrics`` docstring)."""
    out: dict[str, float] = {
        "clip/low": bounds.low,
        "clip/high": bounds.high,
        "clip/calibrations": float(n_calibrations),
        "clip/degenerate_updates": float(n_degenerate),
    }
    if reference == "static":
        out["clip/alpha"] = float(static_alpha)  # type: ignore[arg-type]
    elif last is not None:
        out["clip/alpha"] = last.alpha
    cal = last
    if cal is not None and (step is None or step == last_step):
        out["clip/low_raw"] = cal.low
        out["clip/high_raw"] = cal.high
        out["clip/alpha_achieved"] = cal.alpha_achieved
        out["clip/n_neg"] = float(cal.n_neg)
        out["clip/low_data"] = float(cal.alpha * cal.n_neg < LOW_DATA_TOKENS)
        out["clip/pooled_calibrations"] = float(last_pooled)
        if reference == "shadow":
            out["shadow/clipfrac_neg_low"] = cal.shadow_clipfrac_neg_low
            out["shadow/ratio_neg_q01"] = cal.shadow_ratio_neg_q01
        if upper_rule == "contribution":
            out["clip/p_target"] = cal.p_target
            out["clip/p_achieved"] = cal.p_achieved
    return out
