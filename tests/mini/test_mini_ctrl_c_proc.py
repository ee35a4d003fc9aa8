"""Ctrl-C in a direct ``python -m fp8rl.backends.mini`` run (issue 32, defect 5): one message, no
traceback, exit 130, the run PREEMPTED with a checkpoint, and the printed command resumes it."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fp8rl.runs import RunDir

sys.path.insert(0, str(Path(__file__).parent))
from direct_run import interrupt_direct_run

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
TINY = ["steps=12", "prompts_per_step=2", "num_mini_batches=2", "max_response_len=16", "eval_every=0", "eval_k=1",
        "checkpoint_every=0", "samples_every=0", "algorithm.n_samples_per_prompt=2", "mini.n_train=64",
        "mini.n_eval=2", "mini.sft_steps=0", "mini.num_threads=1"]


def test_ctrl_c_in_a_direct_mini_run_stops_cleanly_and_resumes(tmp_path):
    run = tmp_path / "run"
    rd = RunDir(run)
    code, out = interrupt_direct_run([*TINY, f"run_dir={run}"],
                                     lambda: rd.status_path.exists() and (rd.status() or {}).get("step", 0) >= 2)
    assert code == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "stopped (Ctrl-C): stopped on request at step" in out, out
    st = rd.status()
    assert st["state"] == "PREEMPTED" and (run / "checkpoint" / "state.pt").is_file(), st
    (line,) = [x for x in out.splitlines() if x.startswith("resume with: ")]
    cmd = shlex.split(line.removeprefix("resume with: "))
    res = subprocess.run([sys.executable, *cmd[1:]], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=200)
    assert res.returncode == 0, res.stderr[-3000:]
    assert rd.state == "DONE" and [r["step"] for r in rd.read_metrics()] == list(range(1, 13))
