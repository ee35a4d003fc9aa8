"""The weight sync of a CPU job (``PluginSpec.device == "cpu"``): trainer tensors to the engines
through Ray, not through a collective.

On GPUs OpenRLHF syncs weights by NCCL broadcast (a process group of DeepSpeed rank 0 and every
vLLM worker) or, colocated, by CUDA IPC handles. Neither exists on a CPU machine, and its
Ray-collective route (``--vllm.sync_with_ray``, gloo) cannot reach the engine's worker: vLLM 0.29
runs the worker in a process of its own that is no Ray actor, and ``ray.util.collective``
refuses to run outside one (seen on the CPU job). So on CPU the binding replaces
``ActorPPOTrainer._init_vllm_sync_group`` by nothing and ``ActorPPOTrainer.broadcast_to_vllm``
by :func:`broadcast_to_vllm`, which walks the same parameters in the same order as upstream
(ZeRO-3 gathered one at a time, ``empty_cache`` on the last) and hands each tensor to every
engine through the one engine method that carries an arbitrary payload to the worker:
``RolloutRayActor.update_weight_cuda_ipc(name, dtype, shape, ipc_handles, empty_cache)``
(forwarded by vLLM's ``collective_rpc``; OpenRLHF sets ``VLLM_ALLOW_INSECURE_SERIALIZATION``).
The payload is ``{CPU_PAYLOAD: raw bytes}`` (vLLM's RPC serializer turns a tensor nested in an
argument into a list; bytes pass as they are); the plugin's worker extension
(``vllm_worker.Fp8WorkerWrap.update_weight_cuda_ipc``) recognises it and loads the tensor through
the same route as any other sync (layer-wise reload for FP8 engines). The tensors cross two
process boundaries by value: fine for the smoke job's tiny model, never used on GPUs.
"""

from __future__ import annotations

#: Key of the tensor in the ``ipc_handles`` payload of a CPU weight sync.
CPU_PAYLOAD = "fp8rl_cpu_tensor"


def init_vllm_sync_group(self, backend: str) -> None:
    """No process group on CPU: :func:`broadcast_to_vllm` sends through Ray."""
    self._fp8rl_cpu_sync = True


def broadcast_to_vllm(self) -> None:
    """Upstream's parameter walk; each gathered tensor goes to every engine by value (rank 0)."""
    import deepspeed
    import ray
    import torch.distributed as dist

    model = self.actor.model.module
    args = self.strategy.args
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad or not getattr(self.actor, "is_vlm", False)]
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    for count, (name, param) in enumerate(params, start=1):
        with deepspeed.zero.GatheredParameters([param], enabled=args.ds.zero_stage == 3):
            if rank0:
                shape = param.shape if args.ds.zero_stage != 3 else param.ds_shape
                payload = {CPU_PAYLOAD: to_bytes(param.data)}
                ray.get([engine.update_weight_cuda_ipc.remote(name, dtype=param.dtype, shape=shape,
                                                              ipc_handles=payload, empty_cache=count == len(params))
                         for engine in self.vllm_engines])
    if dist.is_initialized():
        dist.barrier()


def to_bytes(t) -> bytes:
    """A tensor's raw bytes (C order; dtype and shape travel beside them)."""
    import torch

    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def from_bytes(data: bytes, dtype, shape):
    """The tensor :func:`to_bytes` made, given its dtype and shape."""
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(tuple(shape))
