"""What a process of this project knows about how it was started, shared by the launcher and the
backends (neither imports the other: ``fp8rl.launch`` runs backends, backends never import
``fp8rl.launch``; ``tests/test_import_layers.py`` keeps it so).

- :func:`python_command`: how to start this interpreter from the user's shell (resume lines);
- :data:`LOCAL_GPUS_ENV`: a local cell's GPU count while it runs (set by the ``local`` launcher for
  a ``scheduler: local`` cluster profile, read by the paper-scale backend as its allocation).
"""

from __future__ import annotations

import os
import shutil
import sys

__all__ = ["LOCAL_GPUS_ENV", "python_command"]

#: Environment variable holding a local cell's GPU count while it runs (set by the ``local``
#: launcher for a ``scheduler: local`` profile; read by backends as their allocation).
LOCAL_GPUS_ENV = "FP8RL_GPUS_PER_NODE"


def python_command() -> str:
    """How to start this interpreter from the user's shell: ``python`` when that name finds it
    (its virtual environment is active, or it is the ``python`` on ``PATH``), else its path,
    relative to the working directory when under it (``.venv/bin/python``). A virtual
    environment's ``bin/python`` is named, not the system interpreter it links to: only the
    former imports the project's dependencies."""
    exe = os.path.abspath(sys.executable)
    if sys.prefix != sys.base_prefix:  # a virtual environment: its own bin/python, links unresolved
        venv_python = os.path.join(sys.prefix, "bin", "python")
        exe = venv_python if os.path.exists(venv_python) else exe
        active = os.environ.get("VIRTUAL_ENV")
        if active and os.path.realpath(active) == os.path.realpath(sys.prefix) and shutil.which("python"):
            return "python"
    else:
        found = shutil.which("python")
        if found and os.path.realpath(found) == os.path.realpath(exe):
            return "python"
    rel = os.path.relpath(exe)
    return rel if not rel.startswith("..") else exe
