"""The mini trainer under ``sampled`` calibration and the diagnostic gradient comparison: the BF16
shadow runs on the subset only, the subset is ruled by the bounds in force, diagnostics leave
training unchanged, and ``shadow/grad_cos`` is against the BF16 model's gradient."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from fp8rl.backends.mini.run import run_mini
from fp8rl.backends.mini.trainer import MiniTrainer
from fp8rl.runs import metrics as M
from fp8rl.runs.rundir import RunDir

SAMPLED = {"calibration_mode": "sampled", "sample_fraction": 0.25}


def _rows(summary) -> list[dict]:
    return RunDir(summary["run_dir"]).read_metrics()


def _forward_log(trainer, monkeypatch) -> list[tuple[bool, list[int]]]:
    """Record every trainer forward: (FP8 off?, the rows it computed)."""
    import fp8rl.quant.convert as conv

    state = {"off": 0}
    real_off, real_fwd = conv.fp8_disabled, trainer.forward_logits
    log: list = []

    @contextlib.contextmanager
    def off(model):
        state["off"] += 1
        try:
            with real_off(model):
                yield model
        finally:
            state["off"] -= 1

    def fwd(rb, idx):
        log.append((state["off"] > 0, idx.tolist()))
        return real_fwd(rb, idx)

    monkeypatch.setattr(conv, "fp8_disabled", off)
    monkeypatch.setattr(trainer, "forward_logits", fwd)
    return log


def test_sampled_shadows_only_its_subset_and_rules_it_with_the_bounds_in_force(tiny, monkeypatch):
    cfg = tiny("tensorwise", "calibrated", steps=2, num_mini_batches=2, clip_opts=SAMPLED)
    trainer = MiniTrainer(cfg, None, sft_cache=cfg.mini.cache_dir)
    plans, mbs = [], []
    real_begin, real_mb = trainer.clipper.begin_step, trainer.minibatch_update

    def begin(step, **kw):
        plans.append(real_begin(step, **kw))
        return plans[-1]

    def mb(rb, idx, *a, **kw):
        res = real_mb(rb, idx, *a, **kw)
        mbs.append((idx.tolist(), res))
        return res

    monkeypatch.setattr(trainer.clipper, "begin_step", begin)
    monkeypatch.setattr(trainer, "minibatch_update", mb)
    log = _forward_log(trainer, monkeypatch)
    rows, logs = [], []
    for s in (1, 2):
        log.clear()
        rows.append(trainer.train_step(s))
        logs.append(list(log))
    in_force = (0.6, 1.8)
    subsets = []
    for step, plan in enumerate(plans):
        subset = sorted(torch.nonzero(plan.measured).flatten().tolist())
        subsets.append(subset)
        off = [r for is_off, idx in logs[step] if is_off for r in idx]
        first = mbs[2 * step][0]  # the first mini-batch runs on the old weights: no current forward
        want = subset + [r for r in subset if r not in first]
        assert sorted(off) == sorted(want)  # BF16 old and current log-probs: the subset only
        on = [r for is_off, idx in logs[step] if not is_off for r in idx]
        assert len(on) == 2 * plan.n  # FP8 old log-probs and the training forwards: every row
        for idx, res in mbs[2 * step: 2 * step + 2]:
            if any(i in subset for i in idx):
                assert res["bounds_first"] == pytest.approx(in_force)  # the subset: the bounds in force
            else:
                assert res["bounds_first"] is None
            in_force = res["bounds"]  # the rest: the subset's estimate; the next window's subset too
        m = int(plan.eligible.sum())  # rows with any A != 0 (0 on a step whose groups all agree)
        assert rows[step]["clip/sample_seqs"] == len(subset) == share_rule(m)
    if all(int(p.eligible.sum()) > 1 for p in plans):
        assert subsets[0] != subsets[1]  # re-drawn each step


def share_rule(m: int, share: float = 0.25) -> int:
    """The measured sequences of a step with ``m`` eligible ones: round(share * m), at least one
    when there is any, none when there is none (``sampling.draw_subset``)."""
    return 0 if m == 0 else max(1, int(share * m + 0.5))


def test_a_step_without_any_nonzero_advantage_measures_nothing_and_keeps_the_bounds(tiny, monkeypatch):
    """Constructed, not found: step 1's advantages are all zero (every group all right or all
    wrong), so no sequence is eligible: none is shadowed or measured, the bounds in force stay,
    and step 2 (real advantages) draws and calibrates as usual."""
    cfg = tiny("tensorwise", "calibrated", steps=2, num_mini_batches=2, clip_opts=SAMPLED)
    trainer = MiniTrainer(cfg, None, sft_cache=cfg.mini.cache_dir)
    real_adv = trainer.advantages
    plans = []
    real_begin = trainer.clipper.begin_step

    def begin(step, **kw):
        plans.append(real_begin(step, **kw))
        return plans[-1]

    monkeypatch.setattr(trainer.clipper, "begin_step", begin)
    monkeypatch.setattr(trainer, "advantages", lambda batch: torch.zeros_like(real_adv(batch)))
    log = _forward_log(trainer, monkeypatch)
    row = trainer.train_step(1)
    assert int(plans[0].eligible.sum()) == 0 and not plans[0].measured.any() and not plans[0].shadowed.any()
    assert row["clip/sample_seqs"] == 0
    assert not any(is_off for is_off, _ in log)  # no BF16 shadow forward at all
    assert (row[M.CLIP_LOW], row[M.CLIP_HIGH]) == pytest.approx((0.6, 1.8))  # the initial bounds stay
    monkeypatch.setattr(trainer, "advantages", real_adv)
    row2 = trainer.train_step(2)
    m = int(plans[1].eligible.sum())
    assert row2["clip/sample_seqs"] == share_rule(m)


@pytest.mark.parametrize("mode", [SAMPLED, {"calibration_mode": "same_batch"}])
def test_diagnostics_do_not_change_a_calibrated_run(tiny, tmp_path, mode):
    """clip.shadow_diagnostics on a calibrated arm shadows every row and compares gradients;
    every metric but the shadow's is bit-identical to the run without."""
    kw = dict(steps=3, samples_every=0, eval_every=0)
    off = _rows(run_mini(tiny("tensorwise", "calibrated", clip_opts=mode, run_dir=str(tmp_path / "off"), **kw)))
    on = _rows(run_mini(tiny("tensorwise", "calibrated", clip_opts={**mode, "shadow_diagnostics": True},
                             run_dir=str(tmp_path / "on"), **kw)))
    cos = [r[M.SHADOW_GRAD_COS] for r in on if M.SHADOW_GRAD_COS in r]  # steps with a gradient
    assert cos and all(-1 <= c <= 1 for c in cos)
    assert all(M.SHADOW_OOS_N_NEG in r or M.SHADOW_XFIT_N_NEG in r for r in on)

    def train(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("shadow/", "perf/"))} for r in rows]

    assert train(on) == train(off)


