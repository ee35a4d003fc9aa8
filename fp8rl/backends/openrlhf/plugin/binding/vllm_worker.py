"""The binding in the vLLM workers: ``Fp8WorkerWrap``, upstream's ``WorkerWrap`` with the weight
sync through vLLM's layer-wise reload (``plugin.vllm_sync``).

FP8 engines (``quantization=fp8_per_*``) take every sync through the layer-wise reload. On a CPU
job the extension is also installed into BF16 engines (``fp8_rollout.rollout_engine_kwargs``):
upstream's ``update_weight`` allocates the received tensor on ``"cuda"``; ours allocates on the
engine's device (``worker.device``) and, for an unquantized engine, loads it the way upstream
does (``model.load_weights``, one tensor at a time).

After the last tensor of a sync the extension appends one line to the sync log
(``FP8RL_SYNC_LOG``, set by the driver to ``<run>/openrlhf/engine_syncs.jsonl``): the engine's
parameter dtypes and a digest of every parameter, so that the run directory shows which
weights each engine held after each sync (FP8 or BF16, changed or not) -- the tests of the
smoke job read it (``tests/integration/test_int_paper_smoke.py``).

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

        def _fp8rl_load(self, name, weight, last):
            if self.vllm_config.quant_config is None:  # a BF16 engine: upstream's route
                self.model_runner.model.load_weights(weights=[(name, weight)])
            else:
                self._fp8rl_sync().load(name, weight, last=last)
            if last:
                _log_sync(self)

        def update_weight(self, name, dtype, shape, empty_cache=False):
            if dtype != self.model_config.dtype:
                raise ValueError(f"weight sync dtype {dtype} != the engine's {self.model_config.dtype}")
            weight = torch.empty(shape, dtype=dtype, device=self.device)
            if self._model_update_with_ray:
                import ray.util.collective as collective

                collective.broadcast(weight, 0, group_name=self._model_update_group)
            else:
                self._model_update_group.broadcast(weight, src=0, stream=torch.cuda.current_stream())
            self._fp8rl_load(name, weight, bool(empty_cache))

        def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles=None, empty_cache=False):
            from openrlhf.trainer.ray.utils import get_physical_gpu_id

            from fp8rl.backends.openrlhf.plugin.binding.cpu_sync import CPU_PAYLOAD, from_bytes

            if dtype != self.model_config.dtype:
                raise ValueError(f"weight sync dtype {dtype} != the engine's {self.model_config.dtype}")
            if isinstance(ipc_handles, dict) and CPU_PAYLOAD in ipc_handles:  # a CPU job (binding.cpu_sync)
                weight = from_bytes(ipc_handles[CPU_PAYLOAD], dtype, shape).to(self.device)
                self._fp8rl_load(name, weight, bool(empty_cache))
                return
            func, args = ipc_handles[get_physical_gpu_id()]
            list_args = list(args)
            list_args[6] = self.device.index
            # a copy: the layer-wise reload may buffer it until its layer is complete, after the
            # trainer has dropped the tensor the IPC handle points at
            self._fp8rl_load(name, func(*list_args).clone(), bool(empty_cache))
            torch.cuda.synchronize()

    # vLLM (and pickle) find it as `fp8rl.backends.openrlhf.plugin.binding.Fp8WorkerWrap`
    Fp8WorkerWrap.__module__, Fp8WorkerWrap.__qualname__ = "fp8rl.backends.openrlhf.plugin.binding", "Fp8WorkerWrap"
    return Fp8WorkerWrap


#: Environment variable naming the sync log (JSON lines; set by the driver for the engines).
SYNC_LOG_ENV = "FP8RL_SYNC_LOG"


def engine_weights(model: torch.nn.Module) -> dict:
    """``{"dtypes": {dtype: count}, "linear_dtypes": {...}, "digest": {name: sha256}}`` of an engine's
    parameters (``linear_dtypes``: the weights of layers that have a ``quant_method``)."""
    import hashlib

    dtypes: dict[str, int] = {}
    linear: dict[str, int] = {}
    digest = {}
    for n, p in model.named_parameters():
        d = str(p.dtype).replace("torch.", "")
        dtypes[d] = dtypes.get(d, 0) + 1
        t = p.detach().cpu().contiguous().reshape(-1)
        digest[n] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    for _, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if getattr(mod, "quant_method", None) is not None and isinstance(w, torch.Tensor) and w.dim() == 2:
            d = str(w.dtype).replace("torch.", "")
            linear[d] = linear.get(d, 0) + 1
    return {"dtypes": dtypes, "linear_dtypes": linear, "digest": digest}


def _log_sync(worker) -> None:
    """Append the engine's weights after a sync to the sync log (nothing without ``FP8RL_SYNC_LOG``)."""
    import json
    import os
    import time

    path = os.environ.get(SYNC_LOG_ENV)
    if not path:
        return
    worker._fp8rl_syncs = getattr(worker, "_fp8rl_syncs", 0) + 1
    rec = {"pid": os.getpid(), "sync": worker._fp8rl_syncs, "time": time.time(),
           "quantization": getattr(worker.vllm_config.model_config, "quantization", None),
           **engine_weights(worker.model_runner.model)}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
