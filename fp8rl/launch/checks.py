"""Expand-time checks of values that types and ranges of single fields do not catch.

``fp8rl.launch.grid.plan_sweep`` calls these for every cell before anything runs or is written,
so a value that would hang a launcher or break a run mid-way is refused up front, naming the key,
the bad value and the valid values:

- :func:`launch_value_errors`: launch fields (``array_parallelism``: an integer >= 1 or null;
  0 or a negative number would make submitit's pool wait for ever or silently fall back);
- :func:`cell_value_errors`: the built run config (``fp8.name``: one of the known arms, since it
  names the run directory and the analysis reads it as the arm; ``mini.device``: a CUDA device
  this machine has, when the cell runs here).
"""

from __future__ import annotations

import re
from typing import Any

_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")
#: Launchers that run the cells on this machine (their devices must exist here).
LOCAL_LAUNCHERS = ("local", "local_parallel")


def launch_value_errors(launch: dict[str, Any]) -> list[str]:
    """Problems of the sweep-wide launch fields of one cell."""
    errors = []
    ap = launch.get("array_parallelism")
    if ap is not None and (isinstance(ap, bool) or not isinstance(ap, int) or ap < 1):
        errors.append(f"array_parallelism: {ap!r} is not a number of cells at once; give an integer "
                      ">= 1, or null for the default (2 locally, the cluster profile's on Slurm)")
    return errors


def cell_value_errors(run_cfg: Any, launcher: str | None) -> list[str]:
    """Problems of one cell's built run config that its dataclass cannot see alone."""
    errors = []
    device = getattr(getattr(run_cfg, "mini", None), "device", None)
    if isinstance(device, str) and launcher in LOCAL_LAUNCHERS:
        msg = _missing_device(device)
        if msg:
            errors.append(msg)
    return errors


def _missing_device(device: str) -> str | None:
    m = _CUDA_RE.match(device)
    if m is None:
        return None
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(m.group(1) or 0)
    if index < count:
        return None
    valid = "cpu" + (f", cuda, cuda:0 .. cuda:{count - 1}" if count else "")
    return (f"mini.device: {device!r} does not exist on this machine ({count} CUDA device(s)); "
            f"valid values here: {valid}")
