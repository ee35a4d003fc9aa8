"""Run-directory ownership against real processes: held, refused, released, killed, waited for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fp8rl.runs.lock import OWNER_FILE, RunOwned, exclusive, own, probe, read_owner

HOLD = textwrap.dedent("""
    import sys, time
    from fp8rl.runs.lock import own
    with own(sys.argv[1]):
        print("HELD", flush=True)
        time.sleep(float(sys.argv[2]))
    print("RELEASED", flush=True)
""")


def _holder(run_dir: Path, seconds: float, env: dict | None = None) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), str(seconds)], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, **(env or {})})
    assert p.stdout.readline().strip() == "HELD"
    return p


def test_own_writes_owner_and_releases(tmp_path):
    rd = tmp_path / "run"
    assert probe(rd) == (False, None)
    with own(rd) as me:
        held, owner = probe(rd)
        assert held and owner == me and owner.pid == os.getpid() and owner.released is None
        with own(rd):  # re-entrant in one process
            assert probe(rd)[0]
        assert probe(rd)[0]
    held, owner = probe(rd)
    assert not held and owner.pid == os.getpid() and owner.released is not None


def test_second_process_is_refused_naming_the_owner(tmp_path):
    rd = tmp_path / "run"
    p = _holder(rd, 30)
    try:
        held, owner = probe(rd)
        assert held and owner.pid == p.pid
        with pytest.raises(RunOwned, match=rf"running elsewhere: owned by host \S+ pid {p.pid}"):
            with own(rd):
                pass
    finally:
        p.kill()
        p.wait()


def test_killed_owner_is_taken_over_with_a_log_line(tmp_path):
    rd = tmp_path / "run"
    p = _holder(rd, 60)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    held, owner = probe(rd)
    assert not held and owner.pid == p.pid and owner.released is None  # died holding it
    lines: list[str] = []
    with own(rd, log=lines.append) as me:
        assert me.pid == os.getpid()
    assert len(lines) == 1 and f"pid {p.pid}" in lines[0] and "taking over" in lines[0]


def test_cleanly_released_run_is_taken_without_a_takeover_line(tmp_path):
    rd = tmp_path / "run"
    p = _holder(rd, 0.2)
    assert p.stdout.readline().strip() == "RELEASED"
    p.wait()
    lines: list[str] = []
    with own(rd, log=lines.append):
        pass
    assert lines == []


def test_requeued_slurm_task_waits_for_its_previous_incarnation(tmp_path):
    rd = tmp_path / "run"
    p = _holder(rd, 1.5, env={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"})
    old = dict(os.environ)
    os.environ.update({"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"})
    try:
        t0 = time.monotonic()
        with own(rd, wait_same_job_s=30) as me:
            assert me.slurm_job_id == "4242" and me.slurm_restart == "1"
        assert time.monotonic() - t0 > 0.5  # it waited for the holder instead of giving up
    finally:
        os.environ.clear()
        os.environ.update(old)
        p.wait()


def test_other_slurm_job_is_refused_at_once(tmp_path):
    rd = tmp_path / "run"
    p = _holder(rd, 30, env={"SLURM_JOB_ID": "1"})
    old = dict(os.environ)
    os.environ["SLURM_JOB_ID"] = "2"
    try:
        t0 = time.monotonic()
        with pytest.raises(RunOwned, match="Slurm job 1"):
            with own(rd, wait_same_job_s=30):
                pass
        assert time.monotonic() - t0 < 5
    finally:
        os.environ.clear()
        os.environ.update(old)
        p.kill()
        p.wait()


def test_owner_file_is_plain_json_and_unreadable_content_is_tolerated(tmp_path):
    rd = tmp_path / "run"
    with own(rd):
        data = json.loads((rd / OWNER_FILE).read_text())
        assert {"host", "pid", "slurm_job_id", "since", "released"} <= set(data)
    (rd / OWNER_FILE).write_text("{not json")
    assert read_owner(rd) is None
    with own(rd):  # a garbled file is still a lock file
        assert read_owner(rd) is not None


def test_exclusive_serialises_processes(tmp_path):
    lock = tmp_path / "cache" / "key.lock"
    code = textwrap.dedent(f"""
        import time
        from fp8rl.runs.lock import exclusive
        with exclusive({str(lock)!r}):
            print("IN", flush=True)
            time.sleep(1.0)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "IN"
    t0 = time.monotonic()
    with exclusive(lock):
        waited = time.monotonic() - t0
    p.wait()
    assert waited > 0.3
