"""One small registry type, used by every sweep axis.

Every axis of the experiment grid (advantage estimator, loss aggregation, IS correction,
clip method, FP8 recipe, backend, ...) is a ``Registry``: entries are added with a decorator,
looked up with ``REGISTRY[name]``, and configuration validation calls ``REGISTRY.check(name)``
so that a typo fails when the config loads, with the list of valid names, not mid-run.

    ADVANTAGE_ESTIMATORS = Registry("advantage estimator")

    @ADVANTAGE_ESTIMATORS.register("grpo")
    def grpo(rewards, group_ids): ...

    ADVANTAGE_ESTIMATORS["grpo"](rewards, group_ids)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """An unknown or duplicate registry name. ``str()`` is the plain message (KeyError quotes it)."""

    def __str__(self) -> str:  # KeyError's str() adds quotes around the message
        return str(self.args[0]) if self.args else ""


class Registry(Mapping[str, T], Generic[T]):
    """A named mapping from string keys to objects, filled by decorator registration.

    Args:
        kind: what the entries are, used in error messages ("clip method", "FP8 recipe").

    Duplicate names raise ``RegistryError`` (even for the same object, so that two modules
    cannot silently claim one name); unknown names raise ``RegistryError`` listing the valid
    names in sorted order.
    """

    def __init__(self, kind: str) -> None:
        if not kind:
            raise ValueError("Registry needs a non-empty `kind` for its error messages")
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REG.register("name")`` adds the decorated object under ``name``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        """Add ``obj`` under ``name``; raises if the name is taken."""
        if name in self._entries:
            raise RegistryError(
                f"{self.kind} {name!r} is already registered (to {self._entries[name]!r}); "
                "pick another name"
            )
        self._entries[name] = obj

    def check(self, name: str) -> str:
        """Return ``name`` if registered, else raise naming the valid choices."""
        if name not in self._entries:
            valid = ", ".join(sorted(self._entries)) or "(none registered)"
            raise RegistryError(f"unknown {self.kind} {name!r}; valid names are: {valid}")
        return name

    def __getitem__(self, name: str) -> T:
        return self._entries[self.check(name)]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
