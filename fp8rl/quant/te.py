"""Transformer Engine as an FP8 training implementation (``convert_to_fp8(..., impl="transformer_engine")``).

At paper scale the ``blockwise`` arm needs real FP8 kernels: torchao's blockwise training is a
prototype, and Transformer Engine's ``Float8BlockScaling`` (1x128 activations and gradients,
128x128 weights, DeepSeek-V3's tiling; ``reference/paper.md`` "FP8 scaling granularities") is
what production FP8 RL stacks use on Hopper. TE also has per-tensor current and delayed scaling
and MXFP8 on Blackwell. ``fp8rl.quant.te_recipe`` maps our ``Recipe`` onto TE's recipe objects;
this module swaps ``nn.Linear`` layers for ``te.Linear`` layers that run inside ``te.autocast``
with that recipe.
Transformer Engine is imported lazily, inside the functions that need it (never at import).

The recipe mapping (``to_te_recipe``: our recipe -> ``Float8CurrentScaling``, ``DelayedScaling``,
``Float8BlockScaling`` or ``MXFP8BlockScaling``), the GPUs and shapes each TE recipe needs
(``TE_KINDS``, ``check_te_supported``) and the FP4/FP6 refusal text (``SUBBYTE_TRAINER_NEEDS``)
live in ``fp8rl.quant.te_recipe``, with their tables and choices; they are re-exported here,
so ``from fp8rl.quant.te import to_te_recipe`` keeps working.

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
- **No TE extra state in the state dict.** ``TeFp8Linear`` keeps ``nn.Module``'s
  ``get_extra_state``, so ``state_dict()`` has exactly the unconverted model's keys (BF16
  weights, loadable by HF and vLLM). Cost: a delayed-scaling run that resumes starts a fresh
  amax history.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fp8rl.quant.modules import Fp8UnsupportedError, ModuleFilter, swap_linears
from fp8rl.quant.recipes import Recipe, get_recipe
from fp8rl.quant.te_recipe import (
    EMULATE_HINT,
    INSTALL_HINT,
    SUBBYTE_TRAINER_NEEDS,
    TE_KINDS,
    TE_VERSION,
    TeKind,
    check_te_supported,
    import_te,
    subbyte_trainer_needs,
    te_recipe_kind,
    te_shape_problem,
    to_te_recipe,
)

__all__ = [
    "EMULATE_HINT",
    "INSTALL_HINT",
    "SUBBYTE_TRAINER_NEEDS",
    "TE_KINDS",
    "TE_VERSION",
    "TeKind",
    "check_te_supported",
    "convert_te",
    "import_te",
    "subbyte_trainer_needs",
    "te_linear_class",
    "te_recipe_kind",
    "te_shape_problem",
    "te_skipped_layers",
    "to_te_recipe",
]

log = logging.getLogger(__name__)

_SKIPPED_ATTR = "fp8_te_skipped"


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
            f"fp8 arm for this machine, or {EMULATE_HINT}"
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
