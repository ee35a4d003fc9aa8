"""The held-out judgement (analysis.heldout_judgement, analysis.heldout_report) against references
computed here: the unseen tokens' ratio of sums over seeds and Fieller's paired interval by its
closed form, per-seed ratios, all read with json.loads (tests/analysis/holdout_sweep.py), the
printed t table, the closed-form t distribution with 3 degrees of freedom, Holm by hand; the
default-mode rule on constructed tables; and sweeps without held-out rows."""

import math

import numpy as np
import pandas as pd
import pytest
from holdout_sweep import ARMS, GRANULARITIES, MODES, SEEDS, runs_by_loop, write

from analysis.collect import collect
from analysis.heldout_judgement import (
    COMPARATORS,
    arm_rows,
    comparison_rows,
    default_mode_rule,
    has_holdout,
    holm,
    rule_rows,
)
from analysis.heldout_report import (
    X_MAX,
    heldout_sections,
    no_data_line,
    plot_heldout_ratio,
    ratio_table,
)
from analysis.ratio_ci import t_two_sided_p
from fp8rl.runs.synthetic import RunSpec, make_sweep

T975_3 = 3.1824  # Student t 0.975 quantile, 3 degrees of freedom (4 seeds; printed table: bounds to 1e-4)
HO_FP8, HO_BF16, HO_COS, ALPHA_N = ("shadow/ho_fp8_low_n", "shadow/ho_bf16_low_n", "shadow/ho_grad_cos",
                                    "clip/alpha_n")
UN_FP8, UN_BF16 = "shadow/oos_fp8_low_n", "shadow/oos_bf16_low_n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    return write(tmp_path_factory.mktemp("holdout") / "holdout")


@pytest.fixture(scope="module")
def coll(sweep):
    return collect(sweep, workers=1, progress=False)


@pytest.fixture(scope="module")
def loop(sweep):
    return runs_by_loop(sweep)


def _clip(clip, mode):
    return f"calibrated[clip.calibration_mode={mode}]" if mode else clip


def _sum(rows, key):
    return sum(r[key] for r in rows if key in r)


def _ratio(rows, fp8=UN_FP8, bf16=UN_BF16):
    """Ratio of sums over the run's steps (the unseen tokens unless told)."""
    return _sum(rows, fp8) / _sum(rows, bf16)


