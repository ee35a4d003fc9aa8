"""Cluster profiles, the status table, the progress line, sacct parsing, Ray readiness polling."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from fp8rl.backends.openrlhf.ray_cluster import ClusterState, RayBootstrapError, wait_for_cluster
from fp8rl.launch.profiles import PROFILES_DIR, ProfileError, Resources, load_profile, parse_profile
from fp8rl.launch.slurm import _expand
from fp8rl.runs import Cell, RunDir, write_manifest


def test_launch_example_profile_resources_per_slot():
    p = load_profile("example")
    assert p.partition == "gpu" and p.account == "my_project" and p.array_parallelism == 8
    assert p.resources_for("8b") == Resources(nodes=1, gpus_per_node=8, cpus_per_task=64, mem_gb=512, time_min=2880)
    assert p.resources_for("32b").nodes == 4 and p.resources_for("32b").gpus_per_node == 8
    params = p.executor_parameters(p.resources_for("14b"))
    assert params["nodes"] == 2 and params["gpus_per_node"] == 8 and params["slurm_partition"] == "gpu"
    assert params["slurm_account"] == "my_project" and params["slurm_setup"][0].startswith("module load")
    assert params["slurm_array_parallelism"] == 8 and params["timeout_min"] == 2880
    assert p.executor_parameters(p.resources_for("8b"), array_parallelism=2)["slurm_array_parallelism"] == 2


def test_launch_profile_container_becomes_srun_args():
    raw = {"resources": {"default": {}}, "container": "nvcr.io/x:1", "container_mounts": "/d:/d"}
    p = parse_profile(raw, name="c", path="c.yaml")
    params = p.executor_parameters(p.resources_for("8b"))
    assert params["slurm_srun_args"] == ["--container-image=nvcr.io/x:1", "--container-mounts=/d:/d"]
    assert "slurm_python" not in params  # a constructor argument of submitit's executor
    assert p.python_command() == "python3"


@pytest.mark.parametrize(("raw", "msg"), [
    ([], "must be a mapping"),
    ({"resources": {"default": {}}, "partiton": "x"}, "unknown field(s) ['partiton']"),
    ({}, "'default' block"),
    ({"resources": {"default": {"nodes": 0}}}, "resources.default: resources.nodes must be an integer >= 1"),
    ({"resources": {"default": {}, "70b": {}}}, "resources.70b: unknown block"),
    ({"resources": {"default": {"gpus": 8}}}, "unknown field(s) ['gpus']"),
    ({"resources": {"default": {}}, "setup": "module load x"}, "setup must be a list"),
    ({"resources": {"default": {}}, "array_parallelism": 0}, "array_parallelism must be an integer >= 1"),
    ({"resources": {"default": {"gpus_per_node": -1}}}, "gpus_per_node must be an integer >= 0"),
])
def test_launch_bad_profiles_are_refused(raw, msg):
    with pytest.raises(ProfileError, match=None) as e:
        parse_profile(raw, name="p", path="p.yaml")
    assert msg in str(e.value)


def test_launch_missing_profile_lists_available():
    with pytest.raises(ProfileError) as e:
        load_profile("nope")
    assert "example" in str(e.value) and "local" in str(e.value)
    assert {"example", "local"} <= {p.stem for p in PROFILES_DIR.glob("*.yaml")}


def test_launch_sacct_array_ranges_expand():
    assert _expand("12_[0-2,5%2]") == ["12_0", "12_1", "12_2", "12_5"]
    assert _expand("12_3") == ["12_3"]


def _sweep(tmp_path: Path) -> Path:
    sweep = tmp_path / "s"
    cells = []
    for i, state in enumerate(["DONE", "FAILED", "RUNNING", None]):
        name = f"grpo-8b-bf16-vanilla-s{i}"
        run = f"{name}-0000000{i}"
        cells.append(Cell(name=name, hash=f"0000000{i}", run_dir=run,
                          axes={"algorithm": "grpo", "model": "8b", "fp8": "bf16", "clip": "vanilla",
                                "seed": i, "scale": "mini"}, overrides=(f"seed={i}",)))
        if state is None:
            continue
        rd = RunDir(sweep / run).init({"steps": 4})
        w = rd.metrics_writer()
        for step in range(1, 5 if state == "DONE" else 2):  # a DONE run holds every step's row
            w.write({"step": step, "rollout/reward_mean": 0.25 * (i + 1), "actor/entropy": 1.5})
        w.close()
        rd.set_status(state, 1 if state != "DONE" else 4, reason="diverged at step 1" if state == "FAILED" else None)
    write_manifest(sweep, "s", cells)
    return sweep


def test_launch_status_table(tmp_path, capsys):
    from experiments.status import main
    from fp8rl.launch.status import failed_cells, format_table, sweep_status

    sweep = _sweep(tmp_path)
    rows = sweep_status(sweep, query_slurm=False)
    assert [r.state for r in rows] == ["DONE", "FAILED", "RUNNING", "MISSING"]
    assert rows[0].step == 4 and rows[0].steps == 4 and rows[1].reward == 0.5 and rows[0].entropy == 1.5
    table = format_table(rows)
    assert "4 cells: 1 DONE, 1 FAILED, 1 MISSING, 1 RUNNING" in table
    assert failed_cells(rows) == [("grpo-8b-bf16-vanilla-s1-00000001", "diverged at step 1")]
    assert main([str(sweep), "--no-slurm"]) == 1
    out = capsys.readouterr().out
    assert "FAILED, DIED or DAMAGED cells (1)" in out and "diverged at step 1" in out
    assert main([str(sweep), "--no-slurm", "--json"]) == 1
    assert len(json.loads(capsys.readouterr().out)) == 4
    assert main([str(tmp_path / "nowhere")]) == 1


def test_launch_status_marks_jobs_dead_outside_python(tmp_path, monkeypatch):
    """A Slurm task that ended FAILED while its run still says RUNNING is FAILED, with Slurm's reason."""
    import fp8rl.launch.slurm as slurm
    from fp8rl.launch.status import sweep_status

    sweep = _sweep(tmp_path)
    man = json.loads((sweep / "manifest.json").read_text())
    for i, c in enumerate(man["cells"]):
        c["job_id"] = f"7_{i}"
    (sweep / "manifest.json").write_text(json.dumps(man))
    monkeypatch.setattr(slurm, "job_states", lambda ids: {
        "7_0": {"state": "COMPLETED", "exit_code": "0:0", "reason": ""},
        "7_2": {"state": "OUT_OF_MEMORY", "exit_code": "0:125", "reason": ""},
        "7_3": {"state": "PENDING", "exit_code": "0:0", "reason": ""}})
    rows = sweep_status(sweep)
    assert [r.state for r in rows] == ["DONE", "FAILED", "FAILED", "MISSING"]
    assert "Slurm OUT_OF_MEMORY" in rows[2].reason and rows[3].slurm_state == "PENDING"


