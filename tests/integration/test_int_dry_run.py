"""The paper-scale dry run prints every main-table cell, and each printed command passes
OpenRLHF 0.11.2's own argument parser and validation block (defects 6 and 8 visible there)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from int_paths import REPO

pytestmark = pytest.mark.integration


def test_every_main_table_command_passes_openrlhfs_parser(scenario, tmp_path):
    cmd = [sys.executable, "-m", "experiments.launch", "+sweep=main_table", "scale=paper", "cluster=example",
           "dry_run=true", f"output_dir={tmp_path / 'runs'}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "90 cell(s) valid" in out.stdout
    lines = [ln.split("openrlhf:", 1)[1].strip() for ln in out.stdout.splitlines() if ln.strip().startswith("openrlhf:")]
    assert len(lines) == 90
    r = scenario("cli_parse", timeout=300, lines=lines)
    assert r["errors"] == [] and len(r["parsed"]) == 90
    dapo = [p for p in r["parsed"] if p["dynamic_filtering"]]
    grpo = [p for p in r["parsed"] if not p["dynamic_filtering"]]
    assert len(dapo) == len(grpo) == 45
    for p in dapo:  # DAPO: L_max 20,480 with the 4,096 overlong buffer; episodes for 200 steps
        assert p["max_new_tokens"] == 20480 and p["overlong_buffer_len"] == 4096 and p["eps"] == [0.2, 0.28]
        assert p["num_episodes"] == 5 and p["max_samples"] == 17000
    for p in grpo:
        assert p["max_new_tokens"] == 16384 and p["num_episodes"] == 1 and p["max_samples"] == 200 * 128
