"""Unknown keys and config groups stop a launch before anything runs (exit 2, one message naming
the key and the nearest valid ones); every key the sweeps and the docs use still passes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from fp8rl.launch.keys import (
    SWEEPS_DIR,
    cli_groups,
    cli_overrides,
    config_groups,
    override_key_errors,
    unknown_composed_keys,
)

REPO = Path(__file__).resolve().parents[2]

CASES = [
    # (id, overrides, substrings the message must contain)
    ("plus-typo", ["+stepz=3"], ["'stepz'", "did you mean steps"]),
    ("plus-near-miss", ["+step=10"], ["'step'", "did you mean steps"]),
    ("hydra-launcher", ["hydra/launcher=submitit_slurm"], ["hydra/launcher=submitit_slurm", "launcher=slurm",
                                                           "local, local_parallel, slurm"]),
    ("nested-typo", ["clip.epslow=0.1"], ["'clip.epslow'", "algorithm.eps_low"]),
    ("nested-typo-plus", ["+clip.epslow=0.1"], ["'clip.epslow'", "algorithm.eps_low"]),
    ("plain-typo", ["stepz=3"], ["'stepz'", "steps"]),
    ("settings-typo", ["mini.num_thread=1"], ["'mini.num_thread'", "mini.num_threads"]),
    ("typo-in-sweep", ["+sweep=smoke", "+stepz=3,4"], ["'stepz'", "steps"]),
    ("hydra-launcher-key", ["hydra.launcher.partition=gpu"], ["Hydra's launcher is not used", "launcher=slurm"]),
]


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if any launcher is asked to run or submit anything."""
    from fp8rl.launch.launchers import LAUNCHERS, LaunchResult

    calls = []
    for name in LAUNCHERS:
        monkeypatch.setattr(LAUNCHERS[name], "launch", lambda *a, _n=name, **k: calls.append(_n) or LaunchResult())
    return calls


@pytest.mark.parametrize(("overrides", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_unknown_key_or_group_exits_2_before_anything_runs(launch, tmp_path, no_launch, overrides, expected):
    res = launch(*overrides, f"output_dir={tmp_path}/runs")
    msg = res.err + res.out
    assert res.code == 2, msg
    for s in expected:
        assert s in msg, f"{s!r} not in message:\n{msg}"
    assert "Traceback" not in msg and msg.count("Error") == 1, msg
    assert no_launch == [] and not (tmp_path / "runs").exists()


def test_unknown_axis_key_of_a_sweep_is_refused_by_the_sweeper(launch, tmp_path, no_launch):
    """A key that reaches the grid without passing the command-line check (a sweep file's axis,
    here through Hydra's own ``hydra.sweeper.params``): the sweeper refuses it the same way."""
    res = launch("+sweep=smoke", "+hydra.sweeper.params.stepz='1,2'", f"output_dir={tmp_path}/runs")
    msg = res.err + res.out
    assert res.code == 2, msg
    assert "'stepz'" in msg and "did you mean steps" in msg and "Traceback" not in msg
    assert no_launch == [] and not (tmp_path / "runs").exists()


def test_composed_config_check_names_keys_outside_the_schema():
    assert unknown_composed_keys({"steps": 3, "clip": {"arm": "tis"}, "hydra": {"x": 1}}) == []
    assert unknown_composed_keys({"stepz": 3, "clip": {"epslow": 0.1, "arm": "tis"}}) == ["stepz", "clip.epslow"]
    # below a free-form field (dict / Any) every key is valid
    assert unknown_composed_keys({"openrlhf": {"extra_args": {"anything": 1}}}) == []


def _sweep_keys() -> list[str]:
    out = []
    for f in sorted((SWEEPS_DIR / "sweep").glob("*.yaml")):
        params = (((yaml.safe_load(f.read_text()) or {}).get("hydra") or {}).get("sweeper") or {}).get("params") or {}
        out += [f"{k}={v}" for k, v in params.items()]
    return out


def _doc_overrides() -> list[str]:
    """Every override of every ``python -m experiments.launch`` command in the README and docs/."""
    out = []
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted(SWEEPS_DIR.rglob("*.yaml")),
             *sorted((REPO / "slurm" / "profiles").glob("*.yaml"))]
    for f in files:
        if "runs" in f.relative_to(REPO).parts:
            continue
        for m in re.finditer(r"experiments\.launch((?:[ \t]+[^\s`|#)]+)+)", f.read_text(encoding="utf-8")):
            args = [a.strip("[]`'\",;") for a in m.group(1).split()]
            out += [a for a in cli_overrides(args) if re.match(r"^[~+]*[A-Za-z_][\w./@]*=", a)]
    return out


def test_every_key_the_sweeps_and_docs_use_is_valid():
    sweep, docs = _sweep_keys(), _doc_overrides()
    assert len(sweep) > 20 and len(docs) > 40  # the scan found them
    assert {"+sweep=main_table", "launcher=slurm", "cluster=example"} <= set(docs)
    assert override_key_errors([*sweep, *docs]) == []


def test_groups_are_the_config_tree_directories():
    groups = config_groups()
    assert {"algorithm", "model", "fp8", "clip", "data", "backend", "scale", "sweep"} <= set(groups)
    assert override_key_errors(["+sweep=quick", "algorithm=dapo", "seeds=3", "~clip.period", "hydra.verbose=true",
                                "fp8@x=bf16", "clip.period=10,20", "mini.num_threads=1"]) == []


def test_groups_of_an_added_config_dir_are_valid(tmp_path):
    (tmp_path / "mygroup").mkdir()
    (tmp_path / "mygroup" / "a.yaml").write_text("# @package _global_\nsteps: 3\n")
    argv = ["-cd", str(tmp_path), "mygroup=a"]
    assert "mygroup" in cli_groups(argv) and "mygroup" not in cli_groups(["mygroup=a"])
    assert override_key_errors(cli_overrides(argv), cli_groups(argv)) == []
    assert override_key_errors(["mygroup=a"]) != []


def test_cli_overrides_skip_options_and_their_values():
    assert cli_overrides(["-cn", "x=y", "--cfg", "job", "a=1", "--config-dir=/d", "+b=2", "~c"]) == ["a=1", "+b=2", "~c"]
