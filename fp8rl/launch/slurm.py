"""Small Slurm queries used by the launcher and ``experiments/status.py`` (``sacct``).

``job_states(ids)`` asks ``sacct`` for the state of jobs and array tasks (``"123_4"``); array
tasks that have not started yet appear as ``123_[5-9%2]`` and are expanded. Where ``sacct`` is
missing or fails (no Slurm, no accounting) the result is empty: callers show "-".
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable

#: States in which a job may still run: a relaunch must not submit its cell again.
ACTIVE_STATES = frozenset({
    "PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "COMPLETING",
    "CONFIGURING", "RESIZING", "SIGNALING", "STAGE_OUT",
})

_RANGE_RE = re.compile(r"^(\d+)_\[([^\]]+)\]$")


def _expand(job_id: str) -> list[str]:
    m = _RANGE_RE.match(job_id)
    if not m:
        return [job_id]
    base, spec = m.group(1), m.group(2).split("%", 1)[0]
    out = []
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            out += [f"{base}_{i}" for i in range(int(a), int(b) + 1)]
        elif part:
            out.append(f"{base}_{part}")
    return out


def job_states(job_ids: Iterable[str], timeout_s: float = 20.0) -> dict[str, dict]:
    """``{job_id: {"state", "exit_code", "reason"}}`` for the given ids (empty without sacct)."""
    ids = sorted({str(j) for j in job_ids if j})
    if not ids or shutil.which("sacct") is None:
        return {}
    masters = sorted({j.split("_", 1)[0] for j in ids})
    try:
        out = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-o", "JobID,State,ExitCode,Reason", "-j", ",".join(masters)],
            capture_output=True, text=True, timeout=timeout_s, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    states: dict[str, dict] = {}
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) < 4:
            continue
        jid, state, code, reason = parts[:4]
        for j in _expand(jid):
            # a requeued task appears once per attempt; the last line is the current one
            states[j] = {"state": state.split()[0] if state else "", "exit_code": code,
                         "reason": "" if reason in ("None", "") else reason}
    return {j: states[j] for j in ids if j in states}


def active_jobs(job_ids: Iterable[str]) -> set[str]:
    """The ids among ``job_ids`` whose job is pending or running."""
    return {j for j, s in job_states(job_ids).items() if s["state"] in ACTIVE_STATES}
