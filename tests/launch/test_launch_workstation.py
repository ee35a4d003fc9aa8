"""One GPU machine without Slurm: ``cluster=workstation`` (``slurm/profiles/workstation.yaml``).

Through the real entry point (``experiments.launch`` with Hydra overrides, in this process): the
dry run of the main table on 1, 2, 4 and 8 GPUs prints the machine's resources, the colocated
vLLM layout and OpenRLHF's command for those GPUs, and no sbatch request; slots whose vLLM TP
does not fit the GPUs are refused before anything is written; without ``dry_run`` the cells run
one after another in this process with the profile's GPU count as their allocation (the
backend's run is a stand-in here: no GPU, Ray or OpenRLHF run in this tier).
"""

from __future__ import annotations

import os
import shlex
import socket

import pytest

from fp8rl.backends.openrlhf.command import parse_flags
from fp8rl.launch.profiles import LOCAL_GPUS_ENV, ProfileError, load_profile, parse_profile

BASE = ("+sweep=main_table", "scale=paper", "cluster=workstation", "algorithm=grpo", "fp8=tensorwise",
        "clip=calibrated")
TP = {"8b": 1, "14b": 2, "32b": 4}  # sweeps/backend/openrlhf.yaml: openrlhf.vllm_tp
FITS = {1: "8b", 2: "8b,14b", 4: "8b,14b,32b", 8: "8b,14b,32b"}  # the slots whose TP fits the GPUs


def _cells(out: str) -> dict[str, dict[str, str]]:
    """Dry-run lines per cell: ``{slot: {"backend": ..., "local": ..., "layout": ..., "openrlhf": ...}}``."""
    cells, cur = {}, None
    for line in out.splitlines():
        if line.startswith("cell "):
            cur = cells.setdefault(line.split()[2].split("-")[1], {})
        elif cur is not None and line.startswith("    ") and ":" in line:
            key, _, value = line.strip().partition(":")
            cur[key] = value.strip()
    return cells


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_dry_run_lays_out_the_main_table_on_this_machines_gpus(launch, snapshot, tmp_path, gpus):
    runs = tmp_path / "runs"
    before = snapshot(tmp_path)
    extra = [] if gpus == 8 else [f"gpus_per_node={gpus}"]  # 8: the profile's default
    res = launch(*BASE, f"model={FITS[gpus]}", *extra, "dry_run=true", f"output_dir={runs}")
    assert res.code == 0, res.err
    slots = FITS[gpus].split(",")
    assert f"{len(slots)} cell(s) valid" in res.out
    assert "launcher local, cluster profile workstation" in res.out  # not slurm, though scale=paper says so
    assert "sbatch" not in res.out + res.err
    cells = _cells(res.out)
    assert sorted(cells) == sorted(slots)
    for slot, lines in cells.items():
        tp = TP[slot]
        engines = gpus // tp
        assert lines["backend"] == f"openrlhf, launcher: local, resources: this machine (no Slurm), 1 node x {gpus} GPU(s)"
        assert lines["local"] == (f"this machine, no Slurm: {gpus} GPU(s), Ray started on this host, "
                                  "one cell at a time")
        assert lines["layout"].startswith(f"{gpus} GPU(s): {engines} vLLM engine(s) x TP {tp}, colocate_all=True;")
        cmd = shlex.split(lines["openrlhf"])
        assert cmd[:4] == ["python", "-m", "fp8rl.backends.openrlhf.driver", "--"]
        flags = parse_flags(cmd[4:])
        assert flags["actor.num_nodes"] == ["1"] and flags["actor.num_gpus_per_node"] == [str(gpus)]
        assert flags["vllm.num_engines"] == [str(engines)] and flags["vllm.tensor_parallel_size"] == [str(tp)]
        assert "train.colocate_all" in flags and engines * tp == gpus  # OpenRLHF's colocation assertion
        assert gpus == 8 or f"gpus_per_node={gpus}" in lines["command"]  # the cell's own command keeps it
    assert snapshot(tmp_path) == before  # a dry run writes nothing


