"""Sweep-level progress: cells done k/N, the running cells' steps, elapsed time and ETA.

It reads the cells' ``status.json`` files (``fp8rl.runs.RunDir``), so it works for any backend
and any local launcher without a callback into the training loop. ETA: the steps still to go
at the average step rate since the first training step the display saw (the warm-start phase
before it and the steps of resumed runs do not count towards the rate; "ETA after the warm
start" until then), never negative (a cell restarted from step 0 does not make the rate fall).
While warm starts train (before their cells can), each has a bar (terminal) or a part of the
line (elsewhere) with its own steps and ETA, read from its progress file (``prep_bars``).

- **On a terminal**: one tqdm bar (share of all steps, cells finished, elapsed, ETA, what the
  running cells are at), redrawn in place and trimmed to the terminal's width as it changes.
  Messages of the launcher while the bar is up (:func:`echo`, Python warnings, ``logging``
  records) are printed above it, each on its own lines, wrapped to the width (as the terminal
  would wrap them anyway, so that the redrawn bar never lands inside a message).
- **Elsewhere** (a pipe, a log file, CI; or ``TERM=dumb``): no bar and no control characters,
  a plain line when a cell starts or ends and at most every ``every_s`` seconds in between.

The launcher's messages and its stop summary also go to ``<sweep dir>/launch.log``, and a
console whose reader died (``| tee`` killed by the same Ctrl-C) falls back to the terminal
(:class:`ConsoleStream`), so neither the summary nor the stop itself is lost.

:func:`console` gives the launcher a stream on the terminal that stays there while a cell run
in the launching process sends file descriptors 1 and 2 to its ``run.log``
(``fp8rl.runs.runlog``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from fp8rl.runs import DONE, FAILED, RunDir

_CURRENT: SweepProgress | None = None
_CONSOLE = None


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = round(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def is_terminal(stream) -> bool:
    """A stream a bar may be drawn on: a terminal, and not ``TERM=dumb``."""
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
    return tty and os.environ.get("TERM", "") != "dumb"


class ConsoleStream:
    """The launcher's console: a text stream that outlives its reader.

    Under ``make reproduce 2>&1 | tee log`` a Ctrl-C kills ``tee`` too, and the next write to
    standard error fails (``EPIPE``). Raised in the launcher (in its signal handler, say), that
    would end it mid-stop and leave its cells RUNNING (then DIED). Here a failed write switches
    the stream once to the controlling terminal (``/dev/tty``), where the person who pressed
    Ctrl-C still sees the summary, or, without one, drops the output. Every line of
    :func:`echo` also goes to :func:`log` (the sweep's ``launch.log``) when one is open."""

    def __init__(self, stream, close: bool) -> None:
        self._stream, self._close, self._switched = stream, close, False

    def _fallback(self) -> None:
        old, close = self._stream, self._close
        self._stream, self._close = None, False
        if close:
            with contextlib.suppress(OSError):
                old.close()
        if not self._switched:
            self._switched = True
            with contextlib.suppress(OSError):
                self._stream = open("/dev/tty", "w", buffering=1, encoding="utf-8", errors="replace")
                self._close = True

    def write(self, text: str) -> int:
        for _ in range(2):
            if self._stream is None:
                return len(text)
            try:
                self._stream.write(text)
                self._stream.flush()
                return len(text)
            except (OSError, ValueError):  # EPIPE / EIO: the reader is gone
                self._fallback()
        return len(text)

    def flush(self) -> None:
        if self._stream is not None:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._fallback()

    def isatty(self) -> bool:
        return self._stream is not None and is_terminal(self._stream)

    def fileno(self) -> int:
        if self._stream is None:
            raise OSError("the console is closed")
        return self._stream.fileno()

    def close(self) -> None:
        if self._close and self._stream is not None:
            with contextlib.suppress(OSError):
                self._stream.close()
        self._stream = None


_LOG = None


@contextlib.contextmanager
def console(log_path: str | os.PathLike | None = None) -> Iterator:
    """A :class:`ConsoleStream` on this process's standard error as it is now (a duplicate of its
    file descriptor), for the launcher's own output; :func:`echo` writes there during the block,
    and appends each line to ``log_path`` too (the sweep's ``launch.log``) when given."""
    global _CONSOLE, _LOG
    old, old_log = _CONSOLE, _LOG
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # a test's capture object: it is not redirected
        stream, close = sys.stderr, False
    else:
        stream = open(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace")
        close = True
    _CONSOLE = ConsoleStream(stream, close)
    if log_path is not None:
        with contextlib.suppress(OSError):
            _LOG = open(log_path, "a", buffering=1, encoding="utf-8")
    try:
        yield _CONSOLE
    finally:
        _CONSOLE.close()
        if _LOG is not None and _LOG is not old_log:
            with contextlib.suppress(OSError):
                _LOG.close()
        _CONSOLE, _LOG = old, old_log


def log(msg: str) -> None:
    """Append ``msg`` (one or more lines) to the open ``launch.log``, stamped; nothing without one."""
    if _LOG is None:
        return
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with contextlib.suppress(OSError, ValueError):
        _LOG.write("".join(f"{stamp} {line}\n" for line in msg.rstrip("\n").splitlines()))
        _LOG.flush()


def echo(msg: str) -> None:
    """Print a launcher message: above the progress bar when one is shown, else a plain line on
    the console (:func:`console`) or standard error; and into the sweep's ``launch.log``."""
    log(msg)
    cur = _CURRENT
    if cur is not None:
        cur.write(msg)
        return
    stream = _CONSOLE or sys.stderr
    try:
        stream.write(msg + "\n")
        stream.flush()
    except (OSError, ValueError):  # standard error is gone (its reader was killed)
        pass


class SweepProgress:
    """Polls the run directories of ``cells`` (objects with ``run_dir``, ``steps``, ``index`` and
    ``total``) and shows where the sweep stands (module docstring). ``prepare_files``: the
    progress files of the cells' warm starts (default: ``fp8rl.launch.job.prepare_progress_files``
    of the cells, for ``CellPlan`` cells)."""

    def __init__(self, cells: Sequence, *, name: str = "", stream=None, every_s: float = 10.0,
                 interval_s: float = 1.0, workers: int | None = None,
                 prepare_files: Iterable[str | os.PathLike] | None = None) -> None:
        from fp8rl.launch.prep_bars import PrepBars

        self.cells = list(cells)
        if prepare_files is None:
            from fp8rl.launch.job import prepare_progress_files

            prepare_files = prepare_progress_files(self.cells)
        self.prep = PrepBars(prepare_files, _fmt)
        self.name = name
        self.workers = workers
        self.stream = stream or _CONSOLE or sys.stderr
        self.every_s = every_s
        self.interval_s = interval_s
        self.total_steps = sum(max(int(c.steps), 1) for c in self.cells)
        self.t0 = time.monotonic()
        self.steps0 = self.done_steps()[0]
        self._base: tuple[float, int] | None = None  # (time, steps) of the first step seen
        self._high = self.steps0
        self.tty = is_terminal(self.stream)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_print = 0.0
        self._last_key: tuple = ()
        self._bar = None
        self._lock = threading.RLock()
        self._saved_showwarning = None
        self._exit = contextlib.ExitStack()

    # ----- what the sweep is at -------------------------------------------------------------------

    def done_steps(self) -> tuple[int, int, int, list[tuple[int, str | None]]]:
        """``(steps done over all cells, cells DONE, cells FAILED, running cells)``; a running cell
        is ``(index, "step k/n")`` or ``(index, None)`` while its backend prepares it."""
        steps = done = failed = 0
        running: list[tuple[int, str | None]] = []
        for c in self.cells:
            exists = Path(c.run_dir).exists()
            try:
                st = RunDir(Path(c.run_dir)).status() if exists else None
            except (OSError, ValueError):  # damaged: the launcher names it; its writer replaces it
                st = None
            if st is None:
                if exists:  # the backend set the directory up and is preparing (e.g. a warm start)
                    running.append((c.index, None))
                continue
            state, step = st.get("state"), int(st.get("step") or 0)
            if state == DONE:
                done += 1
                steps += max(int(c.steps), 1)
            elif state == FAILED:
                failed += 1
                steps += max(int(c.steps), 1)  # nothing more will run
            else:
                steps += step
                running.append((c.index, f"step {step}/{c.steps}"))
        return steps, done, failed, running

    def _eta(self, steps: int) -> tuple[float, float | None]:
        """``(elapsed, ETA or None)``. The rate is measured from the first training step seen, so
        the warm-start phase before it (and resumed cells' old steps) does not dilute it; steps
        counted once and then lost (a cell restarted from step 0) count as done for the rate, so
        the ETA never runs negative; None until a step has been timed."""
        now = time.monotonic()
        elapsed = now - self.t0
        if self._base is None:
            if steps != self.steps0:  # training has begun: time from here
                self._base = (now, steps)
            return elapsed, None
        self._high = max(self._high, steps)
        t_base, s_base = self._base
        rate = (self._high - s_base) / (now - t_base) if now > t_base else 0.0
        if rate <= 0:
            return elapsed, None
        return elapsed, max(0.0, (self.total_steps - steps) / rate)

    def line(self) -> tuple[str, tuple]:
        """The plain (non-terminal) line and the key whose change prints it at once."""
        steps, done, failed, running = self.done_steps()
        elapsed, eta = self._eta(steps)
        warm = self.prep.poll()
        head = f"[{self.name}] " if self.name else ""
        finished = done + failed == len(self.cells)
        total = self.cells[0].total if self.cells else 0
        run = "; ".join(f"cell {i}/{total} {Path(self._cell(i).run_dir).name} {what or 'preparing (warm start)'}"
                        for i, what in running) if running else ("done" if finished else "starting")
        run += "".join(f" | {self.prep.text(r)}" for r in warm.values())
        fail = f", {failed} FAILED" if failed else ""
        text = (f"{head}{done + failed}/{len(self.cells)} cells finished{fail} | {run} | "
                f"elapsed {_fmt(elapsed)} ETA {_fmt(eta)}")
        return text, (done, failed, tuple(i for i, _ in running), tuple(warm))

    def _cell(self, index: int):
        return next(c for c in self.cells if c.index == index)

    # ----- terminal: a tqdm bar -------------------------------------------------------------------

    def _width(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, ValueError, OSError):
            return shutil.get_terminal_size().columns

    def _make_bar(self):
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.steps0, file=self.stream, dynamic_ncols=True,
                    smoothing=0, leave=True, unit="step", mininterval=0, ascii=False,
                    bar_format="{desc} {percentage:3.0f}%|{bar}| [{elapsed}]{postfix}")

    def _update_bar(self) -> None:
        steps, done, failed, running = self.done_steps()
        fail = f" {failed} FAILED" if failed else ""
        desc = f"{self.name} {done + failed}/{len(self.cells)} cells{fail}".strip()
        eta = self._eta(steps)[1]
        warm = self.prep.poll()
        post = ", ".join([f"ETA {_fmt(eta)}" if eta is not None else
                          ("ETA after the warm start" if warm or any(w is None for _, w in running) else "ETA ?")]
                         + [f"#{i} {what or 'warm start'}" for i, what in running])
        with self._lock:
            bar = self._bar
            if bar is None:
                return
            bar.n = steps
            bar.set_description_str(desc, refresh=False)
            bar.set_postfix_str(post, refresh=False)
            bar.refresh()
            self.prep.draw(self.stream, warm)

    def write(self, msg: str) -> None:
        """Print ``msg`` above the bar (terminal, wrapped to its width) or as plain lines."""
        with self._lock:
            if self._bar is None:
                self.stream.write(msg.rstrip("\n") + "\n")
                self.stream.flush()
                return
            width = max(20, self._width())
            lines = []
            for raw in msg.rstrip("\n").splitlines() or [""]:
                lines += textwrap.wrap(raw, width=width, subsequent_indent="  ", break_long_words=True,
                                       break_on_hyphens=False, replace_whitespace=False) or [""]
            self._bar.write("\n".join(lines), file=self.stream)

    def _showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        self.write(warnings.formatwarning(message, category, filename, lineno, line).rstrip())

    # ----- both -----------------------------------------------------------------------------------

    def show(self, force: bool = False) -> None:
        if self.tty:
            self._update_bar()
            return
        text, key = self.line()
        now = time.monotonic()
        if force or key != self._last_key or now - self._last_print >= self.every_s:
            with self._lock:
                self.stream.write(text + "\n")
                self.stream.flush()
            self._last_print = now
        self._last_key = key

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.show()
            except Exception:  # a half-written status file must not kill the display
                pass

    def __enter__(self) -> SweepProgress:
        global _CURRENT
        if self.tty:
            self._bar = self._make_bar()
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._exit.enter_context(logging_redirect_tqdm(loggers=[logging.root]))
            self._saved_showwarning = warnings.showwarning
            warnings.showwarning = self._showwarning
            self._update_bar()
        _CURRENT = self
        self._thread = threading.Thread(target=self._loop, name="sweep-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        global _CURRENT
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self.show(force=True)
        if _CURRENT is self:
            _CURRENT = None
        if self._saved_showwarning is not None:
            warnings.showwarning = self._saved_showwarning
            self._saved_showwarning = None
        self._exit.close()
        with self._lock:
            self.prep.close()
            if self._bar is not None:
                self._bar.close()
                self._bar = None
