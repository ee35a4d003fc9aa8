"""Finished rows leave the decode batch: the engine computes only the rows still generating.

The rollout engine decodes a batch until its longest completion ends. Until now every row was
computed at every step, a finished row decoding ``<pad>`` (its token and log-prob are then
overwritten): in the mini main table about a quarter of the decoded rows were finished ones
(24% of a training rollout's 128 rows, 30% of an evaluation's 2,048). vLLM drops a finished
sequence from its running batch; the mini engine now does too, **without changing a number**:

- **sampling still sees the whole batch.** ``torch.multinomial`` draws from the generator per
  element of its ``[B, V]`` input (one exponential each, whatever the probabilities), so the
  engine keeps a ``[B, V]`` logits buffer in which a finished row holds its last logits: the
  random stream, and so every live row's sample, is what it was;
- **a row's numbers do not depend on the other rows** in the engine's forward: norms, rotary
  embedding, the KV cache and the fused attention work row by row, and an FP8 layer's
  activation scales must be row-local (per row, ``1 x 128`` blocks, MX ``1 x 32``: the block
  has one row). A per-tensor activation scale (``tensorwise``) is the amax of the whole batch,
  finished rows included, so those engines keep every row (what they computed stays as it was;
  vLLM's scale would cover the running sequences only: a deviation we keep, the published
  tensorwise runs were made with it);
- **the GEMM kernels give a row the same bits at every row count the engine uses.** CPU BLAS
  kernels take special paths for a few rows (MKL on an AVX2 EPYC: 1-3 rows differ from the
  same rows inside a larger product), and elementwise kernels treat the last
  ``numel mod vector width`` elements in scalar code. So the engine computes a multiple of
  :data:`ROW_GRANULE` rows (finished rows fill up the last granule; never fewer than one
  granule), only for batches that are themselves a multiple of it, and
  :func:`rows_independent` checks the engine's own layer forwards at such row counts on this
  machine (once per layer and batch size, a planted outlier row left out of every subset):
  where any differs, nothing is dropped;
- **one thread.** Kernels that run on several threads split the batch among them by its size
  (the CPU flash attention does: at 2 threads a row's output inside 64 rows differs from the
  same row inside 128), so only an engine on one torch thread drops rows. The mini runs
  have one thread per cell (``mini.num_threads: 1``, the launcher's workers).
- the KV cache, the mask row and the rotary slices of the kept rows are gathered when the live
  rows fit in one granule fewer (:meth:`LiveRows.update`), not at every finished row: at most
  ``B / 32`` gathers per batch, each a copy of the cache.

``tests/mini/test_mini_live_rows.py`` checks the tokens, log-probs and masks against decoding
every row, for every rollout recipe; ``tests/mini/test_mini_golden_proc.py`` checks whole cells.
"""

from __future__ import annotations

import weakref

import torch

#: rows are computed in multiples of this (and only for batches that are a multiple of it):
#: 2 x 16 float32 lanes, the chunk of PyTorch's AVX-512 elementwise loops (8 lanes with AVX2)
ROW_GRANULE = 32

#: ``False``: every engine computes every row to the end, as before (for comparisons)
ENABLED = True


class LiveRows:
    """The batch rows a decode step computes: all ``B`` at first, fewer once rows finish.

    ``rows`` is ``None`` (every row) or the sorted ``[M]`` indices into the batch; ``M`` is a
    multiple of :data:`ROW_GRANULE`.
    """

    def __init__(self, batch: int, enabled: bool) -> None:
        self.batch = batch
        self.enabled = enabled and self.eligible(batch)
        self.rows: torch.Tensor | None = None

    @staticmethod
    def eligible(batch: int) -> bool:
        """Whether a batch of this size may shrink at all (before any kernel is probed): whole
        granules, more than one, and one torch thread."""
        return ENABLED and batch % ROW_GRANULE == 0 and batch > ROW_GRANULE and torch.get_num_threads() == 1

    @property
    def count(self) -> int:
        return self.batch if self.rows is None else int(self.rows.numel())

    def update(self, done: torch.Tensor) -> torch.Tensor | None:
        """After a step with ``done`` ``[B]``: the positions (within the rows computed so far) of
        the rows to compute from now on, or ``None`` to keep them all.

        Shrinks as soon as the live rows fit in fewer granules than are computed; finished rows
        fill the last granule, taken in batch order.
        """
        if not self.enabled:
            return None
        current = torch.arange(self.batch, device=done.device) if self.rows is None else self.rows
        live = ~done.index_select(0, current)  # [M] over the current rows
        n_live = int(live.sum())
        keep = max(ROW_GRANULE, -(-n_live // ROW_GRANULE) * ROW_GRANULE)
        if keep >= current.numel():
            return None
        sel = live.nonzero().squeeze(1)
        if keep > n_live:  # fill the last granule with finished rows
            sel = torch.cat([sel, (~live).nonzero().squeeze(1)[: keep - n_live]]).sort().values
        self.rows = current.index_select(0, sel)
        return sel


#: layer module -> {(compute dtype, batch): every probe gave equal rows} (a module's forward is
#: fixed by the module and the dtype; weak keys: an engine's layers go with the engine)
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.inference_mode()
def rows_independent(layers: list[tuple[torch.nn.Module, object]], batch: int, dtype: torch.dtype) -> bool:
    """Whether every layer forward gives each row the same bits inside any multiple of
    :data:`ROW_GRANULE` rows up to ``batch`` as inside the whole batch.

    Args:
        layers: ``(module, forward)``: the engine's linear layers and the functions its
            forward calls for them (``qwen3._fwd``'s choice).
        batch: the decode batch size; dtype: the compute dtype.

    Checked on random inputs with one planted large row (row 0) that the subsets leave out, so
    a scale shared across rows (per-tensor) shows as a difference. Cached per layer module,
    dtype and batch size.
    """
    counts = sorted({m for m in (ROW_GRANULE, 2 * ROW_GRANULE, 3 * ROW_GRANULE, batch // 2, batch - ROW_GRANULE)
                     if ROW_GRANULE <= m < batch and m % ROW_GRANULE == 0})
    for module, forward in layers:
        seen = _PROBED.setdefault(module, {})
        if (dtype, batch) not in seen:
            seen[(dtype, batch)] = _probe(forward, module.in_features, batch, counts, dtype, module.weight.device)
        if not seen[(dtype, batch)]:
            return False
    return True


def _probe(forward, in_features: int, batch: int, counts: list[int], dtype: torch.dtype,
           device: torch.device) -> bool:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, 1, in_features, generator=g).to(device=device, dtype=dtype)
    x[0] *= 64  # the outlier row: a per-tensor scale follows it
    full = forward(x)
    for m in counts:
        idx = torch.randperm(batch - 1, generator=g)[: m].sort().values.to(device) + 1
        if not torch.equal(forward(x.index_select(0, idx)), full.index_select(0, idx)):
            return False
    return True
