"""Shared fixtures of the mini-backend tests: a tiny, fast configuration and one SFT cache."""

from __future__ import annotations

import pytest
from tiny_cells import tiny_config

from fp8rl.backends.mini.config import MiniRunConfig


@pytest.fixture(scope="session")
def sft_cache(shared_sft_cache):
    """The run's SFT cache (``tests/conftest.py``): each warm start is trained once per test run."""
    return str(shared_sft_cache)


@pytest.fixture
def tiny(sft_cache, tmp_path):
    """``tiny(**overrides) -> MiniRunConfig``: 8b slot, 4 prompts x 4 samples, an easy task
    (2-3 terms, operands <= 9) and a short SFT (about 10% accuracy: mixed rewards)."""

    def make(arm: str = "bf16", clip: str = "vanilla", **kw) -> MiniRunConfig:
        return tiny_config(sft_cache, tmp_path / "runs", arm, clip, **kw)

    return make


@pytest.fixture
def killed_at(monkeypatch):
    """``killed_at(cfg, step)``: run ``cfg`` until ``step`` starts, then interrupt it as a kill
    would (KeyboardInterrupt inside the step); the trainer is restored for the next run."""
    from fp8rl.backends.mini.run import run_mini
    from fp8rl.backends.mini.trainer import MiniTrainer

    def run(cfg, step: int) -> None:
        original = MiniTrainer.train_step

        def dies(self, s):
            if s == step:
                raise KeyboardInterrupt("killed")
            return original(self, s)

        monkeypatch.setattr(MiniTrainer, "train_step", dies)
        try:
            with pytest.raises(KeyboardInterrupt):
                run_mini(cfg)
        finally:
            monkeypatch.setattr(MiniTrainer, "train_step", original)

    return run
