"""Every figure of every report: one colour per clip method, bands within the metric's range, one y
scale per metric, metrics that are the same numbers drawn once (issue 32, defect 3).

The colours are read from the artists the report draws (lines, bands, bars, error bars, surge
markers: each carries ``gid = "<fp8>|<clip>[|band|surge]"``), for two reports of different
sweeps with different subsets of methods, and compared with one mapping."""

import dataclasses

import numpy as np
import pytest
from analysis_known import artist_colours, capture_figures
from matplotlib.collections import PolyCollection

import analysis.curves as curves
import analysis.granularity as granularity
from analysis.arms import split_clip
from analysis.collect import collect
from analysis.report import ALL_FIGURES, write_report
from analysis.style import METHOD_COLOURS, REFERENCE_COLOUR, method_colour, support
from fp8rl.runs.synthetic import RunSpec, make_sweep

STEPS = 40


def _main_like(path):
    """Two blocks, three FP8 settings x three methods, two seeds whose clip fractions differ 4x (a
    wide interval near zero: an uncut band goes below 0 %)."""
    specs = [RunSpec(algorithm=a, model=m, fp8=f, clip=c, seed=s, steps=STEPS, eval_every=10,
                     clipfrac_neg_low=(0.001, 0.004)[s], eval={"aime24": 0.3 + 0.01 * s, "math500": 0.6})
             for a, m in (("grpo", "8b"), ("dapo", "14b")) for f in ("bf16", "rollout_only", "tensorwise")
             for c in ("vanilla", "tis", "calibrated") for s in (0, 1)]
    make_sweep(path, specs, sweep="mainlike")
    return collect(path)


def _granularity_like(path):
    specs = [RunSpec(fp8=f, clip=c, seed=s, steps=STEPS, eval_every=10, clipfrac_neg_low=0.002 * (1 + s),
                     eval={"aime24": 0.3, "math500": 0.6 + 0.01 * s})
             for f in ("bf16", "blockwise", "mxfp8") for c in ("tis", "calibrated") for s in (0, 1, 2)]
    make_sweep(path, specs, sweep="granlike")
    return collect(path)


@pytest.fixture(scope="module")
def two_reports(tmp_path_factory):
    base = tmp_path_factory.mktemp("style")
    return _main_like(base / "mainlike"), _granularity_like(base / "granlike")


def test_one_colour_per_method_in_every_figure_of_every_report(two_reports, tmp_path, monkeypatch):
    seen: dict[str, set[str]] = {}
    drawn_figures = set()
    for i, coll in enumerate(two_reports):
        kept = capture_figures(monkeypatch)
        write_report(coll, tmp_path / f"r{i}", figures=list(ALL_FIGURES))
        assert {"entropy", "entropy_vs_bf16", "eval_accuracy", "clipfrac_neg_low", "clipfrac_summary",
                "reward_accuracy"} <= set(kept)
        for name, fig in kept.items():
            arts = artist_colours(fig)
            assert arts, f"{name}: no artist drawn for an arm"
            methods_here = set()
            for gid, col in arts:
                if gid == "reference":
                    assert col == REFERENCE_COLOUR, name
                    continue
                clip = gid.split("|")[1]
                method = split_clip(clip)[0]
                methods_here.add(method)
                seen.setdefault(method, set()).add(col)
                assert col == METHOD_COLOURS[method].lower(), f"{name}: {gid} drawn in {col}"
            # name-free: as many colours among the arms' artists as methods in the figure
            assert len({c for g, c in arts if g != "reference"}) == len(methods_here), name
            drawn_figures.add(name)
    assert set(seen) == {"vanilla", "tis", "calibrated"}
    assert all(len(c) == 1 for c in seen.values()), seen
    assert len({next(iter(c)) for c in seen.values()}) == 3  # three methods, three colours
    assert drawn_figures >= {"entropy", "clipfrac_neg_low", "clipfrac_summary", "eval_accuracy"}


