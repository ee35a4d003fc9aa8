"""The cluster profile and the dry run agree about the CUDA each recipe needs; paper-scale runs
have their own runs root.

``slurm/profiles/example.yaml`` loaded CUDA 12.8 while the main table's blockwise cells (Transformer
Engine's Float8BlockScaling) need 12.9, and the dry run said nothing: the cells would have failed
at their first step on the cluster. And mini and paper sweeps both defaulted to ``runs/<sweep>``:
a paper-scale ``main_table`` would share its sweep directory (and manifest) with the mini one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "slurm" / "profiles" / "example.yaml"
PAPER = ["+sweep=main_table", "scale=paper", "algorithm=grpo", "model=8b", "clip=vanilla", "dry_run=true"]


def _profile(tmp_path: Path, setup: list[str]) -> Path:
    """The example profile with another ``setup``."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["setup"] = setup
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_example_profile_loads_what_every_main_table_recipe_needs(launch, tmp_path):
    """The shipped example profile and the dry run of the paper's main table agree: no warning."""
    from fp8rl.launch.cuda import TE_KIND_CUDA, profile_cuda
    from fp8rl.launch.profiles import load_profile

    (version, _line) = profile_cuda(load_profile("example"))
    assert version >= max(v for v, _ in TE_KIND_CUDA.values())
    res = launch("+sweep=main_table", "scale=paper", "cluster=example", "dry_run=true",
                 f"output_dir={tmp_path}/runs")
    assert res.code == 0, res.err
    assert "90 cell(s) valid" in res.out
    assert "warning" not in res.out + res.err and "CUDA" not in res.out + res.err, res.out[:3000]


@pytest.mark.parametrize(("fp8", "warned"), [("blockwise", True), ("tensorwise", False), ("bf16", False)])
def test_a_profile_with_an_older_cuda_warns_in_the_dry_run_for_blockwise(launch, tmp_path, fp8, warned):
    prof = _profile(tmp_path, ["module load cuda/12.8", "source $HOME/fp8rl/.venv/bin/activate"])
    res = launch(*PAPER, f"fp8={fp8}", f"cluster={prof}", f"output_dir={tmp_path}/runs")
    assert res.code == 0, res.err
    lines = [ln for ln in res.out.splitlines() if ln.startswith("warning:")]
    if not warned:
        assert lines == [], res.out
        return
    (line,) = lines
    assert "1 of 1 cell(s) (grpo-8b-blockwise-vanilla-s0-" in line, line
    assert "fp8.trainer_recipe=blockwise" in line and "Float8BlockScaling" in line, line
    assert "needs CUDA >= 12.9" in line and "loads CUDA 12.8 (setup: 'module load cuda/12.8')" in line, line
    assert "module load cuda/12.9" in line and "without blockwise" in line, line  # the fix
    assert res.out.splitlines()[1] == line  # under the heading, before the cells


def test_a_mini_blockwise_cell_is_emulated_and_needs_no_cuda(launch, tmp_path):
    prof = _profile(tmp_path, ["module load cuda/11.8"])
    res = launch("+sweep=smoke", "fp8=blockwise", "launcher=slurm", f"cluster={prof}", "dry_run=true",
                 f"output_dir={tmp_path}/runs")
    assert res.code == 0, res.err
    assert "warning" not in res.out, res.out


@pytest.mark.parametrize(("line", "version"), [
    ("module load cuda/12.8", (12, 8)), ("module load CUDA/12.9.1", (12, 9)),
    ("export CUDA_HOME=/usr/local/cuda-12.4", (12, 4)), ("module load cudatoolkit/12.6", (12, 6)),
    ("source $HOME/fp8rl/.venv/bin/activate", None)])
def test_the_cuda_a_setup_line_loads(line, version):
    from types import SimpleNamespace

    from fp8rl.launch.cuda import profile_cuda

    got = profile_cuda(SimpleNamespace(setup=(line,)))
    assert (got[0] if got else None) == version


def test_paper_scale_runs_default_to_their_own_runs_root(launch, tmp_path, monkeypatch):
    """``scale=paper`` writes under ``runs/paper/<sweep>``; mini sweeps keep ``runs/<sweep>``."""
    monkeypatch.chdir(tmp_path)
    paper = launch(*PAPER, "fp8=bf16", "cluster=example")
    assert paper.code == 0, paper.err
    assert f"sweep dir {tmp_path / 'runs' / 'paper' / 'main_table'};" in paper.out, paper.out[:500]
    mini = launch("+sweep=main_table", "dry_run=true")
    assert mini.code == 0, mini.err
    assert f"sweep dir {tmp_path / 'runs' / 'main_table'};" in mini.out, mini.out[:500]
    assert not (tmp_path / "runs").exists()  # dry runs write nothing
