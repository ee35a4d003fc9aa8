"""Ctrl-C with a real launcher process: running cells stop at a safe point, one summary (DONE,
resumable, not started, the command that resumes), exit status 130, no traceback, no bar control
characters on a pipe; the printed command finishes the sweep with every step logged once.
A second Ctrl-C stops at once; the sweep still resumes."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp8rl.runs import RunDir, read_manifest

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
STEPS = 20


def _args(root: Path, workers: int) -> list[str]:
    # no periodic checkpoint: the one a stopped cell has is the one it wrote when it stopped
    return ["+sweep=smoke", "fp8=bf16", "clip=vanilla,tis", f"steps={STEPS}", "checkpoint_every=0",
            f"workers={workers}", f"output_dir={root}"]


def _furthest(sweep: Path) -> int:
    best = 0
    for p in sweep.glob("*/status.json"):
        st = RunDir(p.parent).status() or {}
        if st.get("state") == "RUNNING":
            best = max(best, int(st.get("step") or 0))
    return best


def _interrupt(root: Path, workers: int, signals: int) -> tuple[int, str]:
    p = subprocess.Popen([sys.executable, "-m", "experiments.launch", *_args(root, workers)], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    while _furthest(root / "smoke") < 3:
        if p.poll() is not None or time.monotonic() - t0 > 300:
            p.kill()
            pytest.fail(f"no cell reached step 3: {p.communicate()[0][-3000:]}")
        time.sleep(0.1)
    for _ in range(signals):
        p.send_signal(signal.SIGINT)
        time.sleep(0.3)
    out, _ = p.communicate(timeout=300)
    return p.returncode, out


def _resume(out: str) -> subprocess.CompletedProcess:
    (line,) = [x for x in out.splitlines() if x.startswith("resume with: ")]
    cmd = shlex.split(line.removeprefix("resume with: "))
    assert cmd[1:3] == ["-m", "experiments.launch"], cmd  # cmd[0]: this python as the shell finds it
    return subprocess.run([sys.executable, *cmd[1:]], cwd=REPO, capture_output=True, text=True, timeout=500)


def _check_finished(sweep: Path) -> None:
    man = read_manifest(sweep)
    assert len(man.cells) == 2
    for c in man.cells:
        rd = RunDir(man.run_path(c))
        assert rd.state == "DONE", (c.run_dir, rd.status())
        assert [r["step"] for r in rd.read_metrics()] == list(range(1, STEPS + 1)), c.run_dir


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_ctrl_c_stops_cells_at_a_checkpoint_and_the_printed_command_resumes(tmp_path):
    root = tmp_path / "runs"
    code, out = _interrupt(root, workers=2, signals=1)
    assert code == 130, out
    assert "Traceback" not in out and "\r" not in out and "\x1b[" not in out, out
    assert "stopping (Ctrl-C)" in out and "Ctrl-C again to stop at once" in out
    (head,) = [x for x in out.splitlines() if x.startswith("[smoke] stopped (Ctrl-C): ")]
    assert "of 2 cell(s) DONE" in head and "resumable" in head and "not started" in head, out
    stopped = []
    man = read_manifest(root / "smoke")
    for c in man.cells:
        st = RunDir(man.run_path(c)).status()
        if st and st["state"] == "PREEMPTED":
            stopped.append((RunDir(man.run_path(c)), st["step"]))
    assert stopped, out
    before = {}
    for rd, step in stopped:  # it stopped between steps, with a checkpoint of its last step
        assert f"resumable: {rd.path.name} (stopped at step {step}/{STEPS})" in out, out
        assert (rd.path / "checkpoint" / "state.pt").is_file() and 0 < step < STEPS
        assert [r["step"] for r in rd.read_metrics()] == list(range(1, step + 1))
        before[rd.path] = rd.metrics_path.read_bytes()
        assert "RunStopped: stopped on request at step" in (rd.path / "run.log").read_text()

    res = _resume(out)
    assert res.returncode == 0, res.stderr[-3000:]
    _check_finished(root / "smoke")
    for path, data in before.items():  # resumed from the checkpoint, not restarted from step 0
        assert (path / "metrics.jsonl").read_bytes().startswith(data)
        assert (path / "run.log").read_text().count("=== attempt") == 2


@pytest.mark.slow  # six interpreters again (~40 CPU s): the slow tier, which CI runs (make test-slow)
def test_second_ctrl_c_stops_at_once_and_the_sweep_still_resumes(tmp_path):
    root = tmp_path / "runs"
    code, out = _interrupt(root, workers=2, signals=2)
    assert code == 130, out
    assert "Traceback" not in out and " -m experiments.launch +sweep=smoke" in out, out
    assert "killed at step" in out or "stopped at step" in out, out
    res = _resume(out)
    assert res.returncode == 0, res.stderr[-3000:]
    _check_finished(root / "smoke")


def test_sigterm_stops_the_same_way_with_status_143(tmp_path):
    root = tmp_path / "runs"
    p = subprocess.Popen([sys.executable, "-m", "experiments.launch", *_args(root, 1)], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    while _furthest(root / "smoke") < 2 and time.monotonic() - t0 < 300 and p.poll() is None:
        time.sleep(0.1)
    os.kill(p.pid, signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 143, out
    assert "Traceback" not in out and "[smoke] stopped (SIGTERM): " in out and "resume with: " in out, out
