"""Real local runs of tiny cells: run, manifest, relaunch skips DONE, re-runs what is not DONE."""

from __future__ import annotations

import json

import pytest

from fp8rl.runs import RunDir, read_manifest

SMOKE2 = ["+sweep=smoke", "fp8=bf16", "clip=vanilla,calibrated"]


def test_launch_local_sweep_runs_skips_and_reruns(launch, snapshot, tmp_path):
    """Which cells run is the sweep's decision, before any launcher: the cells run in this process
    (``workers=1``; the worker pool has its own tests below) and the test starts no interpreter."""
    root = tmp_path / "runs"
    res = launch(*SMOKE2, "workers=1", f"output_dir={root}")
    assert res.code == 0, res.err
    assert "2 to run" in res.err and "cells finished" in res.err  # progress display
    man = read_manifest(root / "smoke")
    assert len(man.cells) == 2
    for c in man.cells:
        rd = RunDir(man.run_path(c))
        assert rd.state == "DONE", rd.status()
        assert [r["step"] for r in rd.read_metrics()] == [1, 2, 3, 4]
        assert c.axes["fp8"] == "bf16" and c.axes["scale"] == "mini" and c.job_id is None
        assert "fp8=bf16" in c.overrides
    runs_before = {k: v for k, v in snapshot(root / "smoke").items() if not k.startswith("manifest")}

    # relaunch: every cell DONE -> nothing runs, no run directory changes
    res = launch(*SMOKE2, "workers=1", f"output_dir={root}")
    assert res.code == 0 and "2 DONE (skipped)" in res.err and "nothing to do" in res.err
    assert {k: v for k, v in snapshot(root / "smoke").items() if not k.startswith("manifest")} == runs_before

    # a cell that is not DONE is run again; the DONE one is left alone
    redo = RunDir(man.run_path(man.cells[1]))
    keep = man.run_path(man.cells[0])
    redo.set_status("FAILED", 4, reason="pretend")
    keep_before = snapshot(keep)
    res = launch(*SMOKE2, "workers=1", f"output_dir={root}")
    assert res.code == 0, res.err
    assert "1 DONE (skipped)" in res.err and "1 to run" in res.err
    assert redo.state == "DONE" and snapshot(keep) == keep_before
    assert [r["step"] for r in redo.read_metrics()] == [1, 2, 3, 4]  # nothing logged twice


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_launch_local_failing_cell_is_reported_and_others_finish(launch, tmp_path, monkeypatch, capsys):
    """A cell that fails at run time is FAILED with its reason and the others finish. The failing
    cell asks for CUDA on a machine without it; the expand-time device check (``fp8rl.launch.checks``,
    which refuses that cell before anything runs) is lifted here so that the cell reaches its run, as
    a cell whose GPU went away would."""
    from fp8rl.launch import checks

    monkeypatch.setattr(checks, "_missing_device", lambda device: None)
    root = tmp_path / "runs"
    res = launch("+sweep=smoke", "fp8=bf16", "clip=vanilla", "mini.device=cpu,cuda", "progress=false",
                 f"output_dir={root}")
    assert res.code == 1
    man = read_manifest(root / "smoke")
    states = {c.run_dir: RunDir(man.run_path(c)).status() for c in man.cells}
    assert sorted(s["state"] for s in states.values()) == ["DONE", "FAILED"]
    failed = next(k for k, s in states.items() if s["state"] == "FAILED")
    assert "FAILED:" in res.err and failed in res.err
    reason = states[failed]["reason"]
    assert reason and ("CUDA" in reason or "cuda" in reason)

    # the cell's own log holds its error; the launcher and status point to it
    log = root / "smoke" / failed / "run.log"
    text = log.read_text()
    assert text.startswith("=== attempt 1, ") and "Traceback" in text and reason.split(":")[0] in text, text
    assert f"run log: {log}" in res.err

    from experiments.status import main as status_main

    capsys.readouterr()
    assert status_main([str(root / "smoke"), "--no-slurm"]) == 1
    out = capsys.readouterr().out
    assert f"{failed}: {reason}; run log: {log}" in out, out


