"""CPU stand-ins for the CUDA runtime calls on OpenRLHF's actor path (integration tier only).

The same stand-ins the CPU job uses in production (``openrlhf.device=cpu``):
``fp8rl.backends.openrlhf.plugin.cpu_support.apply_torch_cuda`` -- only torch's CUDA entry points
OpenRLHF calls directly are replaced (``current_device``, ``synchronize``, ``set_device``,
``empty_cache``, ``init_device_mesh("cuda")``), never OpenRLHF, DeepSpeed or fp8rl code. The
tier's scenarios apply them from their worker setup hook (``worker_hook.setup``) because their
plugin specs are GPU specs.
"""

from __future__ import annotations


def apply() -> None:
    from fp8rl.backends.openrlhf.plugin.cpu_support import apply_torch_cuda

    apply_torch_cuda()