def _one_minibatch(arm, clip, tiny):
    """A trainer after one step, and one mini-batch of a fresh rollout with everything the
    gradient comparison reads."""
    from fp8rl.backends.mini.runtime import seed_for
    from fp8rl.backends.mini.shadow import shadow_old_log_probs
    from fp8rl.rl.correction import is_weights

    cfg = tiny(arm, clip, steps=2, clip_opts={"shadow_diagnostics": True})
    trainer = MiniTrainer(cfg, None, sft_cache=cfg.mini.cache_dir)
    trainer.train_step(1)
    # the first fresh rollout whose advantages are not all zero (which one that is depends on the
    # CPU's kernels: every group of a batch can be all right or all wrong)
    for attempt in range(32):
        gen = torch.Generator().manual_seed(seed_for(cfg.seed, "step", 2, *([attempt] if attempt else [])))
        batch = trainer.rollout(2, 0, gen)
        adv = trainer.advantages(batch)
        if bool((adv != 0).any()):
            break
    rb = batch.rollout
    old, _ = trainer.old_log_probs(rb)
    shadow_old = shadow_old_log_probs(trainer, rb, torch.ones(len(batch), dtype=torch.bool))
    ref_w, _ = is_weights(shadow_old, rb.rollout_log_probs, rb.response_mask, cfg.clip.is_correction,
                          **cfg.clip.correction_params())
    idx = torch.arange(len(batch))
    assert bool((adv != 0).any())  # the batch carries a gradient
    return trainer, rb, idx, adv[idx], old[idx], shadow_old[idx], ref_w[idx]


def _trained_grads(trainer, rb, idx, adv, old):
    """Backpropagate an FP8 loss (vanilla bounds, a stand-in for the arm's) into ``.grad``."""
    from fp8rl.backends.mini.batch import token_logprobs
    from fp8rl.rl.aggregation import aggregate
    from fp8rl.rl.policy_loss import ppo_token_loss

    trainer.optimizer.zero_grad(set_to_none=True)
    mask = rb.response_mask[idx]
    logp = token_logprobs(trainer.forward_logits(rb, idx), rb.response_ids[idx], trainer.cfg.temperature)
    loss_mat, _ = ppo_token_loss(logp, old, adv, mask, low=0.8, high=1.2, metrics=False)
    aggregate(loss_mat, mask, "token-mean").backward()
    return [None if p.grad is None else p.grad.clone() for p in trainer.policy.parameters()]


