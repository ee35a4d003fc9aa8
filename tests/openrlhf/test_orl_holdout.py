"""Held-out rows at paper scale (issue 46, ``clip.holdout_share``): from the config through the
plugin spec to the binding around upstream 0.11.2's real ``ppo_actor.py`` (heavy imports stubbed,
as in ``test_orl_plugin_bind``; the harness is ``ppo_flow``), for every clip arm alike.

References computed here, independently of the binding: the held-out rows of each step
(``sampling.draw_holdout`` from the eligible rows, the spec's seed, the step and rank 0), the FP8
and BF16 ratios of the stand-in actor (``ppo_flow.want``), the bounds each loss used (recorded), and so
the ``shadow/ho_*`` counts. Planted bugs (each fails a test here): held-out rows left in the
calibration set (``Pending.measured | holdout`` in ``binding.calibrate.plan_windows``), held-out
rows observed without ``holdout=True`` (``plugin.loss``), the windows not run for a vanilla arm
(``binding.actor``), the counts not summed over ranks (``end_step`` without ``reduce_sum``).
"""

from __future__ import annotations

import pytest
import torch
from orl_helpers import main_table_configs
from ppo_flow import PpoFlow
from ppo_flow import want as _want

from fp8rl.backends.openrlhf.plugin import PluginSpec
from fp8rl.rl.calibration.sampling import draw_holdout
from fp8rl.runs import metrics as M

SHARE, SEED = 0.25, 11
N, T, GAS = 16, 32, 2
HO = (M.SHADOW_HO_N_NEG, M.SHADOW_HO_FP8_LOW_N, M.SHADOW_HO_BF16_LOW_N)
#: The clip arms run through the binding: ``vanilla`` (the TIS arm: the stand-in args correct with
#: TIS), and Calibrated Clipping in a mode of each kind (``periodic`` period 2: step 1 calibrates not).
ARMS = {
    "vanilla": None,
    "same_batch": {"mode": "same_batch"},
    "sampled": {"mode": "sampled", "sample_fraction": 0.25},
    "periodic": {"mode": "periodic", "period": 2, "ema": 0.0},
}


def _spec(arm: str, share: float = SHARE) -> PluginSpec:
    opts = ARMS[arm]
    if opts is None:
        return PluginSpec(eps_low=0.2, eps_high=0.28, seed=SEED, holdout_share=share)
    return PluginSpec(clip_method="calibrated", clip_options={**opts, "init_bounds": [0.8, 1.28],
                                                              "upper_rule": "proportional"},
                      eps_low=0.2, eps_high=0.28, seed=SEED, holdout_share=share)


def _run(monkeypatch, spec: PluginSpec, *, steps: int = 2, two_ranks: bool = False) -> dict:
    """``steps`` ``ppo_train`` calls through the binding (``ppo_flow.PpoFlow``: ``N`` samples,
    micro-batches of 1, windows of ``GAS``; the weights change after each window). The last sample
    has A == 0 (not eligible). ``two_ranks``: the DP collectives of ``binding.actor`` act as two
    ranks holding this one's data. Records the plans ``begin_step`` built (with its arguments), the
    tokens each calibration read, and the rows the BF16 shadow ran on per step."""
    flow = PpoFlow(monkeypatch, spec, n=N, t=T, gas=GAS, zero_last=True, two_ranks=two_ranks)
    ctl = flow.ctl
    plans, fed = [], []  # the plans begin_step built (with its arguments); the tokens each calibration read

    def begin_step(step, _orig=ctl.begin_step, **kw):
        plans.append((kw, _orig(step, **kw)))
        return plans[-1][1]

    ctl.begin_step = begin_step
    if hasattr(ctl, "calibrate_window"):
        def record_window(step, tokens, _orig=ctl.calibrate_window, **kw):
            fed.append({"step": step, "n": tokens[0].numel(), "seq": kw.get("seq")})
            return _orig(step, tokens, **kw)

        def record_step(step, parts, _orig=ctl.update_step):
            fed.append({"step": step, "n": sum(p[0].numel() for p in parts), "seq": None})
            return _orig(step, parts)

        ctl.calibrate_window, ctl.update_step = record_window, record_step
    flow.train(steps)
    shadow_calls = [sorted((k, r) for kind, k, rows in calls if kind == "bf16" for r in rows)
                    for calls in flow.step_calls]
    return {"actor": flow.actor, "adv": flow.adv, "mask": flow.mask, "old": flow.old, "forwards": flow.forwards,
            "plans": plans, "fed": fed, "statuses": flow.statuses, "shadow_calls": shadow_calls}


def _held_out(step: int, adv, mask) -> list[int]:
    """The reference draw: eligible rows (any unmasked A != 0), the spec's seed, the step, rank 0."""
    eligible = ((adv != 0) & mask).any(1)
    return torch.nonzero(draw_holdout(eligible, SHARE, seed=SEED, step=step, rank=0)).flatten().tolist()


def _ho_counts(run: dict, step: int, rows: list[int]) -> tuple[int, int, int]:
    """``shadow/ho_*`` of ``rows`` from the stand-in's ratios and the bounds their losses used."""
    n = fp8_low = bf16_low = 0
    for f in run["forwards"]:
        if f["step"] != step or f["idx"][0] not in rows:
            continue
        fp8, bf16, a = _want(run["actor"], run["adv"], run["mask"], run["old"], f["idx"], f["k"])
        neg = a < 0
        n += int(neg.sum())
        fp8_low += int((neg & (fp8 < f["bounds"][0])).sum())
        bf16_low += int((neg & (bf16 < 0.8)).sum())
    return n, fp8_low, bf16_low


