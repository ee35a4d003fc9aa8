"""Typed run configs from plain containers (what a sweep plan and a job payload carry).

Shared by ``fp8rl.launch.grid`` (validation of every cell) and ``fp8rl.launch.job`` (the job
rebuilds its cell's config), so that neither imports the other.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Mapping
from typing import Any


def build_dataclass(cls: type, data: Mapping[str, Any], where: str = ""):
    """Construct dataclass ``cls`` (and nested dataclass fields) from plain containers.

    The values were already type-checked by Hydra against the same dataclasses (the schema is
    built from them), so this only recurses into nested dataclasses and calls the
    constructors, whose ``__post_init__`` validates; unknown keys raise. (Building through
    ``OmegaConf.structured`` + ``to_object`` gives the same objects at ~10x the cost.)
    """
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where or cls.__name__}: unknown key(s) {unknown}; valid keys: {sorted(names)}")
    kwargs = {}
    for k, v in data.items():
        t = hints.get(k)
        if dataclasses.is_dataclass(t) and isinstance(v, Mapping):
            kwargs[k] = build_dataclass(t, v, f"{where}.{k}" if where else k)
        elif isinstance(v, list):
            kwargs[k] = copy.deepcopy(v)
        else:
            kwargs[k] = v
    return cls(**kwargs)
