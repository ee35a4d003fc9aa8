"""Real local runs of tiny cells: run, manifest, relaunch skips DONE, re-runs what is not DONE."""

from __future__ import annotations

import json

import pytest

from fp8rl.runs import RunDir, read_manifest

SMOKE2 = ["+sweep=smoke", "fp8=bf16", "clip=vanilla,calibrated"]


def test_launch_local_sweep_runs_skips_and_reruns(launch, snapshot, tmp_path):
    root = tmp_path / "runs"
    res = launch(*SMOKE2, f"output_dir={root}")
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
    res = launch(*SMOKE2, f"output_dir={root}")
    assert res.code == 0 and "2 DONE (skipped)" in res.err and "nothing to do" in res.err
    assert {k: v for k, v in snapshot(root / "smoke").items() if not k.startswith("manifest")} == runs_before

    # a cell that is not DONE is run again; the DONE one is left alone
    redo = RunDir(man.run_path(man.cells[1]))
    keep = man.run_path(man.cells[0])
    redo.set_status("FAILED", 4, reason="pretend")
    keep_before = snapshot(keep)
    res = launch(*SMOKE2, f"output_dir={root}")
    assert res.code == 0, res.err
    assert "1 DONE (skipped)" in res.err and "1 to run" in res.err
    assert redo.state == "DONE" and snapshot(keep) == keep_before
    assert [r["step"] for r in redo.read_metrics()] == [1, 2, 3, 4]  # nothing logged twice


def test_launch_local_failing_cell_is_reported_and_others_finish(launch, tmp_path):
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

    from experiments.status import main as status_main

    assert status_main([str(root / "smoke"), "--no-slurm"]) == 1


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
