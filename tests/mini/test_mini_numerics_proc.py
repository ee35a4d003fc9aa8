"""The numerics fingerprint (``fp8rl/backends/mini/numerics.py``) tells apart what computes other
bits: torch's kernel level and MKL's code path, forced here by environment in fresh processes (the
stand-ins for another CPU on this one), and stays the same where nothing changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fp8rl.backends.mini import numerics
from fp8rl.runs.provenance import cpu_info

_CHILD = "import json; from fp8rl.backends.mini import numerics as n; print(json.dumps(n.fingerprint()))"


def _fingerprint_in(env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _needs(*flags: str) -> None:
    have = set(cpu_info()["flags"] or [])
    if not set(flags) <= have:
        pytest.skip(f"this CPU lacks {sorted(set(flags) - have)}")


def test_the_key_names_the_kernel_level_and_the_probe():
    fp = numerics.fingerprint()
    assert fp["aten"] == torch.backends.cpu.get_cpu_capability()
    assert fp["key"] == numerics.fingerprint_key(fp)
    assert fp["key"].endswith(f"probe v{numerics.PROBE_VERSION}:{numerics.probe_digest()}")
    assert len(numerics.probe_digest()) == 12
    assert numerics.numerics_key("cpu") == fp["key"]
    assert numerics.numerics_key("cuda") == f"torch {torch.__version__} / cuda"


def test_another_kernel_level_is_another_key():
    """ATen's AVX2 kernels against its scalar ones: other softmax and reduction bits, another key."""
    _needs("avx2", "fma")
    default, avx2 = _fingerprint_in({"ATEN_CPU_CAPABILITY": "default"}), _fingerprint_in({"ATEN_CPU_CAPABILITY": "avx2"})
    assert (default["aten"], avx2["aten"]) == ("DEFAULT", "AVX2")
    assert default["probe"] != avx2["probe"]


def test_another_mkl_code_path_is_another_key_at_the_same_kernel_level():
    """MKL's compatible mode runs other GEMM kernels (as MKL does on another vendor's CPU): the ATen
    level is unchanged, so only the probe can tell; a key without it would hand this machine's
    golden numbers to a machine that computes others (what failed before the probe existed)."""
    _needs("avx2", "fma")
    if not torch.backends.mkl.is_available():
        pytest.skip("torch without MKL")
    here, compat = _fingerprint_in({}), _fingerprint_in({"MKL_CBWR": "COMPATIBLE"})
    assert here["aten"] == compat["aten"]
    assert here["probe"] != compat["probe"] and here["key"] != compat["key"]
    assert here["key"] == numerics.fingerprint()["key"]  # and a fresh process agrees with this one


def test_mkl_reports_its_code_path():
    if not torch.backends.mkl.is_available():
        pytest.skip("torch without MKL")
    fp = _fingerprint_in({})
    assert isinstance(fp["mkl"], str) and fp["mkl"], fp  # e.g. "Intel(R) Architecture processors"
