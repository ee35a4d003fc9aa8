"""The integration tier's Ray worker setup hooks, each ending in the hook the fp8rl driver configures.

The job runtime env of a scenario is the driver's (``fp8rl.backends.openrlhf.driver
.runtime_env``) with ``worker_process_setup_hook`` pointing here; the driver's own hook moves to
``FP8RL_TEST_HOOK`` (``module.function``) and runs last, unchanged.

:func:`setup` puts in the CPU stand-ins for CUDA (``cpu_cuda.apply``, which imports torch), then
runs the driver's hook and records in :data:`AT_HOOK` what the driver's hook saw and did:
``CUDA_VISIBLE_DEVICES`` at that moment and the modules it imported.
"""

from __future__ import annotations

import importlib
import os

AT_HOOK: dict = {}


def _driver_hook() -> None:
    module, func = os.environ["FP8RL_TEST_HOOK"].rsplit(".", 1)
    getattr(importlib.import_module(module), func)()


def setup() -> None:
    import sys

    import cpu_cuda

    cpu_cuda.apply()
    before = set(sys.modules)
    AT_HOOK["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    _driver_hook()
    AT_HOOK["imported"] = sorted(set(sys.modules) - before)
