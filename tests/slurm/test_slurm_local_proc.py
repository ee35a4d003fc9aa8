"""The Slurm mechanics the launcher relies on, against the real local cluster.

Each test is bounded: it polls with its own deadline (cancelling its jobs on the way out)
and carries a pytest-timeout as a backstop, so a broken cluster fails instead of hanging.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def square_in_array_task(x: int) -> tuple[int, str | None, str | None]:
    """Job body: x squared, plus the Slurm array ids the task ran under."""
    return x * x, os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")


@pytest.fixture
def by_value():
    """Pickle this module's functions by value: the job's Python cannot import a test module."""
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(module)


def _executor(folder: Path, **params):
    submitit = pytest.importorskip("submitit")
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    executor.update_parameters(timeout_min=5, cpus_per_task=1, tasks_per_node=1, nodes=1, **params)
    return executor


def _wait_done(jobs, timeout_s: float, force_check: bool = False) -> float:
    """Poll until every submitit job is done; cancel them and fail after timeout_s.

    force_check=True asks sacct on every poll instead of submitit's back-off (0, 2, 4, 8,
    16 s ... after the last submission), which only matters for jobs that write no result.
    """
    t0 = time.monotonic()
    while not all(job.done(force_check=force_check) for job in jobs):
        if time.monotonic() - t0 > timeout_s:
            for job in jobs:
                job.cancel(check=False)
            states = {job.job_id: job.state for job in jobs}
            pytest.fail(f"jobs not done after {timeout_s:.0f} s: {states}")
        time.sleep(0.5)
    return time.monotonic() - t0


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout


def _sacct_states(job_id: str, n_expected: int = 1, timeout_s: float = 20.0) -> dict[str, str]:
    """Final sacct states of a job or its n_expected array tasks.

    sacct lags squeue by a few seconds (finished array tasks appear one by one).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        out = _run("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State")
        states = dict(line.split("|", 1) for line in out.splitlines() if line)
        pending = {"PENDING", "RUNNING", "REQUEUED", "COMPLETING"}
        final = not any(s.split()[0] in pending for s in states.values())
        if len(states) == n_expected and final:
            return states
        if time.monotonic() > deadline:
            pytest.fail(f"sacct still reports unfinished states for job {job_id}: {states}")
        time.sleep(0.5)


@pytest.mark.timeout(180)
def test_submitit_array_job_returns_every_result(tmp_path, by_value):
    inputs = [0, 1, 2, 3, 4]
    executor = _executor(tmp_path / "submitit", slurm_array_parallelism=2, name="fp8rl-test-array")
    jobs = executor.map_array(square_in_array_task, inputs)
    _wait_done(jobs, timeout_s=120)

    results = [job.result() for job in jobs]
    array_id = jobs[0].job_id.split("_")[0]
    assert [r[0] for r in results] == [x * x for x in inputs]
    assert {r[1] for r in results} == {array_id}, "tasks did not run as one array job"
    assert [r[2] for r in results] == [str(i) for i in range(len(inputs))]
    # One array, throttled as asked, and every task recorded as COMPLETED by accounting.
    submission = (tmp_path / "submitit").glob("*_submission.sh")
    assert any(f"--array=0-{len(inputs) - 1}%2" in p.read_text() for p in submission)
    states = _sacct_states(array_id, n_expected=len(inputs))
    assert sorted(states) == [f"{array_id}_{i}" for i in range(len(inputs))]
    assert set(states.values()) == {"COMPLETED"}


@pytest.mark.timeout(120)
def test_job_dying_outside_python_is_reported_failed(tmp_path):
    submitit = pytest.importorskip("submitit")
    # The setup line runs in the batch script before Python starts: no result file is ever
    # written, so only accounting (sacct) can tell submitit the job is over.
    executor = _executor(tmp_path / "submitit", slurm_setup=["exit 3"], name="fp8rl-test-dies")
    job = executor.submit(sum, [1, 2])
    elapsed = _wait_done([job], timeout_s=60, force_check=True)
    print(f"job {job.job_id} seen as done after {elapsed:.1f} s")

    assert job.state == "FAILED", f"state {job.state} after {elapsed:.1f} s"
    # result() then waits up to 15 s for a result file a slow shared filesystem might still
    # deliver; submitit's own tests set this to 0 too.
    job._results_timeout_s = 0
    with pytest.raises(submitit.core.utils.UncompletedJobError, match="state: FAILED"):
        job.result()
    assert _sacct_states(job.job_id) == {job.job_id: "FAILED"}


REQUEUE_SCRIPT = """#!/bin/bash
echo "start ${{SLURM_RESTART_COUNT:-0}}" >> {marker}
if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then echo finished >> {marker}; exit 0; fi
sleep 300
"""


def _wait_for_lines(marker: Path, want: list[str], timeout_s: float, job_id: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        lines = marker.read_text().splitlines() if marker.exists() else []
        if lines[: len(want)] == want:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"job {job_id}: marker lines {lines}, waited {timeout_s:.0f} s for {want}")
        time.sleep(0.25)


@pytest.mark.timeout(180)
def test_scontrol_requeue_runs_the_job_again(tmp_path):
    marker = tmp_path / "marker.txt"
    script = tmp_path / "requeue.sh"
    script.write_text(REQUEUE_SCRIPT.format(marker=marker))
    job_id = _run(
        "sbatch",
        "--parsable",
        "--requeue",
        "--time=5",
        "-c1",
        "--job-name=fp8rl-test-requeue",
        f"--output={tmp_path / 'slurm-%j.out'}",
        str(script),
    ).strip()
    try:
        _wait_for_lines(marker, ["start 0"], timeout_s=30, job_id=job_id)
        t0 = time.monotonic()
        _run("scontrol", "requeue", job_id)
        _wait_for_lines(marker, ["start 0", "start 1", "finished"], timeout_s=120, job_id=job_id)
        print(f"requeued job {job_id} ran again after {time.monotonic() - t0:.1f} s")
        assert _sacct_states(job_id) == {job_id: "COMPLETED"}
        info = _run("scontrol", "show", "job", "-o", job_id)
        assert "Restarts=1" in info.split(), info
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)


@pytest.mark.timeout(60)
def test_impossible_request_is_rejected_at_submit(tmp_path):
    # EnforcePartLimits=ALL: a request the node can never satisfy fails in sbatch (and so in
    # submitit) instead of pending forever; a satisfiable one on the same node is accepted.
    cpus = int(_run("sinfo", "-h", "-N", "-o", "%c").split()[0])
    out = str(tmp_path / "slurm-%j.out")
    for bad in ([f"--cpus-per-task={cpus + 1}"], ["--gpus-per-node=1"]):
        proc = subprocess.run(
            ["sbatch", "--parsable", f"--output={out}", *bad, "--wrap", "true"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert proc.returncode != 0, f"sbatch accepted {bad}: job {proc.stdout.strip()}"
        assert "error" in proc.stderr.lower(), proc.stderr
    job_id = _run(
        "sbatch",
        "--parsable",
        f"--output={out}",
        f"--cpus-per-task={cpus}",
        "--gpus-per-node=0",
        "--wrap",
        "true",
    ).strip()
    assert _sacct_states(job_id) == {job_id: "COMPLETED"}
