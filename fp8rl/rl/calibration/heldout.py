"""The calibration's error on tokens it did not see: out of sample, and by cross-fitting.

A bound estimated so that FP8 clips as many A<0 tokens as BF16 would is exact *by construction*
on the tokens it was estimated from (``same_batch`` with the ``in_sample`` lower bound): its
FP8-clipped count there equals their BF16-shadow count, whatever the method is worth. What it
cannot force is the count on other tokens. Two tallies measure that:

- **out of sample** (:class:`HeldoutTally`, ``shadow/oos_*``): A<0 tokens with a BF16 shadow that
  did not feed the estimate of the bounds applied to them. ``oos_fp8_low_n`` counts those whose
  FP8 ratio is below the lower bound applied, ``oos_bf16_low_n`` those whose BF16 shadow ratio is
  below ``1 - eps_low`` (what BF16 would clip): ``oos_fp8_low_n / oos_bf16_low_n`` is the
  calibration's real error (1 = FP8 clips, out of sample, as many tokens as BF16 would). Which
  tokens are out of sample: every shadowed token of a non-calibrated arm (vanilla bounds, set by
  no token) and of ``periodic`` / ``pooled`` (bounds from earlier steps); under ``sampled`` every
  token (the subset's own tokens are ruled by the previous window's bounds, the rest by the
  subset's); under ``same_batch`` none.
- **cross-fitting** (:func:`cross_fit_counts`, ``shadow/xfit_*``), for a mode whose window bounds
  rule the tokens they come from (``same_batch``): the window's measured sequences are split into
  two halves by a hash of their sequence id and step; each half's A<0 tokens are counted against
  the bounds the mode's own estimator gives on the *other* half. It scores the estimator on new
  tokens at half the window's data (so it errs on the noisy side), not the bounds that trained.

- **held out** (:class:`HeldoutTally`, ``shadow/ho_*``, issue 46): one definition for every clip
  method and mode. A seeded share of each step's sequences (``sampling.draw_holdout``, the same
  rows for every arm of a seed) gets a BF16 shadow and never feeds an estimate; its A<0 tokens are
  scored against the bounds actually in force on them (same counts as ``oos``). Under
  ``same_batch`` these are the only tokens its trained bounds rule without having seen them.

Counts, not rates, so the analysis pools them over steps and seeds (ratio of sums). Comparisons
as in the loss: strictly below the bound, float32 or wider.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp8rl.rl.calibration.bounds import Bounds, DegenerateCalibration
from fp8rl.runs import metrics as M

__all__ = ["HELDOUT_KEYS", "HOLDOUT_KEYS", "XFIT_KEYS", "HeldoutTally", "cross_fit_counts", "low_counts", "xfit_folds"]

#: The out-of-sample counts, in the order of :func:`low_counts`.
HELDOUT_KEYS = (M.SHADOW_OOS_N_NEG, M.SHADOW_OOS_FP8_LOW_N, M.SHADOW_OOS_BF16_LOW_N)
#: The held-out counts, same order.
HOLDOUT_KEYS = (M.SHADOW_HO_N_NEG, M.SHADOW_HO_FP8_LOW_N, M.SHADOW_HO_BF16_LOW_N)
#: The cross-fitted counts, same order.
XFIT_KEYS = (M.SHADOW_XFIT_N_NEG, M.SHADOW_XFIT_FP8_LOW_N, M.SHADOW_XFIT_BF16_LOW_N)


@torch.no_grad()
def low_counts(ratio: torch.Tensor, shadow_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
               low: float, vanilla_low: float) -> torch.Tensor:
    """``[3]`` int64: unmasked A<0 tokens, of which FP8 ``ratio < low``, of which BF16
    ``shadow_ratio < vanilla_low``. Any matching shapes (``advantages`` may be ``[B]`` for 2-D)."""
    if shadow_ratio.shape != ratio.shape or mask.shape != ratio.shape:
        raise ValueError(f"ratio {tuple(ratio.shape)}, shadow_ratio {tuple(shadow_ratio.shape)} and mask "
                         f"{tuple(mask.shape)} must have one shape")
    adv = advantages
    if adv.shape != ratio.shape:
        if ratio.dim() == 2 and adv.shape == ratio.shape[:1]:
            adv = adv[:, None].expand(ratio.shape)
        else:
            raise ValueError(f"advantages has shape {tuple(adv.shape)}; expected {tuple(ratio.shape)}")
    dtype = torch.promote_types(torch.promote_types(ratio.dtype, shadow_ratio.dtype), torch.float32)
    m = (mask if mask.dtype == torch.bool else mask != 0) & (adv < 0)
    fp8 = m & (ratio.to(dtype) < low)
    bf16 = m & (shadow_ratio.to(dtype) < vanilla_low)
    return torch.stack([m.sum(), fp8.sum(), bf16.sum()]).to(torch.int64).cpu()


def xfit_folds(seq: torch.Tensor, step: int) -> torch.Tensor:
    """``[n]`` bool: the cross-fitting half of each token (by its sequence id and the step; a
    multiplicative hash, so the split is fixed by the data and needs no generator state)."""
    h = (seq.to(torch.int64) * 0x9E3779B1 + int(step) * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    return ((h >> 16) & 1).bool()


@torch.no_grad()
def cross_fit_counts(ratio: torch.Tensor, shadow_ratio: torch.Tensor, advantages: torch.Tensor, seq: torch.Tensor,
                     *, step: int, vanilla_low: float, estimate: Callable[..., Bounds]) -> torch.Tensor:
    """2-fold cross-fitted ``[3]`` counts (:func:`low_counts` order) of one window's measured tokens.

    Args:
        ratio, shadow_ratio, advantages, seq: flat ``[n]`` unmasked tokens (FP8 ratio, BF16 ratio,
            advantage, sequence id).
        step: the controller step (part of the split's hash).
        vanilla_low: ``1 - eps_low``.
        estimate: ``estimate(ratio, shadow_ratio, advantages) -> Bounds``, the mode's estimator on
            flat tokens; a half it cannot estimate from (``DegenerateCalibration``) leaves the
            other half uncounted.
    """
    fold = xfit_folds(seq, step)
    out = torch.zeros(3, dtype=torch.int64)
    ones = torch.ones_like(ratio, dtype=torch.bool)
    for f in (False, True):
        train, test = fold != f, fold == f
        if not bool(train.any()) or not bool(test.any()):
            continue
        try:
            b = estimate(ratio[train], shadow_ratio[train], advantages[train])
        except DegenerateCalibration:
            continue
        out += low_counts(ratio[test], shadow_ratio[test], advantages[test], ones[test], low=b.low,
                          vanilla_low=vanilla_low)
    return out


class HeldoutTally:
    """One step's out-of-sample, held-out and cross-fitted counts (a new step starts new sums)."""

    def __init__(self) -> None:
        self.oos = torch.zeros(3, dtype=torch.int64)
        self.ho = torch.zeros(3, dtype=torch.int64)
        self.xfit = torch.zeros(3, dtype=torch.int64)
        self.has_oos = self.has_ho = self.has_xfit = False

    def add_ho(self, counts: torch.Tensor) -> None:
        self.ho += counts.to(torch.int64).cpu()
        self.has_ho = True

    def add_oos(self, counts: torch.Tensor) -> None:
        self.oos += counts.to(torch.int64).cpu()
        self.has_oos = True

    def add_xfit(self, counts: torch.Tensor) -> None:
        self.xfit += counts.to(torch.int64).cpu()
        self.has_xfit = True

    def metrics(self) -> dict[str, float]:
        """The counts, and the two out-of-sample fractions (NaN without A<0 tokens)."""
        out: dict[str, float] = {}
        if self.has_oos:
            n, fp8, bf16 = (int(x) for x in self.oos.tolist())
            out.update(dict(zip(HELDOUT_KEYS, (float(n), float(fp8), float(bf16)), strict=True)))
            out[M.SHADOW_OOS_CLIPFRAC_NEG_LOW] = fp8 / n if n else float("nan")
            out[M.SHADOW_OOS_BF16_CLIPFRAC_NEG_LOW] = bf16 / n if n else float("nan")
        if self.has_ho:
            out.update(dict(zip(HOLDOUT_KEYS, (float(x) for x in self.ho.tolist()), strict=True)))
        if self.has_xfit:
            out.update(dict(zip(XFIT_KEYS, (float(x) for x in self.xfit.tolist()), strict=True)))
        return out
