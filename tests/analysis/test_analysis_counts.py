"""Count ratios to BF16 and S (analysis.counts) in the mechanism and half-width tables, against
sums read from the run directories with json.loads (tests/analysis/calib_sweep.py)."""

import math

import numpy as np
import pandas as pd
import pytest
from calib_sweep import ARMS, SEEDS, per_step_mean, runs_by_loop, total, write

from analysis.calibration_match import halfwidth_rows, halfwidth_table
from analysis.clip_tables import mechanism_table
from analysis.collect import collect
from analysis.counts import NOT_LOGGED, ratio_text, run_counts
from analysis.ratio_ci import RatioCI, fieller_ratio
from analysis.summary import findings
from fp8rl.runs.synthetic import RunSpec, make_sweep

BF16 = ("8b", "bf16", "vanilla", None)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    return write(tmp_path_factory.mktemp("counts") / "heldout")


@pytest.fixture(scope="module")
def coll(sweep):
    return collect(sweep, workers=1, progress=False)


@pytest.fixture(scope="module")
def loop(sweep):
    return runs_by_loop(sweep)


def _label(coll, fp8, clip, mode):
    clip_value = clip if mode is None else f"{clip}[clip.calibration_mode={mode}]"
    return clip_value, coll.runs.loc[(coll.runs["fp8"] == fp8) & (coll.runs["clip"] == clip_value), "arm"].iloc[0]


def _expected(loop, key, ref_key, metric, ref_metric=None, how=total):
    x = [how(loop[key][s], metric) for s in SEEDS]
    y = [how(loop[ref_key][s], ref_metric or metric) for s in SEEDS]
    lo, hi = fieller_ratio(x, y, paired=True)
    return sum(x) / sum(y), max(lo, 0.0), hi


def test_count_ratio_is_the_ratio_of_summed_counts_not_of_fractions(coll, loop):
    """Every run has 41 steps, so the ratio of per-step means is the ratio of the sums over the
    run, with the same interval; FP8 arms make 10% more A<0 tokens, so it is ~1.1x the fraction's."""
    d = mechanism_table(coll).data.set_index(["model", "arm"])
    for (fp8, clip, mode) in ARMS:
        if fp8 == "bf16":
            continue
        _, label = _label(coll, fp8, clip, mode)
        r = d.loc[("8b", label)]
        est, lo, hi = _expected(loop, ("8b", fp8, clip, mode), BF16, "actor/n_neg_low")
        assert r["count_x_bf16"] == pytest.approx(est, rel=1e-9)
        assert (r["count_x_bf16_lo"], r["count_x_bf16_hi"]) == pytest.approx((lo, hi), rel=1e-9)
        assert r["count_x_bf16_text"] == f"{est:.2f} [{lo:.2f}, {hi:.2f}]" and r["count_x_bf16_paired"]
        n_est, n_lo, n_hi = _expected(loop, ("8b", fp8, clip, mode), BF16, "actor/n_neg")
        assert r["n_neg_x_bf16"] == pytest.approx(n_est, rel=1e-9) and n_est == pytest.approx(1.1, abs=0.01)
        assert (r["n_neg_x_bf16_lo"], r["n_neg_x_bf16_hi"]) == pytest.approx((n_lo, n_hi), rel=1e-9)
        # the fraction's ratio is a different number: the count's over the A<0 tokens'
        assert r["count_x_bf16"] / r["x_bf16"] == pytest.approx(1.1, abs=0.02)
    assert d.loc[("8b", "BF16"), "count_x_bf16_text"] == "reference"
    md = mechanism_table(coll).markdown
    assert "count below low x BF16 (95% CI)" in md and "A<0 tokens x BF16 (95% CI)" in md


def test_runs_from_before_the_counts_show_not_logged(coll):
    d = mechanism_table(coll).data.set_index(["model", "arm"])
    for arm in ("FP8 tensorwise (vanilla)", "FP8 tensorwise + calibrated"):
        r = d.loc[("14b", arm)]
        assert r["count_x_bf16_text"] == NOT_LOGGED and r["n_neg_x_bf16_text"] == NOT_LOGGED
        assert math.isnan(r["count_x_bf16"]) and math.isfinite(r["x_bf16"])
    assert d.loc[("14b", "BF16"), "count_x_bf16_text"] == NOT_LOGGED  # nothing to be the reference of
    pr = run_counts(coll).set_index("run")
    old = pr[pr["model"] == "14b"]
    assert old["n_neg_low"].isna().all() and (old["n_neg_low_steps"] == 0).all()


def test_counts_when_the_bf16_arm_alone_lacks_them(tmp_path):
    """An FP8 arm with counts against a BF16 arm without: no ratio, not a ratio to something else."""
    specs = [RunSpec(fp8="bf16", clip="vanilla", seed=s, steps=21) for s in range(3)]
    specs += [RunSpec(fp8="tensorwise", clip="vanilla", seed=s, steps=21, n_neg=900.0, shadow_counts=True)
              for s in range(3)]
    make_sweep(tmp_path / "mixed", specs, sweep="mixed")
    c = collect(tmp_path / "mixed", workers=1, progress=False)
    r = mechanism_table(c).data.set_index("arm").loc["FP8 tensorwise (vanilla)"]
    assert r["count_x_bf16_text"] == NOT_LOGGED and math.isnan(r["count_x_bf16"])
    h = halfwidth_rows(c)
    assert h.empty  # no calibrated arm; S of the vanilla arm: BF16 logged neither shadow nor n_neg_low
    pr = run_counts(c)
    assert pr.loc[pr["fp8"] == "bf16", "s_value"].isna().all()


