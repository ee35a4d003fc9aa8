"""``model:`` -- the model slot (each backend maps slots to its models)."""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl.config.validation import _require

MODEL_SLOTS = ("8b", "14b", "32b")


@dataclass
class ModelConfig:
    """The model slot: ``8b``, ``14b`` or ``32b`` (each backend maps slots to its models)."""

    slot: str = "8b"

    def __post_init__(self) -> None:
        _require(self.slot in MODEL_SLOTS, f"model.slot {self.slot!r} must be one of {MODEL_SLOTS}")
