"""Which run files of a cell are damaged, and the fix that loses least (pure functions; no I/O).

``analysis.collect`` classifies a cell as ``damaged`` when one of its files cannot be trusted:

- ``status.json`` cannot be read (not JSON, not UTF-8, not a mapping);
- ``provenance.json`` or ``config.yaml`` cannot be read: the run's numbers may be intact, but not
  which code and which CPU numerics made them (``analysis.pooling`` groups runs by those), so the
  cell belongs to no group;
- the run says it finished (``status.json`` DONE at step S) but its ``metrics.jsonl`` is missing,
  or it lacks a row of a step 1..S: steps it logged are gone (:func:`metrics_damage`).

A damaged cell is listed with the file, the error and the fix that loses least (the launcher's:
delete ``status.json``, ``provenance.json`` or ``config.yaml`` and relaunch, which writes it again
and resumes from the checkpoint; put ``metrics.jsonl`` back from a copy, or rerun the cell); its
logged steps are left out of the report until it is fixed (the report is written from the rest).
"""

from __future__ import annotations

from fp8rl.runs.jsonl import REPAIRS
from fp8rl.runs.rundir import DONE, METRICS_FILE, missing_step_rows

#: What to do about a damaged file that no relaunch writes again (appended to the reason).
RESTORE = ("restore it from a copy of this run directory (the machine that ran it, a published copy); "
           "without one, delete the run directory and relaunch the sweep to rerun the cell")


def unreadable(file: str, error: str) -> str:
    """The reason of a cell whose ``file`` cannot be read: the file, the error, and the launcher's
    fix for it (``fp8rl.runs.jsonl.REPAIRS``: delete that file and relaunch, where the relaunch
    writes it again), else :data:`RESTORE`."""
    return f"{file} unreadable ({error}): {REPAIRS.get(file, RESTORE)}"


def metrics_damage(state: str | None, status_step: int | None, has_metrics: bool,
                   logged_steps: list[int]) -> str | None:
    """Why a finished run's ``metrics.jsonl`` is damaged, None when it is not (or nothing says).

    ``state``/``status_step``: what ``status.json`` says; ``has_metrics``: whether the file
    exists; ``logged_steps``: the steps of its readable rows. A run that says DONE at step S logged
    every step 1..S: the launcher's rule (``fp8rl.runs.rundir.missing_step_rows``), so status, the
    launcher and the report agree on which cells are damaged.
    """
    if state != DONE or not isinstance(status_step, int) or isinstance(status_step, bool) or status_step < 1:
        return None
    lost = missing_step_rows(int(status_step), logged_steps if has_metrics else None)
    return None if lost is None else f"{METRICS_FILE} {lost}"
