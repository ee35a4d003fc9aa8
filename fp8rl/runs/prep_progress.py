"""Progress of one-time preparation work (the mini backend's SFT warm start), in a small file.

A cell's status lives in its run directory (``status.json``); work that several cells share
and that runs before any of them (a warm start trained once per model slot) has no run
directory, so it writes its progress to a JSON file of its own, which the launcher's display
(``fp8rl.launch.progress``) reads to draw a bar per warm start with its own ETA::

    {"label": "warm start 8b", "step": 120, "steps": 800, "state": "running",
     "pid": 4242, "host": "node1", "started": 1767000000.0, "step0": 40, "time": 1767000031.5}

``started`` and ``step0``: the wall time and step at which this attempt began (a resumed warm
start begins past 0, and its earlier steps do not count towards the rate); ``time``: when the
file was written. ``state`` is ``running`` or ``stopped``. The file is replaced atomically
(``fp8rl.runs.safe_io``), so a reader never sees half of it; a missing or unreadable file
reads as None. A writer killed outright leaves ``running`` behind: :func:`active` then sees
that its process is gone (same host). Standard library only.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

RUNNING, STOPPED = "running", "stopped"


def write(path: str | os.PathLike, *, label: str, step: int, steps: int, state: str, started: float,
          step0: int) -> None:
    """Atomically (re)write the progress file ``path`` of this process's preparation."""
    from fp8rl.runs.safe_io import atomic_write_bytes

    record = {"label": label, "step": int(step), "steps": int(steps), "state": state, "pid": os.getpid(),
              "host": socket.gethostname(), "started": started, "step0": int(step0), "time": time.time()}
    atomic_write_bytes(path, json.dumps(record).encode())


def read(path: str | os.PathLike) -> dict | None:
    """The record at ``path``; None when it is missing, unreadable or not a record."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    need = ("label", "step", "steps", "state", "started", "step0", "time")
    return record if isinstance(record, dict) and all(k in record for k in need) else None


def active(record: dict | None) -> bool:
    """The preparation is still at work: ``running``, and its process alive where we can tell
    (a process on another host is taken at its word)."""
    if not record or record.get("state") != RUNNING:
        return False
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return True
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def eta_s(record: dict, now: float | None = None) -> float | None:
    """Seconds left at this attempt's rate (steps since ``step0`` over the time since
    ``started``), counted from the last write; never negative; None before a step is timed."""
    done = int(record["step"]) - int(record["step0"])
    took = float(record["time"]) - float(record["started"])
    if done <= 0 or took <= 0:
        return None
    left = (int(record["steps"]) - int(record["step"])) * took / done
    since = (time.time() if now is None else now) - float(record["time"])
    return max(0.0, left - max(0.0, since))
