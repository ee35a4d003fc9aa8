"""A damaged checkpoint is reported as what it is, where a person looks (issue 32, defect 1).

As a user met it: a sweep stopped with Ctrl-C (its cell PREEMPTED, "relaunch to resume"), the
cell's ``state.pt`` cut to 1000 bytes, the sweep relaunched. The launcher's line, ``status.json``,
``experiments.status`` and the report's problem table must name ``CheckpointRefused``, the file
and the fix (restore it, or delete it to run from step 0), never the stale PREEMPTED advice; and
following the fix (``rm``, relaunch) finishes the cell from step 0 with every step logged once.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp8rl.runs import RunDir

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
STEPS = 12


def _launch(root: Path) -> list[str]:
    return [sys.executable, "-m", "experiments.launch", "+sweep=smoke", "fp8=bf16", "clip=vanilla",
            f"steps={STEPS}", "checkpoint_every=0", "workers=1", f"output_dir={root}"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _stopped_cell(root: Path) -> RunDir:
    """Launch, Ctrl-C once the cell is past step 2: the cell is PREEMPTED with a checkpoint."""
    p = subprocess.Popen(_launch(root), cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    t0 = time.monotonic()
    while True:
        runs = [RunDir(d) for d in (root / "smoke").glob("grpo-*")] if (root / "smoke").exists() else []
        st = runs[0].status() if runs and runs[0].status_path.exists() else None
        if st and st["state"] == "RUNNING" and st["step"] >= 2:
            break
        if p.poll() is not None or time.monotonic() - t0 > 300:
            p.kill()
            pytest.fail(f"the cell never reached step 2: {p.communicate()[0][-3000:]}")
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 130, out
    rd = runs[0]
    assert rd.state == "PREEMPTED" and (rd.checkpoint_dir / "state.pt").is_file(), (rd.status(), out)
    return rd


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_a_damaged_checkpoint_is_named_with_its_fix_and_the_fix_works(tmp_path):
    root = tmp_path / "runs"
    rd = _stopped_cell(root)
    step = rd.status()["step"]
    ckpt = rd.checkpoint_dir / "state.pt"
    os.truncate(ckpt, 1000)  # `truncate -s 1000 .../checkpoint/state.pt`

    res = subprocess.run(_launch(root), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    (line,) = [x for x in out.splitlines() if x.strip().startswith(rd.path.name + ":")]
    assert "CheckpointRefused" in line and str(ckpt) in line and "damaged" in line, line
    assert f"rm {ckpt}" in line and "from step 0" in line and "restore" in line, line
    assert "stopped on request" not in line and "relaunch to resume" not in line, line

    st = rd.status()
    assert st["state"] == "FAILED" and st["step"] == step and "CheckpointRefused" in st["reason"], st

    status = subprocess.run([sys.executable, "-m", "experiments.status", str(root / "smoke"), "--no-slurm"],
                            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert "FAILED" in status.stdout and "PREEMPTED" not in status.stdout, status.stdout
    assert str(ckpt) in status.stdout and "from step 0" in status.stdout, status.stdout

    rep = subprocess.run([sys.executable, "-m", "analysis.report", str(root / "smoke"), "--no-cache", "--no-progress",
                          "--figures", "entropy"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr[-3000:]
    text = (root / "smoke" / "report" / "report.md").read_text()
    (row,) = [x for x in text.splitlines() if rd.path.name in x and "FAILED" in x]
    assert "CheckpointRefused" in row and "state.pt" in row, row

    # follow the advice: delete the checkpoint, relaunch -> the cell runs again from step 0
    fix = line[line.index("(rm ") + 1:]
    fix = fix[: fix.index(")")]
    assert shlex.split(fix) == ["rm", str(ckpt)]
    ckpt.unlink()
    res = subprocess.run(_launch(root), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert rd.state == "DONE"
    assert [r["step"] for r in rd.read_metrics()] == list(range(1, STEPS + 1))