def _independent_bf16_grads(trainer, rb, idx, adv, shadow_old, ref_w):
    """The reference by hand: a copy of the policy with every FP8 layer replaced by a BF16 GEMM on
    its master weights (no fp8_disabled), the BF16 ratios, vanilla bounds, BF16 IS weights."""
    from fp8rl.backends.mini.batch import response_logits, token_logprobs
    from fp8rl.quant.convert import fp8_layers
    from fp8rl.quant.lowp import linear
    from fp8rl.rl.aggregation import aggregate
    from fp8rl.rl.policy_loss import ppo_token_loss

    model = copy.deepcopy(trainer.policy)
    for mod in fp8_layers(model):  # the BF16 GEMM on the master weights (fp32 accumulation)
        mod.forward = (lambda m: (lambda x: linear(x, m.weight, m.bias)))(mod)
    mask = rb.response_mask[idx]
    logits = response_logits(model, rb.prompt_ids[idx], rb.prompt_mask[idx], rb.response_ids[idx], mask,
                             trainer.dtype)
    logp = token_logprobs(logits, rb.response_ids[idx], trainer.cfg.temperature)
    a = trainer.cfg.algorithm
    loss_mat, _ = ppo_token_loss(logp, shadow_old, adv, mask, low=1 - a.eps_low, high=1 + a.eps_high,
                                 dual_clip=a.dual_clip, metrics=False)
    aggregate(loss_mat * ref_w, mask, a.loss_agg_mode, horizon=trainer.cfg.max_response_len).backward()
    return [None if p.grad is None else p.grad for p in model.parameters()]


def test_grad_cos_compares_with_the_bf16_models_gradient(tiny):
    from fp8rl.backends.mini.shadow import grad_cosine, reference_grad_cos

    trainer, rb, idx, adv, old, shadow_old, ref_w = _one_minibatch("tensorwise", "tis", tiny)
    trained = _trained_grads(trainer, rb, idx, adv, old)
    cos, _ = reference_grad_cos(trainer, rb, idx, adv, shadow_old, ref_w)
    for p, g in zip(trainer.policy.parameters(), trained, strict=True):  # the trained gradient is back
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)
    want = grad_cosine(trained, _independent_bf16_grads(trainer, rb, idx, adv, shadow_old, ref_w))
    assert cos == pytest.approx(want, abs=1e-6)
    fp8_ref = grad_cosine(trained, _trained_grads(trainer, rb, idx, adv, shadow_old))  # FP8 model, BF16 ratios
    assert abs(fp8_ref - want) > 1e-4  # the FP8 model's gradient is another number: the test can tell
    assert -1.0 <= cos < 0.9999


def test_grad_cos_of_a_bf16_vanilla_update_is_one(tiny):
    from fp8rl.backends.mini.shadow import reference_grad_cos

    trainer, rb, idx, adv, old, shadow_old, ref_w = _one_minibatch("bf16", "vanilla", tiny)
    _trained_grads(trainer, rb, idx, adv, old)
    cos, _ = reference_grad_cos(trainer, rb, idx, adv, shadow_old, ref_w)
    assert cos == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("arm", ["tensorwise", "rowwise"])
def test_first_minibatch_shadow_ratio_is_the_forward_it_skips(tiny, arm):
    """Before the step's first optimizer step the BF16 current log-probs are the BF16 old ones:
    the shortcut (no forward, ratio 1) equals the forward on the same weights, bit for bit, for
    any subset of rows (the BF16 forward's rows do not depend on each other); after an update
    the forward differs (so the shortcut must not be taken there)."""
    import torch.nn.functional as F

    from fp8rl.backends.mini.shadow import shadow_old_log_probs, shadow_ratio

    cfg = tiny(arm, "calibrated", steps=1, num_mini_batches=2, clip_opts=SAMPLED)
    trainer = MiniTrainer(cfg, None, sft_cache=cfg.mini.cache_dir)
    rb = trainer.rollout(1, 0, torch.Generator().manual_seed(0)).rollout
    n = len(rb.response_ids)
    old = shadow_old_log_probs(trainer, rb, torch.ones(n, dtype=torch.bool))
    for rows in ([0], [1, 3], list(range(0, n, 2))):
        idx = torch.tensor(rows)
        skipped = shadow_ratio(trainer, rb, idx, old[idx], old_weights=True)
        ran = shadow_ratio(trainer, rb, idx, old[idx], old_weights=False)
        assert torch.equal(skipped, ran) and bool((ran == 1).all())
    with torch.no_grad():  # one update's worth of change: the forward now differs
        for p in trainer.policy.parameters():
            p.add_(F.normalize(torch.ones_like(p).flatten(), dim=0).view_as(p) * 1e-2)
    idx = torch.arange(n)
    assert not bool((shadow_ratio(trainer, rb, idx, old, old_weights=False) == 1).all())
