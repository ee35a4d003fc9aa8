"""Malformed sweeps and overrides: each exits non-zero with a message naming what is wrong,
submits and runs nothing, and leaves the runs root (with an existing run directory) untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CASES = [
    # (id, overrides, substrings the message must contain)
    # a typo outside a sweep axis fails in Hydra's own composition, which lists the options
    ("group-typo", ["algorithm=dapoo"], ["algorithm/dapoo", "dapo", "dr_grpo", "grpo"]),
    ("sweep-file-typo", ["+sweep=main_tabel"], ["sweep/main_tabel", "main_table"]),
    ("sweep-axis-typo", ["+sweep=smoke", "fp8=bf16,tensorwse"], ["fp8", "'tensorwse'", "rowwise", "tensorwise"]),
    ("clip-typo-in-axis", ["+sweep=quick", "clip=vanilla,calibratd"], ["clip", "'calibratd'", "calibrated, no_lower_clip, score_centering, score_centering_tis, tis, vanilla, wide_lower"]),
    ("wrong-type", ["steps=abc"], ["steps", "abc"]),
    ("wrong-type-in-axis", ["+sweep=smoke", "steps=2,abc"], ["steps", "abc", "cell"]),
    ("unknown-key", ["algorithm.eps_lo=0.1"], ["eps_lo"]),
    ("dynamic-sampling-one-sample", ["algorithm=dapo", "algorithm.n_samples_per_prompt=1"],
     ["n_samples_per_prompt", "> 1"]),
    ("eps-out-of-range", ["algorithm.eps_low=1.5"], ["algorithm.eps_low", "(0, 1)"]),
    ("recipe-typo", ["fp8.trainer_recipe=tensorwsie"], ["fp8.trainer_recipe", "tensorwsie", "rowwise"]),
    ("batch-not-divisible", ["num_mini_batches=5"], ["num_mini_batches=5", "split evenly"]),
    ("kl-not-implemented", ["algorithm.kl_coef=0.1"], ["kl_coef", "algorithm.kl_coef=0"]),
    ("bad-init-bounds", ["clip=calibrated", "clip.init_bounds=[1.2,1.8]"], ["init_bounds", "0 < low < 1 < high"]),
    ("slurm-without-cluster", ["launcher=slurm"], ["cluster", "cluster=NAME", "slurm/profiles"]),
    ("missing-cluster-profile", ["launcher=slurm", "cluster=nope"], ["'nope' not found", "example", "local"]),
    ("paper-without-cluster", ["scale=paper"], ["cluster", "scale=paper", "cluster=NAME", "slurm/profiles"]),
    ("scale-backend-mismatch", ["backend=openrlhf"], ["scale", "'mini' is not served by backend 'openrlhf'", "paper"]),
    ("unknown-launcher", ["launcher=sge"], ["launcher", "'sge'", "local, local_parallel, slurm"]),
    ("zero-seeds", ["seeds=0"], ["seeds", ">= 1"]),
    ("seeds-and-seed-sweep", ["seeds=2", "seed=0,1"], ["seeds=2", "seed sweep"]),
    ("run-dir-in-sweep", ["+sweep=smoke", "run_dir=/tmp/one_dir"], ["run_dir", "4 cells"]),
    ("launch-key-as-axis", ["+sweep=smoke", "launcher=local,local_parallel"], ["launcher", "cannot be a sweep axis"]),
    ("sweep-name-path", ["sweep_name=../elsewhere"], ["sweep_name", "plain directory name"]),
    ("bad-device", ["mini.device=tpu"], ["mini.device", "'cpu' or 'cuda[:i]'"]),
]


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    """A runs root holding one finished run directory that must stay untouched."""
    rd = tmp_path / "runs" / "smoke" / "grpo-8b-bf16-vanilla-s0-0123abcd"
    rd.mkdir(parents=True)
    (rd / "status.json").write_text(json.dumps({"state": "DONE", "step": 4, "reason": None}))
    (rd / "metrics.jsonl").write_text('{"step": 1}\n')
    return tmp_path / "runs"


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if any launcher is asked to run or submit anything."""
    from fp8rl.launch.launchers import LAUNCHERS, LaunchResult

    calls = []
    for name in LAUNCHERS:
        monkeypatch.setattr(LAUNCHERS[name], "launch",
                            lambda *a, _n=name, **k: calls.append(_n) or LaunchResult())
    return calls


@pytest.mark.parametrize(("overrides", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_launch_bad_input_is_refused(launch, snapshot, runs_root, no_launch, overrides, expected):
    before = snapshot(runs_root)
    res = launch(*overrides, f"output_dir={runs_root}")
    msg = res.err + res.out
    assert res.code != 0, msg
    for s in expected:
        assert s in msg, f"{s!r} not in message:\n{msg}"
    assert no_launch == []
    assert snapshot(runs_root) == before


def test_launch_unwritable_run_root(launch, snapshot, tmp_path, no_launch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    before = snapshot(tmp_path)
    res = launch("+sweep=smoke", f"output_dir={blocker}/runs")
    assert res.code != 0
    assert "is not a directory" in res.err and "output_dir" in res.err
    assert no_launch == [] and snapshot(tmp_path) == before


def test_launch_malformed_profile_names_the_field(launch, tmp_path, no_launch):
    prof = tmp_path / "mine.yaml"
    prof.write_text("partition: gpu\nresources: {default: {nodes: 1}}\ngpus: 8\n")
    res = launch("launcher=slurm", f"cluster={prof}", f"output_dir={tmp_path}/runs")
    assert res.code != 0
    assert "unknown field(s) ['gpus']" in res.err and str(prof) in res.err
    assert no_launch == [] and not (tmp_path / "runs").exists()


def test_launch_every_invalid_cell_is_reported(launch, tmp_path, no_launch):
    """Two bad axis values in one sweep: both are named, with the cell indices."""
    res = launch("+sweep=smoke", "fp8=bf16,tensorwse", "clip=vanilla,calibratd", f"output_dir={tmp_path}/runs")
    assert res.code != 0
    assert "'tensorwse'" in res.err and "'calibratd'" in res.err
    assert "cell " in res.err and "/4" in res.err
    assert no_launch == [] and not (tmp_path / "runs").exists()
