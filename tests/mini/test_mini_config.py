"""Run configuration: validation with clear messages, OmegaConf round trip, the CLI parser."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from fp8rl.backends.mini.__main__ import main, parse_config
from fp8rl.backends.mini.config import MiniRunConfig, MiniSettings
from fp8rl.config import AlgorithmConfig, ClipConfig, Fp8Config, ModelConfig, RunConfig


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: AlgorithmConfig(name="ppo"), "algorithm.name"),
        (lambda: AlgorithmConfig(advantage_estimator="rloo"), "valid names are"),
        (lambda: AlgorithmConfig(loss_agg_mode="sum"), "loss_agg_mode"),
        (lambda: AlgorithmConfig(eps_low=1.2), "eps_low"),
        (lambda: AlgorithmConfig(dual_clip=0.5), "dual_clip"),
        (lambda: AlgorithmConfig(kl_coef=0.1), "KL regularisation is not implemented"),
        (lambda: ModelConfig(slot="7b"), "model.slot"),
        (lambda: Fp8Config(rollout_recipe="fp4"), "fp8.rollout_recipe"),
        (lambda: ClipConfig(arm="dual"), "clip.arm"),
        (lambda: ClipConfig(upper_rule="magic"), "clip.upper_rule"),
        (lambda: ClipConfig(init_bounds=[1.2, 1.8]), "init_bounds"),
        (lambda: RunConfig(algorithm=AlgorithmConfig(n_samples_per_prompt=1)), "silent no-op"),
        (lambda: RunConfig(prompts_per_step=3, num_mini_batches=5), "split evenly"),
        (lambda: RunConfig(algorithm=AlgorithmConfig(overlong_buffer=64)), "overlong_buffer"),
        (lambda: RunConfig(clip=ClipConfig(arm="calibrated", init_bounds=[0.01, 1.8])), "clip options"),
        (lambda: RunConfig(lr=-1.0), "lr"),
        (lambda: MiniSettings(device="tpu"), "mini.device"),
        (lambda: MiniSettings(min_terms=1), "min_terms"),
        (lambda: MiniSettings(sft_slip_rate=1.5), "mini.sft_slip_rate must be in"),
        (lambda: MiniSettings(sft_slip_rate=-0.1), "mini.sft_slip_rate must be in"),
    ],
)
def test_bad_values_raise_with_a_message(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_defaults_validate_and_round_trip_through_omegaconf():
    cfg = MiniRunConfig()
    assert cfg.fp8.emulate is True  # mini default (see MiniRunConfig)
    assert cfg.clip.method == "vanilla" and cfg.clip.is_correction == "none"
    assert ClipConfig(arm="calibrated").is_correction == "tis"
    back = OmegaConf.to_object(OmegaConf.structured(cfg))
    assert back == cfg
    assert dataclasses.asdict(back) == dataclasses.asdict(cfg)


def test_cli_overrides_and_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("seed: 3\nclip:\n  arm: tis\n")
    arm = ["fp8.name=tensorwise", "fp8.rollout_recipe=tensorwise", "fp8.trainer_recipe=tensorwise"]
    cfg, overrides, _ = parse_config(["--config", str(f), *arm, "algorithm.eps_high=0.28"])
    assert (cfg.seed, cfg.clip.arm, cfg.fp8.name, cfg.algorithm.eps_high) == (3, "tis", "tensorwise", 0.28)
    assert overrides == [*arm, "algorithm.eps_high=0.28"]
    with pytest.raises(ValueError, match=r"fp8\.trainer_recipe=tensorwise"):  # a label that lies
        parse_config(["fp8.name=tensorwise"])
    with pytest.raises(Exception, match="nosuchkey"):
        parse_config(["nosuchkey=1"])
    with pytest.raises(ValueError, match=r"model\.slot"):
        parse_config(["model.slot=70b"])
    with pytest.raises(SystemExit):
        parse_config(["seed"])


def test_cli_print_config(capsys):
    assert main(["--print-config", "seed=5"]) == 0
    assert "seed: 5" in capsys.readouterr().out


def test_a_sample_fraction_below_one_sequence_per_calibration_is_refused_naming_the_minimum():
    """``sampled`` draws ``max(1, round(share x m))`` sequences: a share under 1/N (N the step's
    sequences) would be raised to one silently; the config refuses it and names 1/N."""
    base = MiniRunConfig()
    n_seq = base.prompts_per_step * base.algorithm.n_samples_per_prompt
    clip = dataclasses.replace(ClipConfig(arm="calibrated"), calibration_mode="sampled")
    ok = dataclasses.replace(clip, sample_fraction=1 / n_seq)
    assert dataclasses.replace(base, clip=ok).clip.sample_fraction == 1 / n_seq  # exactly one sequence
    for bad in (1e-300, 0.99 / n_seq):
        with pytest.raises(ValueError, match=rf"clip.sample_fraction={bad!r} .* fewer than one per calibration\. "
                                             rf"Give clip.sample_fraction >= {1 / n_seq:.6g} \(1/{n_seq}: one sequence\)"):
            dataclasses.replace(base, clip=dataclasses.replace(clip, sample_fraction=bad))
