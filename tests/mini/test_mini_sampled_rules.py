"""Which bounds rule which rows' loss under ``sampled`` calibration (out of sample).

``sampled`` (``fp8rl.rl.calibration.schedule``): every window measures a seeded subset of its
sequences; the subset's own loss runs first under the bounds in force (the last window's), and the
estimate from the subset rules the *rest* of the window. So no row is ruled by an estimate it fed.

The tests record every PPO token loss the trainer computes (``fp8rl.rl.policy_loss.ppo_token_loss``,
the public function the update calls) with the bounds it was given, and check row by row that the
measured rows used the window's ``before`` and the other rows its new estimate (``after``); and that
the clip counts the window reports are those of that rule, recomputed here. Nothing depends on the
CPU's numbers: one variant constructs the advantages and the window estimates (so every step has a
window that splits and whose estimate differs from the bounds in force), the other checks a real
run wherever its windows split.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fp8rl.backends.mini.trainer import MiniTrainer
from fp8rl.rl.calibration.bounds import Bounds

SAMPLED = {"calibration_mode": "sampled", "sample_fraction": 0.25}


def _key(old_row: torch.Tensor, adv_row: torch.Tensor, bounds: tuple[float, float]) -> tuple:
    """A row as the loss saw it (its old log-probs and advantages, bit for bit) with its bounds."""
    return (old_row.detach().cpu().numpy().tobytes(), adv_row.detach().cpu().numpy().tobytes(),
            float(bounds[0]), float(bounds[1]))


def _instrument(trainer, monkeypatch):
    """Record the step plans, each window's inputs and result, and every loss call of a window."""
    import fp8rl.rl.policy_loss as pl

    plans, windows = [], []
    current: dict = {}
    real_begin, real_mb, real_loss = trainer.clipper.begin_step, trainer.minibatch_update, pl.ppo_token_loss

    def begin(step, **kw):
        plans.append(real_begin(step, **kw))
        return plans[-1]

    def mb(rb, idx, old, adv, weights, win, *a, **kw):
        current["calls"] = []
        res = real_mb(rb, idx, old, adv, weights, win, *a, **kw)
        windows.append({"idx": idx.clone(), "old": old.clone(), "adv": adv.clone(), "win": win, "res": res,
                        "calls": current.pop("calls")})
        return res

    def loss(log_prob, old_log_prob, advantages, mask, *, low, high, **kw):
        if "calls" in current:
            current["calls"].append((old_log_prob.detach().clone(), advantages.detach().clone(), (low, high)))
        return real_loss(log_prob, old_log_prob, advantages, mask, low=low, high=high, **kw)

    monkeypatch.setattr(trainer.clipper, "begin_step", begin)
    monkeypatch.setattr(trainer, "minibatch_update", mb)
    monkeypatch.setattr(pl, "ppo_token_loss", loss)
    return plans, windows


def _expected_bounds(w) -> list[tuple[float, float]]:
    """The design's rule, per row of the window: a measured row ran first under the bounds in force
    (``before``); every other row is ruled by the window's estimate (``after``)."""
    win = w["win"]
    return [win.before.as_tuple() if bool(m) else win.after.as_tuple() for m in win.measured.tolist()]


def _bounds_per_call(w) -> list[tuple[int, tuple[float, float]]]:
    """(rows, bounds) of each loss call of a window, for the failure message."""
    return [(o.shape[0], b) for o, _, b in w["calls"]]


