"""Every YAML field of the config tree and the cluster profiles carries a comment (as verl's
test_config_docs requires), every sweep file names its paper artefact and command, and every
option of every config group composes and validates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
YAML_FILES = sorted((REPO / "sweeps").rglob("*.yaml")) + sorted((REPO / "slurm" / "profiles").glob("*.yaml"))
KEY_RE = re.compile(r"^\s*(-\s+)?(override\s+)?[A-Za-z_+/@.~][\w+/@.~-]*\s*:(\s|$)")
ITEM_RE = re.compile(r"^\s*-\s+\S")


def undocumented(path: Path, root: Path = REPO) -> list[str]:
    """Lines defining a key or a list item with no comment on the line or just above it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    bad = []
    for i, line in enumerate(lines):
        if not (KEY_RE.match(line) or ITEM_RE.match(line)) or line.lstrip().startswith("#"):
            continue
        if "#" in line.split(":", 1)[-1]:
            continue
        prev = next((p for p in reversed(lines[:i]) if p.strip()), "")
        parent_is_list = ITEM_RE.match(line) and not KEY_RE.match(line)
        if prev.lstrip().startswith("#"):
            continue
        if parent_is_list and (ITEM_RE.match(prev) or prev.rstrip().endswith(":")):
            continue  # items of a documented list (setup lines)
        bad.append(f"{path.relative_to(root)}:{i + 1}: {line.strip()}")
    return bad


def test_launch_config_tree_exists():
    groups = {p.name for p in (REPO / "sweeps").iterdir() if p.is_dir()}
    assert {"algorithm", "model", "fp8", "clip", "data", "backend", "scale", "sweep"} <= groups
    assert {p.stem for p in (REPO / "sweeps" / "sweep").glob("*.yaml")} >= {
        "main_table", "entropy_granularity", "calibration_ablation", "quick", "smoke"}
    assert {p.stem for p in (REPO / "sweeps" / "fp8").glob("*.yaml")} == {
        "fp32", "bf16", "rollout_only", "tensorwise", "tensorwise_delayed", "rowwise", "blockwise", "mxfp8",
        "nvfp4", "nvfp4_rn", "w4a16", "mxfp4", "mxfp6"}
    assert (REPO / "slurm" / "profiles" / "example.yaml").is_file()


@pytest.mark.parametrize("path", YAML_FILES, ids=[str(p.relative_to(REPO)) for p in YAML_FILES])
def test_launch_every_yaml_field_has_a_comment(path):
    assert undocumented(path) == []


def test_launch_doc_checker_catches_a_missing_comment(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("# header\n# documented\na: 1\nb: 2  # inline\nc:\n  # nested doc\n  d: 3\n"
                 "e: 4\nsetup:\n  - echo hi\n")
    assert undocumented(f, root=tmp_path) == ["x.yaml:5: c:", "x.yaml:8: e: 4", "x.yaml:9: setup:"]


@pytest.mark.parametrize("name", ["main_table", "entropy_granularity", "calibration_ablation", "quick", "smoke"])
def test_launch_sweep_file_header_names_artefact_and_command(name):
    text = (REPO / "sweeps" / "sweep" / f"{name}.yaml").read_text()
    head = "\n".join(ln for ln in text.splitlines()[:12] if ln.startswith("#"))
    assert text.startswith("# @package _global_")
    assert "Paper artefact:" in head
    assert f"python -m experiments.launch +sweep={name}" in head
    assert f"sweep_name: {name}" in text


@pytest.mark.parametrize("axes", [
    ("algorithm=grpo,dapo,dr_grpo", "model=8b,14b,32b"),
    ("fp8=bf16,rollout_only,tensorwise,rowwise,blockwise,mxfp8,mxfp6,nvfp4,nvfp4_rn,w4a16,mxfp4",
     "clip=vanilla,tis,calibrated,no_lower_clip,wide_lower"),
], ids=["algorithm-x-model", "fp8-x-clip"])
def test_launch_every_group_option_composes_and_validates(launch, tmp_path, axes):
    """Every option of every axis group, as dry-run grids: every cell is valid, nothing written."""
    res = launch(*axes, "dry_run=true", f"output_dir={tmp_path}/runs")
    assert res.code == 0, res.err
    n = 1
    for a in axes:
        n *= len(a.split("=", 1)[1].split(","))
    assert f"{n} cell(s) valid" in res.out
    assert not (tmp_path / "runs").exists()


def test_documented_paper_dry_run_example_is_what_the_dry_run_prints(launch, tmp_path, monkeypatch):
    """docs/cluster.md quotes one paper-scale cell's dry run (the README links it); a change to the
    config (and so to the run's hash, its OpenRLHF command or its default runs root, runs/paper)
    must update it."""
    monkeypatch.chdir(tmp_path)  # the default output_dir, relative to here
    res = launch("+sweep=main_table", "scale=paper", "cluster=example", "dry_run=true", "algorithm=dapo",
                 "model=14b", "fp8=blockwise", "clip=calibrated")
    assert res.code == 0, res.err
    printed = {k: v for k, v in (line.strip().split(None, 1) for line in res.out.splitlines()
                                 if line.strip().startswith(("cell ", "openrlhf:", "sbatch:", "layout:")))}
    doc = (REPO / "docs" / "cluster.md").read_text(encoding="utf-8").replace("output_dir=runs ", "")
    cell = printed["cell"].split()[1]
    assert f"cell 1/1 {cell}" in doc, f"docs/cluster.md should show run {cell}"
    command = printed["openrlhf:"].replace(f"{tmp_path}/", "").replace(f"{REPO}/", "")  # paths shortened
    assert command in doc, "docs/cluster.md's OpenRLHF command is stale"
    assert f"sweep dir {tmp_path}/runs/paper/main_table;" in res.out
    assert "sweep dir runs/paper/main_table;" in doc and "warning" not in res.out
    for key in ("sbatch:", "layout:"):
        assert f"{key}    {printed[key]}" in doc, key
