"""Run-time plumbing of the mini backend: seeds, torch settings, the failure type."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator

import torch


class RunFailed(RuntimeError):
    """The run diverged (non-finite values); the message is the reason written to status.json."""


def seed_for(*parts: object) -> int:
    """A 63-bit seed from any parts (stable across processes, unlike ``hash``)."""
    h = hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


def quiet_import_noise() -> None:
    """Silence two third-party log lines that every mini run printed on a CPU machine.

    transformers' model code imports torchao (its quantizer registry); torchao then logs that
    its CUDA kernels (``_C_cutlass_90a``, ``_C_mxfp8``) cannot load, and torch's pytree logs a
    deprecation for two torchao enums. Neither matters to an emulated CPU run; both loggers are
    set to ERROR, nothing else is touched.
    """
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


#: glibc ``mallopt`` parameters (``malloc.h``) and the values :func:`keep_freed_memory` sets.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_ALLOCATOR = {_M_MMAP_THRESHOLD: 32 << 20, _M_TRIM_THRESHOLD: 256 << 20, _M_TOP_PAD: 16 << 20}
_allocator_kept = False


def keep_freed_memory() -> bool:
    """Have glibc's ``malloc`` keep freed memory for reuse instead of returning it to the kernel.

    torch's CPU allocator asks ``malloc`` for every tensor. glibc serves a block above its mmap
    threshold (128 KiB at start, raised as such blocks are freed) with a fresh ``mmap`` and
    unmaps it on free, and it trims the top of its heap when more than twice that is free: so a
    step's large temporaries (a 32-row batch's attention scores are 1.3 MB) come back as new
    pages, faulted in and zeroed by the kernel on every allocation. With blocks up to 32 MiB
    served from the heap, 256 MiB of free heap kept before a trim and 16 MiB of padding per heap
    growth, they are reused (a mini run holds a few hundred MB at most). Numbers do not change
    (the same operations on other addresses: ``tests/mini/test_mini_golden_proc.py``); the step gets
    faster (``docs/benchmarks.md``).

    Process-wide and not undone (glibc has no getter), applied once; a no-op off glibc. Returns
    whether the settings are in force.
    """
    global _allocator_kept
    if _allocator_kept:
        return True
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    _allocator_kept = all(mallopt(param, value) == 1 for param, value in _ALLOCATOR.items())
    return _allocator_kept


@contextlib.contextmanager
def torch_settings(deterministic: bool, num_threads: int, device: str = "cpu") -> Iterator[None]:
    """Deterministic algorithms and a thread count for the duration of a run, then restored.

    In deterministic mode torch also fills every freshly allocated tensor (``torch.empty``,
    ``empty_like``, the buffer of ``clone``/``contiguous``) with NaN
    (``torch.utils.deterministic.fill_uninitialized_memory``), a debugging aid that makes a read
    of never-written memory visible. The mini backend reads no such memory (its KV cache reads
    only written positions), so the fill changes no number, and at mini scale it costs a few
    percent of a step (thousands of small fills per step): it is off for the run. The
    algorithms stay deterministic. ``tests/mini/test_mini_golden_proc.py`` checks that logged numbers
    are unchanged.

    It also calls :func:`keep_freed_memory` (process-wide, not restored).

    On CUDA, deterministic cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` set before the process
    starts; we check it and raise naming the fix rather than set it behind the user's back.
    """
    import os

    quiet_import_noise()
    keep_freed_memory()

    if deterministic and torch.device(device).type == "cuda" and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        raise RuntimeError(
            "mini.deterministic=true on CUDA needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment "
            "(export it before starting), or set mini.deterministic=false")
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_fill = torch.utils.deterministic.fill_uninitialized_memory
    prev_threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = False
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev_det)
        torch.utils.deterministic.fill_uninitialized_memory = prev_fill
        torch.set_num_threads(prev_threads)
