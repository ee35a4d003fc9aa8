"""Which GEMM kernels a piece of training ran, counted at the dispatcher (diagnostic dumps only).

With ``PluginSpec.dump_dir`` set (the CPU smoke job), the actor binding counts the matrix
multiplications of every training step and of every BF16 shadow forward and writes them beside
the loss dumps (``kernels-rank<R>-step<S>.json``). The count is taken by a
``TorchDispatchMode``: every ``aten`` matmul that reaches the dispatcher is recorded with its
input dtypes, so an FP8 linear that dequantizes and multiplies in BF16 shows up as BF16 ``mm``
calls and no ``_scaled_mm``, and a shadow pass that computes in FP8 shows ``_scaled_mm`` calls.
What this proves is what *ran*, not what was built: the tests of the smoke job read it
(``tests/integration/test_int_paper_smoke.py``).

Counted ops: ``_scaled_mm`` (FP8 GEMMs, torchao's and ours), ``mm``, ``addmm``, ``bmm``,
``baddbmm`` (keyed ``<op>:<kind of the first operand>``, the kind a dtype or a tensor subclass);
attention's matmuls are ``bmm`` on activations and counted too (they stay BF16 in every recipe).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from contextlib import contextmanager

_OPS = ("_scaled_mm", "mm", "addmm", "bmm", "baddbmm")


def _kind(t) -> str:
    """A matmul operand's kind: its dtype, or the tensor subclass's name (torchao's FP8 tensors
    report the high-precision dtype; the GEMM they run is the ``_scaled_mm`` inside)."""
    import torch

    if type(t) is not torch.Tensor and type(t).__name__ != "Parameter":
        return type(t).__name__
    return str(t.dtype).replace("torch.", "")


@contextmanager
def count_matmuls(counter: Counter):
    """Count the matmul ops that run inside the block into ``counter`` (``"mm:bfloat16": 12``).

    Two probes: a ``TorchDispatchMode`` sees every ``aten`` matmul that reaches the dispatcher
    (an FP8 tensor subclass's ``mm`` is keyed by the subclass); ``torch._scaled_mm`` is also
    counted where Python calls it (a subclass's own dispatch runs with the mode suspended, so the
    mode alone would miss the FP8 GEMM it issues), keyed ``_scaled_mm:<operand dtype>``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in _OPS and name != "_scaled_mm":
                operands = [a for a in args if isinstance(a, torch.Tensor)]
                if name in ("addmm", "baddbmm") and len(operands) > 1:
                    operands = operands[1:]
                counter[f"{name}:{_kind(operands[0]) if operands else '?'}"] += 1
            return func(*args, **(kwargs or {}))

    orig = torch._scaled_mm

    def _scaled_mm(a, b, *args, **kwargs):
        counter[f"_scaled_mm:{_kind(a)}"] += 1
        return orig(a, b, *args, **kwargs)

    torch._scaled_mm = _scaled_mm
    try:
        with _Count():
            yield counter
    finally:
        torch._scaled_mm = orig


def write_counts(directory: str, rank: int, step: int, counts: dict[str, dict]) -> None:
    """``<directory>/kernels-rank<R>-step<S>.json``: ``{phase: {op:dtype: count}}`` for the phases
    ``train`` and ``shadow``; beside them the actor binding's ``rows`` (samples per kind of no-grad
    forward: ``shadow``, ``fp8_prepass``) and ``plan`` (the step's row ids: ``eligible``,
    ``measured``, ``shadowed``; ``n`` rows on ``rank``)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"kernels-rank{rank}-step{step}.json"), "w", encoding="utf-8") as f:
        json.dump({k: dict(v) for k, v in counts.items()}, f, sort_keys=True)