def test_s_is_own_shadow_per_step_over_bf16s(coll, loop):
    df = halfwidth_rows(coll).set_index("mode")
    for mode in ("same_batch", "periodic"):
        r = df.loc[mode]
        est, lo, hi = _expected(loop, ("8b", "tensorwise", "calibrated", mode), BF16, "shadow/low_bf16_n",
                                how=per_step_mean)
        assert r["cal_s"] == pytest.approx(est, rel=1e-9)
        assert (r["cal_s_lo"], r["cal_s_hi"]) == pytest.approx((lo, hi), rel=1e-9)
        planted = ARMS[("tensorwise", "calibrated", mode)][2] / ARMS[("bf16", "vanilla", None)][2]
        assert r["cal_s"] == pytest.approx(planted, rel=0.15)
        est, lo, hi = _expected(loop, ("8b", "tensorwise", "vanilla", None), BF16, "shadow/low_bf16_n",
                                how=per_step_mean)
        assert r["contrast_clip"] == "vanilla" and r["con_s"] == pytest.approx(est, rel=1e-9)
        assert r["con_s_text"] == f"{est:.2f} [{lo:.2f}, {hi:.2f}]"
        est, _, _ = _expected(loop, ("8b", "tensorwise", "calibrated", mode), BF16, "actor/n_neg_low")
        assert r["cal_count"] == pytest.approx(est, rel=1e-9)
        est, _, _ = _expected(loop, ("8b", "tensorwise", "vanilla", None), BF16, "actor/n_neg_low")
        assert r["con_count"] == pytest.approx(est, rel=1e-9)
    t = halfwidth_table(coll)
    assert "S = own shadow / BF16 (95% CI)" in t.markdown
    header = next(line for line in t.markdown.splitlines() if line.startswith("| Granularity"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols.index("S = own shadow / BF16 (95% CI)") == cols.index("calibrated / BF16") + 2  # beside it
    assert "S (own-shadow clipped / BF16 clipped" in t.markdown.splitlines()[0]


def test_s_falls_back_to_the_bf16_runs_clipped_count(tmp_path):
    """A BF16 arm without the shadow diagnostics: its actor/n_neg_low per step is the denominator
    (its own clipped count, what its shadow would count); the FP8 side is always its shadow."""
    specs = [RunSpec(fp8="bf16", clip="vanilla", seed=s, steps=41, n_neg=1000.0, shadow_counts=False)
             for s in range(3)]
    specs += [RunSpec(fp8="tensorwise", clip="calibrated", seed=s, steps=41, n_neg=1000.0, shadow_counts=True,
                      shadow_tokens=3.0) for s in range(3)]
    make_sweep(tmp_path / "fb", specs, sweep="fb")
    c = collect(tmp_path / "fb", workers=1, progress=False)
    loop = runs_by_loop(tmp_path / "fb")
    x = [per_step_mean(loop[("8b", "tensorwise", "calibrated", None)][s], "shadow/low_bf16_n") for s in range(3)]
    y = [per_step_mean(loop[("8b", "bf16", "vanilla", None)][s], "actor/n_neg_low") for s in range(3)]
    r = halfwidth_rows(c).iloc[0]
    assert r["cal_s"] == pytest.approx(np.mean(x) / np.mean(y), rel=1e-9)


def test_summary_quotes_the_count_ratio(coll):
    mech = mechanism_table(coll).data
    lines = findings(coll, paired=None, diagnostics=pd.DataFrame(), mechanism=mech)
    eight = next(line for line in lines if "multiple of" in line and "as a count of tokens" in line)
    fp8 = mech[(mech["model"] == "8b") & (mech["fp8"] != "bf16")]
    assert f"{fp8['count_x_bf16'].max():.1f}x" in eight and f"{fp8['count_x_bf16'].min():.1f}x" in eight
    assert any("as a count of tokens: n/a (runs without `actor/n_neg_low`)" in line for line in lines)


@pytest.mark.parametrize(("ci", "text"), [
    (RatioCI(1.234, 1.0, 1.5, math.nan, math.nan, 3, 3, True), "1.23 [1.00, 1.50]"),
    (RatioCI(1.234, 1.0, 1.5, math.nan, math.nan, 3, 4, False), "1.23 [1.00, 1.50] unpaired"),
    (RatioCI(1.234, -math.inf, math.inf, math.nan, math.nan, 3, 3, True), "1.23 (CI unbounded)"),
    (RatioCI(1.234, math.nan, math.nan, math.nan, math.nan, 1, 1, False, "n/a (1 seed)"), "1.23, n/a (1 seed)"),
    (RatioCI(math.nan, math.nan, math.nan, math.nan, math.nan, 0, 3, False, "n/a (0 seeds)"), NOT_LOGGED),
    (RatioCI(math.nan, math.nan, math.nan, math.nan, math.nan, 3, 0, False, "n/a (0 seeds)"), NOT_LOGGED),
    (None, ""),
])
def test_ratio_text(ci, text):
    assert ratio_text(ci) == text
