"""Run identity: a readable name plus a short hash of the config that ran.

A run directory is named ``<algo>-<model>-<fp8>-<clip>-s<seed>-<hash8>`` (docs/design.md,
"The run directory"):

- the readable part names the grid cell, so ``ls runs/<sweep>/`` reads like the paper's grid;
- ``hash8`` is the first 8 hex digits of the SHA-256 of the fully resolved config minus an
  exclude list, so two runs that differ in any hyper-parameter never share a directory, and
  re-asking for the same config finds the same directory (resume / skip-if-DONE).

Choices made here (the design left them open):

- **Name tokens.** ``-`` separates the five parts, so no part may contain ``-``; a part is
  ``[A-Za-z0-9][A-Za-z0-9_.]*`` (letters, digits, ``_`` and ``.``; no ``/``, whitespace, ``-``).
  Config values such as ``rollout_only`` or ``0.6b`` are fine; ``qwen3-8b`` is refused with a
  message suggesting ``qwen3_8b``. This keeps :func:`parse_run_name` unambiguous.
- **Seed** is a non-negative int (``bool`` refused).
- **Canonical JSON**: keys sorted, no whitespace, tuples as lists, ``ensure_ascii``; floats use
  Python's shortest round-trip repr, so ``0.1`` hashes the same everywhere. NaN/inf are
  refused (a config with NaN is a bug). Other types (Path, enums, dataclasses) must be
  converted by the caller (e.g. ``OmegaConf.to_container(cfg, resolve=True)``); we raise
  rather than guess a spelling that would change hashes later.
- **Exclusions** are dotted key paths removed before hashing; a path that is absent is ignored.
  ``DEFAULT_EXCLUDE`` holds the keys that say *where* or *how* a run is launched and logged,
  not *what* it computes: ``paths``, ``logging``, ``launcher``, ``hydra``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping

#: Dotted config keys left out of the hash: where/how a run is launched and logged.
DEFAULT_EXCLUDE: tuple[str, ...] = ("paths", "logging", "launcher", "hydra")

_TOKEN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]*$")
_HASH_RE = re.compile(r"^[0-9a-f]{8}$")
_NAME_RE = re.compile(
    r"^(?P<algorithm>[A-Za-z0-9][A-Za-z0-9_.]*)-(?P<model>[A-Za-z0-9][A-Za-z0-9_.]*)"
    r"-(?P<fp8>[A-Za-z0-9][A-Za-z0-9_.]*)-(?P<clip>[A-Za-z0-9][A-Za-z0-9_.]*)"
    r"-s(?P<seed>\d+)(?:-(?P<hash>[0-9a-f]{8}))?$"
)


def _check_token(what: str, value: object) -> str:
    if not isinstance(value, str) or not _TOKEN_RE.match(value):
        hint = ""
        if isinstance(value, str) and "-" in value:
            hint = f" (use '_' instead of '-', e.g. {value.replace('-', '_')!r})"
        raise ValueError(
            f"run name part {what}={value!r} must be a non-empty token of letters, digits, "
            f"'_' or '.', starting with a letter or digit; '-' separates the parts, and '/' "
            f"or whitespace would break the directory name{hint}"
        )
    return value


def run_name(algorithm: str, model: str, fp8: str, clip: str, seed: int) -> str:
    """``run_name("grpo", "8b", "tensorwise", "calibrated", 0) -> "grpo-8b-tensorwise-calibrated-s0"``.

    Raises ValueError if a part is not a plain token (see the module docstring) or the seed is
    not a non-negative int.
    """
    parts = [
        _check_token("algorithm", algorithm),
        _check_token("model", model),
        _check_token("fp8", fp8),
        _check_token("clip", clip),
    ]
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"run name seed must be a non-negative int, got {seed!r}")
    return "-".join([*parts, f"s{seed}"])


def parse_run_name(name: str) -> dict:
    """Inverse of :func:`run_name` (and of :func:`run_dir_name`).

    ``"grpo-8b-bf16-vanilla-s1-0123abcd"`` ->
    ``{"algorithm": "grpo", "model": "8b", "fp8": "bf16", "clip": "vanilla", "seed": 1,
    "hash": "0123abcd"}`` (``hash`` is None when the name has none). Raises ValueError on a
    name that does not have this shape.
    """
    m = _NAME_RE.match(name)
    if m is None:
        raise ValueError(
            f"{name!r} is not a run name of the form algo-model-fp8-clip-s<seed>[-<hash8>]"
        )
    out = m.groupdict()
    out["seed"] = int(out["seed"])
    return out


def run_dir_name(name: str, hash8: str) -> str:
    """The run directory's basename: ``f"{name}-{hash8}"`` (both validated)."""
    parse_run_name(name)
    if not isinstance(hash8, str) or not _HASH_RE.match(hash8):
        raise ValueError(f"config hash must be 8 lowercase hex digits, got {hash8!r}")
    return f"{name}-{hash8}"


