"""CPU stand-ins for the CUDA runtime calls on OpenRLHF's actor path (integration tier only).

OpenRLHF 0.11.2 calls ``torch.cuda`` directly where it assumes a GPU; DeepSpeed itself runs on
its CPU accelerator (``DS_ACCELERATOR=cpu``, gloo). Only torch's CUDA entry points are replaced,
never OpenRLHF, DeepSpeed or fp8rl code:

- ``torch.cuda.current_device()`` returns a value that formats as ``0`` (so
  ``NaiveReplayBuffer.__init__``'s ``torch.device(f"cuda:{...}")`` builds) and that ``.to()`` reads
  as ``"cpu"`` (so ``ppo_train``'s ``experience.to_device(...)`` and the strategy's all-reduce
  stay on the CPU);
- ``torch.cuda.synchronize`` / ``set_device`` do nothing (``torch_dist_barrier_and_cuda_sync``,
  ``setup_distributed``);
- ``init_device_mesh("cuda", ...)`` builds the same mesh on ``"cpu"`` (``setup_distributed``).
"""

from __future__ import annotations


class _CpuDevice(str):
    def __format__(self, spec: str) -> str:
        return "0"


def apply() -> None:
    import torch
    import torch.distributed.device_mesh as device_mesh

    if getattr(torch.cuda, "_fp8rl_cpu_stand_in", False):
        return
    torch.cuda.current_device = lambda: _CpuDevice("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None
    orig = device_mesh.init_device_mesh

    def init_device_mesh(device_type, *args, **kwargs):
        return orig("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    device_mesh.init_device_mesh = init_device_mesh
    torch.cuda._fp8rl_cpu_stand_in = True