def test_32b_is_refused_on_two_gpus_before_anything_is_written(launch, snapshot, tmp_path):
    runs = tmp_path / "runs"
    before = snapshot(tmp_path)
    res = launch(*BASE, "model=8b,32b", "gpus_per_node=2", "dry_run=true", f"output_dir={runs}")
    assert res.code == 1
    msg = res.out + res.err
    assert "invalid sweep (1 problem(s) in 2 cell(s)); nothing was run, submitted or written" in msg
    assert ("model slot 32b runs vLLM with tensor-parallel size 4 (openrlhf.vllm_tp.32b) but the cell has "
            "2 GPU(s)") in msg
    assert "cell 2/2 [algorithm=grpo model=32b" in msg and "at least 4 GPUs" in msg  # the cell, and the fix
    res = launch(*BASE, "model=8b,32b", "gpus_per_node=2", f"output_dir={runs}")  # no dry run: same refusal
    assert res.code == 1 and "model slot 32b" in res.out + res.err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(("overrides", "want"), [
    (["gpus_per_node=9"], ["gpus_per_node=9", "1 to 8 GPUs"]),
    (["gpus_per_node=0"], ["gpus_per_node=0", "integer >= 1"]),
    (["gpus_per_node=3"], ["train batch (256) must split into micro-batches of 4 on each of the 3 actor ranks"]),
    (["workers=2"], ["workers=2", "one cell at a time", "workers=1"]),
    (["launcher=local_parallel"], ["launcher=local_parallel", "several cells on the same GPUs"]),
], ids=["nine-gpus", "zero-gpus", "three-gpus-batch", "workers", "local-parallel"])
def test_bad_workstation_launches_are_refused(launch, snapshot, tmp_path, overrides, want):
    before = snapshot(tmp_path)
    res = launch(*BASE, "model=8b", *overrides, "dry_run=true", f"output_dir={tmp_path}/runs")
    assert res.code == 1
    for w in want:
        assert w in res.out + res.err, w
    assert snapshot(tmp_path) == before


def test_gpus_per_node_needs_a_profile_and_mini_scale_none(launch, tmp_path):
    res = launch("gpus_per_node=4", "dry_run=true", f"output_dir={tmp_path}/runs")
    assert res.code == 1 and "gpus_per_node=4 replaces a cluster profile's GPUs" in res.out + res.err
    res = launch("cluster=workstation", "dry_run=true", f"output_dir={tmp_path}/runs")
    assert res.code == 1 and "backend 'mini' (scale=mini) runs on this machine without a profile" in res.out + res.err


def test_workstation_profile_fields():
    p = load_profile("workstation")
    assert p.local and p.scheduler == "local"
    res = p.resources_for("32b")
    assert (res.nodes, res.gpus_per_node, res.local) == (1, 8, True)
    assert p.with_gpus_per_node(4).resources_for("14b").gpus_per_node == 4
    assert p.resources_for("14b").gpus_per_node == 8  # the override is a copy
    with pytest.raises(ProfileError, match="no Slurm"):
        p.executor_parameters(res)
    assert not load_profile("example").local  # Slurm profiles stay Slurm profiles


@pytest.mark.parametrize(("raw", "msg"), [
    ({"scheduler": "pbs", "resources": {"default": {}}}, "scheduler must be one of slurm, local"),
    ({"scheduler": "local", "partition": "gpu", "resources": {"default": {"gpus_per_node": 8}}},
     "field(s) ['partition'] apply to Slurm jobs only"),
    ({"scheduler": "local", "resources": {"default": {"gpus_per_node": 8, "time_min": 60}}},
     "field(s) ['time_min'] are Slurm requests"),
    ({"scheduler": "local", "resources": {"default": {"nodes": 2, "gpus_per_node": 8}}}, "nodes must be 1"),
    ({"scheduler": "local", "resources": {"default": {"gpus_per_node": 0}}}, "1 to 8 GPUs, got 0"),
    ({"scheduler": "local", "resources": {"default": {"gpus_per_node": 16}}}, "1 to 8 GPUs, got 16"),
    ({"scheduler": "local", "resources": {"default": {"gpus_per_node": 8}, "32b": {"gpus_per_node": 12}}},
     "resources.32b: a scheduler: local profile"),
], ids=["scheduler", "slurm-field", "slurm-resource", "nodes", "no-gpus", "16-gpus", "slot-block"])
def test_bad_local_profiles_are_refused(raw, msg):
    with pytest.raises(ProfileError) as e:
        parse_profile(raw, name="w", path="w.yaml")
    assert msg in str(e.value)


