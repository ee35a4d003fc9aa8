"""A direct ``python -m fp8rl.backends.mini`` run in a subprocess, interrupted as a person would:
Ctrl-C (SIGINT) once ``ready()`` holds. Shared by the Ctrl-C and warm-start resume tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def interrupt_direct_run(args: list[str], ready: Callable[[], bool], *, timeout: float = 200,
                         poll: float = 0.05) -> tuple[int, str]:
    """Start the run with ``args``, wait until ``ready()`` (the test fails, with the output, if
    the run ends first or ``timeout`` passes), send SIGINT; returns ``(exit status, output)``."""
    p = subprocess.Popen([sys.executable, "-m", "fp8rl.backends.mini", *args], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    while not ready():
        if p.poll() is not None or time.monotonic() - t0 > timeout:
            p.kill()
            pytest.fail(p.communicate()[0][-3000:])
        time.sleep(poll)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out
