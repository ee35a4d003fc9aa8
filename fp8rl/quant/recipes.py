"""The named FP8 recipes (``RECIPES``) and ``get_recipe``.

The ``Recipe`` / ``OperandConfig`` types (the three GEMMs fprop / dgrad / wgrad, their operands,
per-GEMM overrides, the checks) live in ``fp8rl.quant.recipe_types`` and are re-exported here, so
``from fp8rl.quant.recipes import Recipe`` keeps working.

Named recipes (``RECIPES``), and where each comes from (``reference/paper.md``):

======================  ==============================================================  ==================
name                    operands                                                        default impl
                                                                                        (``emulate=False``)
======================  ==============================================================  ==================
``bf16``                no FP8 anywhere                                                 --
``tensorwise``          all per-tensor; grad_output E5M2 (torchao's default: hybrid)    torchao
``tensorwise_delayed``  as ``tensorwise``, scales from an amax history (TE delayed)     transformer_engine
``rowwise``             all per-row E4M3, power-of-two scales (torchao ``rowwise``)     torchao
``rowwise_with_gw_hp``  per-row fprop, dgrad weight per-tensor, wgrad in high precision torchao
``blockwise``           1x128 activations/grads, 128x128 weights, E4M3 (DeepSeek-V3)    transformer_engine
``mxfp8``               MX 1x32 E8M0 scales, E4M3 everywhere                            transformer_engine
``nvfp4``               NVIDIA's NVFP4 recipe: E2M1, 1x16 E4M3 block scales + FP32      fp8rl (emulated)
                        tensor scale, 16x16 weight tiles, stochastic gradients, wgrad RHT
``nvfp4_rn``            the NVFP4 format alone: 1x16 everywhere, nearest even           fp8rl (emulated)
``w4a16``               NVFP4 16x16-tile weights, BF16 activations and gradients        fp8rl (emulated)
``mxfp4``               MXFP4: MX 1x32 E8M0 scales (OCP rule), E2M1 everywhere          fp8rl (emulated)
``mxfp6``               MXFP6: MX 1x32 E8M0 scales (OCP rule), E2M3; gradients E3M2     fp8rl (emulated)
======================  ==============================================================  ==================

The ``impl`` column is the implementation used when FP8 GEMMs run on FP8 kernels; with
``emulate=True`` the default is ``fp8rl`` (our emulated ``Fp8Linear``), which for the torchao
recipes computes exactly what torchao's emulation computes (``fp8rl.quant.convert.default_impl``). ``tensorwise_delayed`` has
no emulation: only Transformer Engine implements delayed scaling.

``get_recipe(name, hybrid=True)`` switches every grad_output operand to E5M2 (Transformer
Engine's ``HYBRID``), ``hybrid=False`` to E4M3 (``Recipe.with_hybrid``); the recipe's name records
the change so that run names stay distinct (``rowwise_hybrid``, ``tensorwise_e4m3g``).

Choices made here:

- ``tensorwise`` keeps torchao's E5M2 gradients because the paper trained with torchao's
  recipes; ``blockwise`` and ``mxfp8`` use E4M3 gradients as DeepSeek-V3 and torchao's MX
  training do. The paper does not state its gradient format [G].
- ``blockwise`` uses float32 (not power-of-two) scales, as DeepSeek-V3 describes; Transformer
  Engine's ``Float8BlockScaling`` defaults to power-of-two scales (``fp8rl.quant.te`` passes our
  ``pow2_scales`` to TE explicitly, so both implementations quantize alike). Flip
  ``pow2_scales`` to try TE's default.
- ``mxfp8`` quantizes wgrad operands in 1x32 groups along the token dimension (the contraction
  dimension of wgrad), as the MX GEMM requires.
- FP4 / FP6 recipes (``nvfp4``, ``mxfp4``, ``mxfp6``; formats and scale rules in
  ``fp8rl.quant.microscale``): all three GEMMs, every operand quantized in ``1 x block`` groups
  along its GEMM's contraction dimension (wgrad: along tokens), round to nearest even, no
  transform. They run emulated only (``fp8.emulate=true``): no FP4/FP6 GEMM kernel is wired in
  (``convert.check_supported`` refuses, naming the GPU generation, Blackwell sm100+, that has
  them). ``impl`` is ``fp8rl``. What they leave out of the recipes they are named after [G]:
  NVIDIA's NVFP4 *training* recipe (arXiv:2509.25149 section 4; Transformer Engine's
  ``NVFP4BlockScaling``) adds 16x16 2-D weight blocks, a 16x16 random Hadamard transform on the
  wgrad operands, stochastic rounding of gradients and BF16 for some final layers; none is
  implemented in ``nvfp4_rn`` (the NVFP4 *format* with nearest-even everywhere). ``nvfp4`` is that
  recipe: 16x16 weight tiles (``NVBlock(16, rows=16)``), stochastic rounding of ``grad_output``
  (``fp8rl.quant.rounding``) and the 16x16 RHT on both wgrad operands (``wgrad_rht``,
  ``fp8rl.quant.hadamard``); the BF16 final layers are not done [G] (the LM head stays BF16 as
  everywhere). ``w4a16`` (``weight_only``): only the weight of fprop and dgrad is FP4 (16x16 tiles,
  so both GEMMs see one quantized weight), activations and gradients stay in the compute dtype,
  wgrad runs in high precision onto the master weights. ``mxfp6`` casts gradients to E3M2 (the wider-range FP6, by analogy with FP8's hybrid
  E5M2 gradients) and inputs/weights to E2M3; the OCP spec does not prescribe which [G].
- ``tensorwise_delayed`` (``scaling="delayed"``): each operand's scale comes from the maximum
  (``amax_compute_algo="max"``) or the latest (``"most_recent"``) of the last
  ``amax_history_len`` amaxes instead of the current tensor's amax. Defaults are Transformer
  Engine's ``DelayedScaling`` defaults (1024, ``max``); Megatron-LM's are (1, ``most_recent``).
  ``get_recipe("tensorwise_delayed", amax_history_len=16, amax_compute_algo="most_recent")``
  changes them and renames the recipe (``tensorwise_delayed_h16_most_recent``).
"""

