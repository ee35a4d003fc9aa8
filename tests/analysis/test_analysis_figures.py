import numpy as np
import pandas as pd
import pytest
from analysis_known import SURGES

from analysis.arms import arm_label, arm_order_key, arm_style, sort_arms
from analysis.bars import plot_summary
from analysis.collect import collect
from analysis.figures import FIGURE_NAMES, arm_curves, figure_spec, plot_figure
from fp8rl.runs.synthetic import RunSpec, make_sweep


def test_entropy_figure_files_and_csv(known_coll, tmp_path):
    paths = plot_figure(known_coll, "entropy", tmp_path, smooth=1, pdf=True)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["pdf"].read_bytes()[:5] == b"%PDF-"
    assert all(p.stat().st_size > 1000 for p in paths.values())
    csv = pd.read_csv(paths["csv"])
    lines = csv[csv["kind"] == "line"]
    # reference: unsmoothed mean and std over seeds straight from the steps table
    st = known_coll.steps.dropna(subset=["actor/entropy"])
    ref = st.groupby(["arm", "step"], observed=True)["actor/entropy"].agg(["mean", "std", "count"])
    got = lines.set_index(["arm", "step"])
    assert len(got) == len(ref)
    np.testing.assert_allclose(got["mean"].to_numpy(), ref.loc[got.index, "mean"].to_numpy(), rtol=1e-5)
    two = ref["count"] >= 2
    np.testing.assert_allclose(got.loc[ref.index[two], "std"].to_numpy(), ref.loc[two, "std"].to_numpy(),
                               rtol=1e-5)
    assert got.loc[ref.index[~two], "std"].isna().all()
    surges = csv[csv["kind"] == "surge"]
    assert sorted(surges["step"].tolist()) == sorted(SURGES.values())
    # deterministic: same bytes twice
    again = plot_figure(known_coll, "entropy", tmp_path / "again", smooth=1)
    assert again["csv"].read_bytes() == paths["csv"].read_bytes()


def test_smoothing_and_sparse_metrics(known_coll):
    raw = arm_curves(known_coll, "actor/entropy", smooth=1)
    sm = arm_curves(known_coll, "actor/entropy", smooth=10)
    assert len(raw) == len(sm) and not np.allclose(raw["mean"], sm["mean"])
    alpha = arm_curves(known_coll, "clip/alpha", smooth=10)  # logged every 20 steps: not smoothed
    assert set(alpha["arm"]) == {"FP8 tensorwise + calibrated"}
    assert sorted(alpha["step"].unique()) == [0, 20, 40, 60]
    assert np.allclose(alpha["mean"], 0.002)


def test_figures_skip_absent_metrics_and_all_names(tmp_path):
    only = ("actor/entropy",)
    make_sweep(tmp_path / "s", [RunSpec(steps=30, metrics=only), RunSpec(fp8="foo8", clip="newclip",
                                                                        steps=30, metrics=only)])
    c = collect(tmp_path / "s")
    assert plot_figure(c, "mismatch_kl", tmp_path / "f") is None
    assert plot_summary(c, "eval_accuracy", tmp_path / "f") is None
    assert not plot_figure(c, "entropy", tmp_path / "nopdf").get("pdf")  # PDF only on request
    out = plot_figure(c, "entropy", tmp_path / "f")  # unknown fp8/clip values: fallback style
    assert out["png"].stat().st_size > 1000
    assert "FP8 foo8 + newclip" in set(pd.read_csv(out["csv"])["arm"])
    with pytest.raises(KeyError, match="valid names"):
        figure_spec("nope")
    assert {"entropy", "entropy_vs_bf16", "clipfrac_neg_low", "reward_accuracy", "response_length", "mismatch_kl",
            "clip_bounds", "ratio_quantiles"} == set(FIGURE_NAMES)