@pytest.mark.parametrize("arm", list(ARMS))
def test_held_out_rows_are_shadowed_never_calibrated_on_and_counted_apart(monkeypatch, arm):
    """Every arm, every step: the plan holds out the reference draw (the spec's share and seed, the
    rank); the BF16 shadow ran on exactly the shadowed rows (old log-probs on the weights before the
    step, current ones on each window's), the held-out rows included; no calibration read a
    held-out row's token (the tokens fed are exactly the measured rows'); the step's
    ``shadow/ho_*`` equal the counts recomputed from those rows' ratios and the bounds their losses
    used; a vanilla arm trains on its fixed bounds all the same."""
    spec = _spec(arm)
    run = _run(monkeypatch, spec)
    adv, mask = run["adv"], run["mask"]
    tokens = (mask & (adv != 0)).sum(1)
    total = [0, 0, 0]
    for step, (kw, plan) in enumerate(run["plans"]):
        assert kw["holdout_share"] == SHARE and kw["seed"] == SEED and kw["rank"] == 0
        held = _held_out(step, adv, mask)
        assert torch.nonzero(plan.holdout).flatten().tolist() == held and len(held) == round(SHARE * (N - 1))
        shadowed = torch.nonzero(plan.shadowed).flatten().tolist()
        assert set(held) <= set(shadowed) and not plan.measured[held].any()
        assert run["shadow_calls"][step] == sorted([(0, r) for r in shadowed] + [(r // GAS, r) for r in shadowed])
        fed = [f for f in run["fed"] if f["step"] == step]
        measured = torch.nonzero(plan.measured).flatten().tolist()
        assert sum(f["n"] for f in fed) == int(tokens[measured].sum())  # the measured rows' tokens, no others
        for f in fed:
            if f["seq"] is not None:
                assert not set(f["seq"].tolist()) & set(held)
        if arm == "vanilla":
            assert not fed and shadowed == held
        want = _ho_counts(run, step, held)
        assert tuple(run["statuses"][step][k] for k in HO) == want, (step, want)
        total = [a + b for a, b in zip(total, want, strict=True)]
    assert total[0] > 0 and total[1] > 0 and total[2] > 0  # not vacuous: held-out A<0 tokens clipped by both
    if arm == "vanilla":
        assert {f["bounds"] for f in run["forwards"]} == {(0.8, 1.28)}


def test_without_a_share_a_vanilla_arm_runs_no_shadow(monkeypatch):
    run = _run(monkeypatch, _spec("vanilla", share=0.0), steps=1)
    assert run["shadow_calls"] == [[]] and not any(k.startswith("shadow/") for k in run["statuses"][0])
    assert not run["plans"][0][1].holdout.any()


def test_held_out_counts_are_summed_over_the_ranks():
    """With the DP collectives live (two ranks holding this rank's data), the step's ``shadow/ho_*``
    are the sum over the ranks: twice one rank's counts."""
    with pytest.MonkeyPatch.context() as mp:
        one = _run(mp, _spec("vanilla"), steps=1)["statuses"][0]
    with pytest.MonkeyPatch.context() as mp:
        two = _run(mp, _spec("vanilla"), steps=1, two_ranks=True)["statuses"][0]
    assert one[M.SHADOW_HO_N_NEG] > 0
    assert all(two[k] == 2 * one[k] for k in HO), ({k: one[k] for k in HO}, {k: two[k] for k in HO})


def test_calibration_data_and_held_out_counts_reach_the_ingested_step(monkeypatch):
    """The step status ``ppo_train`` returns (what OpenRLHF logs) holds the calibration data
    ``clip/k``, ``clip/n``, ``clip/alpha_n`` and the ``shadow/ho_*`` counts; ingestion keeps them
    under the same names."""
    from fp8rl.backends.openrlhf.ingest import map_step

    status = _run(monkeypatch, _spec("same_batch"), steps=1)["statuses"][0]
    keys = (M.CLIP_K, M.CLIP_N, M.CLIP_ALPHA_N, *HO)
    assert all(k in status for k in keys), sorted(status)
    assert status[M.CLIP_N] > 0
    row = map_step(status)
    assert {k: row[k] for k in keys} == {k: float(status[k]) for k in keys}


def test_the_share_travels_from_the_config_to_the_spec_its_json_and_the_dry_run(tmp_path):
    import dataclasses

    from fp8rl.backends.openrlhf.command import plugin_lines

    cfg = next(c for key, c in main_table_configs(tmp_path) if key[3] == "tis")
    assert PluginSpec.from_config(cfg).holdout_share == 0.0 and plugin_lines(cfg, tmp_path / "run") == []
    cfg = dataclasses.replace(cfg, clip=dataclasses.replace(cfg.clip, holdout_share=0.125))
    spec = PluginSpec.from_config(cfg)
    assert spec.holdout_share == 0.125 and spec.to_dict()["holdout_share"] == 0.125
    assert PluginSpec.from_json(spec.to_json()) == spec
    (line,) = plugin_lines(cfg, tmp_path / "run")
    assert "holdout_share=0.125" in line
    for bad in (1.0, -0.1, True, "0.1", float("nan")):
        with pytest.raises(ValueError, match="holdout_share"):
            PluginSpec(holdout_share=bad)
