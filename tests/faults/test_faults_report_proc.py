"""A report killed while it writes: no half-written file in its output, and a rerun completes it;
two reports into one ``--out`` at once both complete.

``python -m analysis.report`` runs as a real process on a fabricated sweep
(``fp8rl.runs.synthetic``: real run directories written by the backends' writers) and is killed
with SIGKILL once it has started writing its outputs. Its output directory must then hold
nothing it had started (a report builds in a staging directory and moves each finished file
in, ``analysis.report.publish``), and a rerun must write what an uninterrupted report writes
(every table and figure's data byte for byte; PDFs and PNGs carry no data of their own).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp8rl.runs.synthetic import demo_specs, make_sweep

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _report(sweep: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "analysis.report", str(sweep), "--out", str(out),
                             "--no-progress", "--workers", "1"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _data_files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.suffix in (".csv", ".md", ".tex") and ".cache" not in p.parts}


def _started_writing(sweep: Path, out: Path) -> bool:
    """The report has written at least one figure or table file (in its output or its staging)."""
    for root in [out, *sweep.glob(f".{out.name}.partial-*")]:
        if any(p.suffix in (".png", ".csv") for p in root.rglob("*") if p.is_file()):
            return True
    return False


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_a_killed_report_leaves_no_partial_output_and_a_rerun_completes_it(tmp_path):
    sweep = tmp_path / "sweep"
    make_sweep(sweep, demo_specs(steps=60, seeds=(0,)), fast=True)
    reference = tmp_path / "reference"
    done = _report(sweep, reference)
    assert done.wait(timeout=240) == 0, done.stdout.read()[-3000:]
    want = _data_files(reference)
    assert "report.md" in want and any(k.startswith("tables/") for k in want)

    out = sweep / "report"
    p = _report(sweep, out)
    t0 = time.monotonic()
    while not _started_writing(sweep, out):
        assert p.poll() is None, "the report ended before it could be killed"
        assert time.monotonic() - t0 < 200, "the report wrote nothing in 200 s"
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    # nothing the killed report started is in its output: no report.md, no figure, no table
    assert not out.exists() or not any(f.is_file() and ".cache" not in f.parts for f in out.rglob("*")), \
        sorted(str(f.relative_to(out)) for f in out.rglob("*") if f.is_file())

    again = _report(sweep, out)
    assert again.wait(timeout=240) == 0, again.stdout.read()[-3000:]
    assert _data_files(out) == want
    assert not list(sweep.glob(f".{out.name}.partial-*"))  # the killed report's staging is gone


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_two_reports_into_one_out_both_complete(tmp_path):
    """Two reports started together into one ``--out``: neither removes the other's staging
    directory (each holds a lock on its own), both end 0, and ``--out`` holds one whole report."""
    sweep = tmp_path / "sweep"
    make_sweep(sweep, demo_specs(steps=60, seeds=(0,)), fast=True)
    out = tmp_path / "report"
    procs = [_report(sweep, out) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=240) == 0, p.stdout.read()[-3000:]
    files = _data_files(out)
    assert "report.md" in files and any(k.startswith("tables/") for k in files)
    assert not list(tmp_path.glob(f".{out.name}.partial-*"))  # staging and locks gone
