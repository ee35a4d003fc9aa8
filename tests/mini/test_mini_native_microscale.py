"""Whole FP4 / FP6 runs with the native microscaled kernel (``native.microscaled``) log exactly the
numbers of the same runs on the PyTorch code (``native.disabled()``): NVFP4's recipe (1 x 16
blocks, 16 x 16 weight tiles, stochastically rounded gradients, the wgrad RHT) and MXFP6's
(E2M3, E3M2 gradients), FP4/FP6 rollout engine and trainer, Calibrated Clipping's BF16 shadow
and the BF16 evaluations, every logged value but wall times. So the kernel changes what a cell
costs, never what it computes: published FP4 / FP6 runs replay (the surge_dose cells were run
on the PyTorch code). The kernel-level comparison, edge by edge, is
``tests/quant/test_quant_native_microscale.py``.
"""

from __future__ import annotations

import pytest
from tiny_cells import cell_numbers, first_difference, tiny_config

from fp8rl.quant import native

pytestmark = pytest.mark.skipif(not native.enabled(), reason=f"native kernels {native.status()}")


@pytest.mark.parametrize(("arm", "clip"), [("nvfp4", "calibrated"), ("mxfp6", "tis")])
def test_a_run_logs_the_same_numbers_with_and_without_the_kernel(sft_cache, tmp_path, arm, clip):
    def numbers(sub: str) -> tuple[dict, int]:
        cfg = tiny_config(sft_cache, tmp_path / sub, arm, clip, steps=3, eval_every=3, samples_every=0)
        before = native.calls["mq_full"]
        got = cell_numbers(cfg)
        return got, native.calls["mq_full"] - before

    on, on_calls = numbers("on")
    with native.disabled():
        off, off_calls = numbers("off")
    assert on_calls > 100 and off_calls == 0  # what computed them: the kernel, then the PyTorch code
    assert len(on["metrics"]) == 3 and on["eval"]
    diff = first_difference(off, on)
    assert diff is None, f"{arm}: the native kernel changed a logged number: {diff}"
