"""FP8 training of the OpenRLHF actor: convert its Linears, and refuse to train if that did not happen.

The binding calls :func:`convert_trainer_model` on the policy's HF model inside
``DeepspeedStrategy._ds_init_train_model``, i.e. after ``Actor(...)`` built it (under ZeRO-3
already partitioned by ``zero.Init``) and right before ``deepspeed.initialize`` wraps it, so
DeepSpeed registers its parameter hooks on the FP8 modules. ``fp8rl.quant.convert_to_fp8``
swaps every ``nn.Linear`` but the LM head (embeddings are no Linears) for the trainer recipe's
FP8 linear, keeping the original weight ``Parameter`` objects (no copies): DeepSpeed's partitioned
parameters, the optimizer's parameter list and the parameter names that the weight sync sends
to vLLM stay what they were. Only the trained policy is converted: the EMA copy and the
reference model (``_ds_init_eval_model``) run in BF16.

:func:`require_conversion` is the guard that makes a cell fail instead of silently training in
BF16 and being reported as FP8: a recipe that asks for FP8 with no FP8 layer in the actor (or
FP8 layers in a ``bf16`` cell) raises :class:`Fp8ConversionError` naming the recipe, the counts
and the likely cause. The binding runs it right after the conversion, again when the trainer
is built, and the driver asks every actor for it before training starts (``binding.attest``).

Guess (unverified on GPUs here; ``benchmarks/gpu_paper_smoke.py`` checks it): FP8 layers made
before ``deepspeed.initialize`` train correctly under ZeRO-3, because the layers keep the
partitioned Parameter and DeepSpeed gathers it before each module's forward. On CPU the
integration tier runs exactly this (ZeRO-3, gloo, torchao and emulated recipes).
"""

from __future__ import annotations

import torch

from fp8rl.backends.openrlhf.plugin.spec import PluginSpec


def trainer_recipe_problem(recipe) -> str | None:
    """Why the paper-scale trainer cannot run ``recipe`` (one clause naming the GPU generation and
    the library version it needs, ``fp8rl.quant.te.SUBBYTE_TRAINER_NEEDS``), or ``None``. Pure: the
    same refusal that ``convert_to_fp8`` (``check_supported``) raises on the node, given before
    submission (``check_paper_scale_recipes``): FP4/FP6 recipes have no GPU implementation here."""
    from fp8rl.quant.recipes import get_recipe
    from fp8rl.quant.te import subbyte_trainer_needs

    recipe = get_recipe(recipe)
    if not (recipe.enabled and recipe.microscaled):
        return None
    return f"trainer {recipe.name} needs {subbyte_trainer_needs(recipe)}"


class Fp8ConversionError(RuntimeError):
    """The trainer's configured FP8 conversion did not happen (or happened in a BF16 cell)."""


def convert_trainer_model(model: torch.nn.Module, spec: PluginSpec) -> torch.nn.Module:
    """Convert ``model`` in place to FP8 training GEMMs per ``spec.trainer_recipe`` (loud if unsupported).

    The hardware check uses the CUDA device this process trains on when there is one (the
    model may still sit on the CPU before DeepSpeed moves it); otherwise the model's device.
    """
    from fp8rl.quant.convert import convert_to_fp8

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    return convert_to_fp8(model, spec.trainer_recipe, impl=spec.trainer_impl, emulate=spec.trainer_emulate,
                          device=device)


def count_fp8_layers(model: torch.nn.Module) -> int:
    """Number of FP8-converted linear layers in ``model`` (a DeepSpeed engine or any module)."""
    from fp8rl.quant.convert import fp8_layers

    return len(fp8_layers(model))


def require_conversion(spec: PluginSpec, n_fp8: int, where: str) -> None:
    """Raise :class:`Fp8ConversionError` unless ``n_fp8`` FP8 layers agree with ``spec.trainer_recipe``."""
    wants = spec.trainer_recipe.enabled
    if wants and n_fp8 == 0:
        raise Fp8ConversionError(
            f"{where}: the cell's trainer recipe is {spec.trainer_recipe.name!r} but the actor has no FP8 "
            "linear layer: the conversion did not run (the plugin's binding into OpenRLHF's "
            "DeepspeedStrategy was not reached). Refusing to train in BF16 and report FP8.")
    if not wants and n_fp8 > 0:
        raise Fp8ConversionError(
            f"{where}: the cell's trainer recipe is {spec.trainer_recipe.name!r} (no FP8) but the actor has "
            f"{n_fp8} FP8 linear layer(s)")
