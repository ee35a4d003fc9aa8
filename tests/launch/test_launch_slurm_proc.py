"""The launcher against the real local Slurm cluster (``slurm/local_cluster.sh``).

Skipped without a cluster, failed under CI (``FP8RL_REQUIRE_SLURM``). Each test polls with its
own deadline and cancels its jobs on the way out.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp8rl.runs import RunDir, read_manifest

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster"), pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def _sacct(job_ids: list[str]) -> dict[str, str]:
    from fp8rl.launch.slurm import job_states

    return {j: s["state"] for j, s in job_states(job_ids).items()}


def _wait(pred, timeout_s: float, what: str, job_ids=(), poll_s: float = 0.5):
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            if job_ids:
                subprocess.run(["scancel", *{j.split("_")[0] for j in job_ids}], check=False)
            pytest.fail(f"{what} not reached after {timeout_s:.0f} s (sacct: {_sacct(list(job_ids))})")
        time.sleep(poll_s)


def _job_ids(sweep: Path) -> list[str]:
    return [c.job_id for c in read_manifest(sweep).cells]


def _all_final(sweep: Path) -> bool:
    ids = _job_ids(sweep)
    st = _sacct(ids)
    return len(st) == len(ids) and all(s in ("COMPLETED", "FAILED") for s in st.values())


@pytest.fixture
def cancel_jobs():
    ids: list[str] = []
    yield ids
    if ids:
        subprocess.run(["scancel", *{j.split("_")[0] for j in ids}], check=False, capture_output=True)


def test_launch_slurm_smoke_array_done_and_relaunch_submits_nothing(launch, tmp_path, cancel_jobs):
    root = tmp_path / "runs"
    t0 = time.monotonic()
    res = launch("+sweep=smoke", "launcher=slurm", "cluster=local", f"output_dir={root}")
    submit_s = time.monotonic() - t0
    assert res.code == 0, res.err
    assert "submitted 4 cell(s) as Slurm array job(s)" in res.err
    sweep = root / "smoke"
    ids = _job_ids(sweep)
    cancel_jobs.extend(ids)
    assert len(ids) == 4 and len({i.split("_")[0] for i in ids}) == 1  # one array
    assert sorted(i.split("_")[1] for i in ids) == ["0", "1", "2", "3"]
    assert submit_s < 60  # submit-and-return: far less than the runs take
    _wait(lambda: _all_final(sweep), 400, "all array tasks final", ids)
    assert set(_sacct(ids).values()) == {"COMPLETED"}
    man = read_manifest(sweep)
    for c in man.cells:
        rd = RunDir(man.run_path(c))
        assert rd.state == "DONE"
        assert [r["step"] for r in rd.read_metrics()] == [1, 2, 3, 4]
        assert rd.provenance()["slurm"]["SLURM_ARRAY_JOB_ID"] == c.job_id.split("_")[0]

    from experiments.status import main as status_main

    assert status_main([str(sweep)]) == 0

    res = launch("+sweep=smoke", "launcher=slurm", "cluster=local", f"output_dir={root}")
    assert res.code == 0 and "4 DONE (skipped)" in res.err and "nothing to do" in res.err
    assert "submitted" not in res.err and _job_ids(sweep) == ids


def test_launch_slurm_failing_cell_is_failed_with_reason(launch, tmp_path, cancel_jobs, capsys):
    root = tmp_path / "runs"
    res = launch("+sweep=smoke", "fp8=bf16", "clip=vanilla", "mini.device=cpu,cuda", "launcher=slurm",
                 "cluster=local", f"output_dir={root}")
    assert res.code == 0, res.err
    sweep = root / "smoke"
    ids = _job_ids(sweep)
    cancel_jobs.extend(ids)
    _wait(lambda: _all_final(sweep), 300, "both tasks final", ids)
    man = read_manifest(sweep)
    by_dev = {RunDir(man.run_path(c)).config()["mini"]["device"]: c for c in man.cells}
    ok, bad = by_dev["cpu"], by_dev["cuda"]
    assert RunDir(man.run_path(ok)).state == "DONE"
    st = RunDir(man.run_path(bad)).status()
    assert st["state"] == "FAILED" and "cuda" in st["reason"].lower()
    assert _sacct([ok.job_id, bad.job_id]) == {ok.job_id: "COMPLETED", bad.job_id: "FAILED"}

    from experiments.status import main as status_main

    capsys.readouterr()
    assert status_main([str(sweep)]) == 1
    out = capsys.readouterr().out
    assert "FAILED, DIED or DAMAGED cells (1)" in out and bad.run_dir in out and "FAILED" in out


def test_launch_slurm_requeue_resumes_from_checkpoint(launch, tmp_path, cancel_jobs):
    root = tmp_path / "runs"
    # the task ignores SIGTERM for KillWait (5 s) after the requeue: keep >= ~80 steps to go
    steps = 150
    res = launch("+sweep=smoke", "fp8=bf16", "clip=vanilla", f"steps={steps}", "checkpoint_every=2",
                 "launcher=slurm", "cluster=local", f"output_dir={root}")
    assert res.code == 0, res.err
    sweep = root / "smoke"
    (job_id,) = _job_ids(sweep)
    cancel_jobs.append(job_id)
    rd = RunDir(read_manifest(sweep).run_path(read_manifest(sweep).cells[0]))

    def mid_run() -> bool:
        st = rd.status() if rd.status_path.exists() else None
        return bool(st) and st["state"] == "RUNNING" and 6 <= st["step"] < steps - 80
    _wait(mid_run, 240, "the run past step 6", [job_id], poll_s=0.1)
    at = rd.status()["step"]
    subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True, text=True)
    def resumed_and_done() -> bool:
        prov = rd.provenance() or {}
        return (rd.state == "DONE" and bool(prov.get("previous_attempts"))
                and _sacct([job_id]).get(job_id) == "COMPLETED")
    _wait(resumed_and_done, 300, "the requeued task to resume and finish", [job_id])
    logged = [r["step"] for r in rd.read_metrics()]
    assert logged == list(range(1, steps + 1)), f"requeued at step {at}: {logged}"
    prov = rd.provenance()
    assert len(prov["previous_attempts"]) >= 1  # a second attempt ran and resumed
    assert prov["slurm"].get("SLURM_RESTART_COUNT") == "1"


def _plan(args: list[str]):
    """The validated plan of an ``experiments.launch`` command line (Hydra's own composition)."""
    from fp8rl.launch.grid import plan_command

    return plan_command(args)


def test_duplicate_submission_runs_each_step_once(tmp_path, cancel_jobs):
    """The same cell submitted as two Slurm jobs at once: one task runs it, the other finds the
    run owned by the first (``fp8rl.runs.lock``) or already DONE and ends cleanly; every step is
    in metrics.jsonl once, written by one attempt."""
    import submitit

    from fp8rl.launch.job import CellJob

    plan = _plan(["+sweep=smoke", "fp8=bf16", "clip=vanilla", "steps=40", f"output_dir={tmp_path}/runs"])
    (cell,) = plan.cells
    ex = submitit.AutoExecutor(folder=tmp_path / "submitit" / "%j", cluster="slurm")
    ex.update_parameters(timeout_min=20, cpus_per_task=1, nodes=1, tasks_per_node=1)
    jobs = [ex.submit(CellJob(), cell.payload()) for _ in range(2)]
    ids = [j.job_id for j in jobs]
    cancel_jobs.extend(ids)
    results = [j.result() for j in jobs]
    rd = RunDir(cell.run_dir)
    assert rd.state == "DONE"
    assert [r["step"] for r in rd.read_metrics()] == list(range(1, 41))
    assert sum(1 for r in results if not r.get("skipped")) == 1  # exactly one task ran it
    owned = [r for r in results if r.get("owned_by")]
    for r in owned:
        assert "running elsewhere" in r["reason"] and "Slurm job" in r["owned_by"]
    assert rd.provenance()["previous_attempts"] == []  # one attempt wrote the run
    _wait(lambda: set(_sacct(ids).values()) == {"COMPLETED"}, 60, "both tasks COMPLETED in sacct", ids)


@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="ray is not installed (it is in the cluster extra; see docs/launch.md)")
def test_launch_slurm_ray_bootstrap_one_node(tmp_path, cancel_jobs):
    """A one-node Ray inside a real Slurm job, torn down with the job -- and only its own Ray:
    another Ray on the same node (another user's, another cell's) keeps running."""
    import shutil
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray_bin = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    bystander = subprocess.Popen([ray_bin, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                                  "--num-cpus=1", "--block", "--disable-usage-stats", "--include-dashboard=false"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _test_bootstrap_job(tmp_path, cancel_jobs)
        assert bystander.poll() is None, "the job's teardown stopped another Ray on the node"
    finally:
        os.killpg(bystander.pid, signal.SIGTERM)
        bystander.wait(timeout=60)


def _test_bootstrap_job(tmp_path, cancel_jobs):
    out = tmp_path / "ray.out"
    driver = "import ray; ray.init(); print('RAY_RESOURCES', ray.cluster_resources().get('CPU'))"
    wrap = (f"{sys.executable} {REPO / 'slurm' / 'ray_bootstrap.py'} --gpus-per-node 0 --deadline-s 180 "
            f"-- {sys.executable} -c \"{driver}\"")
    sub = subprocess.run(["sbatch", "--parsable", "-N1", "-n1", "-c2", "--time=10", f"--output={out}",
                          f"--chdir={tmp_path}", "--wrap", wrap], check=True, capture_output=True, text=True,
                         env={**os.environ})
    job_id = sub.stdout.strip().split(";")[0]
    cancel_jobs.append(job_id)
    _wait(lambda: _sacct([job_id]).get(job_id) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300,
          "the Ray job to end", [job_id])
    text = out.read_text()
    assert _sacct([job_id])[job_id] == "COMPLETED", text[-3000:]
    assert "ready: 1 node(s), 0 GPU(s)" in text and "RAY_RESOURCES" in text and "Ray stopped" in text
