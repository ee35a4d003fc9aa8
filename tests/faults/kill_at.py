"""Test-only: run the mini CLI and kill it at a named point (``tests/faults/test_faults_resume_proc.py``).

``python tests/faults/kill_at.py POINT SIGNAL [mini CLI args ...]`` patches one function of the
mini backend in this process, then runs ``python -m fp8rl.backends.mini``'s ``main`` with the
remaining arguments. At ``POINT`` the process sends itself ``SIGNAL`` (``KILL`` or ``TERM``),
as a scheduler or an operator would. Nothing in the package knows about this: the patches live
here, so an unpatched run has no hook at all.

Points (``k`` counts from 1):

- ``step:k``: as step ``k`` starts (everything of step ``k - 1`` is logged);
- ``checkpoint:k``: inside the ``k``-th checkpoint write, after the state is written to the
  temporary file and before it replaces ``state.pt``;
- ``metrics:k``: inside the append of step ``k``'s row to ``metrics.jsonl``, after half of the
  line is written and flushed;
- ``samples:k``: inside the write of step ``k``'s ``samples/step_*.jsonl``, after its temporary
  file is written and before it is renamed into place;
- ``summary``: after the last step (its metrics and evaluation are logged), before
  ``summary.json`` and the DONE status are written.

If the process survives the signal (a handler that stops gracefully), the patched function
goes on as the real one would: the signal arrived in the middle of it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def _die(sig: signal.Signals) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), sig)


def install(point: str, sig: signal.Signals) -> None:
    """Patch the function where ``point`` lies so that it sends ``sig`` there."""
    from fp8rl.backends.mini.checkpoint import CHECKPOINT_FILE
    from fp8rl.backends.mini.trainer import MiniTrainer
    from fp8rl.runs import jsonl
    from fp8rl.runs.rundir import METRICS_FILE, RunDir

    name, _, arg = point.partition(":")
    k = int(arg) if arg else 0
    if name == "step":
        train_step = MiniTrainer.train_step

        def step_then_die(self, step):
            if step == k:
                _die(sig)
            return train_step(self, step)

        MiniTrainer.train_step = step_then_die
    elif name == "checkpoint":
        from fp8rl.backends.mini import checkpoint

        atomic_write_with, seen = checkpoint.atomic_write_with, [0]

        def save_then_die(path, write, **kw):
            if Path(path).name != CHECKPOINT_FILE:
                return atomic_write_with(path, write, **kw)
            seen[0] += 1

            def write_then_die(f):
                write(f)
                if seen[0] == k:
                    f.flush()
                    _die(sig)

            return atomic_write_with(path, write_then_die, **kw)

        checkpoint.atomic_write_with = save_then_die
    elif name == "metrics":
        write = jsonl.JsonlWriter.write

        def append_then_die(self, row):
            if self.path.name == METRICS_FILE and row.get("step") == k:
                line = json.dumps(jsonl.to_jsonable(row), allow_nan=False) + "\n"
                data = line.encode()
                os.write(self._fd, data[: len(data) // 2])
                _die(sig)
                os.write(self._fd, data[len(data) // 2:])
                self.last_step = k
                return None
            return write(self, row)

        jsonl.JsonlWriter.write = append_then_die
    elif name == "samples":
        from fp8rl.runs import safe_io

        atomic_write_text = jsonl.atomic_write_text

        def write_then_die(path, text):
            if Path(path).name != f"step_{k:06d}.jsonl":
                return atomic_write_text(path, text)

            def write(f):
                f.write(text.encode())
                f.flush()
                _die(sig)

            return safe_io.atomic_write_with(path, write)

        jsonl.atomic_write_text = write_then_die
    elif name == "summary":
        write_summary = RunDir.write_summary

        def die_then_summary(self, summary):
            _die(sig)
            return write_summary(self, summary)

        RunDir.write_summary = die_then_summary
    else:
        raise SystemExit(f"kill_at.py: unknown point {point!r} (step:k, checkpoint:k, metrics:k, samples:k, "
                         "summary)")


def main(argv: list[str]) -> int:
    point, sig, *args = argv
    install(point, signal.Signals[f"SIG{sig}"])
    from fp8rl.backends.mini.__main__ import main as mini_main

    return mini_main(args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
