"""The mini trainer's checkpoint file, ``<run-dir>/checkpoint/state.pt``: safe to write, safe to load.

``CheckpointMixin`` (a mixin of ``MiniTrainer``) saves the trainer's state into it and restores it
(``save_checkpoint``, ``load_checkpoint``); the functions below are the file's format and checks.

**What it holds**: tensors (model, optimizer moments, the torch RNG state, a calibration
pool, the quantizer state of a stochastically rounding recipe: ``quant_state``) and plain data (ints, floats, strings, lists, tuples, dicts: step, counters, history,
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

**Bit rot is refused, not trained on.** ``torch.load`` does not check the zip's CRC-32s, so a
flipped bit in a weight or an Adam moment would load silently and change every later number.
Each checkpoint carries a digest of its tensors (``digest``: SHA-256 of every tensor's dtype,
shape and bytes, by its dotted name, :func:`tensor_digests`), computed from the tensors in
memory as they are saved; :func:`load_state` recomputes it and refuses a mismatch naming the
tensors, and it also checks the CRC-32 of every member of the zip (the plain data: step,
history, RNG state). The SFT warm-start cache (``sft.py``) uses the same loader and keeps its
digest in ``meta.json``. A checkpoint written before digests existed loads after the CRC check,
with one line saying it carries no digest. The digest reads the tensors only: no trained
number changes.

**Saving** is atomic (``fp8rl.runs.safe_io``): a temporary ``state.pt.tmp*`` beside it,
fsynced, renamed over it. On a full disk the previous checkpoint stays whole and
``RunDirWriteError`` says so; relaunching resumes from it.
"""

from __future__ import annotations

import hashlib
import io
import random
import shlex
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from fp8rl.quant.rounding import model_quantizer_state
from fp8rl.runs.safe_io import atomic_write_with, refuse_symlink

#: The checkpoint's file name in the run directory's ``checkpoint/``.
CHECKPOINT_FILE = "state.pt"
#: Keys every checkpoint holds (``CheckpointMixin.save_checkpoint``).
STATE_KEYS = ("step", "model", "optimizer", "clipper", "bad_steps", "skipped_updates", "history",
              "torch_rng", "python_rng")
#: The key of a checkpoint's tensor digest (absent in checkpoints written before digests).
DIGEST_KEY = "digest"
#: The key of the policy's quantizer state (``fp8rl.quant.rounding.QuantizerState``: the seeded
#: generator of stochastic rounding), present when its recipe rounds stochastically (``nvfp4``).
QUANT_STATE_KEY = "quant_state"



class CheckpointRefused(RuntimeError):
    """A checkpoint that is not loaded: damaged, not ours, or would run code. The message names
    the file, why, and the two ways on: restore the checkpoint from a copy (the cell resumes
    from its step), or delete it and relaunch (the cell runs again from step 0; the trainer then
    drops the rows logged before, ``fp8rl.runs.relaunch``). ``checkpoint``: the ``state.pt`` to
    restore or delete (``path`` itself unless the refused file is another, ``metrics.jsonl``)."""

    def __init__(self, path: Path, why: str, checkpoint: Path | None = None) -> None:
        ckpt = Path(checkpoint or path)
        fix = (f"restore {path.name} from a copy to resume from the checkpoint's step, or delete it and relaunch: "
               f"the cell restarts from step 0 and runs again the steps it logged (rm {shlex.quote(str(ckpt))})")
        super().__init__(f"{path}: refused to resume: {why}. To go on, {fix} (resume only run "
                         "directories you wrote)")
        self.path, self.checkpoint = Path(path), ckpt


