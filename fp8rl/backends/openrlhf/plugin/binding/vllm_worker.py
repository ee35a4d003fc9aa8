"""The binding in the vLLM workers: ``Fp8WorkerWrap``, upstream's ``WorkerWrap`` with the weight
sync through vLLM's layer-wise reload (``plugin.vllm_sync``).

Built on first access (``binding.Fp8WorkerWrap``): upstream's module imports vLLM through its
package, which exists only where the engines run."""

from __future__ import annotations

import torch

from fp8rl.backends.openrlhf.plugin.binding.common import _check_params

_CLASS: list[type] = []


def fp8_worker_wrap() -> type:
    """The extension class (built once per process)."""
    if not _CLASS:
        _CLASS.append(_make_fp8_worker_wrap())
    return _CLASS[0]


def _make_fp8_worker_wrap() -> type:
    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

    _check_params(WorkerWrap.update_weight, ("self", "name", "dtype", "shape", "empty_cache"),
                  "WorkerWrap.update_weight")
    _check_params(WorkerWrap.update_weight_cuda_ipc, ("self", "name", "dtype", "shape", "ipc_handles",
                                                      "empty_cache"), "WorkerWrap.update_weight_cuda_ipc")

    class Fp8WorkerWrap(WorkerWrap):
        """Upstream's ``WorkerWrap`` whose weight sync goes through vLLM's layer-wise reload.

        Receives each BF16 tensor exactly as upstream does (broadcast or CUDA IPC) and hands it to
        ``vllm_sync.LayerwiseSync``; ``empty_cache=True`` marks the last tensor of a sync.
        """

        def _fp8rl_sync(self):
            sync = getattr(self, "_fp8rl_layerwise", None)
            if sync is None:
                from fp8rl.backends.openrlhf.plugin.spec import check_vllm_version
                from fp8rl.backends.openrlhf.plugin.vllm_sync import LayerwiseSync

                check_vllm_version()
                sync = self._fp8rl_layerwise = LayerwiseSync(self.model_runner.get_model, self.vllm_config)
            return sync

        def update_weight(self, name, dtype, shape, empty_cache=False):
            if dtype != self.model_config.dtype:
                raise ValueError(f"weight sync dtype {dtype} != the engine's {self.model_config.dtype}")
            weight = torch.empty(shape, dtype=dtype, device="cuda")
            if self._model_update_with_ray:
                import ray.util.collective as collective

                collective.broadcast(weight, 0, group_name=self._model_update_group)
            else:
                self._model_update_group.broadcast(weight, src=0, stream=torch.cuda.current_stream())
            self._fp8rl_sync().load(name, weight, last=bool(empty_cache))

        def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles=None, empty_cache=False):
            from openrlhf.trainer.ray.utils import get_physical_gpu_id

            if dtype != self.model_config.dtype:
                raise ValueError(f"weight sync dtype {dtype} != the engine's {self.model_config.dtype}")
            func, args = ipc_handles[get_physical_gpu_id()]
            list_args = list(args)
            list_args[6] = self.device.index
            # a copy: the layer-wise reload may buffer it until its layer is complete, after the
            # trainer has dropped the tensor the IPC handle points at
            self._fp8rl_sync().load(name, func(*list_args).clone(), last=bool(empty_cache))
            torch.cuda.synchronize()

    # vLLM (and pickle) find it as `fp8rl.backends.openrlhf.plugin.binding.Fp8WorkerWrap`
    Fp8WorkerWrap.__module__, Fp8WorkerWrap.__qualname__ = "fp8rl.backends.openrlhf.plugin.binding", "Fp8WorkerWrap"
    return Fp8WorkerWrap
