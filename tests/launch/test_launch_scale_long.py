"""``scale=long`` (issue 48): the mini backend over 200 steps of 7-9-term problems, through the real
launcher; the sweeps that use it expand to the grids their files state."""

from __future__ import annotations

import re


def _dry(launch, tmp_path, *args):
    res = launch("dry_run=true", f"output_dir={tmp_path}", *args)
    assert res.code == 0, res.err
    return res


def _compose(overrides: list[str]) -> dict:
    """The launcher's config for ``overrides``, composed by Hydra from sweeps/ as the launcher does."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    import experiments.launch as launch

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=launch.CONFIG_DIR, version_base=None):
            return OmegaConf.to_container(compose("config", overrides=overrides), resolve=False)
    finally:
        GlobalHydra.instance().clear()


def test_scale_long_is_the_mini_backend_over_the_long_horizon():
    from fp8rl.backends.mini.config import MiniRunConfig

    cfg = _compose(["scale=long"])
    assert cfg["scale"] == "long" and cfg["backend"] == "mini"
    assert (cfg["steps"], cfg["max_response_len"], cfg["eval_every"]) == (200, 128, 25)
    assert (cfg["mini"]["min_terms"], cfg["mini"]["max_terms"]) == (7, 9)
    assert cfg["clip"]["calibration_mode"] == "periodic"
    # the warm start with the borrow slip, carried into the typed config the run is built from
    from fp8rl.launch.configs import build_dataclass

    assert cfg["mini"]["sft_slip_rate"] == 0.6
    assert build_dataclass(type(MiniRunConfig().mini), cfg["mini"]).sft_slip_rate == 0.6
    mini = _compose([])
    assert (mini["steps"], mini["mini"]["min_terms"]) == (MiniRunConfig.steps, 3)  # scale=mini unchanged
    assert mini["mini"]["sft_slip_rate"] == 0.0


def test_the_sweeps_of_the_long_regime_expand_to_their_grids(launch, tmp_path):
    res = _dry(launch, tmp_path, "+sweep=surge_dose")
    cells = re.findall(r"^cell \d+/(\d+) grpo-8b-(\w+)-(\w+)-s(\d+)-", res.out, re.M)
    assert len(cells) == 96 and {c[1] for c in cells} == {"mxfp8", "tensorwise", "mxfp6", "nvfp4"}
    assert {c[2] for c in cells} == {"vanilla", "tis", "calibrated", "no_lower_clip"}
    assert {c[3] for c in cells} == {str(s) for s in range(6)}
    bf16 = _dry(launch, tmp_path, "+sweep=surge_dose", "fp8=bf16", "clip=vanilla")
    assert len(re.findall(r"^cell \d+/6 grpo-8b-bf16-vanilla-", bf16.out, re.M)) == 6
    quick = _dry(launch, tmp_path, "+sweep=surge_dose_quick")
    assert len(re.findall(r"^cell \d+/8 ", quick.out, re.M)) == 8
    body = _dry(launch, tmp_path, "+sweep=long_body")
    assert len(re.findall(r"^cell \d+/6 grpo-8b-bf16-vanilla-", body.out, re.M)) == 6
    for sweep in ("surge_dose", "surge_dose_quick", "long_body"):  # each selects the long regime
        assert _compose([f"+sweep={sweep}"])["scale"] == "long", sweep


def test_an_unknown_scale_is_refused_naming_the_valid_ones(launch, tmp_path):
    res = launch("dry_run=true", f"output_dir={tmp_path}", "scale=longer")
    assert res.code != 0
    assert "long" in res.err and "mini" in res.err, res.err
