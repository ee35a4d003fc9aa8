"""A lean forward pass of transformers' ``Qwen3ForCausalLM``: the same operations, less Python.

At mini scale a forward pass is per-operator overhead, not FLOPs (a decode step of the ``8b``
slot is ~165 tensor operations of a few microseconds each), and about a fifth of the time of
``Qwen3ForCausalLM.__call__`` is its machinery around the maths: keyword plumbing and
decorators, output-capture hooks, building the 4-D attention mask from the 2-D one on every
call, rotary embeddings recomputed from the positions, ``DynamicCache`` bookkeeping, output
dataclasses. :class:`LeanQwen3` walks the *same module tree* (so FP8-converted linears,
``fp8_disabled`` and ``state_dict`` are untouched) and applies **exactly the operations of
transformers' eager Qwen3 path, in the same order, on tensors of the same shapes and
layouts** (transformers 5.x ``modeling_qwen3``):

- embedding; per layer: RMSNorm (upcast to fp32, ``pow(2).mean``, ``rsqrt``, weight),
  q/k/v projections, per-head q/k RMSNorm, rotary embedding ``x*cos + rotate_half(x)*sin``,
  the KV cache, grouped-query ``repeat_kv`` (expand + reshape), ``q @ k^T * scale + mask``,
  softmax in fp32, ``@ v``, output projection, residual; RMSNorm, SwiGLU MLP, residual;
  final RMSNorm and the LM head;
- the additive attention mask is transformers' eager mask: 0 where a query may attend,
  ``finfo(float32).min`` elsewhere (causal by column index, and padding);
- cos/sin come from a table built once per call site with transformers' own formula
  (``positions * inv_freq``, duplicated, ``cos``/``sin``, times the attention scaling), then
  gathered by position: an elementwise function gives the same bits wherever its argument
  sits in a tensor;
- the cache (:class:`KVCache`) is preallocated and written in place (no ``torch.cat`` of
  the whole cache per token); the attention reads the filled prefix, which ``repeat_kv``
  copies into the same contiguous layout transformers' cache produces.

In BF16 (``dtype=torch.bfloat16``) it is the forward of the model cast to BF16, as BF16 mixed
precision runs it: fp32 master weights cast to BF16 where they are used (differentiably),
BF16 activations, and every GEMM with BF16 inputs and fp32 accumulation
(``fp8rl.quant.lowp``: native on GPUs, emulated exactly on CPUs, which lack fast BF16 GEMMs).

In fp32, equality is bit-for-bit, not approximate: ``tests/mini/test_mini_qwen3.py`` compares logits,
gradients, sampled tokens and log-probs against ``Qwen3ForCausalLM.__call__`` for every
rollout and trainer recipe, with and without left padding, prefill and decode; a transformers
release that changes its eager maths fails that test. What is not supported raises at
construction (sliding-window layers, non-default RoPE, attention other than ``eager``,
attention dropout in training mode): the mini backend builds its models itself
(``model.py``) and never needs those.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from fp8rl.quant.linear import SharedInput
from fp8rl.quant.lowp import linear as lowp_linear
from fp8rl.quant.lowp import matmul as lowp_matmul


class KVCache:
    """Preallocated per-layer key/value buffers ``[B, kv_heads, capacity, head_dim]``.

    ``append(layer, k, v)`` writes ``[B, kv_heads, L, head_dim]`` at the current length and
    returns views of the filled prefix; ``advance(L)`` (called once per forward, after the
    last layer) moves the length on; ``keep_rows(rows)`` drops the other batch rows.
    """

    def __init__(self, n_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 *, dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.length, self.capacity = 0, capacity

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} positions needed, capacity {self.capacity}")
        self.k[layer].narrow(2, self.length, k.shape[2]).copy_(k)
        self.v[layer].narrow(2, self.length, v.shape[2]).copy_(v)
        return self.k[layer].narrow(2, 0, end), self.v[layer].narrow(2, 0, end)

    def advance(self, n: int) -> None:
        self.length += n

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (``[M]`` indices), in that order."""
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]


