import numpy as np
import pandas as pd
from analysis_known import EVALS, SURGES

from analysis.arms import arm_label
from analysis.tables import accuracy_table, diagnostics_table, run_diagnostics

ARMS = [("bf16", "vanilla"), ("tensorwise", "vanilla"), ("tensorwise", "calibrated"), ("blockwise", "tis")]


def expected_cell(fp8, clip, ds):
    vals = []
    for (f, c, _seed), ev in EVALS.items():
        if (f, c) == (fp8, clip):
            vals.append(100 * (np.mean(list(ev.values())) if ds == "Average" else ev[ds]))
    return np.mean(vals), np.std(vals, ddof=1), len(vals)


def test_accuracy_cells_equal_written_numbers(known_coll):
    t = accuracy_table(known_coll)
    d = t.data.set_index(["arm", "dataset"])
    assert list(dict.fromkeys(t.data["dataset"])) == ["aime24", "math500", "Average"]
    assert list(dict.fromkeys(t.data["arm"])) == [arm_label(*a) for a in ARMS]  # paper order
    for fp8, clip in ARMS:
        for ds in ("aime24", "math500", "Average"):
            mean, std, n = expected_cell(fp8, clip, ds)
            row = d.loc[(arm_label(fp8, clip), ds)]
            assert row["n"] == n == 2
            assert np.isclose(row["mean"], mean, rtol=0, atol=1e-9)
            assert np.isclose(row["std"], std, rtol=0, atol=1e-9)
            assert f"{mean:.1f} ± {std:.1f}" in t.markdown
    # three arms asked for 3 seeds and 2 finished: partial marks; the FAILED run's 90% is excluded
    partial = set(t.data.loc[t.data["partial"], "arm"])
    assert partial == {"BF16", "FP8 tensorwise + calibrated", "FP8 blockwise + TIS"}
    assert not d["missing"].any()
    assert "‡" in t.markdown and "fewer finished seeds" in t.markdown
    assert d["mean"].max() < 90


def test_best_marked_per_column(known_coll):
    t = accuracy_table(known_coll)
    for ds, g in t.data.groupby("dataset"):
        best = g.loc[g["best"], "arm"].tolist()
        assert best == [g.loc[g["mean"].idxmax(), "arm"]], ds
        mean, std, _ = expected_cell(*{arm_label(*a): a for a in ARMS}[best[0]], ds)
        assert f"**{mean:.1f} ± {std:.1f}**" in t.markdown
        assert f"\\textbf{{{mean:.1f} {{\\scriptsize $\\pm$ {std:.1f}}}}}" in t.latex


def test_missing_cells_footnoted(known_coll):
    # drop every finished calibrated run from the collection: its cells become missing
    coll = known_coll
    runs = coll.runs.copy()
    runs.loc[runs["clip"] == "calibrated", "cell"] = "failed"
    from dataclasses import replace

    t = accuracy_table(replace(coll, runs=runs))
    miss = t.data[t.data["missing"]]
    assert set(miss["arm"]) == {"FP8 tensorwise + calibrated"} and len(miss) == 3
    assert "| FP8 tensorwise + calibrated | n/a† | n/a† | n/a† |" in t.markdown
    assert "† no finished run" in t.markdown
    assert "n/a$^\\dagger$" in t.latex


def test_latex_is_booktabs_and_csv_roundtrips(known_coll, tmp_path):
    t = accuracy_table(known_coll)
    for s in ("\\toprule", "\\midrule", "\\bottomrule", "\\begin{tabular}{lrrr}"):
        assert s in t.latex
    assert "MATH-500" in t.latex and "AIME24" in t.markdown
    paths = t.write(tmp_path)
    assert all(p.stat().st_size > 0 for p in paths.values())
    back = pd.read_csv(paths["csv"])
    np.testing.assert_allclose(back["mean"], t.data["mean"], rtol=1e-5)
    assert back["best"].sum() == t.data["best"].sum() == 3


