"""A paper-scale cell fails with the reason: the plugin's error from the log; a train set smaller
than the episode plan assumed."""

import dataclasses

from orl_helpers import main_table_configs

from fp8rl.backends.openrlhf.run import check_train_set, plugin_error


def test_failed_run_quotes_the_plugins_error(tmp_path):
    log = tmp_path / "driver.1.log"
    log.write_text(
        "(PolicyModelActor pid=12) Traceback (most recent call last):\n"
        "ray.exceptions.RayTaskError(Fp8ConversionError): ray::PolicyModelActor.init_model_from_pretrained()\n"
        "fp8rl.backends.openrlhf.plugin.fp8_training.Fp8ConversionError: ActorPPOTrainer.__init__: the cell's "
        "trainer recipe is 'tensorwise' but the actor has no FP8 linear layer\n")
    got = plugin_error(log)
    assert got.startswith("Fp8ConversionError: ActorPPOTrainer.__init__: the cell's trainer recipe is 'tensorwise'")
    log.write_text("Global step 1: {}\nsomething else failed\n")
    assert plugin_error(log) is None
    assert plugin_error(tmp_path / "missing.log") is None


def test_a_train_set_smaller_than_planned_fails_before_training(tmp_path):
    cfg = dict(main_table_configs(tmp_path))[("dapo", "14b", "bf16", "vanilla")]
    f = tmp_path / "dapo.jsonl"
    f.write_text("{}\n" * 17000)
    assert check_train_set(cfg, f) is None
    f.write_text("{}\n" * 16999)
    reason = check_train_set(cfg, f)
    assert "16999 prompts" in reason and "train_set_sizes.dapo_math_17k=17000" in reason
    assert check_train_set(dataclasses.replace(cfg, steps=1), f) is None  # one episode of 384 prompts
