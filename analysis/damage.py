"""Which run files of a cell are damaged, and the fix that loses least (pure functions; no I/O).

``analysis.collect`` classifies a cell as ``damaged`` when one of its files cannot be trusted:

- ``status.json`` cannot be read (not JSON, not UTF-8, not a mapping);
- ``provenance.json`` or ``config.yaml`` cannot be read: the run's numbers may be intact, but not
  which code and which CPU numerics made them (``analysis.pooling`` groups runs by those), so the
  cell belongs to no group;
- the run says it finished (``status.json`` DONE at step S) but its ``metrics.jsonl`` is missing,
  or its last logged step is before S: steps it logged are gone (:func:`metrics_damage`).

A damaged cell is listed with the file, the error and the fix; its logged steps are left out of
the report until it is fixed (the report is written from the rest). The fix that loses least is
to put the file back from a copy of the run directory (the machine that ran it, a published copy);
without one, rerun the cell.
"""

from __future__ import annotations

from fp8rl.runs.rundir import DONE, METRICS_FILE, STATUS_FILE

#: What to do about a damaged file of a run directory (appended to the reason).
RESTORE = ("restore it from a copy of this run directory (the machine that ran it, a published copy); "
           "without one, delete the run directory and relaunch the sweep to rerun the cell")
#: What a damaged ``status.json`` needs (the launcher's own advice: the cell resumes from its checkpoint).
STATUS_FIX = "delete it and relaunch: the cell resumes from its checkpoint"


def unreadable(file: str, error: str) -> str:
    """The reason of a cell whose ``file`` cannot be read: the file, the error, the fix."""
    fix = STATUS_FIX if file == STATUS_FILE else RESTORE
    return f"{file} unreadable ({error}): {fix}"


def metrics_damage(state: str | None, status_step: int | None, has_metrics: bool,
                   last_step: int | None) -> str | None:
    """Why a finished run's ``metrics.jsonl`` is damaged, None when it is not (or nothing says).

    ``state``/``status_step``: what ``status.json`` says; ``has_metrics``: whether the file
    exists; ``last_step``: its last readable logged step (None when it holds no row). A run that
    says DONE at step S logged every step up to S (``fp8rl.runs``): a missing file, an empty one,
    or one that ends before S lost steps.
    """
    if state != DONE or status_step is None:
        return None
    says = f"{STATUS_FILE} says DONE at step {int(status_step)}"
    if not has_metrics:
        return f"{METRICS_FILE} missing ({says}): {RESTORE}"
    if last_step is None:
        return f"{METRICS_FILE} holds no step ({says}): {RESTORE}"
    if int(last_step) < int(status_step):
        return f"{METRICS_FILE} ends at step {int(last_step)} ({says}): {RESTORE}"
    return None
