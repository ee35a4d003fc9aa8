"""Validation helpers shared by the config dataclasses: each failure is a ``ValueError`` whose
message says what is wrong and how to fix it."""

from __future__ import annotations

import importlib


def _check_registry(module: str, attr: str, name: str, what: str) -> None:
    """Raise ``ValueError`` if ``name`` is not registered in ``module.attr``."""
    registry = getattr(importlib.import_module(module), attr)
    if name not in registry:
        raise ValueError(f"{what}: unknown name {name!r}; valid names are: {sorted(registry)}")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)
