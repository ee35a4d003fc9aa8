"""Transformer Engine as an FP8 training implementation (``convert_to_fp8(..., impl="transformer_engine")``).

At paper scale the ``blockwise`` arm needs real FP8 kernels: torchao's blockwise training is a
prototype, and Transformer Engine's ``Float8BlockScaling`` (1x128 activations and gradients,
128x128 weights, DeepSeek-V3's tiling; ``reference/paper.md`` "FP8 scaling granularities") is
what production FP8 RL stacks use on Hopper. TE also has per-tensor current and delayed scaling
and MXFP8 on Blackwell. This module maps our ``Recipe`` onto TE's recipe objects and swaps
``nn.Linear`` layers for ``te.Linear`` layers that run inside ``te.autocast`` with that recipe.
Transformer Engine is imported lazily, inside the functions that need it (never at import).

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

Conversion (``convert_te``): every ``nn.Linear`` that passes the module filter (by default all
but the LM head; embeddings are not Linears and stay as they are) becomes a ``TeFp8Linear``, a
subclass of the installed ``te.Linear`` built on the ``meta`` device and then given the
original ``weight``/``bias`` Parameters (the same objects: no copy, the optimizer and the
checkpoint see the BF16 master weights). Layers whose ``in_features``/``out_features`` are not
multiples of the recipe's alignment stay in high precision and are reported: logged at WARNING
and listed by ``te_skipped_layers(model)``.

``TeFp8Linear.forward`` flattens the input to ``[tokens, in_features]``, pads the token count
with zero rows to the recipe's alignment when needed (TE refuses other shapes), runs
``te.Linear.forward`` inside ``te.autocast(enabled=True, recipe=...)`` and drops the padded
rows. The backward runs with the recipe TE captured in the forward (TE's documented use: the
autocast wraps the forward only). ``fp8_disabled(model)`` runs ``hp_forward`` instead --
``F.linear`` on the same Parameters, outside any autocast -- which is exactly the unconverted
layer (the BF16 shadow pass of Calibrated Clipping).

Choices and deviations (we had to guess or chose):

- **Autocast per layer, not per model.** Each converted layer enters ``te.autocast`` itself, so
  every path that calls a layer -- the actor's training forward, the old-log-prob forward, a
  gradient-checkpointing recompute during the backward, a plugin that calls a submodule --
  runs FP8 with no wrapper to forget. Cost: TE's Python enter/exit per layer call (not measured
  here). With delayed scaling, a recompute under Hugging Face's gradient checkpointing records
  its amaxes a second time (TE's own ``te.checkpoint`` avoids that; we do not use it).
- **Zero-row padding** of the token dimension. It is exact: zero rows leave every amax
  (tensor, 1x128 rows, 128-token wgrad blocks, MX groups) unchanged and their outputs and
  gradients are discarded.
- **Delayed scaling keeps local amaxes** (``reduce_amax=False``): with a per-layer autocast,
  ``reduce_amax=True`` would all-reduce at every layer's exit. Data-parallel ranks then scale
  activations and gradients from their own history (as current scaling does); weights are
  replicated, so their amaxes agree anyway.
- **Float32 block scales** for ``blockwise`` (our recipe's ``pow2_scales=False``, DeepSeek-V3);
  TE's default is power-of-two. We set ``QParams(power_2_scale=...)`` on the recipe instance
  because TE 2.20.2 declares them as class attributes, not constructor fields.
- **No TE extra state in the state dict.** ``TeFp8Linear`` keeps ``nn.Module``'s
  ``get_extra_state``, so ``state_dict()`` has exactly the unconverted model's keys (BF16
  weights, loadable by HF and vLLM). Cost: a delayed-scaling run that resumes starts a fresh
  amax history.
- ``amax_epsilon=0`` (TE's default); our quantizer clamps amax at 1e-12 (torchao's EPS). Only
  all-zero blocks differ, and both give zeros.
- TE's GEMM accumulation options (``MMParams``) keep TE's defaults: ``Float8CurrentScaling``
  uses fast (non-split) accumulation in fprop, the emulation accumulates in float32.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fp8rl.quant.formats import E4M3, E5M2
from fp8rl.quant.granularity import MX, PerBlock, PerTensor
from fp8rl.quant.modules import Fp8UnsupportedError, ModuleFilter, swap_linears
from fp8rl.quant.recipes import GEMMS, Recipe, get_recipe

__all__ = [
    "TE_KINDS",
    "SUBBYTE_TRAINER_NEEDS",
    "TE_VERSION",
    "TeKind",
    "check_te_supported",
    "convert_te",
    "import_te",
    "te_linear_class",
    "te_recipe_kind",
    "te_shape_problem",
    "subbyte_trainer_needs",
    "te_skipped_layers",
    "to_te_recipe",
]

log = logging.getLogger(__name__)

#: The Transformer Engine version the ``cluster`` extra pins and this module was written against.
TE_VERSION = "2.20.2"
INSTALL_HINT = (
    f"install it on the GPU nodes with pip install 'fp8rl[cluster]' "
    f"(transformer-engine[pytorch]=={TE_VERSION}, CUDA 12)"
)
_SKIPPED_ATTR = "fp8_te_skipped"
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
_EMULATE = "emulate it with fp8.emulate=true and fp8.impl=auto (convert_to_fp8(..., emulate=True))"


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
            f"({type(e).__name__}: {e}); {INSTALL_HINT}, or {_EMULATE}"
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
    alt = f"or {_EMULATE}"
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


def _autocast(te, te_recipe):
    """``te.autocast(enabled=True, recipe=...)`` (TE >= 2.8), else the older ``te.fp8_autocast``."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=te_recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=te_recipe)


