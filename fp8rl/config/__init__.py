"""Typed configuration of one run, shared by both backends.

Plain dataclasses of primitives (OmegaConf structured-config friendly: no unions of complex
types, lists of primitives only) that validate in ``__post_init__`` and raise ``ValueError``
with a message saying what is wrong and how to fix it. The axis configs mirror the Hydra
config groups (``algorithm/ model/ fp8/ clip/``); ``RunConfig`` composes them and runs the
cross-field checks in ``validate()`` (called from its ``__post_init__``). Nothing is rewritten
after validation: the logged config is the config that ran.

Registry-backed names (advantage estimator, loss aggregation, FP8 recipes, clip arms) are
checked against their registries when the config is built, so a typo in a sweep fails before
anything runs. Those registries live in ``fp8rl.rl`` / ``fp8rl.quant`` and are imported lazily
inside the checks.

Backend-specific settings (the mini backend's model sizes, task and SFT) live with the backend
(``fp8rl.backends.mini.config.MiniRunConfig`` extends ``RunConfig``).

One module per concern, every name re-exported here (``from fp8rl.config import X`` is the
import path): ``algorithm`` (``AlgorithmConfig``), ``model`` (``ModelConfig``), ``fp8``
(``Fp8Config``, ``torch_dtype``), ``clip`` (``ClipConfig``), ``run`` (``RunConfig``,
``LoggingConfig``, ``IDENTITY_EXCLUDE``) and ``validation`` (the shared ``_require`` /
``_check_registry`` helpers).
"""

from __future__ import annotations

from fp8rl.config.algorithm import ALGORITHMS, AlgorithmConfig
from fp8rl.config.clip import ClipConfig
from fp8rl.config.fp8 import COMPUTE_DTYPES, Fp8Config, torch_dtype
from fp8rl.config.model import MODEL_SLOTS, ModelConfig
from fp8rl.config.run import (
    IDENTITY_EXCLUDE,
    IDENTITY_LATE_DEFAULTS,
    MAX_SEED,
    LoggingConfig,
    RunConfig,
)
from fp8rl.config.validation import _check_registry, _require

__all__ = [
    "ALGORITHMS", "COMPUTE_DTYPES", "IDENTITY_EXCLUDE", "IDENTITY_LATE_DEFAULTS", "MAX_SEED", "MODEL_SLOTS",
    "AlgorithmConfig", "ClipConfig", "Fp8Config", "LoggingConfig", "ModelConfig", "RunConfig",
    "_check_registry", "_require", "torch_dtype",
]
