"""One schedule for every clip method and calibration mode, driven the same way by both backends.

A backend runs one step as ``num_mini_batches`` windows (optimizer steps) over the step's ``N``
sequences. It asks the clip method for the step's plan and follows it, whatever the method or
mode (the mode's flags are read here, never its name, so a new mode needs no backend branch):

    plan = clipper.begin_step(step, eligible=seq_has_nonzero_adv, diagnostics=..., rank=rank)
    # BF16 old log-probs (weights before the step's first update) of plan.shadowed sequences
    for rows in windows:                                    # the window's sequences, [n] indices
        w = plan.window(rows)
        # the FP8 ratios of w.measured rows, and the BF16 shadow ratios of w.shadowed rows
        #   (at paper scale: an FP8 pre-pass when w.prepass, else the measured rows' own loss
        #   forwards, run first under w.before)
        after = w.calibrate(ratio_m, shadow_m, adv_m, mask_m, seq=rows_m)   # measured rows
        # the loss: rows in w.first use w.before, the others `after`
        w.observe(ratio_s, shadow_s, adv_s, mask_s, after=...)   # shadowed rows, per bounds used
    metrics = plan.finish()                                 # pooled update (step-level modes)

``calibrate`` happens once the measured rows' FP8 ratios are in: with ``w.prepass`` before any
loss of the window, otherwise after the losses of the ``w.first`` rows (at mini scale one forward
gives every row's ratio, so it happens between the forward and the loss). For the step-level
modes (``periodic``, ``pooled``) it only collects the tokens and returns ``w.before``; ``finish``
runs the step's pooled update. A non-calibrated arm (vanilla, TIS) measures nothing, and with
``diagnostics`` shadows every row for the agreement and out-of-sample counts (training unchanged).

Tallies of one step (``finish``): which tokens FP8 clips against what BF16 would
(``agreement``; every shadowed token with the bounds applied to it), the out-of-sample and
cross-fitted counts (``heldout``), and for ``sampled`` the share rule's decision.
"""

from __future__ import annotations

import torch

from fp8rl.rl.calibration.bounds import Bounds
from fp8rl.rl.calibration.heldout import HeldoutTally, cross_fit_counts, low_counts
from fp8rl.rl.calibration.metrics import AgreementTally
from fp8rl.runs import metrics as M

__all__ = ["StepPlan", "WindowPlan", "flat_window_tokens"]


@torch.no_grad()
def flat_window_tokens(ratio: torch.Tensor, shadow_ratio: torch.Tensor | None, advantages: torch.Tensor,
                       mask: torch.Tensor, seq: torch.Tensor | None) -> tuple:
    """Unmasked tokens, flat: ``(ratio [n], shadow [n] or None, adv [n], seq [n] or None)``.

    ``[B, T]`` inputs (``advantages`` ``[B, T]`` or ``[B]``, ``seq`` ``[B]`` sequence ids) or flat
    ``[n]`` ones (``seq`` ``[n]``); float32 or wider, in row-major order (``state.flat_tokens``)."""
    from fp8rl.rl.calibration.state import flat_tokens

    r, s, a = flat_tokens(ratio, shadow_ratio, advantages, mask)
    q = None
    if seq is not None:
        valid = mask.detach().reshape(-1)
        valid = valid if valid.dtype == torch.bool else valid != 0
        full = seq[:, None].expand(ratio.shape) if ratio.dim() == 2 and seq.shape == ratio.shape[:1] else seq
        if full.shape != ratio.shape:
            raise ValueError(f"seq has shape {tuple(seq.shape)}; expected {tuple(ratio.shape[:1])} (one per row) "
                             f"or {tuple(ratio.shape)}")
        q = full.reshape(-1)[valid.to(full.device)]
    return r, s, a, q


