"""The ``windowed`` calibration mode at paper scale (issue 46 item 6): the plugin's loss and binding
around upstream 0.11.2's real ``ppo_actor.py`` (the harness is ``ppo_flow``) log ``clip/k``,
``clip/n``, ``clip/alpha_n`` per calibration and pool the steps the shared window rule picks.

References computed here, independently of the binding and the controller: the measured rows of
each step (``sampling.draw_subset`` of the eligible rows at ``window_share``, the spec's seed, the
step, rank 0), their tokens' FP8 and BF16 ratios on the weights each loss saw (``ppo_flow.want``),
so each step's k (A<0 tokens whose BF16 ratio is below 1 - eps_low) and n (A<0 tokens); the window W
(the fewest recent steps whose A<0 count times the BF16 rate over the last ``window_max`` steps
reaches ``window_target``), and the logged values of the pooled W steps. Planted bugs this catches:
a window that never drops old steps, the window's rate or alpha n read from the FP8 ratios; and,
with held-out rows (``clip.holdout_share``), the rows whose tokens reach the estimate are the
mode's draw minus the seed's held-out draw from the eligible rows (planted: held-out rows marked
measured in the binding's ``Pending``, or drawn from the windowed subset).
"""

from __future__ import annotations

import pytest
import torch
from ppo_flow import PpoFlow
from ppo_flow import want as _want

from fp8rl.backends.openrlhf.plugin import PluginSpec
from fp8rl.rl.calibration.plan import WindowPlan
from fp8rl.rl.calibration.sampling import draw_holdout, draw_subset
from fp8rl.runs import metrics as M

SEED, SHARE, TARGET, WMAX = 5, 0.5, 6.0, 4
N, T, GAS, STEPS = 16, 32, 2, 6
V = 0.8  # 1 - eps_low


def _spec(share: float = SHARE, holdout: float = 0.0) -> PluginSpec:
    return PluginSpec(clip_method="calibrated",
                      clip_options={"mode": "windowed", "window_share": share, "window_target": TARGET,
                                    "window_max": WMAX, "init_bounds": [0.8, 1.28], "upper_rule": "proportional"},
                      eps_low=0.2, eps_high=0.28, seed=SEED, holdout_share=holdout)


def _window(ks: list[int], ns: list[int]) -> int:
    """The steps the rule pools at the last step of ``ks``/``ns`` (module docstring)."""
    ks, ns = ks[-WMAX:], ns[-WMAX:]
    alpha, pooled = sum(ks) / sum(ns), 0
    for w in range(1, len(ns) + 1):
        pooled += ns[-w]
        if alpha * pooled >= TARGET:
            return w
    return len(ns)


def _step_counts(flow: PpoFlow, step: int, rows: list[int]) -> tuple[int, int, int]:
    """(k BF16, k FP8, n) of ``rows``' A<0 tokens on the weights their losses saw at ``step``."""
    k_bf16 = k_fp8 = n = 0
    for f in flow.forwards:
        if f["step"] == step and f["idx"][0] in rows:
            fp8, bf16, a = _want(flow.actor, flow.adv, flow.mask, flow.old, f["idx"], f["k"])
            neg = a < 0
            k_bf16 += int((neg & (bf16 < V)).sum())
            k_fp8 += int((neg & (fp8 < V)).sum())
            n += int(neg.sum())
    return k_bf16, k_fp8, n


