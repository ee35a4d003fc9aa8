"""Both worker processes of a local launch killed during the SFT warm start (what the
out-of-memory killer does to a machine that ran out of memory): the launch ends with a summary
of the cells, why each did not finish and the command that resumes the sweep, exit status 1, no
traceback.

The launch is the real command (``python -m experiments.launch +sweep=smoke workers=2``, two
cells sharing one warm start made long enough to be caught), in a subprocess; both workers are
found among its children and sent SIGKILL once one trains the warm start (its cache lock exists)
and the other has taken a cell (its run directory exists).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _children(pid: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of the live child processes of ``pid`` (from ``/proc``)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append((int(d.name), cmd))
    return out


def _workers(pid: int) -> list[int]:
    """The pool's worker processes among the launcher's children (not multiprocessing's tracker)."""
    return [p for p, cmd in _children(pid) if "spawn_main" in cmd and "resource_tracker" not in cmd]


def test_workers_killed_during_the_warm_start_end_in_a_summary_and_a_resume_command(tmp_path):
    out = tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    args = ["+sweep=smoke", "clip=vanilla", "fp8=bf16,tensorwise", "workers=2", "progress=false",
            "mini.sft_steps=5000", f"output_dir={out}"]
    proc = subprocess.Popen([sys.executable, "-m", "experiments.launch", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, "the launch ended before its workers could be killed"
            assert time.monotonic() - t0 < 200, "the workers never reached the warm start"
            locks = list((out / ".cache" / "sft").glob("*.lock"))
            runs = [p for p in (out / "smoke").glob("grpo-*") if (p / "owner.json").exists()]
            workers = _workers(proc.pid)
            if locks and runs and len(workers) == 2:
                break
            time.sleep(0.1)
        time.sleep(0.5)
        for w in workers:
            os.kill(w, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "2 cell(s) FAILED" in stderr, stderr[-3000:]
    assert "killed by SIGKILL" in stderr and "not started: every worker process died" in stderr, stderr[-3000:]
    resume = next(ln for ln in stderr.splitlines() if "resume with:" in ln)
    assert resume.endswith("python -m experiments.launch " + " ".join(args)), resume
    assert not any(Path(f"/proc/{w}").exists() for w in workers)  # nothing left behind