def _tensors(obj: object, name: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(dotted name, tensor)`` of every tensor in nested dicts, lists and tuples, in order."""
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{name}.{k}" if name else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{name}.{i}" if name else str(i))


def tensor_digests(obj: object) -> dict[str, str]:
    """SHA-256 (hex) of each tensor in ``obj`` (dtype, shape and bytes), by dotted name
    (``model.norm.weight``, ``optimizer.state.0.exp_avg``). Reads the tensors, changes nothing."""
    out = {}
    for name, t in _tensors(obj):
        h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}|".encode())
        flat = t.detach().cpu().contiguous().reshape(-1)
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy())
        out[name] = h.hexdigest()
    return out


def digest_mismatch(obj: object, digest: dict) -> list[str]:
    """Names whose tensor differs from ``digest`` (or that one of the two lacks); [] when equal."""
    now = tensor_digests(obj)
    return sorted(k for k in now.keys() | digest.keys() if now.get(k) != digest.get(k))


def save_state(path: str | Path, state: dict) -> None:
    """Atomically write ``state`` (tensors and plain data) to ``path``, with its tensor digest."""
    state = {**state, DIGEST_KEY: tensor_digests(state)}
    atomic_write_with(path, lambda f: f.write(saved_bytes(state)), prefix=Path(path).name + ".tmp", suffix="")


def saved_bytes(obj: object) -> memoryview:
    """``torch.save(obj)``'s bytes, made in memory: written to a file by torch, a full disk surfaces
    as torch's ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``; written by
    us, as the ``OSError`` (ENOSPC) that ``RunDirWriteError`` names."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getbuffer()


def load_tensors(path: Path, device: torch.device | str, refuse: Callable[[str], Exception]) -> object:
    """``torch.load(path, weights_only=True)`` of a file fp8rl wrote; a file that is not a zip, or
    holds more than tensors and plain data, or fails to load raises ``refuse(why)`` (one line, never
    torch's own advice to load it with ``weights_only=False``). Check :func:`check_crc` after the
    digest (which names the tensors) for the rest of the file."""
    refuse_symlink(path)
    if not zipfile.is_zipfile(path):
        raise refuse("it is not in the format fp8rl writes (damaged: truncated, emptied or overwritten; "
                     "or a plain pickle, which is never unpickled)")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        if "weights_only" in str(e) or "WeightsUnpickler" in str(e):
            # from None: the chained cause is torch's message, whose advice to retry with
            # weights_only=False would run the file's code; a run.log traceback must not repeat it
            raise refuse("it holds objects other than tensors and plain data, whose unpickling could "
                         "run code; it was not unpickled") from None
        raise refuse(f"it is damaged ({_first_line(e)})") from e


def check_crc(path: Path, refuse: Callable[[str], Exception]) -> None:
    """Raise ``refuse(why)`` unless every member of the zip at ``path`` matches its CRC-32
    (``torch.load`` does not check them)."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except Exception as e:  # a damaged directory or member header
        raise refuse(f"it is damaged ({_first_line(e)})") from e
    if bad is not None:
        raise refuse(f"it is damaged: the bytes of its member {bad} do not match their CRC-32 (bit rot "
                     "on disk, a bad copy)")


def refuse_mismatch(obj: object, digest: object, refuse: Callable[[str], Exception]) -> None:
    """Raise ``refuse(why)`` when the tensors of ``obj`` do not match ``digest``."""
    if not isinstance(digest, dict):
        raise refuse(f"its tensor digest is damaged (a {type(digest).__name__}, not a mapping)")
    bad = digest_mismatch(obj, digest)
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise refuse(f"its tensors do not match the digest written with them ({shown}): the file changed "
                     "after it was written (bit rot on disk, a bad copy)")


def say_no_digest(path: Path, what: str) -> None:
    """One line for a file written before digests: loaded, its tensors unchecked."""
    print(f"{path}: {what} written before tensor digests: loaded after a CRC-32 check of the file; its "
          "tensors carry no digest to check", file=sys.stderr, flush=True)


def load_state(path: str | Path, device: torch.device | str) -> dict:
    """The checkpoint at ``path``, loaded without unpickling anything but tensors and plain data,
    its CRC-32s and tensor digest checked.

    Raises :class:`CheckpointRefused` (see the module docstring) or ``RunDirSymlink``.
    """
    path = Path(path)

    def refuse(why: str) -> CheckpointRefused:
        return CheckpointRefused(path, why)

    state = load_tensors(path, device, refuse)
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointRefused(path, f"it lacks {missing}: it is damaged or not a mini-trainer checkpoint")
    if DIGEST_KEY in state:
        refuse_mismatch(state, state.pop(DIGEST_KEY), refuse)
    else:
        say_no_digest(path, "a checkpoint")
    check_crc(path, refuse)
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


def restore_quant_state(policy: torch.nn.Module, state: dict, path: Path) -> None:
    """Restore the policy's quantizer state (stochastic rounding's generator) from ``state``; a
    policy that rounds stochastically refuses a checkpoint without one (it would draw other noise)."""
    quant_state = model_quantizer_state(policy)
    if quant_state is None:
        return
    if QUANT_STATE_KEY not in state:
        raise CheckpointRefused(path, f"it holds no {QUANT_STATE_KEY!r} but the policy rounds stochastically: the "
                                      "resumed run would draw other rounding noise than the run that wrote it")
    quant_state.load_state_dict(state[QUANT_STATE_KEY])


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}"


class CheckpointMixin:
    """``checkpoint_path``, ``save_checkpoint``, ``load_checkpoint`` of ``MiniTrainer``; needs
    ``run_dir``, ``device``, ``policy``, ``optimizer``, ``clipper``, ``engine``, ``step``,
    ``bad_steps``, ``skipped_updates`` and ``history`` on the instance."""

    def checkpoint_path(self) -> Path | None:
        return None if self.run_dir is None else Path(self.run_dir.checkpoint_dir) / CHECKPOINT_FILE

    def save_checkpoint(self) -> None:
        path = self.checkpoint_path()
        if path is None:
            return
        state = {  # tensors and plain data only: loads with weights_only (load_state)
            "step": self.step, "model": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
            "clipper": self.clipper.state_dict(), "bad_steps": self.bad_steps,
            "skipped_updates": self.skipped_updates, "history": self.history,
            "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
        }
        quant_state = model_quantizer_state(self.policy)
        if quant_state is not None:  # the rounding noise resumes where it stopped
            state[QUANT_STATE_KEY] = quant_state.state_dict()
        save_state(path, state)

    def load_checkpoint(self) -> bool:
        """Restore the latest checkpoint if there is one; True if restored. A damaged or foreign
        ``state.pt`` is refused, never unpickled (``checkpoint.load_state``)."""
        path = self.checkpoint_path()
        if path is None or not (path.exists() or path.is_symlink()):
            return False
        state = load_state(path, self.device)
        check_logged(self.run_dir.metrics_path, self.run_dir.read_metrics(), int(state["step"]), path)
        self.policy.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.clipper.load_state_dict(state["clipper"])
        self.step, self.bad_steps = int(state["step"]), int(state["bad_steps"])
        self.skipped_updates, self.history = int(state["skipped_updates"]), list(state["history"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        restore_quant_state(self.policy, state, path)
        self.engine.sync(self.policy)
        return True
