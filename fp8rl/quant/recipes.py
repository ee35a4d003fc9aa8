"""FP8 recipes: per operand what is quantized and how; per GEMM whether it runs in FP8.

A linear layer ``y = x @ W.T`` runs three GEMMs (torchao / Transformer Engine vocabulary):

    fprop:  y      = x      @ W.T        operands (input, weight)
    dgrad:  grad_x = grad_y @ W          operands (grad_output, weight_for_dgrad)
    wgrad:  grad_W = grad_y.T @ x        operands (grad_output_for_wgrad, input_for_wgrad)

A ``Recipe`` composes one ``OperandConfig`` (granularity + format) per operand, optional
per-GEMM overrides (torchao's ``cast_config_*_for_grad_*``), and one flag per GEMM. Granularities
are applied in each GEMM's own orientation (contraction dimension last; see ``granularity.py``).
A GEMM whose flag is off runs in the operands' high-precision dtype.

Named recipes (``RECIPES``), and where each comes from (``reference/paper.md``):

=====================  ==============================================================  ========
name                   operands                                                        default
                                                                                       impl
=====================  ==============================================================  ========
``bf16``               no FP8 anywhere                                                 --
``tensorwise``         all per-tensor; grad_output E5M2 (torchao's default: hybrid)    torchao
``rowwise``            all per-row E4M3, power-of-two scales (torchao ``rowwise``)     torchao
``rowwise_with_gw_hp`` per-row fprop, dgrad weight per-tensor, wgrad in high precision torchao
``blockwise``          1x128 activations/grads, 128x128 weights, E4M3 (DeepSeek-V3)    fp8rl
``mxfp8``              MX 1x32 E8M0 scales, E4M3 everywhere                            fp8rl
=====================  ==============================================================  ========

``with_hybrid(True)`` switches every grad_output operand to E5M2 (Transformer Engine's
``HYBRID``), ``with_hybrid(False)`` to E4M3; the recipe's name records the change so that run
names stay distinct (``rowwise_hybrid``, ``tensorwise_e4m3g``).

Choices made here:

- ``tensorwise`` keeps torchao's E5M2 gradients because the paper trained with torchao's
  recipes; ``blockwise`` and ``mxfp8`` use E4M3 gradients as DeepSeek-V3 and torchao's MX
  training do. The paper does not state its gradient format [G].
- ``blockwise`` uses float32 (not power-of-two) scales, as DeepSeek-V3 describes; Transformer
  Engine's ``Float8BlockScaling`` defaults to power-of-two scales. Flip ``pow2_scales`` to try it.
- ``mxfp8`` quantizes wgrad operands in 1x32 groups along the token dimension (the contraction
  dimension of wgrad), as the MX GEMM requires.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fp8rl.quant.formats import E4M3, E5M2, Fp8Format
from fp8rl.quant.granularity import MX, Granularity, PerBlock, PerRow, PerTensor
from fp8rl.registry import Registry

__all__ = ["GEMMS", "RECIPES", "OperandConfig", "Recipe", "get_recipe"]

#: The three GEMMs of a linear layer, in the order forward, grad-input, grad-weight.
GEMMS = ("fprop", "dgrad", "wgrad")


@dataclass(frozen=True)
class OperandConfig:
    """How one GEMM operand is cast to FP8: scaling ``granularity`` and element ``fmt``."""

    granularity: Granularity
    fmt: Fp8Format = E4M3

    def __post_init__(self) -> None:
        if not isinstance(self.granularity, Granularity):
            raise TypeError(
                f"OperandConfig.granularity must be a Granularity instance (PerTensor(), PerRow(), "
                f"PerBlock(r, c), MX(32)), got {self.granularity!r}"
            )
        if not isinstance(self.fmt, Fp8Format):
            raise TypeError(f"OperandConfig.fmt must be E4M3 or E5M2, got {self.fmt!r}")

    def short_str(self) -> str:
        return f"{self.granularity.short_str()}_{self.fmt.short_str()}"


@dataclass(frozen=True)
class Recipe:
    """A point in the FP8 recipe space (see the module docstring for the GEMM/operand names).

    Attributes:
        name: registry name, also the run-name fragment (``short_str``).
        input, weight, grad_output: operand configs for fprop / dgrad / wgrad (``None``: the
            operand never enters an FP8 GEMM).
        weight_for_dgrad, input_for_wgrad, grad_output_for_wgrad: per-GEMM overrides; ``None``
            means "same as the operand's config".
        fprop, dgrad, wgrad: run this GEMM in FP8.
        pow2_scales: round every scale to a power of two (torchao ``round_scales_to_power_of_2``).
        impl: default implementation (a key of ``fp8rl.quant.convert.IMPLEMENTATIONS``).
    """

    name: str
    input: OperandConfig | None = None
    weight: OperandConfig | None = None
    grad_output: OperandConfig | None = None
    fprop: bool = False
    dgrad: bool = False
    wgrad: bool = False
    weight_for_dgrad: OperandConfig | None = None
    input_for_wgrad: OperandConfig | None = None
    grad_output_for_wgrad: OperandConfig | None = None
    pow2_scales: bool = False
    impl: str = "fp8rl"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("Recipe needs a name (it becomes part of run names)")
        for gemm in GEMMS:
            if getattr(self, gemm):
                a, b = self.operands(gemm)
                if a is None or b is None:
                    raise ValueError(
                        f"recipe {self.name!r}: GEMM {gemm} is FP8 but an operand has no config "
                        f"({a!r}, {b!r}); give both operands an OperandConfig or set {gemm}=False"
                    )

    def operands(self, gemm: str) -> tuple[OperandConfig | None, OperandConfig | None]:
        """The ``(a, b)`` operand configs of ``gemm`` in ``a @ b.T`` orientation, overrides applied."""
        if gemm == "fprop":
            return self.input, self.weight
        if gemm == "dgrad":
            return self.grad_output, self.weight_for_dgrad or self.weight
        if gemm == "wgrad":
            return self.grad_output_for_wgrad or self.grad_output, self.input_for_wgrad or self.input
        raise ValueError(f"unknown GEMM {gemm!r}; valid: {', '.join(GEMMS)}")

    @property
    def enabled(self) -> bool:
        """True when at least one GEMM runs in FP8 (False for ``bf16``)."""
        return self.fprop or self.dgrad or self.wgrad

    @property
    def hybrid(self) -> bool:
        """True when the gradient operands are E5M2."""
        cfgs = [c for c in (self.grad_output, self.grad_output_for_wgrad) if c is not None]
        return bool(cfgs) and all(c.fmt == E5M2 for c in cfgs)

    def granularities(self) -> set[type[Granularity]]:
        """Granularity types used by the FP8 GEMMs of this recipe."""
        out: set[type[Granularity]] = set()
        for gemm in GEMMS:
            if getattr(self, gemm):
                out.update(type(c.granularity) for c in self.operands(gemm) if c is not None)
        return out

    def with_hybrid(self, hybrid: bool) -> Recipe:
        """Same recipe with gradients in E5M2 (``hybrid=True``) or E4M3; renamed if it changes."""
        if not self.enabled or self.hybrid == hybrid:
            return self
        fmt = E5M2 if hybrid else E4M3

        def swap(c: OperandConfig | None) -> OperandConfig | None:
            return None if c is None else replace(c, fmt=fmt)

        suffix = "_hybrid" if hybrid else "_e4m3g"
        return replace(
            self,
            name=self.name + suffix,
            grad_output=swap(self.grad_output),
            grad_output_for_wgrad=swap(self.grad_output_for_wgrad),
        )

    def short_str(self) -> str:
        """Run-name fragment: the recipe name (``tensorwise``, ``rowwise_hybrid``, ``bf16``)."""
        return self.name

    def describe(self) -> str:
        """One line per GEMM: ``fprop: r_e4m3 x r_e4m3`` or ``fprop: high precision``."""
        lines = []
        for gemm in GEMMS:
            a, b = self.operands(gemm)
            if getattr(self, gemm):
                lines.append(f"{gemm}: {a.short_str()} x {b.short_str()}")  # type: ignore[union-attr]
            else:
                lines.append(f"{gemm}: high precision")
        return "; ".join(lines)


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
        impl="fp8rl",
        **_ALL,
    )
)


def get_recipe(name: str | Recipe, *, hybrid: bool | None = None) -> Recipe:
    """Look up a named recipe (or pass a ``Recipe`` through); ``hybrid`` overrides the grad format."""
    recipe = name if isinstance(name, Recipe) else RECIPES[name]
    return recipe if hybrid is None else recipe.with_hybrid(hybrid)
