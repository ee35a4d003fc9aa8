import numpy as np
import pytest

from analysis.surge import SurgeRule, ema, surge_onset, surge_table
from fp8rl.runs.synthetic import RunSpec, entropy_curve


def reference_onset(steps, entropy, rule):
    """Slow explicit loop of the documented rule."""
    s, started, kept = None, False, []
    alpha = 2 / (rule.span + 1)
    for st, e in zip(steps, entropy, strict=True):
        if not np.isfinite(e):
            continue
        s = e if not started else alpha * e + (1 - alpha) * s
        started = True
        if st >= rule.warmup:
            kept.append((st, s))
    run_min, streak, start = np.inf, 0, None
    for st, v in kept:
        run_min = min(run_min, v)
        if v > rule.k * run_min and v - run_min > rule.min_rise:
            if streak == 0:
                start = st
            streak += 1
            if streak >= rule.m:
                return start
        else:
            streak = 0
    return None


def _curve(spec):
    steps = np.arange(spec.steps)
    return steps, entropy_curve(spec, steps.astype(float), np.random.default_rng(0))


@pytest.mark.parametrize("surge_at", [25, 60, 140])
def test_planted_surge_found_at_its_step(surge_at):
    steps, e = _curve(RunSpec(steps=200, surge_at=surge_at))
    assert surge_onset(steps, e) == surge_at


def test_flat_and_decaying_runs_have_no_surge():
    steps, e = _curve(RunSpec(steps=300, noise=0.02))
    assert surge_onset(steps, e) is None
    assert surge_onset(np.arange(100), np.full(100, 0.5)) is None
    assert surge_onset([], []) is None


def test_surge_too_short_or_too_small_is_ignored():
    e = np.full(200, 0.4)
    e[100:105] = 1.2  # 5 steps < m
    assert surge_onset(np.arange(200), e) is None
    tiny = np.full(200, 0.01)
    tiny[100:] = 0.03  # 3x, but 0.02 nats above the minimum < min_rise
    assert surge_onset(np.arange(200), tiny) is None
    assert surge_onset(np.arange(200), tiny, SurgeRule(min_rise=0.0)) == 100


def test_warmup_and_nan():
    e = np.full(100, 0.4)
    e[:10] = 2.0  # high early entropy is not a surge
    assert surge_onset(np.arange(100), e) is None
    e = np.full(100, 0.4)
    e[50:] = 1.2
    e[55] = np.nan  # skipped: does not break the streak
    assert surge_onset(np.arange(100), e) == 50


def test_matches_reference_loop_on_random_series():
    rng = np.random.default_rng(1)
    found = 0
    for i in range(200):
        n = int(rng.integers(20, 150))
        e = np.exp(rng.normal(-1, 0.3, n)).cumsum() / np.arange(1, n + 1) + rng.random() * (
            np.arange(n) > rng.integers(0, n)
        )
        e[rng.random(n) < 0.05] = np.nan
        rule = SurgeRule(k=float(rng.uniform(1.1, 2.5)), m=int(rng.integers(1, 12)),
                         warmup=int(rng.integers(0, 30)), span=float(rng.uniform(1, 8)),
                         min_rise=float(rng.uniform(0, 0.2)))
        steps = np.arange(n) * 2
        want = reference_onset(steps, e, rule)
        assert surge_onset(steps, e, rule) == want, (i, rule)
        found += want is not None
    assert 20 < found < 180  # the random cases exercise both outcomes


def test_rule_validation_and_ema():
    for bad in [dict(k=1.0), dict(m=0), dict(warmup=-1), dict(span=0.5), dict(min_rise=-1)]:
        with pytest.raises(ValueError):
            SurgeRule(**bad)
    with pytest.raises(ValueError):
        surge_onset([1, 2], [1.0])
    x = np.array([np.nan, 1.0, np.nan, 3.0])
    np.testing.assert_allclose(ema(x, 3.0), [np.nan, 1.0, 1.0, 2.0])
    assert "1.5x" in SurgeRule().describe()


def test_surge_table(known_coll):
    from analysis_known import SURGES

    t = surge_table(known_coll.steps).merge(known_coll.runs[["run", "fp8", "clip", "seed"]], on="run")
    t = t.dropna(subset=["surge_step"])
    got = {(r.fp8, r.clip, int(r.seed)): int(r.surge_step) for r in t.itertuples()}
    assert got == SURGES


def test_rule_for_short_runs_scales_warmup_and_streak():
    # The mini default is 20 steps: the default warm-up (20) would leave nothing to test.
    e = np.full(21, 0.025)
    e[:3] = 0.04  # the early decrease from the warm start
    e[9:] = 0.10  # a 4x surge from step 9 on
    steps = np.arange(21)
    assert surge_onset(steps, e, SurgeRule()) is None  # warm-up 20: blind on this run
    short = SurgeRule.for_length(20)
    assert (short.warmup, short.m) == (5, 5)
    # the EMA (span 5) needs 3 steps to climb 0.05 nats above the floor: onset 11, not 9
    assert surge_onset(steps, e, short) == 11
    assert surge_onset(steps, e, short) == reference_onset(steps, e, short)
    flat = np.full(21, 0.025)
    flat[:3] = 0.04
    assert surge_onset(steps, flat, short) is None
    # long runs keep the defaults; explicit values win; None means "scaled"
    assert SurgeRule.for_length(80) == SurgeRule() == SurgeRule.for_length(500)
    assert SurgeRule.for_length(40) == SurgeRule(warmup=10, m=10)
    assert SurgeRule.for_length(20, m=3, warmup=None, k=2.0) == SurgeRule(warmup=5, m=3, k=2.0)
    assert SurgeRule.for_length(3).m == 2
    for bad in (0, -5, 2.5, "20"):
        with pytest.raises(ValueError, match="n_steps"):
            SurgeRule.for_length(bad)