def test_colours_are_looked_up_by_key_not_label():
    assert method_colour("tis") == method_colour("tis[clip.period=4]") == METHOD_COLOURS["tis"]
    for label in ("TIS", "FP8 tensorwise + TIS"):
        with pytest.raises(ValueError, match="not the label"):
            method_colour(label)
    assert method_colour("newclip") == method_colour("newclip")  # an unknown key: a stable fallback
    assert method_colour("newclip") not in METHOD_COLOURS.values()


def test_bands_and_error_bars_stay_within_the_metric_range(two_reports, tmp_path, monkeypatch):
    coll = two_reports[0]
    kept = capture_figures(monkeypatch)
    write_report(coll, tmp_path / "r", figures=["clipfrac_neg_low", "clipfrac_summary", "entropy", "mismatch_kl"])
    lows = []
    for name in ("clipfrac_neg_low", "entropy", "mismatch_kl"):
        for ax in kept[name].axes:
            for c in ax.collections:
                if isinstance(c, PolyCollection) and str(c.get_gid()).endswith("|band"):
                    y = np.concatenate([p.vertices[:, 1] for p in c.get_paths()])
                    assert y.min() >= 0.0, f"{name}: band below 0 ({y.min()})"
                    if name == "clipfrac_neg_low":
                        assert y.max() <= 100.0
                        lows.append(y.min())
    assert min(lows) == 0.0  # the data's interval does reach below 0 %: it is cut there
    for ax in kept["clipfrac_summary"].axes:
        for ln in ax.get_lines():  # error-bar caps and the bars' ends
            x = np.asarray(ln.get_xdata(), dtype=float)
            assert (x[np.isfinite(x)] >= 0).all()
    assert support("actor/clipfrac_neg_low") == (0.0, 1.0) and support("rollout/reward_mean")[0] == -np.inf


def test_one_y_scale_per_metric(two_reports, tmp_path, monkeypatch):
    kept = capture_figures(monkeypatch)
    granularity.plot_by_granularity(two_reports[0], curves.spec_by_name(
        __import__("analysis.figures", fromlist=["FIGURES"]).FIGURES, "clipfrac_neg_low"), tmp_path)
    fig = kept["clipfrac_neg_low"]
    fig.canvas.draw()
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 6  # two blocks x three FP8 settings
    assert len({ax.get_ylim() for ax in axes}) == 1


def test_a_metric_equal_to_another_is_drawn_once(two_reports, tmp_path, monkeypatch):
    coll = two_reports[1]
    steps = coll.steps.copy()
    steps["rollout/acc"] = steps["rollout/reward_mean"]  # the mini backend: reward = accuracy
    coll = dataclasses.replace(coll, steps=steps)
    kept = capture_figures(monkeypatch)
    from analysis.figures import plot_figure

    paths = plot_figure(coll, "reward_accuracy", tmp_path)
    axes = [ax for ax in kept["reward_accuracy"].axes if ax.get_visible()]
    assert len(axes) == 3 and {ax.get_ylabel() for ax in axes} == {"mean reward", ""}
    assert "rollout/acc equals rollout/reward_mean at every step of every run, so it is drawn once" in paths.caption


def test_every_fp8_arm_of_the_launcher_has_a_label_and_a_colour_family():
    """An ``fp8=`` arm (``fp8rl.config.fp8.fp8_arms``, one per recipe) drawn with the fallback
    label and a hashed colour is a figure nobody can read across reports: each has its entry."""
    from analysis.arms import _COLOURS, FP8_LABELS
    from fp8rl.config.fp8 import fp8_arms

    missing = [a for a in fp8_arms() if a not in FP8_LABELS or a not in _COLOURS]
    # the old fp32 arm and the training-only recipes are drawn with the fallback on purpose
    assert set(missing) <= {"fp32", "rowwise_with_gw_hp", "tensorwise_delayed"}, missing
