"""Collect a sweep's run directories into tidy pandas tables.

``collect(SWEEP_DIR)`` reads ``manifest.json`` and every run directory of one or more sweeps
(the format of ``fp8rl.runs``; docs/design.md, "The run directory") and returns a
:class:`Collection` with

- ``runs``: one row per grid cell / run directory: ``sweep, run, name, hash, algorithm, model,
  fp8, clip, seed, scale, arm, state, status_step, reason, cell, in_manifest, n_rows,
  first_step, last_step, truncated_tail, bad_lines, duplicate_steps, code, cpu, steps_configured,
  summary, run_dir`` (``code``, ``cpu``: where the numbers come from, ``analysis.rundir_read.run_origin``;
  ``analysis.pooling`` groups runs by them);
- ``steps``: one row per (run, logged step): ``run, step``, the axes and ``arm``, and one
  float column per metric seen in any run (NaN where a run did not log it: missing optional
  metrics, non-finite values written as ``null``, runs of different lengths);
- ``evals``: one row per (run, step, dataset, statistic, engine): ``run, step, dataset, stat
  ("avg@k" | "pass@k" | "greedy"), k, n, value, precision`` ("own": the arm's rollout engine,
  ``eval/`` keys; "bf16": a BF16 engine on the same weights, ``eval_bf16/``) and the axes;
- ``problems``: every cell that is not a finished run, with why: ``missing`` (in the manifest,
  no run directory or an empty one), ``failed`` (status FAILED), ``incomplete`` (RUNNING,
  PREEMPTED, no status.json, or DONE before the ``steps`` its config.yaml asks for), ``damaged`` (a file of the run
  cannot be trusted, ``analysis.damage``: ``status.json``, ``provenance.json`` or ``config.yaml``
  cannot be read (not JSON/YAML, not UTF-8, not a mapping), or the run says DONE at step S while
  its ``metrics.jsonl`` is missing or ends before S; the reason names the file, the error and the
  fix, and the cell's logged steps, evaluations and summary are left out of ``steps``, ``evals``
  and every table until it is fixed), ``unlisted`` (a run directory
  the manifest does not name);
- ``notes``: data-quality remarks (a truncated last line dropped, corrupt lines skipped,
  duplicated steps de-duplicated, no manifest).

Nothing is dropped silently: a cell that is missing or broken is a row of ``runs`` and of
``problems`` and shows up in the report.

Speed. The JSONL parsing dominates (a 500-run x 2,000-step sweep with every metric of docs/design.md
is about 1 GB of JSON). Each file is read in one go and parsed with a single ``loads`` call on
the lines joined into one JSON array (``orjson`` when installed, the standard library
otherwise; a file ``orjson`` refuses, e.g. one with ``NaN`` literals written by another tool,
is re-parsed with the standard library). Rows are grouped by their key sequence (rows written
by one writer share it) and each group becomes a 2-D float array with one ``np.fromiter``, so
no per-value Python work is done beyond the parse. ``workers > 1`` parses runs in worker
processes. With ``cache_dir`` the parsed columns of each ``metrics.jsonl`` are kept (a ``.npy``
and a ``.json`` per run) together with the byte offset they cover; since the file is append-only, a
later collect parses only the appended lines (a file that was replaced, e.g. by a resume's
``truncate_after``, is re-parsed whole). ``benchmarks/bench_collect.py`` measures all of this
against a plain ``json.loads`` loop; the numbers are in ``docs/analysis.md``.

Choices: a run's *final* evaluation (:func:`final_evals`) is the ``eval/<dataset>/<stat>``
value in ``summary.json`` when present (the backend's final numbers, docs/design.md), else the eval
row with the largest step. When several rows share a step, the last one wins (a resume that
did not truncate), and a note says so.

Modules: this one discovers the cells of a sweep and classifies them; ``analysis.rundir_read``
reads one run directory (and keeps the metrics cache), ``analysis.jsonl`` parses JSONL,
``analysis.evals`` handles evaluations (``final_evals``) and ``analysis.frames`` holds
:class:`Collection` and builds the ``steps`` frame. Their public names are importable from here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.arms import arm_label, with_variant
from analysis.damage import metrics_damage, unreadable
from analysis.evals import build_evals, eval_entries, final_evals
from analysis.frames import (
    CELL_DAMAGED,
    CELL_FAILED,
    CELL_INCOMPLETE,
    CELL_MISSING,
    CELL_OK,
    CELL_UNLISTED,
    EVAL_COLUMNS,
    RUN_COLUMNS,
    Collection,
    build_steps,
)
from analysis.jsonl import _orjson, parse_jsonl, parse_jsonl_bytes, rows_to_columns
from analysis.rundir_read import load_run
from fp8rl.runs.identity import parse_run_name
from fp8rl.runs.manifest import AXES, MANIFEST_FILE, read_manifest
from fp8rl.runs.rundir import (
    CONFIG_FILE,
    DONE,
    EVAL_FILE,
    FAILED,
    METRICS_FILE,
    STATUS_FILE,
    SUMMARY_FILE,
)

#: What ``from analysis.collect import ...`` offers (the split modules' public names included).
__all__ = [
    "CELL_DAMAGED", "CELL_FAILED", "CELL_INCOMPLETE", "CELL_MISSING", "CELL_OK", "CELL_UNLISTED",
    "EVAL_COLUMNS", "RUN_COLUMNS", "Collection", "_orjson", "collect", "eval_entries", "final_evals",
    "parse_jsonl", "parse_jsonl_bytes", "rows_to_columns",
]


def _axes_from_name(run: str) -> dict:
    try:
        d = parse_run_name(run)
    except ValueError:
        return {a: None for a in AXES}
    return {**{a: d.get(a) for a in AXES}, "scale": None}


def _classify(loaded: dict, in_manifest: bool) -> tuple[str, str | None, bool]:
    """``(cell, reason, damaged)`` of one cell; a damaged one (``analysis.damage``) names the file and
    the fix, and its logged steps are left out (``damaged``: also for an unlisted damaged run)."""
    if not loaded.get("exists"):
        return CELL_MISSING, "no run directory", False
    st = loaded.get("status")
    has_data = loaded.get("has_config") or loaded.get("has_metrics")
    steps = loaded.get("steps", ())
    damaged_origin = loaded.get("origin_damaged")
    if st is None:
        if not has_data:
            return CELL_MISSING, "empty run directory (never started)", False
        cell, why = CELL_INCOMPLETE, "no status.json"
    elif st.get("__corrupt__"):
        cell, why = CELL_DAMAGED, unreadable(STATUS_FILE, st["__corrupt__"])
    elif damaged_origin:
        cell, why = CELL_DAMAGED, unreadable(*damaged_origin)
    elif (lost := metrics_damage(st.get("state"), st.get("step"), bool(loaded.get("has_metrics")),
                                 [int(x) for x in steps])) is not None:
        cell, why = CELL_DAMAGED, lost
    elif st.get("state") == DONE and _short_of(loaded, st) is not None:
        cell, why = CELL_INCOMPLETE, _short_of(loaded, st)
    elif st.get("state") == DONE:
        cell, why = CELL_OK, None
    elif st.get("state") == FAILED:
        cell, why = CELL_FAILED, st.get("reason") or "FAILED"
    else:
        why = f"{st.get('state')} at step {st.get('step')}"
        if st.get("reason"):
            why += f": {st['reason']}"
        cell = CELL_INCOMPLETE
    if cell != CELL_DAMAGED and damaged_origin:  # no status.json, or not finished: still name the file
        cell, why = CELL_DAMAGED, f"{why}; {unreadable(*damaged_origin)}"
    if not in_manifest:
        return CELL_UNLISTED, f"run directory not in manifest ({cell}{': ' + why if why else ''})", cell == CELL_DAMAGED
    return cell, why, cell == CELL_DAMAGED


def _short_of(loaded: dict, st: dict) -> str | None:
    """Why a DONE run is incomplete: it stopped before the ``steps`` its config.yaml asks for
    (its status step, else its last logged step); None when it reached them or nothing says."""
    want = loaded.get("steps_configured")
    got = st.get("step")
    if got is None and len(loaded.get("steps", ())):
        got = int(loaded["steps"][-1])
    if want is None or got is None or int(got) >= int(want):
        return None
    return f"DONE at step {int(got)} of the {int(want)} its config.yaml asks for"


def _progress(iterable, total: int, progress: bool | None, desc: str):
    if progress is None:
        progress = total >= 50
    if not progress:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="run", leave=False)


_NOT_VARIANT_KEYS = frozenset((*AXES, "seeds"))


def _variants(overrides: Sequence[Sequence[str]]) -> list[str]:
    """Per cell, the options beyond the grid axes whose values differ between the cells.

    ``overrides`` are the manifest cells' command-line overrides. Axis keys (``fp8=``, ``seed=``,
    ...), ``+``/``~`` group additions and options every cell shares are left out; what is left
    (``calibration_ablation``: ``clip.period``, ``clip.init_bounds``, ``clip.upper_rule``) is
    returned as ``"key=value key=value"`` in the order the keys first appear, "" when none.
    """
    parsed: list[dict[str, str]] = []
    order: dict[str, None] = {}
    for ovs in overrides:
        d = {}
        for o in ovs:
            key, eq, value = str(o).partition("=")
            if not eq or key.startswith(("+", "~")) or key in _NOT_VARIANT_KEYS:
                continue
            d[key] = value
            order.setdefault(key, None)
        parsed.append(d)
    varying = [k for k in order if len({d.get(k) for d in parsed}) > 1]
    return [" ".join(f"{k}={d[k]}" for k in varying if k in d) for d in parsed]


def _discover(sweep_dir: Path) -> tuple[str, list[dict], list[str]]:
    """Cells of one sweep: manifest cells plus unlisted run directories."""
    notes = []
    cells: list[dict] = []
    listed: set[str] = set()
    sweep = sweep_dir.name
    if (sweep_dir / MANIFEST_FILE).exists():
        man = read_manifest(sweep_dir)
        sweep = man.sweep
        variants = _variants([c.overrides for c in man.cells])
        for c, variant in zip(man.cells, variants, strict=True):
            run = Path(c.run_dir).name
            listed.add(str(Path(c.run_dir)))
            axes = dict(c.axes)
            axes["clip"] = with_variant(axes.get("clip"), variant) if axes.get("clip") is not None else None
            cells.append({"sweep": sweep, "run": run, "name": c.name, "hash": c.hash,
                          "axes": axes, "path": sweep_dir / c.run_dir, "in_manifest": True})
    else:
        notes.append(
            f"{sweep_dir}: no {MANIFEST_FILE}; run directories were discovered by listing, so "
            "cells that never started cannot be reported"
        )
    for d in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        if d.name in listed or d.name.startswith("."):
            continue
        if not any((d / f).exists() for f in (CONFIG_FILE, STATUS_FILE, METRICS_FILE)):
            continue  # not a run directory (e.g. a report folder)
        axes = _axes_from_name(d.name)
        parsed = {}
        try:
            parsed = parse_run_name(d.name)
        except ValueError:
            pass
        cells.append({"sweep": sweep, "run": d.name,
                      "name": d.name[:-9] if parsed.get("hash") else d.name,
                      "hash": parsed.get("hash"), "axes": axes, "path": d,
                      "in_manifest": not (sweep_dir / MANIFEST_FILE).exists()})
    return sweep, cells, notes


def _distinct(sweep_dirs: list[Path], notes: list[str]) -> list[Path]:
    """``sweep_dirs`` with each directory once (the same directory named twice, or through a link,
    is read once; a note says so)."""
    out: dict[Path, Path] = {}
    for sd in sweep_dirs:
        key = sd.resolve()
        if key in out:
            notes.append(f"{sd}: the same sweep directory as {out[key]}, given twice; read once")
            continue
        out[key] = sd
    return list(out.values())


def sweep_labels(sweep_dirs: Sequence[Path], names: Sequence[str]) -> list[str]:
    """The ``sweep`` of each directory's runs: its manifest's sweep name, made unique by the end of
    its path where two directories carry one name (a sweep and its copy, one sweep run on two
    machines): ``a/main_table`` and ``b/main_table``. Run identity is ``<sweep>/<run name>`` when
    several directories are read, so it includes the directory wherever a name alone would not."""
    labels = list(names)
    for name in set(names):
        idx = [i for i, n in enumerate(names) if n == name]
        if len(idx) < 2:
            continue
        parts = [Path(sweep_dirs[i]).resolve().parts for i in idx]
        k = 1
        while k < max(map(len, parts)) and len({p[-k:] for p in parts}) < len(parts):
            k += 1
        for i, p in zip(idx, parts, strict=True):
            tail = "/".join(p[-k:]).lstrip("/") or "/"
            labels[i] = tail if p[-1] == name else f"{name} ({tail})"
    return labels


def collect(
    sweep_dirs: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    workers: int | None = None,
    progress: bool | None = None,
    engine: str = "auto",
    cache_dir: str | os.PathLike | None = None,
) -> Collection:
    """Read one or more sweep directories into a :class:`Collection`.

    Args:
        sweep_dirs: a sweep directory (holding ``manifest.json``) or a list of them.
        workers: processes parsing runs in parallel; None = 1, except for sweeps of 64 runs
            or more on machines with at least 2 cores: ``min(os.cpu_count(), 8)`` (on an idle
            2-core machine 2 workers collect 500 runs 1.8x faster than one; with the other core
            busy they are no slower).
        progress: show a progress bar; None = only for sweeps of 50 runs or more.
        engine: JSON parser, ``"auto"`` | ``"json"`` | ``"loop"`` (see :func:`parse_jsonl`).
        cache_dir: where to keep parsed ``metrics.jsonl`` columns between calls (a ``.npy`` and a
            ``.json`` per run); a later collect then parses only the lines appended since. None: no
            cache. ``python -m analysis.report`` uses ``<out>/.cache``.
    """
    if isinstance(sweep_dirs, (str, os.PathLike)):
        sweep_dirs = [sweep_dirs]
    notes: list[str] = []
    sweep_dirs = _distinct([Path(s) for s in sweep_dirs], notes)
    cells: list[dict] = []
    for sd in sweep_dirs:
        if not sd.is_dir():
            raise FileNotFoundError(f"sweep directory {sd} does not exist")
    found = [_discover(sd) for sd in sweep_dirs]
    labels = sweep_labels(sweep_dirs, [name for name, _, _ in found])
    for label, (_, cs, ns) in zip(labels, found, strict=True):
        for c in cs:
            c["sweep"] = label
        cells.extend(cs)
        notes.extend(ns)
    if len(sweep_dirs) > 1:  # runs of different sweeps may share a basename
        for c in cells:
            c["run"] = f"{c['sweep']}/{c['run']}"
    paths = [str(c["path"]) for c in cells]
    cache = None if cache_dir is None else str(cache_dir)
    if workers is None:
        cores = os.cpu_count() or 1
        workers = min(cores, 8) if len(paths) >= 64 and cores >= 2 else 1
    if workers > 1 and len(paths) > 1:
        with ProcessPoolExecutor(max_workers=workers) as ex:
            it = ex.map(load_run, paths, [engine] * len(paths), [cache] * len(paths),
                        chunksize=max(1, len(paths) // (workers * 8)))
            loaded = list(_progress(it, len(paths), progress, "collect"))
    else:
        loaded = [load_run(p, engine, cache) for p in _progress(paths, len(paths), progress, "collect")]
    return _assemble(cells, loaded, notes, sweep_dirs)


def _assemble(cells: list[dict], loaded: list[dict], notes: list[str], sweep_dirs: list[Path]) -> Collection:
    run_rows = []
    step_parts: list[tuple[int, np.ndarray, dict]] = []
    eval_parts: list[tuple[int, list]] = []
    for i, (c, ld) in enumerate(zip(cells, loaded, strict=True)):
        cell, why, damaged = _classify(ld, c["in_manifest"])
        st = ld.get("status") or {}
        steps = ld.get("steps", np.zeros(0, np.int64))
        cols = ld.get("cols", {})
        dup = 0
        if len(steps) and not (np.diff(steps) > 0).all():
            # keep the last row of each step, in step order
            rev = steps[::-1]
            _, first_rev = np.unique(rev, return_index=True)
            idx = (len(steps) - 1 - first_rev)
            dup = len(steps) - len(idx)
            steps = steps[idx]
            cols = {k: v[idx] for k, v in cols.items()}
            if dup:
                notes.append(f"{c['run']}: {dup} duplicated step row(s) in {METRICS_FILE}; kept the last of each")
        if ld.get("truncated_tail"):
            notes.append(f"{c['run']}: truncated last line of {METRICS_FILE} dropped")
        if ld.get("bad_lines"):
            notes.append(f"{c['run']}: {ld['bad_lines']} corrupt line(s) of {METRICS_FILE} skipped")
        if ld.get("eval_bad_lines"):
            notes.append(f"{c['run']}: {ld['eval_bad_lines']} corrupt/truncated line(s) of {EVAL_FILE} skipped")
        summary = ld.get("summary")
        if isinstance(summary, dict) and summary.get("__corrupt__"):
            notes.append(f"{c['run']}: {SUMMARY_FILE} unreadable; ignored")
            summary = None
        axes = c["axes"]
        run_rows.append({
            "sweep": c["sweep"], "run": c["run"], "name": c["name"], "hash": c["hash"],
            **{a: axes.get(a) for a in AXES},
            "arm": arm_label(axes.get("fp8"), axes.get("clip")),
            "state": st.get("state"), "status_step": st.get("step"), "reason": why, "cell": cell,
            "in_manifest": c["in_manifest"], "n_rows": len(steps),
            "first_step": int(steps[0]) if len(steps) else None,
            "last_step": int(steps[-1]) if len(steps) else None,
            "truncated_tail": bool(ld.get("truncated_tail", False)),
            "bad_lines": int(ld.get("bad_lines", 0)), "duplicate_steps": dup,
            "code": ld.get("code"), "cpu": ld.get("cpu"), "steps_configured": ld.get("steps_configured"),
            "summary": None if damaged else summary, "run_dir": str(c["path"]),
        })
        if damaged:  # listed with the file and the fix; the report is written from the rest
            continue
        if len(steps):
            step_parts.append((i, steps, cols))
        if ld.get("eval"):
            eval_parts.append((i, ld["eval"]))
    runs = pd.DataFrame(run_rows, columns=RUN_COLUMNS)
    for col in ("seed", "status_step", "first_step", "last_step", "steps_configured"):
        runs[col] = pd.to_numeric(runs[col], errors="coerce").astype("Int64")
    steps_df = build_steps(runs, step_parts)
    evals_df = build_evals(runs, eval_parts)
    problems = runs.loc[runs["cell"] != CELL_OK, ["sweep", "run", *AXES, "arm", "cell", "state",
                                                  "status_step", "last_step", "reason"]]
    return Collection(runs=runs, steps=steps_df, evals=evals_df,
                      problems=problems.reset_index(drop=True), notes=notes, sweep_dirs=sweep_dirs)
