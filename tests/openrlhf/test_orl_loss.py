"""Our PolicyLoss subclass vs the real OpenRLHF 0.11.2 ``PolicyLoss`` (loaded by path)."""

import inspect

import pytest
import torch
from orl_helpers import random_batch

from fp8rl.backends.openrlhf.plugin import (
    PluginSpec,
    correction_from_upstream,
    make_policy_loss_class,
)

CASES = [
    dict(is_correction_level="off"),
    dict(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.0, 2.0)),
    dict(is_correction_level="token", is_correction_mode="mask", is_correction_threshold=(0.5, 5.0)),
]


@pytest.mark.parametrize("corr", CASES, ids=["off", "tis", "icepop"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("dp", [None, 2])
def test_subclass_equals_upstream_when_calibration_off(upstream_loss, corr, dual_clip, token_level, dp):
    eps = (0.2, 0.28)
    kw = dict(clip_eps_low=eps[0], clip_eps_high=eps[1], dual_clip=dual_clip, token_level_loss=token_level, **corr)
    theirs = upstream_loss.PolicyLoss(**kw)
    cls = make_policy_loss_class(upstream_loss.PolicyLoss, PluginSpec(eps_low=eps[0], eps_high=eps[1]))
    ours = cls(**kw)
    assert isinstance(ours, upstream_loss.PolicyLoss)
    lp, old, rollout, adv, mask = random_batch(3)
    extra = {} if dp is None else dict(dp_size=dp, batch_num_tokens=mask.sum() * 1.5, global_batch_size=20.0)
    t = theirs(lp, old, adv, mask, rollout_log_probs=rollout, **extra)
    o = ours(lp, old, adv, mask, rollout_log_probs=rollout, **extra)
    assert len(o) == len(t) == 5
    torch.testing.assert_close(o[0], t[0], rtol=1e-6, atol=1e-7)
    (tg,) = torch.autograd.grad(t[0], lp)
    (og,) = torch.autograd.grad(o[0], lp)
    torch.testing.assert_close(og, tg, rtol=1e-6, atol=1e-8)
    for a, b in zip(o[1:], t[1:], strict=True):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-6, atol=1e-7)
    assert float(t[1]) > 0.02  # the batch really clips


def test_signature_matches_upstream(upstream_loss):
    cls = make_policy_loss_class(upstream_loss.PolicyLoss, PluginSpec())
    def spec(f):
        return [(p.name, p.default) for p in inspect.signature(f).parameters.values()]

    assert spec(cls.forward) == spec(upstream_loss.PolicyLoss.forward)


def _counts(batches, low, high):
    """Independent reference: the clip table of the concatenated micro-batches (loops, no fp8rl)."""
    num = dict.fromkeys(("neg", "pos", "neg_low", "neg_high", "pos_low", "pos_high"), 0)
    negs = []
    for lp, old, adv, mask in batches:
        r = torch.exp((lp.detach() - old).clamp(-20, 20))
        for b in range(r.shape[0]):
            for t in range(r.shape[1]):
                if not mask[b, t]:
                    continue
                a, x = float(adv[b, t]), float(r[b, t])
                side = "neg" if a < 0 else "pos" if a > 0 else None
                if side is None:
                    continue
                num[side] += 1
                num[f"{side}_low"] += x < low
                num[f"{side}_high"] += x > high
                if side == "neg":
                    negs.append(x)
    return num, sorted(negs)


def test_step_metrics_are_global_counts_not_means_of_micro_batches(upstream_loss):
    """Issue 13, defect 5: one micro-batch without A<0 tokens must not make the step NaN, and the
    step's fraction is the global count over micro-batches and ranks, not a mean of fractions."""
    from fp8rl.backends.openrlhf.plugin.metrics import StepMetrics

    cls = make_policy_loss_class(upstream_loss.PolicyLoss, PluginSpec(eps_low=0.2, eps_high=0.28))
    batches = []
    for seed, (B, T) in enumerate([(4, 30), (2, 11), (6, 25), (3, 40)]):
        lp, old, _, adv, mask = random_batch(seed, B, T)
        if seed == 1:
            adv = adv.abs() + 0.1  # this micro-batch has no A<0 token at all
        batches.append((lp, old, adv, mask))
    ranks = [batches[:2], batches[2:]]
    metrics = []
    for part in ranks:  # two simulated DP ranks, each with its own loss and accumulator
        loss = cls(clip_eps_low=0.2, clip_eps_high=0.28)
        loss.step_metrics = StepMetrics()
        for lp, old, adv, mask in part:
            loss(lp, old, adv, mask)
        metrics.append(loss.step_metrics)
    # the collectives of two ranks, in process: sum the count vectors, concatenate the ratios
    vecs, negs = [], []
    for m in metrics:
        m.finalize(lambda v: vecs.append(v.clone()) or v, lambda t: negs.append(t.clone()) or [t])
    total = vecs[0] + vecs[1]
    got = metrics[0].finalize(lambda v: total.clone(), lambda t: negs)
    num, neg_ratios = _counts(batches, 0.8, 1.28)
    for side in ("neg", "pos"):
        for b in ("low", "high"):
            assert got[f"actor/clipfrac_{side}_{b}"] == pytest.approx(num[f"{side}_{b}"] / num[side], rel=1e-6)
    assert got["actor/clipfrac_neg_low"] > 0 and all(v == v for v in got.values())  # no NaN
    import numpy as np

    assert got["actor/ratio_neg_q01"] == pytest.approx(float(np.quantile(neg_ratios, 0.01)), rel=1e-6)
    # actor/ratio_std (issue 48's dose): over every response token of both ranks, as the mini backend's
    dev = np.concatenate([(torch.exp(lp.detach() - old)[mask.bool()] - 1).double().numpy() for lp, old, _, mask in batches])
    assert got["actor/ratio_std"] == pytest.approx(float(np.std(dev)), rel=1e-6)
    # the mean of per-micro-batch fractions (what upstream's merge of info would log) differs
    per_mb = []
    for b in batches:
        n, _ = _counts([b], 0.8, 1.28)
        per_mb.append(n["neg_low"] / n["neg"] if n["neg"] else float("nan"))
    assert per_mb[1] != per_mb[1]  # NaN in the micro-batch without A<0 tokens


def test_mismatch_kl_is_a_token_weighted_sum(upstream_loss):
    from fp8rl.backends.openrlhf.plugin.metrics import StepMetrics
    from fp8rl.rl.correction import is_weights

    cls = make_policy_loss_class(upstream_loss.PolicyLoss, PluginSpec())
    loss = cls(clip_eps_low=0.2, clip_eps_high=0.2, is_correction_level="token", is_correction_mode="clip",
               is_correction_threshold=(0.0, 2.0))
    loss.step_metrics = StepMetrics()
    parts = [random_batch(s, 3, 20 + 7 * s) for s in range(3)]
    for lp, old, rollout, adv, mask in parts:
        loss(lp, old, adv, mask, rollout_log_probs=rollout)
    got = loss.step_metrics.finalize()
    k3 = [(o.double() - r.double()).clamp(-20, 20) for _, o, r, _, _ in parts]
    num = sum(float(((torch.expm1(c) - c) * m.double()).sum()) for c, (*_, m) in zip(k3, parts, strict=True))
    den = sum(float(m.sum()) for *_, m in parts)
    assert got["rollout/mismatch_kl"] == pytest.approx(num / den, rel=1e-5)
    _, one = is_weights(parts[0][1], parts[0][2], parts[0][4], "tis", cap=2.0)
    assert float(one["rollout/mismatch_kl"]) != pytest.approx(got["rollout/mismatch_kl"])


def test_calibrated_bounds_move_the_loss(upstream_loss):
    """The loss clips with its window's bounds: the ones in force until the window calibrates, the
    window's own after; while the window's sink is open a measured micro-batch hands its FP8 ratio
    and BF16 shadow to it, and its shadowed rows are counted against the bounds it used. Outside a
    window the controller's bounds rule; plan rows without a window are a binding bug."""
    from fp8rl.backends.openrlhf.plugin.calibration import Pending, StepTokens

    spec = PluginSpec(clip_method="calibrated", clip_options={"mode": "sampled", "init_bounds": [0.8, 1.2],
                                                              "sample_fraction": 1.0},
                      eps_low=0.2, eps_high=0.2)
    cls = make_policy_loss_class(upstream_loss.PolicyLoss, spec)
    loss = cls(clip_eps_low=0.2, clip_eps_high=0.2)
    lp, old, _, adv, mask = random_batch(1)
    rows = torch.arange(lp.shape[0])
    ratio = torch.exp((lp.detach() - old).clamp(-20, 20))
    plain = loss(lp, old, adv, mask)[0].detach()  # no window: the controller's bounds (0.8, 1.2)
    plan = loss.clipper.begin_step(0, eligible=torch.ones_like(rows, dtype=torch.bool))
    w = plan.window(rows)
    assert bool(w.measured.all()) and bool(w.first.all())
    loss.window, loss.sink = w, StepTokens(shadow=True)
    loss.pending = Pending(rows, w.measured, w.shadowed, ratio ** 0.25)  # a shadow that strays far less
    first = loss(lp, old, adv, mask)[0].detach()
    assert float(first) == pytest.approx(float(plain))  # the bounds in force before the calibration
    assert loss.sink.micro_batches == 1 and loss.pending is None
    torch.testing.assert_close(loss.sink.local()["ratio"], ratio[mask.bool() & (adv != 0)])
    got = loss.sink.local()
    after = w.calibrate(got["ratio"], got["shadow"], got["adv"], torch.ones_like(got["ratio"], dtype=torch.bool),
                        seq=got["seq"])
    loss.sink = None
    assert after.low < 0.8  # FP8 ratios are noisier: the lower bound widens
    assert float(loss(lp, old, adv, mask)[0].detach()) != pytest.approx(float(first))  # the window's own now
    metrics = plan.finish()
    assert metrics["shadow/oos_n_neg"] == float((mask.bool() & (adv < 0)).sum())  # counted with the bounds used
    loss.window = None
    loss.pending = Pending(rows, w.measured, w.shadowed, None)
    with pytest.raises(RuntimeError, match="no window"):
        loss(lp, old, adv, mask)


def test_correction_mapping_and_bad_input():
    assert correction_from_upstream("off", "mask", "ratio", (0.5, 5.0)) == ("none", {})
    assert correction_from_upstream("token", "clip", "ratio", (0.0, 2.0)) == ("tis", {"cap": 2.0})
    assert correction_from_upstream("token", "mask", "ratio", (0.5, 5.0)) == ("icepop", {"low": 0.5, "high": 5.0})
    with pytest.raises(ValueError, match="clamps the IS weight from below"):
        correction_from_upstream("token", "clip", "ratio", (0.5, 2.0))
    with pytest.raises(ValueError, match="no fp8rl equivalent"):
        correction_from_upstream("seq", "mask", "ratio", (0.5, 5.0))


def test_eps_mismatch_with_spec_raises(upstream_loss):
    cls = make_policy_loss_class(upstream_loss.PolicyLoss, PluginSpec(eps_low=0.2, eps_high=0.28))
    with pytest.raises(ValueError, match="disagrees with the plugin spec"):
        cls(clip_eps_low=0.2, clip_eps_high=0.2)


def test_a_correction_without_rollout_log_probs_raises(upstream_loss):
    """Engines asked for no log-probs send ``rollout_log_probs=None``: upstream's loss fails on the
    ``None``; ours must not fall back to no correction in silence."""
    lp, old, _, adv, mask = random_batch(5, 3, 9)
    tis = dict(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.0, 2.0))
    theirs = upstream_loss.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2, **tis)
    with pytest.raises(TypeError):
        theirs(lp, old, adv, mask, rollout_log_probs=None)
    ours = make_policy_loss_class(upstream_loss.PolicyLoss, PluginSpec())(clip_eps_low=0.2, clip_eps_high=0.2, **tis)
    with pytest.raises(ValueError, match="got no rollout log-probs"):
        ours(lp, old, adv, mask, rollout_log_probs=None)
    off = make_policy_loss_class(upstream_loss.PolicyLoss, PluginSpec())(clip_eps_low=0.2, clip_eps_high=0.2)
    off(lp, old, adv, mask, rollout_log_probs=None)  # no correction: none needed


