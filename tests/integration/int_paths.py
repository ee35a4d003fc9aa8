"""Paths of the integration tier (imported by its conftest and tests as ``int_paths``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUPPORT = HERE / "support"
REPO = HERE.parents[1]
#: The pinned vLLM wheel unpacked by ``make install-integration`` (never on .venv's own path).
VLLM_DIR = Path(os.environ.get("FP8RL_VLLM_DIR", str(Path(sys.prefix) / "vllm-0.29.0")))
