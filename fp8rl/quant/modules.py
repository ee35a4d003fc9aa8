"""Swapping a model's linear layers, and the "FP8 off" switch: what every implementation shares.

``swap_linears`` replaces ``nn.Linear`` layers in place (``fp8rl.quant.convert`` for training,
``fp8rl.quant.rollout`` for the rollout engine, ``fp8rl.quant.te`` for Transformer Engine);
``default_module_filter`` keeps the LM head in high precision; every converted layer carries the
attribute ``fp8_recipe`` (``fp8_layers`` finds them); ``fp8_disabled`` is the BF16 shadow pass
(mechanism described in ``fp8rl.quant.convert``'s docstring). Split out of ``convert`` so that
``te`` can use these without importing ``convert``, which imports ``te`` lazily.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

from torch import nn

__all__ = [
    "DEFAULT_SKIP_NAMES",
    "Fp8UnsupportedError",
    "ModuleFilter",
    "default_module_filter",
    "fp8_disabled",
    "fp8_layers",
    "swap_linears",
]

ModuleFilter = Callable[[nn.Module, str], bool]

#: Linear layers with these attribute names stay in high precision by default (MiniMax-M1:
#: an FP32/BF16 LM head keeps train/rollout probabilities aligned; paper.md "Neighbouring methods").
DEFAULT_SKIP_NAMES = ("lm_head", "embed_out", "output_layer")
_RECIPE_ATTR = "fp8_recipe"
_DEPTH_ATTR = "_fp8rl_disabled_depth"


class Fp8UnsupportedError(RuntimeError):
    """A recipe cannot run on this hardware with these settings; the message names the fix."""


def default_module_filter(module: nn.Module, fqn: str) -> bool:
    """Convert every ``nn.Linear`` except those named in ``DEFAULT_SKIP_NAMES`` (the LM head)."""
    return isinstance(module, nn.Linear) and fqn.split(".")[-1] not in DEFAULT_SKIP_NAMES


def swap_linears(
    model: nn.Module, make: Callable[[nn.Linear], nn.Module], module_filter: ModuleFilter
) -> nn.Module:
    """Replace every ``nn.Linear`` (subclasses included) passing ``module_filter(mod, fqn)`` by ``make(mod)``."""
    if isinstance(model, nn.Linear):
        return make(model) if module_filter(model, "") else model
    targets = [
        (fqn, mod) for fqn, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and fqn and module_filter(mod, fqn)
    ]
    for fqn, mod in targets:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(mod))
    return model


def fp8_layers(model: nn.Module) -> list[nn.Module]:
    """The FP8-converted linear layers of ``model`` (those carrying ``fp8_recipe``)."""
    return [m for m in model.modules() if hasattr(m, _RECIPE_ATTR)]


def _hp_forward(self: nn.Module, x):
    """The layer without FP8: ``F.linear(x, weight, bias)`` in ``x``'s dtype, i.e. exactly the
    unconverted layer for fp32 activations and a BF16 GEMM (fp32 accumulation) on the
    BF16-rounded master weight for BF16 activations (``fp8rl.quant.lowp.linear``)."""
    from fp8rl.quant.lowp import linear

    return linear(x, self.weight, self.bias)


def _disable(mod: nn.Module) -> None:
    depth = mod.__dict__.get(_DEPTH_ATTR, 0)
    if depth == 0:
        if "forward" in mod.__dict__:
            raise RuntimeError(f"{type(mod).__name__} already has an instance-level forward; cannot disable FP8")
        hp_forward = getattr(type(mod), "hp_forward", _hp_forward)  # TE layers define their own
        mod.forward = types.MethodType(hp_forward, mod)
    mod.__dict__[_DEPTH_ATTR] = depth + 1


def _enable(mod: nn.Module) -> None:
    depth = mod.__dict__[_DEPTH_ATTR] - 1
    if depth == 0:
        del mod.__dict__["forward"]
        del mod.__dict__[_DEPTH_ATTR]
    else:
        mod.__dict__[_DEPTH_ATTR] = depth


@contextlib.contextmanager
def fp8_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, every FP8 layer of ``model`` computes ``F.linear`` on its master weights.

    Re-entrant (nesting keeps FP8 off until the outermost block exits) and exception-safe.
    Yields ``model``. A model with no FP8 layers is left untouched.
    """
    done: list[nn.Module] = []
    try:
        for mod in fp8_layers(model):
            _disable(mod)
            done.append(mod)
        yield model
    finally:
        for mod in reversed(done):
            _enable(mod)
