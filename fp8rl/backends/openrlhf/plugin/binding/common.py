"""What the binders share: the error types, upstream-signature checks, saved originals."""

from __future__ import annotations

import inspect
from collections.abc import Callable

#: Key of the BF16 old log-probs in a replay-buffer sample's ``info`` (popped before upstream sees it).
SHADOW_OLD_KEY = "_fp8rl_shadow_old"
_ORIG = "_fp8rl_originals"


class UpstreamChangedError(RuntimeError):
    """An OpenRLHF object the plugin wraps no longer has the shape it was written for."""


class PluginNotActiveError(RuntimeError):
    """A policy actor runs without the plugin bound as the cell asks (found by the driver)."""


class ResumeError(RuntimeError):
    """A checkpoint cannot resume the clip controller exactly."""


def _check_params(obj, expected: tuple[str, ...], what: str) -> None:
    params = tuple(inspect.signature(obj).parameters)[: len(expected)]
    if params != expected:
        raise UpstreamChangedError(
            f"OpenRLHF {what} has parameters {params}, fp8rl's binding was written for {expected}; "
            "the installed OpenRLHF is not the 0.11.2 the plugin binds into")


def _originals(cls, names: tuple[str, ...]) -> dict[str, Callable]:
    """The upstream functions of ``cls`` (saved on first binding, so rebinding never stacks)."""
    saved = cls.__dict__.get(_ORIG)
    if saved is None:
        saved = {}
        setattr(cls, _ORIG, saved)
    for n in names:  # a name first asked for later is still upstream's then
        if n not in saved:
            saved[n] = cls.__dict__[n]
    return saved
