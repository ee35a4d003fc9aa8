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
list of supported ones. The FP4/FP6 recipes (``nvfp4``, ``nvfp4_rn``, ``w4a16``, ``mxfp4``,
``mxfp6``) are not mapped: :func:`check_paper_scale_recipes` refuses such a cell before submission
in one line naming what the rollout side (:data:`SUBBYTE_ROLLOUT_NEEDS`: GPU generation, vLLM
method) and the trainer side (``fp8rl.quant.te.SUBBYTE_TRAINER_NEEDS``: GPU generation,
Transformer Engine recipe and version) would need. vLLM 0.29 does have an online ``mxfp4``
linear method (FlashInfer W4A4 on sm100+, Marlin W4A16 fallback on sm80+): the next one to map,
once the weight sync's reload through it is checked on a Blackwell GPU.

Deviation: at paper scale the rollout's FP8 arithmetic is vLLM's own (its quantizer and
kernels); the mini backend emulates the recipes with ``fp8rl.quant.rollout``. The tensorwise
row's activations are per token on Cutlass GPUs (vLLM's choice), not per tensor.

Hardware (:func:`check_rollout_hardware`, pure: the devices are arguments). All three methods
run W8A8 -- FP8 weights *and* FP8 activations on FP8 tensor cores -- only on GPUs of compute
capability 8.9 or more (sm89 Ada: L40S, L4; sm90 Hopper: H100, H200; sm100 Blackwell: B200).
Below that (A100 sm80, V100 sm70, T4 sm75) vLLM 0.29 has no W8A8 FP8 kernel and falls back to
weight-only FP8 (Marlin, W8A16: BF16 activations), or refuses per-channel scales: not the paper's
rollout, and for tensorwise and blockwise without an error. So a cell with an FP8 rollout refuses
to start there (``Fp8UnsupportedError`` naming the GPU, its capability and the fix). The trainer
side asks more of some recipes (``fp8rl.quant.convert.check_supported``: per-tensor and per-row
via torchao 8.9+, blockwise via Transformer Engine 9.0+, mxfp8 10.x); :func:`check_cell_hardware`
checks both, and :func:`check_node_hardware` -- called first thing by ``binding.install_driver``,
on the head node of the cell's allocation, before any engine or actor is built -- reads the
node's GPUs with ``torch.cuda`` (and skips on a machine without CUDA: the CPU smoke runs). The
refusal reaches the FAILED run's reason (``run.PLUGIN_ERRORS``). Only the head node's GPUs are
read: a multi-node cell is assumed to get one kind of GPU (a partition or constraint).

History: the earlier plugin pre-quantized a checkpoint with ``quantization="fp8"`` and per-channel
scales for rowwise, which vLLM 0.29's serialized-FP8 loader rejects (its per-tensor
``PerTensorScaleParameter`` asserts one scale per logical shard).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fp8rl.backends.openrlhf.plugin.spec import PluginSpec

if TYPE_CHECKING:
    from fp8rl.quant.recipes import Recipe

#: fp8rl rollout recipe -> vLLM 0.29 ``quantization`` (an online-quantization shorthand).
VLLM_QUANTIZATION = {
    "tensorwise": "fp8_per_tensor",
    "rowwise": "fp8_per_channel",
    "blockwise": "fp8_per_block",
}
#: The vLLM worker extension that keeps FP8 engines in sync with the trainer (``binding``).
WORKER_EXTENSION = "fp8rl.backends.openrlhf.plugin.binding.Fp8WorkerWrap"
#: Least CUDA compute capability with FP8 tensor cores, where vLLM runs its W8A8 FP8 kernels.
W8A8_MIN_CAPABILITY = (8, 9)
#: GPUs of that kind, for messages.
W8A8_GPUS = "L40S, H100, H200, B200"

#: One GPU as the checks take it: ``(name, (major, minor))``, e.g. ``("NVIDIA H100 80GB HBM3", (9, 0))``.
Device = tuple[str, tuple[int, int]]


#: What each FP4/FP6 rollout recipe would need of the GPUs and of vLLM, in words (read from vLLM
#: 0.29's source: ``config/quantization.py`` ``_ONLINE_SHORTHANDS``, ``layers/quantization/online/``,
#: ``kernels/linear/mxfp4/``). None is mapped: each is refused before submission (one line).
SUBBYTE_ROLLOUT_NEEDS: dict[str, str] = {
    "nvfp4": ("Blackwell (sm100+) and a vLLM that quantizes synced weights to NVFP4 online for linear layers "
              "(vLLM 0.29 runs NVFP4 linears only from pre-quantized ModelOpt/compressed-tensors checkpoints; "
              "its online NVFP4 covers MoE experts only)"),
    "mxfp4": ("Blackwell (sm100+, FlashInfer W4A4) for vLLM 0.29's online mxfp4 linear method, not mapped by fp8rl "
              "yet (its weight-sync reload is unchecked, and on sm80-sm90 vLLM would run Marlin W4A16 instead)"),
    "mxfp6": ("Blackwell (sm100+) and a vLLM with an MXFP6 linear kernel on CUDA (vLLM 0.29 has MXFP6 only in "
              "AMD Quark's emulation)"),
    "w4a16": ("Ampere or newer (sm80+, Marlin FP4 W4A16) and a vLLM that quantizes synced BF16 weights to NVFP4 "
              "online (vLLM 0.29 runs NVFP4 W4A16 only from pre-quantized checkpoints)"),
}
SUBBYTE_ROLLOUT_NEEDS["nvfp4_rn"] = SUBBYTE_ROLLOUT_NEEDS["nvfp4"]


