"""The launch's error type, apart so that every launch module can raise it without import cycles."""

from __future__ import annotations

from hydra.errors import CompactHydraException


class SweepError(CompactHydraException):
    """An invalid sweep: printed by Hydra without a traceback, exit status 1."""
