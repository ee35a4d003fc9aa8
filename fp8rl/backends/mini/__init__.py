"""The embedded mini backend: full-pipeline FP8 RL at miniature scale, on CPU or one GPU.

Tiny Qwen3-architecture models (``model``), a character tokenizer (``tokenizer``), a synthetic
multi-step arithmetic task with exact answers (``task``), a cached supervised warm start
(``sft``), a rollout engine with its own (FP8) weight copy and a KV cache (``rollout``), the
trainer loop with GRPO/DAPO, vanilla/TIS/calibrated clipping and the BF16 shadow pass
(``trainer``), held-out evaluation (``evaluate``), and run-directory handling (``run``).

Entry point: ``python -m fp8rl.backends.mini key=value ...``; in Python::

    from fp8rl.backends.mini import MiniRunConfig, run_mini
    summary = run_mini(MiniRunConfig(steps=20))

See ``docs/mini.md`` for sizes, timings and the study.
"""

from fp8rl.backends.mini.config import MiniRunConfig, MiniSettings
from fp8rl.backends.mini.run import resolve_run_dir, run_mini

__all__ = ["MiniRunConfig", "MiniSettings", "resolve_run_dir", "run_mini"]
