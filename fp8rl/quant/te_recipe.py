"""Transformer Engine's recipe for each of our recipes, and what TE needs to run it.

``fp8rl.quant.te`` runs our ``Recipe`` on Transformer Engine (``impl="transformer_engine"``,
module conversion there); this module is its pure half: which TE recipe family expresses a
recipe (``te_recipe_kind``), the TE recipe object (``to_te_recipe``), the GPUs and shapes each
family needs (``TE_KINDS``, ``check_te_supported``, ``te_shape_problem``), the TE import
(``import_te``), and the refusal text for FP4/FP6 recipes on the trainer side
(``SUBBYTE_TRAINER_NEEDS``). Everything here is re-exported by ``fp8rl.quant.te``. Transformer
Engine is imported lazily, inside the functions that need it (never at import).

Recipe mapping (``to_te_recipe``; TE classes from ``transformer_engine.common.recipe``, fields
read from TE 2.20.2's source):

====================== ======================== ================================================
ours                   TE                       arguments
====================== ======================== ================================================
``tensorwise``         ``Float8CurrentScaling`` ``fp8_format``; ``use_power_2_scales`` and the
                                                three ``QParams(power_2_scale=pow2_scales)``
``tensorwise_delayed`` ``DelayedScaling``       ``fp8_format``, ``amax_history_len``,
                                                ``amax_compute_algo``, ``margin=0``,
                                                ``reduce_amax=False``
``blockwise``          ``Float8BlockScaling``   ``fp8_format``, ``x/w/grad_block_scaling_dim``
                                                (1x128 -> 1, 128x128 -> 2), ``QParams`` as above
``mxfp8``              ``MXFP8BlockScaling``    ``fp8_format``, ``margin=0``
====================== ======================== ================================================

``fp8_format`` is ``Format.E4M3`` when our gradients are E4M3 and ``Format.HYBRID`` (E4M3
forward, E5M2 gradients) when they are E5M2 (``tensorwise``'s default, ``with_hybrid``); TE's
forward is always E4M3, so a recipe with E5M2 inputs or weights is refused. Every recipe also
gets ``backward_override=None`` and ``fp8_dpa=fp8_mha=False`` (attention stays in BF16: only
``nn.Linear`` layers are converted). Passing these explicitly matters: TE reads their defaults
(and the power-of-two scale defaults) from environment variables at import, and a run's config must say
all that runs (docs/design.md, "Typed configs"). Recipes TE cannot express (per-row scaling, a GEMM kept in high precision,
per-GEMM operand overrides, other block shapes) raise ``ValueError`` naming ``impl='torchao'``
or ``impl='fp8rl'``.

Hardware (``TE_KINDS``; checked by ``check_te_supported`` from the model's device at
conversion, and again by TE's own ``is_*_available`` at conversion):

==================== ================================================ =========================
TE recipe            GPU                                              shapes (multiples of)
==================== ================================================ =========================
current / delayed    compute capability >= 8.9 (Ada, Hopper,           in/out features 16,
                     Blackwell); CUDA >= 12.1 on Ada                   tokens 16
Float8BlockScaling   >= 9.0 (Hopper and newer); CUDA >= 12.9           16, tokens 16
MXFP8BlockScaling    10.x (B200/GB200/B300: sm100/sm103); TE 2.20.2    32, tokens 32
                     refuses sm120 (consumer Blackwell)
==================== ================================================ =========================

Choices and deviations (we had to guess or chose):

- **Delayed scaling keeps local amaxes** (``reduce_amax=False``): with the per-layer autocast of ``fp8rl.quant.te``,
  ``reduce_amax=True`` would all-reduce at every layer's exit. Data-parallel ranks then scale
  activations and gradients from their own history (as current scaling does); weights are
  replicated, so their amaxes agree anyway.
- **Float32 block scales** for ``blockwise`` (our recipe's ``pow2_scales=False``, DeepSeek-V3);
  TE's default is power-of-two. We set ``QParams(power_2_scale=...)`` on the recipe instance
  because TE 2.20.2 declares them as class attributes, not constructor fields.
- ``amax_epsilon=0`` (TE's default); our quantizer clamps amax at 1e-12 (torchao's EPS). Only
  all-zero blocks differ, and both give zeros.
- TE's GEMM accumulation options (``MMParams``) keep TE's defaults: ``Float8CurrentScaling``
  uses fast (non-split) accumulation in fprop, the emulation accumulates in float32.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from fp8rl.quant.formats import E4M3, E5M2
from fp8rl.quant.granularity import MX, PerBlock, PerTensor
from fp8rl.quant.modules import Fp8UnsupportedError
from fp8rl.quant.recipes import GEMMS, Recipe, get_recipe

__all__ = [
    "EMULATE_HINT",
    "INSTALL_HINT",
    "SUBBYTE_TRAINER_NEEDS",
    "TE_KINDS",
    "TE_VERSION",
    "TeKind",
    "check_te_supported",
    "import_te",
    "subbyte_trainer_needs",
    "te_recipe_kind",
    "te_shape_problem",
    "to_te_recipe",
]

#: The Transformer Engine version the ``cluster`` extra pins and this module was written against.
TE_VERSION = "2.20.2"
INSTALL_HINT = (
    f"install it on the GPU nodes with pip install 'fp8rl[cluster]' "
    f"(transformer-engine[pytorch]=={TE_VERSION}, CUDA 12)"
)
#: The emulated alternative, named by every refusal of ``impl="transformer_engine"``.
EMULATE_HINT = "emulate it with fp8.emulate=true and fp8.impl=auto (convert_to_fp8(..., emulate=True))"
#: What training each FP4/FP6 recipe on GPUs would take, in words (GPU generation, library and
#: version); the one text of every trainer-side refusal (``te_recipe_kind``,
#: ``convert.check_supported``, the paper-scale check ``plugin.fp8_training.trainer_recipe_problem``).
#: TE's ``NVFP4BlockScaling`` came with TE 2.8 (PR #2177); its full recipe (RHT, stochastic
#: rounding) runs on sm100/sm103 only, sm120 without those two.
SUBBYTE_TRAINER_NEEDS: dict[str, str] = {
    "nvfp4": (f"Blackwell B200/GB200/B300 (sm100/sm103) with Transformer Engine >= 2.8's NVFP4BlockScaling "
              f"(in the pinned TE {TE_VERSION}; fp8rl does not map it yet)"),
    "nvfp4_rn": (f"Blackwell (sm100+) with Transformer Engine >= 2.8's NVFP4BlockScaling(disable_rht, "
                 f"disable_stochastic_rounding, disable_2d_quantization) (in the pinned TE {TE_VERSION}; not mapped "
                 f"by fp8rl yet)"),
    "mxfp4": (f"Blackwell (sm100+) MXFP4 tensor cores and a training library with an MXFP4 recipe (Transformer "
              f"Engine {TE_VERSION} has MXFP8 and NVFP4 only)"),
    "mxfp6": (f"Blackwell (sm100+) MXFP6 tensor cores and a training library with an MXFP6 recipe (Transformer "
              f"Engine {TE_VERSION} has MXFP8 and NVFP4 only)"),
    "w4a16": (f"a weight-only FP4 training linear (W4A16 GEMMs, e.g. Marlin FP4 on sm80+) wired into the trainer "
              f"(Transformer Engine {TE_VERSION} has no weight-only recipe)"),
}


def subbyte_trainer_needs(recipe: Recipe) -> str:
    """``SUBBYTE_TRAINER_NEEDS`` of an FP4/FP6 recipe, or a generic line for an unlisted one."""
    return SUBBYTE_TRAINER_NEEDS.get(
        recipe.name, "Blackwell (sm100+) FP4/FP6 tensor cores and a library recipe that fp8rl maps")


@dataclass(frozen=True)
class TeKind:
    """One TE recipe family: its class, the GPUs it runs on and the shapes it accepts.

    Attributes:
        te_class: class name in ``transformer_engine.common.recipe``.
        min_capability, max_capability: CUDA compute capability range ``[min, max)``.
        align: ``in_features``, ``out_features`` and the token count must be multiples of it.
        available_fn: TE's own check in ``transformer_engine.pytorch`` (``(ok, reason)``).
        gpus: the GPUs in words, for error messages and docs.
    """

    te_class: str
    min_capability: tuple[int, int]
    max_capability: tuple[int, int] | None
    align: int
    available_fn: str
    gpus: str


TE_KINDS: dict[str, TeKind] = {
    "current": TeKind("Float8CurrentScaling", (8, 9), None, 16, "is_fp8_available",
                      "compute capability >= 8.9 (Ada, Hopper, Blackwell)"),
    "delayed": TeKind("DelayedScaling", (8, 9), None, 16, "is_fp8_available",
                      "compute capability >= 8.9 (Ada, Hopper, Blackwell)"),
    "block": TeKind("Float8BlockScaling", (9, 0), None, 16, "is_fp8_block_scaling_available",
                    "compute capability >= 9.0 (Hopper and newer) with CUDA >= 12.9"),
    "mxfp8": TeKind("MXFP8BlockScaling", (10, 0), (12, 0), 32, "is_mxfp8_available",
                    "compute capability 10.x (Blackwell B200/GB200/B300)"),
}


def import_te():
    """``(transformer_engine.pytorch, transformer_engine.common.recipe)``, or a clear error.

    Raises ``Fp8UnsupportedError`` naming the install command and the emulated alternative when
    TE is missing or fails to import (TE raises ``OSError``/``RuntimeError`` without CUDA).
    """
    try:
        te = importlib.import_module("transformer_engine.pytorch")
        recipe_mod = importlib.import_module("transformer_engine.common.recipe")
    except Exception as e:  # ImportError, or OSError/RuntimeError from TE's CUDA libraries
        raise Fp8UnsupportedError(
            f"impl='transformer_engine' needs Transformer Engine, which cannot be imported here "
            f"({type(e).__name__}: {e}); {INSTALL_HINT}, or {EMULATE_HINT}"
        ) from e
    return te, recipe_mod


def _block_dim(g) -> int | None:
    if isinstance(g, PerBlock) and (g.rows, g.cols) == (1, 128):
        return 1
    if isinstance(g, PerBlock) and (g.rows, g.cols) == (128, 128):
        return 2
    return None


def te_recipe_kind(recipe: Recipe | str) -> str:
    """Which TE recipe family expresses ``recipe``: a key of ``TE_KINDS``; pure.

    Raises ``ValueError`` saying what TE cannot express and which implementation can.
    """
    recipe = get_recipe(recipe)
    name = recipe.name
    if not recipe.enabled:
        raise ValueError(f"recipe {name!r} has no FP8 GEMM; there is nothing for Transformer Engine to run")
    hp = [g for g in GEMMS if not getattr(recipe, g)]
    if hp:
        raise ValueError(
            f"recipe {name!r} keeps {', '.join(hp)} in high precision; Transformer Engine runs all "
            f"three GEMMs in FP8 inside its autocast; use impl='torchao' or impl='fp8rl'"
        )
    for over, base in (
        (recipe.weight_for_dgrad, recipe.weight),
        (recipe.input_for_wgrad, recipe.input),
        (recipe.grad_output_for_wgrad, recipe.grad_output),
    ):
        if over is not None and over != base:
            raise ValueError(
                f"recipe {name!r} casts an operand differently in two GEMMs ({base} vs {over}); "
                f"Transformer Engine has one setting per operand; use impl='fp8rl'"
            )
    if recipe.microscaled:
        raise ValueError(
            f"recipe {name!r} casts operands to FP4/FP6, which impl='transformer_engine' does not run here: it "
            f"needs {subbyte_trainer_needs(recipe)}; use impl='fp8rl' with emulate=True"
        )
    i, w, g = recipe.input, recipe.weight, recipe.grad_output
    assert i is not None and w is not None and g is not None  # Recipe.__post_init__ checks it
    if i.fmt != E4M3 or w.fmt != E4M3:
        raise ValueError(
            f"recipe {name!r} casts inputs or weights to {i.fmt.name}/{w.fmt.name}; Transformer Engine's "
            f"forward is E4M3 only (gradients may be E5M2: HYBRID); use impl='fp8rl'"
        )
    grans = (i.granularity, w.granularity, g.granularity)
    if all(isinstance(x, PerTensor) for x in grans):
        return "delayed" if recipe.scaling == "delayed" else "current"
    if all(isinstance(x, MX) and x.block == 32 for x in grans):
        return "mxfp8"
    dims = [_block_dim(x) for x in grans]
    if all(d is not None for d in dims):
        if sum(d == 2 for d in dims) > 1:
            raise ValueError(f"recipe {name!r}: TE has no 128x128 x 128x128 block GEMM; use impl='fp8rl'")
        return "block"
    raise ValueError(
        f"recipe {name!r} ({recipe.describe()}) has no Transformer Engine equivalent: TE scales per "
        f"tensor, in 1x128/128x128 blocks or in MX 1x32 groups, the same for every operand; per-row "
        f"scaling runs with impl='torchao', anything else with impl='fp8rl'"
    )


def _te_format(recipe: Recipe, recipe_mod):
    fmts = {c.fmt for c in (recipe.grad_output, recipe.grad_output_for_wgrad) if c is not None}
    return recipe_mod.Format.HYBRID if fmts == {E5M2} else recipe_mod.Format.E4M3


def to_te_recipe(recipe: Recipe | str, recipe_mod=None):
    """The TE recipe object for ``recipe`` (table in the module docstring).

    Args:
        recipe: our recipe (or its name).
        recipe_mod: ``transformer_engine.common.recipe``; imported (``import_te``) when omitted.
    """
    recipe = get_recipe(recipe)
    kind = te_recipe_kind(recipe)
    if recipe_mod is None:
        recipe_mod = import_te()[1]
    fmt = _te_format(recipe, recipe_mod)
    if kind == "delayed":
        return recipe_mod.DelayedScaling(
            margin=0, fp8_format=fmt, amax_history_len=recipe.amax_history_len,
            amax_compute_algo=recipe.amax_compute_algo, reduce_amax=False,
            fp8_dpa=False, fp8_mha=False, backward_override=None,
        )
    if kind == "mxfp8":
        return recipe_mod.MXFP8BlockScaling(
            margin=0, fp8_format=fmt, fp8_dpa=False, fp8_mha=False, backward_override=None
        )
    if kind == "current":
        out = recipe_mod.Float8CurrentScaling(
            fp8_format=fmt, use_power_2_scales=recipe.pow2_scales,
            fp8_dpa=False, fp8_mha=False, backward_override=None,
        )
    else:
        x, w, g = (_block_dim(c.granularity) for c in (recipe.input, recipe.weight, recipe.grad_output))  # type: ignore[union-attr]
        out = recipe_mod.Float8BlockScaling(
            fp8_format=fmt, use_f32_scales=not recipe.pow2_scales, x_block_scaling_dim=x,
            w_block_scaling_dim=w, grad_block_scaling_dim=g, fp8_dpa=False, fp8_mha=False,
            backward_override=None,
        )
    # class attributes in TE (unannotated), so set per instance; see the module docstring
    for attr in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        setattr(out, attr, recipe_mod.QParams(power_2_scale=recipe.pow2_scales, amax_epsilon=0.0))
    return out


def check_te_supported(
    recipe: Recipe | str,
    *,
    device_type: str,
    capability: tuple[int, int] | None = None,
    emulate: bool = False,
) -> None:
    """Raise ``Fp8UnsupportedError`` if TE cannot run ``recipe`` here; pure (no import, no query)."""
    recipe = get_recipe(recipe)
    spec = TE_KINDS[te_recipe_kind(recipe)]
    alt = f"or {EMULATE_HINT}"
    if emulate:
        raise Fp8UnsupportedError(
            f"impl='transformer_engine' has no emulation; set fp8.emulate=false on a GPU with "
            f"{spec.gpus}, {alt}"
        )
    if device_type != "cuda":
        raise Fp8UnsupportedError(
            f"Transformer Engine runs on CUDA GPUs only (recipe {recipe.name!r} -> {spec.te_class} "
            f"needs {spec.gpus}); the model is on {device_type!r}: move it to the GPU before "
            f"convert_to_fp8, {alt}"
        )
    cap = None if capability is None else tuple(capability)
    if cap is None or cap < spec.min_capability or (
        spec.max_capability is not None and cap >= spec.max_capability
    ):
        raise Fp8UnsupportedError(
            f"recipe {recipe.name!r} -> TE {spec.te_class} needs {spec.gpus}; this GPU has compute "
            f"capability {cap}; choose another fp8 arm for this GPU, {alt}"
        )


def te_shape_problem(in_features: int, out_features: int, kind: str) -> str | None:
    """Why TE cannot take a ``Linear(in_features, out_features)`` for ``kind``, or ``None``."""
    a = TE_KINDS[kind].align
    if in_features % a or out_features % a:
        return (f"in_features={in_features}, out_features={out_features}: {TE_KINDS[kind].te_class} "
                f"needs multiples of {a}")
    return None
