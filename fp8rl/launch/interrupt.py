"""Ctrl-C and SIGTERM during a blocking launch: stop cleanly, say where the sweep stands.

:class:`Interrupt` is installed (main thread only) while a blocking launcher runs its cells:

- **first** SIGINT or SIGTERM: a stop request (``fp8rl.runs.stop``). No new cell starts; running
  cells stop at their next safe point: a mini cell checkpoints the step it just finished and
  records ``PREEMPTED`` (in a worker process the launcher forwards the request with
  ``fp8rl.runs.stop.STOP_SIGNAL``; the workers ignore the terminal's SIGINT themselves). One line
  says so and that a second Ctrl-C stops at once;
- **second**: ``KeyboardInterrupt`` in the launcher, which kills its worker processes at once
  (their cells resume from their last checkpoint).

Either way the launch ends with :func:`summary_lines`: how many cells are DONE, which are
resumable (and at which step), which never started, and the command that resumes the sweep
from where the user stands (:func:`resume_command`: ``make reproduce`` when a make target
started it, else this interpreter as the user's shell finds it, ``.venv/bin/python`` when its
environment is not active, and the same arguments); the exit status is ``128 + signal`` (130 for Ctrl-C). No traceback.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from fp8rl.procenv import python_command
from fp8rl.runs import stop as _stop


class Interrupt:
    """Signal handling for one launch (module docstring). ``level``: 0 nothing, 1 stopping
    (first signal), 2 stop at once (second); ``signum`` the first signal."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, name: str = "", on_stop: Callable[[], None] | None = None) -> None:
        self.name = name
        self.level = 0
        self.signum: int | None = None
        self.on_stop = on_stop
        self._saved: dict[int, object] = {}

    @property
    def exit_status(self) -> int:
        return 128 + int(self.signum or signal.SIGINT)

    def describe(self) -> str:
        return "Ctrl-C" if self.signum in (None, signal.SIGINT) else signal.Signals(self.signum).name

    def _handle(self, signum, frame) -> None:
        self.level += 1
        if self.level == 1:
            self.signum = signum
            _stop.request_stop()
            from fp8rl.launch.progress import echo

            head = f"[{self.name}] " if self.name else ""
            echo(f"{head}stopping ({self.describe()}): no new cell starts; running cells stop after "
                 "their current step and keep a checkpoint. Ctrl-C again to stop at once")
            if self.on_stop is not None:
                self.on_stop()
            return
        raise KeyboardInterrupt

    def __enter__(self) -> Interrupt:
        _stop.clear()
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._saved[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._saved.items():
            signal.signal(s, old)
        self._saved.clear()
        _stop.clear()


#: Set by the Makefile's targets that launch sweeps (``FP8RL_RESUME="make reproduce"``): the
#: command that resumes from where the user stands is then that make command.
RESUME_ENV = "FP8RL_RESUME"


def resume_command(argv: list[str] | None = None) -> str:
    """The command line that relaunches this sweep from where the user stands: the make target
    that started it (:data:`RESUME_ENV`), else :func:`python_command` ``-m experiments.launch``
    with the same arguments."""
    via = os.environ.get(RESUME_ENV, "").strip()
    if via:
        return via
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join([python_command(), "-m", "experiments.launch", *args])


def summary_lines(plan, how: str, argv: list[str] | None = None) -> list[str]:
    """Where ``plan``'s cells stand after an interrupted launch, and how to resume it."""
    from fp8rl.runs import DONE, FAILED, PREEMPTED, RunDir

    done, resumable, failed, new = [], [], [], []
    for c in plan.cells:
        rd = RunDir(Path(c.run_dir))
        try:
            st = rd.status() if rd.path.exists() else None
        except (OSError, ValueError) as e:  # a damaged status.json (named, with its fix)
            failed.append((c, str(e)))
            continue
        state = (st or {}).get("state")
        if state == DONE:
            done.append(c)
        elif state == FAILED:
            failed.append((c, st.get("reason") or "no reason recorded"))
        elif state is None:
            new.append(c)
        else:  # PREEMPTED, or RUNNING left by a process killed at once: both resume
            resumable.append((c, int(st.get("step") or 0), state == PREEMPTED))
    head = f"[{plan.sweep_name}] " if plan.sweep_name else ""
    out = [f"{head}stopped ({how}): {len(done)} of {len(plan.cells)} cell(s) DONE, {len(resumable)} "
           f"resumable, {len(new)} not started" + (f", {len(failed)} FAILED" if failed else "")]
    for c, step, stopped in resumable:
        how_far = (f"stopped at step {step}/{c.steps}" if stopped else
                   f"killed at step {step}/{c.steps}, resumes from its last checkpoint")
        out.append(f"  resumable: {Path(c.run_dir).name} ({how_far})")
    for c, reason in failed:
        out.append(f"  FAILED: {Path(c.run_dir).name}: {reason}")
    if resumable or new or failed:
        out.append(f"resume with: {resume_command(argv)}")
    return out
