"""The status table of a sweep: every manifest cell, its run state, and Slurm's view of it.

``sweep_status(sweep_dir)`` reads ``manifest.json`` and each cell's run directory
(``status.json``, the last row of ``metrics.jsonl``) and, where cells have job ids and
``sacct`` works, the Slurm state of each array task. ``format_table`` renders it;
``failed_cells`` lists the cells that failed with their reasons: the run's own reason
(``status.json``), else Slurm's state and exit code with the path of the job's log.

State of a cell (column ``state``): the run directory's state (RUNNING, DONE, FAILED,
PREEMPTED) or ``MISSING`` (never started). A cell whose Slurm task ended (FAILED, TIMEOUT,
OUT_OF_MEMORY, CANCELLED, NODE_FAIL) while its run directory still says RUNNING, or was never
written, is shown as ``FAILED`` with Slurm's reason: the job died outside Python. A cell that
says RUNNING but whose run directory no live process owns (``fp8rl.runs.lock``: its process was
killed, e.g. together with its launcher) is shown as ``DIED``, naming the owner that is gone;
relaunching the sweep resumes it from its checkpoint. A cell whose ``status.json`` or
``config.yaml`` cannot be read (not JSON/YAML, not UTF-8, not a mapping) is shown as ``DAMAGED``
with the file and the error; the other cells are shown as usual. So is a cell whose
``status.json`` says DONE while its ``metrics.jsonl`` is missing or holds fewer step rows than
the status's step (``RunDir.done_damage``: no relaunch would log them again), with the fix. Each row carries the path of
the run's ``run.log`` (``fp8rl.runs.runlog``); the failed cells' reasons end with it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from fp8rl.runs import DONE, FAILED, RUNNING, RunDir, read_manifest
from fp8rl.runs import metrics as M
from fp8rl.runs.lock import OWNER_FILE, probe
from fp8rl.runs.runlog import log_path

#: Shown for a run that says RUNNING while no live process owns it.
DIED = "DIED"
#: Shown for a run whose status.json or config.yaml cannot be read, or that says DONE without its metrics.
DAMAGED = "DAMAGED"


class _Damaged(Exception):
    """A run file that cannot be read (the message names the file and the error)."""


def _read_mapping(path: Path, read) -> dict | None:
    """``read()`` (a mapping or None when the file is absent), or :class:`_Damaged` naming ``path``."""
    if not path.exists():
        return None
    try:
        value = read()
    except Exception as e:  # not JSON/YAML, not UTF-8, unreadable: name it, do not stop the table
        raise _Damaged(f"{path.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    if not isinstance(value, dict):
        raise _Damaged(f"{path.name}: holds a {type(value).__name__}, not a mapping")
    return value

_DEAD = {"FAILED", "TIMEOUT", "OUT_OF_MEMORY", "CANCELLED", "NODE_FAIL", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}


@dataclass
class CellStatus:
    """One row of the table."""

    run_dir: str
    state: str
    step: int | None
    steps: int | None
    reward: float | None
    entropy: float | None
    job_id: str | None
    slurm_state: str | None
    reason: str | None
    overrides: tuple[str, ...]
    log: str | None = None  # the run's run.log (what the cell printed), when it has one


def _last_metrics(rd: RunDir) -> dict:
    path = rd.metrics_path
    if not path.exists():
        return {}
    last = None
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                last = line
    if last is None:
        return {}
    try:
        row = json.loads(last)
    except ValueError:  # a line being written
        return {}
    return row if isinstance(row, dict) else {}


def _log_path(sweep_dir: Path, job_id: str) -> Path | None:
    hits = sorted((sweep_dir / ".submitit").glob(f"*/{job_id}_0_log.err"))
    return hits[0] if hits else None


def sweep_status(sweep_dir: str | Path, *, query_slurm: bool = True) -> list[CellStatus]:
    """The status of every manifest cell of ``sweep_dir``."""
    from fp8rl.launch.slurm import job_states

    man = read_manifest(sweep_dir)
    sweep_dir = Path(sweep_dir)
    ids = [c.job_id for c in man.cells if c.job_id]
    slurm = job_states(ids) if (query_slurm and ids) else {}
    rows = []
    for c in man.cells:
        rd = RunDir(man.run_path(c))
        sl = slurm.get(c.job_id or "", {})
        try:
            st = _read_mapping(rd.status_path, rd.status)
            cfg = _read_mapping(rd.config_path, rd.config)
        except _Damaged as e:
            rows.append(CellStatus(
                run_dir=c.run_dir, state=DAMAGED, step=None, steps=None, reward=None, entropy=None,
                job_id=c.job_id, slurm_state=sl.get("state") or None, reason=str(e), overrides=c.overrides))
            continue
        state = st["state"] if st else "MISSING"
        reason = st.get("reason") if st else None
        if state == DONE:  # finished, but are its steps' rows there? (a DONE cell is never rerun)
            try:
                damage = rd.done_damage()
            except (OSError, ValueError) as e:
                damage = str(e)
            if damage:
                rows.append(CellStatus(
                    run_dir=c.run_dir, state=DAMAGED, step=st.get("step"), steps=(cfg or {}).get("steps"),
                    reward=None, entropy=None, job_id=c.job_id, slurm_state=sl.get("state") or None,
                    reason=damage, overrides=c.overrides))
                continue
        last = _last_metrics(rd)
        if sl.get("state") in _DEAD and state not in (DONE, FAILED):
            state = FAILED
            log = _log_path(sweep_dir, c.job_id) if c.job_id else None
            reason = (f"Slurm {sl['state']} (exit code {sl.get('exit_code')})"
                      + (f"; log: {log}" if log else ""))
        elif state == RUNNING and (rd.path / OWNER_FILE).exists():
            held, owner = probe(rd.path)
            if not held:
                state = DIED
                reason = (f"its process ({owner.describe() if owner else 'unknown'}) is gone; "
                          "relaunch the sweep to resume it from its checkpoint")
        elif state == FAILED and not reason and c.job_id:
            log = _log_path(sweep_dir, c.job_id)
            reason = f"see {log}" if log else None
        log = log_path(rd.path)
        rows.append(CellStatus(
            run_dir=c.run_dir, state=state, step=st.get("step") if st else None,
            steps=(cfg or {}).get("steps"), reward=last.get(M.ROLLOUT_REWARD_MEAN),
            entropy=last.get(M.ACTOR_ENTROPY), job_id=c.job_id,
            slurm_state=sl.get("state") or None, reason=reason, overrides=c.overrides,
            log=str(log) if log.is_file() and not log.is_symlink() else None,
        ))
    return rows


def _num(x: float | None) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.3f}"


def format_table(rows: list[CellStatus]) -> str:
    """A fixed-width table, one line per cell, and a count per state."""
    head = ("cell", "state", "step", "reward", "entropy", "job", "slurm")
    body = [(r.run_dir, r.state, f"{r.step if r.step is not None else '-'}/{r.steps or '-'}",
             _num(r.reward), _num(r.entropy), r.job_id or "-", r.slurm_state or "-") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
             for line in (head, *body)]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    lines.append(f"{len(rows)} cells: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return "\n".join(lines)


def failed_cells(rows: list[CellStatus]) -> list[tuple[str, str]]:
    """``(run dir, reason)`` of every FAILED, DIED or DAMAGED cell; the reason ends with the path
    of the run's ``run.log`` when it has one (what the cell printed, its traceback included)."""
    return [(r.run_dir, (r.reason or "no reason recorded") + (f"; run log: {r.log}" if r.log else ""))
            for r in rows if r.state in (FAILED, DIED, DAMAGED)]