def _check_window(w) -> bool:
    """Assert the window's losses and clip counts follow the rule; True if the window split (some
    rows measured, some not, and an estimate other than the bounds in force)."""
    from fp8rl.rl.diagnostics import clip_counts

    win, res = w["win"], w["res"]
    want = _expected_bounds(w)
    assert win.after is not None  # the window calibrated before its loss
    assert res["bounds"] == pytest.approx(win.after.as_tuple())
    expected = Counter(_key(w["old"][i], w["adv"][i], b) for i, b in enumerate(want))
    seen = Counter(_key(o[i], a[i], b) for o, a, b in w["calls"] for i in range(o.shape[0]))
    assert seen == expected, (  # every row's loss once, with the bounds the rule gives it
        f"measured rows {win.measured.tolist()}: want before={win.before.as_tuple()} on measured rows and "
        f"after={win.after.as_tuple()} on the rest; the losses used {_bounds_per_call(w)}")
    m = res["mask"].bool()
    for key, got in res["counts"].items():  # the logged clip table counts each row under its bounds
        total = sum(int(clip_counts(res["ratio"][i:i + 1], res["adv"][i:i + 1], m[i:i + 1], low=lo, high=hi)[key])
                    for i, (lo, hi) in enumerate(want))
        assert int(got) == total, key
    meas = win.measured
    return bool(meas.any()) and not bool(meas.all()) and win.before != win.after


def _check_chain(plans, windows, per_step: int) -> None:
    """The bounds in force before a window: the last window's estimate (the step's start bounds
    for its first window)."""
    assert len(windows) == per_step * len(plans)
    for s, plan in enumerate(plans):
        prev = plan.before
        for w in windows[per_step * s: per_step * (s + 1)]:
            assert w["win"].before == prev
            assert torch.equal(w["win"].measured.cpu(), plan.measured[w["idx"]].cpu())
            prev = w["win"].after


def test_sampled_estimate_rules_the_rows_it_was_not_measured_on(tiny, monkeypatch):
    """Constructed: every row has A != 0 (alternating signs), so a 1/4 subset of 16 rows over two
    windows of 8 always leaves a window with measured and unmeasured rows; each window's estimate is
    replaced by a distinct pair of bounds (the controller still runs), so it differs from the bounds
    in force and the two groups of rows can be told apart."""
    from fp8rl.rl.advantages import broadcast_to_tokens

    cfg = tiny("tensorwise", "calibrated", steps=3, num_mini_batches=2, clip_opts=SAMPLED)
    trainer = MiniTrainer(cfg, None, sft_cache=cfg.mini.cache_dir)

    def advantages(batch):
        n = len(batch)
        adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(n)])
        return broadcast_to_tokens(adv.to(trainer.device), batch.rollout.response_mask)

    made: list[Bounds] = []
    real_cal = trainer.clipper.calibrate_window

    def calibrate_window(step, tokens, **kw):
        real_cal(step, tokens, **kw)
        made.append(Bounds(0.55 - 0.01 * len(made), 1.45 + 0.01 * len(made)))
        return made[-1]

    monkeypatch.setattr(trainer, "advantages", advantages)
    monkeypatch.setattr(trainer.clipper, "calibrate_window", calibrate_window)
    plans, windows = _instrument(trainer, monkeypatch)
    for s in (1, 2, 3):
        trainer.train_step(s)
    _check_chain(plans, windows, 2)
    assert [w["win"].after for w in windows] == made  # each window's estimate is the one it made
    for s, plan in enumerate(plans):
        m = int(plan.eligible.sum())  # 16 unless a response is empty
        assert m > 0 and int(plan.measured.sum()) == max(1, int(0.25 * m + 0.5)) <= 4
        split = [_check_window(w) for w in windows[2 * s: 2 * s + 2]]
        assert any(split)  # at most 4 measured rows in two windows of 8: one splits


def test_sampled_real_run_rules_each_row_out_of_sample(tiny, monkeypatch):
    """The same rule on an unmodified run (its numbers depend on the CPU; every window is checked,
    whether or not it splits)."""
    cfg = tiny("tensorwise", "calibrated", steps=3, num_mini_batches=2, clip_opts=SAMPLED)
    trainer = MiniTrainer(cfg, None, sft_cache=cfg.mini.cache_dir)
    plans, windows = _instrument(trainer, monkeypatch)
    for s in (1, 2, 3):
        trainer.train_step(s)
    _check_chain(plans, windows, 2)
    for w in windows:
        _check_window(w)