def rollout_recipe_problem(recipe: str | Recipe) -> str | None:
    """Why the paper-scale rollout engines cannot run ``recipe`` (one clause), or ``None``."""
    from fp8rl.quant.recipes import get_recipe

    recipe = get_recipe(recipe)
    if not recipe.enabled or recipe.name in VLLM_QUANTIZATION:
        return None
    if recipe.microscaled:
        need = SUBBYTE_ROLLOUT_NEEDS.get(recipe.name, "Blackwell (sm100+) and an FP4/FP6 vLLM method fp8rl maps")
        return f"rollout {recipe.name} needs {need}"
    return (f"rollout {recipe.name} has no vLLM 0.29 online quantization here (supported FP8 rollout recipes: "
            f"{sorted(VLLM_QUANTIZATION)}, or bf16)")


def check_paper_scale_recipes(rollout_recipe: str | Recipe, trainer_recipe: str | Recipe) -> None:
    """Refuse a paper-scale cell whose rollout or trainer recipe the pinned stack cannot run, before
    submission, in ONE line that names what each refused side needs (GPU generation, library and
    version): rollout from :data:`SUBBYTE_ROLLOUT_NEEDS`, trainer from
    ``fp8rl.quant.te.SUBBYTE_TRAINER_NEEDS`` (``fp8_training.trainer_recipe_problem``)."""
    from fp8rl.backends.openrlhf.plugin.fp8_training import trainer_recipe_problem
    from fp8rl.quant.recipes import get_recipe

    rollout, trainer = get_recipe(rollout_recipe), get_recipe(trainer_recipe)
    problems = [p for p in (rollout_recipe_problem(rollout), trainer_recipe_problem(trainer)) if p]
    if problems:
        raise ValueError(
            f"fp8.rollout_recipe={rollout.name!r} / fp8.trainer_recipe={trainer.name!r} refused at paper scale: "
            + "; ".join(problems) + ". Run FP4/FP6 arms at mini scale (emulated), or pick an FP8 arm "
            f"({', '.join(sorted(VLLM_QUANTIZATION))}) here")


def check_rollout_recipe(recipe: str | Recipe) -> None:
    """Raise ``ValueError`` unless the paper-scale rollout engines can run ``recipe`` (a ``Recipe``
    or a ``RECIPES`` name)."""
    from fp8rl.quant.recipes import get_recipe

    recipe = get_recipe(recipe)
    recipe_name = recipe.name
    if recipe.enabled and recipe_name not in VLLM_QUANTIZATION and recipe.microscaled:
        raise ValueError(
            f"fp8.rollout_recipe={recipe_name!r} (FP4/FP6) is refused at paper scale: {rollout_recipe_problem(recipe)}; "
            f"run it at mini scale (emulated), or use one of {sorted(VLLM_QUANTIZATION)} (or bf16)")
    if recipe.enabled and recipe_name not in VLLM_QUANTIZATION:
        raise ValueError(
            f"fp8.rollout_recipe={recipe_name!r} has no vLLM 0.29 online quantization at paper scale; "
            f"supported FP8 rollout recipes: {sorted(VLLM_QUANTIZATION)} (or bf16)")


def rollout_engine_kwargs(spec: PluginSpec) -> dict:
    """Extra ``vllm.AsyncEngineArgs`` kwargs of the rollout engines (empty for a bf16 rollout on
    GPUs with vLLM's default batching); ``max_num_seqs`` when the spec sets it."""
    extra = {"max_num_seqs": spec.engine_max_num_seqs} if spec.engine_max_num_seqs is not None else {}
    recipe = spec.rollout_recipe.name
    if not spec.rollout_recipe.enabled:
        # on CPU, BF16 engines need our extension too (upstream's sync allocates on "cuda")
        return {"worker_extension_cls": WORKER_EXTENSION, **extra} if spec.device == "cpu" else extra
    check_rollout_recipe(recipe)
    if spec.device == "cpu":
        from fp8rl.backends.openrlhf.plugin.cpu_support import check_cpu_rollout

        check_cpu_rollout(recipe)
    return {"quantization": VLLM_QUANTIZATION[recipe], "worker_extension_cls": WORKER_EXTENSION,
            **extra}


