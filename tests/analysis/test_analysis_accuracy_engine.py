"""The accuracy figure (``eval_accuracy``) and the report's summary show the BF16-scored gains
versus BF16 where the runs have them (``eval_bf16/`` keys), else each arm's own engine's, and
say which.

Planted: in the block with a BF16 engine, each arm's own engine and the BF16 engine give gains
that differ (FP8 tensorwise vanilla gains more than BF16 by its own engine, less by the BF16
engine), so the own-engine and BF16-scored differences to BF16 have opposite signs. The
expected numbers are computed here from the run directories' files (``manifest.json``,
``eval.jsonl``) with ``json.loads``, not through ``analysis``.
"""

import json
import math
import statistics
from pathlib import Path

import pandas as pd
import pytest
from figure_capture import capture_saved_figures

import analysis.bars as bars
from analysis.collect import collect
from analysis.report import write_report
from fp8rl.runs.synthetic import RunSpec, make_sweep

SEEDS = (0, 1, 2)
SETS = {"arith": 0.0, "alg": -0.1}  # per-set offset of the final value
#: final avg@k of the arm's own engine and of the BF16 engine, by (fp8, clip) and seed; the
#: synthetic writer puts step 0 at half the final value, so a run's gain is half its final value
OWN = {("bf16", "vanilla"): lambda s: 0.60 + 0.02 * s,
       ("tensorwise", "vanilla"): lambda s: 0.70 + 0.03 * s,
       ("tensorwise", "calibrated"): lambda s: 0.66 + 0.01 * s}
BF16 = {("bf16", "vanilla"): OWN[("bf16", "vanilla")],  # a BF16 arm's own engine is BF16
        ("tensorwise", "vanilla"): lambda s: 0.55 + 0.01 * (s % 2),
        ("tensorwise", "calibrated"): lambda s: 0.58 - 0.01 * s}
#: Student t, 97.5% quantile, 2 degrees of freedom (tables)
T975_DF2 = 4.302652729911275


def _specs(model, with_bf16):
    return [RunSpec(model=model, fp8=f, clip=c, seed=s, steps=20, eval_every=10,
                    eval={d: OWN[(f, c)](s) + o for d, o in SETS.items()},
                    eval_bf16={d: BF16[(f, c)](s) + o for d, o in SETS.items()} if with_bf16 else {})
            for (f, c) in OWN for s in SEEDS]


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    make_sweep(root / "with_bf16", _specs("8b", True), sweep="with_bf16")  # every run BF16-scored too
    make_sweep(root / "own_only", _specs("14b", False), sweep="own_only")  # from before the BF16 engine
    return root / "with_bf16", root / "own_only"


def _expected(sweep_dir: Path, prefix: str) -> dict:
    """Per non-BF16 arm: the paired differences of gains (points) scored by ``prefix``
    (``eval`` or ``eval_bf16``), read from the files: mean, 95% t interval, t."""
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    gains = {}
    for cell in manifest["cells"]:
        rows = [json.loads(x) for x in (sweep_dir / cell["run_dir"] / "eval.jsonl").read_text().splitlines()]
        by_step = {}
        for r in rows:
            for key, v in r.items():
                if key.startswith(f"{prefix}/") and key.endswith("/avg@k"):
                    by_step.setdefault(r["step"], []).append(v)
        first, last = by_step[min(by_step)], by_step[max(by_step)]
        a = cell["axes"]
        gains[(a["fp8"], a["clip"], a["seed"])] = statistics.mean(last) - statistics.mean(first)
    out = {}
    for f, c in OWN:
        if f == "bf16":
            continue
        d = [100 * (gains[(f, c, s)] - gains[("bf16", "vanilla", s)]) for s in SEEDS]
        m, sd = statistics.mean(d), statistics.stdev(d)
        half = T975_DF2 * sd / math.sqrt(len(d))
        out[(f, c)] = {"mean": m, "lo": m - half, "hi": m + half, "t": m / (sd / math.sqrt(len(d)))}
    return out


def test_the_planted_engines_disagree(sweeps):
    own, bf16 = _expected(sweeps[0], "eval"), _expected(sweeps[0], "eval_bf16")
    for arm in own:  # the test means something only if the two engines differ in sign
        assert own[arm]["mean"] > 1.0 and bf16[arm]["mean"] < -1.0, (arm, own[arm], bf16[arm])


