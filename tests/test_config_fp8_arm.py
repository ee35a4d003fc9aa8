"""The fp8 arm name is what run names and legends show: it must match the recipes that run."""

import pytest

from fp8rl.config import Fp8Config


@pytest.mark.parametrize(
    ("name", "rollout", "trainer"),
    [
        ("bf16", "bf16", "bf16"),
        ("rollout_only", "tensorwise", "bf16"),
        ("rollout_only", "blockwise", "bf16"),
        ("tensorwise", "tensorwise", "tensorwise"),
        ("blockwise", "blockwise", "blockwise"),
    ],
)
def test_consistent_arms_build(name, rollout, trainer):
    Fp8Config(name=name, rollout_recipe=rollout, trainer_recipe=trainer, emulate=True)


def test_delayed_arm_rolls_out_with_tensorwise():
    # delayed scaling has no emulation, so this arm is built with emulate=False
    Fp8Config(name="tensorwise_delayed", rollout_recipe="tensorwise", trainer_recipe="tensorwise_delayed")
    with pytest.raises(ValueError, match=r"fp8\.trainer_recipe=tensorwise_delayed"):
        Fp8Config(name="tensorwise_delayed", rollout_recipe="tensorwise", trainer_recipe="tensorwise")


@pytest.mark.parametrize(
    ("name", "rollout", "trainer", "needle"),
    [
        ("tensorwise", "bf16", "bf16", "fp8.trainer_recipe=tensorwise"),
        ("tensorwise", "bf16", "tensorwise", "FP8 fp8.rollout_recipe"),
        ("blockwise", "tensorwise", "tensorwise", "fp8.trainer_recipe=blockwise"),
        ("bf16", "tensorwise", "bf16", "fp8.rollout_recipe=bf16"),
        ("rollout_only", "bf16", "bf16", "FP8 fp8.rollout_recipe"),
        ("rollout_only", "tensorwise", "tensorwise", "fp8.trainer_recipe=bf16"),
    ],
)
def test_mislabelled_arm_raises_naming_the_fix(name, rollout, trainer, needle):
    with pytest.raises(ValueError, match=r"fp8\.name") as e:
        Fp8Config(name=name, rollout_recipe=rollout, trainer_recipe=trainer, emulate=True)
    assert needle in str(e.value)


@pytest.mark.parametrize("name", ["my_custom_arm", "fp9", "b"])
def test_a_name_that_is_no_arm_is_refused_listing_the_arms(name):
    """One rule for the config and the launcher: ``fp8_arms`` (free labels would reach run names
    and legends saying nothing about what ran)."""
    with pytest.raises(ValueError, match=rf"fp8\.name: '{name}' is not an FP8 arm; valid values: fp32, bf16, "
                                         r"rollout_only, blockwise, mxfp4, mxfp6, mxfp8, nvfp4, nvfp4_rn, rowwise, rowwise_with_gw_hp, "
                                         r"tensorwise"):
        Fp8Config(name=name, rollout_recipe="rowwise", trainer_recipe="tensorwise", emulate=True)


def test_every_recipe_has_its_full_fp8_arm():
    from fp8rl.config.fp8 import fp8_arms
    from fp8rl.quant import RECIPES

    arms = fp8_arms()
    assert list(arms)[:3] == ["fp32", "bf16", "rollout_only"]
    assert set(arms) - {"fp32", "bf16", "rollout_only"} == set(RECIPES) - {"bf16"}
    for recipe in set(RECIPES) - {"bf16"}:
        assert arms[recipe].trainer == recipe
