"""What ``provenance.json`` records about the machine and the code (:meth:`RunDir.write_provenance`).

Helpers that read the environment, each failing soft (``None`` for what cannot be read), so that
writing provenance never stops a run:

- :func:`git_info` — sha + dirty flag of the work tree holding the fp8rl package;
- :func:`package_versions` — versions of :data:`PROVENANCE_PACKAGES`;
- :func:`slurm_env` — the Slurm ids of :data:`SLURM_VARS` set at call time;
- :func:`cpu_info` — the CPU model and the instruction-set extensions that change CPU numerics.

:func:`provenance_problem` checks a record read back, field by field (:data:`PROVENANCE_FIELDS`):
``RunDir.provenance`` refuses one that is not a mapping or holds a field of another type,
naming the file and the field (a relaunch writes a deleted record again).

**Why the CPU.** The same code, seed and thread count give different numbers on CPUs with
different vector extensions: oneDNN/MKL pick AVX2, AVX512 or AMX (bf16) kernels whose
accumulation orders differ, and RL from a short SFT warm start amplifies the last bit (measured:
the mini 8b warm start's step-0 held-out avg@4 is 79.5% on one x86-64 machine and 76.9% on
another, same commit and settings). Results from different CPUs are different samples, not
repeats; ``cpu.flags`` says which kernels could run.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

#: Packages whose versions go into provenance.json (None when not installed).
PROVENANCE_PACKAGES: tuple[str, ...] = ("torch", "torchao", "transformers", "fp8rl")
#: Slurm variables recorded in provenance.json when set.
SLURM_VARS: tuple[str, ...] = (
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_NODELIST",
    "SLURM_NNODES",
    "SLURM_RESTART_COUNT",
    "SLURM_CLUSTER_NAME",
)
#: x86-64 extensions whose presence selects other GEMM / conversion kernels (recorded when present).
NUMERIC_CPU_FLAGS: tuple[str, ...] = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8",
)
#: The fields of a provenance record and the JSON types each may hold (None: null). A record
#: may lack fields (records written before one existed), never hold one of another type.
PROVENANCE_FIELDS: dict[str, tuple[type | None, ...]] = {
    "git": (dict,), "packages": (dict,), "python": (str,), "platform": (str,), "host": (str,),
    "device": (str, None), "cpu": (dict,), "slurm": (dict,), "argv": (list,), "time_started": (str,),
    "time_ended": (str, None), "extra": (dict,), "previous_attempts": (list,),
}
_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", None: "null"}


def _json_name(value: object) -> str:
    return _JSON_NAMES.get(None if value is None else type(value), type(value).__name__)


def provenance_problem(record: object, where: str = "") -> str | None:
    """Why ``record`` (``provenance.json`` as read) is not a provenance record fp8rl writes, naming
    the field; None when it is one. Each earlier attempt in ``previous_attempts`` is checked too."""
    if not isinstance(record, dict):
        return f"{where or 'it'} holds {_json_name(record)}, not an object of provenance fields"
    for name, types in PROVENANCE_FIELDS.items():
        if name not in record:
            continue
        value = record[name]
        if not any(value is None if t is None else (isinstance(value, t) and not isinstance(value, bool))
                   for t in types):
            want = " or ".join(_JSON_NAMES[t] for t in types)
            return f"its field {where}{name} holds {_json_name(value)}, not {want}"
    for i, old in enumerate(record.get("previous_attempts") or []):
        if where:  # an earlier attempt's own list is not nested further
            break
        why = provenance_problem(old, f"previous_attempts[{i}].")
        if why:
            return why if isinstance(old, dict) else f"its field previous_attempts[{i}] holds {_json_name(old)}, not an object"
    return None


#: Where Linux describes the CPU.
CPUINFO = Path("/proc/cpuinfo")


def git_info(start: Path) -> dict:
    """``{"sha": ..., "dirty": bool}`` of the git work tree containing ``start``, or Nones."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(start), *args], capture_output=True, text=True,
                                 timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        return {"sha": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": None if status is None else bool(status)}


def package_versions(names: Iterable[str]) -> dict:
    """``{name: version or None}``."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def slurm_env() -> dict:
    """The :data:`SLURM_VARS` set in the environment."""
    return {k: os.environ[k] for k in SLURM_VARS if k in os.environ}


def cpu_info(cpuinfo: Path | None = None) -> dict:
    """``{"model": str | None, "flags": [...]}``: the first processor's model name and which of
    :data:`NUMERIC_CPU_FLAGS` it has (in that order), from ``/proc/cpuinfo``; off Linux the
    model is :func:`platform.processor` and ``flags`` is None (unknown, not "none")."""
    path = CPUINFO if cpuinfo is None else cpuinfo
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {"model": platform.processor() or None, "flags": None}
    model, flags = None, None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if model is not None or flags is not None:
                break  # end of the first processor's block
            continue
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and flags is None:
            have = set(value.split())
            flags = [f for f in NUMERIC_CPU_FLAGS if f in have]
    return {"model": model, "flags": flags}