def test_launch_progress_line_counts_steps_and_eta(tmp_path):
    from fp8rl.launch.progress import SweepProgress

    cells = []
    for i, state in enumerate(["DONE", "RUNNING", None]):
        rd = RunDir(tmp_path / f"grpo-8b-bf16-vanilla-s{i}-0000000{i}")
        if state:
            rd.set_status(state, 4 if state == "DONE" else 1)
        cells.append(SimpleNamespace(run_dir=rd.path, steps=4, index=i + 1, total=3))
    buf = io.StringIO()
    prog = SweepProgress(cells, name="t", stream=buf)
    assert prog.done_steps()[:3] == (5, 1, 0)
    RunDir(cells[1].run_dir).set_status("RUNNING", 2)
    prog.line()  # the first step seen: the rate is timed from here
    RunDir(cells[1].run_dir).set_status("RUNNING", 3)
    text, _ = prog.line()
    assert text.startswith("[t] 1/3 cells finished | cell 2/3 grpo-8b-bf16-vanilla-s1-00000001 step 3/4")
    assert "ETA" in text and "ETA ?" not in text  # a step timed: a rate exists
    prog.show(force=True)
    assert buf.getvalue().count("\n") == 1


def test_launch_eta_excludes_the_warm_start_and_is_never_negative(tmp_path, monkeypatch):
    """Issue 32, defect 5: a minute of warm start, then 1 step / 5 s; then a cell restarts from
    step 0. The ETA is unknown during the warm start, then the remaining steps at 5 s each (not
    diluted by the warm start), and never negative, in the line and in the terminal bar."""
    import fp8rl.launch.progress as P

    now = [0.0]
    monkeypatch.setattr(P.time, "monotonic", lambda: now[0])
    cells = []
    for i in range(2):
        (tmp_path / f"c{i}").mkdir()  # set up, no status yet: the backend is warm-starting
        cells.append(SimpleNamespace(run_dir=tmp_path / f"c{i}", steps=10, index=i + 1, total=2))
    buf = io.StringIO()
    prog = P.SweepProgress(cells, name="t", stream=buf)
    prog.tty = True
    prog._bar = prog._make_bar()

    def eta_of_bar() -> str:
        prog._update_bar()
        return prog._bar.postfix

    now[0] = 60.0
    assert "ETA ?" in prog.line()[0] and "preparing (warm start)" in prog.line()[0]
    assert eta_of_bar().startswith("ETA after the warm start")
    RunDir(cells[0].run_dir).set_status("RUNNING", 1)
    prog.line()
    now[0] = 70.0
    RunDir(cells[0].run_dir).set_status("RUNNING", 3)  # 2 steps in 10 s
    assert prog._eta(3)[1] == pytest.approx((20 - 3) * 5.0)  # the warm start's minute is not in it
    RunDir(cells[0].run_dir).set_status("RUNNING", 0)  # restarted from step 0 (no checkpoint)
    for t in (80.0, 90.0, 4000.0):
        now[0] = t
        eta = prog._eta(prog.done_steps()[0])[1]
        assert eta is not None and eta >= 0
        assert "-" not in eta_of_bar().split(",")[0], eta_of_bar()
    prog._bar.close()


