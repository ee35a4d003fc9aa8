"""Pooling (issue 32, defect 2): runs of different sweeps, commits or CPU numerics are refused or
reported separately, as the user chooses (``--separate``, ``--pool``); unfinished runs stay out of
the headline ratios and are named where they count (``analysis.pooling``)."""

import json

import pandas as pd
import pytest

from analysis.collect import collect
from analysis.pooling import finished, groups
from analysis.report import main
from fp8rl.runs.synthetic import RunSpec, make_sweep

STEPS = 30


def _sweep(path, name, seeds=(0, 1, 2), extra=()):
    specs = [RunSpec(fp8=f, clip="vanilla", seed=s, steps=STEPS, clipfrac_neg_low=c, noise=0.0,
                     eval={"aime24": 0.3, "math500": 0.6}, eval_every=10)
             for f, c in (("bf16", 0.002), ("tensorwise", 0.010)) for s in seeds]
    make_sweep(path, [*specs, *extra], sweep=name)
    return path


def _provenance(run_dir, sha, flags, dirty=False):
    (run_dir / "provenance.json").write_text(json.dumps(
        {"git": {"sha": sha, "dirty": dirty}, "device": "cpu x1",
         "cpu": {"model": "Some CPU", "flags": flags}}))


def test_two_sweeps_are_refused_and_the_message_names_the_groups_and_the_flags(tmp_path, capsys):
    a = _sweep(tmp_path / "a", "alpha")
    b = _sweep(tmp_path / "b", "beta")
    assert main([str(a), str(b), "--out", str(tmp_path / "rep"), "--no-progress", "--no-cache",
                 "--figures", "entropy"]) == 3
    err = capsys.readouterr().err
    assert "refusing to pool runs of 2 groups" in err
    assert "alpha · code not recorded · CPU not recorded: 6 runs" in err and "beta ·" in err
    assert "--separate" in err and "--pool" in err
    assert not (tmp_path / "rep" / "report.md").exists()


def test_separate_writes_one_report_per_group(tmp_path):
    a, b = _sweep(tmp_path / "a", "alpha"), _sweep(tmp_path / "b", "beta")
    out = tmp_path / "rep"
    assert main([str(a), str(b), "--out", str(out), "--no-progress", "--no-cache", "--figures", "entropy",
                 "--separate"]) == 0
    for name in ("alpha", "beta"):
        text = (out / name / "report.md").read_text()
        assert f"# Report: {name}\n" in text
        assert f"All 6 runs come from one sweep, one commit and one CPU: {name} ·" in text


def test_pool_says_so_in_the_report(tmp_path):
    a, b = _sweep(tmp_path / "a", "alpha"), _sweep(tmp_path / "b", "beta")
    out = tmp_path / "rep"
    assert main([str(a), str(b), "--out", str(out), "--no-progress", "--no-cache", "--figures", "entropy",
                 "--pool"]) == 0
    text = (out / "report.md").read_text()
    assert "**Pooled knowingly (`--pool`)**: these runs come from 2 groups" in text
    assert "- alpha · code not recorded · CPU not recorded: 6 runs" in text


def test_one_sweep_of_two_commits_or_two_cpus_is_two_groups(tmp_path, capsys):
    sw = _sweep(tmp_path / "s", "gamma")
    runs = sorted(p for p in sw.iterdir() if p.is_dir())
    for r in runs:
        _provenance(r, "a" * 40, ["avx2", "fma"])
    assert len(groups(collect(sw))) == 1
    _provenance(runs[0], "b" * 40, ["avx2", "fma"])
    _provenance(runs[1], "a" * 40, ["avx2", "fma", "avx512f"])
    g = groups(collect(sw))
    assert sorted(zip(g["code"], g["cpu"], g["runs"], strict=True)) == [
        ("aaaaaaa", "Some CPU (avx2 fma avx512f)", 1), ("aaaaaaa", "Some CPU (avx2 fma)", 4),
        ("bbbbbbb", "Some CPU (avx2 fma)", 1)]
    assert main([str(sw), "--out", str(tmp_path / "rep"), "--no-progress", "--no-cache",
                 "--figures", "entropy"]) == 3
    assert "refusing to pool runs of 3 groups" in capsys.readouterr().err


def test_a_done_run_short_of_its_configured_steps_is_incomplete(tmp_path):
    sw = _sweep(tmp_path / "s", "delta", seeds=(0,))
    run = next(p for p in sw.iterdir() if p.name.startswith("grpo-8b-tensorwise"))
    with open(run / "config.yaml", "a") as f:
        f.write("steps: 200\n")
    r = collect(sw).runs.set_index("run").loc[run.name]
    assert r["cell"] == "incomplete" and r["state"] == "DONE"
    assert r["reason"] == f"DONE at step {STEPS - 1} of the 200 its config.yaml asks for"


def test_an_unfinished_run_stays_out_of_the_headline_ratio_and_is_named(tmp_path):
    """A one-step PREEMPTED FP8 run that logged no A<0 tokens below the bound: with it, the
    FP8 arm's x BF16 would drop from 5.0x; without it, it is the finished runs' 5.0x."""
    short = RunSpec(fp8="tensorwise", clip="vanilla", seed=3, steps=2, clipfrac_neg_low=0.0, noise=0.0,
                    state="PREEMPTED")
    sw = _sweep(tmp_path / "s", "eps", extra=(short,))
    coll = collect(sw)
    assert len(finished(coll).runs) == 6
    out = tmp_path / "rep"
    assert main([str(sw), "--out", str(out), "--no-progress", "--no-cache", "--figures", "entropy"]) == 0
    mech = pd.read_csv(out / "tables" / "mechanism.csv").set_index("fp8")
    assert mech.loc["tensorwise", "x_bf16"] == pytest.approx(5.0, rel=0.02)
    assert mech.loc["tensorwise", "runs"] == 3
    text = (out / "report.md").read_text()
    assert "5.0x (FP8 tensorwise (vanilla))" in text
    name = next(p.name for p in sw.iterdir() if p.name.startswith("grpo-8b-tensorwise-vanilla-s3"))
    assert f"Unfinished runs are left out of this table and of every x BF16 ratio: {name}." in text
    assert f"{name} (PREEMPTED at step 1: synthetic preemption)" in text  # under the diagnostics table
