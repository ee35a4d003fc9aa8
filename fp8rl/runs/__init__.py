"""Run identity, the run directory, its writers and the sweep manifest.

This package is the format contract of docs/design.md ("The run directory"): every backend writes
run directories with it and ``analysis`` reads them with it. It needs only the standard library
and PyYAML (no torch), so analysis runs anywhere.

- :mod:`fp8rl.runs.metrics`: the metric names (constants, ``TRAIN_METRICS``, ``eval_key``).
- :mod:`fp8rl.runs.identity`: ``run_name``, ``config_hash``, ``run_dir_name``.
- :mod:`fp8rl.runs.rundir`: ``RunDir`` (config, provenance, status, JSONL writers, resume,
  summary) and ``read_jsonl``.
- :mod:`fp8rl.runs.relaunch`: what a relaunch keeps and drops of a killed attempt (stale
  temporary files, the outputs of an attempt without checkpoint).
- :mod:`fp8rl.runs.safe_io`: atomic, symlink-refusing writes; ``RunDirWriteError`` (disk full,
  read-only) and ``RunDirSymlink``.
- :mod:`fp8rl.runs.manifest`: a sweep's ``manifest.json`` (``Cell``, ``write_manifest``,
  ``read_manifest``).
- :mod:`fp8rl.runs.synthetic`: fabricated sweeps with known curves, for tests, benchmarks and
  notebook demos (imported on demand; needs numpy).
"""

from fp8rl.runs import metrics
from fp8rl.runs.identity import (
    DEFAULT_EXCLUDE,
    canonical_json,
    config_hash,
    parse_run_name,
    run_dir_name,
    run_name,
)
from fp8rl.runs.manifest import AXES, MANIFEST_FILE, Cell, Manifest, read_manifest, write_manifest
from fp8rl.runs.metrics import TRAIN_METRICS, eval_key, eval_row
from fp8rl.runs.rundir import (
    DONE,
    FAILED,
    PREEMPTED,
    RUNNING,
    STATES,
    TERMINAL_STATES,
    JsonlWriter,
    RunDir,
    RunDirConflict,
    RunDirDamaged,
    read_jsonl,
)
from fp8rl.runs.safe_io import RunDirSymlink, RunDirWriteError

__all__ = [
    "AXES",
    "DEFAULT_EXCLUDE",
    "DONE",
    "FAILED",
    "MANIFEST_FILE",
    "PREEMPTED",
    "RUNNING",
    "STATES",
    "TERMINAL_STATES",
    "TRAIN_METRICS",
    "Cell",
    "JsonlWriter",
    "Manifest",
    "RunDir",
    "RunDirConflict",
    "RunDirDamaged",
    "RunDirSymlink",
    "RunDirWriteError",
    "canonical_json",
    "config_hash",
    "eval_key",
    "eval_row",
    "metrics",
    "parse_run_name",
    "read_jsonl",
    "read_manifest",
    "run_dir_name",
    "run_name",
    "write_manifest",
]
