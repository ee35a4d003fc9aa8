"""Paths of the integration tier (imported by its conftest and tests as ``int_paths``)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
SUPPORT = HERE / "support"
REPO = HERE.parents[1]


def vllm_dir() -> Path:
    """The installed ``vllm`` package of vLLM's CPU build (``make install-integration``)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("vllm is not installed: run make install-integration")
    return Path(spec.origin).parent
