"""Model conversion for FP8 training, the hardware check, and the "FP8 off" switch.

``convert_to_fp8(model, recipe)`` swaps ``nn.Linear`` layers (all but the LM head by default)
for an FP8 linear that follows the recipe, through one of three implementations (the
``IMPLEMENTATIONS`` registry; ``impl=`` picks one, ``None``/``"auto"`` takes ``default_impl``):

- ``torchao``: ``torchao.float8.convert_to_float8_training`` with a ``Float8LinearConfig`` built
  from the recipe (``to_torchao_config``; for the three torchao recipes it equals
  ``Float8LinearConfig.from_recipe_name``, which a test checks). The paper trained with torchao.
  Per-tensor and per-row dynamic scaling.
- ``fp8rl``: our ``Fp8Linear`` (``linear.py``), for any dynamic-scaling recipe; the emulated
  implementation (``emulate=True``) of block and MX recipes.
- ``transformer_engine``: ``te.Linear`` run inside ``te.autocast`` with the TE recipe mapped from
  ours (``fp8rl.quant.te``): per-tensor current and delayed scaling, 1x128/128x128 blocks, MXFP8.
  CUDA only; no emulation.

Default implementation per recipe (``default_impl(recipe, emulate=...)``, pure):

======================================  ===================  ===================================
recipe                                  ``emulate=False``    ``emulate=True``
======================================  ===================  ===================================
tensorwise, rowwise, rowwise_with_gw_hp torchao (the paper)  fp8rl, torchao's arithmetic (below)
blockwise                               transformer_engine   fp8rl (emulated ``Fp8Linear``)
mxfp8                                   transformer_engine   fp8rl
tensorwise_delayed                      transformer_engine   -- (raises: no emulation exists)
======================================  ===================  ===================================

Emulation runs on ``fp8rl`` for every recipe because it is the faster emulator on CPU (no
tensor-subclass dispatch, a table lookup for FP8 -> float32, quantized operands reused between
forward and backward where the recipe allows; ``benchmarks/bench_quant.py``) and it computes
**the same numbers as the recipe's reference implementation**: for the torchao recipes it
dequantizes as torchao's emulated GEMM does (``q / qscale``), and the forward output and both
gradients equal ``torchao.float8``'s ``emulate=True`` layer bit for bit (tested against torchao
itself, ``tests/quant/test_quant_linear.py``); block and MX recipes dequantize with the
multiplier (``q * scale``) as their kernels do. ``fp8.impl=torchao`` still runs torchao's own
emulation.

So ``blockwise`` runs on Transformer Engine where it is importable (on an sm90+ GPU) and is
emulated only when ``emulate=True`` is asked for; a choice that cannot run raises
``Fp8UnsupportedError`` (hardware, TE missing) or ``ValueError`` (an implementation that cannot
express the recipe, ``resolve_impl``) before anything trains, naming the fix. An explicit
``emulate=True`` wins over an importable TE: emulation is a request, not a fallback.

torchao and fp8rl layers are ``nn.Linear`` subclasses; TE layers are ``te.Linear`` subclasses. All
share the original ``weight``/``bias`` Parameters (no copies) and carry the attribute
``fp8_recipe``.

``fp8_disabled(model)`` is the BF16 shadow pass of Calibrated Clipping (paper: calibration
step): inside the ``with`` block every converted layer runs ``nn.Linear.forward`` (or its class's
``hp_forward``, which TE layers define because a bias-less ``te.Linear`` holds an empty tensor as
``bias``) -- exactly ``F.linear(x, weight, bias)`` on the master weights in their own dtype, i.e.
what the unconverted model computes -- and FP8 again after it. For TE this is running outside
``te.autocast`` on the same weights. Mechanism: an instance attribute ``forward`` that
shadows the class method (``nn.Module.__call__`` looks it up on the instance first), installed on
entry and deleted on exit, with a per-layer depth counter so nested blocks are safe, and a
``finally`` so an exception inside the block restores FP8. No torchao code is patched and the
same mechanism covers both implementations. It works with autograd (plain ``F.linear``).

Hardware check (``check_supported``, pure: device type and CUDA capability are arguments;
``convert_to_fp8`` reads them from the model's parameters at call time, never at import):

========================  =================================  =================================
GEMM scales               CPU                                CUDA
========================  =================================  =================================
per-tensor / per-row      ``torch._scaled_mm`` (runs on CPU)  capability >= 8.9
block / MX (torchao,      ``emulate=True`` required          ``emulate=True`` required (no
fp8rl)                                                       kernel wired in, see linear.py)
FP4 / FP6 (nvfp4, mxfp4,  ``emulate=True`` required          ``emulate=True`` required (no
mxfp6; ``microscale``)                                       kernel wired in; Blackwell has them)
transformer_engine        not supported                      per recipe (``te.TE_KINDS``):
                                                             per-tensor 8.9, block 9.0,
                                                             MXFP8 10.x
========================  =================================  =================================

Choice: the implementation registry holds ``torchao``, ``fp8rl`` and
``transformer_engine``; emulation is the boolean ``emulate`` (config key ``fp8.emulate``) on top
of torchao or fp8rl, not a registry entry named ``emulated`` (as first planned), because it changes *how* GEMMs are
computed, not which code quantizes (the issues name the fix ``emulate=True``). The planned
``emulated`` is ``fp8.emulate=true`` with the default implementation.

torchao on CPU runs with and without its ``emulate`` flag (without it, ``torch._scaled_mm``'s
CPU kernel; checked in the tests). Anything else raises ``Fp8UnsupportedError`` naming the fix:
``fp8.emulate=true`` (``emulate=True``), which computes the same quantization in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fp8rl.quant.formats import E4M3
from fp8rl.quant.granularity import PerRow, PerTensor
from fp8rl.quant.linear import Fp8Linear
from fp8rl.quant.modules import (
    _RECIPE_ATTR,
    DEFAULT_SKIP_NAMES,
    Fp8UnsupportedError,
    ModuleFilter,
    default_module_filter,
    fp8_disabled,
    fp8_layers,
    swap_linears,
)
from fp8rl.quant.recipes import GEMMS, OperandConfig, Recipe, get_recipe
from fp8rl.quant.rounding import STATE_ATTR, QuantizerState
from fp8rl.registry import Registry, RegistryError

__all__ = [
    "DEFAULT_SKIP_NAMES",
    "IMPLEMENTATIONS",
    "Fp8UnsupportedError",
    "check_supported",
    "convert_to_fp8",
    "default_impl",
    "default_module_filter",
    "fp8_disabled",
    "fp8_layers",
    "resolve_impl",
    "swap_linears",
    "to_torchao_config",
]

_MIN_CUDA_CAPABILITY = (8, 9)
#: ``impl`` values that mean "the recipe's default implementation" (config key ``fp8.impl=auto``).
AUTO_IMPL = ("auto", None)
_TE = "transformer_engine"


def check_supported(
    recipe: Recipe,
    *,
    impl: str,
    device_type: str,
    capability: tuple[int, int] | None = None,
    emulate: bool = False,
) -> None:
    """Raise ``Fp8UnsupportedError`` if ``recipe`` cannot run as asked; pure, no hardware query.

    Args:
        recipe: the FP8 recipe.
        impl: implementation name (a key of ``IMPLEMENTATIONS``).
        device_type: ``"cpu"``, ``"cuda"``, ...
        capability: CUDA compute capability ``(major, minor)``; needed for ``cuda``.
        emulate: compute FP8 GEMMs as quantize-dequantize-matmul.
    """
    if not recipe.enabled:
        return
    if impl == _TE:
        from fp8rl.quant.te import check_te_supported

        check_te_supported(recipe, device_type=device_type, capability=capability, emulate=emulate)
        return
    if emulate:
        return
    fix = "set fp8.emulate=true (convert_to_fp8(..., emulate=True)) to emulate it in float32"
    if recipe.microscaled:
        from fp8rl.quant.te import subbyte_trainer_needs

        raise Fp8UnsupportedError(
            f"recipe {recipe.name!r} casts operands to FP4/FP6, which has no GEMM kernel wired in here "
            f"(implementation {impl!r}); training it on GPUs needs {subbyte_trainer_needs(recipe)} (Blackwell: "
            f"compute capability 10.x, CUDA >= 12.8); {fix}"
        )
    if device_type == "cuda":
        if capability is None or tuple(capability) < _MIN_CUDA_CAPABILITY:
            raise Fp8UnsupportedError(
                f"FP8 recipe {recipe.name!r} needs a CUDA GPU with compute capability >= 8.9 "
                f"(Ada/Hopper/Blackwell), this one has {capability}; {fix}"
            )
    elif device_type != "cpu":
        raise Fp8UnsupportedError(f"FP8 recipe {recipe.name!r} has no kernels on {device_type!r}; {fix}")
    unsupported = sorted(
        g.__name__ for g in recipe.granularities() if g not in (PerTensor, PerRow)
    )
    if unsupported:
        raise Fp8UnsupportedError(
            f"FP8 recipe {recipe.name!r} uses {', '.join(unsupported)} scaling, which has no FP8 "
            f"GEMM kernel wired in for {device_type} (implementation {impl!r}); {fix}"
        )


def default_impl(recipe: Recipe | str, *, emulate: bool) -> str:
    """The implementation ``impl="auto"`` picks (table in the module docstring); pure.

    Raises ``ValueError`` for a delayed-scaling recipe with ``emulate=True`` (no emulation exists).
    """
    recipe = get_recipe(recipe)
    if not emulate:
        return recipe.impl
    if recipe.scaling == "delayed":
        raise ValueError(
            f"recipe {recipe.name!r} uses delayed scaling, which only Transformer Engine implements "
            f"(there is no emulation): set fp8.emulate=false and run on a CUDA GPU with compute "
            f"capability >= 8.9 and transformer_engine installed (pip install 'fp8rl[cluster]'), or "
            f"use the dynamic-scaling recipe 'tensorwise'"
        )
    return "fp8rl"


def resolve_impl(recipe: Recipe | str, impl: str | None = None, *, emulate: bool = False) -> str:
    """The implementation that will run ``recipe``: ``impl``, or ``default_impl`` for ``None``/``"auto"``.

    Pure (no import of torchao or Transformer Engine, no hardware query): checks that the
    implementation can express the recipe and that ``emulate`` is possible with it. Hardware and
    installation are checked by ``convert_to_fp8`` (``check_supported``, ``te.import_te``).
    Returns ``"none"`` for a recipe without FP8 GEMMs (``bf16``).

    Raises:
        RegistryError: ``impl`` is not ``auto`` or a key of ``IMPLEMENTATIONS``.
        ValueError: the implementation cannot express the recipe, or cannot emulate; the message
            names the implementation that can.
    """
    recipe = get_recipe(recipe)
    if impl not in AUTO_IMPL and impl not in IMPLEMENTATIONS:
        raise RegistryError(
            f"unknown FP8 linear implementation {impl!r}; valid names are: auto, "
            f"{', '.join(IMPLEMENTATIONS.names())}"
        )
    if not recipe.enabled:
        return "none"
    if impl in AUTO_IMPL:
        return default_impl(recipe, emulate=emulate)
    if impl == _TE:
        from fp8rl.quant.te import te_recipe_kind

        if emulate:
            raise ValueError(
                f"impl='transformer_engine' has no emulation (it runs TE's CUDA kernels); set "
                f"fp8.emulate=false, or keep fp8.emulate=true with fp8.impl=auto to emulate "
                f"{recipe.name!r} with {default_impl(recipe, emulate=True)!r}"
            )
        te_recipe_kind(recipe)  # raises ValueError naming what TE cannot express
        return impl
    if recipe.scaling == "delayed":
        raise ValueError(
            f"recipe {recipe.name!r} uses delayed scaling, which impl={impl!r} does not implement; "
            f"use impl='transformer_engine' (fp8.impl=transformer_engine, fp8.emulate=false)"
        )
    if impl == "torchao":
        bad = sorted(g.__name__ for g in recipe.granularities() if g not in (PerTensor, PerRow))
        if bad:
            raise ValueError(
                f"torchao float8 training supports per-tensor and per-row scaling only; recipe "
                f"{recipe.name!r} uses {', '.join(bad)}; use impl='fp8rl' (emulated) or "
                f"impl='transformer_engine'"
            )
    return impl  # type: ignore[return-value]


def to_torchao_config(recipe: Recipe, *, emulate: bool = False):
    """Build the ``torchao.float8.Float8LinearConfig`` that implements ``recipe``.

    Raises ``ValueError`` when torchao cannot express the recipe (block/MX scales, mixed
    formats within one operand).
    """
    from torchao.float8.config import (
        CastConfig,
        Float8LinearConfig,
        ScalingGranularity,
        ScalingType,
    )

    tao_gran = {PerTensor: ScalingGranularity.TENSORWISE, PerRow: ScalingGranularity.AXISWISE}

    def cast(cfg: OperandConfig | None, enabled: bool, other_use: OperandConfig | None) -> CastConfig:
        if not enabled:
            # torchao wants one target dtype per operand across its two uses, even if disabled.
            ref = other_use or cfg
            fmt = ref.fmt if ref is not None else E4M3
            return CastConfig(scaling_type=ScalingType.DISABLED, target_dtype=fmt.dtype)
        assert cfg is not None
        if type(cfg.granularity) not in tao_gran:
            raise ValueError(
                f"torchao float8 training supports per-tensor and per-row scaling only; recipe "
                f"{recipe.name!r} uses {cfg.granularity}; use impl='fp8rl'"
            )
        return CastConfig(
            scaling_granularity=tao_gran[type(cfg.granularity)], target_dtype=cfg.fmt.dtype
        )

    (i, w), (go, w_gi), (go_gw, i_gw) = (recipe.operands(g) for g in GEMMS)
    for name, (u1, on1), (u2, on2) in (
        ("input", (i, recipe.fprop), (i_gw, recipe.wgrad)),
        ("weight", (w, recipe.fprop), (w_gi, recipe.dgrad)),
        ("grad_output", (go, recipe.dgrad), (go_gw, recipe.wgrad)),
    ):
        if on1 and on2 and u1 is not None and u2 is not None and u1.fmt != u2.fmt:
            raise ValueError(
                f"recipe {recipe.name!r}: torchao casts {name} to one format in both GEMMs, got "
                f"{u1.fmt.name} and {u2.fmt.name}; use impl='fp8rl'"
            )
    return Float8LinearConfig(
        cast_config_input=cast(i, recipe.fprop, i_gw),
        cast_config_weight=cast(w, recipe.fprop, w_gi),
        cast_config_grad_output=cast(go, recipe.dgrad, go_gw),
        cast_config_input_for_grad_weight=cast(i_gw, recipe.wgrad, i),
        cast_config_weight_for_grad_input=cast(w_gi, recipe.dgrad, w),
        cast_config_grad_output_for_grad_weight=cast(go_gw, recipe.wgrad, go),
        round_scales_to_power_of_2=recipe.pow2_scales,
        emulate=emulate,
    )


IMPLEMENTATIONS: Registry[Callable[..., nn.Module]] = Registry("FP8 linear implementation")


@IMPLEMENTATIONS.register("torchao")
def _convert_torchao(model: nn.Module, recipe: Recipe, module_filter: ModuleFilter, emulate: bool) -> nn.Module:
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = to_torchao_config(recipe, emulate=emulate)
    model = convert_to_float8_training(model, module_filter_fn=module_filter, config=config)
    for mod in model.modules():
        if isinstance(mod, Float8Linear) and not hasattr(mod, _RECIPE_ATTR):
            setattr(mod, _RECIPE_ATTR, recipe)
    return model


@IMPLEMENTATIONS.register("fp8rl")
def _convert_fp8rl(model: nn.Module, recipe: Recipe, module_filter: ModuleFilter, emulate: bool) -> nn.Module:
    def make(mod: nn.Linear) -> nn.Module:
        new = Fp8Linear.from_linear(mod, recipe, emulate=emulate)
        setattr(new, _RECIPE_ATTR, recipe)
        return new

    return swap_linears(model, make, module_filter)


@IMPLEMENTATIONS.register(_TE)
def _convert_transformer_engine(
    model: nn.Module, recipe: Recipe, module_filter: ModuleFilter, emulate: bool
) -> nn.Module:
    from fp8rl.quant.te import convert_te

    if emulate:  # resolve_impl refuses this already; kept for direct registry calls
        raise ValueError("impl='transformer_engine' has no emulation; set emulate=False")
    return convert_te(model, recipe, module_filter)


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _hardware(
    model: nn.Module, device: torch.device | str | None = None
) -> tuple[str, tuple[int, int] | None]:
    """``(device_type, cuda_capability)`` of ``device`` (default: the model's parameters), read now."""
    device = _device_of(model) if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return device.type, capability


def convert_to_fp8(
    model: nn.Module,
    recipe: Recipe | str,
    *,
    module_filter: ModuleFilter | None = None,
    emulate: bool = False,
    impl: str | None = None,
    device: torch.device | str | None = None,
    seed: int | None = None,
) -> nn.Module:
    """Swap ``nn.Linear`` layers of ``model`` for FP8 linears following ``recipe`` (in place).

    Args:
        model: any module; a bare ``nn.Linear`` is returned converted (not in place).
        recipe: a ``Recipe`` or a ``RECIPES`` name. ``bf16`` converts nothing.
        module_filter: ``(module, fqn) -> bool``, True = convert; replaces the default
            filter (all Linears but the LM head) entirely.
        emulate: quantize-dequantize-matmul instead of FP8 kernels (needed for block/MX
            without Transformer Engine).
        impl: ``torchao``, ``fp8rl``, ``transformer_engine``, or ``None``/``"auto"`` for
            ``default_impl(recipe, emulate=emulate)`` (a backend passes ``cfg.fp8.impl``).
        device: the device the model will train on, for the hardware check, when its parameters
            are not there yet (e.g. still on the CPU before DeepSpeed moves them); default: the
            device of its parameters.
        seed: seeds the model's quantizer state (``fp8rl.quant.rounding.QuantizerState``, one
            generator shared by its FP8 layers), required by a recipe that rounds an operand
            stochastically (``nvfp4``); pass the run seed. Ignored by other recipes.

    Returns:
        The converted model (the same object unless ``model`` is itself a Linear).

    Raises:
        ValueError: ``impl`` cannot express the recipe (``resolve_impl``).
        Fp8UnsupportedError: the hardware (or a missing Transformer Engine) cannot run the
            recipe as asked; the message names the fix.
    """
    recipe = get_recipe(recipe)
    if not recipe.enabled:
        return model
    impl = resolve_impl(recipe, impl, emulate=emulate)
    if impl == _TE:
        from fp8rl.quant.te import import_te

        import_te()  # a missing or broken install is named before any hardware complaint
    device_type, capability = _hardware(model, device)
    check_supported(recipe, impl=impl, device_type=device_type, capability=capability, emulate=emulate)
    already = [fqn for fqn, m in model.named_modules() if hasattr(m, _RECIPE_ATTR)]
    if already:
        raise ValueError(f"model already has FP8 layers ({already[:3]}...); convert an unconverted model")
    if recipe.stochastic and seed is None:
        raise ValueError(f"recipe {recipe.name!r} rounds operands stochastically: convert_to_fp8 needs seed= (the "
                         "run seed) for its quantizer state, so that the rounding noise is seeded and checkpointed")
    model = IMPLEMENTATIONS[impl](model, recipe, module_filter or default_module_filter, emulate)
    if recipe.stochastic:
        state = QuantizerState(seed, device=_device_of(model) if device is None else torch.device(device))
        for m in fp8_layers(model):
            setattr(m, STATE_ATTR, state)
    return model
