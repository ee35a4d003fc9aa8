"""A warm start that stops resumes: the SFT loop's partial state and its progress, beside the cache.

While the cache entry ``<cache_dir>/<key>/`` (``fp8rl.backends.mini.sft``) is being trained,
``<cache_dir>/<key>.partial/`` holds

- ``state.pt``: the key, the step, the weights, AdamW's moments, the learning-rate schedule,
  the batch sampler's RNG state and torch's (and CUDA's on a GPU), and the losses so far; saved
  every tenth of the SFT steps (:data:`SAVES`) and when a stop is requested (the first Ctrl-C of
  a direct run, the launcher's Ctrl-C or SIGTERM), tensors and plain data only, atomically, with
  the digest of its tensors (``checkpoint.save_state``; checked with the CRC-32s on load);
- ``progress.json``: the step, the steps and when (``fp8rl.runs.prep_progress``), rewritten
  every hundredth of the steps (:data:`REPORTS`); the launcher's display draws a bar from it.

A later warm start with the same key (under the same lock) restores that state and trains only
the steps left: the same batches, the same updates, so the finished entry (``model.pt``,
``meta.json``) is the same, bit for bit, as an uninterrupted warm start's
(``tests/mini/test_mini_sft_resume.py`` stops a real one with SIGINT and compares). A
``state.pt`` recorded for another key (a directory copied or renamed by hand), of other steps,
or that does not load (damaged, bit rot) is not used: the warm start trains from step 0 (and
says so when it shows progress). The partial directory is removed once the finished entry is
written.

Where we chose: saves every tenth of the steps (a killed process loses at most that; a save is
1.3 MB and 20-28 ms for ``8b``, 2.8 MB and 24-28 ms for ``32b``, docs/mini.md); a state that cannot be
used is trained again rather than refused, because a warm start is deterministic and cheaper
than a person's time deciding what to do with it.
"""

from __future__ import annotations

import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from fp8rl.runs import prep_progress

#: how many times a warm start saves its state (every ``ceil(steps / SAVES)`` steps)
SAVES = 10
#: how many times it rewrites its progress file (every ``max(1, steps // REPORTS)`` steps)
REPORTS = 100
STATE_KEYS = ("key", "step", "steps", "model", "optimizer", "scheduler", "python_rng", "torch_rng",
              "cuda_rng", "losses")


def partial_dir(entry: str | Path) -> Path:
    """``<cache_dir>/<key>.partial``: the partial state of the cache entry ``<cache_dir>/<key>``."""
    entry = Path(entry)
    return entry.with_name(entry.name + ".partial")


def progress_path(entry: str | Path) -> Path:
    """The progress file of the warm start building ``entry`` (what the launcher's display reads)."""
    return partial_dir(entry) / "progress.json"


class _Unusable(ValueError):
    """Why a saved partial state is not used (it is trained again instead)."""


