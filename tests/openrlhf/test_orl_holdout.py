"""Held-out rows at paper scale (issue 46, ``clip.holdout_share``): from the config through the
plugin spec to the binding around upstream 0.11.2's real ``ppo_actor.py`` (heavy imports stubbed,
as in ``test_orl_plugin_bind``), for every clip arm alike.

References computed here, independently of the binding: the held-out rows of each step
(``sampling.draw_holdout`` from the eligible rows, the spec's seed, the step and rank 0), the FP8
and BF16 ratios of the stand-in actor (``_want``), the bounds each loss used (recorded), and so
the ``shadow/ho_*`` counts. Planted bugs (each fails a test here): held-out rows left in the
calibration set (``Pending.measured | holdout`` in ``binding.calibrate.plan_windows``), held-out
rows observed without ``holdout=True`` (``plugin.loss``), the windows not run for a vanilla arm
(``binding.actor``), the counts not summed over ranks (``end_step`` without ``reduce_sum``).
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from orl_helpers import main_table_configs
from test_orl_plugin_bind import _FakeActor, _Strategy, _want, load_ppo_actor

from fp8rl.backends.openrlhf import plugin
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
    """``steps`` ``ppo_train`` calls through the binding (``N`` samples, micro-batches of 1, windows
    of ``GAS``; the weights change after each window). The last sample has A == 0 (not eligible).
    ``two_ranks``: the DP collectives of ``binding.actor`` act as two ranks holding this one's data."""
    import torch.distributed as dist

    import fp8rl.quant.convert as convert
    from fp8rl.backends.openrlhf.plugin.binding import actor as actor_binding

    ppo_actor, _ = load_ppo_actor(monkeypatch)
    actor = _FakeActor(N, T)

    @contextlib.contextmanager
    def fp8_disabled(model):
        model.bf16 = True
        try:
            yield model
        finally:
            model.bf16 = False

    monkeypatch.setattr(convert, "fp8_disabled", fp8_disabled)
    if two_ranks:
        def all_reduce(t, op=None, group=None):
            if op == dist.ReduceOp.SUM:
                t.mul_(2)
            return t

        monkeypatch.setattr(actor_binding, "_dp_group", lambda strategy: (None, True))
        monkeypatch.setattr(actor_binding, "varlen_all_gather", lambda t, group=None: [t, t])
        monkeypatch.setattr(dist, "all_reduce", all_reduce)
    g = torch.Generator().manual_seed(1)
    sign = torch.tensor([(-1.0) ** i for i in range(N)])[:, None]
    adv = (sign * (torch.rand(N, 1, generator=g) + 0.1)).expand(N, T).clone()
    adv[N - 1] = 0.0
    mask = torch.arange(T)[None, :] < torch.randint(T // 2, T + 1, (N,), generator=g)[:, None]

    def collate(chunk):
        idx = torch.tensor([c.idx for c in chunk])
        info = {k: [c.info[k] for c in chunk] for k in chunk[0].info}
        return types.SimpleNamespace(sequences=idx, action_mask=mask[idx], attention_mask=None, advantages=adv[idx],
                                     action_log_probs=None, info=info, to_device=lambda d, self=None: None)

    forwards = []

    def fake_step(self, experience, kl_ctl, step, loss_batch_info=None):  # upstream's order of events
        lp = self.actor(experience.sequences, experience.action_mask)
        loss = self.actor_loss_fn
        out = loss(lp, experience.action_log_probs, experience.advantages, experience.action_mask,
                   rollout_log_probs=experience.action_log_probs, **loss_batch_info)
        w = loss.window
        forwards.append({"step": loss.step, "k": self.actor.k, "idx": experience.sequences.tolist(),
                         "bounds": (w.bounds() if w is not None else loss.clipper.bounds(loss.step)).as_tuple()})
        if step % GAS == GAS - 1:
            self.actor.k += 1
        return out

    def fake_ppo_train(self, kl_ctl):
        batches = []
        for i in range(N):
            b = collate([self.replay_buffer.items[i]])
            b.action_log_probs = old[i:i + 1]
            batches.append(b)
        windows = ppo_actor.iter_grad_accum_global_norm(iter(batches), self.strategy, GAS, lambda e: e.action_mask)
        for step, (exp, info) in enumerate(windows):
            self.training_step(exp, kl_ctl, step, info)
        return {"policy_loss": 0.0}

    monkeypatch.setattr(ppo_actor.ActorPPOTrainer, "training_step", fake_step)
    monkeypatch.setattr(ppo_actor.ActorPPOTrainer, "ppo_train", fake_ppo_train)
    plugin.install(spec, modules={"ppo_actor": ppo_actor})
    strategy = _Strategy()
    strategy.ring_attn_group = None
    trainer = ppo_actor.ActorPPOTrainer(strategy, actor=actor, ema_model=None, actor_optim=None, actor_scheduler=None)
    trainer.micro_train_batch_size = 1
    trainer.replay_buffer.collate_fn = collate
    ctl = trainer.actor_loss_fn.clipper
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
    statuses, shadow_calls = [], []
    for _ in range(steps):
        actor.k = 0
        old = actor.base + actor.noise[0]  # the FP8 trainer's old log-probs, before the step's first update
        trainer.replay_buffer.items = [types.SimpleNamespace(idx=i, action_mask=mask[i], advantages=adv[i], info={})
                                       for i in range(N)]
        before = len(actor.calls)
        statuses.append(trainer.ppo_train(0.0))
        shadow_calls.append(sorted((k, r) for kind, k, rows in actor.calls[before:] if kind == "bf16" for r in rows))
    return {"actor": actor, "adv": adv, "mask": mask, "old": old, "forwards": forwards, "plans": plans, "fed": fed,
            "statuses": statuses, "shadow_calls": shadow_calls}


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
