"""FP8 weights for the rollout engine: vLLM's fp8 checkpoint layout and a W8A8 inference linear.

The rollout engine keeps its own FP8 copy of the policy (paper: FP8 rollout; "FlashRL-style"
vLLM patch). After every weight sync the trainer's high-precision weights are quantized once
per the *rollout* recipe; activations are quantized dynamically per call (W8A8). Rollout and
trainer recipes are independent: ``rollout_only`` is FP8 rollout + ``bf16`` trainer.

Layout (matches vLLM's ``Fp8LinearMethod.create_weights`` for ``quant_method: fp8``):

- ``tensorwise``: ``<layer>.weight`` float8_e4m3fn ``[N, K]`` and ``<layer>.weight_scale``
  float32 scalar (shape ``()``); config ``{"quant_method": "fp8", "activation_scheme": "dynamic"}``.
- ``blockwise``: ``<layer>.weight`` float8_e4m3fn ``[N, K]`` and ``<layer>.weight_scale_inv``
  float32 ``[ceil(N/128), ceil(K/128)]``; config adds ``"weight_block_size": [128, 128]``.
- **Naming trap**: in both cases the stored value is the *dequantization multiplier*
  (``w ~= q * s``, i.e. ``amax / 448``). vLLM's ``weight_scale_inv`` (DeepSeek-V3's checkpoint
  spelling) is multiplied at dequantization despite its name; it is **not** ``448 / amax``.
- ``rowwise`` / ``rowwise_with_gw_hp``: ``<layer>.weight_scale`` float32 ``[N, 1]``. vLLM loads
  per-channel FP8 only through ``compressed-tensors`` (``strategy: channel``), which uses the same
  tensor names but a different config schema that we do not emit; our config is marked
  ``"fp8rl_weight_granularity": "row"`` [deviation].
- ``mxfp8``: ``<layer>.weight_scale_inv`` float32 ``[N, ceil(K/32)]`` (powers of two); vLLM's
  MXFP8 layout stores E8M0 bytes instead -- ours is marked ``"fp8rl_weight_granularity": "mx32"``.
- FP4 / FP6 (``nvfp4``, ``mxfp4``, ``mxfp6``; ``fp8rl.quant.microscale``): ``<layer>.weight``
  uint8 ``[N, K]``, one element code per byte (unpacked), ``<layer>.weight_scale`` float32
  ``[N, ceil(K/block)]`` (E4M3 block scales for NVFP4, E8M0 powers of two for MX) and, NVFP4 only,
  ``<layer>.weight_scale_2`` float32 ``()`` (the per-tensor decode scale). The names are
  ModelOpt's NVFP4 checkpoint names, but ModelOpt packs two codes per byte and stores E4M3 /
  E8M0 bytes, so the config is ``{"quant_method": "fp8rl_microscaled", ...}`` [deviation]: the
  mini engine's own layout, not a vLLM checkpoint. Activations are fake-quantized per call in
  the recipe's ``input`` format; the GEMM is emulated (no FP4/FP6 kernel is wired in). NVFP4
  weights with ``16 x 16`` tiles (``nvfp4``, ``w4a16``) store one scale per tile,
  ``[ceil(N/16), ceil(K/16)]``.
- ``w4a16`` (weight-only): the weight as above, activations in the engine's compute dtype
  (BF16), not quantized; the GEMM is the BF16 activations times the dequantized FP4 weight in
  float32, rounded to BF16 (what a W4A16 kernel that dequantizes into its fp32-accumulating MMA
  computes, up to accumulation order); ``fp8rl_input_format: bf16`` in the config.
- Activations: dynamic (no ``input_scale``), quantized with the recipe's ``input`` granularity
  (per-tensor, per-token, or 1x128 tiles), as vLLM's dynamic schemes do.

API used by the mini rollout engine::

    rollout_model = copy.deepcopy(policy)                     # engine's own copy
    convert_for_rollout(rollout_model, "tensorwise")          # Linears -> Fp8InferenceLinear
    ...                                                       # train a step
    sync_rollout_weights(rollout_model, trainer_model.state_dict(), "tensorwise")
    sd, quant_config = quantize_for_rollout(trainer_model.state_dict(), "blockwise")  # for vLLM

``convert_for_rollout`` on a ``bf16`` recipe converts nothing, and ``sync_rollout_weights``
then copies the state dict; the trainer may hold torchao/Fp8Linear layers (their weights are
still named ``<layer>.weight``). The LM head stays in high precision (``DEFAULT_SKIP_NAMES``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from fp8rl.quant.convert import (
    DEFAULT_SKIP_NAMES,
    ModuleFilter,
    _device_of,
    check_supported,
    default_module_filter,
    swap_linears,
)
from fp8rl.quant.fake import fake_quantize
from fp8rl.quant.formats import SubByteFormat
from fp8rl.quant.granularity import MX, PerBlock, PerRow, PerTensor
from fp8rl.quant.linear import SharedInput, cached_operand, has_scaled_mm_kernel, scaled_gemm
from fp8rl.quant.microscale import (
    MicroscaledTensor,
    dequantize_microscaled,
    quantize_microscaled,
)
from fp8rl.quant.quantize import dequantize, quantize
from fp8rl.quant.recipes import Recipe, get_recipe

__all__ = [
    "Fp8InferenceLinear",
    "convert_for_rollout",
    "quantize_for_rollout",
    "rollout_quant_config",
    "scale_key",
    "sync_rollout_weights",
]


def scale_key(recipe: Recipe) -> str:
    """State-dict suffix of the weight scale: ``weight_scale`` or (block/MX) ``weight_scale_inv``."""
    cfg = _weight_cfg(recipe)
    if _microscaled(cfg):
        return "weight_scale"
    return "weight_scale_inv" if isinstance(cfg.granularity, (PerBlock, MX)) else "weight_scale"


def _microscaled(cfg) -> bool:
    """The weight is FP4/FP6: codes + block scales (+ NVFP4's per-tensor scale ``weight_scale_2``)."""
    return isinstance(cfg.fmt, SubByteFormat)


def _has_tensor_scale(cfg) -> bool:
    return _microscaled(cfg) and not isinstance(cfg.granularity, MX)


def _weight_cfg(recipe: Recipe):
    if recipe.weight is None or (recipe.input is None and not recipe.weight_only):
        raise ValueError(f"recipe {recipe.name!r} has no FP8 weight/input config for rollout")
    return recipe.weight


def rollout_quant_config(recipe: Recipe | str) -> dict | None:
    """The ``quantization_config`` entry of ``config.json`` for ``recipe`` (``None`` for bf16)."""
    recipe = get_recipe(recipe)
    if not recipe.enabled:
        return None
    wcfg = _weight_cfg(recipe)
    g = wcfg.granularity
    if _microscaled(wcfg):
        return {"quant_method": "fp8rl_microscaled", "activation_scheme": "dynamic",
                "fp8rl_weight_format": wcfg.fmt.name, "fp8rl_weight_granularity": g.short_str(),
                "fp8rl_input_format": "bf16" if recipe.input is None else recipe.input.fmt.name}
    cfg: dict = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if isinstance(g, PerBlock):
        cfg["weight_block_size"] = [g.rows, g.cols]
    elif isinstance(g, PerRow):
        cfg["fp8rl_weight_granularity"] = "row"
    elif isinstance(g, MX):
        cfg["fp8rl_weight_granularity"] = f"mx{g.block}"
    return cfg


def _quantize_weight(w: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q, scale, tensor_scale)``: FP8 ``q`` and its scale (``tensor_scale`` None), or FP4/FP6
    codes, block scales and (NVFP4) the per-tensor scale."""
    cfg = _weight_cfg(recipe)
    if _microscaled(cfg):
        mt = quantize_microscaled(w.detach(), cfg.granularity, cfg.fmt)
        return mt.codes, mt.block_scale, mt.tensor_scale
    q, s = quantize(w.detach(), cfg.granularity, cfg.fmt, pow2_scale=recipe.pow2_scales)
    return q, s, None


def _default_is_linear_weight(key: str, tensor: torch.Tensor) -> bool:
    parts = key.split(".")
    return (
        parts[-1] == "weight" and tensor.ndim == 2
        and not any(p in DEFAULT_SKIP_NAMES or "embed" in p for p in parts[:-1])
    )


def quantize_for_rollout(
    state_dict: Mapping[str, torch.Tensor],
    recipe: Recipe | str,
    *,
    linear_names: set[str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Quantize the linear weights of a state dict into vLLM's fp8 checkpoint layout.

    Args:
        state_dict: high-precision ``{name: tensor}``.
        recipe: the rollout recipe (its ``weight`` config and ``pow2_scales`` are used).
        linear_names: module names whose ``.weight`` to quantize; default: every 2-D
            ``*.weight`` not under an embedding or the LM head (``DEFAULT_SKIP_NAMES``).

    Returns:
        ``(new_state_dict, quantization_config)``; other entries are passed through unchanged.
    """
    recipe = get_recipe(recipe)
    out = dict(state_dict)
    if not recipe.enabled:
        return out, None
    suffix = scale_key(recipe)
    for key, tensor in state_dict.items():
        module = key.rpartition(".")[0]
        chosen = (module in linear_names and key.endswith(".weight")) if linear_names is not None \
            else _default_is_linear_weight(key, tensor)
        if chosen:
            q, s, s2 = _quantize_weight(tensor, recipe)
            out[key] = q
            out[f"{module}.{suffix}"] = s
            if s2 is not None:
                out[f"{module}.weight_scale_2"] = s2
    return out, rollout_quant_config(recipe)


class Fp8InferenceLinear(nn.Module):
    """W8A8 linear for rollout: FP8 weight + scale (buffers), dynamic activation quantization.

    Buffers are named as in vLLM's checkpoint (``weight`` and ``weight_scale`` or
    ``weight_scale_inv``), so ``state_dict()`` is the vLLM layout. Inference only (no autograd
    through the FP8 weight).
    """

    def __init__(self, in_features: int, out_features: int, *, recipe: Recipe, bias: bool,
                 emulate: bool = False, out_dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.recipe, self.emulate, self.out_dtype = recipe, emulate, out_dtype
        wcfg = _weight_cfg(recipe)
        self._scale_name = scale_key(recipe)
        gr, gc = wcfg.granularity.grid(out_features, in_features)
        scale_shape: tuple[int, ...] = () if isinstance(wcfg.granularity, PerTensor) else (gr, gc)
        wdtype = torch.uint8 if _microscaled(wcfg) else wcfg.fmt.dtype  # FP4/FP6: one code per byte
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=wdtype, device=device))
        self.register_buffer(self._scale_name, torch.ones(scale_shape, dtype=torch.float32, device=device))
        if _has_tensor_scale(wcfg):  # NVFP4's per-tensor FP32 decode scale
            self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=out_dtype, device=device) if bias else None)
        self._dq_cache: tuple | None = None  # see dequantized_weight

    @property
    def scale(self) -> torch.Tensor:
        """The weight's dequantization multiplier (whatever its state-dict name)."""
        return getattr(self, self._scale_name)

    @torch.no_grad()
    def load_hp_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Quantize a high-precision ``[N, K]`` weight into the buffers (in place)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(weight.shape)} != {(self.out_features, self.in_features)}")
        q, s, s2 = _quantize_weight(weight, self.recipe)
        self.weight.copy_(q)
        self.scale.copy_(s.reshape(self.scale.shape))
        if s2 is not None:
            self.weight_scale_2.copy_(s2)
        if self.bias is not None:
            if bias is None:
                raise ValueError("this layer has a bias; pass it")
            self.bias.copy_(bias)

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: Recipe, *, emulate: bool = False) -> Fp8InferenceLinear:
        new = cls(mod.in_features, mod.out_features, recipe=recipe, bias=mod.bias is not None,
                  emulate=emulate, out_dtype=mod.weight.dtype, device=mod.weight.device)
        new.load_hp_weight(mod.weight, mod.bias)
        return new

    def dequantized_weight(self) -> torch.Tensor:
        """``dequantize(weight, scale)`` as float32 ``[N, K]``, cached until the buffers change.

        The emulated forward needs it on every call, but the weight only changes at a sync, so
        it is computed once per weight version: the cache is keyed on the identity and the
        in-place version counter of the ``weight`` and scale buffers (``load_hp_weight``,
        ``load_state_dict``, ``.to()`` and buffer reassignment all invalidate it). It holds
        the very tensor ``scaled_gemm``'s emulated path would compute, so outputs are
        bit-identical to dequantizing per call.
        """
        w, s = self.weight, self.scale
        s2 = getattr(self, "weight_scale_2", None)
        v2 = None if s2 is None else (id(s2), s2._version)
        c = self._dq_cache
        if (c is None or c[0] is not w or c[1] != w._version or c[2] is not s or c[3] != s._version
                or c[5] != v2):
            cfg = _weight_cfg(self.recipe)
            if _microscaled(cfg):
                dq = dequantize_microscaled(MicroscaledTensor(w, s, s2), cfg.granularity, cfg.fmt)
            else:
                dq = dequantize(w, s, cfg.granularity)
            c = self._dq_cache = (w, w._version, s, s._version, dq, v2)
        return c[4]

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, None)

    @torch.no_grad()
    def forward_with(self, x: torch.Tensor, shared: SharedInput) -> torch.Tensor:
        """``forward``, the emulated FP8 input shared through ``shared`` with the other layers that
        read the same input (a decoder layer's q/k/v, gate/up): quantized once, the same numbers."""
        return self._forward(x, shared)

    def _forward(self, x: torch.Tensor, shared: SharedInput | None) -> torch.Tensor:
        icfg, wcfg = self.recipe.input, _weight_cfg(self.recipe)
        x2 = x.reshape(-1, x.shape[-1])
        if icfg is None:  # weight-only (w4a16): high-precision activations, the FP4 weight dequantized
            y = (x2.to(torch.float32) @ self.dequantized_weight().t()).to(x.dtype)
        elif self.emulate or not has_scaled_mm_kernel(icfg.granularity, wcfg.granularity):
            # scaled_gemm's emulated path (fake_quantize == dequantize(quantize(x)), bit for
            # bit) with the weight dequantized once per sync
            xq = cached_operand(
                None if shared is None else shared.for_input(x), ("rollout.input", icfg, self.recipe.pow2_scales),
                lambda: fake_quantize(x2, icfg.granularity, icfg.fmt, pow2_scale=self.recipe.pow2_scales))  # type: ignore[union-attr]
            y = (xq @ self.dequantized_weight().t()).to(x.dtype)
        else:
            qx, sx = quantize(x2, icfg.granularity, icfg.fmt, pow2_scale=self.recipe.pow2_scales)  # type: ignore[union-attr]
            y = scaled_gemm(qx, sx, icfg.granularity, self.weight, self.scale, wcfg.granularity,  # type: ignore[union-attr]
                            out_dtype=x.dtype, emulate=False)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"recipe={self.recipe.name}, emulate={self.emulate}")


