"""``run.log``: what a cell printed (Python, file descriptors, child processes), appended per
attempt with a header line, its error included; a symlink in its place is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fp8rl.runs import RunDirSymlink
from fp8rl.runs.runlog import HEADER, attempts, capture, log_path


def test_capture_appends_every_kind_of_output_per_attempt(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with capture(run) as path:
        print("python stdout line")
        print("python stderr line", file=sys.stderr)
        os.write(1, b"fd one line\n")
        os.write(2, b"fd two line\n")
        subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"],
                       check=True)
    assert path == log_path(run)
    os.write(1, b"")  # the descriptors are back: nothing more lands in the log
    print("after the block")
    text = path.read_text()
    for want in ("python stdout line", "python stderr line", "fd one line", "fd two line", "child out", "child err"):
        assert want in text, text
    assert "after the block" not in text
    assert text.startswith(f"{HEADER} 1, ") and attempts(run) == 1

    with pytest.raises(ValueError, match="boom"), capture(run):
        print("second attempt")
        raise ValueError("boom")
    text = path.read_text()
    assert attempts(run) == 2 and text.index("fd two line") < text.index(f"{HEADER} 2, ") < text.index("second attempt")
    assert "Traceback" in text and "ValueError: boom" in text  # the cell's error is in its log


def test_capture_refuses_a_symlink_and_leaves_its_target(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "elsewhere.txt"
    target.write_text("not the run's\n")
    (run / "run.log").symlink_to(target)
    with pytest.raises(RunDirSymlink, match=r"run\.log is a symlink"), capture(run):
        print("never")
    assert target.read_text() == "not the run's\n"


def test_capture_refuses_a_directory_in_place_of_the_log(tmp_path):
    run = tmp_path / "run"
    (run / "run.log").mkdir(parents=True)
    with pytest.raises(OSError), capture(run):
        print("never")
