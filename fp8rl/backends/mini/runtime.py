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


@contextlib.contextmanager
def torch_settings(deterministic: bool, num_threads: int, device: str = "cpu") -> Iterator[None]:
    """Deterministic algorithms and a thread count for the duration of a run, then restored.

    In deterministic mode torch also fills every freshly allocated tensor (``torch.empty``,
    ``empty_like``, the buffer of ``clone``/``contiguous``) with NaN
    (``torch.utils.deterministic.fill_uninitialized_memory``), a debugging aid that makes a read
    of never-written memory visible. The mini backend reads no such memory (its KV cache reads
    only written positions), so the fill changes no number, and at mini scale it costs a few
    percent of a step (thousands of small fills per step): it is off for the run. The
    algorithms stay deterministic. ``tests/mini/test_mini_golden.py`` checks that logged numbers
    are unchanged.

    On CUDA, deterministic cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` set before the process
    starts; we check it and raise naming the fix rather than set it behind the user's back.
    """
    import os

    quiet_import_noise()

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