def _fieller(x, y):
    """Fieller's paired 95% interval for sum(x) / sum(y) by its closed form: the R with
    (mx - R my)^2 <= t^2 (sxx - 2 R sxy + R^2 syy) / n (4 seeds: t on 3 df)."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x) / (n - 1)
    syy = sum((b - my) ** 2 for b in y) / (n - 1)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / (n - 1)
    t2 = T975_3 ** 2 / n
    a, b, c = my * my - t2 * syy, mx * my - t2 * sxy, mx * mx - t2 * sxx
    r = math.sqrt(b * b - a * c)
    return max((b - r) / a, 0.0), (b + r) / a


def _mean(rows, key):
    v = [r[key] for r in rows if r.get(key) is not None]
    return sum(v) / len(v)


def _t_interval(values):
    n = len(values)
    m = sum(values) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    h = T975_3 * sd / math.sqrt(n)
    return m, m - h, m + h


def _p_df3(t):
    """Two-sided p of Student t with 3 df, closed form: 1 - (2/pi)(u / (1 + u^2) + atan u), u = |t|/sqrt 3."""
    u = abs(t) / math.sqrt(3)
    return 1 - (2 / math.pi) * (u / (1 + u * u) + math.atan(u))


def _holm_by_hand(ps):
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adj, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adj[i] = running
    return adj


def test_t_two_sided_p_matches_the_closed_form_and_the_printed_table():
    for t in (0.3, 1.1, 2.5, 5.0, 40.0):
        assert t_two_sided_p(t, 3) == pytest.approx(_p_df3(t), rel=1e-9, abs=1e-15)
    assert t_two_sided_p(-2.5, 3) == t_two_sided_p(2.5, 3)
    assert t_two_sided_p(3.1824, 3) == pytest.approx(0.05, abs=1e-4)
    assert t_two_sided_p(2.201, 11) == pytest.approx(0.05, abs=1e-4)
    assert t_two_sided_p(0.0, 5) == 1.0 and t_two_sided_p(math.inf, 5) == 0.0


def test_holm_by_hand():
    p = [0.01, 0.04, 0.03, 0.005, math.nan]
    adj = holm(p)
    # sorted 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 -> max(0.06, 0.04)
    assert adj[:4] == pytest.approx([0.03, 0.06, 0.06, 0.02], rel=1e-12)
    assert math.isnan(adj[4])
    assert holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])


def test_heldout_ratio_is_the_unseen_tokens_ratio_of_sums_with_fieller(coll, loop):
    df = arm_rows(coll)
    assert has_holdout(coll)
    assert len(df) == 1 + len(GRANULARITIES) * len(ARMS)
    for fp8 in ("bf16", *GRANULARITIES):
        for clip, mode in ([("vanilla", None)] if fp8 == "bf16" else ARMS):
            runs = loop[(fp8, clip, mode)]
            r = df[(df["fp8"] == fp8) & (df["clip"] == _clip(clip, mode))]
            assert len(r) == 1, (fp8, clip, mode)
            r = r.iloc[0]
            x = [_sum(runs[s], UN_FP8) for s in SEEDS]
            y = [_sum(runs[s], UN_BF16) for s in SEEDS]
            assert r["ratio_n"] == 4 and r["runs"] == 4
            assert (r["un_fp8"], r["un_bf16"]) == (sum(x), sum(y))
            assert r["ratio_mean"] == pytest.approx(sum(x) / sum(y), rel=1e-12)
            if clip != "no_lower_clip":  # x = 0 there: Fieller's lower end is 0
                assert (r["ratio_lo"], r["ratio_hi"]) == pytest.approx(_fieller(x, y), rel=1e-4, abs=1e-12)
            last = {s: max(row["step"] for row in runs[s]) for s in SEEDS}
            late = {s: [row for row in runs[s] if row["step"] > 0.25 * last[s]] for s in SEEDS}
            lx, ly = [_sum(late[s], UN_FP8) for s in SEEDS], [_sum(late[s], UN_BF16) for s in SEEDS]
            assert 0 < sum(ly) < sum(y) and r["late_bf16"] == sum(ly)
            assert r["late_mean"] == pytest.approx(sum(lx) / sum(ly), rel=1e-12)
            if clip != "no_lower_clip":
                assert (r["late_lo"], r["late_hi"]) == pytest.approx(_fieller(lx, ly), rel=1e-4, abs=1e-12)
            hx, hy = sum(_sum(runs[s], HO_FP8) for s in SEEDS), sum(_sum(runs[s], HO_BF16) for s in SEEDS)
            assert r["ho_ratio"] == pytest.approx(hx / hy, rel=1e-12)
            if mode == "same_batch":  # its unseen tokens are its held-out rows
                assert (sum(x), sum(y)) == (hx, hy)
            cm, clo, chi = _t_interval([_mean(runs[s], HO_COS) for s in SEEDS])
            assert (r["cos_mean"], r["cos_lo"], r["cos_hi"]) == pytest.approx((cm, clo, chi), rel=1e-6)
            if mode:
                alpha = sum(_mean(runs[s], ALPHA_N) for s in SEEDS) / len(SEEDS)
                assert r["alpha_n"] == pytest.approx(alpha, rel=1e-12) and r["mode"] == mode
            else:
                assert math.isnan(r["alpha_n"])
            planted, ho_planted = (1.0, 1.0) if fp8 == "bf16" else (ARMS[(clip, mode)][0], ARMS[(clip, mode)][4])
            if clip != "no_lower_clip":  # the planted ratios, up to binomial noise
                assert r["ratio_mean"] == pytest.approx(planted, rel=0.15)
                assert r["ho_ratio"] == pytest.approx(ho_planted, rel=0.15)
    text = ratio_table(df).markdown
    assert "| - |" in text and "0.61" in text  # alpha n of sampled; "-" for an arm that does not calibrate


def test_paired_comparisons_with_holm_per_family(coll, loop):
    comp = comparison_rows(coll)
    assert len(comp) == len(MODES) * len(COMPARATORS) * len(GRANULARITIES) * 2
    for mode in MODES:
        for other in COMPARATORS:
            fam = comp[(comp["mode"] == mode) & (comp["comparator"] == other)].reset_index(drop=True)
            assert len(fam) == len(GRANULARITIES) * 2
            ps = []
            for _, r in fam.iterrows():
                a, b = loop[(r["fp8"], "calibrated", mode)], loop[(r["fp8"], other, None)]
                if r["measure"] == "ratio_dist":
                    d = [abs(_ratio(a[s]) - 1) - abs(_ratio(b[s]) - 1) for s in SEEDS]
                else:
                    d = [_mean(a[s], HO_COS) - _mean(b[s], HO_COS) for s in SEEDS]
                m, lo, hi = _t_interval(d)
                sd = math.sqrt(sum((x - m) ** 2 for x in d) / 3)
                t = m / (sd / 2)
                assert r["diff_mean"] == pytest.approx(m, rel=1e-9)
                assert (r["diff_lo"], r["diff_hi"]) == pytest.approx((lo, hi), rel=1e-4)
                assert r["t"] == pytest.approx(t, rel=1e-9) and r["pairs"] == 4
                assert r["p"] == pytest.approx(_p_df3(t), rel=1e-6)
                ps.append(_p_df3(t))
            ref = _holm_by_hand(ps)
            assert fam["p_holm"].tolist() == pytest.approx(ref, rel=1e-6)
            assert fam["survives"].tolist() == [q < 0.05 for q in ref]
            assert (fam["p_holm"] > fam["p"]).any()  # the correction acts
    # a planted difference is favoured the right way: lower distance, higher grad_cos
    r = comp[(comp["mode"] == "same_batch") & (comp["comparator"] == "tis")]
    assert set(r["favours"]) == {"calibrated"}


def test_the_rule_on_the_sweep_picks_the_cheapest_that_qualifies(coll):
    rules = rule_rows(coll)
    assert set(rules["best_control"]) == {"no_lower_clip"}  # 0.96 > wide_lower's 0.955
    v = default_mode_rule(rules)
    assert v.order == ("sampled", "windowed", "same_batch")  # by shadow seconds per step
    assert v.qualified == ("sampled", "same_batch") and v.mode == "sampled"
    assert "not within [0.8, 1.25]" in v.reasons["windowed"][0]
    assert "the default mode is `sampled`" in v.text


def _rules(rows):
    cols = ["mode", "granularity", "cost", "ratio_lo", "ratio_hi", "best_control", "cos_diff_lo", "cos_diff_hi"]
    return pd.DataFrame(rows, columns=cols)


def test_the_rule_on_constructed_tables():
    ok_ratio, ok_cos, bad_cos = (0.9, 1.1), (-0.001, 0.002), (-0.004, -0.001)
    # the cheapest matches BF16's ratio but its grad_cos is below the best control's: the next one wins
    t = _rules([("sampled", "tw", 0.1, *ok_ratio, "wide_lower", *bad_cos),
                ("sampled", "bw", 0.1, *ok_ratio, "wide_lower", *ok_cos),
                ("windowed", "tw", 0.5, *ok_ratio, "no_lower_clip", *ok_cos),
                ("windowed", "bw", 0.5, *ok_ratio, "no_lower_clip", *ok_cos),
                ("same_batch", "tw", 1.0, *ok_ratio, "wide_lower", *ok_cos),
                ("same_batch", "bw", 1.0, 0.85, 1.3, "wide_lower", *ok_cos)])
    v = default_mode_rule(t)
    assert v.order == ("sampled", "windowed", "same_batch")
    assert v.qualified == ("windowed",) and v.mode == "windowed"
    assert "grad_cos below wide_lower's" in v.reasons["sampled"][0]
    assert "[0.85, 1.30] not within" in v.reasons["same_batch"][0]
    # none qualifies: said, and the cheapest is kept
    t2 = t.copy()
    t2.loc[t2["mode"] == "windowed", "ratio_hi"] = 1.4
    v2 = default_mode_rule(t2)
    assert v2.qualified == () and v2.mode == "sampled"
    assert "No calibrated mode qualifies" in v2.text and "keep the cheapest, `sampled`" in v2.text
    # no interval (one seed) or no control with data: not qualified; unmeasured cost: the nominal order
    t3 = _rules([("same_batch", "tw", math.nan, *ok_ratio, "wide_lower", *ok_cos),
                 ("sampled", "tw", math.nan, math.nan, math.nan, "wide_lower", *ok_cos),
                 ("windowed", "tw", math.nan, *ok_ratio, "", math.nan, math.nan)])
    v3 = default_mode_rule(t3)
    assert v3.order == ("sampled", "windowed", "same_batch") and v3.mode == "same_batch"
    assert "no control" in v3.reasons["windowed"][0] and "no held-out ratio interval" in v3.reasons["sampled"][0]
    assert default_mode_rule(t.iloc[:0]).mode == ""


def test_sections_tables_and_figure(coll, tmp_path):
    secs = heldout_sections(coll, tmp_path / "tables", tmp_path / "figures")
    assert [s[0] for s in secs] == ["Held-out judgement: the deployed bounds on rows no calibration saw"]
    text = "\n".join(secs[0][1])
    assert "figures/heldout_ratio.png" in text and "the default mode is `sampled`" in text
    for name in ("heldout_ratio", "heldout_paired", "heldout_rule"):
        assert all((tmp_path / "tables" / f"{name}.{ext}").is_file() for ext in ("md", "tex", "csv"))
    assert (tmp_path / "figures" / "heldout_ratio.png").is_file()
    fig = pd.read_csv(tmp_path / "figures" / "heldout_ratio.csv")
    arms = arm_rows(coll)
    arms = arms[arms["fp8"] != "bf16"]
    assert len(fig) == len(arms)
    np.testing.assert_allclose(fig["mean"].to_numpy(), arms["ratio_mean"].to_numpy(), rtol=1e-5)


def test_a_ratio_beyond_the_axis_is_drawn_at_its_edge_and_kept_in_the_csv(coll, tmp_path):
    """Few BF16-clipped tokens (surge_dose_quick's 8 steps: tensorwise vanilla 35x) can put a whole
    ratio above the axis: its point sits at the edge (the CSV keeps the value), its bar from the
    lower bound; an interval that does not hold its point (never Fieller's) draws no negative bar."""
    arms = arm_rows(coll).reset_index(drop=True)
    fp8_rows = arms.index[arms["fp8"] != "bf16"]
    beyond, odd = fp8_rows[0], fp8_rows[1]
    arms.loc[beyond, ["ratio_mean", "ratio_lo", "ratio_hi"]] = [X_MAX * 2.5, X_MAX * 1.5, X_MAX * 4]
    arms.loc[odd, ["ratio_mean", "ratio_lo", "ratio_hi"]] = [2.0, 2.5, 1.5]
    paths = plot_heldout_ratio(coll, arms, tmp_path)
    fig = pd.read_csv(paths["csv"])
    assert fig["mean"].max() == pytest.approx(X_MAX * 2.5)
    assert "a triangle at the edge" in paths.caption
    plain = plot_heldout_ratio(coll, arm_rows(coll), tmp_path / "plain")
    assert "triangle" not in plain.caption


def test_without_heldout_rows_the_report_says_so(tmp_path, capsys):
    from analysis.report import main as report_main

    sweep = tmp_path / "old"
    make_sweep(sweep, [RunSpec(fp8=f, clip=c, seed=0, steps=21, calibration_mode=m)
                       for f, c, m in (("bf16", "vanilla", None), ("tensorwise", "calibrated", "same_batch"))],
               sweep="old")
    c = collect(sweep, workers=1, progress=False)
    assert not has_holdout(c)
    assert heldout_sections(c, tmp_path / "t", tmp_path / "f") == [] and not (tmp_path / "t").exists()
    assert "no held-out data" in no_data_line(c).lower()
    assert "No held-out data" in ratio_table(arm_rows(c)).markdown
    assert default_mode_rule(rule_rows(c)).mode == ""
    assert report_main([str(sweep), "--out", str(tmp_path / "r"), "--no-cache", "--no-progress",
                        "--figures", "entropy"]) == 0
    assert "no held-out data" in capsys.readouterr().out.lower()
    assert "Held-out judgement" not in (tmp_path / "r" / "report.md").read_text()