def test_the_plugin_logs_k_n_alpha_n_of_the_window_the_shared_rule_picks(monkeypatch):
    from fp8rl.backends.openrlhf.ingest import map_step

    flow = PpoFlow(monkeypatch, _spec(), n=N, t=T, gas=GAS, zero_last=True)
    assert type(flow.ctl).__module__ == "fp8rl.rl.calibration.controller"  # the shared controller, not a copy
    plans = []

    def begin_step(step, _orig=flow.ctl.begin_step, **kw):
        plans.append(_orig(step, **kw))
        return plans[-1]

    flow.ctl.begin_step = begin_step
    flow.actor.drift *= 0.1  # a small policy move: BF16 clips few A<0 tokens, FP8 (its error on top) many more
    flow.train(STEPS)
    eligible = ((flow.adv != 0) & flow.mask).any(1)
    ks, fs, ns, windows = [], [], [], []
    k_run = n_run = 0
    for step, plan in enumerate(plans):
        rows = torch.nonzero(plan.measured).flatten().tolist()
        assert rows == torch.nonzero(draw_subset(eligible, SHARE, seed=SEED, step=step)).flatten().tolist()
        k, f, n = _step_counts(flow, step, rows)
        ks.append(k)
        fs.append(f)
        ns.append(n)
        w = _window(ks, ns)
        windows.append(w)
        k_pool, n_pool = sum(ks[-w:]), sum(ns[-w:])
        k_run, n_run = k_run + k_pool, n_run + n_pool  # a pooled token counts once per calibration it feeds
        status = flow.statuses[step]
        assert (status[M.CLIP_K], status[M.CLIP_N], status[M.CLIP_EVENTS]) == (k_pool, n_pool, 1.0), step
        assert status["clip/pooled_calibrations"] == w, step
        assert status[M.CLIP_K_ZERO] == float(k_pool == 0)
        assert status[M.CLIP_ALPHA_RUN] == pytest.approx(k_run / n_run)
        assert status[M.CLIP_ALPHA_N] == pytest.approx(k_run / n_run * n_pool)
        row = map_step(status)  # ingestion keeps the names and the values
        keys = (M.CLIP_K, M.CLIP_N, M.CLIP_ALPHA_N, M.CLIP_K_ZERO, M.CLIP_EVENTS, M.CLIP_ALPHA_RUN)
        assert {k: row[k] for k in keys} == {k: float(status[k]) for k in keys}
    # not vacuous: the window grows, and drops old steps before window_max; FP8 clips other tokens
    # than BF16, so a window sized from the FP8 ratios would differ
    assert max(windows) > 1 and any(w < min(s + 1, WMAX) for s, w in enumerate(windows)), windows
    assert sum(fs) > 2 * sum(ks) and [_window(fs[: s + 1], ns[: s + 1]) for s in range(STEPS)] != windows, (fs, ks)


def test_held_out_rows_never_reach_a_windowed_estimate(monkeypatch):
    """Every step: the rows whose tokens the estimate read (the sequence ids handed to the window's
    ``calibrate``, this rank's) are the mode's seeded draw minus the held-out rows, and those are
    the seed's draw from the eligible rows (references recomputed here)."""
    share, holdout = 0.75, 0.25
    flow = PpoFlow(monkeypatch, _spec(share, holdout), n=N, t=T, gas=GAS, zero_last=True)
    fed = []  # (step, sequence ids one window's calibrate read)
    calibrate = WindowPlan.calibrate

    def record(self, ratio, shadow_ratio, advantages, mask, *, seq=None):
        fed.append((self.plan.step, seq.tolist()))
        return calibrate(self, ratio, shadow_ratio, advantages, mask, seq=seq)

    monkeypatch.setattr(WindowPlan, "calibrate", record)
    flow.train(3)
    eligible = ((flow.adv != 0) & flow.mask).any(1)
    exposed = 0  # held-out rows whose micro-batch ran before the window's calibration (a leak would show)
    for step in range(3):
        held = draw_holdout(eligible, holdout, seed=SEED, step=step)
        drawn = draw_subset(eligible, share, seed=SEED, step=step)
        read = sorted({s for st, seq in fed if st == step for s in seq})
        assert read == torch.nonzero(drawn & ~held).flatten().tolist(), step
        exposed += sum(bool(held[r]) and bool((drawn & ~held)[r + 1]) for r in range(0, N, GAS))
    assert exposed > 0
