"""Relaunching an interrupted run: what its killed attempt left behind, what is kept, what goes.

A run can be killed at any moment (SIGKILL, SIGTERM, preemption, a crash of the machine). The
relaunch holds the run directory alone (``fp8rl.runs.lock.own``), so nothing else writes it,
and it does one of two things:

- **With a checkpoint** it resumes from it: ``RunDir.truncate_after`` drops the rows the killed
  attempt logged after the checkpoint's step, and TensorBoard purges those steps
  (``fp8rl.runs.live``).
- **Without one** (killed before its first checkpoint) nothing can be continued: the run
  restarts from step 0, and :func:`discard_outputs` first drops everything the killed attempt
  wrote after ``RunDir.init``: ``metrics.jsonl``, ``eval.jsonl``, ``summary.json``,
  ``samples/``, ``tensorboard/``. They are moved into one folder (``.discarded/`` in the run
  directory), which is then deleted. A kill in the middle of that leaves either outputs of an
  attempt without checkpoint, which the next relaunch discards again, or the folder, which it
  deletes: the restarted run never logs after rows of the attempt it replaces. ``config.yaml``,
  ``overrides.txt``, ``provenance.json`` (which records the attempts), ``owner.json`` and
  ``status.json`` stay.

In both cases :func:`remove_stale_temps` first deletes the temporary files of atomic writes
the kill interrupted (``state.pt.tmp*`` of a checkpoint write, ``.<name>.*.tmp`` of
``fp8rl.runs.jsonl.atomic_write_text``: ``.step_*.jsonl.*.tmp`` of a samples file too) in the run
directory, ``checkpoint/`` and ``samples/``. The
replaced file was never touched by such a write (it is swapped in by ``os.replace`` only
when complete), so a temporary file is never the checkpoint and is ignored when resuming; each
removal prints one line naming the file.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from fp8rl.runs.live import TENSORBOARD_DIR
from fp8rl.runs.rundir import EVAL_FILE, METRICS_FILE, SAMPLES_DIR, SUMMARY_FILE, RunDir

#: What a run writes after ``RunDir.init``; a restart from step 0 discards it.
OUTPUTS: tuple[str, ...] = (METRICS_FILE, EVAL_FILE, SUMMARY_FILE, SAMPLES_DIR, TENSORBOARD_DIR)
#: Names of the temporary files of atomic writes (see :func:`is_temp`).
TEMP_NAMES = (re.compile(r"[^.].*\.tmp[a-z0-9_]{8}"), re.compile(r"\..+\.[a-z0-9_]{8}\.tmp"))
#: The folder outputs are moved into before they are deleted.
DISCARDED_DIR = ".discarded"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def is_temp(path: Path) -> bool:
    """A temporary file of an atomic write: ``<name>.tmp<random>`` (``mkstemp`` with the
    destination's name and ``.tmp`` as prefix, as checkpoints are written) or
    ``.<name>.<random>.tmp`` (``atomic_write_text``); ``<random>`` is ``mkstemp``'s 8 characters."""
    return path.is_file() and any(p.fullmatch(path.name) for p in TEMP_NAMES)


def remove_stale_temps(rd: RunDir) -> list[Path]:
    """Delete the temporary files interrupted atomic writes left in the run directory, its
    ``checkpoint/`` and ``samples/`` (the caller owns the run, so no write is in progress);
    returns them."""
    removed = []
    for d in (rd.path, rd.checkpoint_dir, rd.samples_dir):
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if is_temp(p):
                p.unlink()
                removed.append(p)
                _say(f"{rd.path.name}: removed {p.relative_to(rd.path)}, the unfinished temporary file of "
                     "a write the previous attempt was killed in (the file it was to replace is intact)")
    return removed


def _has_content(p: Path) -> bool:
    return p.is_file() or (p.is_dir() and any(p.iterdir()))


def discard_outputs(rd: RunDir) -> list[str]:
    """For a restart from step 0: drop what an earlier attempt wrote after ``RunDir.init``
    (:data:`OUTPUTS`), atomically as a whole (module docstring); returns the names dropped.
    ``samples/`` is left in place, empty, as ``RunDir.init`` makes it."""
    trash = rd.path / DISCARDED_DIR
    if trash.exists():  # an earlier discard was killed before it finished
        shutil.rmtree(trash)
    found = [name for name in OUTPUTS if _has_content(rd.path / name)]
    if found:
        lines = rd.metrics_path.read_bytes().count(b"\n") if rd.metrics_path.is_file() else 0
        _say(f"{rd.path.name}: no checkpoint to resume from; restarting the run from step 0 and "
             f"discarding what the interrupted attempt wrote ({', '.join(found)}; {lines} line(s) of "
             f"{METRICS_FILE})")
        trash.mkdir()
        for name in found:
            (rd.path / name).replace(trash / name)
        shutil.rmtree(trash)
    rd.samples_dir.mkdir(exist_ok=True)
    return found