@pytest.fixture
def stand_in_run(monkeypatch):
    """The OpenRLHF backend's run replaced: records what each cell saw (allocation, process)."""
    import submitit

    import fp8rl.backends.openrlhf.run as run
    from fp8rl.backends.openrlhf import ray_cluster
    from fp8rl.runs import DONE, RunDir

    seen = []

    def run_openrlhf(cfg, overrides=(), *, progress=False):
        rd = RunDir(run.resolve_run_dir(cfg))
        rd.init(run.config_dict(cfg), overrides)
        seen.append({"slot": cfg.model.slot, "allocation": run.allocation(), "pid": os.getpid(),
                     "ray_nodes": ray_cluster.allocation_nodes(), "env": os.environ.get(LOCAL_GPUS_ENV)})
        rd.write_summary({"state": DONE, "reason": None, "steps": cfg.steps})
        writer = rd.metrics_writer()  # a DONE run holds its steps' rows (else it is DAMAGED)
        for step in range(1, cfg.steps + 1):
            writer.write({"step": step})
        rd.set_status(DONE, cfg.steps)
        return {"state": DONE, "run_dir": str(rd.path)}

    def no_slurm(*a, **k):
        raise AssertionError("a workstation launch must not use submitit/Slurm")

    monkeypatch.setattr(run, "run_openrlhf", run_openrlhf)
    monkeypatch.setattr(submitit, "AutoExecutor", no_slurm)
    monkeypatch.setattr(submitit, "LocalExecutor", no_slurm)
    for var in ("SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_GPUS_ON_NODE",
                "SLURM_GPUS_PER_NODE", LOCAL_GPUS_ENV):
        monkeypatch.delenv(var, raising=False)
    return seen


def test_launch_runs_cells_one_after_another_with_the_profiles_gpus(launch, monkeypatch, tmp_path, stand_in_run):
    import fp8rl.launch.launchers as launchers
    from fp8rl.runs import read_manifest

    monkeypatch.setattr(launchers, "visible_gpus", lambda: 8)  # an 8-GPU machine; cells use 4
    runs = tmp_path / "runs"
    res = launch(*BASE, "model=8b,14b,32b", "gpus_per_node=4", "progress=false", f"output_dir={runs}")
    assert res.code == 0, res.err
    assert "running 3 cell(s) one after another in this process on this machine's GPUs" in res.err
    assert "sbatch" not in res.out + res.err
    assert [s["slot"] for s in stand_in_run] == ["8b", "14b", "32b"]
    for s in stand_in_run:
        assert s["allocation"] == (1, 4) and s["env"] == "4" and s["pid"] == os.getpid()
        assert s["ray_nodes"] == [socket.gethostname()]  # Ray on this host: no srun, no node list
    assert LOCAL_GPUS_ENV not in os.environ  # set only while a cell runs
    cells = read_manifest(runs / "main_table").cells
    assert len(cells) == 3 and all(c.job_id is None for c in cells)
    res = launch(*BASE, "model=8b,14b,32b", "gpus_per_node=4", "progress=false", f"output_dir={runs}")
    assert res.code == 0 and len(stand_in_run) == 3  # DONE cells are skipped on a relaunch


@pytest.mark.parametrize(("have", "want"), [
    (0, "shows 0 CUDA GPU(s) (torch.cuda.device_count()); nothing was run or written; run on a GPU machine"),
    (2, "shows 2 CUDA GPU(s) (torch.cuda.device_count()); nothing was run or written; give gpus_per_node=2"),
], ids=["no-gpu", "too-few"])
def test_launch_refuses_more_gpus_than_the_machine_has(launch, monkeypatch, snapshot, tmp_path, stand_in_run,
                                                       have, want):
    import fp8rl.launch.launchers as launchers

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(launchers, "visible_gpus", lambda: have)
    before = snapshot(tmp_path)
    res = launch(*BASE, "model=8b", "gpus_per_node=4", f"output_dir={tmp_path}/runs")
    assert res.code == 1
    assert f"cluster=workstation gives each cell 4 GPU(s), but this machine {want}" in res.out + res.err
    assert stand_in_run == [] and snapshot(tmp_path) == before


def test_allocation_prefers_the_local_profile_then_slurm_then_this_machine(monkeypatch):
    import torch

    from fp8rl.backends.openrlhf.run import allocation

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    for var in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", LOCAL_GPUS_ENV):
        monkeypatch.delenv(var, raising=False)
    assert allocation() == (1, 3)
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    assert allocation() == (2, 8)
    monkeypatch.setenv(LOCAL_GPUS_ENV, "4")
    assert allocation() == (1, 4)
