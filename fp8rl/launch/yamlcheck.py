"""YAML errors in the config files a launch reads, found before Hydra composes anything.

Hydra parses a sweep file when it composes the config and answers a YAML error with a 100-line
traceback through its own internals. ``experiments.launch`` calls :func:`yaml_errors` first: it
parses (``yaml.safe_load``) the files this command line selects, in ``sweeps/`` and every
``--config-dir``: the primary ``config.yaml``, the options its ``defaults`` list names, the
option of every ``group=value`` override (each value of a comma-separated list, ``+sweep=NAME``
included), and the options the selected files name in their own ``defaults`` or grid
(``hydra.sweeper.params``). A file that does not parse is reported in one line with its path,
line and column (``sweeps/sweep/x.yaml, line 8, column 1: expected ...``). Files the command
line does not select are not read: a broken scratch file stops no other launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from fp8rl.launch.keys import SWEEPS_DIR, cli_overrides


def config_dirs(argv: Sequence[str]) -> list[Path]:
    """``sweeps/`` and every ``--config-dir`` of the command line that exists."""
    dirs = [SWEEPS_DIR]
    for i, a in enumerate(argv):
        if a in ("-cd", "--config-dir") and i + 1 < len(argv):
            dirs.append(Path(argv[i + 1]))
        elif a.startswith("--config-dir="):
            dirs.append(Path(a.split("=", 1)[1]))
    return [d for d in dirs if d.is_dir()]


def describe(path: Path, e: Exception) -> str:
    """One line: the file, the line and column where parsing stopped, and why."""
    mark = getattr(e, "problem_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or " ".join(str(e).split())
    context = getattr(e, "context", None)
    return f"{path}{where}: {problem}" + (f" ({context})" if context else "")


def _selections(doc: object) -> list[tuple[str, str]]:
    """``(group, option)`` pairs a parsed config file names: its ``defaults`` list and its grid."""
    out: list[tuple[str, str]] = []
    if not isinstance(doc, dict):
        return out
    for entry in doc.get("defaults") or []:
        if isinstance(entry, dict):
            for k, v in entry.items():
                out += [(str(k).split()[-1], str(v))] if isinstance(v, str) else []
    hydra = doc.get("hydra")
    sweeper = hydra.get("sweeper") if isinstance(hydra, dict) else None
    params = sweeper.get("params") if isinstance(sweeper, dict) else None
    if isinstance(params, dict):
        for k, v in params.items():
            out += [(str(k), o.strip()) for o in str(v).split(",")]
    return out


def yaml_errors(argv: Sequence[str]) -> list[str]:
    """One line per selected config file that is not valid YAML (module docstring)."""
    dirs = config_dirs(argv)
    todo: list[Path] = [d / "config.yaml" for d in dirs]
    for ov in cli_overrides(argv):
        key, _, value = ov.lstrip("+~").partition("=")
        todo += [d / key / f"{o.strip()}.yaml" for d in dirs for o in value.split(",") if o.strip()]
    seen: set[Path] = set()
    errors = []
    while todo:
        path = todo.pop(0)
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        try:
            doc = yaml.safe_load(path.read_bytes().decode("utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            errors.append(describe(path, e))
            continue
        todo += [d / group / f"{option}.yaml" for group, option in _selections(doc) for d in dirs
                 if "/" not in group and "${" not in option]
    return errors