class StepPlan:
    """The calibration plan of one step (module docstring). Built by ``clipper.begin_step``.

    Attributes:
        step: the controller step (from 0).
        calibrates: this step feeds the controller.
        eligible: ``[N]`` bool, sequences with any A != 0 token (what ``sampled`` draws from).
        shadowed: ``[N]`` bool, sequences that get a BF16 shadow (their BF16 old log-probs, on the
            weights before the step's first update, are needed).
        measured: ``[N]`` bool, sequences whose tokens feed an estimate.
        before: the bounds in force when the step starts.
        choice: the share rule's decision (``sampling.ShareChoice``; ``sampled`` only, else None).
        holdout: ``[N]`` bool, the held-out sequences (``sampling.draw_holdout``): shadowed, never
            measured, scored against the bounds in force on them (``shadow/ho_*``), for every clip
            method alike.
    """

    def __init__(self, clipper, step: int, *, n: int, measured: torch.Tensor, shadowed: torch.Tensor,
                 calibrates: bool, choice=None, eligible: torch.Tensor | None = None,
                 holdout: torch.Tensor | None = None) -> None:
        self.clipper, self.step, self.n = clipper, step, n
        self.eligible = eligible if eligible is not None else torch.ones(n, dtype=torch.bool)
        self.holdout = torch.zeros_like(measured) if holdout is None else holdout.to(measured.device)
        if self.holdout.shape != measured.shape or self.holdout.dtype != torch.bool:
            raise ValueError(f"holdout must be a [N] bool tensor like measured, got {self.holdout.dtype} "
                             f"{tuple(self.holdout.shape)}")
        self.measured, self.shadowed = measured & ~self.holdout, shadowed | self.holdout
        self.calibrates = calibrates
        self.spec = getattr(clipper, "mode_spec", None) if calibrates else None
        self.choice = choice
        self.before = clipper.bounds(step)
        self.vanilla = Bounds.vanilla(clipper.eps_low, clipper.eps_high)
        self.tally = AgreementTally()
        self.heldout = HeldoutTally()
        self.windows: list[WindowPlan] = []
        self.step_tokens: list[tuple] = []  # step-level modes: every window's measured tokens
        self._finished = False

    @property
    def in_window(self) -> bool:
        return self.spec is not None and self.spec.in_window

    def window(self, rows: torch.Tensor) -> WindowPlan:
        """The plan of the window over the step's sequences ``rows`` (``[n]`` long indices)."""
        if self._finished:
            raise RuntimeError("window() after finish(): start a new step with begin_step")
        rows = rows.to(torch.long)
        idx = rows.to(self.measured.device)
        w = WindowPlan(self, rows, measured=self.measured[idx].to(rows.device),
                       shadowed=self.shadowed[idx].to(rows.device), before=self._current(),
                       holdout=self.holdout[idx].to(rows.device))
        self.windows.append(w)
        return w

    def _current(self) -> Bounds:
        """Bounds in force before the next window's calibration (in-window modes: the last window's)."""
        if self.in_window:
            for w in reversed(self.windows):
                if w.after is not None:
                    return w.after
        return self.before

    def finish(self, reduce_sum=None) -> dict[str, float]:
        """After the step's windows: the pooled update of a step-level mode; the step's metrics.

        ``reduce_sum``: sums a 1-D int64 tensor over the data-parallel ranks (an all-reduce; every
        rank must call ``finish``), applied to the tokens counted by :meth:`WindowPlan.observe`
        (agreement, out of sample), which each rank counts on its own tokens; the cross-fitted
        counts come from the gathered tokens and are not summed. None: this process only."""
        if self._finished:
            raise RuntimeError("finish() called twice for one step")
        self._finished = True
        ctl, step = self.clipper, self.step
        out: dict[str, float] = {}
        afters = [w.after for w in self.windows if w.after is not None]
        if self.in_window and afters:
            lows, highs = [b.low for b in afters], [b.high for b in afters]
            out.update({M.CLIP_LOW: sum(lows) / len(lows), M.CLIP_HIGH: sum(highs) / len(highs),
                        "clip/low_min_batch": min(lows), "clip/high_max_batch": max(highs)})
        else:
            out.update({M.CLIP_LOW: self.before.low, M.CLIP_HIGH: self.before.high})
        if self.calibrates:
            if not self.in_window:
                new = ctl.update_step(step, self.step_tokens)
                out.update({"clip/low_next": new.low, "clip/high_next": new.high})
            out.update({k: v for k, v in ctl.metrics(step).items() if k not in (M.CLIP_LOW, M.CLIP_HIGH)})
        elif getattr(ctl, "calibrates", False):  # a calibrating method, not calibrating this step: its running counters
            out.update({k: v for k, v in ctl.metrics().items()
                        if k in ("clip/calibrations", "clip/degenerate_updates", M.CLIP_ALPHA)})
        if reduce_sum is not None:
            local = torch.cat([self.tally.counts, self.heldout.oos, self.heldout.ho,
                               torch.tensor([int(self.tally.step is not None), int(self.heldout.has_oos),
                                             int(self.heldout.has_ho)])])
            total = reduce_sum(local.clone()).to(torch.int64).cpu()
            self.tally.counts, self.heldout.oos, self.heldout.ho = total[:6].clone(), total[6:9].clone(), \
                total[9:12].clone()
            if int(total[12]) > 0:
                self.tally.step = step
            self.heldout.has_oos, self.heldout.has_ho = int(total[13]) > 0, int(total[14]) > 0
        out.update(self.tally.metrics(step))
        out.update(self.heldout.metrics())
        if self.choice is not None:
            c = self.choice
            out.update({"clip/sample_share": c.share, "clip/sample_pool": float(c.pool),
                        "clip/sample_seqs": float(self.measured.sum()), "clip/sample_deff": c.deff,
                        "clip/sample_alpha_neff": c.expected, "clip/sample_low_data": float(c.low_data)})
        return out


