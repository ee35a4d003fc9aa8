"""End-to-end tests of the mini trainer loop (tiny configs; CPU; FP8 emulated)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from fp8rl.backends.mini import run_mini
from fp8rl.backends.mini.trainer import MiniTrainer
from fp8rl.runs import RunDir
from fp8rl.runs import metrics as M

ALWAYS = [m for m in M.TRAIN_METRICS if m not in M.SPARSE_METRICS]


def _rows(summary: dict) -> list[dict]:
    return RunDir(summary["run_dir"]).read_metrics()


def _no_perf(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.mark.parametrize("arm", ["fp32", "bf16", "rollout_only", "tensorwise", "blockwise"])
@pytest.mark.parametrize("clip", ["vanilla", "tis", "calibrated"])
def test_five_step_run_writes_every_metric(tiny, arm, clip):
    cfg = tiny(arm, clip)
    summary = run_mini(cfg)
    assert summary["state"] == "DONE", summary
    rd = RunDir(summary["run_dir"])
    rows = rd.read_metrics()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        missing = [m for m in ALWAYS if m not in r and m != M.DAPO_KEPT_GROUP_FRAC]
        assert not missing, (r["step"], missing)
    if clip == "calibrated":
        # period 2: controller steps 0, 2, 4 = logged steps 1, 3, 5 run the shadow pass; a
        # calibration with no A<0 token is degenerate (bounds kept, counted)
        done = 0
        for r in rows:
            calib = r["step"] % 2 == 1
            assert (M.PERF_SHADOW_S in r) == calib, r["step"]
            done_now = r["clip/calibrations"] + r["clip/degenerate_updates"]
            assert done_now == done + calib
            done = done_now
            if M.SHADOW_CLIPFRAC_NEG_LOW in r:
                assert calib and M.CLIP_ALPHA in r
        assert done == 3
        assert rows[-1]["clip/calibrations"] >= 1  # at least one real calibration
    else:
        assert all(r[M.CLIP_LOW] == 0.8 and r[M.CLIP_HIGH] == 1.2 for r in rows)
    kl = [r[M.ROLLOUT_MISMATCH_KL] for r in rows]
    if arm == "fp32":  # an exact copy; KV cache and fused attention differ by float round-off
        assert all(0 <= v < 1e-9 for v in kl)
    elif arm == "bf16":
        # a BF16 engine: one query per step and a fused attention (fp32 scores) vs the trainer's
        # eager BF16 attention -> a small natural mismatch
        assert all(0 < v < 1e-3 for v in kl)
    else:
        # FP8 rollout: the engine's FP8 activations differ from the trainer's (tensorwise: scales
        # over a decode step vs whole sequences; every recipe: FP8 rounding amplifies the BF16
        # engine's small differences)
        assert all(v > 1e-5 for v in kl)
    ev = rd.read_eval()
    assert [e["step"] for e in ev] == [0, 5]
    assert 0 <= ev[-1][M.eval_key("arith", "avg@k")] <= ev[-1][M.eval_key("arith", "pass@k")] <= 1
    assert rd.status()["state"] == "DONE" and rd.summary()["steps"] == 5
    assert (rd.path / "config.yaml").exists() and (rd.path / "provenance.json").exists()
    samples = sorted(rd.samples_dir.glob("*.jsonl"))
    assert [p.name for p in samples] == ["step_000002.jsonl", "step_000004.jsonl"]
    first = json.loads(samples[0].read_text().splitlines()[0])
    assert set(first) >= {"prompt", "response", "answer", "reward", "garbled"}


@pytest.mark.parametrize(("clip", "low"), [("no_lower_clip", 1e-30), ("wide_lower", 0.6)])
def test_the_calibration_controls_train_with_their_own_bounds_and_tis(tiny, clip, low):
    """The two controls of Calibrated Clipping run end to end at mini scale: their lower bound in
    force every step, vanilla's upper bound, and no BF16 shadow pass (their TIS: the arm table,
    ``tests/rl/test_clipping.py``)."""
    summary = run_mini(tiny("tensorwise", clip, steps=3))
    assert summary["state"] == "DONE", summary
    rows = RunDir(summary["run_dir"]).read_metrics()
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r[M.CLIP_LOW] == low and r[M.CLIP_HIGH] == 1.2 for r in rows)
    assert all(M.PERF_SHADOW_S not in r and "clip/calibrations" not in r for r in rows)


def test_same_seed_same_metrics(tiny, tmp_path):
    a = run_mini(tiny("tensorwise", "calibrated", steps=3, run_dir=str(tmp_path / "a")))
    b = run_mini(tiny("tensorwise", "calibrated", steps=3, run_dir=str(tmp_path / "b")))
    c = run_mini(tiny("tensorwise", "calibrated", steps=3, seed=1, run_dir=str(tmp_path / "c")))
    assert _no_perf(_rows(a)) == _no_perf(_rows(b))
    assert _no_perf(_rows(a)) != _no_perf(_rows(c))
    assert RunDir(a["run_dir"]).read_eval() == RunDir(b["run_dir"]).read_eval()


def test_evaluations_do_not_perturb_training(tiny, tmp_path):
    """Evaluating every step or only at the end trains identically and ends on the same final
    evaluation (evaluations sample from their own generator): how often to evaluate is a cost
    choice, not a change of the experiment."""
    kw = dict(steps=3, samples_every=0)
    often = run_mini(tiny("tensorwise", "calibrated", eval_every=1, run_dir=str(tmp_path / "often"), **kw))
    end = run_mini(tiny("tensorwise", "calibrated", eval_every=0, run_dir=str(tmp_path / "end"), **kw))
    assert _no_perf(_rows(often)) == _no_perf(_rows(end))
    ev_often, ev_end = RunDir(often["run_dir"]).read_eval(), RunDir(end["run_dir"]).read_eval()
    assert [r["step"] for r in ev_often] == [0, 1, 2, 3] and [r["step"] for r in ev_end] == [0, 3]
    assert ev_often[0] == ev_end[0] and ev_often[-1] == ev_end[-1]


@pytest.mark.parametrize("mode", ["periodic", "pooled", "same_batch"])
def test_kill_and_resume_gives_the_same_metrics(tiny, tmp_path, killed_at, mode):
    kw = dict(steps=5, checkpoint_every=2, eval_every=2, clip_opts={"calibration_mode": mode})
    ref = run_mini(tiny("tensorwise", "calibrated", run_dir=str(tmp_path / "ref"), **kw))
    cfg = tiny("tensorwise", "calibrated", run_dir=str(tmp_path / "killed"), **kw)
    killed_at(cfg, 4)
    rd = RunDir(tmp_path / "killed")
    assert rd.status()["state"] == "PREEMPTED"
    assert [r["step"] for r in rd.read_metrics()] == [1, 2, 3]  # step 3 logged after the checkpoint
    resumed = run_mini(cfg)
    assert resumed["state"] == "DONE"
    assert _no_perf(rd.read_metrics()) == _no_perf(_rows(ref))
    assert rd.read_eval() == RunDir(ref["run_dir"]).read_eval()
    # a DONE run is skipped when asked again
    assert run_mini(cfg).get("skipped") is True


@pytest.mark.parametrize("arm", ["bf16", "tensorwise"])
def test_one_update_per_batch_ratio_is_one(tiny, arm):
    summary = run_mini(tiny(arm, "vanilla", steps=2, num_mini_batches=1))
    for r in _rows(summary):
        assert r[M.ACTOR_CLIPFRAC] == 0.0
        for cell in ("neg_low", "neg_high", "pos_low", "pos_high"):
            v = r[f"actor/clipfrac_{cell}"]
            assert v is None or v == 0.0  # None: no token of that sign
        for q in ("q01", "q50", "q99"):
            v = r[f"actor/ratio_neg_{q}"]
            assert v is None or v == 1.0
        assert r[M.ACTOR_PPO_KL] == 0.0


def test_several_minibatches_move_the_ratio(tiny):
    rows = _rows(run_mini(tiny("bf16", "vanilla", steps=2, num_mini_batches=4)))
    assert any(r[M.ACTOR_RATIO_NEG_Q01] not in (None, 1.0) or r[M.ACTOR_PPO_KL] != 0.0 for r in rows)


def test_dapo_dynamic_sampling_and_overlong(tiny):
    cfg = tiny("bf16", "vanilla", steps=3,
               algorithm=dict(name="dapo", eps_high=0.28, dynamic_sampling=True, max_extra_rounds=2,
                              overlong_buffer=8))
    rows = _rows(run_mini(cfg))
    for r in rows:
        assert 0.0 <= r[M.DAPO_KEPT_GROUP_FRAC] <= 1.0
        assert 0 <= r["dapo/extra_rounds"] <= 2
        assert r[M.ROLLOUT_REWARD_MEAN] <= r[M.ROLLOUT_ACC] + 1e-6  # penalties only subtract


def test_non_finite_loss_fails_the_run(tiny, monkeypatch):
    import fp8rl.rl.aggregation as agg

    real = agg.aggregate
    monkeypatch.setattr(agg, "aggregate", lambda *a, **k: real(*a, **k) * float("nan"))
    cfg = tiny("bf16", "vanilla", steps=5, max_bad_steps=2)
    summary = run_mini(cfg)
    assert summary["state"] == "FAILED"
    rd = RunDir(summary["run_dir"])
    st = rd.status()
    assert st["state"] == "FAILED" and "non-finite" in st["reason"]
    rows = rd.read_metrics()
    assert [r["train/skipped_updates"] for r in rows] == [2]  # step 1 logged; step 2 raised
    # the skipped updates left the weights finite
    assert rd.summary()["state"] == "FAILED"


@pytest.mark.parametrize("arm", ["fp32", "bf16"])
def test_rollout_engine_is_resynced_after_every_update(tiny, arm):
    """The engine holds the trainer's master weights after every step: an exact copy (fp32),
    or the copy rounded to BF16 once per sync (a BF16 engine, as vLLM loads BF16 weights)."""
    cfg = tiny(arm, "vanilla", steps=1)
    trainer = MiniTrainer(cfg, None, sft_cache=cfg.mini.cache_dir)
    before = {k: v.clone() for k, v in trainer.engine.model.state_dict().items()}
    trainer.train_step(1)
    after = trainer.engine.model.state_dict()
    policy = trainer.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    if arm == "fp32":
        assert all(torch.equal(after[k], policy[k]) for k in after)
    else:
        assert all(torch.equal(after[k], policy[k].to(torch.bfloat16).float()) for k in after)
        assert any(not torch.equal(after[k], policy[k]) for k in after)  # the rounding is real
    assert math.isfinite(trainer.summary(0.0, "DONE", None)["wall_s"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("emulate", [True, False])
def test_cuda_run(tiny, emulate, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    cfg = tiny("tensorwise", "calibrated", steps=3, mini={"device": "cuda"})
    cfg = dataclasses.replace(cfg, fp8=dataclasses.replace(cfg.fp8, emulate=emulate))
    summary = run_mini(cfg)
    assert summary["state"] == "DONE"
    assert len(_rows(summary)) == 3


def test_cuda_determinism_needs_cublas_config(monkeypatch):
    from fp8rl.backends.mini.runtime import torch_settings

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with pytest.raises(RuntimeError, match="CUBLAS_WORKSPACE_CONFIG"), torch_settings(True, 0, "cuda"):
        pass
    with torch_settings(False, 0, "cuda"):
        pass


def test_an_update_moves_log_probs_along_the_advantage(tiny):
    """Sign check of the whole update path (BF16, one small AdamW step): the surrogate
    sum(A * delta log-prob) increases, tokens with A>0 became more likely and tokens with A<0
    less likely on average."""
    cfg = tiny("bf16", "vanilla", steps=1, num_mini_batches=1, lr=1e-5, prompts_per_step=8)
    trainer = MiniTrainer(cfg, None, sft_cache=cfg.mini.cache_dir)
    gen = torch.Generator().manual_seed(0)
    batch, _, _ = trainer.collect(1, gen)
    rb, idx = batch.rollout, torch.arange(len(batch))
    adv = trainer.advantages(batch)
    with torch.no_grad():
        before = trainer.forward_logits(rb, idx).log_softmax(-1).gather(-1, rb.response_ids[..., None])[..., 0]
    trainer.update(1, batch, gen)
    with torch.no_grad():
        after = trainer.forward_logits(rb, idx).log_softmax(-1).gather(-1, rb.response_ids[..., None])[..., 0]
    m = rb.response_mask.bool()
    delta = (after - before)[m]
    a = adv[m]
    assert (a > 0).any() and (a < 0).any()
    assert (a * delta).sum() > 0
    assert delta[a > 0].mean() > 0 > delta[a < 0].mean()


@pytest.mark.parametrize("arm", ["bf16", "rowwise", "blockwise", "tensorwise"])
def test_old_log_probs_in_their_own_micro_batches(tiny, arm):
    """Old log-probs are recomputed in rollout-order micro-batches (OpenRLHF's
    --rollout.micro_batch_size), not the updates' mini-batch: with one update per batch the
    ratio is 1 for per-row/per-token scales and BF16 (batch-invariant), but not for tensorwise,
    whose activation scale is the amax of whatever batch a GEMM sees."""
    rows = _rows(run_mini(tiny(arm, "vanilla", steps=2, num_mini_batches=1, logprob_micro_batch=4)))
    moved = any(r[M.ACTOR_PPO_KL] != 0.0 for r in rows)
    assert moved == (arm == "tensorwise")


def _count_shadow_forwards(monkeypatch) -> list:
    """Patch ``fp8_disabled`` (the shadow's context) to record each use: one entry per BF16
    shadow forward (old log-probs: one per step; current policy: one per mini-batch after the
    step's first optimizer step, the first mini-batch's being the old log-probs)."""
    import fp8rl.quant.convert as conv

    calls: list = []
    real = conv.fp8_disabled

    def counted(model):
        calls.append(1)
        return real(model)

    monkeypatch.setattr(conv, "fp8_disabled", counted)
    return calls


@pytest.mark.parametrize("mode", ["periodic", "pooled"])
def test_calibration_pools_every_minibatch_and_rules_the_next_step(tiny, monkeypatch, mode):
    """On a calibration step the controller gets the tokens of every mini-batch, the first
    included (their FP8 ratios before each update, and the BF16 shadow ratios of the same tokens
    on the same weights), once, after the updates; the new bounds rule from the next step."""
    opts = {"calibration_mode": mode, **({"period": 2, "ema": 0.0} if mode == "periodic" else {})}
    cfg = tiny("tensorwise", "calibrated", steps=4, num_mini_batches=4, clip_opts=opts)
    trainer = MiniTrainer(cfg, None, sft_cache=cfg.mini.cache_dir)
    seen: list = []
    mb_rows: list = []
    real_update, real_mb = trainer.clipper.update_step, trainer.minibatch_update

    def update(step, parts):  # the plan's pooled update: every measured mini-batch's tokens, in order
        cat = [torch.cat([p[i] for p in parts]) for i in range(3)]
        seen.append((step, {"ratio": cat[0], "shadow_ratio": cat[1], "advantages": cat[2],
                            "mask": torch.ones_like(cat[0], dtype=torch.bool)}))
        return real_update(step, parts)

    def mb(rb, idx, *a, **kw):
        res = real_mb(rb, idx, *a, **kw)
        mb_rows.append((int(rb.response_mask[idx].sum()), res))
        return res

    monkeypatch.setattr(trainer.clipper, "update_step", update)
    monkeypatch.setattr(trainer, "minibatch_update", mb)
    shadows = _count_shadow_forwards(monkeypatch)
    rows = [trainer.train_step(s) for s in range(1, 5)]
    calib = [0, 2] if mode == "periodic" else [0, 1, 2, 3]
    assert [s for s, _ in seen] == calib  # controller steps = logged steps - 1
    assert len(shadows) == 4 * len(calib)  # old log-probs + mini-batches 2-4 (the 1st is on the old weights)
    first = mb_rows[:4]
    assert all(r["shadow_ratio"] is not None for _, r in first)
    pooled = seen[0][1]
    assert pooled["ratio"].numel() == sum(n for n, _ in first)
    want = torch.cat([r["ratio"][r["mask"].bool()] for _, r in first])
    assert torch.equal(pooled["ratio"], want)
    assert not torch.equal(pooled["ratio"], pooled["shadow_ratio"])  # FP8 vs BF16 shadow
    assert rows[0]["clip/n_neg"] == float(int((pooled["advantages"] < 0).sum()))
    # bounds: computed at the end of step 1, in force during step 2 (and used by its losses)
    assert (rows[1][M.CLIP_LOW], rows[1][M.CLIP_HIGH]) == (rows[0]["clip/low_next"], rows[0]["clip/high_next"])
    assert all(r["bounds"] == (rows[1][M.CLIP_LOW], rows[1][M.CLIP_HIGH]) for _, r in mb_rows[4:8])
    assert (rows[0][M.CLIP_LOW], rows[0][M.CLIP_HIGH]) == (0.6, 1.8)  # the initial bounds ruled step 1
    # agreement: the pooled tokens against the bounds in force during the step
    from fp8rl.rl.calibration.agreement import agreement_counts

    c = agreement_counts(pooled["ratio"], pooled["shadow_ratio"], pooled["advantages"], pooled["mask"],
                         low=0.6, high=1.8, vanilla_low=0.8, vanilla_high=1.2)
    assert [rows[0][k] for k in (M.SHADOW_LOW_BF16_N, M.SHADOW_LOW_FP8_N, M.SHADOW_HIGH_BOTH_N)] == \
        [float(c[0]), float(c[1]), float(c[5])]


def test_same_batch_bounds_come_from_each_minibatch_before_its_loss(tiny, monkeypatch):
    """same_batch: every mini-batch of every step (the first included) runs the shadow forward,
    and its loss uses bounds calibrated on its own tokens (reference: calibrate_bounds on the
    FP8 and shadow ratios it measured)."""
    from fp8rl.rl.calibration import calibrate_bounds

    cfg = tiny("tensorwise", "calibrated", steps=2, num_mini_batches=4, clip_opts={"calibration_mode": "same_batch"})
    trainer = MiniTrainer(cfg, None, sft_cache=cfg.mini.cache_dir)
    mb_rows: list = []
    real_mb = trainer.minibatch_update

    def mb(rb, idx, *a, **kw):
        res = real_mb(rb, idx, *a, **kw)
        mb_rows.append(res)
        return res

    monkeypatch.setattr(trainer, "minibatch_update", mb)
    shadows = _count_shadow_forwards(monkeypatch)
    rows = [trainer.train_step(s) for s in range(1, 3)]
    assert len(mb_rows) == 8 and len(shadows) == 2 * (1 + 3)  # old + mini-batches 2-4
    n_cal = 0
    for res in mb_rows:
        assert res["shadow_ratio"] is not None and not torch.equal(res["shadow_ratio"], res["ratio"])
        try:
            ref = calibrate_bounds(res["ratio"], res["shadow_ratio"], res["adv"], res["mask"], eps_low=0.2,
                                   eps_high=0.2, low_min=0.5, high_max=2.0,
                                   lower_estimator="in_sample")  # same_batch's own estimator
        except Exception:  # degenerate: the previous bounds are kept
            continue
        n_cal += 1
        assert res["bounds"] == (ref.low, ref.high)
    assert n_cal >= 4
    lows = [r["bounds"][0] for r in mb_rows[:4]]
    assert rows[0][M.CLIP_LOW] == pytest.approx(sum(lows) / 4)
    assert rows[0][M.SHADOW_LOW_FP8_N] == sum(int(((r["ratio"] < r["bounds"][0]) & (r["adv"] < 0)
                                                   & r["mask"].bool()).sum()) for r in mb_rows[:4])
    assert M.PERF_SHADOW_S in rows[0] and M.PERF_SHADOW_S in rows[1]


@pytest.mark.parametrize("arm", ["tensorwise", "bf16"])
def test_shadow_diagnostics_do_not_change_training(tiny, tmp_path, arm):
    """clip.shadow_diagnostics on a vanilla/TIS arm: every step logs the agreement metrics
    (bounds in force = vanilla), and everything else is bit-identical to the run without."""
    kw = dict(steps=3, samples_every=0, eval_every=0)
    off = _rows(run_mini(tiny(arm, "tis", run_dir=str(tmp_path / "off"), **kw)))
    on = _rows(run_mini(tiny(arm, "tis", clip_opts={"shadow_diagnostics": True}, run_dir=str(tmp_path / "on"), **kw)))
    shadow_keys = {k for r in on for k in r if k.startswith("shadow/") or k == M.PERF_SHADOW_S}
    assert {M.SHADOW_LOW_RECALL, M.SHADOW_HIGH_PRECISION, M.SHADOW_LOW_BF16_N, M.PERF_SHADOW_S} <= shadow_keys
    assert all(M.SHADOW_LOW_FP8_N in r for r in on)
    strip = [{k: v for k, v in r.items() if k not in shadow_keys} for r in on]
    assert _no_perf(strip) == _no_perf(off)
    if arm == "bf16":  # its own ratios are the shadow: the same tokens on both sides
        for r in on:
            assert r[M.SHADOW_LOW_FP8_N] == r[M.SHADOW_LOW_BF16_N] == r[M.SHADOW_LOW_BOTH_N]


def test_step0_evaluation_is_shared_by_cells_with_the_same_engine(tiny, tmp_path):
    """Two runs with the same warm start, engine, evaluation settings and seed: the second reads
    the first's step-0 evaluation from beside the warm start; another engine computes its own."""
    from pathlib import Path

    # the warm-start cache is shared by the run's tests (other workers write to it meanwhile):
    # count only what these runs add, by their seed
    seed = 4242
    cache = Path(tiny("bf16").mini.cache_dir)
    before = set(cache.glob("*/eval0-*.json"))
    a = run_mini(tiny("bf16", "vanilla", steps=1, seed=seed, run_dir=str(tmp_path / "a")))
    b = run_mini(tiny("bf16", "tis", steps=1, seed=seed, run_dir=str(tmp_path / "b")))
    c = run_mini(tiny("rollout_only", "tis", steps=1, seed=seed, run_dir=str(tmp_path / "c")))
    ev = {k: RunDir(s["run_dir"]).read_eval()[0] for k, s in {"a": a, "b": b, "c": c}.items()}
    assert ev["a"] == ev["b"]
    cached = sorted(p for p in set(cache.glob("*/eval0-*.json")) - before
                    if json.loads(p.read_text())["spec"]["seed"] == seed)
    assert {p.parent.name for p in cached} == {a["sft"]["key"]}
    assert len(cached) == 2  # the bf16 engine's, the tensorwise engine's (c's BF16 evaluation: a's entry)
    rows = [json.loads(p.read_text())["row"] for p in cached]

    def own(row):  # an entry holds one engine's row: the arm's own keys
        return {k: v for k, v in row.items() if not k.startswith(M.EVAL_BF16_PREFIX)}

    assert own(ev["a"]) in rows and own(ev["c"]) in rows
