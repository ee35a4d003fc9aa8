"""A report refused for a disk that fills while it writes leaves nothing in an ``--out`` that did not
exist before: not even the metrics cache it wrote first (issue 50, item 4).

A real tmpfs (mounted for the test, as ``test_faults_disk_proc.py`` does; skipped where mounting is not
permitted) with room for the parsed-metrics cache (``OUT/.cache``, written while collecting) but not
for the figures; ``python -m analysis.report`` runs as a real process.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8rl.runs.synthetic import RunSpec, make_sweep

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)
FREE = 96 * 1024  # the cache of the four runs below takes about 40 KB of tmpfs pages; the figure 70 KB more


@contextlib.contextmanager
def _tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip() or proc.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill_but(disk: Path, free: int) -> Path:
    """Fill ``disk`` with one file until ENOSPC, then give back ``free`` bytes."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    block = b"\0" * (1 << 16)
    try:
        while block:
            try:
                os.write(fd, block)
            except OSError:
                block = block[: len(block) // 2]
    finally:
        os.close(fd)
    os.truncate(filler, max(0, filler.stat().st_size - free))
    return filler


def test_a_report_refused_for_a_full_disk_leaves_no_cache_in_a_new_out(tmp_path):
    sweep = tmp_path / "sweep"
    make_sweep(sweep, [RunSpec(fp8=f, seed=s, steps=20, eval={"aime24": 0.3}, eval_every=10)
                       for f in ("bf16", "tensorwise") for s in (0, 1)], fast=True)
    with _tmpfs(tmp_path / "disk", "1m") as disk:
        _fill_but(disk, FREE)
        out = disk / "report"
        proc = subprocess.run([sys.executable, "-m", "analysis.report", str(sweep), "--out", str(out),
                               "--no-progress", "--workers", "1", "--figures", "entropy"],
                              cwd=REPO, capture_output=True, text=True, timeout=240,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert "no space left on device" in line and "rerun" in line, line
        assert sorted(p.name for p in disk.iterdir()) == ["filler"], sorted(str(p) for p in disk.rglob("*"))
