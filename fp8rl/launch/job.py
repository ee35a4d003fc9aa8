"""What runs inside a job: one validated cell, from its payload, into its run directory.

The payload (``CellPlan.payload()``) carries the backend's *resolved* run config, so a job runs
exactly the config that was validated at launch time; editing a YAML file while jobs wait in
the queue changes nothing (hydra-submitit-launcher, by contrast, re-composes the config inside
each job).

``run_cell`` rebuilds the backend's config dataclass (which validates again), checks that it
still resolves to the run directory the launcher recorded, and calls the backend's run
function, which skips a DONE run and resumes an incomplete one from its checkpoint. When the
backend fails before it could record why (an exception while building the model, a missing
CUDA device, a checkpoint refused on resume: the status is still the one an earlier attempt
wrote), ``run_cell`` writes ``FAILED`` with the exception as the reason, then re-raises
so the job itself fails (Slurm shows FAILED, ``experiments/status.py`` shows the reason); an
interrupt or a stop request (``fp8rl.runs.stop``) there records ``PREEMPTED`` instead. A state a
previous attempt left (``PREEMPTED``: "relaunch to resume") is replaced too: it would name the
wrong cause.
Everything the cell prints goes to ``<run-dir>/run.log`` (``fp8rl.runs.runlog``), one header
line per attempt, the traceback of an exception that ends it included.

``CellJob`` is the callable submitted to Slurm. It is a ``submitit.helpers.Checkpointable``:
on preemption or on the signal before the time limit, submitit calls its ``checkpoint``, which
resubmits the same payload, and Slurm requeues the array task (same job id). A requeued task
(also one requeued by hand with ``scontrol requeue``) starts the same payload again and the
backend resumes from the run directory's checkpoint; rows logged after that checkpoint are
dropped first (``RunDir.truncate_after``), so no step is logged twice.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import submitit


class CellFailed(RuntimeError):
    """The backend ended the run FAILED (its reason is the message)."""


def build_config(payload: dict):
    """The backend's validated config dataclass from a payload."""
    from fp8rl.launch.backends import BACKENDS
    from fp8rl.launch.configs import build_dataclass

    return build_dataclass(BACKENDS[payload["backend"]].load_config_class(), payload["config"])


def run_cell(payload: dict) -> dict:
    """Run (or resume, or skip) one cell; returns the backend's summary.

    The cell's run directory is taken first (``fp8rl.runs.lock.own``): when another live process
    owns it, nothing is written and the summary says so (``{"skipped": True, "owned_by": ...}``),
    so a duplicate Slurm task ends cleanly and a second launcher reports the cell as running
    elsewhere. Raises :class:`CellFailed` when the run ends FAILED, and re-raises any exception
    of the backend after recording it in ``status.json``.
    """
    from fp8rl.runs.lock import RunOwned, own
    from fp8rl.runs.runlog import capture

    run_dir = Path(payload["run_dir"])
    try:
        with own(run_dir), capture(run_dir):
            return _run_owned(payload, run_dir)
    except RunOwned as e:
        return {"state": None, "skipped": True, "run_dir": str(run_dir), "reason": str(e),
                "owned_by": e.owner.describe() if e.owner else None}


def _run_owned(payload: dict, run_dir: Path) -> dict:
    from fp8rl.launch.backends import BACKENDS
    from fp8rl.runs import FAILED, PREEMPTED, TERMINAL_STATES, RunDir

    backend = BACKENDS[payload["backend"]]
    before = _status(RunDir(run_dir))  # a status this attempt did not write says nothing about it
    try:
        cfg = build_config(payload)
        resolved = Path(backend.load_resolve_run_dir()(cfg))
        if resolved != run_dir:
            raise RuntimeError(
                f"the payload's config resolves to {resolved}, not to the recorded run directory "
                f"{run_dir}: the backend's run identity changed since launch; relaunch the sweep"
            )
        summary = backend.load_run()(cfg, payload.get("overrides", ()), progress=payload.get("progress", False))
    except BaseException as e:
        rd = RunDir(run_dir)
        st = _status(rd)
        if st is None or st.get("state") not in TERMINAL_STATES or st == before:
            step = int(st.get("step", 0)) if st else 0
            with contextlib.suppress(OSError):  # a full disk: the error itself says more
                if isinstance(e, KeyboardInterrupt):  # stopped or interrupted: resumable, not failed
                    rd.set_status(PREEMPTED, step, reason=str(e) or "interrupted")
                else:
                    rd.set_status(FAILED, step, reason=f"{type(e).__name__}: {e}")
        raise
    if summary.get("state") == FAILED:
        raise CellFailed(f"{run_dir.name}: {summary.get('reason')}")
    return summary


def _status(rd) -> dict | None:
    """``status.json`` of ``rd``, None when absent or unreadable (a damaged one is rewritten)."""
    try:
        st = rd.status() if rd.status_path.exists() else None
    except (OSError, ValueError):
        return None
    return st if isinstance(st, dict) else None


def prepare_key(payload: dict):
    """The key of the one-time work a cell needs before it runs (cells with equal keys share
    it), or None when its backend has no such step."""
    from fp8rl.launch.backends import BACKENDS

    backend = BACKENDS[payload["backend"]]
    if backend.prepare is None:
        return None
    return backend.load_prepare()[0](build_config(payload))


def prepare_cell(payload: dict) -> None:
    """Do a cell's one-time work (idempotent, safe to run concurrently with the cell)."""
    from fp8rl.launch.backends import BACKENDS

    BACKENDS[payload["backend"]].load_prepare()[1](build_config(payload))


def prepare_progress_files(cells) -> dict[Path, list[int]]:
    """Where the one-time work of ``cells`` reports its progress (the backend's
    ``prepare_progress``): file -> the indices of the cells that need it. Cells without a payload
    (``CellPlan``), or whose backend has no such file, are left out."""
    from fp8rl.launch.backends import BACKENDS

    files: dict[Path, list[int]] = {}
    for c in cells:
        name = getattr(c, "backend", None)
        hook = BACKENDS[name].load_prepare_progress() if hasattr(c, "payload") and name in BACKENDS else None
        if hook is not None:
            files.setdefault(Path(hook(build_config(c.payload()))), []).append(c.index)
    return files


class CellJob(submitit.helpers.Checkpointable):
    """The submitted callable: ``CellJob()(payload)``; requeued with the same payload."""

    def __call__(self, payload: dict) -> dict:
        return run_cell(payload)
