"""Shared fixtures of the mini-backend tests: a tiny, fast configuration and one SFT cache."""

from __future__ import annotations

import pytest

from fp8rl.backends.mini.config import MiniRunConfig, MiniSettings
from fp8rl.config import AlgorithmConfig, ClipConfig, Fp8Config

#: precision arms of the issue: name -> (rollout recipe, trainer recipe)
ARMS = {
    "fp32": ("bf16", "bf16"),
    "bf16": ("bf16", "bf16"),
    "rollout_only": ("tensorwise", "bf16"),
    "tensorwise": ("tensorwise", "tensorwise"),
    "rowwise": ("rowwise", "rowwise"),
    "blockwise": ("blockwise", "blockwise"),
    "mxfp8": ("mxfp8", "mxfp8"),
}


def _clip_opts(arm: str, opts: dict | None) -> dict:
    """The tiny runs calibrate ``periodic``ally every 2 steps unless ``opts`` names a mode."""
    opts = {"arm": arm, **(opts or {})}
    if opts.get("calibration_mode", "periodic") == "periodic":
        opts = {"calibration_mode": "periodic", "period": 2, **opts}
    return opts


@pytest.fixture(scope="session")
def sft_cache(shared_sft_cache):
    """The run's SFT cache (``tests/conftest.py``): each warm start is trained once per test run."""
    return str(shared_sft_cache)


@pytest.fixture
def tiny(sft_cache, tmp_path):
    """``tiny(**overrides) -> MiniRunConfig``: 8b slot, 4 prompts x 4 samples, an easy task
    (2-3 terms, operands <= 9) and a short SFT (about 10% accuracy: mixed rewards)."""

    def make(arm: str = "bf16", clip: str = "vanilla", *, algorithm: dict | None = None,
             clip_opts: dict | None = None, mini: dict | None = None, **kw) -> MiniRunConfig:
        rollout, trainer = ARMS[arm]
        base = dict(steps=5, prompts_per_step=4, num_mini_batches=2, max_response_len=32,
                    eval_every=5, eval_k=2, checkpoint_every=0, samples_every=2, lr=1e-3,
                    output_dir=str(tmp_path / "runs"))
        base.update(kw)
        return MiniRunConfig(
            algorithm=AlgorithmConfig(**{"n_samples_per_prompt": 4, **(algorithm or {})}),
            fp8=Fp8Config(name=arm, rollout_recipe=rollout, trainer_recipe=trainer, emulate=True,
                          compute_dtype="fp32" if arm == "fp32" else "bf16"),
            clip=ClipConfig(**_clip_opts(clip, clip_opts)),
            mini=MiniSettings(**{"n_train": 200, "n_eval": 4, "sft_steps": 150, "sft_batch_size": 32,
                                 "min_terms": 2, "max_terms": 3, "max_operand": 9,
                                 "cache_dir": sft_cache, "num_threads": 1, **(mini or {})}),
            **base,
        )

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
