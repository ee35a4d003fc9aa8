"""The plugin's step metrics: global counts over every micro-batch and data-parallel rank of a step.

What goes wrong otherwise (OpenRLHF 0.11.2, ``ActorPPOTrainer.ppo_train``): every 0-d tensor a
micro-batch leaves in ``experience.info`` is weighted by that micro-batch's action tokens,
all-reduced, and averaged over the micro-batches of the step, with a key missing from a
micro-batch counted as 0. That is exact for a fraction *of all action tokens* (upstream's
``ppo_clip_ratio``, ``is_filter_ratio``, ``entropy_loss``), but not for ours: a fraction of the
A<0 tokens is NaN in a micro-batch without A<0 tokens (and the NaN poisons the step), and a value
present in one micro-batch only (a calibration result) is diluted by the others.

So the plugin keeps its own numbers out of ``experience.info``. The loss adds, per micro-batch,
numerators and denominators to a :class:`StepMetrics` (0-d tensors on the device, no host sync),
and after upstream's ``ppo_train`` the binding calls :meth:`StepMetrics.finalize`, which sums
them over the data-parallel ranks (one all-reduce), gathers the A<0 ratios of all ranks for the
quantiles (one variable-length all-gather), and returns plain floats that go into the status
dict ``ppo_train`` returns (rank 0's reaches OpenRLHF's logger: ``Global step N: {...}``).

One logged row = one training step (one ``ppo_train`` call = ``num_mini_batches`` optimizer
steps); the mini backend defines its step metrics the same way (``fp8rl.backends.mini``: counts
summed over the step's mini-batches). Metrics (names as in docs/design.md):

- ``actor/clipfrac_{neg,pos}_{low,high}``: ``fp8rl.rl.diagnostics.fractions_from_counts`` of
  the summed ``clip_counts``, each micro-batch counted against the bounds in force for it;
  NaN when the whole step has no token of that advantage sign. ``actor/clipfrac`` is left to
  upstream's ``ppo_clip_ratio`` (token-weighted, hence exact; ingested as ``actor/clipfrac``).
- ``actor/n_neg``, ``actor/n_neg_low``: the summed A<0 count and its part below the lower bound
  (``fractions_from_counts``' denominator and numerator, global over ranks).
- ``actor/ratio_neg_q01|q50|q99``: quantiles over the A<0 ratios of the whole step (all ranks).
- ``actor/ratio_std``: the standard deviation of r - 1 over the step's response tokens (all ranks;
  ``fp8rl.rl.diagnostics.ratio_dev_sums`` summed, then ``ratio_std_from_sums``).
- ``rollout/mismatch_kl``: the k3 estimate summed over tokens / number of tokens (TIS arms).
- ``perf/shadow_s``: seconds in BF16 shadow forwards (calibration steps).
- ``sc/head_mass``, ``sc/rho``, ``sc/term_abs`` (Score Centering arms): sum_H q, rho and |A * C|
  summed over the response tokens of the step (all ranks) / their number: means over response
  tokens, as the mini backend defines them (``fp8rl.runs.metrics``).

Calibration values (``clip/*``, ``shadow/*``) come from the controller once per step
(``clipper.metrics(step)``, identical on every rank), not through this accumulator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from fp8rl.runs import metrics as M

#: Count keys of ``fp8rl.rl.diagnostics.clip_counts``.
COUNT_KEYS = ("tokens", "neg", "pos", "neg_low", "neg_high", "pos_low", "pos_high")
#: Score Centering's per-token sums (``fp8rl.rl.score_centering.score_centering_sums``) and their token count.
SC_KEYS = ("sc_head", "sc_rho", "sc_term_abs", "sc_tokens")
#: Everything :meth:`StepMetrics.finalize` sums over the ranks: the counts, the mismatch sums and
#: Score Centering's sums.
#: The sums behind ``actor/ratio_std`` (``fp8rl.rl.diagnostics.ratio_dev_sums``).
DEV_KEYS = ("dev_n", "dev_sum", "dev_sq")
SUMMED_KEYS = (*COUNT_KEYS, "mismatch_sum", "mismatch_tokens", "has_mismatch", *SC_KEYS, *DEV_KEYS)


def all_reduce_keyed(values: Mapping[str, torch.Tensor], all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None,
                     keys: tuple[str, ...] = SUMMED_KEYS, *, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """``{key: sum over ranks}`` of the 0-d float64 ``values`` in one all-reduce: packed in the
    order of ``keys`` (the same tuple on every rank), unpacked by key, so no reader indexes the
    vector by position; a key missing from ``values`` counts 0 (a rank that saw no micro-batch).
    A key in ``values`` but not in ``keys`` raises (it would be dropped)."""
    extra = set(values) - set(keys)
    if extra:
        raise KeyError(f"all_reduce_keyed: {sorted(extra)} not in the reduced keys {keys}")
    device = device or next((v.device for v in values.values()), torch.device("cpu"))
    zero = torch.zeros((), dtype=torch.float64, device=device)
    vec = torch.stack([values.get(k, zero).to(device=device, dtype=torch.float64) for k in keys])
    if all_reduce_sum is not None:
        vec = all_reduce_sum(vec)
    return {k: vec[i] for i, k in enumerate(keys)}


class StepMetrics:
    """Accumulates one step's counts on one rank; :meth:`finalize` reduces over ranks."""

    def __init__(self) -> None:
        self.counts: dict[str, torch.Tensor] = {}
        self.neg_ratios: list[torch.Tensor] = []
        self.mismatch_sum: torch.Tensor | None = None
        self.mismatch_tokens: torch.Tensor | None = None
        self.shadow_s = 0.0
        self.micro_batches = 0
        self.sc: dict[str, torch.Tensor] = {}

    def add(self, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, low: float,
            high: float, mismatch_kl: torch.Tensor | None = None) -> None:
        """One micro-batch: ``ratio``, ``advantages``, ``mask`` ``[B, T]``; ``mismatch_kl`` the 0-d
        mean k3 estimate of the rollout/trainer mismatch over its response tokens (None without
        rollout log-probs), weighted here by the micro-batch's token count."""
        from fp8rl.rl.diagnostics import clip_counts, ratio_dev_sums

        with torch.no_grad():
            m = mask.bool()
            for k, v in [*clip_counts(ratio, advantages, m, low=low, high=high).items(),
                         *ratio_dev_sums(ratio, m).items()]:
                v = v.to(torch.float64)
                self.counts[k] = v if k not in self.counts else self.counts[k] + v
            self.neg_ratios.append(ratio.detach()[m & (advantages < 0)].float())
            if mismatch_kl is not None:
                n = m.sum().double()
                s = mismatch_kl.detach().double() * n
                self.mismatch_sum = s if self.mismatch_sum is None else self.mismatch_sum + s
                self.mismatch_tokens = n if self.mismatch_tokens is None else self.mismatch_tokens + n
        self.micro_batches += 1

    def add_score_centering(self, sums: Mapping[str, torch.Tensor]) -> None:
        """One micro-batch's Score Centering sums (``fp8rl.rl.score_centering.score_centering_sums``: keys :data:`SC_KEYS`)."""
        if set(sums) != set(SC_KEYS):
            raise KeyError(f"Score Centering sums need keys {SC_KEYS}, got {sorted(sums)}")
        for k, v in sums.items():
            v = v.detach().to(torch.float64)
            self.sc[k] = v if k not in self.sc else self.sc[k] + v

    def finalize(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None = None) -> dict[str, float]:
        """The step's metrics over all ranks (``None`` collectives: this rank only). Every rank must
        call it (collectives inside), also a rank that saw no micro-batch."""
        from fp8rl.rl.diagnostics import (
            fractions_from_counts,
            neg_counts,
            ratio_quantiles,
            ratio_std_from_sums,
        )

        device = self._device()
        local = {k: self.counts[k].to(device) for k in (*COUNT_KEYS, *DEV_KEYS) if k in self.counts}
        if self.mismatch_sum is not None:
            local.update(mismatch_sum=self.mismatch_sum.to(device), mismatch_tokens=self.mismatch_tokens.to(device),
                         has_mismatch=torch.ones((), dtype=torch.float64, device=device))
        local.update({k: v.to(device) for k, v in self.sc.items()})
        total = all_reduce_keyed(local, all_reduce_sum, device=device)
        counts = {k: total[k] for k in COUNT_KEYS}
        out = {k: float(v) for k, v in fractions_from_counts(counts).items() if k != M.ACTOR_CLIPFRAC}
        out.update({k: float(v) for k, v in neg_counts(counts).items()})
        out.update({k: float(v) for k, v in ratio_std_from_sums({k: total[k] for k in DEV_KEYS}).items()})
        neg = torch.cat(self.neg_ratios) if self.neg_ratios else torch.zeros(0, device=device)
        if all_gather is not None:
            neg = torch.cat(all_gather(neg.to(device).contiguous()))
        ones = torch.ones_like(neg, dtype=torch.bool)
        out.update({k: float(v) for k, v in
                    ratio_quantiles(neg, -torch.ones_like(neg), ones).items()})
        if float(total["has_mismatch"]) > 0 and float(total["mismatch_tokens"]) > 0:
            out[M.ROLLOUT_MISMATCH_KL] = float(total["mismatch_sum"] / total["mismatch_tokens"])
        if self.shadow_s:
            out[M.PERF_SHADOW_S] = self.shadow_s
        if float(total["sc_tokens"]) > 0:  # Score Centering arms: means over the step's response tokens
            n = total["sc_tokens"]
            out.update({M.SC_HEAD_MASS: float(total["sc_head"] / n), M.SC_RHO: float(total["sc_rho"] / n),
                        M.SC_TERM_ABS: float(total["sc_term_abs"] / n)})
        return out

    def _device(self) -> torch.device:
        for v in self.counts.values():
            return v.device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
