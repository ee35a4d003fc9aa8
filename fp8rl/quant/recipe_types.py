"""The FP8 recipe type: per operand what is quantized and how; per GEMM whether it runs in FP8.

A linear layer ``y = x @ W.T`` runs three GEMMs (torchao / Transformer Engine vocabulary):

    fprop:  y      = x      @ W.T        operands (input, weight)
    dgrad:  grad_x = grad_y @ W          operands (grad_output, weight_for_dgrad)
    wgrad:  grad_W = grad_y.T @ x        operands (grad_output_for_wgrad, input_for_wgrad)

A ``Recipe`` composes one ``OperandConfig`` (granularity + format) per operand, optional
per-GEMM overrides (torchao's ``cast_config_*_for_grad_*``), and one flag per GEMM. Granularities
are applied in each GEMM's own orientation (contraction dimension last; see ``granularity.py``).
A GEMM whose flag is off runs in the operands' high-precision dtype. Both classes check their
fields when built and say what is wrong and how to fix it.

``with_hybrid(True)`` switches every grad_output operand to E5M2 (Transformer Engine's
``HYBRID``), ``with_hybrid(False)`` to E4M3; the recipe's name records the change so that run
names stay distinct (``rowwise_hybrid``, ``tensorwise_e4m3g``). ``with_delayed`` does the same
for the amax history options of a delayed-scaling recipe.

The named recipes (``RECIPES``, ``get_recipe``), where each comes from and the choices made for
them are in ``fp8rl.quant.recipes``, which re-exports everything defined here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fp8rl.quant.formats import E4M3, E5M2, Fp8Format, SubByteFormat
from fp8rl.quant.granularity import Granularity, PerTensor
from fp8rl.quant.microscale import check_microscaled
from fp8rl.quant.rounding import ROUNDINGS

__all__ = ["AMAX_COMPUTE_ALGOS", "GEMMS", "SCALINGS", "OperandConfig", "Recipe"]


#: The three GEMMs of a linear layer, in the order forward, grad-input, grad-weight.
GEMMS = ("fprop", "dgrad", "wgrad")
#: How scales are chosen: from the tensor being cast, or from a history of earlier amaxes.
SCALINGS = ("dynamic", "delayed")
#: Delayed scaling: which amax of the history sets the scale (Transformer Engine's names).
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class OperandConfig:
    """How one GEMM operand is cast to FP8: scaling ``granularity``, element ``fmt`` and ``rounding``
    (``nearest``: nearest even; ``stochastic``: unbiased random rounding from the model's seeded
    quantizer state, ``fp8rl.quant.rounding``; FP4/FP6 operands only)."""

    granularity: Granularity
    fmt: Fp8Format | SubByteFormat = E4M3
    rounding: str = "nearest"

    def __post_init__(self) -> None:
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"OperandConfig.rounding must be one of {', '.join(ROUNDINGS)}, got {self.rounding!r}")
        if self.rounding == "stochastic" and not isinstance(self.fmt, SubByteFormat):
            raise ValueError(
                f"OperandConfig: stochastic rounding is implemented for FP4/FP6 operands only (E2M1, E2M3, "
                f"E3M2), got {getattr(self.fmt, 'name', self.fmt)!r}; use rounding='nearest' for FP8")
        if not isinstance(self.granularity, Granularity):
            raise TypeError(
                f"OperandConfig.granularity must be a Granularity instance (PerTensor(), PerRow(), "
                f"PerBlock(r, c), MX(32)), got {self.granularity!r}"
            )
        if not isinstance(self.fmt, (Fp8Format, SubByteFormat)):
            raise TypeError(f"OperandConfig.fmt must be E4M3, E5M2, E2M1, E2M3 or E3M2, got {self.fmt!r}")
        check_microscaled(self.granularity, self.fmt)

    def short_str(self) -> str:
        sr = "_sr" if self.rounding == "stochastic" else ""
        return f"{self.granularity.short_str()}_{self.fmt.short_str()}{sr}"


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
        impl: default implementation on FP8 kernels (a key of
            ``fp8rl.quant.convert.IMPLEMENTATIONS``); see ``convert.default_impl`` for ``emulate``.
        scaling: ``"dynamic"`` (scale from the current tensor's amax) or ``"delayed"`` (scale
            from an amax history; per-tensor granularity only; Transformer Engine only).
        amax_history_len, amax_compute_algo: delayed scaling: history length (>= 1) and
            ``"max"`` or ``"most_recent"``; must keep their defaults when ``scaling="dynamic"``.
        wgrad_rht: multiply both wgrad operands by the 16x16 random Hadamard transform along the
            tokens before quantizing them (``fp8rl.quant.hadamard``; NVIDIA's NVFP4 recipe).
        weight_only: weight-only quantization (``w4a16``): only the weight operand of fprop and
            dgrad is quantized; ``input`` and ``grad_output`` stay ``None`` (high precision) and
            wgrad runs in high precision.
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
    scaling: str = "dynamic"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    wgrad_rht: bool = False
    weight_only: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("Recipe needs a name (it becomes part of run names)")
        self._check_scaling()
        self._check_transform()
        for gemm in GEMMS:
            if getattr(self, gemm):
                a, b = self.operands(gemm)
                if self.weight_only and b is not None:
                    continue
                if a is None or b is None:
                    raise ValueError(
                        f"recipe {self.name!r}: GEMM {gemm} is FP8 but an operand has no config "
                        f"({a!r}, {b!r}); give both operands an OperandConfig or set {gemm}=False"
                    )

    def _check_scaling(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"recipe {self.name!r}: scaling must be one of {SCALINGS}, got {self.scaling!r}")
        if self.scaling == "dynamic":
            if (self.amax_history_len, self.amax_compute_algo) != (1024, "max"):
                raise ValueError(
                    f"recipe {self.name!r}: amax_history_len / amax_compute_algo only apply to "
                    f"delayed scaling; set scaling='delayed' or leave them at 1024 / 'max'"
                )
            return
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"recipe {self.name!r}: amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"recipe {self.name!r}: amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}, "
                f"got {self.amax_compute_algo!r}"
            )
        grans = self.granularities()
        if grans and grans != {PerTensor}:
            raise ValueError(
                f"recipe {self.name!r}: delayed scaling keeps one scale per tensor; every FP8 operand "
                f"must be PerTensor(), got {sorted(g.__name__ for g in grans)}"
            )

    def _check_transform(self) -> None:
        if self.weight_only and (self.input is not None or self.grad_output is not None or self.wgrad
                                 or self.weight is None or not self.fprop):
            raise ValueError(
                f"recipe {self.name!r}: weight_only quantizes the weight of fprop (and dgrad) only: set "
                f"weight, fprop=True, wgrad=False and leave input / grad_output None (high precision)")
        if self.wgrad_rht:
            a, b = self.operands("wgrad")
            if not (self.wgrad and a is not None and b is not None
                    and isinstance(a.fmt, SubByteFormat) and isinstance(b.fmt, SubByteFormat)):
                raise ValueError(
                    f"recipe {self.name!r}: wgrad_rht transforms the two operands of an FP4/FP6 wgrad GEMM; "
                    f"set wgrad=True with FP4/FP6 input and grad_output configs, or wgrad_rht=False")

    @property
    def stochastic(self) -> bool:
        """True when an operand of an FP8 GEMM of this recipe rounds stochastically."""
        return any(c is not None and c.rounding == "stochastic"
                   for gemm in GEMMS if getattr(self, gemm) for c in self.operands(gemm))

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
    def microscaled(self) -> bool:
        """True when an FP8 GEMM of this recipe has an FP4/FP6 operand (``fp8rl.quant.microscale``)."""
        return any(
            c is not None and isinstance(c.fmt, SubByteFormat)
            for gemm in GEMMS if getattr(self, gemm) for c in self.operands(gemm)
        )

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
        if self.microscaled:
            raise ValueError(
                f"recipe {self.name!r} casts to FP4/FP6; hybrid (E5M2 / E4M3 gradients) is an FP8 option "
                f"and has no meaning for it: leave hybrid unset"
            )
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

    def with_delayed(self, amax_history_len: int | None = None, amax_compute_algo: str | None = None) -> Recipe:
        """Same delayed-scaling recipe with other amax options; renamed if they change.

        ``tensorwise_delayed`` with ``amax_history_len=16`` becomes ``tensorwise_delayed_h16``;
        with ``amax_compute_algo="most_recent"`` too, ``tensorwise_delayed_h16_most_recent``.
        """
        if self.scaling != "delayed":
            raise ValueError(
                f"recipe {self.name!r} uses {self.scaling} scaling; amax history options apply to "
                f"delayed-scaling recipes only (e.g. tensorwise_delayed)"
            )
        h = self.amax_history_len if amax_history_len is None else amax_history_len
        algo = self.amax_compute_algo if amax_compute_algo is None else amax_compute_algo
        if (h, algo) == (self.amax_history_len, self.amax_compute_algo):
            return self
        suffix = (f"_h{h}" if h != self.amax_history_len else "") + (
            f"_{algo}" if algo != self.amax_compute_algo else ""
        )
        return replace(self, name=self.name + suffix, amax_history_len=h, amax_compute_algo=algo)

    def short_str(self) -> str:
        """Run-name fragment: the recipe name (``tensorwise``, ``rowwise_hybrid``, ``bf16``)."""
        return self.name

    def describe(self) -> str:
        """One line per GEMM: ``fprop: r_e4m3 x r_e4m3`` or ``fprop: high precision``."""
        lines = []
        for gemm in GEMMS:
            a, b = self.operands(gemm)
            if getattr(self, gemm):
                sa, sb = (c.short_str() if c is not None else "hp" for c in (a, b))
                rht = " (RHT16)" if gemm == "wgrad" and self.wgrad_rht else ""
                lines.append(f"{gemm}: {sa} x {sb}{rht}")
            else:
                lines.append(f"{gemm}: high precision")
        if self.scaling == "delayed":
            lines.append(f"delayed scaling: amax history {self.amax_history_len}, {self.amax_compute_algo}")
        return "; ".join(lines)
