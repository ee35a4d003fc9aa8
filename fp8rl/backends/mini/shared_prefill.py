"""Prompts that repeat in a batch are prefilled once: the same numbers, a fraction of the work.

A GRPO batch samples ``n`` completions of each prompt (a training rollout: 16 prompts x 8; an
evaluation: 512 problems x 4), and the engine's prefill computed every row: 8 (or 4) times
the same keys, values and last logits per prompt. vLLM prefills a parallel-sampling request
once and forks its KV cache; the mini engine now does too, **without changing a number**:

- the prefill runs on one row per distinct prompt (``torch.unique`` over ids and mask, each
  prompt's first row), repeated cyclically up to a multiple of
  :data:`~fp8rl.backends.mini.live_rows.ROW_GRANULE` rows, for the same reason as live rows:
  an elementwise kernel handles the last ``numel mod vector width`` elements in scalar code,
  and a GEMM may take another path for a handful of rows; then every batch row gets its
  prompt's keys and values (``KVCache.keep_rows``) and last logits;
- every operation of the prefill is row-local (norms, rotary embedding, attention, per-row or
  per-block activation scales), or, for a per-tensor activation scale (``tensorwise``), an
  amax over rows: the distinct prompts hold every value the whole batch holds, so it is the
  same maximum;
- **checked, not assumed**: the first time a batch shape is met (batch rows, prefill rows,
  prompt length) for an engine's kind (its model dimensions, compute dtype, attention, and the
  class and recipe of every linear layer), the engine also prefills the whole batch, and the
  shared prefill is used, for that shape and every later one like it in the process, only if
  the last logits and every key and value are bit-for-bit the whole batch's; otherwise that
  shape is prefilled whole from then on. The verdict is per process (the worker of a sweep
  runs many cells, each with new engines of the same kinds), since what could make the two
  differ is which kernels run, which the shapes, dtypes and layer kinds decide, not the weights;
- one torch thread only (a kernel on several threads splits its work by the batch size), and
  only batches that are themselves a multiple of the granule, as for live rows.

``ENABLED = False`` prefills every row (for comparisons). Tested against the whole prefill for
every rollout recipe, by counting the rows prefilled, and with a planted difference
(``tests/mini/test_mini_shared_prefill.py``); whole runs by the golden numbers.
"""

from __future__ import annotations

import torch

from fp8rl.backends.mini.live_rows import ROW_GRANULE

#: ``False``: every row is prefilled, as before (for comparisons)
ENABLED = True

#: (engine kind, batch rows, prefill rows, prompt length) -> whether the shared prefill gave the
#: whole batch's bits when it was checked
VERDICTS: dict[tuple, bool] = {}


def plan(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rows [M], inverse [B])`` or ``None`` (prefill every row).

    ``rows``: the batch rows to prefill, the first row of each distinct prompt (ids and mask),
    in order of first appearance, repeated cyclically to ``M``, the least multiple of
    ``ROW_GRANULE`` that holds them; ``inverse``: for each batch row, the position in ``rows``
    of its prompt's row. ``None`` unless ``M < B``, ``B`` is a multiple of the granule and torch
    runs one thread.
    """
    b = prompt_ids.shape[0]
    if not ENABLED or b % ROW_GRANULE or b <= ROW_GRANULE or torch.get_num_threads() != 1:
        return None
    keys = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)  # [B]: sorted-unique index
    n = int(inverse.max()) + 1
    m = -(-n // ROW_GRANULE) * ROW_GRANULE
    if m >= b:
        return None
    first = torch.full((n,), b, dtype=torch.long).scatter_reduce_(0, inverse, torch.arange(b), "amin")
    order = torch.argsort(first)  # distinct prompts in order of first appearance
    position = torch.empty(n, dtype=torch.long)
    position[order] = torch.arange(n)
    rows = first[order][torch.arange(m) % n]
    return rows, position[inverse]


def engine_kind(lean) -> tuple:
    """What decides which kernels a ``LeanQwen3`` prefill runs, besides the shapes: the model's
    dimensions, the compute dtype, the attention path and each linear layer's class and recipe."""
    cfg = lean.model.config
    layers = tuple((type(m).__qualname__, getattr(getattr(m, "recipe", None), "name", None))
                   for m, _ in lean.linear_layers())
    return (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
            cfg.num_attention_heads, cfg.num_key_value_heads, lean.dtype, lean.fused, layers)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (``-0.0`` is not ``0.0``; a NaN equals the same NaN)."""
    if a.dtype.is_floating_point:
        a, b = a.contiguous(), b.contiguous()
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.view(view), b.view(view))
    return torch.equal(a, b)


def prefill(lean, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, capacity: int, bias: torch.Tensor,
            positions: torch.Tensor):
    """The decode loop's prefill: ``(last logits [B, V], KVCache for B rows)``, each prompt
    prefilled once where that was checked to give the same bits (module docstring).

    Args:
        lean: the engine's ``LeanQwen3``; capacity: the cache's positions.
        bias, positions: ``causal_bias(prompt_mask)`` ``[B, 1, P, P]`` and the prompt's
            position ids ``[B, P]`` (the whole batch's).
    """

    def whole():
        cache = lean.new_cache(prompt_ids.shape[0], capacity)
        return lean(prompt_ids, bias, positions, cache)[:, -1, :], cache

    p = plan(prompt_ids, prompt_mask)
    if p is None:
        return whole()
    rows, inverse = p
    key = (engine_kind(lean), prompt_ids.shape[0], rows.numel(), prompt_ids.shape[1])
    verdict = VERDICTS.get(key)
    if verdict is False:
        return whole()
    cache = lean.new_cache(rows.numel(), capacity)
    last = lean(prompt_ids.index_select(0, rows), bias.index_select(0, rows), positions.index_select(0, rows),
                cache)[:, -1, :]
    cache.keep_rows(inverse)
    last = last.index_select(0, inverse)
    if verdict is None:  # the first batch of this shape: checked against the whole prefill
        full_last, full_cache = whole()
        n = cache.length
        verdict = VERDICTS[key] = _same(last, full_last) and all(
            _same(a.narrow(2, 0, n), b.narrow(2, 0, n)) for a, b in zip(cache.k + cache.v, full_cache.k + full_cache.v,
                                                                      strict=True))
        if not verdict:
            return full_last, full_cache
    return last, cache