def causal_bias(attention_mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' eager mask for a full forward: ``[B, L] -> [B, 1, L, L]`` (0 / ``dtype`` min).

    Query ``i`` may attend key ``j`` when ``j <= i`` (column index, as transformers does) and
    key ``j`` is not padding. ``dtype`` is the compute dtype (transformers builds the mask in
    the model's dtype; a float32 minimum would overflow to -inf in BF16).
    """
    n = attention_mask.shape[1]
    idx = torch.arange(n, device=attention_mask.device)
    allowed = (idx[None, :] <= idx[:, None])[None] & attention_mask.bool()[:, None, :]
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]


def decode_bias(prompt_mask: torch.Tensor, max_new_tokens: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[B, 1, 1, P + max_new_tokens]``: the mask row of a decoded token (0 / ``dtype`` min).

    The prefix ``[..., :P + i + 1]`` is the eager mask of the ``i``-th decoded token: the
    prompt's padding is masked, every generated position is visible (as transformers' mask
    from the 2-D mask extended by ones).
    """
    b, p = prompt_mask.shape
    out = torch.zeros((b, 1, 1, p + max_new_tokens), dtype=dtype, device=prompt_mask.device)
    out[:, 0, 0, :p] = torch.where(prompt_mask.bool(), 0.0, torch.finfo(dtype).min).to(dtype)
    return out


class LeanQwen3:
    """Callable over a ``Qwen3ForCausalLM``'s modules: ``(ids, bias, positions, cache) -> logits``.

    Args:
        model: a ``transformers`` ``Qwen3ForCausalLM`` with eager attention (its linears may
            be FP8 modules; they are called as modules) and fp32 (master) weights.
        max_positions: size of the rotary table (positions ``0 .. max_positions - 1``).
        dtype: the compute dtype: ``torch.float32`` (transformers' fp32 forward, bit for bit)
            or ``torch.bfloat16`` (transformers' forward of the model cast to BF16: activations,
            norms' and embeddings' weights and the mask in BF16, GEMMs with BF16 inputs and fp32
            accumulation, ``fp8rl.quant.lowp``; the casts of the fp32 weights are
            differentiable, so gradients reach the fp32 masters as under FSDP mixed precision).
        weights_rounded: the model's weights already hold ``dtype`` values (a rollout engine's
            copy, rounded once per weight sync): high-precision GEMMs skip the weight cast.
        attention: ``eager`` (transformers' eager attention, op for op) or ``fused``: one
            ``scaled_dot_product_attention`` call on the fp32 values of q, k, v with the output
            rounded to ``dtype``, as an inference engine's fused attention kernel keeps scores
            and probabilities in fp32 (the rollout engine's choice; in BF16 it is what makes
            the engine's numbers differ from the trainer's, see ``rollout.py``).

    The modules' forward functions are looked up at construction: build the object inside
    ``fp8_disabled(model)`` for a pass without FP8.
    """

    def __init__(self, model: torch.nn.Module, max_positions: int, *, dtype: torch.dtype = torch.float32,
                 weights_rounded: bool = False, attention: str = "eager") -> None:
        cfg = model.config
        problems = []
        if type(model).__name__ != "Qwen3ForCausalLM":
            problems.append(f"model is a {type(model).__name__}, not a Qwen3ForCausalLM")
        if getattr(cfg, "_attn_implementation", None) != "eager":
            problems.append(f"attention implementation {cfg._attn_implementation!r} (needs 'eager')")
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
            problems.append(f"layer types {cfg.layer_types} (sliding windows are not supported)")
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            problems.append(f"rope type {rope.get('rope_type')!r} (needs 'default')")
        if model.training and cfg.attention_dropout:
            problems.append(f"attention dropout {cfg.attention_dropout} in training mode")
        if attention not in ("eager", "fused"):
            problems.append(f"attention={attention!r} (eager or fused)")
        if problems:
            raise ValueError("LeanQwen3 reproduces transformers' eager Qwen3 forward only: "
                             + "; ".join(problems) + ". Call the model itself instead")
        self.model, self.dtype, self.fused = model, dtype, attention == "fused"
        self.weights_rounded = weights_rounded
        attn = model.model.layers[0].self_attn
        self.head_dim, self.groups, self.scaling = attn.head_dim, attn.num_key_value_groups, attn.scaling
        self.kv_heads = cfg.num_key_value_heads
        # the modules' forward functions and norm weights, looked up once per instance (an
        # instance lives for one forward or one rollout; FP8 conversion happens before)
        self.layers = [_Layer(layer, weights_rounded, dtype) for layer in model.model.layers]
        emb = model.model.embed_tokens
        if type(emb) is not torch.nn.Embedding or emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
            raise ValueError("LeanQwen3 needs a plain nn.Embedding (no max_norm, sparse or scale_grad_by_freq)")
        self.embed_weight, self.padding_idx = emb.weight, emb.padding_idx
        self.final_norm = (model.model.norm.weight, model.model.norm.variance_epsilon)
        self.lm_head = _fwd(model.lm_head, weights_rounded, dtype)
        self.cos_table, self.signed_sin_table = rope_tables(model.model.rotary_emb, max_positions)

    def linear_layers(self) -> list[tuple[torch.nn.Module, object]]:
        """``(module, forward)`` of every linear layer (LM head included): the function the
        forward calls for it (``forward_with`` aside, which computes the same numbers)."""
        return [(m, _fwd(m, self.weights_rounded, self.dtype))
                for m in self.model.modules()
                if isinstance(getattr(m, "in_features", None), int) and hasattr(m, "out_features")]

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A KV cache for this model. The fused attention of a BF16 model reads keys and values
        in float32 (their exact values): the cache holds them in float32, converted once when
        written instead of the whole prefix at every decode step."""
        w = self.model.lm_head.weight
        dtype = torch.float32 if self.fused else self.dtype
        return KVCache(len(self.layers), batch, self.kv_heads, capacity, self.head_dim, dtype=dtype,
                       device=w.device)

    @staticmethod
    def _rms(norm: tuple[torch.Tensor, float], x: torch.Tensor) -> torch.Tensor:
        """``Qwen3RMSNorm.forward`` (``norm``: its weight and epsilon)."""
        weight, eps = norm
        dtype = x.dtype
        if dtype == torch.float32 and weight.dtype == torch.float32:
            # without its three casts, which return their input in fp32: torch's rms_norm, which
            # on CPU runs these very operations (x.pow(2).mean(-1, keepdim) + eps, rsqrt, x * it,
            # * weight) and records the same autograd nodes, in one call
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + eps)
        return weight.to(dtype) * h.to(dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` (``apply_rotary_pos_emb`` for one tensor).

        ``rotate_half(x) = cat(-x2, x1)`` (``x1``, ``x2`` the halves of the last dim) is computed as
        ``cat(x2, x1) * sign`` with the sign folded into the sine (``signed_sin``, see
        :func:`rope_tables`): a product's rounding is symmetric in sign, so
        ``(-a) * s == a * (-s)`` bit for bit, and one ``roll`` by half the dim (a permutation,
        forward and backward) replaces two slices, a negation and a concatenation."""
        return (x * cos) + (torch.roll(x, x.shape[-1] // 2, -1) * signed_sin)

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (:meth:`_rope`) ``[B, 1, L, head_dim]`` of ``position_ids`` ``[B, L]``,
        in the compute dtype (gathered from the tables: a caller may gather many positions once
        and pass slices)."""
        cos, sin = self.cos_table[position_ids], self.signed_sin_table[position_ids]
        if self.dtype != torch.float32:
            cos, sin = cos.to(dtype=self.dtype), sin.to(dtype=self.dtype)
        return cos[:, None], sin[:, None]

    def __call__(self, input_ids: torch.Tensor, bias: torch.Tensor, position_ids: torch.Tensor | None,
                 cache: KVCache | None = None, *, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ) -> torch.Tensor:
        """Logits ``[B, L, V]``.

        Args:
            input_ids: ``[B, L]`` tokens (with a cache: the next ``L`` tokens of every row).
            bias: ``[B, 1, L, S]`` additive mask over the ``S`` keys (cached + new):
                :func:`causal_bias` / a prefix of :func:`decode_bias`.
            position_ids: ``[B, L]`` rotary positions (None when ``rope`` is given).
            cache: optional :class:`KVCache`; the new keys/values are appended.
            rope: ``self.rope(position_ids)`` (or slices of it along ``L``), instead of
                ``position_ids``: the same values, gathered once for many calls.
        """
        # the table cast to the compute dtype, as a BF16 model holds it (the gradient of a row
        # that appears several times then sums in that dtype, as there); the casts below are
        # skipped where they would return their input (fp32): the same operations, fewer calls
        low = self.dtype != torch.float32
        x = F.embedding(input_ids, self.embed_weight.to(self.dtype) if low else self.embed_weight, self.padding_idx)
        if bias.dtype != self.dtype:
            bias = bias.to(self.dtype)
        if self.fused and low:  # the fused BF16 attention's float32 inputs (exact), once for all layers
            bias = bias.float()
        cos, sin = self.rope(position_ids) if rope is None else rope  # [B, 1, L, d]
        b, n = input_ids.shape
        hd, g = self.head_dim, self.groups
        for i, ly in enumerate(self.layers):
            residual = x
            h = self._rms(ly.input_norm, x)
            q = self._rms(ly.q_norm, ly.q_proj(h).view(b, n, -1, hd)).transpose(1, 2)
            k = self._rms(ly.k_norm, ly.k_proj(h).view(b, n, -1, hd)).transpose(1, 2)
            v = ly.v_proj(h).view(b, n, -1, hd).transpose(1, 2)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            if cache is not None:
                k, v = cache.append(i, k, v)
            if self.fused and not low:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scaling, enable_gqa=g > 1)
            elif self.fused:  # (k, v and bias are float32 already with a cache from new_cache)
                o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias,
                                                   scale=self.scaling, enable_gqa=g > 1).to(q.dtype)
            else:
                kh, s = k.shape[1], k.shape[2]
                if g > 1:  # repeat_kv
                    k = k[:, :, None, :, :].expand(b, kh, g, s, hd).reshape(b, kh * g, s, hd)
                    v = v[:, :, None, :, :].expand(b, kh, g, s, hd).reshape(b, kh * g, s, hd)
                # in place on the fresh score tensor: the same arithmetic as ``* scaling`` and
                # ``+ bias`` (autograd needs neither's output), without two more [b, h, n, s]
                # allocations (at 32 rows x 50 tokens a 1.3 MB one is mmap'ed and page-faulted anew)
                w = lowp_matmul(q, k.transpose(2, 3)).mul_(self.scaling)
                w = w.add_(bias)
                w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
                o = lowp_matmul(w, v)
            o = o.transpose(1, 2).contiguous()
            x = residual + ly.o_proj(o.reshape(b, n, -1))  # (contiguous: a view of o)
            residual = x
            h = self._rms(ly.post_norm, x)
            x = residual + ly.down_proj(ly.act(ly.gate_proj(h)) * ly.up_proj(h))
        if cache is not None:
            cache.advance(n)
        return self.lm_head(self._rms(self.final_norm, x))


def _fwd(module: torch.nn.Module, weights_rounded: bool = False, dtype: torch.dtype | None = None):
    """The function a forward calls for ``module``.

    A plain ``nn.Linear`` becomes :func:`fp8rl.quant.lowp.linear` on its weight (``F.linear``
    itself, bound to the weight, when the compute ``dtype`` is fp32: what ``lowp.linear`` calls
    for fp32 activations); a plain SiLU activation becomes ``F.silu`` (what its forward calls);
    other modules (FP8 linears, the embedding) are called through ``module.forward`` when calling
    the module would add nothing (no hooks of any kind), else through the module: the same
    computation without ``nn.Module.__call__``'s bookkeeping. An instance-level ``forward``
    (``fp8_disabled``'s switch) is what ``module.forward`` finds, and it is never bypassed.
    """
    from torch.nn.modules import module as torch_module

    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
             module._backward_pre_hooks, torch_module._global_forward_hooks,
             torch_module._global_forward_pre_hooks, torch_module._global_backward_hooks,
             torch_module._global_backward_pre_hooks)
    if any(hooks):
        return module
    own_forward = "forward" in vars(module)
    if type(module) is torch.nn.Linear and not own_forward:
        weight, bias = module.weight, module.bias
        if dtype == torch.float32:
            return functools.partial(F.linear, weight=weight, bias=bias)
        return lambda x: lowp_linear(x, weight, bias, weight_rounded=weights_rounded)
    if type(module).__name__ == "SiLUActivation" and type(module).__module__.startswith("transformers.") \
            and not own_forward:
        return F.silu
    return module.forward


def _fwd_shared(modules: list[torch.nn.Module], f) -> list:
    """``[f(m) for m in modules]`` for layers that read one input, except that FP8 layers whose
    forward would be called as is (``f`` gives ``m.forward``: no hooks, FP8 not switched off)
    are called through ``forward_with`` and one :class:`~fp8rl.quant.linear.SharedInput`: each
    quantizes the input as it would alone, so the first quantization serves them all."""
    fwds = [f(m) for m in modules]
    if all(callable(getattr(m, "forward_with", None)) and "forward" not in vars(m) and fw == m.forward
           for m, fw in zip(modules, fwds, strict=True)):
        shared = SharedInput()
        return [functools.partial(m.forward_with, shared=shared) for m in modules]
    return fwds


class _Layer:
    """One decoder layer's forward functions and norm parameters."""

    __slots__ = ("act", "down_proj", "gate_proj", "input_norm", "k_norm", "k_proj", "o_proj", "post_norm",
                 "q_norm", "q_proj", "up_proj", "v_proj")

    def __init__(self, layer: torch.nn.Module, weights_rounded: bool, dtype: torch.dtype) -> None:
        attn, mlp = layer.self_attn, layer.mlp

        def norm(m: torch.nn.Module) -> tuple[torch.Tensor, float]:
            return m.weight, m.variance_epsilon

        self.input_norm, self.post_norm = norm(layer.input_layernorm), norm(layer.post_attention_layernorm)
        self.q_norm, self.k_norm = norm(attn.q_norm), norm(attn.k_norm)
        def f(m: torch.nn.Module):
            return _fwd(m, weights_rounded, dtype)

        self.q_proj, self.k_proj, self.v_proj = _fwd_shared([attn.q_proj, attn.k_proj, attn.v_proj], f)
        self.gate_proj, self.up_proj = _fwd_shared([mlp.gate_proj, mlp.up_proj], f)
        self.o_proj, self.down_proj = f(attn.o_proj), f(mlp.down_proj)
        self.act = _fwd(mlp.act_fn)


#: rotary tables per rotary-embedding module (its ``inv_freq`` is fixed at construction)
_ROPE_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rope_tables(rot: torch.nn.Module, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, signed_sin)``: cos and sin ``[max_positions, head_dim]`` of transformers'
    ``Qwen3RotaryEmbedding.forward`` for every position at once (times its attention scaling),
    the sin's first half negated (exact; ``LeanQwen3._rope``). Built once per module, size and
    device (``inv_freq`` is a non-persistent buffer that nothing changes after construction)."""
    inv_freq = rot.inv_freq
    key = (max_positions, inv_freq.device, inv_freq.dtype, rot.attention_scaling)
    cached = _ROPE_TABLES.setdefault(rot, {})
    if key not in cached:
        pos = torch.arange(max_positions, device=inv_freq.device)
        freqs = pos[..., None].float() * inv_freq.to(dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = emb.shape[-1] // 2
        sign = torch.ones(emb.shape[-1], device=emb.device)
        sign[:half] = -1.0
        cached.clear()  # one entry per module: a second size or device replaces the first
        cached[key] = (emb.cos() * rot.attention_scaling, (emb.sin() * rot.attention_scaling) * sign)
    return cached[key]