def _sm(capability: Sequence[int]) -> str:
    return f"sm{capability[0]}{capability[1]}"


def _which(devices: Sequence[Device], indices: list[int]) -> str:
    """``GPU 0-3 (NVIDIA A100-SXM4-80GB, sm80), GPU 5,7 (Tesla T4, sm75)``."""
    groups: dict[tuple, list[int]] = {}
    for i in indices:
        name, cap = devices[i]
        groups.setdefault((name, tuple(cap)), []).append(i)
    parts = []
    for (name, cap), idx in groups.items():
        runs, start = [], idx[0]
        for a, b in zip(idx, [*idx[1:], None], strict=True):
            if b != a + 1:
                runs.append(str(start) if start == a else f"{start}-{a}")
                start = b
        parts.append(f"GPU {','.join(runs)} ({name}, {_sm(cap)})")
    return ", ".join(parts)


def check_rollout_hardware(recipe: str | Recipe, devices: Sequence[Device]) -> None:
    """Raise ``Fp8UnsupportedError`` unless every GPU in ``devices`` runs ``recipe``'s vLLM
    FP8 method as W8A8 (compute capability >= 8.9); a bf16 rollout is never refused. Pure.

    ``devices``: ``(name, (major, minor))`` per GPU, in device order (indices name them).
    """
    from fp8rl.quant.modules import Fp8UnsupportedError
    from fp8rl.quant.recipes import get_recipe

    recipe = get_recipe(recipe)
    recipe_name = recipe.name
    if not recipe.enabled:
        return
    check_rollout_recipe(recipe)
    bad = [i for i, (_, cap) in enumerate(devices) if tuple(cap) < W8A8_MIN_CAPABILITY]
    if bad:
        raise Fp8UnsupportedError(
            f"fp8.rollout_recipe={recipe_name!r} needs FP8 tensor cores for vLLM's W8A8 "
            f"{VLLM_QUANTIZATION[recipe_name]} (compute capability >= 8.9: {W8A8_GPUS}); "
            f"{_which(devices, bad)} lacks them: vLLM would run weight-only FP8 (Marlin W8A16) or fail. "
            "Use the bf16 arm (fp8=bf16) here, or sm89+ GPUs for FP8 cells (another partition or "
            "constraint in the cluster profile); blockwise training needs sm90+, mxfp8 sm100")


def check_trainer_hardware(spec: PluginSpec, devices: Sequence[Device]) -> None:
    """Raise ``Fp8UnsupportedError`` unless every GPU in ``devices`` runs the spec's trainer recipe
    with its implementation (``fp8rl.quant.convert.check_supported``, the conversion's own check). Pure."""
    from fp8rl.quant.convert import check_supported, resolve_impl
    from fp8rl.quant.modules import Fp8UnsupportedError
    recipe = spec.trainer_recipe
    if not recipe.enabled:
        return
    impl = resolve_impl(recipe, spec.trainer_impl, emulate=spec.trainer_emulate)
    bad, first = [], None
    for i, (_, cap) in enumerate(devices):
        try:
            check_supported(recipe, impl=impl, device_type="cuda", capability=tuple(cap),
                            emulate=spec.trainer_emulate)
        except Fp8UnsupportedError as e:
            bad.append(i)
            first = first or e
    if first is not None:
        raise Fp8UnsupportedError(
            f"fp8.trainer_recipe={recipe.name!r} ({impl}) cannot train on {_which(devices, bad)}: {first}") from first


def check_cell_hardware(spec: PluginSpec, devices: Sequence[Device]) -> None:
    """The rollout and the trainer recipe of ``spec`` on ``devices`` (rollout first). Pure."""
    check_rollout_hardware(spec.rollout_recipe, devices)
    check_trainer_hardware(spec, devices)


def visible_devices() -> list[Device] | None:
    """This node's CUDA GPUs as :data:`Device` tuples; ``None`` when CUDA is not available."""
    import torch

    if not torch.cuda.is_available():
        return None
    return [(torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
            for i in range(torch.cuda.device_count())]


def check_node_hardware(spec: PluginSpec, devices: Sequence[Device] | None = None) -> None:
    """The start-up refusal of ``binding.install_driver``: :func:`check_cell_hardware` on this
    node's GPUs (``devices``, default :func:`visible_devices`). Does nothing for an all-BF16 cell,
    a CPU job (``spec.device == "cpu"``) or on a machine without CUDA."""
    if getattr(spec, "device", "cuda") == "cpu":
        return
    if not (spec.rollout_recipe.enabled or spec.trainer_recipe.enabled):
        return
    if devices is None:
        devices = visible_devices()
        if devices is None:
            return
    check_cell_hardware(spec, devices)
