"""Fixture for tests that need the project's local Slurm cluster (``slurm/local_cluster.sh``).

Tests marked ``@pytest.mark.slurm`` use the ``slurm_cluster`` fixture. Where there is no
cluster (``SLURM_CONF`` unset or stale, Slurm clients not installed, controller down) they
skip; with ``FP8RL_REQUIRE_SLURM=1`` (set by ``.ci/run``) the same condition is a failure,
so CI cannot silently pass without having run them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

START_HINT = (
    'start it with: env_lines="$(bash slurm/local_cluster.sh start)" && eval "$env_lines" '
    "(needs root and apt-get the first time; see slurm/README.md)"
)
CLIENTS = ("sbatch", "squeue", "sacct", "scontrol", "scancel", "sinfo")


@dataclass(frozen=True)
class SlurmCluster:
    """What a test needs to know about the running cluster."""

    conf: Path
    partition: str


def slurm_required() -> bool:
    """True when a missing cluster must fail the tests instead of skipping them."""
    return os.environ.get("FP8RL_REQUIRE_SLURM", "").strip().lower() in {"1", "true", "yes"}


def find_cluster() -> tuple[SlurmCluster | None, str]:
    """Return the reachable cluster, or None and the reason there is none."""
    conf = os.environ.get("SLURM_CONF")
    if not conf:
        return None, "SLURM_CONF is not set"
    if not Path(conf).is_file():
        return None, f"SLURM_CONF={conf} does not exist"
    missing = [c for c in CLIENTS if shutil.which(c) is None]
    if missing:
        return None, f"Slurm clients not on PATH: {', '.join(missing)}"
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%P %a"], capture_output=True, text=True, timeout=15, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        return None, f"sinfo failed ({exc}); is slurmctld running?"
    default = [line.split()[0] for line in out.splitlines() if line.split()[0].endswith("*")]
    if not default:
        return None, f"no default partition in sinfo output {out!r}"
    return SlurmCluster(conf=Path(conf), partition=default[0].rstrip("*")), ""


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    cluster, reason = find_cluster()
    if cluster is None:
        msg = f"no local Slurm cluster: {reason}; {START_HINT}"
        if slurm_required():
            pytest.fail(f"FP8RL_REQUIRE_SLURM is set and {msg}", pytrace=False)
        pytest.skip(msg)
    return cluster
