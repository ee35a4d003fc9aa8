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

Equality is bit-for-bit, not approximate: ``tests/mini/test_mini_qwen3.py`` compares logits,
gradients, sampled tokens and log-probs against ``Qwen3ForCausalLM.__call__`` for every
rollout and trainer recipe, with and without left padding, prefill and decode; a transformers
release that changes its eager maths fails that test. What is not supported raises at
construction (sliding-window layers, non-default RoPE, attention other than ``eager``,
attention dropout in training mode): the mini backend builds its models itself
(``model.py``) and never needs those.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_NEG = torch.finfo(torch.float32).min


class KVCache:
    """Preallocated per-layer key/value buffers ``[B, kv_heads, capacity, head_dim]``.

    ``append(layer, k, v)`` writes ``[B, kv_heads, L, head_dim]`` at the current length and
    returns views of the filled prefix; ``advance(L)`` (called once per forward, after the
    last layer) moves the length on.
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
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n


def causal_bias(attention_mask: torch.Tensor) -> torch.Tensor:
    """transformers' eager mask for a full forward: ``[B, L] -> [B, 1, L, L]`` (0 / float32 min).

    Query ``i`` may attend key ``j`` when ``j <= i`` (column index, as transformers does) and
    key ``j`` is not padding.
    """
    n = attention_mask.shape[1]
    idx = torch.arange(n, device=attention_mask.device)
    allowed = (idx[None, :] <= idx[:, None])[None] & attention_mask.bool()[:, None, :]
    return torch.where(allowed, 0.0, _NEG)[:, None]


def decode_bias(prompt_mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """``[B, 1, 1, P + max_new_tokens]``: the mask row of a decoded token (0 / float32 min).

    The prefix ``[..., :P + i + 1]`` is the eager mask of the ``i``-th decoded token: the
    prompt's padding is masked, every generated position is visible (as transformers' mask
    from the 2-D mask extended by ones).
    """
    b, p = prompt_mask.shape
    out = torch.zeros((b, 1, 1, p + max_new_tokens), dtype=torch.float32, device=prompt_mask.device)
    out[:, 0, 0, :p] = torch.where(prompt_mask.bool(), 0.0, _NEG)
    return out


class LeanQwen3:
    """Callable over a ``Qwen3ForCausalLM``'s modules: ``(ids, bias, positions, cache) -> logits``.

    Args:
        model: a ``transformers`` ``Qwen3ForCausalLM`` with eager attention (its linears may
            be FP8 modules; they are called as modules).
        max_positions: size of the rotary table (positions ``0 .. max_positions - 1``).
    """

    def __init__(self, model: torch.nn.Module, max_positions: int) -> None:
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
        if problems:
            raise ValueError("LeanQwen3 reproduces transformers' eager Qwen3 forward only: "
                             + "; ".join(problems) + ". Call the model itself instead")
        self.model = model
        attn = model.model.layers[0].self_attn
        self.head_dim, self.groups, self.scaling = attn.head_dim, attn.num_key_value_groups, attn.scaling
        self.kv_heads = cfg.num_key_value_heads
        # the modules' forward functions and norm weights, looked up once per instance (an
        # instance lives for one forward or one rollout; FP8 conversion happens before)
        self.layers = [_Layer(layer) for layer in model.model.layers]
        self.embed = _fwd(model.model.embed_tokens)
        self.final_norm = (model.model.norm.weight, model.model.norm.variance_epsilon)
        self.lm_head = _fwd(model.lm_head)
        rot = model.model.rotary_emb
        inv_freq = rot.inv_freq
        pos = torch.arange(max_positions, device=inv_freq.device)
        # transformers' Qwen3RotaryEmbedding.forward, for every position at once
        freqs = pos[..., None].float() * inv_freq.to(dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table = emb.cos() * rot.attention_scaling  # [max_positions, head_dim]
        self.sin_table = emb.sin() * rot.attention_scaling

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        w = self.model.lm_head.weight
        return KVCache(len(self.layers), batch, self.kv_heads, capacity, self.head_dim, dtype=w.dtype,
                       device=w.device)

    @staticmethod
    def _rms(norm: tuple[torch.Tensor, float], x: torch.Tensor) -> torch.Tensor:
        """``Qwen3RMSNorm.forward`` (``norm``: its weight and epsilon)."""
        weight, eps = norm
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + eps)
        return weight * h.to(dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` (``apply_rotary_pos_emb`` for one tensor)."""
        half = x.shape[-1] // 2
        return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)

    def __call__(self, input_ids: torch.Tensor, bias: torch.Tensor, position_ids: torch.Tensor,
                 cache: KVCache | None = None) -> torch.Tensor:
        """Logits ``[B, L, V]``.

        Args:
            input_ids: ``[B, L]`` tokens (with a cache: the next ``L`` tokens of every row).
            bias: ``[B, 1, L, S]`` additive mask over the ``S`` keys (cached + new):
                :func:`causal_bias` / a prefix of :func:`decode_bias`.
            position_ids: ``[B, L]`` rotary positions.
            cache: optional :class:`KVCache`; the new keys/values are appended.
        """
        x = self.embed(input_ids)
        cos = self.cos_table[position_ids].to(dtype=x.dtype)[:, None]  # [B, 1, L, d]
        sin = self.sin_table[position_ids].to(dtype=x.dtype)[:, None]
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
            kh, s = k.shape[1], k.shape[2]
            if g > 1:  # repeat_kv
                k = k[:, :, None, :, :].expand(b, kh, g, s, hd).reshape(b, kh * g, s, hd)
                v = v[:, :, None, :, :].expand(b, kh, g, s, hd).reshape(b, kh * g, s, hd)
            w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
            w = w + bias
            w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.matmul(w, v).transpose(1, 2).contiguous()
            x = residual + ly.o_proj(o.reshape(b, n, -1).contiguous())
            residual = x
            h = self._rms(ly.post_norm, x)
            x = residual + ly.down_proj(ly.act(ly.gate_proj(h)) * ly.up_proj(h))
        if cache is not None:
            cache.advance(n)
        return self.lm_head(self._rms(self.final_norm, x))