def test_launch_manifest_keeps_cells_of_earlier_launches(launch, tmp_path):
    root = tmp_path / "runs"
    assert launch("+sweep=smoke", "fp8=bf16", "clip=vanilla", "progress=false", f"output_dir={root}").code == 0
    assert launch("+sweep=smoke", "fp8=bf16", "clip=tis", "progress=false", f"output_dir={root}").code == 0
    man = read_manifest(root / "smoke")
    assert sorted(c.axes["clip"] for c in man.cells) == ["tis", "vanilla"]
    json.loads((root / "smoke" / "manifest.json").read_text())


@pytest.mark.slow
def test_launch_local_parallel(launch, tmp_path):
    root = tmp_path / "runs"
    res = launch(*SMOKE2, "launcher=local_parallel", f"output_dir={root}")
    assert res.code == 0, res.err
    man = read_manifest(root / "smoke")
    assert all(RunDir(man.run_path(c)).state == "DONE" for c in man.cells)
    assert all(c.job_id for c in man.cells)


@pytest.mark.slow
def test_launch_no_overrides_runs_the_default_mini_run(tmp_path):
    """``python -m experiments.launch`` with nothing but a runs root: one full default run."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "experiments.launch", f"output_dir={tmp_path}/runs"],
                         capture_output=True, text=True, timeout=3600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    man = read_manifest(tmp_path / "runs" / "default")
    assert len(man.cells) == 1 and RunDir(man.run_path(man.cells[0])).state == "DONE"


def _numbers(sweep):
    """Every logged number of every cell, minus timings: what a run computed."""
    man = read_manifest(sweep)
    out = {}
    for c in man.cells:
        rd = RunDir(man.run_path(c))
        rows = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rd.read_metrics()]
        out[c.run_dir] = (rows, rd.read_eval(), rd.state)
    return out


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_workers_run_cells_side_by_side_with_the_same_numbers(launch, tmp_path):
    """The local launcher's worker pool changes when cells run, not what they compute."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = ["+sweep=smoke", "steps=3", "progress=false"]
    r1 = launch(*args, "workers=1", f"output_dir={one}")
    r2 = launch(*args, "workers=2", f"output_dir={two}")
    assert r1.code == 0 and r2.code == 0, r1.err + r2.err
    assert "running 4 cell(s) in this process" in r1.err
    assert "running 4 cell(s) 2 at a time in worker processes" in r2.err
    a, b = _numbers(one / "smoke"), _numbers(two / "smoke")
    assert set(a) == set(b) and all(v[2] == "DONE" for v in b.values())
    assert a == b


def test_workers_must_be_a_positive_count(launch, tmp_path):
    res = launch("+sweep=smoke", "workers=0", f"output_dir={tmp_path}/runs")
    assert res.code == 1 and "workers: 0 is not a number of worker processes" in res.err
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_pool_prepares_each_warm_start_once_before_the_cells(launch, tmp_path):
    """Two cells of one model slot on two workers: the SFT warm start is trained once (a
    preparation task is queued first; a cell that reaches the cache's lock first trains it and
    everyone else loads it)."""
    root = tmp_path / "runs"
    res = launch("+sweep=smoke", "fp8=bf16", "clip=vanilla,tis", "steps=2", "mini.sft_steps=20",
                 "workers=2", "progress=false", f"output_dir={root}")
    assert res.code == 0, res.err
    man = read_manifest(root / "smoke")
    hits = [RunDir(man.run_path(c)).summary()["sft"]["cache_hit"] for c in man.cells]
    assert hits.count(False) <= 1  # at most one of the cells trained it; usually the preparation
    cached = [p for p in (root / ".cache" / "sft").iterdir() if p.is_dir()]
    assert len(cached) == 1 and (cached[0] / "model.pt").exists()
