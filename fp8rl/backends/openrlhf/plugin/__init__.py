"""The OpenRLHF 0.11.2 worker plugin: FP8 training, FP8 rollout, our policy loss and Calibrated Clipping.

Modules, by concern (the import of this package is free: names below load their module on use):

- ``spec``: the :class:`PluginSpec` the driver hands to every worker, the version pins.
- ``hook``: the Ray worker setup hook; binds lazily, only in processes that import the
  OpenRLHF modules the plugin changes (standard library only).
- ``binding`` (a package: ``actor``, ``trainer``, ``driver``, ``vllm_worker``, ``agent``): **the one place
  that touches OpenRLHF internals**; its docstring lists every upstream object the plugin wraps,
  in which process, and why it is reached there.
- ``loss``: our ``PolicyLoss`` subclass (the FP8 ratio a calibration reads is its own).
- ``calibration``: the calibration tokens of a step or optimizer step, gathered over DP ranks,
  into the controller (the three calibration modes at paper scale).
- ``fp8_training``: converting the actor's Linears and the guard that refuses BF16-as-FP8.
- ``fp8_rollout``: rollout recipe -> vLLM online FP8 quantization, engine kwargs.
- ``vllm_sync``: the weight sync into FP8 vLLM engines (the one module touching vLLM internals).
- ``metrics``: step metrics from counts summed over micro-batches and DP ranks.
- ``score_centering``: Score Centering's top-k from the vLLM engines to the loss (extraction,
  layout on the experience, trainer log p at the ids).

Paper-scale documentation: docs/cluster.md.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "OPENRLHF_VERSION": "spec", "VLLM_VERSION": "spec", "SPEC_ENV": "spec", "STATE_KEY": "spec",
    "PluginSpec": "spec", "PluginVersionError": "spec", "check_version": "spec", "check_vllm_version": "spec",
    "install_from_env": "hook", "install_lazy": "hook",
    "bind_module": "binding", "install": "binding", "install_driver": "binding", "attest": "binding",
    "check_attestations": "binding", "PluginNotActiveError": "binding", "ResumeError": "binding",
    "UpstreamChangedError": "binding", "SHADOW_OLD_KEY": "binding",
    "make_policy_loss_class": "loss", "correction_from_upstream": "loss",
    "StepTokens": "calibration", "calibration_tokens": "calibration", "gather_calibration": "calibration",
    "Pending": "calibration", "add_measured": "calibration", "varlen_all_gather": "calibration",
    "Fp8ConversionError": "fp8_training", "convert_trainer_model": "fp8_training",
    "count_fp8_layers": "fp8_training", "require_conversion": "fp8_training",
    "VLLM_QUANTIZATION": "fp8_rollout", "check_rollout_recipe": "fp8_rollout",
    "rollout_engine_kwargs": "fp8_rollout",
    "LayerwiseSync": "vllm_sync",
    "StepMetrics": "metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
