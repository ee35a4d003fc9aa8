"""FP8 for training and rollout: formats, scaling granularities, FP8 linear, conversion, audit.

The FP8 half of "full-pipeline FP8" (paper: FP8 rollout + FP8 training GEMMs; see
``reference/paper.md`` "FP8 scaling granularities"). Modules:

- ``formats``      ``Fp8Format``, ``E4M3`` (max 448), ``E5M2`` (max 57344); ``SubByteFormat``
                   ``E2M1`` (FP4), ``E2M3`` / ``E3M2`` (FP6), OCP MX bit fields.
- ``microscale``   FP4/FP6 quantization: OCP MX (E8M0 scales) and NVFP4 (two-level) rules.
- ``granularity``  ``PerTensor``, ``PerRow``, ``PerBlock(r, c)``, ``MX(32)``, ``NVBlock(16)``; the one meaning of
                   "axis" (contraction dimension last) is documented there.
- ``quantize``     ``quantize(x, granularity, fmt) -> (q, scale)``, ``dequantize``, ``sqnr_db``.
- ``recipe_types`` ``Recipe`` (per operand granularity + format, per GEMM FP8 flag, dynamic or
                   delayed scaling), ``OperandConfig``.
- ``recipes``      ``RECIPES`` (re-exports ``recipe_types``): ``bf16``, ``tensorwise``,
                   ``tensorwise_delayed``, ``rowwise``, ``rowwise_with_gw_hp``, ``blockwise``,
                   ``mxfp8``, and the emulated FP4/FP6 ``nvfp4``, ``nvfp4_rn``, ``w4a16``, ``mxfp4``,
                   ``mxfp6``;
                   ``get_recipe(name, hybrid=..., amax_history_len=..., amax_compute_algo=...)``.
- ``linear``       ``Fp8Linear`` / ``fp8_linear``: our FP8 training linear (``_scaled_mm`` or emulation).
- ``convert``      ``convert_to_fp8(model, recipe, module_filter=, emulate=, impl=)`` (torchao,
                   ours or Transformer Engine; ``default_impl``/``resolve_impl`` pick and check),
                   ``fp8_disabled(model)`` (the BF16 shadow pass), ``check_supported``.
- ``te_recipe``    Transformer Engine's recipe for ours: ``to_te_recipe``, ``TE_KINDS`` (GPU and
                   shape needs), ``SUBBYTE_TRAINER_NEEDS`` (the FP4/FP6 refusal text).
- ``te``           Transformer Engine module conversion (``convert_te``, ``te_skipped_layers``;
                   re-exports ``te_recipe``); imports TE only when converting.
- ``rollout``      ``quantize_for_rollout`` (vLLM fp8 layout), ``Fp8InferenceLinear`` (W8A8),
                   ``convert_for_rollout``, ``sync_rollout_weights``.
- ``audit``        the noise audit behind ``python -m experiments.audit``.

Typical use (trainer and rollout engine are configured independently)::

    from fp8rl.quant import convert_to_fp8, fp8_disabled, convert_for_rollout, sync_rollout_weights

    policy = convert_to_fp8(policy, "blockwise", emulate=True)     # FP8 training GEMMs
    with torch.no_grad(), fp8_disabled(policy):                     # BF16 shadow log-probs
        shadow_logits = policy(input_ids).logits
    rollout = convert_for_rollout(copy.deepcopy(unconverted_policy), "tensorwise")
    sync_rollout_weights(rollout, policy.state_dict())              # after every optimizer step

Hardware: per-tensor and per-row FP8 GEMMs run on CPU via ``torch._scaled_mm``; block and MX
GEMMs need Transformer Engine on a GPU (sm90+ / sm100) or ``emulate=True`` (the config key
``fp8.emulate=true``); anything that cannot run raises ``Fp8UnsupportedError`` naming the fix
instead of silently falling back.
"""

from fp8rl.quant.convert import (
    DEFAULT_SKIP_NAMES,
    IMPLEMENTATIONS,
    Fp8UnsupportedError,
    check_supported,
    convert_to_fp8,
    default_impl,
    default_module_filter,
    fp8_disabled,
    fp8_layers,
    resolve_impl,
    to_torchao_config,
)
from fp8rl.quant.fake import fake_quantize
from fp8rl.quant.formats import E2M1, E2M3, E3M2, E4M3, E5M2, FORMATS, Fp8Format, SubByteFormat
from fp8rl.quant.granularity import (
    GRANULARITIES,
    MX,
    Granularity,
    NVBlock,
    PerBlock,
    PerRow,
    PerTensor,
)
from fp8rl.quant.linear import Fp8Linear, fp8_linear, fp8_mm, scaled_gemm
from fp8rl.quant.quantize import (
    EPS,
    NonFiniteError,
    dequantize,
    fp8_to_float32,
    quantize,
    quantize_with_scale,
    sqnr_db,
)
from fp8rl.quant.recipes import (
    AMAX_COMPUTE_ALGOS,
    GEMMS,
    RECIPES,
    SCALINGS,
    OperandConfig,
    Recipe,
    get_recipe,
)
from fp8rl.quant.rollout import (
    Fp8InferenceLinear,
    convert_for_rollout,
    quantize_for_rollout,
    rollout_quant_config,
    scale_key,
    sync_rollout_weights,
)
from fp8rl.quant.te import TE_KINDS, TE_VERSION, te_recipe_kind, te_skipped_layers, to_te_recipe

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "DEFAULT_SKIP_NAMES",
    "E2M1",
    "E2M3",
    "E3M2",
    "E4M3",
    "E5M2",
    "EPS",
    "FORMATS",
    "GEMMS",
    "GRANULARITIES",
    "IMPLEMENTATIONS",
    "MX",
    "RECIPES",
    "SCALINGS",
    "TE_KINDS",
    "TE_VERSION",
    "Fp8Format",
    "Fp8InferenceLinear",
    "Fp8Linear",
    "Fp8UnsupportedError",
    "Granularity",
    "NVBlock",
    "NonFiniteError",
    "OperandConfig",
    "PerBlock",
    "PerRow",
    "PerTensor",
    "Recipe",
    "SubByteFormat",
    "check_supported",
    "convert_for_rollout",
    "convert_to_fp8",
    "default_impl",
    "default_module_filter",
    "dequantize",
    "fake_quantize",
    "fp8_disabled",
    "fp8_layers",
    "fp8_linear",
    "fp8_mm",
    "fp8_to_float32",
    "get_recipe",
    "quantize",
    "quantize_for_rollout",
    "quantize_with_scale",
    "resolve_impl",
    "rollout_quant_config",
    "scale_key",
    "scaled_gemm",
    "sqnr_db",
    "sync_rollout_weights",
    "te_recipe_kind",
    "te_skipped_layers",
    "to_te_recipe",
    "to_torchao_config",
]
