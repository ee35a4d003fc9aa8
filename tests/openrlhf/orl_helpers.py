"""Helpers for the OpenRLHF backend tests (imported as ``orl_helpers``): upstream 0.11.2 source
loaded by path, and the 90 main-table cells at paper scale built from the YAML config tree.

Nothing here imports the ``openrlhf`` package (it needs deepspeed, flash-attn, vLLM): files are
executed from the installed wheel's source with heavy imports stubbed through ``sys.modules``.
Missing openrlhf skips, except under CI (``CI`` set), where it fails.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import os
import sys
import types
from pathlib import Path
from typing import Optional

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from fp8rl.backends.openrlhf.config import OpenRLHFRunConfig
from fp8rl.launch.configs import build_dataclass

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def openrlhf_dir() -> Path:
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or spec.origin is None:
        msg = "openrlhf==0.11.2 is not installed (pip install --no-deps openrlhf==0.11.2; `make install` does)"
        if os.environ.get("CI"):
            pytest.fail(msg + " -- required under CI")
        pytest.skip(msg)
    return Path(spec.origin).parent


def function_from_source(path: Path, name: str, namespace: dict):
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


def load_upstream_loss(monkeypatch) -> types.ModuleType:
    """``openrlhf/models/loss.py`` of the installed wheel, with upstream's ``masked_mean``."""
    root = openrlhf_dir()
    pkg_name = "_fp8rl_orl_models"
    pkg = types.ModuleType(pkg_name)
    pkg.__path__ = [str(root / "models")]
    utils = types.ModuleType(f"{pkg_name}.utils")
    utils.masked_mean = function_from_source(root / "models" / "utils.py", "masked_mean",
                                             {"torch": torch, "Optional": Optional})
    monkeypatch.setitem(sys.modules, pkg_name, pkg)
    monkeypatch.setitem(sys.modules, f"{pkg_name}.utils", utils)
    spec = importlib.util.spec_from_file_location(f"{pkg_name}.loss", root / "models" / "loss.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, f"{pkg_name}.loss", mod)
    spec.loader.exec_module(mod)
    return mod


def random_batch(seed: int, B: int = 12, T: int = 30):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 4
    lp = (old + torch.randn(B, T, generator=g) * 0.3).requires_grad_(True)
    rollout = old + torch.randn(B, T, generator=g) * 0.6
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    return lp, old, rollout, adv, mask


def _yaml(group: str, name: str) -> dict:
    return yaml.safe_load((REPO / "sweeps" / group / f"{name}.yaml").read_text())


def main_table_configs(tmp_path: Path):
    grid = yaml.safe_load((REPO / "sweeps" / "sweep" / "main_table.yaml").read_text())["hydra"]["sweeper"]["params"]
    scale = {k: v for k, v in _yaml("scale", "paper").items() if k not in ("defaults", "scale", "launcher")}
    backend = _yaml("backend", "openrlhf")["openrlhf"]
    data = _yaml("data", "paper")["openrlhf"]
    axes = [grid[k].split(",") for k in ("algorithm", "model", "fp8", "clip")]
    for algo, model, fp8, clip in itertools.product(*axes):
        cfg = {
            "algorithm": _yaml("algorithm", algo), "model": {"slot": model},
            "fp8": {**_yaml("fp8", fp8), **scale["fp8"]}, "clip": {**_yaml("clip", clip), **scale["clip"]},
            **{k: v for k, v in scale.items() if k not in ("fp8", "clip")},
            "openrlhf": {**backend, **data}, "output_dir": str(tmp_path / "main_table"),
        }
        cfg = OmegaConf.to_container(OmegaConf.create(cfg), resolve=True)  # scale/paper.yaml interpolates
        yield (algo, model, fp8, clip), build_dataclass(OpenRLHFRunConfig, cfg)
