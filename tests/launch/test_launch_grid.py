"""Grid expansion, the seed axis, dry runs, and the fast composition against Hydra's own."""

from __future__ import annotations

import pytest

from fp8rl.launch.grid import compose_cells, expand_overrides


@pytest.fixture
def hydra_loader():
    """Hydra's config loader on sweeps/ and a function composing the multirun master config."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    import experiments.launch as launch

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=launch.CONFIG_DIR, version_base=None):
        loader = GlobalHydra.instance().config_loader()

        def master(overrides):
            return loader.load_configuration("config", overrides=list(overrides), run_mode=RunMode.MULTIRUN)

        yield loader, master
    GlobalHydra.instance().clear()


def _grid(loader, master_overrides, sweep_args, master):
    cfg = master(master_overrides)
    params = dict(cfg.hydra.sweeper.params)
    return cfg, expand_overrides(params, [*master_overrides, *sweep_args], loader)


@pytest.mark.parametrize(("sweep", "n"), [
    ("smoke", 4), ("quick", 4),
    pytest.param("calibration_ablation", 18, marks=pytest.mark.slow),
    pytest.param("entropy_granularity", 12, marks=pytest.mark.slow)])
def test_launch_fast_composition_equals_hydra(hydra_loader, sweep, n):
    loader, master = hydra_loader
    cfg, grid = _grid(loader, [f"+sweep={sweep}"], [], master)
    assert len(grid) == n
    fast = compose_cells(cfg, loader, grid)
    exact = compose_cells(cfg, loader, grid, exact=True)
    assert fast == exact


def test_launch_fast_composition_falls_back_when_axes_overlap(hydra_loader):
    """dapo sets eps_high and so does the value axis: those cells are composed in full, and the
    command-line value wins as in Hydra."""
    loader, master = hydra_loader
    cfg, grid = _grid(loader, [], ["algorithm=grpo,dapo", "algorithm.eps_high=0.3,0.4"], master)
    fast = compose_cells(cfg, loader, grid)
    assert fast == compose_cells(cfg, loader, grid, exact=True)
    assert [c["algorithm"]["eps_high"] for c in fast] == [0.3, 0.4, 0.3, 0.4]
    assert [c["algorithm"]["name"] for c in fast] == ["grpo", "grpo", "dapo", "dapo"]


@pytest.mark.slow
def test_launch_fast_composition_equals_hydra_main_table(hydra_loader):
    loader, master = hydra_loader
    cfg, grid = _grid(loader, ["+sweep=main_table"], [], master)
    assert len(grid) == 90
    assert compose_cells(cfg, loader, grid) == compose_cells(cfg, loader, grid, exact=True)


def test_launch_main_table_dry_run(launch, tmp_path):
    res = launch("+sweep=main_table", "seeds=3", "dry_run=true", f"output_dir={tmp_path}/runs")
    assert res.code == 0, res.err
    assert "270 cell(s) valid" in res.out
    dirs = [ln.split("run dir:", 1)[1].strip() for ln in res.out.splitlines() if "run dir:" in ln]
    assert len(dirs) == len(set(dirs)) == 270
    for seed in (0, 1, 2):
        assert sum(f"-s{seed}-" in d for d in dirs) == 90
    assert "nothing was run, submitted or written" in res.out
    assert not (tmp_path / "runs").exists()


def test_launch_default_is_one_mini_run(launch, tmp_path):
    res = launch("dry_run=true", f"output_dir={tmp_path}/runs")
    assert res.code == 0, res.err
    assert "1 cell(s) valid" in res.out and "launcher local" in res.out
    line = next(ln for ln in res.out.splitlines() if "run dir:" in ln)
    assert f"{tmp_path}/runs/default/grpo-8b-bf16-vanilla-s0-" in line
    assert "command:   python -m experiments.launch" in res.out


def test_launch_dry_run_slurm_shows_resources(launch, tmp_path):
    res = launch("+sweep=smoke", "launcher=slurm", "cluster=example", "dry_run=true", f"output_dir={tmp_path}/r")
    assert res.code == 0, res.err
    assert "cluster profile example" in res.out
    # a mini cell asks for CPUs and memory, not the profile's 8-GPU node (its time limit is kept)
    assert "1 node(s) x no GPU, 1 CPU(s)/task, 4 GB, 2880 min" in res.out
    assert "8 GPU" not in res.out and "--gpus" not in res.out
