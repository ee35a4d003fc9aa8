"""Resources follow the scale: a mini cell sent with a GPU cluster profile asks for CPUs and
memory only (no GPU flag, no whole node); a paper cell keeps its GPUs; the dry run shows each
cell's request; the sbatch script submitit writes for a mini cell has no GPU request (checked by
the local Slurm's ``sbatch --test-only``, which refuses any GPU request: it has no GPUs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from fp8rl.launch.profiles import load_profile

GPU_PROFILE = {  # an 8-GPU node profile, as paper_h100.yaml, on the local cluster's partition
    "array_parallelism": 2, "additional_parameters": {"exclusive": True},
    "resources": {"default": {"nodes": 1, "gpus_per_node": 8, "cpus_per_task": 2, "mem_gb": None,
                              "time_min": 9}},
}


def _sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def test_mini_cell_asks_for_cpus_and_memory_only(launch, tmp_path):
    """Dry run of mini cells with the 8-GPU profile: each cell's request, no GPU; the backend
    line and the sbatch line say so."""
    res = launch("+sweep=smoke", "fp8=bf16", "launcher=slurm", "cluster=paper_h100", "dry_run=true",
                 "mini.num_threads=2", f"output_dir={tmp_path}/runs")
    assert res.code == 0, res.err + res.out
    sb = [line.strip() for line in res.out.splitlines() if line.strip().startswith("sbatch:")]
    assert len(sb) == 2, res.out
    for line in sb:
        assert line == "sbatch:    --nodes=1 --ntasks-per-node=1 --cpus-per-task=2 --mem=4G --time=2880", line
    assert res.out.count("resources: 1 node(s) x no GPU, 2 CPU(s)/task, 4 GB, 2880 min") == 2, res.out
    assert "gpu" not in " ".join(sb).lower()
    assert not (tmp_path / "runs").exists()


def test_paper_cell_keeps_its_gpus_in_the_dry_run(launch, tmp_path):
    res = launch("scale=paper", "cluster=paper_h100", "model=14b", "dry_run=true", f"output_dir={tmp_path}/runs")
    assert res.code == 0, res.err + res.out
    assert "resources: 2 node(s) x 8 GPU(s), 96 CPU(s)/task, 1024 GB, 2880 min" in res.out, res.out
    assert "--nodes=2 --ntasks-per-node=1 --gpus-per-node=8 --cpus-per-task=96 --mem=1024G" in res.out


def test_executor_parameters_of_a_cpu_cell_carry_no_gpu_and_no_whole_node():
    from fp8rl.backends.mini.config import MiniRunConfig
    from fp8rl.backends.mini.run import MINI_MEM_GB, cell_resources

    prof = load_profile("paper_h100")
    req = prof.resources_for("8b")
    mini = cell_resources(MiniRunConfig(), req)
    assert (mini.nodes, mini.gpus_per_node, mini.mem_gb, mini.time_min) == (1, 0, MINI_MEM_GB, req.time_min)
    params = prof.executor_parameters(mini)
    assert "gpus_per_node" not in params and "exclusive" not in params.get("slurm_additional_parameters", {})
    paper = prof.executor_parameters(req)  # a paper cell: the profile's request, as before
    assert paper["gpus_per_node"] == 8 and paper["slurm_additional_parameters"] == {"exclusive": True}


@pytest.mark.slurm
def test_mini_cells_sbatch_script_has_no_gpu_request(slurm_cluster, launch, tmp_path, monkeypatch):
    """Through the launcher's real submitit path with an 8-GPU, exclusive-node profile: the script
    of the mini cells asks for no GPU and no whole node, and the local Slurm (no GPUs: it refuses
    any GPU request) accepts it with ``sbatch --test-only`` (checked, not queued)."""
    import subprocess

    from submitit.slurm.slurm import SlurmExecutor

    scripts: list[str] = []

    def submit(self, path):  # Slurm only checks the script; the job id is made up
        scripts.append(Path(path).read_text())
        chk = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True, timeout=30)
        assert chk.returncode == 0, chk.stderr + scripts[-1]
        return ["echo", "Submitted batch job 424242"]

    monkeypatch.setattr(SlurmExecutor, "_make_submission_command", submit)
    prof = tmp_path / "gpu_nodes.yaml"
    prof.write_text(yaml.safe_dump({**GPU_PROFILE, "partition": slurm_cluster.partition}))
    res = launch("+sweep=smoke", "fp8=bf16", "launcher=slurm", f"cluster={prof}", f"output_dir={tmp_path}/runs")
    assert res.code == 0, res.err + res.out
    (script,) = scripts
    flags = "\n".join(_sbatch_lines(script))
    assert not re.search(r"gpu|gres|exclusive", flags, re.IGNORECASE), flags
    for line in ("#SBATCH --cpus-per-task=1", "#SBATCH --mem=4GB", "#SBATCH --nodes=1", "#SBATCH --time=9"):
        assert line in flags, f"{line!r} not in:\n{flags}"


def test_the_same_profile_keeps_gpus_for_a_gpu_cell(tmp_path):
    """The GPU flags of the profile above do reach a cell that asks for GPUs (so the test above
    would see them if the mini cell kept the profile's request)."""
    from fp8rl.launch.profiles import parse_profile

    prof = parse_profile({**GPU_PROFILE, "partition": "p"}, name="g", path="g.yaml")
    params = prof.executor_parameters(prof.resources_for("8b"))
    assert params["gpus_per_node"] == 8 and params["slurm_additional_parameters"] == {"exclusive": True}
