"""The values of the command line's single-valued overrides, checked before Hydra composes.

Hydra composes the primary config from every override that is not a sweep (``fp8=fp9``,
``steps=abc``) before the ``fp8rl`` sweeper runs, and a bad value there was Hydra's own
multi-line answer: the config search path, the options one per line, and the
``HYDRA_FULL_ERROR`` hint. :func:`override_value_errors` answers first, one line per bad value
naming the override, what is wrong and the fix:

- a config-group option that does not exist: ``fp8=fp9: 'fp9' is not an option of config group
  fp8 (no sweeps/fp8/fp9.yaml); valid values: bf16, blockwise, ...`` (and the nearest ones);
- a value of the wrong type for a typed key of the schema (``fp8rl.launch.schema``):
  ``steps=abc: steps takes an integer, got 'abc'; give one, e.g. steps=...``; ``null`` for a key
  that cannot be null.

Sweep values (``fp8=bf16,fp9``) are left to the sweep's validation (``fp8rl.launch.grid``), which
names the cell of each bad value, the types with this check (once per value, before composing);
keys are checked by ``fp8rl.launch.keys`` before this.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fp8rl.launch.keys import SWEEPS_DIR
from fp8rl.launch.yamlcheck import config_dirs


def _options(group: str, dirs: Sequence[Path]) -> list[str] | None:
    """The options of config group ``group`` (YAML files below ``<dir>/<group>/``, without the
    suffix), or None when no directory has that group."""
    found: set[str] = set()
    is_group = False
    for d in dirs:
        g = d / group
        if g.is_dir():
            is_group = True
            found.update(str(p.relative_to(g).with_suffix("")) for p in g.rglob("*.yaml"))
    return sorted(found) if is_group else None


@functools.cache
def _leaf_types() -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (type, default)}`` of every typed leaf of the launch schema."""
    from fp8rl.launch.schema import build_schema

    out: dict[str, tuple[Any, Any]] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints.get(f.name, Any)
            inner = _strip_optional(tp)[0]
            if dataclasses.is_dataclass(inner):
                walk(inner, f"{prefix}{f.name}.")
            else:
                default = f.default if f.default is not dataclasses.MISSING else None
                out[f"{prefix}{f.name}"] = (tp, default)

    walk(build_schema(), "")
    return out


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else Any), True
    return tp, tp is Any


_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _type_error(key: str, tp: Any, value: Any, default: Any, raw: str) -> str | None:
    """Why ``value`` cannot be ``key``'s value (typed ``tp``), or None when it can (or when the
    type is one this check leaves to Hydra: lists, mappings, ``Any``)."""
    from omegaconf import BooleanNode, EnumNode, FloatNode, IntegerNode
    from omegaconf.errors import ValidationError

    inner, optional = _strip_optional(tp)
    if isinstance(value, str) and "${" in value:
        return None  # an interpolation: resolved by Hydra
    if value is None:
        return None if optional else f"{key} cannot be null"
    node = None
    if inner is bool:
        node = lambda v: BooleanNode(v)  # noqa: E731
    elif inner is int:
        node = lambda v: IntegerNode(v)  # noqa: E731
    elif inner is float:
        node = lambda v: FloatNode(v)  # noqa: E731
    elif isinstance(inner, type) and issubclass(inner, enum.Enum):
        node = lambda v: EnumNode(inner, v)  # noqa: E731
    if node is None:
        return None
    try:
        node(value)
        return None
    except ValidationError:
        pass
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        want = "one of " + ", ".join(m.name for m in inner)
    else:
        want = _NAMES.get(inner, inner.__name__)
    example = f"; e.g. {key}={str(default).lower() if isinstance(default, bool) else default}" \
        if default is not None and not isinstance(default, (list, dict)) else ""
    return f"{key} takes {want}{' or null' if optional else ''}, got {raw!r}{example}"


def _values(parsed) -> list[Any] | None:
    """The values of a parsed single-valued override, or None for sweeps (checked per cell)."""
    if parsed.is_sweep_override():
        return None
    return [parsed.value()]


def override_value_errors(overrides: Iterable[str], dirs: Sequence[Path] = (SWEEPS_DIR,), *,
                          groups: bool = True) -> list[str]:
    """One line per single-valued override whose value its config group or typed key refuses
    (module docstring); ``dirs``: the config directories (``sweeps/`` and any ``--config-dir``);
    ``groups=False``: check typed keys only (the sweep's validation checks group values itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    errors: list[str] = []
    for ov in overrides:
        try:
            parsed = parser.parse_override(ov)
        except Exception as e:  # Hydra's grammar: one line
            text = " ".join(str(e).split())
            errors.append(f"{ov}: not an override Hydra can parse ({text[:200]}); write key=value, "
                          "quoting a value with spaces or special characters ('key=\"a b\"')")
            continue
        if parsed.is_delete():
            continue
        key = parsed.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue  # Hydra's own settings
        values = _values(parsed)
        if values is None:
            continue
        options = None if parsed.package else _options(key, dirs)
        if options is not None and not groups:
            continue
        if options is not None:
            for v in values:
                if isinstance(v, str) and v in options:
                    continue
                near = difflib.get_close_matches(str(v), options, n=3, cutoff=0.6)
                hint = f"; did you mean {' or '.join(near)}?" if near else ""
                where = ", ".join("sweeps" if d == SWEEPS_DIR else str(d) for d in dirs)
                errors.append(f"{ov}: {str(v)!r} is not an option of config group {key} (no {key}/{v}.yaml "
                              f"in {where}); valid values: {', '.join(options)}{hint}")
            continue
        leaf = _leaf_types().get(key)
        if leaf is None:
            continue  # below a free-form block, or an unknown key (keys.py names those)
        raw = ov.split("=", 1)[1] if "=" in ov else ""
        for v in values:
            why = _type_error(key, leaf[0], v, leaf[1], raw)
            if why:
                errors.append(f"{ov}: {why}")
    return errors


__all__ = ["config_dirs", "override_value_errors"]
