"""FP8 rollout in OpenRLHF's vLLM engines: which vLLM quantization each rollout recipe becomes.

OpenRLHF 0.11.2 has no flag for FP8 rollout (its engine kwargs hard-code ``dtype="bfloat16"``),
but ``RolloutRayActor`` passes extra kwargs on to ``vllm.AsyncEngineArgs``; the driver adds
:func:`rollout_engine_kwargs` there (``binding.install_driver``). vLLM 0.29 quantizes a BF16
checkpoint *online* while loading it (``vllm/config/quantization.py: _ONLINE_SHORTHANDS``;
``vllm/model_executor/layers/quantization/online/fp8.py``), and re-quantizes when new BF16
weights arrive through its layer-wise reload (``plugin.vllm_sync``), so the engines load the
same HF checkpoint as the trainer and nothing is pre-quantized:

==============  =====================  ====================================================
rollout recipe  ``quantization=``      vLLM 0.29 online method (weights / activations)
==============  =====================  ====================================================
``tensorwise``  ``fp8_per_tensor``     ``Fp8PerTensorOnlineLinearMethod``: one scale per
                                       weight; dynamic **per-token** activations where
                                       Cutlass FP8 runs (H100), else per-tensor
``rowwise``     ``fp8_per_channel``    ``Fp8PtpcOnlineLinearMethod``: one scale per output
                                       channel; dynamic per-token activations (needs a
                                       Cutlass/SM89+ GPU; vLLM refuses Marlin W8A16 for it)
``blockwise``   ``fp8_per_block``      ``Fp8PerBlockOnlineLinearMethod``: 128x128 weight
                                       blocks; dynamic 1x128 activation groups
==============  =====================  ====================================================

Linear layers only: the LM head (``ParallelLMHead``), embeddings, norms and attention stay BF16,
as in the trainer. Other rollout recipes (``mxfp8``: Blackwell only, not in the paper's tables)
are rejected by :func:`check_rollout_recipe` when a paper-scale config is validated, with the
list of supported ones.

Deviation: at paper scale the rollout's FP8 arithmetic is vLLM's own (its quantizer and
kernels); the mini backend emulates the recipes with ``fp8rl.quant.rollout``. The tensorwise
row's activations are per token on Cutlass GPUs (vLLM's choice), not per tensor.

History: the earlier plugin pre-quantized a checkpoint with ``quantization="fp8"`` and per-channel
scales for rowwise, which vLLM 0.29's serialized-FP8 loader rejects (its per-tensor
``PerTensorScaleParameter`` asserts one scale per logical shard).
"""

from __future__ import annotations

from fp8rl.backends.openrlhf.plugin.spec import PluginSpec

#: fp8rl rollout recipe -> vLLM 0.29 ``quantization`` (an online-quantization shorthand).
VLLM_QUANTIZATION = {
    "tensorwise": "fp8_per_tensor",
    "rowwise": "fp8_per_channel",
    "blockwise": "fp8_per_block",
}
#: The vLLM worker extension that keeps FP8 engines in sync with the trainer (``binding``).
WORKER_EXTENSION = "fp8rl.backends.openrlhf.plugin.binding.Fp8WorkerWrap"


def check_rollout_recipe(recipe_name: str) -> None:
    """Raise ``ValueError`` unless the paper-scale rollout engines can run ``recipe_name``."""
    from fp8rl.quant.recipes import get_recipe

    if get_recipe(recipe_name).enabled and recipe_name not in VLLM_QUANTIZATION:
        raise ValueError(
            f"fp8.rollout_recipe={recipe_name!r} has no vLLM 0.29 online quantization at paper scale; "
            f"supported FP8 rollout recipes: {sorted(VLLM_QUANTIZATION)} (or bf16)")


def rollout_engine_kwargs(spec: PluginSpec) -> dict:
    """Extra ``vllm.AsyncEngineArgs`` kwargs of the rollout engines (empty for a bf16 rollout)."""
    from fp8rl.quant.recipes import get_recipe

    if not get_recipe(spec.rollout_recipe).enabled:
        return {}
    check_rollout_recipe(spec.rollout_recipe)
    return {"quantization": VLLM_QUANTIZATION[spec.rollout_recipe], "worker_extension_cls": WORKER_EXTENSION}
