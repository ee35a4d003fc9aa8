"""Support subprocesses started ahead of the integration tests that read them (conftest ``scenarios_ahead``).

Imported by the conftest and the tests as ``int_ahead``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

from int_paths import REPO, SUPPORT


@dataclass(frozen=True)
class Job:
    """A support subprocess whose recorded result a test module's fixture returns.

    ``kind``: ``scenario`` (``support/scenarios.py NAME``: Ray, DeepSpeed ranks, OpenRLHF's actors),
    ``vllm`` (``support/vllm_cpu.py NAME``: vLLM's CPU build) or ``script`` (``support/NAME.py OUT
    PARAMS_JSON``, a job of its own, e.g. a whole launch); ``needed_by``: the fixture or
    the test function that reads it (a selected test that uses the fixture, or is the function,
    starts it); ``expected_s``: about how long it runs (the longest start first)."""

    needed_by: str
    kind: str
    name: str
    params: dict = field(default_factory=dict)
    timeout_s: float = 600.0  # against a hang: under load on 2 cores a job takes several times expected_s
    expected_s: float = 60.0

    def run(self, out):
        import torch

        out.mkdir(parents=True, exist_ok=True)
        if self.kind == "scenario":
            (out / "params.json").write_text(json.dumps(self.params))
            cmd, env = [sys.executable, str(SUPPORT / "scenarios.py"), self.name, str(out), f"@{out / 'params.json'}"], None
        elif self.kind in ("vllm", "script"):
            script = "vllm_cpu.py" if self.kind == "vllm" else f"{self.name}.py"
            cmd = [sys.executable, str(SUPPORT / script), *([self.name] if self.kind == "vllm" else []), str(out),
                   json.dumps(self.params)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), str(REPO)])}
        else:
            raise ValueError(f"Job kind {self.kind!r} must be 'scenario', 'vllm' or 'script'")
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=self.timeout_s, env=env)
        assert res.returncode == 0, f"{' '.join(cmd[:3])} failed ({res.returncode}):\n" \
                                    f"{res.stdout[-2000:]}\n{res.stderr[-6000:]}"
        return torch.load(out / "result.pt", weights_only=False)


class Ahead:
    """The support subprocesses of the session's selected tests, started when the session starts,
    ``jobs`` at a time (conftest ``AHEAD_JOBS``), the longest first.

    A test module declares them as ``AHEAD = {key: Job(...)}``; a fixture (or test) reads one with
    ``scenarios_ahead.result(request, key)``. Each is a subprocess that also waits part of its time
    (Ray's start-up, a bounded hang, one single-threaded engine): another runs meanwhile, and the
    tests go on with the results that are ready. A job whose fixture no selected test uses is not
    run; one not started ahead runs when it is asked for."""

    def __init__(self, items, tmp_path_factory, jobs: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        wanted: dict[tuple[str, str], Job] = {}
        for item in items:
            for key, job in getattr(getattr(item, "module", None), "AHEAD", {}).items():
                if job.needed_by in item.fixturenames or job.needed_by == getattr(item, "originalname", None):
                    wanted[(item.module.__name__, key)] = job
        self.pool = ThreadPoolExecutor(max_workers=max(1, jobs)) if wanted else None
        self.futures = {}
        for (module, key), job in sorted(wanted.items(), key=lambda kv: -kv[1].expected_s):
            self.futures[(module, key)] = self.pool.submit(job.run, tmp_path_factory.mktemp(key))

    def result(self, request, key: str):
        """The recorded result of the module's job ``key`` (run now if it was not started ahead)."""
        future = self.futures.get((request.module.__name__, key))
        if future is not None:
            return future.result()
        return request.module.AHEAD[key].run(request.getfixturevalue("tmp_path_factory").mktemp(key))

    def close(self) -> None:
        if self.pool is not None:
            for f in self.futures.values():
                f.cancel()
            self.pool.shutdown(wait=True)
