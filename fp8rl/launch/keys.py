"""Every key and config group a launch may set, and the check that refuses any other.

Hydra accepts ``+key=value`` for any key (``+`` forces the key into a structured config) and
``hydra/launcher=...`` for any installed Hydra launcher; ``python -m experiments.launch`` would
then run as if they were not there: a top-level key that no backend reads is dropped, and the
``fp8rl`` sweeper launches cells with its own launchers whatever ``hydra/launcher`` says. So
every override is checked against the typed schema (``fp8rl.launch.schema``: launch fields,
the run config, the backends' settings blocks) and the config groups of ``sweeps/`` before
anything runs: an unknown key or group is an error naming it and the nearest valid keys
(``difflib``), exit status 2 (:class:`UnknownKeyError`).

Checked twice: on the command line, before Hydra composes anything (``experiments/launch.py``;
Hydra's own message for ``stepz=3`` would advise ``+stepz=3``, which it then accepts), and in
``fp8rl.launch.grid.plan_sweep`` on every cell's overrides (sweep files' axes included) and on
every composed config (:func:`unknown_composed_keys`).

Choices: below a field typed ``dict`` or ``Any`` every key is accepted (free-form blocks such
as extra arguments); ``hydra.*`` keys are Hydra's own and are left to Hydra, but for
``hydra/launcher``, ``hydra.launcher.*`` and ``hydra/sweeper`` (ours does the launching).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fp8rl.launch.errors import SweepError

#: The config tree of ``python -m experiments.launch``.
SWEEPS_DIR = Path(__file__).resolve().parents[2] / "sweeps"
#: A schema node below which any key is valid (a ``dict`` or ``Any`` field).
OPEN = "open"
#: Hydra options of the launch's command line that take a value in the next argument.
_HYDRA_VALUE_FLAGS = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "-p",
                      "--package", "--experimental-rerun", "-sc", "--shell-completion")


class UnknownKeyError(SweepError):
    """An override names a key or config group the launch does not have (exit status 2)."""

    exit_status = 2


def _node_of(tp: Any) -> Any:
    """The schema subtree of a field type: a dict for a dataclass, ``OPEN``, or ``None`` (a leaf)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:  # X | None
        tp = args[0]
    if dataclasses.is_dataclass(tp):
        return _tree_of(tp)
    origin = typing.get_origin(tp) or tp
    if tp is Any or origin in (dict, Mapping, typing.Dict):  # noqa: UP006 (the typing alias too)
        return OPEN
    return None


def _tree_of(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: _node_of(hints.get(f.name, Any)) for f in dataclasses.fields(cls)}


@functools.cache
def schema_tree() -> dict[str, Any]:
    """``{key: subtree | OPEN | None}`` of the launch schema (``fp8rl.launch.schema.build_schema``)."""
    from fp8rl.launch.schema import build_schema

    return _tree_of(build_schema())


