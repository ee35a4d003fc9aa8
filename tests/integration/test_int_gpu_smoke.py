"""``benchmarks/gpu_paper_smoke.py --dry-run``: the GPU script's path (ZeRO-3, conversion, guard,
shadow, steps) on CPU, so the prepared script is known to run before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from int_paths import REPO

pytestmark = pytest.mark.integration


def test_gpu_paper_smoke_dry_run(integration_ready, tmp_path):
    out = tmp_path / "smoke.json"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                                 os.path.join(sys.prefix, "torch_extensions"))}
    res = subprocess.run([sys.executable, "benchmarks/gpu_paper_smoke.py", "--dry-run", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["zero_stage"] == 3
    assert set(report["recipes"]) == {"bf16", "tensorwise", "blockwise"}
    assert report["recipes"]["tensorwise"]["fp8_layers"] == report["recipes"]["blockwise"]["fp8_layers"] == 14
    assert report["recipes"]["bf16"]["fp8_layers"] == 0
