"""Sweep-level progress: cells done k/N, the running cells' steps, elapsed time and ETA.

It reads the cells' ``status.json`` files (``fp8rl.runs.RunDir``), so it works for any backend
and any local launcher without a callback into the training loop. ETA: the steps still to go
divided by the step rate measured since the display started (steps that were already done
when it started, e.g. resumed runs, do not count towards the rate).

On a terminal it is a progress bar redrawn in place (fraction of all steps, cells finished,
what each running cell is at, ETA); otherwise (logs, CI) a text line is printed when a cell
starts or ends and at most every ``every_s`` seconds in between.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from fp8rl.runs import DONE, FAILED, RunDir


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = round(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class SweepProgress:
    """Polls the run directories of ``cells`` (objects with ``run_dir`` and ``steps``)."""

    def __init__(self, cells: Sequence, *, name: str = "", stream=None, every_s: float = 10.0,
                 interval_s: float = 1.0, workers: int | None = None, bar_width: int = 24) -> None:
        self.cells = list(cells)
        self.name = name
        self.workers = workers
        self.bar_width = bar_width
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self.interval_s = interval_s
        self.total_steps = sum(max(int(c.steps), 1) for c in self.cells)
        self.t0 = time.monotonic()
        self.steps0 = self.done_steps()[0]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_print = 0.0
        self._last_key: tuple = ()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def done_steps(self) -> tuple[int, int, int, list[str]]:
        """``(steps done over all cells, cells DONE, cells FAILED, running cell descriptions)``."""
        steps = done = failed = 0
        running = []
        for c in self.cells:
            exists = Path(c.run_dir).exists()
            st = RunDir(Path(c.run_dir)).status() if exists else None
            if st is None:
                if exists:  # the backend set the directory up and is preparing (e.g. a warm start)
                    running.append(f"cell {c.index}/{c.total} {Path(c.run_dir).name} preparing")
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
                running.append(f"cell {c.index}/{c.total} {Path(c.run_dir).name} step {step}/{c.steps}")
        return steps, done, failed, running

    def line(self) -> tuple[str, tuple]:
        steps, done, failed, running = self.done_steps()
        elapsed = time.monotonic() - self.t0
        rate = (steps - self.steps0) / elapsed if elapsed > 0 else 0.0
        eta = (self.total_steps - steps) / rate if rate > 0 else None
        head = f"[{self.name}] " if self.name else ""
        finished = done + failed == len(self.cells)
        run = "; ".join(running) if running else ("done" if finished else "starting")
        fail = f", {failed} FAILED" if failed else ""
        if self.tty:
            filled = round(self.bar_width * steps / max(self.total_steps, 1))
            bar = "#" * filled + "." * (self.bar_width - filled)
            pct = 100.0 * steps / max(self.total_steps, 1)
            text = (f"{head}[{bar}] {pct:3.0f}% {done + failed}/{len(self.cells)} cells{fail} | "
                    f"{_fmt(elapsed)} ETA {_fmt(eta)} | {run}")
        else:
            text = (f"{head}{done + failed}/{len(self.cells)} cells finished{fail} | {run} | "
                    f"elapsed {_fmt(elapsed)} ETA {_fmt(eta)}")
        return text, (done, failed, tuple(r.rsplit(" step ", 1)[0].removesuffix(" preparing") for r in running))

    def show(self, force: bool = False) -> None:
        text, key = self.line()
        now = time.monotonic()
        if self.tty:
            import shutil

            self.stream.write("\r\033[K" + text[: max(40, shutil.get_terminal_size().columns - 1)])
            self.stream.flush()
        elif force or key != self._last_key or now - self._last_print >= self.every_s:
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
        self._thread = threading.Thread(target=self._loop, name="sweep-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.show(force=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