def test_diagnostics(known_coll):
    per_run = run_diagnostics(known_coll)
    surged = per_run.dropna(subset=["surge_step"])
    assert {(r.fp8, r.clip, int(r.seed)): int(r.surge_step) for r in surged.itertuples()} == SURGES
    ok = per_run[per_run["surge_step"].isna() & (per_run["cell"] == "ok")]
    assert np.allclose(ok["final_entropy"], 0.4 * (1 + np.exp(-10) * 1.5), atol=0.02)
    t = diagnostics_table(known_coll)
    d = t.data.set_index("arm")
    assert d.loc["FP8 tensorwise (vanilla)", "surged"] == 2
    assert d.loc["FP8 blockwise + TIS", "surged"] == 1
    assert d.loc["FP8 blockwise + TIS", "runs"] == 3 and d.loc["FP8 blockwise + TIS", "finished"] == 2
    assert d.loc["BF16", "surged"] == 0 and d.loc["BF16", "cells"] == 3
    assert d.loc["FP8 tensorwise (vanilla)", "surge_step_median"] == np.median([40, 47])
    assert d.loc["FP8 tensorwise (vanilla)", "final_garbled_frac"] == 0.3
    assert "2/2 (step 44)" in t.markdown and "Surge rule" in t.markdown
    assert "\\toprule" in t.latex


def test_clip_cells_table(known_coll):
    from analysis.clip_tables import clip_cells_table

    t = clip_cells_table(known_coll)
    assert list(t.index.get_level_values("arm")) == [arm_label(*a) for a in ARMS]
    st = known_coll.steps
    for fp8, clip in ARMS:
        for cell in ("actor/clipfrac_neg_low", "actor/clipfrac_pos_high"):
            ref = st[(st["fp8"] == fp8) & (st["clip"] == clip)][cell].mean()
            assert np.isclose(t.loc[("grpo", "8b", arm_label(fp8, clip)), cell], ref)
    # planted: surging runs clip more A<0 tokens than BF16
    assert (t.loc[("grpo", "8b", "FP8 tensorwise (vanilla)"), "actor/clipfrac_neg_low"]
            > t.loc[("grpo", "8b", "BF16"), "actor/clipfrac_neg_low"])


def test_mechanism_table_against_a_per_run_loop(known_coll):
    """Mean over steps per run, then mean/std over runs; x BF16 against the BF16 vanilla arm."""
    from analysis.clip_tables import mechanism_table

    t = mechanism_table(known_coll)
    d = t.data.set_index("arm")
    st = known_coll.steps

    def per_run_means(fp8, clip, metric):
        g = st[(st["fp8"] == fp8) & (st["clip"] == clip)]
        out = []
        for _, r in g.groupby("run", observed=True):
            v = r[metric].to_numpy(dtype=float)
            v = v[np.isfinite(v)]
            if len(v):
                out.append(sum(v) / len(v))
        return np.array(out)

    ref = per_run_means("bf16", "vanilla", "actor/clipfrac_neg_low").mean()
    for fp8, clip in ARMS:
        v = per_run_means(fp8, clip, "actor/clipfrac_neg_low")
        row = d.loc[arm_label(fp8, clip)]
        assert row["runs"] == len(v)
        assert np.isclose(row["clipfrac_neg_low_mean"], v.mean())
        assert np.isclose(row["clipfrac_neg_low_std"], np.std(v, ddof=1))
        assert np.isclose(row["x_bf16"], v.mean() / ref)
        q = per_run_means(fp8, clip, "actor/ratio_neg_q01")
        assert np.isclose(row["ratio_neg_q01"], q.mean())
        g = st[(st["fp8"] == fp8) & (st["clip"] == clip)].sort_values("step")
        lows = [r["clip/low"].dropna().iloc[-1] for _, r in g.groupby("run", observed=True)]
        assert np.isclose(row["clip_low_final"], np.mean(lows))
    assert d.loc["BF16", "x_bf16"] == 1.0
    assert (d["bf16_reference"] == "BF16").all()
    assert "x BF16" in t.markdown and "±" in t.markdown and "\\toprule" in t.latex


def test_mechanism_table_without_a_bf16_arm(known_coll):
    import dataclasses

    from analysis.clip_tables import mechanism_table

    keep = known_coll.runs["fp8"] != "bf16"
    runs = known_coll.runs[keep]
    coll = dataclasses.replace(known_coll, runs=runs,
                               steps=known_coll.steps[known_coll.steps["run"].isin(runs["run"])])
    t = mechanism_table(coll)
    assert len(t.data) and t.data["x_bf16"].isna().all()
    assert "none in this block" in t.markdown