def test_eval_accuracy_draws_bf16_scored_gains_and_falls_back_per_block(sweeps, tmp_path, monkeypatch):
    with_bf16, own_only = sweeps
    kept = capture_saved_figures(monkeypatch, bars)
    paths = bars.plot_summary(collect([with_bf16, own_only], workers=1, progress=False), "eval_accuracy",
                              tmp_path / "mixed")
    csv = pd.read_csv(paths["csv"])
    assert list(csv.columns) == ["kind", "metric", "algorithm", "model", "arm", "fp8", "clip", "mean", "std",
                                 "n_seeds", "lo", "hi", "scored_by"]
    for model, sweep_dir, prefix, engine in (("8b", with_bf16, "eval_bf16", "bf16"),
                                             ("14b", own_only, "eval", "own")):
        rows = csv[csv["model"] == model].set_index(["fp8", "clip"])
        exp = _expected(sweep_dir, prefix)
        assert set(rows.index) == set(exp)
        for arm, e in exp.items():
            r = rows.loc[arm]
            assert r["scored_by"] == engine and r["n_seeds"] == len(SEEDS), (model, arm)
            for k in ("mean", "lo", "hi"):
                assert math.isclose(r[k], e[k], rel_tol=1e-4, abs_tol=1e-4), (model, arm, k, r[k], e[k])
    (fig,) = kept
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(axes) == {"GRPO · 8b (BF16-scored)", "GRPO · 14b (own engine)"}
    assert axes["GRPO · 8b (BF16-scored)"].get_xlabel().endswith("\nscored by a BF16 engine")
    assert axes["GRPO · 14b (own engine)"].get_xlabel().endswith("\nscored by each arm's own engine")
    assert "BF16-scored where the runs have it" in fig._suptitle.get_text()
    assert ("scored by a BF16 engine on the same weights in the panels marked BF16-scored, else scored by "
            "each arm's own engine" in paths.caption)


def test_eval_accuracy_of_a_sweep_without_bf16_engine_says_own_engine(sweeps, tmp_path, monkeypatch):
    kept = capture_saved_figures(monkeypatch, bars)
    paths = bars.plot_summary(collect(sweeps[1], workers=1, progress=False), "eval_accuracy", tmp_path / "own")
    csv = pd.read_csv(paths["csv"])
    assert set(csv["scored_by"]) == {"own"}
    (fig,) = kept
    (ax,) = [a for a in fig.axes if a.get_visible()]
    assert ax.get_xlabel() == "avg@k gain − BF16 gain, same seed (points)\nscored by each arm's own engine"
    assert "scored by each arm's own engine" in fig._suptitle.get_text()
    assert "scored by each arm's own engine (no BF16-engine evaluation)" in paths.caption
    assert "(tables/paired_accuracy)" in paths.caption


def test_the_summary_states_bf16_scored_gains_else_own_labelled(sweeps, tmp_path):
    with_bf16, own_only = sweeps
    coll = collect([with_bf16, own_only], workers=1, progress=False)
    text = write_report(coll, tmp_path / "rep", figures=["eval_accuracy"]).read_text()
    summary = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    b8 = summary.split("**GRPO · 8b**", 1)[1].split("**GRPO · 14b**", 1)[0]
    b14 = summary.split("**GRPO · 14b**", 1)[1]

    def label(arm):
        return {("tensorwise", "vanilla"): "FP8 tensorwise (vanilla)",
                ("tensorwise", "calibrated"): "FP8 tensorwise + calibrated"}[arm]

    bf16 = _expected(with_bf16, "eval_bf16")
    hi, lo = max(bf16, key=lambda a: bf16[a]["mean"]), min(bf16, key=lambda a: bf16[a]["mean"])

    def with_ci(a):
        e = bf16[a]
        return f"{label(a)} {e['mean']:+.1f} pts [{e['lo']:+.1f}, {e['hi']:+.1f}] (3 seeds)"

    assert f"largest {with_ci(hi)}, smallest {with_ci(lo)}." in b8
    assert "Gain from step 0 minus" not in b8  # the own-engine difference is not printed beside it
    for e in _expected(with_bf16, "eval").values():
        assert f"{e['mean']:+.1f} pts" not in b8
    assert "Final accuracy (avg@k, each arm's own engine," in b8
    own = _expected(own_only, "eval")
    hi, lo = max(own, key=lambda a: own[a]["mean"]), min(own, key=lambda a: own[a]["mean"])

    def with_t(a):
        return f"{label(a)} {own[a]['mean']:+.1f} pts (3 seeds, t = {own[a]['t']:.1f})"

    assert (f"Gain from step 0 minus the BF16 arm's gain, paired by seed, scored by each arm's own engine "
            f"(no BF16-engine evaluation in these runs): largest {with_t(hi)}, smallest {with_t(lo)}.") in b14
    assert "Training effect" not in b14 and "Final accuracy (avg@k, mean" in b14
    # the figure in the report says the same
    fig_csv = pd.read_csv(tmp_path / "rep" / "figures" / "eval_accuracy.csv")
    assert dict(zip(fig_csv["model"], fig_csv["scored_by"], strict=True)) == {"8b": "bf16", "14b": "own"}