class _TeFp8LinearMixin:
    """Methods of ``TeFp8Linear`` (combined with the installed ``te.Linear`` by ``te_linear_class``)."""

    _te = None  # the transformer_engine.pytorch module, set on the built class
    fp8_recipe: Recipe
    te_recipe: object
    token_align: int

    # nn.Module's (absent) extra state: state_dict() keeps the unconverted model's keys
    get_extra_state = nn.Module.get_extra_state
    set_extra_state = nn.Module.set_extra_state

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: Recipe, te_recipe, token_align: int):
        """A TE layer that owns ``mod.weight`` / ``mod.bias`` (the same Parameter objects)."""
        w = mod.weight
        new = cls(mod.in_features, mod.out_features, bias=mod.bias is not None,
                  params_dtype=w.dtype, device="meta")
        new.weight = w
        if mod.bias is not None:
            new.bias = mod.bias
        else:  # TE keeps an empty tensor as `bias`; put it where the weights live
            new.bias = torch.empty(0, dtype=w.dtype, device=w.device)
        new.fp8_recipe = recipe
        new.te_recipe = te_recipe
        new.token_align = token_align
        new.train(mod.training)
        return new

    def forward(self, inp: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """``[..., in] -> [..., out]`` through ``te.Linear`` inside ``te.autocast`` (tokens padded)."""
        lead = inp.shape[:-1]
        x = inp.reshape(-1, inp.shape[-1])
        n = x.shape[0]
        pad = (-n) % self.token_align
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        with _autocast(self._te, self.te_recipe):
            out = super().forward(x, *args, **kwargs)  # type: ignore[misc]
        if pad:
            out = out[:n]
        return out.reshape(*lead, out.shape[-1])

    def hp_forward(self, inp: torch.Tensor) -> torch.Tensor:
        """The unconverted layer: ``F.linear`` on the same Parameters, no autocast (``fp8_disabled``)."""
        return F.linear(inp, self.weight, self.bias if self.use_bias else None)  # type: ignore[attr-defined]


_CLASSES: dict[type, type] = {}


def te_linear_class(te) -> type:
    """``TeFp8Linear``: ``_TeFp8LinearMixin`` + ``te.Linear`` of the given TE module (cached)."""
    base = te.Linear
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type("TeFp8Linear", (_TeFp8LinearMixin, base), {
            "__module__": __name__,
            "__doc__": "te.Linear running inside te.autocast with an fp8rl recipe (fp8rl.quant.te).",
            "_te": te,
        })
        _CLASSES[base] = cls
    return cls


def _check_te_runtime(te, kind: str) -> None:
    fn: Callable | None = getattr(te, TE_KINDS[kind].available_fn, None)
    if fn is None:
        return
    ok, reason = fn(return_reason=True)
    if not ok:
        raise Fp8UnsupportedError(
            f"Transformer Engine cannot run {TE_KINDS[kind].te_class} here: {reason}; choose another "
            f"fp8 arm for this machine, or {_EMULATE}"
        )


def convert_te(model: nn.Module, recipe: Recipe | str, module_filter: ModuleFilter) -> nn.Module:
    """Swap filtered ``nn.Linear`` layers for ``TeFp8Linear`` (in place; see the module docstring).

    Hardware is checked by the caller (``convert_to_fp8`` -> ``check_supported``); this checks TE's
    own availability function, converts, and records skipped layers (``te_skipped_layers``).
    """
    recipe = get_recipe(recipe)
    te, recipe_mod = import_te()
    kind = te_recipe_kind(recipe)
    te_recipe = to_te_recipe(recipe, recipe_mod)
    _check_te_runtime(te, kind)
    cls = te_linear_class(te)
    align = TE_KINDS[kind].align
    skipped: dict[str, str] = {}

    def keep(mod: nn.Module, fqn: str) -> bool:
        if not module_filter(mod, fqn):
            return False
        why = te_shape_problem(mod.in_features, mod.out_features, kind)  # type: ignore[arg-type]
        if why:
            skipped[fqn] = why
            return False
        return True

    out = swap_linears(model, lambda mod: cls.from_linear(mod, recipe, te_recipe, align), keep)
    setattr(out, _SKIPPED_ATTR, skipped)
    if skipped:
        log.warning("Transformer Engine: %d linear layer(s) left in high precision (shapes): %s",
                    len(skipped), "; ".join(f"{k or '<root>'}: {v}" for k, v in skipped.items()))
    return out


def te_skipped_layers(model: nn.Module) -> dict[str, str]:
    """Layers ``convert_te`` left in high precision because of their shapes: ``{fqn: reason}``."""
    return dict(getattr(model, _SKIPPED_ATTR, {}))
