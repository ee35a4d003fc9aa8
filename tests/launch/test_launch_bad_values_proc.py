"""A bad value on the command line is one short block naming it and the fix, never Hydra's text.

``fp8=fp9`` and ``steps=abc`` used to print Hydra's multi-line answer: its config search path,
the options one per line and the ``HYDRA_FULL_ERROR`` hint. Single-valued overrides are now
checked before Hydra composes (``fp8rl.launch.values``), and a sweep's invalid cells are printed
without Hydra's hint (``fp8rl.launch.sweep.run_sweep``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HYDRA_TEXT = ("HYDRA_FULL_ERROR", "Config search path", "provider=", "Traceback", "Error merging override")

CASES = [
    # (id, overrides, what the message must hold)
    ("group-value", ["fp8=fp9"], ["fp8=fp9", "'fp9' is not an option of config group fp8",
                                  "valid values: bf16, blockwise, fp32, mxfp4, mxfp6, mxfp8, nvfp4, nvfp4_rn, rollout_only, rowwise, tensorwise, "
                                  "tensorwise_delayed, w4a16"]),
    ("sweep-file", ["+sweep=main_tabel"], ["+sweep=main_tabel", "config group sweep", "did you mean main_table?"]),
    ("group-typo", ["algorithm=dapoo"], ["'dapoo'", "dapo, dr_grpo, grpo", "did you mean dapo?"]),
    ("int-type", ["steps=abc"], ["steps=abc: steps takes an integer, got 'abc'", "e.g. steps="]),
    ("int-float", ["steps=1.5"], ["steps=1.5: steps takes an integer, got '1.5'"]),
    ("float-type", ["lr=fast"], ["lr=fast: lr takes a number, got 'fast'"]),
    ("bool-type", ["dry_run=maybe"], ["dry_run=maybe: dry_run takes true or false, got 'maybe'", "dry_run=false"]),
    ("optional-int", ["array_parallelism=two"], ["array_parallelism takes an integer or null, got 'two'"]),
    ("not-null", ["steps=null"], ["steps=null: steps cannot be null"]),
    ("in-a-sweep-axis", ["+sweep=smoke", "fp8=bf16,fp9"], ["cell 3/4", "fp8: unknown value 'fp9'", "valid values"]),
    ("type-in-a-sweep-axis", ["+sweep=smoke", "steps=2,abc"], ["cell", "steps", "abc"]),
]


@pytest.mark.parametrize(("overrides", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_value_is_one_short_block_without_hydras_text(launch, tmp_path, overrides, expected):
    res = launch(*overrides, "dry_run=true", f"output_dir={tmp_path}/runs")
    msg = res.err + res.out
    assert res.code in (1, 2), msg
    for s in expected:
        assert s in msg, f"{s!r} not in message:\n{msg}"
    for s in HYDRA_TEXT:
        assert s not in msg, f"{s!r} in message:\n{msg}"
    assert len(msg.strip().splitlines()) <= 3, msg
    assert msg.startswith("Error: ") and "nothing was run, submitted or written" in msg, msg
    assert not (tmp_path / "runs").exists()


def test_a_bad_group_value_from_the_real_command(tmp_path):
    """As a user runs it: a subprocess, exit status 1, three lines on standard error."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "experiments.launch", "fp8=fp9", "steps=abc",
                           f"output_dir={tmp_path}/runs"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3, proc.stderr  # the heading and one line per bad value
    assert lines[1].strip().startswith("fp8=fp9: 'fp9' is not an option of config group fp8") and "bf16" in lines[1]
    assert lines[2].strip().startswith("steps=abc: steps takes an integer, got 'abc'")
    assert not any(s in proc.stderr for s in HYDRA_TEXT), proc.stderr
    assert proc.stdout == "" and not (tmp_path / "runs").exists()
