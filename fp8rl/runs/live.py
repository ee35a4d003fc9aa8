"""Live views of a run: TensorBoard event files, and Weights & Biases when configured.

``metrics.jsonl`` and ``eval.jsonl`` are the source of truth (``analysis`` reads only them);
these are for watching runs as they go, with the viewers verl, OpenRLHF and TRL users already
use. Every row a run logs is mirrored under **the same names**: each finite number under a
namespaced name of a training row (``actor/entropy``, ``actor/clipfrac_neg_low``, ``clip/low``, ``perf/step_s``, ...)
and of an evaluation row (``eval/arith/avg@k``, ...) becomes a scalar at the row's ``step``;
other values (strings, ``null``) are left out.

- **TensorBoard** (``logging.tensorboard``, on by default): event files in
  ``<run-dir>/tensorboard/``, so ``tensorboard --logdir runs/`` shows every run of every sweep
  (named by its path). Paper-scale runs keep OpenRLHF's own TensorBoard writer in the same
  place. A resumed run opens its writer with ``purge_step`` = the first step it logs again, so
  TensorBoard drops the events of steps the interrupted attempt wrote after its checkpoint (the
  same rows ``RunDir.truncate_after`` drops from ``metrics.jsonl``).
- **W&B** (``logging.wandb_project``): ``wandb.init(project, entity, mode, name=<run dir
  name>, group=<sweep>, config=<the run's config>, dir=<run-dir>, resume="allow",
  id=<wandb_run_id>)``, then ``wandb.log(row, step=row["step"])``. ``mode="offline"`` writes
  files only (``wandb sync`` uploads them). The id (:func:`wandb_run_id`) is the run
  directory's name plus 8 hex digits of its sweep directory's absolute path, so the same cell
  in two sweeps (or two runs roots) gets two W&B runs instead of one overwriting the other;
  it is written to ``<run-dir>/wandb_id.txt`` the first time and read back on every resume,
  so a resumed run, also one whose sweep directory was moved, continues the same W&B run.

Choices: a writer failure (disk full, W&B down) is reported once on stderr and that view is
switched off; the run itself goes on, since its record is ``metrics.jsonl``.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from fp8rl.runs.metrics import STEP
from fp8rl.runs.safe_io import atomic_write_bytes

TENSORBOARD_DIR = "tensorboard"
#: Where a run keeps its W&B id (written once, read on every resume).
WANDB_ID_FILE = "wandb_id.txt"


def wandb_run_id(run_dir: str | Path) -> str:
    """The run's W&B id: stored in ``<run-dir>/wandb_id.txt``, else ``<run dir name>-<8 hex of
    the sweep directory's absolute path>`` (then stored), unique per sweep directory and cell."""
    run_dir = Path(run_dir)
    f = run_dir / WANDB_ID_FILE
    if f.is_file():
        stored = f.read_text(encoding="ascii").strip()
        if stored:
            return stored
    sweep_dir = run_dir.absolute().parent
    rid = f"{run_dir.name}-{hashlib.sha256(str(sweep_dir).encode()).hexdigest()[:8]}"
    atomic_write_bytes(f, (rid + "\n").encode("ascii"))
    return rid


def scalars(row: Mapping) -> dict[str, float]:
    """The finite numbers of a row under namespaced names (``ns/...``; so ``step`` and an eval
    row's bookkeeping ``k``/``n`` are left out, as are booleans)."""
    out = {}
    for k, v in row.items():
        if "/" not in k or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[k] = float(v)
    return out