def convert_for_rollout(
    model: nn.Module,
    recipe: Recipe | str,
    *,
    module_filter: ModuleFilter | None = None,
    emulate: bool = False,
) -> nn.Module:
    """Replace ``nn.Linear`` layers (LM head excluded by default) by ``Fp8InferenceLinear``, in place.

    The layers' high-precision weights are quantized now and dropped. ``bf16``: no change.
    Raises ``Fp8UnsupportedError`` when the hardware needs ``emulate=True``.
    """
    recipe = get_recipe(recipe)
    if not recipe.enabled:
        return model
    device = _device_of(model)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    rollout_only = Recipe(f"{recipe.name}/rollout", input=recipe.input, weight=recipe.weight,
                          fprop=True, pow2_scales=recipe.pow2_scales, weight_only=recipe.weight_only)
    check_supported(rollout_only, impl="fp8rl", device_type=device.type, capability=capability, emulate=emulate)
    return swap_linears(
        model,
        lambda m: Fp8InferenceLinear.from_linear(m, recipe, emulate=emulate),
        module_filter or default_module_filter,
    )


@torch.no_grad()
def sync_rollout_weights(
    rollout_model: nn.Module,
    trainer_state_dict: Mapping[str, torch.Tensor],
    recipe: Recipe | str | None = None,
) -> None:
    """Copy a trainer state dict into a rollout model, quantizing into its FP8 layers.

    Args:
        rollout_model: a model converted by ``convert_for_rollout`` (or unconverted, bf16).
        trainer_state_dict: high-precision weights with the unconverted model's names.
        recipe: optional check: must equal the recipe the rollout model was converted with.

    Raises ``KeyError`` listing rollout entries missing from the trainer state dict.
    """
    fp8 = {name: m for name, m in rollout_model.named_modules() if isinstance(m, Fp8InferenceLinear)}
    if recipe is not None:
        want = get_recipe(recipe)
        for name, m in fp8.items():
            if m.recipe != want:
                raise ValueError(f"rollout layer {name!r} uses recipe {m.recipe.name!r}, not {want.name!r}")
    owned = {f"{n}.{s}" for n in fp8 for s in ("weight", "bias", "weight_scale", "weight_scale_inv", "weight_scale_2")}
    plain = {k: v for k, v in rollout_model.state_dict().items() if k not in owned}
    needed = [f"{n}.weight" for n in fp8] + list(plain)
    missing = [k for k in needed if k not in trainer_state_dict]
    if missing:
        raise KeyError(f"trainer state dict lacks {len(missing)} rollout entries, e.g. {missing[:5]}")
    for name, m in fp8.items():
        m.load_hp_weight(trainer_state_dict[f"{name}.weight"], trainer_state_dict.get(f"{name}.bias"))
    rollout_model.load_state_dict({k: trainer_state_dict[k] for k in plain}, strict=False)
