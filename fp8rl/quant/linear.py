"""Our FP8 linear layer for training: fprop, dgrad and wgrad per a ``Recipe``.

Used for the recipes torchao does not implement (``blockwise``, ``mxfp8``) and, for the
agreement tests and the GPU benchmark, for the ones it does. Each FP8 GEMM quantizes its two
operands with dynamic scales in the GEMM's own orientation (contraction dim last, see
``granularity.py``) and then

- calls ``torch._scaled_mm`` when both scales are per-tensor or per-row (a per-tensor scale
  paired with a per-row one is broadcast to per-row, as torchao does) -- this runs on CPU and on
  CUDA GPUs with capability >= 8.9;
- otherwise **emulates**: dequantize both operands to float32, matmul in float32 (FP8 tensor
  cores also accumulate in float32), cast the result to the output dtype. With ``emulate=True``
  every GEMM takes this path; the numbers then equal an exact FP8 GEMM up to float32
  accumulation order.

Like torchao's ``Float8Linear`` the layer saves the high-precision input and weight for the
backward pass and re-quantizes them there (no FP8 copies are kept between passes), the output
dtype is the input's dtype, and the bias is added in high precision.

Deviations / choices:

- Blockwise and MX GEMMs have no kernel wired in here (PyTorch 2.13 has ``F.scaled_mm`` with
  ``BlockWise1x128``/``BlockWise128x128`` scaling on Hopper, not exercised in this project yet,
  see ``benchmarks/gpu_fp8_linear.py``); ``convert_to_fp8`` therefore requires ``emulate=True``
  for them on every device.
- FP4 / FP6 operands (``nvfp4``, ``mxfp4``, ``mxfp6``; ``fp8rl.quant.microscale``) are always
  emulated: no FP4/FP6 GEMM kernel is wired in (``convert_to_fp8`` requires ``emulate=True``).
- On CUDA, row-scaled ``_scaled_mm`` cannot write float32; like torchao we compute in bfloat16
  and cast, so float32 models see a bfloat16-rounded FP8 GEMM output there. On CPU the output
  is written in float32 directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fp8rl.quant.fake import fake_quantize
from fp8rl.quant.granularity import Granularity, NVBlock, PerBlock, PerRow, PerTensor
from fp8rl.quant.hadamard import rht
from fp8rl.quant.lowp import linear as lowp_linear
from fp8rl.quant.lowp import matmul as lowp_matmul
from fp8rl.quant.microscale import dequantize_microscaled, is_microscaled, quantize_microscaled
from fp8rl.quant.quantize import dequantize, quantize
from fp8rl.quant.recipes import OperandConfig, Recipe
from fp8rl.quant.rounding import QuantizerState, stochastic_generator

__all__ = ["Fp8Linear", "SharedInput", "fp8_linear", "fp8_mm", "has_scaled_mm_kernel", "scaled_gemm"]

_KERNEL_GRANULARITIES = (PerTensor, PerRow)


def has_scaled_mm_kernel(ga: Granularity, gb: Granularity) -> bool:
    """True when ``torch._scaled_mm`` can take these two scale layouts (per-tensor / per-row)."""
    return isinstance(ga, _KERNEL_GRANULARITIES) and isinstance(gb, _KERNEL_GRANULARITIES)


def scaled_gemm(
    qa: torch.Tensor,
    sa: torch.Tensor,
    ga: Granularity,
    qb: torch.Tensor,
    sb: torch.Tensor,
    gb: Granularity,
    *,
    out_dtype: torch.dtype,
    emulate: bool,
) -> torch.Tensor:
    """``dequant(qa) @ dequant(qb).T`` from quantized operands.

    Args:
        qa, sa: FP8 ``[M, K]`` and its dequantization scale (granularity ``ga``).
        qb, sb: FP8 ``[N, K]`` and its scale (granularity ``gb``).
        out_dtype: dtype of the ``[M, N]`` result.
        emulate: dequantize + float32 matmul instead of ``torch._scaled_mm``.
    """
    if emulate or not has_scaled_mm_kernel(ga, gb):
        a = dequantize(qa, sa, ga)
        b = dequantize(qb, sb, gb)
        return (a @ b.t()).to(out_dtype)
    m, n = qa.shape[0], qb.shape[0]
    if isinstance(ga, PerTensor) and isinstance(gb, PerTensor):
        scale_a, scale_b = sa.reshape(()), sb.reshape(())
        rowwise = False
    else:  # at least one per-row: broadcast the other to per-row (torchao preprocess_addmm)
        scale_a = sa.reshape(m, 1) if isinstance(ga, PerRow) else sa.reshape(1, 1).expand(m, 1)
        scale_b = sb.reshape(1, n) if isinstance(gb, PerRow) else sb.reshape(1, 1).expand(1, n)
        scale_a, scale_b = scale_a.contiguous(), scale_b.contiguous()
        rowwise = True
    kernel_dtype = out_dtype
    if rowwise and qa.device.type == "cuda" and out_dtype != torch.bfloat16:
        kernel_dtype = torch.bfloat16  # CUDA row-scaled kernel writes bfloat16 only
    out = torch._scaled_mm(qa, qb.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=kernel_dtype)
    return out.to(out_dtype)


def fp8_mm(
    a: torch.Tensor,
    a_cfg: OperandConfig,
    b: torch.Tensor,
    b_cfg: OperandConfig,
    *,
    pow2_scales: bool = False,
    emulate: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``a @ b.T`` with both operands quantized to FP8 per their configs.

    Args:
        a: ``[M, K]`` high precision; b: ``[N, K]`` high precision (K = contraction dim).
        a_cfg, b_cfg: granularity and format of each operand.
        pow2_scales: power-of-two scales for both operands.
        emulate: dequantize-and-matmul instead of ``torch._scaled_mm``.
        out_dtype: result dtype (default ``a.dtype``).

    Returns:
        ``[M, N]`` in ``out_dtype``.
    """
    if is_microscaled(a_cfg.granularity, a_cfg.fmt) or is_microscaled(b_cfg.granularity, b_cfg.fmt):
        # FP4 / FP6: codes and scales, dequantized, float32 matmul (no kernel is wired in)
        da, db = (dequantize_microscaled(quantize_microscaled(t, c.granularity, c.fmt), c.granularity, c.fmt)
                  if is_microscaled(c.granularity, c.fmt)
                  else dequantize(*quantize(t, c.granularity, c.fmt, pow2_scale=pow2_scales), c.granularity)
                  for t, c in ((a, a_cfg), (b, b_cfg)))
        return (da @ db.t()).to(out_dtype or a.dtype)
    qa, sa = quantize(a, a_cfg.granularity, a_cfg.fmt, pow2_scale=pow2_scales)
    qb, sb = quantize(b, b_cfg.granularity, b_cfg.fmt, pow2_scale=pow2_scales)
    return scaled_gemm(
        qa, sa, a_cfg.granularity, qb, sb, b_cfg.granularity,
        out_dtype=out_dtype or a.dtype, emulate=emulate,
    )