def order_event_files_before_now(tb_dir: Path, now: float | None = None) -> int:
    """Rename the event files in ``tb_dir`` so that a writer opened now sorts after all of them;
    returns how many seconds they were moved back (0: nothing renamed).

    TensorBoard reads a run's event files in name order, and a name starts with the second its
    file was opened (``events.out.tfevents.<seconds>.<host>.<pid>...``). A resumed writer must sort
    after the interrupted attempt's file, or a reader applies that attempt's events after the
    resume's purge (duplicate steps). When an existing file is stamped at or after the current
    second (opened in the same second, or by an attempt on a node whose clock ran ahead), every
    existing file is renamed that many seconds earlier (their order kept), instead of waiting on
    the wall clock (which, an hour ahead, would stall the resume for an hour). Only the resuming
    run's owner calls this, so no writer has these files open."""
    files = []
    for p in tb_dir.glob("events.out.tfevents.*"):
        parts = p.name.split(".")
        if len(parts) > 3 and parts[3].isdigit():
            files.append((int(parts[3]), p))
    now_s = int(time.time() if now is None else now)
    if not files or max(s for s, _ in files) < now_s:
        return 0
    shift = max(s for s, _ in files) - now_s + 1
    for stamp, p in sorted(files):  # oldest first: a new name never meets one not yet renamed
        parts = p.name.split(".")
        parts[3] = f"{max(0, stamp - shift):010d}"
        p.rename(p.with_name(".".join(parts)))
    if shift > 1:  # a clock that ran ahead (the same second is the common case: not worth a line)
        print(f"{tb_dir}: {len(files)} TensorBoard event file(s) stamped up to {shift - 1} s ahead of this "
              f"machine's clock renamed {shift} s earlier, so that the resumed run's file sorts after them",
              file=sys.stderr, flush=True)
    return shift


class _TensorBoard:
    def __init__(self, run_dir: Path, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if purge_step is not None:
            order_event_files_before_now(run_dir / TENSORBOARD_DIR)
        self.w = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=purge_step, flush_secs=10)

    def log(self, row: Mapping) -> None:
        step = int(row[STEP])
        for k, v in scalars(row).items():
            self.w.add_scalar(k, v, global_step=step)

    def close(self) -> None:
        self.w.close()


class _Wandb:
    def __init__(self, run_dir: Path, cfg, config: Mapping | None) -> None:
        import wandb

        self.run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, mode=cfg.wandb_mode,
                              name=run_dir.name, id=wandb_run_id(run_dir), group=run_dir.parent.name,
                              config=dict(config or {}), dir=str(run_dir), resume="allow", reinit="create_new")

    def log(self, row: Mapping) -> None:
        self.run.log(scalars(row), step=int(row[STEP]))

    def close(self) -> None:
        self.run.finish()


class LiveLog:
    """The live views of one run (see the module docstring); a no-op when all are off.

    Args:
        run_dir: the run directory.
        cfg: a ``fp8rl.config.LoggingConfig``.
        resume_step: the last step already logged for good (the checkpoint's), or 0.
        config: the run's config (for W&B's run page).
    """

    def __init__(self, run_dir: str | Path, cfg, *, resume_step: int = 0, config: Mapping | None = None) -> None:
        run_dir = Path(run_dir)
        self.sinks: dict[str, object] = {}
        if cfg.tensorboard:
            self.sinks["tensorboard"] = _TensorBoard(run_dir, resume_step + 1 if resume_step else None)
        if cfg.wandb_project:
            self.sinks["wandb"] = _Wandb(run_dir, cfg, config)

    def log(self, row: Mapping) -> None:
        """Mirror one training or evaluation row (it must carry ``step``)."""
        for name in list(self.sinks):
            try:
                self.sinks[name].log(row)  # type: ignore[attr-defined]
            except Exception as e:  # a view must not end the run; metrics.jsonl has the row
                print(f"live view {name} failed ({type(e).__name__}: {e}); switching it off",
                      file=sys.stderr, flush=True)
                self._close(name)

    def _close(self, name: str) -> None:
        sink = self.sinks.pop(name)
        try:
            sink.close()  # type: ignore[attr-defined]
        except Exception as e:
            print(f"live view {name} failed to close ({type(e).__name__}: {e})", file=sys.stderr, flush=True)

    def close(self) -> None:
        for name in list(self.sinks):
            self._close(name)

    def __enter__(self) -> LiveLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
