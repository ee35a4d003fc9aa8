"""The progress display on a real pseudo-terminal of 60 columns (every line fits, a warning is
printed on its own line above the bar, a warm start's bar of its own below it) and on a pipe
(plain lines, no control characters)."""

from __future__ import annotations

import os
import pty
import re
import select
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WARNING = "the warm start cache is on a slow disk and this message is long enough to wrap"

SCRIPT = textwrap.dedent(f"""
    import sys, time, warnings
    from pathlib import Path
    from types import SimpleNamespace
    from fp8rl.launch.progress import SweepProgress, echo
    from fp8rl.runs import RunDir, prep_progress

    root = Path(sys.argv[1])
    cells = [SimpleNamespace(run_dir=root / f"grpo-8b-blockwise-calibrated-s{{i}}-0123456{{i}}", steps=10,
                             index=i + 1, total=3) for i in range(3)]
    warm = root / "warm.json"  # the third cell's warm start (written as fp8rl.backends.mini.sft_partial does)

    def warm_at(step):
        prep_progress.write(warm, label="warm start 14b", step=step, steps=40, state="running",
                            started=time.time() - 1, step0=0)

    warm_at(0)
    with SweepProgress(cells, name="main_table", interval_s=0.05, prepare_files=[warm]):
        for step in range(1, 11):
            if step < 5:
                warm_at(step * 10)
                time.sleep(0.1)
            elif step == 5:
                warm.unlink()  # done
            for c in cells[:2]:
                RunDir(c.run_dir).set_status("RUNNING", step)
            time.sleep(0.06)
            if step == 5:
                warnings.warn({WARNING!r})
                echo("a launcher message")
        for c in cells:
            RunDir(c.run_dir).set_status("DONE", 10)
        time.sleep(0.2)
""")


def _run_on_pty(tmp_path: Path, cols: int) -> str:
    import fcntl
    import termios

    script = tmp_path / "show.py"
    script.write_text(SCRIPT)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm", "COLUMNS": str(cols)}
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path / "runs")], stdin=slave, stdout=slave,
                         stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        r, _, _ = select.select([master], [], [], 60)
        if not r:
            break
        try:
            data = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    p.wait(timeout=60)
    os.close(master)
    assert p.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def _screen_lines(raw: str) -> list[str]:
    """What each redraw puts on one terminal line: split at CR/LF, control sequences removed."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)
    return [seg for seg in re.split(r"[\r\n]", text) if seg]


def test_bar_fits_60_columns_and_warnings_go_above_it(tmp_path):
    raw = _run_on_pty(tmp_path, 60)
    lines = _screen_lines(raw)
    assert any("%|" in x for x in lines), raw  # a bar was drawn
    too_long = [x for x in lines if len(x) > 60]
    assert not too_long, too_long
    # the warning starts a line of its own (not glued to a bar) and its words all arrive
    starts = [x for x in lines if "UserWarning:" in x]
    assert starts and all("%|" not in x for x in starts), lines
    joined = " ".join(x.strip() for x in lines)
    assert all(word in joined for word in WARNING.split()), joined
    assert "a launcher message" in lines
    assert any(x.startswith("warm start 14b") and "30/40, ETA " in x for x in lines), lines


def test_pipe_gets_plain_lines_without_control_characters(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert out.returncode == 0, out.stderr
    err = out.stderr
    assert "\r" not in err and "\x1b" not in err, repr(err)
    assert "[main_table] 3/3 cells finished | done" in err and "a launcher message" in err
    assert re.search(r"\| warm start 14b [1-4]0/40 ETA \d+:\d\d \|", err), err
    assert WARNING in err
