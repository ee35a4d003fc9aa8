"""Expand a sweep's grid into override lists and compose each grid point's config (Hydra semantics).

``expand_overrides`` is Hydra's basic sweeper's expansion (the cartesian product of every
comma-separated axis, command-line values replacing the sweep file's for the same key);
``compose_cells`` composes every grid point with Hydra's own config loader, fast (once per axis
value, adding up the changes) or exactly (once per grid point). ``fp8rl.launch.grid`` validates
what comes out.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any


def expand_overrides(params: Mapping[str, str], arguments: Sequence[str], config_loader) -> list[list[str]]:
    """The grid as lists of ``key=value`` overrides, one list per grid point (Hydra semantics)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params_conf = [f"{k}={v}" for k, v in (params or {}).items()]
    parser = OverridesParser.create(config_loader=config_loader)
    parsed = parser.parse_overrides([*params_conf, *arguments])
    return BasicSweeper.split_arguments(parsed, None)[0]


def set_dotted(d: dict, dotted: str, value: Any) -> None:
    node = d
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def get_dotted(d: Mapping, dotted: str) -> Any:
    node: Any = d
    for p in dotted.split("."):
        if not isinstance(node, Mapping) or p not in node:
            return None
        node = node[p]
    return node


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{dotted.path: leaf}`` (lists and scalars are leaves; ``{}`` is a leaf)."""
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


_REMOVED = object()


def _delta(base: dict, other: dict) -> dict[str, Any]:
    """Dotted paths where ``other`` differs from ``base`` (``_REMOVED`` where it lacks a path)."""
    fb, fo = _flatten(base), _flatten(other)
    out = {k: v for k, v in fo.items() if k not in fb or fb[k] != v}
    out.update({k: _REMOVED for k in fb if k not in fo})
    return out


def _overlap(paths_a: set[str], paths_b: set[str]) -> bool:
    for a in paths_a:
        for b in paths_b:
            if a == b or a.startswith(b + ".") or b.startswith(a + "."):
                return True
    return False


def _apply(base: dict, delta: dict[str, Any]) -> None:
    for path, value in delta.items():
        parts = path.split(".")
        node = base
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        if value is _REMOVED:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = copy.deepcopy(value)


def _compose(master_cfg, config_loader, overrides: list[str]) -> dict:
    """Hydra's composition of ``overrides`` (resolved, ``hydra`` node dropped)."""
    from omegaconf import OmegaConf

    cfg = config_loader.load_sweep_config(master_cfg, list(overrides))
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    return container


def compose_cells(master_cfg, config_loader, grid: list[list[str]], *, exact: bool = False
                  ) -> list[dict | Exception]:
    """The composed config of every grid point (an exception where composition failed).

    ``exact=True`` runs Hydra's full composition per grid point (about 0.1 s each). The default
    composes once per *axis value* instead: the base (every single-valued override) and, for
    each value of each multi-valued axis, the base with that one value; a grid point is the
    base plus the changes of its axis values. That equals the full composition whenever the
    axes change disjoint keys, which is checked: a grid point whose axes touch a common key is
    composed in full. (``tests/launch`` compares both for every shipped sweep.)
    """
    if exact or len(grid) <= 1:
        out: list[dict | Exception] = []
        for overrides in grid:
            try:
                out.append(_compose(master_cfg, config_loader, overrides))
            except Exception as e:
                out.append(e)
        return out
    keys = [[ov.split("=", 1)[0] for ov in g] for g in grid]
    values: dict[str, set[str]] = {}
    for g in grid:
        for ov in g:
            values.setdefault(ov.split("=", 1)[0], set()).add(ov)
    singles = [next(iter(v)) for k, v in values.items() if len(v) == 1]
    try:
        base = _compose(master_cfg, config_loader, singles)
    except Exception as e:
        return [e] * len(grid)
    deltas: dict[str, dict | Exception] = {}
    for k, vals in values.items():
        if len(vals) == 1:
            continue
        rest = [s for s in singles if s.split("=", 1)[0] != k]
        for ov in vals:
            try:
                deltas[ov] = _delta(base, _compose(master_cfg, config_loader, [*rest, ov]))
            except Exception as e:
                deltas[ov] = e
    out = []
    for g, ks in zip(grid, keys, strict=True):
        ds = [deltas[ov] for ov, k in zip(g, ks, strict=True) if len(values[k]) > 1]
        err = next((d for d in ds if isinstance(d, Exception)), None)
        if err is not None:
            out.append(err)
            continue
        paths = [set(d) for d in ds]
        if any(_overlap(paths[i], paths[j]) for i in range(len(paths)) for j in range(i + 1, len(paths))):
            try:
                out.append(_compose(master_cfg, config_loader, g))
            except Exception as e:
                out.append(e)
            continue
        cell = copy.deepcopy(base)
        for d in ds:
            _apply(cell, d)
        out.append(cell)
    return out
