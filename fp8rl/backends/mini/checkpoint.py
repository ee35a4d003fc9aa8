"""The mini trainer's checkpoint file, ``<run-dir>/checkpoint/state.pt``: safe to write, safe to load.

**What it holds**: tensors (model, optimizer moments, the torch RNG state, a calibration
pool) and plain data (ints, floats, strings, lists, tuples, dicts: step, counters, history,
clip state, the Python RNG state), in ``torch.save``'s zip format. Nothing else, so it loads
with ``torch.load(weights_only=True)``, whose unpickler builds only those types.

**Loading never runs code from the file.** A run directory can come from someone else (a
copied or downloaded run); ``torch.load(weights_only=False)`` would unpickle whatever the file
asks for (``os.system`` included). :func:`load_state` refuses, with one line naming the file,
a file that is not in the zip format (damaged, or a plain pickle), one that holds objects
other than tensors and plain data, a damaged one and one that lacks the checkpoint's keys; a
symlink in its place is refused too (``RunDirSymlink``). Checkpoints written before this
module hold the same types and load unchanged. :func:`check_logged` refuses a resume whose
``metrics.jsonl`` lacks rows the checkpoint covers (emptied or cut): they cannot be made again.

**Saving** is atomic (``fp8rl.runs.safe_io``): a temporary ``state.pt.tmp*`` beside it,
fsynced, renamed over it. On a full disk the previous checkpoint stays whole and
``RunDirWriteError`` says so; relaunching resumes from it.
"""

from __future__ import annotations

import shlex
import zipfile
from pathlib import Path

import torch

from fp8rl.runs.safe_io import atomic_write_with, refuse_symlink

#: Keys every checkpoint holds (``MiniTrainer.save_checkpoint``).
STATE_KEYS = ("step", "model", "optimizer", "clipper", "bad_steps", "skipped_updates", "history",
              "torch_rng", "python_rng")


class CheckpointRefused(RuntimeError):
    """A checkpoint that is not loaded: damaged, not ours, or would run code. The message names
    the file, why, and the two ways on: restore the checkpoint from a copy (the cell resumes
    from its step), or delete it and relaunch (the cell runs again from step 0; the trainer then
    drops the rows logged before, ``fp8rl.runs.relaunch``). ``checkpoint``: the ``state.pt`` to
    restore or delete (``path`` itself unless the refused file is another, ``metrics.jsonl``)."""

    def __init__(self, path: Path, why: str, checkpoint: Path | None = None) -> None:
        ckpt = Path(checkpoint or path)
        fix = (f"restore {path.name} from a copy to resume from the checkpoint's step, or delete the "
               f"checkpoint (rm {shlex.quote(str(ckpt))}) and relaunch to run the cell again from step 0")
        super().__init__(f"{path}: refused to resume: {why}. To go on, {fix} (resume only run "
                         "directories you wrote)")
        self.path, self.checkpoint = Path(path), ckpt


def save_state(path: str | Path, state: dict) -> None:
    """Atomically write ``state`` (tensors and plain data) to ``path``."""
    atomic_write_with(path, lambda f: torch.save(state, f), prefix=Path(path).name + ".tmp", suffix="")


def load_state(path: str | Path, device: torch.device | str) -> dict:
    """The checkpoint at ``path``, loaded without unpickling anything but tensors and plain data.

    Raises :class:`CheckpointRefused` (see the module docstring) or ``RunDirSymlink``.
    """
    path = Path(path)
    refuse_symlink(path)
    if not zipfile.is_zipfile(path):
        raise CheckpointRefused(path, "it is not in the format fp8rl writes (damaged: truncated, emptied "
                                      "or overwritten; or a plain pickle, which is never unpickled)")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        if "weights_only" in str(e) or "WeightsUnpickler" in str(e):
            raise CheckpointRefused(path, "it holds objects other than tensors and plain data, whose "
                                          "unpickling could run code; it was not unpickled") from e
        raise CheckpointRefused(path, f"it is damaged ({_first_line(e)})") from e
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointRefused(path, f"it lacks {missing}: it is damaged or not a mini-trainer checkpoint")
    return state


def check_logged(metrics_path: Path, rows: list[dict], step: int, checkpoint: Path | None = None) -> None:
    """Refuse to resume from the checkpoint of ``step`` when ``metrics.jsonl`` lacks rows it
    covers (steps ``1..step``: the file was emptied or cut): going on would leave them out
    for good, and the tables would read a run that silently skipped steps."""
    logged = {r.get("step") for r in rows}
    missing = [s for s in range(1, step + 1) if s not in logged]
    if missing:
        shown = f"{missing[0]}-{missing[-1]}" if len(missing) > 1 else str(missing[0])
        raise CheckpointRefused(metrics_path, f"it lacks the rows of steps {shown} that the checkpoint of "
                                              f"step {step} covers (the file was emptied or cut)", checkpoint)


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}"