from __future__ import annotations

from fp8rl.quant.formats import E2M1, E2M3, E3M2, E4M3, E5M2
from fp8rl.quant.granularity import MX, NVBlock, PerBlock, PerRow, PerTensor
from fp8rl.quant.recipe_types import AMAX_COMPUTE_ALGOS, GEMMS, SCALINGS, OperandConfig, Recipe
from fp8rl.registry import Registry

__all__ = ["AMAX_COMPUTE_ALGOS", "GEMMS", "RECIPES", "SCALINGS", "OperandConfig", "Recipe", "get_recipe"]


RECIPES: Registry[Recipe] = Registry("FP8 recipe")


def _register(recipe: Recipe) -> Recipe:
    RECIPES.add(recipe.name, recipe)
    return recipe


_ALL = {"fprop": True, "dgrad": True, "wgrad": True}

_register(Recipe("bf16", impl="none"))
_register(
    Recipe(
        "tensorwise",
        input=OperandConfig(PerTensor(), E4M3),
        weight=OperandConfig(PerTensor(), E4M3),
        grad_output=OperandConfig(PerTensor(), E5M2),
        impl="torchao",
        **_ALL,
    )
)
_register(
    Recipe(
        "tensorwise_delayed",
        input=OperandConfig(PerTensor(), E4M3),
        weight=OperandConfig(PerTensor(), E4M3),
        grad_output=OperandConfig(PerTensor(), E5M2),
        impl="transformer_engine",
        scaling="delayed",
        amax_history_len=1024,
        amax_compute_algo="max",
        **_ALL,
    )
)
_register(
    Recipe(
        "rowwise",
        input=OperandConfig(PerRow(), E4M3),
        weight=OperandConfig(PerRow(), E4M3),
        grad_output=OperandConfig(PerRow(), E4M3),
        pow2_scales=True,
        impl="torchao",
        **_ALL,
    )
)
_register(
    Recipe(
        "rowwise_with_gw_hp",
        input=OperandConfig(PerRow(), E4M3),
        weight=OperandConfig(PerRow(), E4M3),
        grad_output=OperandConfig(PerRow(), E4M3),
        weight_for_dgrad=OperandConfig(PerTensor(), E4M3),
        fprop=True,
        dgrad=True,
        wgrad=False,
        pow2_scales=True,
        impl="torchao",
    )
)
_register(
    Recipe(
        "blockwise",
        input=OperandConfig(PerBlock(1, 128), E4M3),
        weight=OperandConfig(PerBlock(128, 128), E4M3),
        grad_output=OperandConfig(PerBlock(1, 128), E4M3),
        impl="transformer_engine",
        **_ALL,
    )
)
_register(
    Recipe(  # NVIDIA's NVFP4 training recipe (arXiv:2509.25149 section 4; TE NVFP4BlockScaling)
        "nvfp4",
        input=OperandConfig(NVBlock(16), E2M1),
        weight=OperandConfig(NVBlock(16, rows=16), E2M1),
        grad_output=OperandConfig(NVBlock(16), E2M1, rounding="stochastic"),
        wgrad_rht=True,
        impl="fp8rl",
        **_ALL,
    )
)
_register(
    Recipe(  # the NVFP4 format alone: 1x16 blocks everywhere, nearest even, no transform
        "nvfp4_rn",
        input=OperandConfig(NVBlock(16), E2M1),
        weight=OperandConfig(NVBlock(16), E2M1),
        grad_output=OperandConfig(NVBlock(16), E2M1),
        impl="fp8rl",
        **_ALL,
    )
)
_register(
    Recipe(  # FP4 (NVFP4, 16x16 weight tiles) weights, BF16 activations and gradients
        "w4a16",
        weight=OperandConfig(NVBlock(16, rows=16), E2M1),
        fprop=True,
        dgrad=True,
        wgrad=False,
        weight_only=True,
        impl="fp8rl",
    )
)
_register(
    Recipe(
        "mxfp4",
        input=OperandConfig(MX(32), E2M1),
        weight=OperandConfig(MX(32), E2M1),
        grad_output=OperandConfig(MX(32), E2M1),
        impl="fp8rl",
        **_ALL,
    )
)
_register(
    Recipe(
        "mxfp6",
        input=OperandConfig(MX(32), E2M3),
        weight=OperandConfig(MX(32), E2M3),
        grad_output=OperandConfig(MX(32), E3M2),
        impl="fp8rl",
        **_ALL,
    )
)
_register(
    Recipe(
        "mxfp8",
        input=OperandConfig(MX(32), E4M3),
        weight=OperandConfig(MX(32), E4M3),
        grad_output=OperandConfig(MX(32), E4M3),
        impl="transformer_engine",
        **_ALL,
    )
)


def get_recipe(
    name: str | Recipe,
    *,
    hybrid: bool | None = None,
    amax_history_len: int | None = None,
    amax_compute_algo: str | None = None,
) -> Recipe:
    """Look up a named recipe (or pass a ``Recipe`` through).

    ``hybrid`` overrides the grad format; ``amax_history_len`` / ``amax_compute_algo`` override
    a delayed-scaling recipe's options (``ValueError`` on a dynamic-scaling recipe).
    """
    recipe = name if isinstance(name, Recipe) else RECIPES[name]
    if hybrid is not None:
        recipe = recipe.with_hybrid(hybrid)
    if amax_history_len is not None or amax_compute_algo is not None:
        recipe = recipe.with_delayed(amax_history_len, amax_compute_algo)
    return recipe
