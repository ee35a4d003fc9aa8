"""``experiments.paper_smoke``'s preemption of a cell on Slurm, with stand-in ``squeue``/``scontrol``.

The real thing runs in ``make paper-smoke`` (the requeued task's second attempt, checked by
``tests/integration/test_int_paper_smoke.py``); here: the order of the Slurm calls. The array's
other pending tasks are held before the requeue (so the slot the kill frees goes back to the
requeued task), never the requeued task itself, and released once another attempt owns the run.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from experiments import paper_smoke


@pytest.fixture
def slurm_log(tmp_path, monkeypatch):
    """Stand-in ``squeue`` (pending tasks 8_2 and 8_3) and ``scontrol`` on PATH; returns the call log."""
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("squeue", 'echo "8_2"; echo "8_3"'), ("scontrol", "true")):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n{body}\n')
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def _run_dir(tmp_path: Path, since: str, array: str = "8_1") -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "owner.json").write_text(json.dumps({"pid": 1, "slurm_job_id": "9", "slurm_array": array, "since": since}))
    (run / "status.json").write_text(json.dumps({"state": "RUNNING", "step": 1}))
    return run


def test_the_requeued_task_gets_its_slot_back(tmp_path, slurm_log):
    run = _run_dir(tmp_path, "t0")
    what, held = paper_smoke.interrupt(run, slurm=True, log=print)
    assert held == ["8_2", "8_3"] and "scontrol requeue 8_1" in what
    calls = slurm_log.read_text().splitlines()
    assert calls == ["squeue -h -r -j 8 -t PENDING -o %i", "scontrol hold 8_2", "scontrol hold 8_3",
                     "scontrol requeue 8_1"]
    assert not paper_smoke.taken_over(run, "t0")  # the killed attempt still owns it
    _run_dir(tmp_path, "t1")  # the second attempt took the run over
    assert paper_smoke.taken_over(run, "t0")


def test_a_task_outside_an_array_is_requeued_alone(tmp_path, slurm_log):
    run = _run_dir(tmp_path, "t0", array=None)
    what, held = paper_smoke.interrupt(run, slurm=True, log=print)
    assert held == [] and what == "scontrol requeue 9"
    assert slurm_log.read_text().splitlines() == ["scontrol requeue 9"]


def test_the_interruption_waits_for_the_checkpointed_steps_metrics_line(tmp_path):
    """A checkpoint alone is not enough to interrupt: the resume never logs the checkpoint's step
    again, so its ``Global step N:`` line must have reached the driver log first (Ray forwards
    the trainer's output with a lag; a kill in between lost step 1's metrics)."""
    run = tmp_path / "run"
    actor = run / "checkpoint" / "deepspeed" / "_actor"
    (run / "openrlhf").mkdir(parents=True)
    assert not paper_smoke.has_checkpoint(run)
    (actor / "global_step1").mkdir(parents=True)
    log = run / "openrlhf" / "driver.1.log"
    log.write_text("Global step 0 is not a step\n")
    assert not paper_smoke.has_checkpoint(run)  # checkpoint written, its metrics line not yet
    log.write_text("... Global step 1: {'policy_loss': 0.1}\n")
    assert paper_smoke.has_checkpoint(run)
    (actor / "global_step2").mkdir()  # the earliest checkpoint's line is the one the resume skips
    assert paper_smoke.has_checkpoint(run)
