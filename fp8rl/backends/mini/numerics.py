"""The machine's numerics fingerprint: what decides the bits a mini run logs on a CPU.

A mini run is deterministic on one machine (fixed seeds, deterministic algorithms, one thread per
cell), but its bits differ between machines, and RL amplifies the last bit: one flipped sampled
token parts two trajectories. Golden numbers (``tests/mini/test_mini_golden_proc.py``), the shared
step-0 evaluation cache and the report's "published numbers" claim all need to know whether two
machines compute the same bits. Measured on a 2-core AMD EPYC with AVX-512
(``benchmarks/numerics_factors.py``; docs/numerics.md has the table):

- **Decides the bits**: torch's ATen kernel level (``ATEN_CPU_CAPABILITY``: default / AVX2 /
  AVX512 give three different trajectories), and the code path MKL takes for its fp32 GEMMs (every
  mini GEMM is an fp32 GEMM on CPU, BF16 ones included: ``fp8rl/quant/lowp.py``). MKL chooses its
  path by CPU vendor and ISA (its verbose header names it: ``Intel(R) Architecture processors``
  on this AMD CPU, ISA-specific kernels on Intel CPUs), so two "AVX512" machines disagree (the
  AVX-512 golden numbers recorded on a Xeon failed on this EPYC; forcing other MKL paths with
  ``MKL_CBWR`` changes the bits here), while this EPYC with ATen held to AVX2 reproduces the
  numbers of an AVX2-only EPYC bit for bit. torch and transformers versions decide them too.
- **Does not**: oneDNN's ISA (``ONEDNN_MAX_CPU_ISA``; the mini backend runs no oneDNN GEMM), the
  native ``fake_quantize`` kernels on or off (``FP8RL_NATIVE=0``: the same bits by construction,
  ``tests/quant/test_quant_native_proc.py``), the process (every cell twice in fresh processes gives
  identical numbers).
- **Held fixed, not fingerprinted**: the thread count (golden cells and the launcher's workers run
  one thread per cell; more threads split MKL's and ATen's reductions differently).
- **Not varied here** (one machine): glibc's libm, the C compiler of the native kernels (their
  arithmetic is plain IEEE float32 without contraction, so any conforming compiler gives the same
  bits), other MKL builds.

So the fingerprint is measured, not described: :func:`probe_digest` runs the kinds of operation a
mini run uses (fp32 GEMMs at the mini models' widths and row counts in every layout a forward and
backward take, softmax, log-softmax, attention, the elementwise maths of RMSNorm and SwiGLU, the
sampling's cumulative sums, AdamW's update) on fixed inputs, on one thread, and hashes the output
bits. It uses torch alone, never this package's code, so a change of ours cannot change the
fingerprint and turn a golden failure into a skip. Two machines with the same :func:`fingerprint`
key computed the same probe bits; MKL's code path and the CPU are recorded beside it for people.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import tempfile

import torch
import torch.nn.functional as F

__all__ = ["PROBE_VERSION", "fingerprint", "fingerprint_key", "mkl_code_path", "numerics_key", "probe_digest",
           "probe_source_digest"]

#: Bumped whenever :func:`_probe_outputs` changes (recorded golden numbers are keyed by it).
PROBE_VERSION = 1
#: mini widths (8b, 14b, 32b: hidden, intermediate) and row counts (decode rows to a training batch's tokens)
_WIDTHS = ((64, 192), (80, 240), (96, 288))
_ROWS = (1, 2, 3, 5, 8, 16, 31, 64, 200, 833)


def _probe_outputs() -> list[torch.Tensor]:
    """The probe's outputs: fixed inputs through the kinds of kernel a mini run calls."""
    g = torch.Generator().manual_seed(20261206)
    out: list[torch.Tensor] = []

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    for hidden, inter in _WIDTHS:
        w_up = randn(inter, hidden) * hidden ** -0.5
        w_down = randn(hidden, inter) * inter ** -0.5
        for rows in _ROWS:
            x = randn(rows, hidden)
            xb = x.to(torch.bfloat16).float()  # BF16 values through the fp32 GEMM (lowp.linear)
            h = F.linear(x, w_up)  # forward: [rows, hidden] x [inter, hidden]^T
            hb = F.linear(xb, w_up.to(torch.bfloat16).float())
            a = F.silu(h) * h
            y = F.linear(a, w_down)
            dy = randn(rows, hidden)
            out += [h, hb, a, y, dy @ w_down, dy.t() @ a, (dy @ w_down).t().contiguous() @ x]  # dgrad, wgrad
            # RMSNorm's maths
            out.append(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        # attention: [batch, heads, T, head_dim] with a causal mask, fp32 and BF16 inputs
        heads, t = 4, 47
        q, k, v = (randn(3, heads, t, hidden // heads) for _ in range(3))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        bias = torch.zeros(t, t).masked_fill(~mask, float("-inf"))
        out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
        out.append(F.scaled_dot_product_attention(q.to(torch.bfloat16), k.to(torch.bfloat16),
                                                  v.to(torch.bfloat16), attn_mask=bias.to(torch.bfloat16)).float())
        w = torch.matmul(q, k.transpose(-1, -2)) * (hidden // heads) ** -0.5 + bias
        out += [F.softmax(w, dim=-1), torch.matmul(F.softmax(w, dim=-1), v)]
    # the LM head, log-probs, entropy, sampling
    logits = randn(833, 37) * 3
    lp = F.log_softmax(logits, dim=-1)
    out += [lp, -(lp.exp() * lp).sum(-1), F.softmax(logits / 0.7, -1).cumsum(-1), torch.exp(lp - lp.flip(0))]
    out.append(F.cross_entropy(logits, torch.arange(833) % 37, reduction="none"))
    # AdamW's update (the foreach path the trainers take)
    params = [torch.nn.Parameter(randn(96, 288)), torch.nn.Parameter(randn(37, 96))]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
    for _ in range(2):
        for p in params:
            p.grad = randn(*p.shape)
        opt.step()
    out += [p.detach().clone() for p in params]
    return out


@functools.lru_cache(maxsize=1)
def probe_digest() -> str:
    """12 hex digits of SHA-256 over the probe's output bits, computed on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            outs = _probe_outputs()
    finally:
        torch.set_num_threads(threads)
    h = hashlib.sha256()
    for t in outs:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype != torch.bfloat16
                 else t.float().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


def probe_source_digest() -> str:
    """SHA-256 (12 hex) of the probe's own source: recorded beside golden numbers, so that an edit
    of the probe (which re-keys every machine) is caught by a test instead of skipping silently."""
    src = inspect.getsource(_probe_outputs) + repr((_WIDTHS, _ROWS, PROBE_VERSION))
    return hashlib.sha256(src.encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def mkl_code_path() -> str | None:
    """The code path MKL reports for its GEMMs (``MKL_VERBOSE``'s header, e.g. ``"Intel(R) Advanced
    Vector Extensions 512 (Intel(R) AVX-512) enabled processors"`` or, on AMD CPUs, ``"Intel(R)
    Architecture processors"``); None without MKL or when the header was printed earlier in this
    process (MKL prints it once)."""
    if not torch.backends.mkl.is_available():
        return None
    fd, path = tempfile.mkstemp(prefix="fp8rl-mkl-")
    saved = os.dup(1)
    try:
        os.dup2(fd, 1)
        with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
            torch.ones(4, 4) @ torch.ones(4, 4)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(fd)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    finally:
        os.unlink(path)
    for line in text.splitlines():
        if line.startswith("MKL_VERBOSE oneMKL") or line.startswith("MKL_VERBOSE Intel(R) MKL"):
            _, _, rest = line.partition(" architecture ")
            return rest.split(", Lnx")[0].strip() or None
    return None


@functools.lru_cache(maxsize=1)
def fingerprint() -> dict:
    """What decides this machine's mini bits, and what describes it.

    ``key`` (:func:`fingerprint_key`) holds the deciding parts: torch and transformers versions,
    ATen's kernel level and the probe digest. ``mkl`` and ``cpu`` are recorded for people (the
    probe already tells machines apart where they matter).
    """
    from importlib import metadata

    from fp8rl.runs.provenance import cpu_info

    try:  # the installed version, without importing the package
        tf_version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        tf_version = None
    fp = {"torch": torch.__version__, "transformers": tf_version,
          "aten": torch.backends.cpu.get_cpu_capability(), "probe": f"v{PROBE_VERSION}:{probe_digest()}",
          "mkl": mkl_code_path(), "cpu": {**cpu_info(), "vendor": _cpu_vendor()}}
    fp["key"] = fingerprint_key(fp)
    return fp


def fingerprint_key(fp: dict) -> str:
    """``"torch 2.13.0+cpu / AVX512 / transformers 5.24.0 / probe v1:0123456789ab"``."""
    return f"torch {fp['torch']} / {fp['aten']} / transformers {fp['transformers']} / probe {fp['probe']}"


def numerics_key(device: str = "cpu") -> str:
    """The key of what computes a run's bits on ``device`` (a device type or name): the CPU's
    :func:`fingerprint` key; on an accelerator, torch's version and the device type (GPU kernels
    are not fingerprinted here). Cache keys of computed results (the SFT warm start, the step-0
    evaluation) include it, so that a cache shared by two machines never hands one's bits to the other."""
    kind = torch.device(device).type
    if kind == "cpu":
        return fingerprint()["key"]
    return f"torch {torch.__version__} / {kind}"


def _cpu_vendor() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip() or None
    except OSError:
        pass
    return None
