"""One owner per run, with real launcher processes: concurrent launches, kill -9, DIED, takeover.

Each test starts ``python -m experiments.launch`` as separate processes (as two terminals
would) on the smoke sweep, and checks the run directories afterwards: every step logged once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp8rl.runs import RunDir, read_manifest
from fp8rl.runs.lock import probe, read_owner

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "experiments.launch", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(pred, timeout_s: float, what: str) -> None:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"{what} not reached after {timeout_s:.0f} s")
        time.sleep(0.1)


def _steps(rd: RunDir) -> list[int]:
    return [r["step"] for r in rd.read_metrics()]


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_two_concurrent_launches_log_every_step_once(tmp_path):
    root = tmp_path / "runs"
    args = ["+sweep=smoke", "steps=12", "workers=1", "progress=false", f"output_dir={root}"]
    a, b = _start(*args), _start(*args)
    out_a, _ = a.communicate(timeout=500)
    out_b, _ = b.communicate(timeout=500)
    assert a.returncode == 0 and b.returncode == 0, out_a[-2000:] + out_b[-2000:]
    man = read_manifest(root / "smoke")
    assert len(man.cells) == 4
    for c in man.cells:
        rd = RunDir(man.run_path(c))
        assert rd.state == "DONE"
        assert _steps(rd) == list(range(1, 13)), c.run_dir
        assert [r["step"] for r in rd.read_eval()] == [0, 12]
    # the launchers met: one of them found a cell running in the other
    assert "running elsewhere" in out_a + out_b


# ``launcher`` starts six interpreters (~45 CPU s): the slow tier, which CI runs (make test-slow)
@pytest.mark.parametrize("kill", ["owner", pytest.param("launcher", marks=pytest.mark.slow)])
def test_killed_run_shows_died_and_next_launch_takes_over(tmp_path, kill, capsys):
    """``owner``: kill -9 the process that holds the run (here the launcher itself, one worker).
    ``launcher``: kill -9 a launcher with two worker processes; its workers die with it."""
    root = tmp_path / "runs"
    workers = 1 if kill == "owner" else 2
    clips = "vanilla" if workers == 1 else "vanilla,tis"  # two cells: a pool of two workers
    args = ["+sweep=smoke", "fp8=bf16", f"clip={clips}", "steps=80", "checkpoint_every=2",
            f"workers={workers}", "progress=false", f"output_dir={root}"]
    p = _start(*args)
    sweep = root / "smoke"

    def mid_run() -> bool:
        if not (sweep / "manifest.json").exists():
            return False
        st = RunDir(read_manifest(sweep).run_path(read_manifest(sweep).cells[0])).status()
        return bool(st) and st["state"] == "RUNNING" and st["step"] >= 6

    _wait_for(mid_run, 240, "the run past step 6")
    rd = RunDir(read_manifest(sweep).run_path(read_manifest(sweep).cells[0]))
    owner = read_owner(rd.path)
    assert owner is not None and (owner.pid == p.pid) == (workers == 1)
    os.kill(owner.pid if kill == "owner" else p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    _wait_for(lambda: not probe(rd.path)[0], 60, "the owner's lock to go")  # workers die with the launcher
    at = rd.status()["step"]
    assert rd.state == "RUNNING" and at < 80  # what it says on disk

    from experiments.status import main as status_main

    capsys.readouterr()
    assert status_main([str(sweep), "--no-slurm"]) == 1
    out = capsys.readouterr().out
    assert "DIED" in out and f"pid {owner.pid}" in out and "relaunch" in out

    res = subprocess.run([sys.executable, "-m", "experiments.launch", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=500)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"pid {owner.pid}" in res.stderr and "taking over" in res.stderr
    assert rd.state == "DONE"
    assert _steps(rd) == list(range(1, 81)), f"killed at step {at}"
    assert len(rd.provenance()["previous_attempts"]) == 1
    assert json.loads((rd.path / "owner.json").read_text())["released"] is not None