def test_the_dump_holds_the_rollout_log_probs_and_the_weights_applied(upstream_loss, tmp_path):
    """``dump_dir``: each forward writes what the loss received and the IS weights it applied;
    the weights equal min(exp(old - rollout), C) (a formula here) and the per-token loss is the
    PPO loss times them."""
    tis = dict(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.0, 2.0))
    lp, old, rollout, adv, mask = random_batch(6, 4, 11)
    dumped = []
    for name, kw in (("tis", tis), ("off", {})):
        cls = make_policy_loss_class(upstream_loss.PolicyLoss, PluginSpec(dump_dir=str(tmp_path / name)))
        cls(clip_eps_low=0.2, clip_eps_high=0.2, **kw)(lp, old, adv, mask, rollout_log_probs=rollout)
        (path,) = (tmp_path / name).glob("rank0-*.pt")
        dumped.append(torch.load(path, weights_only=False))
    with_tis, without = dumped
    m = mask.bool()
    assert with_tis["correction"] == "tis" and with_tis["correction_params"] == {"cap": 2.0}
    torch.testing.assert_close(with_tis["rollout_log_probs"], rollout)
    torch.testing.assert_close(with_tis["old_log_probs"], old)
    want_w = torch.where(m, torch.exp(old - rollout).clamp(max=2.0), torch.zeros(()))
    torch.testing.assert_close(with_tis["is_weights"], want_w)
    assert ((want_w != 1) & m).any() and (want_w == 2.0).any()  # the batch is corrected and truncated
    r = torch.exp(lp.detach() - old)
    ppo = torch.where(m, torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2)), torch.zeros(()))
    torch.testing.assert_close(with_tis["token_loss"], ppo * want_w)
    assert without["correction"] == "none" and without["is_weights"] is None
    torch.testing.assert_close(without["token_loss"], ppo)


def test_the_step_metrics_reduce_is_keyed_not_positional():
    """Each rank's sums arrive under their own key whatever the order of the packed vector: a
    reduce that reverses the vector (a stand-in for another packing order) and reverses it back
    gives the same metrics; an unknown key is refused rather than dropped."""
    import pytest
    import torch

    from fp8rl.backends.openrlhf.plugin.metrics import SUMMED_KEYS, all_reduce_keyed

    vals = {k: torch.tensor(float(i + 1), dtype=torch.float64) for i, k in enumerate(SUMMED_KEYS)}
    twice = all_reduce_keyed(vals, lambda v: v * 2)
    assert {k: float(v) for k, v in twice.items()} == {k: 2.0 * (i + 1) for i, k in enumerate(SUMMED_KEYS)}
    rev = all_reduce_keyed(vals, None, keys=tuple(reversed(SUMMED_KEYS)))
    assert {k: float(v) for k, v in rev.items()} == {k: float(v) for k, v in vals.items()}
    assert float(all_reduce_keyed({}, None)["neg"]) == 0.0  # a rank without micro-batches
    with pytest.raises(KeyError, match="not in the reduced keys"):
        all_reduce_keyed({"neg_lowx": torch.tensor(1.0)}, None)
