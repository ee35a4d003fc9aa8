"""The report's figures are paper-ready: the entropy figure has one panel per FP8 setting with a
mean line and a 95% t band per clip method, evaluation accuracy is paired differences to BF16 with
confidence intervals, no axis carries an offset, every figure has a caption, and report.md opens with the
findings summary and shows the figures before the tables."""

import dataclasses

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from figure_capture import capture_saved_figures
from matplotlib.collections import PolyCollection
from matplotlib.container import BarContainer, ErrorbarContainer
from PIL import Image

import analysis.bars as bars
import analysis.figures as figures
import analysis.granularity as granularity
from analysis.paired import run_gains
from analysis.ratio_ci import t_quantile
from analysis.report import main as report_main


def _visible(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def test_entropy_one_panel_per_granularity_mean_and_band(known_coll, tmp_path, monkeypatch):
    kept = capture_saved_figures(monkeypatch, granularity)
    paths = figures.plot_figure(known_coll, "entropy", tmp_path)
    (fig,) = kept
    axes = _visible(fig)
    # the known sweep: BF16, FP8 tensorwise, FP8 blockwise (in the arms' order)
    assert [ax.get_title() for ax in axes] == ["BF16", "FP8 tensorwise", "FP8 blockwise"]
    expected = {"BF16": {"vanilla"}, "FP8 tensorwise": {"vanilla", "calibrated"}, "FP8 blockwise": {"TIS"}}
    for ax in axes:
        labelled = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
        assert {ln.get_label() for ln in labelled} == expected[ax.get_title()]
        bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
        assert len(bands) == len(labelled), f"{ax.get_title()}: one band per clip method"
        for ln, band in zip(labelled, bands, strict=True):  # band and line share the colour
            assert np.allclose(band.get_facecolor()[0][:3], plt.matplotlib.colors.to_rgb(ln.get_color()))
        assert ax.get_xlabel() == "training step" or ax is not axes[-1]
        if ax.get_title() != "BF16":  # the BF16 reference over every FP8 panel, in black
            assert [ln.get_color() for ln in ax.get_lines() if ln.get_gid() == "reference"] == ["#000000"]
    assert axes[0].get_ylabel() == "entropy (nats/token)"
    legend = fig.legends[0]
    assert {t.get_text() for t in legend.get_texts()} >= {"vanilla", "calibrated", "TIS", granularity.BAND}
    # the band is the 95% t interval of the mean over seeds (CSV), and the caption says so
    csv = pd.read_csv(paths["csv"])
    line = csv[(csv["kind"] == "line") & (csv["n_seeds"] >= 2)]
    half = np.array([t_quantile(0.975, n - 1) for n in line["n_seeds"]]) * line["std"] / np.sqrt(line["n_seeds"])
    np.testing.assert_allclose(line["hi"] - line["mean"], half, rtol=1e-3, atol=2e-5)  # CSV: 6 digits
    # cut at 0: entropy is not negative (two-seed arms of the known sweep have wide intervals)
    np.testing.assert_allclose(line["lo"], np.maximum(line["mean"] - half, 0.0), rtol=1e-3, atol=2e-5)
    assert (line["lo"] == 0).any() and (line["lo"] >= 0).all()
    cap = paths.caption
    for words in ("one panel per FP8 setting", "95% t interval of the mean over seeds, clipped to the metric's range",
                  "Sweep known", "2-3 seeds per arm", "trained to step 49-79 (runs differ)", "11 runs (8 finished)",
                  "surge", "The curves include 2 unfinished run(s)"):
        assert words in cap, words
    assert Image.open(paths["png"]).text["Description"] == cap


def test_accuracy_is_paired_differences_with_confidence_intervals(known_coll, tmp_path, monkeypatch):
    kept = capture_saved_figures(monkeypatch, bars)
    paths = bars.plot_summary(known_coll, "eval_accuracy", tmp_path)
    (fig,) = kept
    (ax,) = _visible(fig)
    assert not any(isinstance(c, BarContainer) for c in ax.containers)  # differences, not bars from 0
    assert any(isinstance(c, ErrorbarContainer) for c in ax.containers)
    assert {t.get_text() for t in ax.get_yticklabels()} == {
        "FP8 tensorwise (vanilla)", "FP8 tensorwise + calibrated", "FP8 blockwise + TIS"}
    csv = pd.read_csv(paths["csv"]).set_index("arm")
    # reference: run_gains per seed, minus the BF16 arm's gain of the same seed, t interval
    g = run_gains(known_coll).set_index(["fp8", "clip", "seed"])["gain"]
    d = (g.loc["tensorwise", "vanilla"] - g.loc["bf16", "vanilla"]).dropna().to_numpy()
    r = csv.loc["FP8 tensorwise (vanilla)"]
    assert r["n_seeds"] == len(d) == 2 and np.isclose(r["mean"], 100 * d.mean(), atol=1e-4)
    half = 12.706 * 100 * d.std(ddof=1) / np.sqrt(2)  # 95% t interval, 1 degree of freedom
    assert np.isclose(r["hi"] - r["mean"], half, rtol=1e-4) and np.isclose(r["mean"] - r["lo"], half, rtol=1e-4)
    assert "95% confidence interval" in paths.caption and "same seed" in paths.caption


def test_ratio_quantiles_axis_has_no_offset(known_coll, tmp_path, monkeypatch):
    steps = known_coll.steps.copy()
    rng = np.random.default_rng(0)
    steps["actor/ratio_neg_q50"] = 1.0 + 3e-5 * rng.random(len(steps))  # the mini runs' q50
    coll = dataclasses.replace(known_coll, steps=steps)
    kept = capture_saved_figures(monkeypatch, granularity)
    figures.plot_figure(coll, "ratio_quantiles", tmp_path)
    (fig,) = kept
    fig.canvas.draw()
    axes = _visible(fig)
    assert axes
    for ax in axes:
        assert ax.yaxis.get_offset_text().get_text() == "", ax.get_ylabel()
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert len(set(labels)) == len(labels), f"{ax.get_ylabel()}: tick labels repeat: {labels}"


def test_report_opens_with_the_summary_and_figures_precede_tables(known_sweep, tmp_path):
    out = tmp_path / "rep"
    assert report_main([str(known_sweep), "--out", str(out), "--no-progress", "--no-cache",
                        "--figures", "entropy,eval_accuracy"]) == 0
    text = (out / "report.md").read_text()
    sections = [ln[3:] for ln in text.splitlines() if ln.startswith("## ")]
    assert sections[0] == "Summary" and sections[1] == "Figures"
    assert sections.index("Figures") < sections.index("Tables") < sections.index("Accuracy")
    summary = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    # computed from the known sweep: 8 finished runs + 3 problems; the surges planted in it
    assert "11 cells: 1 failed, 1 incomplete, 1 missing, 8 ok." in summary
    assert "Entropy surges: 3 of 10 runs" in summary
    assert "FP8 tensorwise + calibrated" in summary and "Final accuracy" in summary
    body = text.split("## Figures", 1)[1].split("\n## ", 1)[0]
    for k, name in enumerate(("entropy", "eval_accuracy"), start=1):
        img = body.index(f"](figures/{name}.png)")
        cap = body.index(f"*Figure {k}.* ", img)
        assert "Sweep known" in body[cap:body.index("\n", cap)]
    assert "(tables/accuracy.md)" in text
    assert not list((out / "figures").glob("*.pdf"))