def _canonical(obj: object, where: str) -> object:
    """Plain JSON types with sorted-key-independent structure; raises on anything else."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ValueError(f"config value at {where or '<root>'} is {obj!r}; NaN/inf cannot be hashed")
        return float(obj)
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"config key {k!r} at {where or '<root>'} is not a string")
            out[k] = _canonical(v, f"{where}.{k}" if where else k)
        return out
    if isinstance(obj, (list, tuple)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(
        f"config value at {where or '<root>'} has type {type(obj).__name__}; convert the config "
        "to plain dict/list/str/int/float/bool/None first (e.g. OmegaConf.to_container(cfg, "
        "resolve=True)) so the hash does not depend on a type's repr"
    )


def _drop(cfg: dict, dotted: str) -> None:
    node: object = cfg
    parts = dotted.split(".")
    for p in parts[:-1]:
        if not isinstance(node, dict) or p not in node:
            return
        node = node[p]
    if isinstance(node, dict):
        node.pop(parts[-1], None)


def drop_defaults(config: Mapping, defaults: Mapping[str, object]) -> dict:
    """A copy of ``config`` without the dotted keys of ``defaults`` whose value equals the default.

    For options added after runs were made: a key at its default is left out of the hash (and of
    a resume's config comparison), so a run made before the key existed keeps its identity; any
    other value is part of it. Keys absent from ``config`` are ignored."""
    out = copy.deepcopy(dict(config))
    for dotted, default in defaults.items():
        node: object = out
        parts = dotted.split(".")
        for p in parts[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and parts[-1] in node and node[parts[-1]] == default:
            del node[parts[-1]]
    return out


def canonical_json(config: Mapping, exclude: Iterable[str] = DEFAULT_EXCLUDE) -> str:
    """The exact string that :func:`config_hash` hashes (handy for debugging a hash change)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping, got {type(config).__name__}")
    if isinstance(exclude, str):
        raise TypeError("exclude must be an iterable of dotted keys, not a single string")
    cfg = copy.deepcopy(_canonical(config, ""))
    for dotted in exclude:
        _drop(cfg, dotted)
    return json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def config_hash(config: Mapping, exclude: Iterable[str] = DEFAULT_EXCLUDE) -> str:
    """First 8 hex digits of SHA-256 of the canonical JSON of ``config`` minus ``exclude``.

    Args:
        config: the fully resolved config as plain nested dicts/lists/scalars.
        exclude: dotted key paths to drop before hashing (default :data:`DEFAULT_EXCLUDE`).
    """
    return hashlib.sha256(canonical_json(config, exclude).encode("ascii")).hexdigest()[:8]


def _get(config: object, dotted: str) -> object:
    for part in dotted.split("."):
        if not isinstance(config, dict) or part not in config:
            return None
        config = config[part]
    return config


def changed_values(old: object, new: object, keys: Iterable[str]) -> dict[str, dict]:
    """``{key: {"before": old value, "now": new value}}`` for each dotted key whose value differs
    (a resume's changes outside the run identity, recorded in provenance)."""
    return {k: {"before": _get(old, k), "now": _get(new, k)} for k in keys if _get(old, k) != _get(new, k)}