def test_calibration_table_lists_every_calibration_step(known_coll):
    from analysis.clip_tables import calibration_table

    t = calibration_table(known_coll)
    d = t.data
    assert set(d["arm"]) == {arm_label("tensorwise", "calibrated")}  # only calibrated arms
    st = known_coll.steps
    g = st[(st["fp8"] == "tensorwise") & (st["clip"] == "calibrated")]
    cal_steps = sorted(set(g.loc[g["shadow/clipfrac_neg_low"].notna(), "step"].astype(int)))
    assert cal_steps, "the synthetic calibrated runs log the shadow on calibration steps"
    assert sorted(d.loc[d["calibration"], "step"]) == cal_steps
    assert d["step"].min() == g["step"].min() and d["step"].max() == g["step"].max()
    for _, r in d.iterrows():
        at = g[g["step"] == r["step"]]
        assert r["runs"] == at["run"].nunique()
        for m in ("clip/low", "clip/high", "clip/alpha"):
            v = at[m].dropna()
            assert (np.isnan(r[m]) and v.empty) or np.isclose(r[m], v.mean()), (r["step"], m)
    # the planted controller moves the bounds from (0.6, 1.8) towards (0.7, 1.35)
    first, last = d.iloc[0], d.iloc[-1]
    assert last["clip/low"] > first["clip/low"] and last["clip/high"] < first["clip/high"]
    assert "alpha" in t.markdown and "(not a calibration step)" in t.markdown


def test_calibration_table_without_calibrated_arms(known_coll):
    import dataclasses

    from analysis.clip_tables import calibration_table

    runs = known_coll.runs[known_coll.runs["clip"] != "calibrated"]
    coll = dataclasses.replace(known_coll, runs=runs,
                               steps=known_coll.steps[known_coll.steps["run"].isin(runs["run"])])
    t = calibration_table(coll)
    assert t.data.empty and "No calibrated arm" in t.markdown


def test_trajectory_table_against_a_per_run_loop(known_coll):
    import math

    from analysis.tables import TRAJECTORY_WINDOW, trajectory_table

    t = trajectory_table(known_coll)
    d = t.data.set_index("arm")
    st, ev = known_coll.steps, known_coll.evals
    for fp8, clip in ARMS:
        firsts, lasts, maxes, ev_first, ev_last = [], [], [], [], []
        for run, g in st[(st["fp8"] == fp8) & (st["clip"] == clip)].groupby("run", observed=True):
            e = g.sort_values("step")["actor/entropy"].to_numpy(dtype=float)
            w = max(1, math.ceil(TRAJECTORY_WINDOW * len(e)))
            firsts.append(np.nanmean(e[:w]))
            lasts.append(np.nanmean(e[-w:]))
            maxes.append(np.nanmax(e))
            r = ev[(ev["run"] == run) & (ev["stat"] == "avg@k")]
            if len(r):
                by = r.groupby("step")["value"].mean().sort_index()
                ev_first.append(by.iloc[0])
                ev_last.append(by.iloc[-1])
        row = d.loc[arm_label(fp8, clip)]
        assert np.isclose(row["entropy_first_mean"], np.mean(firsts))
        assert np.isclose(row["entropy_last_mean"], np.mean(lasts))
        assert np.isclose(row["entropy_max_mean"], np.mean(maxes))
        assert np.isclose(row["eval_last_mean"], np.mean(ev_last))
        assert np.isclose(row["eval_first_std"], np.std(ev_first, ddof=1))
    # planted surges: the surging arm ends with more entropy than it started with; BF16 does not
    assert d.loc["FP8 tensorwise (vanilla)", "entropy_last_mean"] > d.loc["FP8 tensorwise (vanilla)",
                                                                          "entropy_first_mean"]
    assert d.loc["BF16", "entropy_last_mean"] < d.loc["BF16", "entropy_first_mean"]
    assert "→" in t.markdown and "$\\to$" in t.latex