def test_arm_labels_and_styles():
    assert arm_label("bf16", "vanilla") == "BF16"
    assert arm_label("rollout_only", "vanilla") == "FP8 rollout only"
    assert arm_label("tensorwise", "vanilla") == "FP8 tensorwise (vanilla)"
    assert arm_label("tensorwise", "tis") == "FP8 tensorwise + TIS"
    assert arm_label("rowwise", "calibrated") == "FP8 rowwise + calibrated"
    assert arm_label("fp4", "tis") == "FP8 fp4 + TIS"
    arms = [("tensorwise", "calibrated"), ("zz", "vanilla"), ("bf16", "vanilla"), ("tensorwise", "vanilla"),
            ("rollout_only", "tis"), ("tensorwise", "weird")]
    assert sort_arms(arms) == [("bf16", "vanilla"), ("rollout_only", "tis"), ("tensorwise", "vanilla"),
                               ("tensorwise", "calibrated"), ("tensorwise", "weird"), ("zz", "vanilla")]
    assert arm_order_key("bf16", "vanilla") < arm_order_key("mxfp8", "vanilla")
    # sweep variants: numbers by value, decimals and exponents included; never a tie
    def variants(*vs):
        return sorted((f"calibrated[{v}]" for v in vs), key=lambda c: arm_order_key("tensorwise", c))
    assert variants("clip.low_min=0.5", "clip.low_min=0.05", "clip.low_min=0.2") == [
        "calibrated[clip.low_min=0.05]", "calibrated[clip.low_min=0.2]", "calibrated[clip.low_min=0.5]"]
    assert variants("lr=0.0003", "lr=1e-05", "lr=0", "lr=0.0001", "lr=3e-05") == [
        "calibrated[lr=0]", "calibrated[lr=1e-05]", "calibrated[lr=3e-05]", "calibrated[lr=0.0001]",
        "calibrated[lr=0.0003]"]
    assert variants("p=8 b=[0.8,1.2]", "p=8 b=[0.6,1.8]", "p=2 b=[0.8,1.2]")[0] == "calibrated[p=2 b=[0.8,1.2]]"
    odd = ["a", "a1", "01", "1", "1.0", "x=05", "x=5"]
    keys = [arm_order_key("tensorwise", f"c[{v}]") for v in odd]
    assert len(set(keys)) == len(odd)  # distinct labels never sort equal
    # fixed mapping: the same arm always gets the same style; distinct arms differ
    known = [(f, c) for f in ("bf16", "rollout_only", "tensorwise", "rowwise", "blockwise", "mxfp8")
             for c in ("vanilla", "tis", "calibrated")]
    styles = {a: arm_style(*a) for a in known}
    assert len({(s.color, s.linestyle) for s in styles.values()}) == len(known)
    assert arm_style("mystery", "tis") == arm_style("mystery", "tis")
    assert arm_style("mystery", "other").linestyle == "-."


def test_many_panels_wrap_and_order(tmp_path):
    from analysis.arms import panel_order_key

    specs = [RunSpec(algorithm=a, model=m, steps=30, metrics=("actor/entropy",))
             for a in ("dapo", "grpo") for m in ("14b", "8b")]
    make_sweep(tmp_path / "s", specs)
    c = collect(tmp_path / "s")
    out = plot_figure(c, "entropy", tmp_path / "f")
    csv = pd.read_csv(out["csv"])
    assert set(zip(csv["algorithm"], csv["model"].astype(str), strict=True)) == {
        ("dapo", "14b"), ("dapo", "8b"), ("grpo", "14b"), ("grpo", "8b")}
    panels = sorted({(s.algorithm, s.model) for s in specs}, key=lambda p: panel_order_key(*p))
    assert panels == [("grpo", "8b"), ("grpo", "14b"), ("dapo", "8b"), ("dapo", "14b")]
    import matplotlib.image as mpimg

    h, w = mpimg.imread(out["png"]).shape[:2]
    assert h > 0.4 * w  # wrapped into two rows of at most three panels, not one wide row


def test_select_filters_a_panel_and_an_arm_with_categoricals():
    import pandas as pd

    from analysis.arms import select

    df = pd.DataFrame({"algorithm": ["grpo", "grpo", "dapo", "grpo"], "model": ["8b", "8b", "8b", "14b"],
                       "fp8": ["bf16", "tensorwise", "bf16", "bf16"], "clip": ["vanilla", "tis", "vanilla", "vanilla"],
                       "v": [1, 2, 3, 4]})
    cat = df.astype({c: "category" for c in ("algorithm", "model", "fp8", "clip")})
    for d in (df, cat):
        assert select(d, "grpo", "8b")["v"].tolist() == [1, 2]
        assert select(d, "grpo", "8b", "tensorwise", "tis")["v"].tolist() == [2]
        assert select(d, "dapo", "14b").empty
