"""Figures and a report.md a person can read (issue 50, item 9): no image of more than
``MAX_PANELS`` panels (a figure of more is split by (algorithm, model) block, then by metric), no
panel drawn twice (a metric equal to another in every run of a block is drawn once there), and
report.md states the headline tables before the per-cell detail, which it folds."""

import dataclasses
import re

import pytest
from analysis_known import capture_figures

from analysis.collect import collect
from analysis.figures import FIGURE_NAMES, plot_figure
from analysis.granularity import MAX_PANELS
from analysis.report import write_report
from fp8rl.runs import metrics as M
from fp8rl.runs.synthetic import RunSpec, make_sweep

BLOCKS = [(a, m) for a in ("grpo", "dapo") for m in ("8b", "14b", "32b")]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """Six (algorithm, model) blocks x three FP8 settings, calibrated (so the clip bounds are
    logged); GRPO's rollout accuracy is its reward (the mini backend), DAPO's is not (its overlong
    penalty moves the reward)."""
    path = tmp_path_factory.mktemp("big") / "big"
    specs = [RunSpec(algorithm=a, model=m, fp8=f, clip="calibrated", seed=0, steps=12, eval_every=6,
                     eval={"aime24": 0.3}) for a, m in BLOCKS for f in ("bf16", "tensorwise", "rowwise")]
    make_sweep(path, specs, sweep="big", fast=True)
    coll = collect(path)
    st = coll.steps.copy()
    grpo = st["algorithm"].astype(str) == "grpo"
    st.loc[grpo, M.ROLLOUT_ACC] = st.loc[grpo, M.ROLLOUT_REWARD_MEAN]
    st.loc[~grpo, M.ROLLOUT_ACC] = st.loc[~grpo, M.ROLLOUT_REWARD_MEAN] + 0.01
    return dataclasses.replace(coll, steps=st)


def test_no_image_has_more_than_max_panels_and_none_is_drawn_twice(big, tmp_path, monkeypatch):
    kept = capture_figures(monkeypatch)
    for name in FIGURE_NAMES:
        plot_figure(big, name, tmp_path)
    assert kept
    for name, fig in kept.items():
        panels = [ax for ax in fig.axes if ax.get_visible()]
        assert len(panels) <= MAX_PANELS, (name, len(panels))
        labels = [ax.get_ylabel() for ax in panels if ax.get_ylabel()]
        assert len(labels) == len(set(labels)), (name, labels)  # one row per metric, never twice
    # entropy: 18 panels in one block-per-image split; the reward figure of a GRPO block has one row
    assert {n for n in kept if n.startswith("entropy-")} == {f"entropy-{a}-{m}" for a, m in BLOCKS}
    grpo = [ax for ax in kept["reward_accuracy-grpo-8b"].axes if ax.get_visible()]
    dapo = [ax for ax in kept["reward_accuracy-dapo-8b"].axes if ax.get_visible()]
    assert len(grpo) == 3 and len(dapo) == 6


def test_the_report_links_every_image_of_a_split_figure_and_folds_the_detail(big, tmp_path):
    out = tmp_path / "rep"
    text = write_report(big, out, figures=["entropy", "reward_accuracy"]).read_text()
    for a, m in BLOCKS:
        assert f"](figures/entropy-{a}-{m}.png)" in text
        assert (out / "figures" / f"entropy-{a}-{m}.png").is_file()
    assert "rollout/acc equals rollout/reward_mean at every step of every run of GRPO · 8b" in text
    titles = [ln[3:] for ln in text.splitlines() if ln.startswith("## ")]
    head = ["Accuracy", "Accuracy gain, paired", "Mechanism: FP8 noise and the lower clip bound"]
    detail = ["Diagnostics", "Start versus end of training", "Calibrated Clipping: the bounds over time"]
    assert max(titles.index(t) for t in head) < titles.index("Which runs") < min(titles.index(t) for t in detail)
    for t in detail:  # each detail table sits in a <details> block
        body = text.split(f"\n## {t}\n", 1)[1].split("\n## ", 1)[0]
        assert re.match(r"\s*<details>\n<summary>", body), (t, body[:200])
    for t in head:
        body = text.split(f"\n## {t}\n", 1)[1].split("\n## ", 1)[0]
        assert not body.lstrip().startswith("<details>"), t
