"""The BF16-evaluated accuracy (``eval_bf16/`` keys): collected apart from the arm's own engine,
its accuracy and paired tables, the training effect with its interval, and runs without it
reading exactly as before."""

import math
import statistics

import numpy as np

from analysis.collect import collect, final_evals
from analysis.paired import mean_interval, paired_accuracy_table, run_gains, training_effect_lines
from analysis.report import write_report
from analysis.tables import accuracy_table
from fp8rl.runs import metrics as M
from fp8rl.runs.synthetic import RunSpec, make_sweep

# final avg@k per (fp8, seed): the arm's own engine, and a BF16 engine on the same weights; the
# synthetic writer puts step 0 at half the final value
OWN = {("bf16", 0): 0.60, ("bf16", 1): 0.64, ("bf16", 2): 0.70,
       ("tensorwise", 0): 0.50, ("tensorwise", 1): 0.62, ("tensorwise", 2): 0.60}
BF16 = {("bf16", 0): 0.60, ("bf16", 1): 0.64, ("bf16", 2): 0.70,
        ("tensorwise", 0): 0.58, ("tensorwise", 1): 0.66, ("tensorwise", 2): 0.68}
#: Student t, 97.5% quantile, 2 degrees of freedom (tables)
T975_DF2 = 4.302652729911275


def _sweep(tmp_path, name="s", bf16=True):
    specs = [RunSpec(fp8=f, seed=s, steps=20, eval={"arith": v}, eval_every=10,
                     eval_bf16={"arith": BF16[(f, s)]} if bf16 else {})
             for (f, s), v in OWN.items()]
    make_sweep(tmp_path / name, specs)
    return collect(tmp_path / name, workers=1, progress=False)


def test_the_two_engines_are_collected_apart(tmp_path):
    coll = _sweep(tmp_path)
    ev = coll.evals
    assert set(ev["precision"]) == {M.EVAL_OWN, M.EVAL_BF16}
    last = ev[(ev["step"] == 19) & (ev["stat"] == M.EVAL_AVG)]
    for (f, s), v in OWN.items():
        run = last[(last["fp8"] == f) & (last["seed"] == s)].set_index("precision")["value"]
        assert run[M.EVAL_OWN] == v and run[M.EVAL_BF16] == BF16[(f, s)]
    # the arm's own rows are those of the same runs written without the BF16 keys
    old = _sweep(tmp_path, "old", bf16=False).evals
    assert set(old["precision"]) == {M.EVAL_OWN}
    keep = ["step", "dataset", "stat", "k", "n", "value", "fp8", "seed"]
    own = ev[ev["precision"] == M.EVAL_OWN][keep].reset_index(drop=True)
    assert own.equals(old[keep].reset_index(drop=True))


def test_final_evals_and_the_accuracy_table_of_each_engine(tmp_path):
    coll = _sweep(tmp_path)
    for precision, finals in ((M.EVAL_OWN, OWN), (M.EVAL_BF16, BF16)):
        fe = final_evals(coll, precision=precision).set_index(["fp8", "seed"])
        assert (fe["source"] == "summary").all()
        for key, v in finals.items():
            assert fe.loc[key, "value"] == v
        t = accuracy_table(coll, precision=precision).data
        t = t[t["dataset"] == "arith"].set_index("fp8")
        for f in ("bf16", "tensorwise"):
            vals = [100 * finals[(f, s)] for s in range(3)]
            assert math.isclose(t.loc[f, "mean"], statistics.mean(vals), rel_tol=1e-12)
    md = accuracy_table(coll, precision=M.EVAL_BF16, name="accuracy_bf16").markdown
    assert "avg@k by a BF16 engine (%)" in md


def test_paired_gain_of_the_bf16_engine_with_its_interval(tmp_path):
    coll = _sweep(tmp_path)
    g = run_gains(coll, precision=M.EVAL_BF16).set_index(["fp8", "seed"])
    for key, v in BF16.items():
        assert math.isclose(g.loc[key, "gain"], v / 2, abs_tol=1e-12)
    t = paired_accuracy_table(coll, precision=M.EVAL_BF16, name="paired_accuracy_bf16").data.set_index("fp8")
    d = [BF16[("tensorwise", s)] / 2 - BF16[("bf16", s)] / 2 for s in range(3)]
    m, sd = statistics.mean(d), statistics.stdev(d)
    assert math.isclose(t.loc["tensorwise", "vs_bf16_mean"], m, abs_tol=1e-12)
    half = T975_DF2 * sd / math.sqrt(3)
    assert math.isclose(t.loc["tensorwise", "vs_bf16_lo"], m - half, rel_tol=1e-6)
    assert math.isclose(t.loc["tensorwise", "vs_bf16_hi"], m + half, rel_tol=1e-6)
    assert np.isnan(t.loc["bf16", "vs_bf16_lo"])  # the reference arm has no difference to itself
    own = paired_accuracy_table(coll).data.set_index("fp8")
    d_own = [OWN[("tensorwise", s)] / 2 - OWN[("bf16", s)] / 2 for s in range(3)]
    assert math.isclose(own.loc["tensorwise", "vs_bf16_mean"], statistics.mean(d_own), abs_tol=1e-12)
    assert "vs_bf16_lo" not in own.columns  # the arm's own table keeps its published layout
    lines = training_effect_lines(paired_accuracy_table(coll, precision=M.EVAL_BF16).data)
    assert lines[0].startswith("The training effect is the BF16-evaluated paired gain")
    assert f"FP8 tensorwise (vanilla) {100 * m:+.1f} [{100 * (m - half):+.1f}, {100 * (m + half):+.1f}] (3 seeds)" in lines[-1]


def test_mean_interval_edge_cases():
    assert all(np.isnan(v) for v in mean_interval([0.1]))
    assert mean_interval([0.25, 0.25, 0.25]) == (0.25, 0.25)  # no spread: the mean
    lo, hi = mean_interval([1.0, 2.0, 3.0])
    assert math.isclose(hi - 2.0, T975_DF2 / math.sqrt(3), rel_tol=1e-6) and math.isclose(lo + hi, 4.0)


def test_the_report_shows_both_engines_and_states_the_training_effect(tmp_path):
    with_bf16, without = _sweep(tmp_path, "with"), _sweep(tmp_path, "without", bf16=False)
    a = write_report(with_bf16, tmp_path / "ra", figures=[]).read_text()
    b = write_report(without, tmp_path / "rb", figures=[]).read_text()
    assert "the training effect is the bf16-evaluated paired gain" in a.lower()
    assert "Training effect (the BF16-evaluated paired gain" in a  # the summary at the top
    assert "Scored by a BF16 engine" in a and "BF16" in a
    for name in ("accuracy_bf16", "paired_accuracy_bf16"):
        assert (tmp_path / "ra" / "tables" / f"{name}.csv").is_file()
        assert not (tmp_path / "rb" / "tables" / f"{name}.csv").exists()
    assert "BF16-evaluated" not in b and "BF16 engine" not in b
    # the arm's own tables do not depend on whether the BF16 engine also scored the runs
    for name in ("accuracy", "paired_accuracy", "trajectory"):
        for ext in ("md", "csv", "tex"):
            assert ((tmp_path / "ra" / "tables" / f"{name}.{ext}").read_bytes()
                    == (tmp_path / "rb" / "tables" / f"{name}.{ext}").read_bytes()), f"{name}.{ext}"