def _fwd(module: torch.nn.Module):
    """``module.forward`` when calling the module would add nothing (no hooks of any kind),
    else the module itself: the same computation without ``nn.Module.__call__``'s bookkeeping.
    An instance-level ``forward`` (``fp8_disabled``'s switch) is what ``module.forward`` finds."""
    from torch.nn.modules import module as torch_module

    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
             module._backward_pre_hooks, torch_module._global_forward_hooks,
             torch_module._global_forward_pre_hooks, torch_module._global_backward_hooks,
             torch_module._global_backward_pre_hooks)
    return module if any(hooks) else module.forward


class _Layer:
    """One decoder layer's forward functions and norm parameters."""

    __slots__ = ("act", "down_proj", "gate_proj", "input_norm", "k_norm", "k_proj", "o_proj", "post_norm",
                 "q_norm", "q_proj", "up_proj", "v_proj")

    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp

        def norm(m: torch.nn.Module) -> tuple[torch.Tensor, float]:
            return m.weight, m.variance_epsilon

        self.input_norm, self.post_norm = norm(layer.input_layernorm), norm(layer.post_attention_layernorm)
        self.q_norm, self.k_norm = norm(attn.q_norm), norm(attn.k_norm)
        self.q_proj, self.k_proj = _fwd(attn.q_proj), _fwd(attn.k_proj)
        self.v_proj, self.o_proj = _fwd(attn.v_proj), _fwd(attn.o_proj)
        self.gate_proj, self.up_proj, self.down_proj = _fwd(mlp.gate_proj), _fwd(mlp.up_proj), _fwd(mlp.down_proj)
        self.act = _fwd(mlp.act_fn)
