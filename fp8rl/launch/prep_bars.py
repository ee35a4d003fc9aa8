"""The sweep display's view of one-time preparations: a bar per warm start, with its own ETA.

Before its cells can train, a mini sweep trains one SFT warm start per model slot (minutes
each; ``fp8rl.backends.mini.sft``). The cells' ``status.json`` files say nothing then, so the
display (``fp8rl.launch.progress.SweepProgress``) also reads the progress files those warm
starts write (``fp8rl.runs.prep_progress``; the backend's ``prepare_progress`` hook names each
cell's, ``fp8rl.launch.job.prepare_progress_files``) and shows, for each one at work:

- on a terminal, a bar of its own under the sweep's bar: ``warm start 8b  45%|████| 360/800,
  ETA 3:10`` (its steps and an ETA at its own rate); the bars go once no warm start is at work;
- elsewhere, a part of the plain line: ``warm start 8b 360/800 ETA 3:10``.

A file that is missing, half-written or left by a process that is gone shows nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from fp8rl.runs import prep_progress


class PrepBars:
    """The preparations whose progress files are ``files``; ``fmt`` formats seconds."""

    def __init__(self, files: Iterable[Path], fmt: Callable[[float | None], str]) -> None:
        self.files = list(dict.fromkeys(Path(f) for f in files))
        self.fmt = fmt
        self._bars: dict[Path, object] = {}

    def poll(self) -> dict[Path, dict]:
        """File -> record of each preparation at work now, in the order of ``files``."""
        records = {f: prep_progress.read(f) for f in self.files}
        return {f: r for f, r in records.items() if prep_progress.active(r)}

    def text(self, record: dict) -> str:
        """``warm start 8b 360/800 ETA 3:10``."""
        return f"{record['label']} {record['step']}/{record['steps']} ETA {self.fmt(prep_progress.eta_s(record))}"

    def draw(self, stream, at_work: dict[Path, dict]) -> None:
        """Create or update a tqdm bar per preparation ``at_work`` (:meth:`poll`) on ``stream``,
        below the sweep's bar; close them all when none is at work any more."""
        from tqdm import tqdm

        if not at_work:
            self.close()
            return
        for f, r in at_work.items():
            bar = self._bars.get(f)
            if bar is None:
                bar = self._bars[f] = tqdm(
                    total=r["steps"], initial=r["step"], desc=r["label"], file=stream, position=len(self._bars) + 1, leave=False,
                    dynamic_ncols=True, mininterval=0, smoothing=0, unit="step", ascii=False,
                    bar_format="{desc} {percentage:3.0f}%|{bar}| {n}/{total}{postfix}")
            bar.n = r["step"]
            bar.set_description_str(r["label"], refresh=False)
            bar.set_postfix_str(f"ETA {self.fmt(prep_progress.eta_s(r))}", refresh=False)
            bar.refresh()
        for f, bar in self._bars.items():  # seen at work before, not now: finished or stopped
            if f not in at_work:
                r = prep_progress.read(f)
                bar.n = r["step"] if r else bar.total
                bar.set_postfix_str("stopped" if r else "done", refresh=False)
                bar.refresh()

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()