class SftPartial:
    """The partial state and progress of one warm start (``entry``: the cache entry it builds,
    ``key``: its cache key); ``show``: a progress bar and messages on standard error."""

    def __init__(self, entry: str | Path, key: str, slot: str, steps: int, *, show: bool = False) -> None:
        self.dir, self.key, self.steps, self.show = partial_dir(entry), key, int(steps), show
        self.label = f"warm start {slot}"
        self.save_every = max(1, math.ceil(self.steps / SAVES))
        self.report_every = max(1, self.steps // REPORTS)
        self.started, self.step0, self._bar = time.time(), 0, None

    @property
    def state_path(self) -> Path:
        return self.dir / "state.pt"

    # ----- the state ------------------------------------------------------------------------------

    def resume(self, model, opt, sched, rng: random.Random, losses: list[float]) -> int:
        """Restore the saved state into the loop's objects; the step to go on from (0: none)."""
        state = self._load(next(model.parameters()).device)
        step = 0
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            rng.setstate(state["python_rng"])
            torch.set_rng_state(state["torch_rng"])
            if state["cuda_rng"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(state["cuda_rng"])
            losses[:] = [float(x) for x in state["losses"]]
            step = int(state["step"])
            self._say(f"{self.label}: resuming from step {step}/{self.steps} ({self.dir})")
        self.started, self.step0 = time.time(), step
        return step

    def _load(self, device) -> dict | None:
        from fp8rl.backends.mini.checkpoint import (
            DIGEST_KEY,
            check_crc,
            load_tensors,
            refuse_mismatch,
        )

        path = self.state_path
        if not path.is_file() or path.is_symlink():
            return None
        why = None
        try:  # tensors and plain data only, never unpickled otherwise; digest and CRC-32s checked
            state = load_tensors(path, device, _Unusable)
            missing = [k for k in (*STATE_KEYS, DIGEST_KEY) if not isinstance(state, dict) or k not in state]
            if missing:
                raise _Unusable(f"it lacks {missing}")
            refuse_mismatch(state, state.pop(DIGEST_KEY), _Unusable)
            check_crc(path, _Unusable)
            if state["key"] != self.key:
                why = f"it was saved for the warm start {state['key']}, not {self.key}"
            elif int(state["steps"]) != self.steps or not 0 < int(state["step"]) <= self.steps:
                why = f"its step {state['step']}/{state['steps']} does not fit {self.steps} steps"
        except _Unusable as e:
            why = f"it does not load ({e})"
        if why is not None:
            self._say(f"{self.label}: {path} not used: {why}; training from step 0")
            return None
        return state

    def save(self, step: int, model, opt, sched, rng: random.Random, losses: list[float]) -> None:
        """Atomically write the loop's state after ``step`` steps."""
        from fp8rl.backends.mini.checkpoint import save_state

        state = {"key": self.key, "step": int(step), "steps": self.steps, "model": model.state_dict(),
                 "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "python_rng": rng.getstate(),
                 "torch_rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state() if next(model.parameters()).is_cuda else None,
                 "losses": list(losses)}
        self.dir.mkdir(parents=True, exist_ok=True)
        save_state(self.state_path, state)  # atomic, with the digest of its tensors (checkpoint.py)

    # ----- the loop's calls -----------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """The loop starts at ``step``: progress file and bar."""
        if self.steps == 0:  # nothing to train: nothing to show
            return
        self._report(step, prep_progress.RUNNING)
        if self.show:
            from tqdm import tqdm

            self._bar = tqdm(total=self.steps, initial=step, desc=self.label, unit="step", dynamic_ncols=True,
                             file=sys.stderr, smoothing=0)

    def after_step(self, step: int, model, opt, sched, rng: random.Random, losses: list[float]) -> None:
        """``step`` steps are done: save every :attr:`save_every`, report every :attr:`report_every`."""
        if step % self.save_every == 0 and step < self.steps:
            self.save(step, model, opt, sched, rng, losses)
        if step % self.report_every == 0 or step == self.steps:
            self._report(step, prep_progress.RUNNING)
        if self._bar is not None:
            self._bar.update(1)

    def stop(self, step: int, model, opt, sched, rng: random.Random, losses: list[float]) -> str:
        """A stop was requested before step ``step + 1``: save (when a step was trained) and
        return the message of the stop."""
        if step > 0:
            self.save(step, model, opt, sched, rng, losses)
        self._report(step, prep_progress.STOPPED)
        return (f"stopped on request at step {step}/{self.steps} of the SFT warm start; it resumes from "
                f"there on relaunch")

    def end(self, step: int) -> None:
        """The loop ended (finished, stopped or failed): the bar closes, the file says stopped
        unless it finished (it is removed with the partial directory then)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if step < self.steps and prep_progress.active(prep_progress.read(self.dir / "progress.json")):
            self._report(step, prep_progress.STOPPED)

    def discard(self) -> None:
        """The finished entry is written: remove the partial state and progress."""
        shutil.rmtree(self.dir, ignore_errors=True)

    def _report(self, step: int, state: str) -> None:
        prep_progress.write(self.dir / "progress.json", label=self.label, step=step, steps=self.steps,
                            state=state, started=self.started, step0=self.step0)

    def _say(self, msg: str) -> None:
        if self.show:
            print(msg, file=sys.stderr, flush=True)