def _transpose_invariant(g: Granularity) -> bool:
    """Quantizing ``t`` and ``t.T`` with ``g`` gives the same FP8 values (transposed)."""
    return (isinstance(g, PerTensor) or (isinstance(g, PerBlock) and g.rows == g.cols)
            or (isinstance(g, NVBlock) and g.rows == g.block))


def _fake_quantize(t: torch.Tensor, cfg: OperandConfig, recipe: Recipe,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """An emulated GEMM operand: ``t``'s FP8 values in float32, dequantized as the recipe's
    reference implementation does (torchao divides by its multiplier; the others multiply);
    a stochastic operand draws from ``generator`` (the model's quantizer state)."""
    if cfg.rounding == "stochastic":
        if generator is None:
            raise ValueError(f"recipe {recipe.name!r}: a stochastically rounded operand needs the model's seeded "
                             "quantizer state (convert_to_fp8(..., seed=))")
        return fake_quantize(t, cfg.granularity, cfg.fmt, generator=generator)
    return fake_quantize(t, cfg.granularity, cfg.fmt, pow2_scale=recipe.pow2_scales,
                         divide=recipe.impl == "torchao")


class _Operand:
    """A GEMM operand's emulated FP8 value, kept for a later GEMM that quantizes the same
    tensor transposed with the same config (then the values are the same, transposed)."""

    __slots__ = ("cfg", "value")

    def __init__(self, cfg: OperandConfig, value: torch.Tensor) -> None:
        self.cfg, self.value = cfg, value

    def transposed_for(self, cfg: OperandConfig) -> torch.Tensor | None:
        if cfg == self.cfg and _transpose_invariant(cfg.granularity) and cfg.rounding == "nearest":
            return self.value.t()
        return None


class SharedInput:
    """The emulated FP8 operands of one input that several layers read, quantized once.

    A decoder layer feeds one tensor to its q, k and v projections and another to gate and up;
    with the same recipe each of them would quantize that tensor identically, for its forward
    GEMM and again, transposed, for its weight gradient. Layers called through ``forward_with``
    with one ``SharedInput`` quantize it once per GEMM role instead: the very tensors each would
    compute, so the numbers are unchanged (``tests/quant/test_shared_input.py``).

    It is bound to the last input it saw, by identity, and holds it, so no other tensor can take
    that identity while it is bound; a new input starts a new set of operands. The caller must
    not modify the input in place between the layers' calls (``LeanQwen3`` calls them back to
    back on a fresh tensor).
    """

    __slots__ = ("operands", "x")

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None
        self.operands: dict = {}

    def for_input(self, x: torch.Tensor) -> dict:
        """The operand cache of ``x``: ``{key: tensor}``, empty for a new input."""
        if self.x is not x:
            self.x, self.operands = x, {}
        return self.operands


def cached_operand(cache: dict | None, key, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``cache[key]``, computed by ``make()`` and stored when absent; ``make()`` alone without a
    cache (``SharedInput.for_input``)."""
    if cache is None:
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _operand(t: torch.Tensor, cfg: OperandConfig | None, recipe: Recipe, source: _Operand | None,
             shared: dict | None, role: str, generator: torch.Generator | None = None,
             transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """A GEMM operand's emulated FP8 value: from ``shared`` (another layer quantized the same
    input for the same role), from ``source`` (the same tensor transposed), or quantized now
    (after ``transform``: the wgrad RHT). ``cfg=None``: a high-precision operand of a weight-only
    recipe, in float32 (exact from BF16)."""
    if cfg is None:
        return t.to(torch.float32)

    def make() -> torch.Tensor:
        q = source.transposed_for(cfg) if source is not None and transform is None else None
        if q is not None:
            return q
        return _fake_quantize(t if transform is None else transform(t), cfg, recipe, generator)

    return cached_operand(None if cfg.rounding == "stochastic" else shared, (role, recipe), make)


def _gemm(recipe: Recipe, gemm: str, a: torch.Tensor, b: torch.Tensor, emulate: bool,
          *, a_from: _Operand | None = None, b_from: _Operand | None = None,
          a_shared: dict | None = None, b_shared: dict | None = None,
          generator: torch.Generator | None = None,
          ) -> tuple[torch.Tensor, _Operand | None, _Operand | None]:
    """One of the three GEMMs, ``a @ b.T``, in FP8 or high precision per the recipe.

    Emulated, an operand whose ``*_from`` holds the same tensor transposed, quantized with the
    same transpose-invariant config (per-tensor, square blocks), is taken from there instead of
    being quantized again: the same numbers, one quantization less; an operand with a
    ``*_shared`` cache (``SharedInput.for_input``) is taken from, or put into, that cache.
    Returns the result and the two emulated operands (``None`` when the GEMM ran in high
    precision or on a kernel). The wgrad GEMM of a recipe with ``wgrad_rht`` quantizes both
    operands after the 16x16 random Hadamard transform along the tokens (``hadamard.rht``; the
    product is unchanged in exact arithmetic), never reusing an untransformed operand; a
    weight-only recipe's ``None`` operand enters in high precision. ``generator``: the draws of
    stochastically rounded operands.
    """
    if not getattr(recipe, gemm):
        return lowp_matmul(a, b.t()), None, None
    a_cfg, b_cfg = recipe.operands(gemm)
    assert b_cfg is not None and (a_cfg is not None or recipe.weight_only)
    if a_cfg is not None and not (emulate or not has_scaled_mm_kernel(a_cfg.granularity, b_cfg.granularity)):
        out = fp8_mm(a, a_cfg, b, b_cfg, pow2_scales=recipe.pow2_scales, emulate=False)
        return out, None, None
    transform = rht if gemm == "wgrad" and recipe.wgrad_rht else None
    qa = _operand(a, a_cfg, recipe, a_from, a_shared, f"{gemm}.a", generator, transform)
    qb = _operand(b, b_cfg, recipe, b_from, b_shared, f"{gemm}.b", generator, transform)
    return (qa @ qb.t()).to(a.dtype), _Operand(a_cfg, qa), _Operand(b_cfg, qb)


class _Fp8LinearFn(torch.autograd.Function):
    """``x @ W.T`` with the three GEMMs following ``recipe`` (bias handled by the caller).

    Emulated, the backward GEMMs reuse the forward's quantized input / weight, and wgrad reuses
    dgrad's quantized gradient, where the recipe quantizes the same tensor transposed with a
    transpose-invariant config (``tensorwise``: three quantizations per layer instead of six;
    ``blockwise``: the 128x128 weight): exactly the numbers re-quantizing would give.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, emulate: bool,
                shared: dict | None, generator: torch.Generator | None):
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.emulate, ctx.shared, ctx.generator = recipe, emulate, shared, generator
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        y, ctx.x_q, ctx.w_q = _gemm(recipe, "fprop", x2, weight, emulate, a_shared=shared)  # [M, N]
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight = ctx.saved_tensors
        recipe, emulate = ctx.recipe, ctx.emulate
        g2 = grad_y.reshape(-1, grad_y.shape[-1])  # [M, N]
        grad_x = grad_w = None
        g_q = None
        if ctx.needs_input_grad[0]:
            # dgrad: grad_x [M, K] = grad_y [M, N] @ W [N, K]; contraction over N
            grad_x, g_q, _ = _gemm(recipe, "dgrad", g2, weight.t(), emulate, b_from=ctx.w_q,
                                   generator=ctx.generator)
            grad_x = grad_x.reshape(x.shape)
        if ctx.needs_input_grad[1]:
            # wgrad: grad_W [N, K] = grad_y.T [N, M] @ x [M, K]; contraction over tokens M
            x2 = x.reshape(-1, x.shape[-1])
            grad_w, _, _ = _gemm(recipe, "wgrad", g2.t(), x2.t(), emulate, a_from=g_q, b_from=ctx.x_q,
                                 b_shared=ctx.shared, generator=ctx.generator)
            grad_w = grad_w.to(weight.dtype)
        ctx.x_q = ctx.w_q = ctx.shared = ctx.generator = None
        return grad_x, grad_w, None, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Recipe,
    *,
    emulate: bool = False,
    shared: SharedInput | None = None,
    quant_state: QuantizerState | None = None,
) -> torch.Tensor:
    """Functional FP8 linear: ``x [..., K] @ weight[N, K].T + bias[N]`` -> ``[..., N]``.

    Computes in ``x``'s dtype: with BF16 activations and an fp32 master weight, the weight is
    cast to BF16 first (differentiably) and quantized from there, as under BF16 mixed precision
    (FSDP / DeepSpeed hand the layer a BF16 weight); GEMM outputs are BF16. ``shared``: the
    input's operands are shared with the other layers that read it (``SharedInput``).
    ``quant_state``: the seeded generator of a recipe with stochastically rounded operands
    (required for it, ``fp8rl.quant.rounding``).
    """
    if not recipe.enabled:
        return lowp_linear(x, weight, bias)
    generator = stochastic_generator(recipe, quant_state)
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    y = _Fp8LinearFn.apply(x, weight, recipe, emulate, None if shared is None else shared.for_input(x), generator)
    return y if bias is None else y + bias.to(y.dtype)


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose forward/backward GEMMs follow an FP8 ``Recipe``.

    Shares ``weight`` and ``bias`` Parameters with the layer it was built from (no copies): the
    master weights stay in their dtype and receive ordinary gradients. ``quant_state``: the
    model's seeded quantizer state (``convert_to_fp8(..., seed=)``), shared by its layers.
    """

    quant_state: QuantizerState | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Recipe, emulate: bool = False, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.emulate = emulate

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: Recipe, *, emulate: bool = False) -> Fp8Linear:
        """Wrap ``mod``'s Parameters (shared, not copied) in an ``Fp8Linear``."""
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False, recipe=recipe, emulate=emulate)
        new.weight = mod.weight
        new.bias = mod.bias
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fp8_linear(input, self.weight, self.bias, self.recipe, emulate=self.emulate,
                          quant_state=self.quant_state)

    def forward_with(self, input: torch.Tensor, shared: SharedInput) -> torch.Tensor:
        """``forward``, the input's emulated FP8 operands shared through ``shared`` with the other
        layers that read the same input (the same numbers, fewer quantizations)."""
        return fp8_linear(input, self.weight, self.bias, self.recipe, emulate=self.emulate, shared=shared,
                          quant_state=self.quant_state)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, emulate={self.emulate}"
