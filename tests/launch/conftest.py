"""Helpers for the launch tests: run ``experiments.launch`` in this process, snapshot trees.

Running the Hydra app in-process (``sys.argv`` patched, ``SystemExit`` caught) keeps each
test at Hydra-composition speed instead of paying torch's import in a subprocess every time.
The Slurm fixture is the one of ``tests/slurm/conftest.py`` (loaded by path: the tests
directory is not a package), so skip/require behave the same (``FP8RL_REQUIRE_SLURM``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_spec = importlib.util.spec_from_file_location("_fp8rl_slurm_conftest", REPO / "tests" / "slurm" / "conftest.py")
_slurm = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _slurm
_spec.loader.exec_module(_slurm)
find_cluster = _slurm.find_cluster
slurm_required = _slurm.slurm_required


@pytest.fixture(scope="session")
def slurm_cluster():
    cluster, reason = find_cluster()
    if cluster is None:
        msg = f"no local Slurm cluster: {reason}; {_slurm.START_HINT}"
        if slurm_required():
            pytest.fail(f"FP8RL_REQUIRE_SLURM is set and {msg}", pytrace=False)
        pytest.skip(msg)
    return cluster


@dataclass
class LaunchResult:
    code: int
    out: str
    err: str


def run_launch(args: list[str], capsys) -> LaunchResult:
    """``python -m experiments.launch ARGS`` in this process; returns exit code and output."""
    import experiments.launch as launch

    old = sys.argv
    sys.argv = ["experiments/launch.py", *args]
    code = 0
    try:
        launch.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old
    cap = capsys.readouterr()
    return LaunchResult(code, cap.out, cap.err)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """``{relative path: (size, mtime_ns)}`` of every file and directory under ``root``."""
    out = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(name="snapshot")
def snapshot_fixture():
    return snapshot


@pytest.fixture
def launch(capsys):
    def _run(*args: str) -> LaunchResult:
        return run_launch(list(args), capsys)

    return _run
