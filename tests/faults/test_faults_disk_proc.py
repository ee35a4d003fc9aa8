"""A real full file system: a small tmpfs mounted for the test, filled with a file until the
kernel answers ENOSPC (not a patched ``fsync``: ``test_faults_files.py`` does that).

- ``experiments.launch`` into the full disk: one line naming the file it could not write and the
  fix, exit status 1, and no empty sweep directory left behind;
- ``analysis.report`` with ``--out`` on the full disk: one line, exit status 1, no traceback;
- a disk that fills while a cell runs: the launch names the write that failed and how to go on
  (not the ``OSError`` of writing the traceback into ``run.log`` on the same disk), and once space
  is freed the relaunch resumes the cell and it ends DONE with every step logged once.

Mounting needs root (CAP_SYS_ADMIN); where it is not permitted the tests skip saying so. Every
mount is unmounted by its fixture, whatever the test did.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp8rl.runs import RunDir

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)
CELL = ["+sweep=smoke", "fp8=bf16", "clip=vanilla", "workers=1", "progress=false"]


def _mount(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip() or proc.returncode}")


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` at ``path`` for the block; unmounted afterwards whatever happened."""
    _mount(path, size)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)  # busy: detach it now


def fill(disk: Path) -> Path:
    """Fill ``disk`` with one file until the kernel says ENOSPC; returns the file (delete it to
    free the space)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    block = b"\0" * (1 << 16)
    try:
        while True:
            try:
                os.write(fd, block)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if len(block) == 1:
                    break
                block = block[: len(block) // 2]
    finally:
        os.close(fd)
    return filler


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _launch(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.launch", *CELL, f"output_dir={out}", *extra],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)


def test_a_launch_into_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    with tmpfs(tmp_path / "disk", "256k") as disk:
        fill(disk)
        proc = _launch(disk / "runs")
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error:")]
        assert f"no space left on device writing {disk / 'runs' / 'smoke'}" in line, line
        assert "free space and relaunch" in line and "nothing was run" in line, line
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # no empty runs/smoke left


def test_a_report_onto_a_full_disk_is_one_line(tmp_path):
    from fp8rl.runs.synthetic import RunSpec, make_sweep

    sweep = tmp_path / "sweep"
    make_sweep(sweep, [RunSpec(fp8="bf16", steps=20, eval={"aime24": 0.3}, eval_every=10)], fast=True)
    with tmpfs(tmp_path / "disk", "256k") as disk:
        fill(disk)
        proc = subprocess.run([sys.executable, "-m", "analysis.report", str(sweep), "--out", str(disk / "report"),
                               "--no-progress", "--workers", "1", "--figures", "entropy"],
                              cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert "no space left on device" in line and str(disk) in line and "rerun" in line, line
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # no staging directory left


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_a_disk_filling_mid_run_names_the_write_and_the_relaunch_resumes(tmp_path):
    with tmpfs(tmp_path / "disk", "24m") as disk:
        out = disk / "runs"
        steps = 60
        proc = subprocess.Popen([sys.executable, "-m", "experiments.launch", *CELL, f"output_dir={out}",
                                 f"steps={steps}"], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            t0 = time.monotonic()
            while True:  # the disk fills once the cell has logged step 2 (and written its checkpoint)
                assert proc.poll() is None, "the run ended before the disk could fill"
                assert time.monotonic() - t0 < 200, "the run never logged step 2"
                runs = list((out / "smoke").glob("grpo-*/metrics.jsonl"))
                if runs and runs[0].read_bytes().count(b"\n") >= 2:
                    break
                time.sleep(0.02)
            filler = fill(disk)
            _, stderr = proc.communicate(timeout=200)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 1, stderr[-3000:]
        run = runs[0].parent
        line = next(ln for ln in stderr.splitlines() if ln.startswith(f"  {run.name}: "))
        assert f"no space left on device writing {run}" in line, line
        assert "free space and relaunch; the run resumes from its last checkpoint" in line, line
        assert "Errno 28" not in stderr and "threading.excepthook" not in stderr, stderr[-3000:]
        filler.unlink()  # space freed: what the message says
        again = _launch(out, f"steps={steps}")
        assert again.returncode == 0, again.stderr[-3000:]
        rd = RunDir(run)
        assert rd.state == "DONE"
        assert [r["step"] for r in rd.read_metrics()] == list(range(1, steps + 1))