class WindowPlan:
    """One window of a :class:`StepPlan` (module docstring).

    Attributes:
        rows: ``[n]`` the window's sequences (indices into the step's).
        measured: ``[n]`` bool, rows whose tokens feed the window's (or the step's) estimate.
        shadowed: ``[n]`` bool, rows with a BF16 shadow (measured ones, or all with diagnostics).
        first: ``[n]`` bool, rows whose loss runs before the window's calibration and is ruled by
            ``before`` (the measured rows of a mode whose bounds do not rule their own tokens).
        prepass: the measured rows' FP8 ratios are needed before any loss of the window (a mode
            whose window bounds rule the tokens they come from).
        before: the bounds in force before this window's calibration.
        after: the bounds from this window's calibration (None until ``calibrate``).
    """

    def __init__(self, plan: StepPlan, rows: torch.Tensor, *, measured: torch.Tensor, shadowed: torch.Tensor,
                 before: Bounds, holdout: torch.Tensor | None = None) -> None:
        self.plan, self.rows = plan, rows
        self.measured, self.shadowed = measured, shadowed
        self.holdout = torch.zeros_like(measured) if holdout is None else holdout
        spec = plan.spec
        self.prepass = bool(spec is not None and spec.in_window and spec.rules_measured)
        first = spec is not None and spec.in_window and not spec.rules_measured
        self.first = measured.clone() if first else torch.zeros_like(measured)
        self.before = before
        self.after: Bounds | None = None

    def bounds(self) -> Bounds:
        """The bounds a loss computed now uses: ``after`` once calibrated, else ``before``."""
        return self.after if self.after is not None else self.before

    @torch.no_grad()
    def calibrate(self, ratio: torch.Tensor, shadow_ratio: torch.Tensor | None, advantages: torch.Tensor,
                  mask: torch.Tensor, *, seq: torch.Tensor | None = None) -> Bounds:
        """The window's estimate from its measured rows' tokens (all ranks' at paper scale); returns
        the bounds that rule the window's other rows (``after``). ``[B, T]`` or flat tokens as
        :func:`flat_window_tokens`; ``seq`` the sequences' ids (needed by ``sampled``'s design
        effect and ``same_batch``'s cross-fitting). Call once per window."""
        if self.after is not None:
            raise RuntimeError("calibrate() called twice for one window")
        plan = self.plan
        if not plan.calibrates:
            self.after = self.before
            return self.after
        r, s, a, q = flat_window_tokens(ratio, shadow_ratio, advantages, mask, seq)
        if s is None and r.numel() == 0 and plan.clipper.measures(plan.step):
            s = r.new_zeros(0)  # a window none of whose rows is measured
        if not plan.in_window:
            plan.step_tokens.append((r, s, a))
            self.after = self.before
            return self.after
        ctl = plan.clipper
        self.after = ctl.calibrate_window(plan.step, (r, s, a), seq=q)
        if plan.spec.rules_measured and s is not None and q is not None and r.numel():
            plan.heldout.add_xfit(cross_fit_counts(r, s, a, q, step=plan.step, vanilla_low=plan.vanilla.low,
                                                   estimate=ctl.estimate_flat))
        return self.after

    @torch.no_grad()
    def observe(self, ratio: torch.Tensor, shadow_ratio: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, after: bool, holdout: bool = False) -> None:
        """Count shadowed tokens (``[B, T]`` or flat, as the loss saw them) against the bounds the
        loss used for them: ``after`` (the window's calibration) or ``before``. ``holdout``: the
        tokens are of held-out rows (``self.holdout``; pass them in a call of their own): also
        counted as held out (``shadow/ho_*``), and out of sample whatever the mode."""
        plan = self.plan
        applied = self.after if after else self.before
        if applied is None:
            raise RuntimeError("observe(after=True) before calibrate()")
        plan.tally.add(plan.step, ratio, shadow_ratio, advantages, mask, applied=applied, vanilla=plan.vanilla)
        in_sample = (after and plan.spec is not None and plan.spec.in_window and plan.spec.rules_measured
                     and not holdout)
        counts = low_counts(ratio, shadow_ratio, advantages, mask, low=applied.low, vanilla_low=plan.vanilla.low)
        if not in_sample:
            plan.heldout.add_oos(counts)
        if holdout:
            plan.heldout.add_ho(counts)