def config_groups(sweeps_dir: Path = SWEEPS_DIR) -> list[str]:
    """The config groups of ``sweeps/`` (its sub-directories): ``algorithm``, ``clip``, ``sweep``, ..."""
    return sorted(p.name for p in sweeps_dir.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def _paths(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        path = f"{prefix}{k}"
        out.append(path)
        if isinstance(v, dict):
            out += _paths(v, path + ".")
    return out


def nearest(key: str, groups: Iterable[str] = (), n: int = 4) -> list[str]:
    """The valid keys nearest to ``key``: its misspelt part among its siblings, then its last part
    anywhere in the schema (``clip.epslow`` -> ``algorithm.eps_low``)."""
    tree: Any = schema_tree()
    parts = key.split(".")
    prefix: list[str] = []
    siblings: list[str] = [*tree, *groups]
    for p in parts:
        if not isinstance(tree, dict) or p not in tree:
            break
        prefix.append(p)
        tree = tree[p]
        siblings = list(tree) if isinstance(tree, dict) else []
    bad = parts[len(prefix)] if len(prefix) < len(parts) else parts[-1]
    out = [".".join([*prefix, s]) for s in difflib.get_close_matches(bad, sorted(set(siblings)), n=n, cutoff=0.6)]
    by_leaf: dict[str, list[str]] = {}
    for p in _paths(schema_tree()):
        by_leaf.setdefault(p.rsplit(".", 1)[-1], []).append(p)
    for m in difflib.get_close_matches(parts[-1], sorted(by_leaf), n=n, cutoff=0.75):
        out += [p for p in by_leaf[m] if p not in out]
    return out[:n]


def unknown_path(key: str) -> str | None:
    """``None`` if the dotted ``key`` is in the schema, else its first unknown prefix."""
    tree: Any = schema_tree()
    parts = key.split(".")
    for i, p in enumerate(parts):
        if tree is OPEN:
            return None
        if not isinstance(tree, dict) or p not in tree:
            return ".".join(parts[: i + 1])
        tree = tree[p]
    return None


def _hydra_refusal(key: str, override: str) -> str | None:
    if key in ("hydra/launcher", "hydra.launcher") or key.startswith("hydra.launcher."):
        from fp8rl.launch.launchers import LAUNCHERS

        return (f"{override}: Hydra's launcher is not used by experiments.launch (its sweeper validates "
                "every cell, then runs or submits them with fp8rl's own launchers), so this would do "
                f"nothing; choose the launcher with launcher=NAME ({', '.join(LAUNCHERS.names())}), e.g. "
                "launcher=slurm cluster=NAME")
    if key == "hydra/sweeper" or key.startswith("hydra.sweeper._target_"):
        return (f"{override}: experiments.launch needs its own sweeper (hydra/sweeper: fp8rl), which "
                "validates every cell before anything runs; give the grid as overrides instead "
                "(fp8=bf16,tensorwise) or with +sweep=NAME")
    return None


def override_key_errors(overrides: Iterable[str], groups: Sequence[str] | None = None) -> list[str]:
    """One message per override whose key or config group the launch does not have.

    ``overrides`` are Hydra override strings (``key=value``, ``+key=value``, ``~key``,
    ``group=option``, ``hydra/launcher=...``); ``groups``: the config groups (default: those of
    ``sweeps/``). Values are not checked here (Hydra and the cell's config do that).
    """
    groups = config_groups() if groups is None else list(groups)
    errors, seen = [], set()
    for ov in overrides:
        key = ov.split("=", 1)[0].lstrip("~+").split("@", 1)[0]
        if not key or key in seen:
            continue
        seen.add(key)
        refused = _hydra_refusal(key, ov)
        if refused:
            errors.append(refused)
            continue
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue  # Hydra's own settings, checked by Hydra
        top = key.split("/", 1)[0]
        if "/" in key and top in groups:
            continue
        if key in groups:
            continue
        bad = unknown_path(key)
        if bad is None:
            continue
        near = nearest(key, groups if "." not in key else ())
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        what = "key" if bad == key else f"key {bad!r} of"
        errors.append(f"{ov}: unknown {what} {key!r}{hint} (python -m experiments.launch --help lists the "
                      "main keys and groups; add --cfg job to print every key)")
    return errors


def unknown_composed_keys(config: Mapping[str, Any]) -> list[str]:
    """Dotted keys of a composed config (``hydra`` node dropped) that the schema does not have."""
    def walk(node: Mapping[str, Any], tree: Any, prefix: str) -> list[str]:
        out = []
        for k, v in node.items():
            if tree is OPEN:
                return []
            if not isinstance(tree, dict) or k not in tree:
                out.append(f"{prefix}{k}")
            elif isinstance(v, Mapping) and isinstance(tree[k], dict):
                out += walk(v, tree[k], f"{prefix}{k}.")
        return out

    return walk({k: v for k, v in config.items() if k != "hydra"}, schema_tree(), "")


def cli_overrides(argv: Sequence[str]) -> list[str]:
    """The override arguments of a Hydra command line (options and their values left out)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in _HYDRA_VALUE_FLAGS:
            skip = True
            continue
        if not a.startswith("-") and ("=" in a or a.startswith("~")):
            out.append(a)
    return out


def cli_groups(argv: Sequence[str]) -> list[str]:
    """The config groups a command line can use: those of ``sweeps/`` and of every ``--config-dir``."""
    dirs = []
    for i, a in enumerate(argv):
        if a in ("-cd", "--config-dir") and i + 1 < len(argv):
            dirs.append(argv[i + 1])
        elif a.startswith("--config-dir="):
            dirs.append(a.split("=", 1)[1])
    groups = set(config_groups())
    for d in dirs:
        if Path(d).is_dir():
            groups.update(config_groups(Path(d)))
    return sorted(groups)


def raise_unknown(errors: Sequence[str]) -> None:
    """Raise :class:`UnknownKeyError` listing ``errors`` (nothing was run)."""
    if errors:
        raise UnknownKeyError("unknown key(s) or config group(s); nothing was run, submitted or written:\n  "
                              + "\n  ".join(errors))