def test_launch_ray_readiness_waits_for_every_node_and_gpu():
    states = iter([None, ClusterState(("a",), 8), ClusterState(("a", "b"), 8), ClusterState(("a", "b"), 16)])
    t = [0.0]
    got = wait_for_cluster(lambda: next(states), nodes=2, gpus=16, deadline_s=100, poll_s=1,
                           clock=lambda: t[0], sleep=lambda s: t.__setitem__(0, t[0] + s))
    assert got == ClusterState(("a", "b"), 16) and t[0] == 3


def test_launch_ray_readiness_deadline_names_what_is_missing():
    t = [0.0]
    with pytest.raises(RayBootstrapError) as e:
        wait_for_cluster(lambda: ClusterState(("a",), 8), nodes=2, gpus=16, deadline_s=5, poll_s=1,
                         expected_hosts=["a", "b"], clock=lambda: t[0], sleep=lambda s: t.__setitem__(0, t[0] + s))
    assert "1/2 nodes and 8/16 GPUs" in str(e.value) and "missing hosts: b" in str(e.value)
    with pytest.raises(RayBootstrapError, match="head did not answer"):
        wait_for_cluster(lambda: None, nodes=1, gpus=0, deadline_s=2, poll_s=1,
                         clock=lambda: t[0], sleep=lambda s: t.__setitem__(0, t[0] + s))


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere(tmp_path):
    import io
    from types import SimpleNamespace

    from fp8rl.launch.progress import SweepProgress
    from fp8rl.runs import RunDir

    cells = [SimpleNamespace(run_dir=tmp_path / f"r{i}", steps=10, index=i + 1, total=2) for i in range(2)]
    RunDir(cells[0].run_dir).set_status("DONE", 10)
    RunDir(cells[1].run_dir).set_status("RUNNING", 5)

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, log = Tty(), io.StringIO()
    with SweepProgress(cells, name="s", stream=tty, interval_s=60):
        pass
    SweepProgress(cells, name="s", stream=log).show(force=True)
    assert "\r" in tty.getvalue() and "s 1/2 cells  75%|" in tty.getvalue()  # a tqdm bar
    assert "#2 step 5/10" in tty.getvalue()
    assert log.getvalue().startswith("[s] 1/2 cells finished | cell 2/2 r1 step 5/10 | elapsed")
    assert log.getvalue().endswith("\n") and "\r" not in log.getvalue()


def test_ray_bootstrap_writes_to_the_stderr_of_its_call_not_of_its_import(monkeypatch, tmp_path):
    """A launcher worker runs cells one after another, each with stderr captured into its own run
    log and closed after it; the bootstrap's default log is the stderr in force when it is called
    (bound at import, the second cell of a worker wrote to the first cell's closed log)."""
    import io

    from fp8rl.backends.openrlhf import (
        ray_cluster,  # imported with another stderr in force (pytest's)
    )

    now = io.StringIO()
    monkeypatch.setattr(ray_cluster.sys, "stderr", now)
    fake_ray = tmp_path / "ray"
    fake_ray.write_text("#!/bin/sh\nexit 1\n")
    fake_ray.chmod(0o755)
    with pytest.raises(ray_cluster.RayBootstrapError, match="did not answer"):
        ray_cluster.bootstrap(["true"], gpus_per_node=1, ray_bin=str(fake_ray), deadline_s=1)
    assert "[ray_bootstrap] head" in now.getvalue()
