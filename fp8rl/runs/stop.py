"""A request to stop at a safe point: what Ctrl-C asks of a running cell.

The launcher (``fp8rl.launch.interrupt``) turns the first SIGINT or SIGTERM into
:func:`request_stop` in every process that runs a cell (in a worker process through
:data:`STOP_SIGNAL`). A backend that can stop cleanly polls :func:`stop_requested` between
steps; the mini trainer then writes a checkpoint of the step it just finished, records
``PREEMPTED`` and raises :class:`RunStopped`, so the relaunch resumes exactly where it stopped.
A backend that does not poll keeps running to its end (or until the second Ctrl-C kills it;
it then resumes from its last checkpoint).

Process-wide and thread-safe (a ``threading.Event``); it needs only the standard library.
"""

from __future__ import annotations

import signal
import threading

#: The signal a launcher sends a worker process to ask its cell to stop at a safe point.
STOP_SIGNAL = signal.SIGUSR1

_STOP = threading.Event()


class RunStopped(KeyboardInterrupt):
    """A run stopped at a safe point because a stop was requested; it is resumable.

    A ``KeyboardInterrupt`` so that code which treats an interrupt as "not a failure" (the
    run is not marked FAILED, a worker ends) treats it the same way."""


def request_stop() -> None:
    """Ask the running cell(s) of this process to stop at their next safe point."""
    _STOP.set()


def stop_requested() -> bool:
    """True once :func:`request_stop` was called (until :func:`clear`)."""
    return _STOP.is_set()


def clear() -> None:
    """Forget a stop request (a launcher that is done with its cells)."""
    _STOP.clear()


def _on_stop_signal(signum, frame) -> None:  # pragma: no cover - runs in a signal handler
    request_stop()


def install_stop_signal() -> None:
    """In a worker process: :data:`STOP_SIGNAL` requests a stop; SIGINT is ignored, because a
    terminal's Ctrl-C reaches the whole process group and the launcher decides what the
    workers do (its first Ctrl-C: :data:`STOP_SIGNAL`; its second: they are killed)."""
    signal.signal(STOP_SIGNAL, _on_stop_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
