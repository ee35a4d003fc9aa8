"""Collect a sweep's run directories into tidy pandas tables.

``collect(SWEEP_DIR)`` reads ``manifest.json`` and every run directory of one or more sweeps
(the format of ``fp8rl.runs``; docs/design.md, "The run directory") and returns a
:class:`Collection` with

- ``runs``: one row per grid cell / run directory: ``sweep, run, name, hash, algorithm, model,
  fp8, clip, seed, scale, arm, state, status_step, reason, cell, in_manifest, n_rows,
  first_step, last_step, truncated_tail, bad_lines, duplicate_steps, summary, run_dir``;
- ``steps``: one row per (run, logged step): ``run, step``, the axes and ``arm``, and one
  float column per metric seen in any run (NaN where a run did not log it: missing optional
  metrics, non-finite values written as ``null``, runs of different lengths);
- ``evals``: one row per (run, step, dataset, statistic): ``run, step, dataset, stat
  ("avg@k" | "pass@k"), k, n, value`` and the axes;
- ``problems``: every cell that is not a finished run, with why: ``missing`` (in the manifest,
  no run directory or an empty one), ``failed`` (status FAILED), ``incomplete`` (RUNNING,
  PREEMPTED, or no status.json), ``damaged`` (its ``status.json`` cannot be read: not JSON, not
  UTF-8, not a mapping; the reason names the file and the error), ``unlisted`` (a run directory
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
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.arms import arm_label, arm_order_key, with_variant
from fp8rl.runs import metrics as M
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

try:  # optional fast parser
    import orjson as _orjson
except ImportError:  # pragma: no cover - exercised where orjson is absent
    _orjson = None

CELL_OK, CELL_MISSING, CELL_FAILED, CELL_INCOMPLETE, CELL_UNLISTED, CELL_DAMAGED = (
    "ok",
    "missing",
    "failed",
    "incomplete",
    "unlisted",
    "damaged",
)
RUN_COLUMNS = [
    "sweep", "run", "name", "hash", *AXES, "arm", "state", "status_step", "reason", "cell",
    "in_manifest", "n_rows", "first_step", "last_step", "truncated_tail", "bad_lines",
    "duplicate_steps", "summary", "run_dir",
]
EVAL_COLUMNS = ["run", "step", "dataset", "stat", "k", "n", "value"]


# --- parsing -----------------------------------------------------------------------------


def _loads(data: bytes):
    if _orjson is not None:
        try:
            return _orjson.loads(data)
        except _orjson.JSONDecodeError:
            pass  # e.g. NaN literals: the standard library accepts them
    return json.loads(data)


@dataclasses.dataclass
class ParsedJsonl:
    """Rows of one JSONL file and what had to be repaired to read it."""

    rows: list
    truncated_tail: bool = False
    bad_lines: int = 0


def parse_jsonl(path: str | os.PathLike, *, engine: str = "auto") -> ParsedJsonl:
    """Read a JSONL file fast; tolerant of a truncated last line and of corrupt lines.

    ``engine`` is ``"auto"`` (orjson when installed), ``"json"`` (standard library) or
    ``"loop"`` (one ``json.loads`` per line: the reference). A missing file gives no rows.
    A final line without newline that does not parse is dropped (``truncated_tail``); corrupt
    lines elsewhere are skipped and counted (``bad_lines``) rather than failing the sweep.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return ParsedJsonl([])
    return parse_jsonl_bytes(data, engine=engine)[0]


def parse_jsonl_bytes(data: bytes, *, engine: str = "auto") -> tuple[ParsedJsonl, int]:
    """:func:`parse_jsonl` on bytes; also returns how many bytes were consumed (everything
    but a truncated last line, which a later, longer read may complete)."""
    truncated = False
    consumed = len(data)
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        tail = data[cut:]
        try:
            obj = json.loads(tail)
            ok = isinstance(obj, dict)
        except ValueError:
            ok = False
        if ok:
            data = data + b"\n"
        else:
            truncated = bool(tail.strip())
            data = data[:cut]
            consumed = cut
    if data.endswith(b"\n") and not data.endswith(b"\n\n") and not data.isspace():
        body = None  # common case: one final newline, no copy needed to strip it
    else:
        body = data.rstrip(b"\n")
        if not body.strip():
            return ParsedJsonl([], truncated), consumed
    if engine != "loop":
        loads = _loads if engine == "auto" else json.loads
        try:
            if body is None:  # "[" + lines joined by "," + "]" with two copies, not three
                doc = bytearray(b"[")
                doc += data
                doc = doc.replace(b"\n", b",")
                doc[-1] = 0x5D  # the final newline's comma -> "]"
                doc = doc if loads is _loads else bytes(doc)
            else:
                doc = b"[" + body.replace(b"\n", b",") + b"]"
            rows = loads(doc)
            if not rows or set(map(type, rows)) == {dict}:
                return ParsedJsonl(rows, truncated), consumed
        except ValueError:
            pass  # blank or corrupt lines: fall through to the per-line reader
    rows, bad = [], 0
    for line in (data if body is None else body).split(b"\n"):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(obj, dict):
            rows.append(obj)
        else:
            bad += 1
    return ParsedJsonl(rows, truncated, bad), consumed


def rows_to_columns(rows: Sequence[dict]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Metric rows -> (steps int64 [N], {metric: float64 [N]}); rows without an int step dropped.

    Values that are not numbers (null, lists, objects) become NaN; booleans become 0/1. (A
    string value is read with ``float()`` when every value of its key group converts, else as
    NaN; the backends never log strings.) Rows are grouped by key sequence and each group is converted with one ``np.fromiter``
    into a [rows, keys] block. The common case, every row with the first row's key sequence
    (checked with one C-level pass over ``map(list, rows)``), skips the grouping and the
    NaN-filled scatter: the columns are the rows of the transposed block.
    """
    n = len(rows)
    if n == 0:
        return np.zeros(0, np.int64), {}
    sig0 = tuple(rows[0])
    sig0l = list(sig0)
    if all(map(sig0l.__eq__, map(list, rows))):
        cols = dict(zip(sig0, _block(rows, len(sig0)).T.copy(), strict=True))
    else:
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(rows):
            sig = tuple(r)
            g = groups.get(sig)
            if g is None:
                groups[sig] = [i]
            else:
                g.append(i)
        cols = {}
        for sig, idx in groups.items():
            block = _block([rows[i] for i in idx], len(sig))
            ia = np.asarray(idx)
            for j, key in enumerate(sig):
                col = cols.get(key)
                if col is None:
                    col = cols[key] = np.full(n, np.nan)
                col[ia] = block[:, j]
    step = cols.pop(M.STEP, np.full(n, np.nan))
    keep = np.isfinite(step) & (step >= 0) & (step == np.floor(step))
    if not keep.all():
        step = step[keep]
        cols = {k: v[keep] for k, v in cols.items()}
    return step.astype(np.int64), cols


def _block(grp: Sequence[dict], width: int) -> np.ndarray:
    """Rows sharing one key sequence -> float64 [len(grp), width] (one ``np.fromiter``)."""
    try:
        block = np.fromiter(
            itertools.chain.from_iterable(map(dict.values, grp)),
            dtype=np.float64,
            count=len(grp) * width,
        )
    except (TypeError, ValueError, OverflowError):
        block = np.array([[_num(v) for v in r.values()] for r in grp], dtype=np.float64)
    return block.reshape(len(grp), width)


def _num(v) -> float:
    if v is None or isinstance(v, (str, list, dict)):
        return np.nan
    try:
        return float(v)
    except (TypeError, ValueError, OverflowError):
        return np.nan


def eval_entries(rows: Iterable[dict]) -> list[tuple]:
    """eval.jsonl rows -> ``(step, dataset, stat, k, n, value)`` tuples.

    Accepts the canonical layout (``eval/<ds>/avg@k`` keys plus ``k``/``n`` fields), a numeric
    k in the key (``eval/<ds>/avg@16``), rows holding several datasets, and bare
    ``avg@k``/``pass@k`` keys next to a ``dataset`` field.
    """
    out = []
    for r in rows:
        step = r.get(M.STEP)
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        k_row, n_row, ds_row = r.get(M.EVAL_K), r.get(M.EVAL_N), r.get(M.EVAL_DATASET)
        for key, value in r.items():
            parsed = M.parse_eval_key(key)
            if parsed is None and ds_row is not None and "/" not in key:
                parsed = M.parse_eval_key(f"eval/{ds_row}/{key}")
            if parsed is None:
                continue
            ds, stat, k = parsed
            out.append((step, ds, stat, k if k is not None else k_row, n_row, _num(value)))
    return out


def _read_json(path: Path):
    """The JSON object in ``path``, None when absent, ``{"__corrupt__": why}`` when it cannot be read."""
    try:
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # ValueError: not JSON, not UTF-8
        return {"__corrupt__": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    if not isinstance(value, dict):
        return {"__corrupt__": f"holds a JSON {type(value).__name__}, not an object"}
    return value


_SIG = 64  # bytes before the cached offset that must be unchanged for an incremental read


def _cache_path(cache_dir: str, run_dir: Path) -> Path:
    """Stem of a run's cache files: ``<stem>.npy`` (rows = step + metrics) and ``<stem>.json``."""
    key = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:20]
    return Path(cache_dir) / f"{run_dir.name[:60]}-{key}"


def _cache_load(stem: Path) -> dict | None:
    try:
        meta = json.loads(stem.with_suffix(".json").read_text())
        if meta.get("version") != _CACHE_VERSION:
            return None
        data = np.load(stem.with_suffix(".npy"), allow_pickle=False)
        names = meta["columns"]
        if data.ndim != 2 or data.shape[0] != len(names) + 1 or data.shape[1] != meta["rows"]:
            return None
        cols = {k: data[i + 1] for i, k in enumerate(names)}
        return {**meta, "steps": data[0].astype(np.int64), "cols": cols}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cache_save(stem: Path, meta: dict, steps: np.ndarray, cols: dict) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    names = list(cols)
    data = np.empty((len(names) + 1, len(steps)), dtype=np.float64)
    data[0] = steps
    for i, k in enumerate(names):
        data[i + 1] = cols[k]
    tmp = stem.parent / f".{stem.name}.{os.getpid()}.tmp.npy"
    np.save(tmp, data, allow_pickle=False)
    os.replace(tmp, stem.with_suffix(".npy"))
    full = {**meta, "version": _CACHE_VERSION, "columns": names, "rows": len(steps)}
    tmp_json = stem.parent / f".{stem.name}.{os.getpid()}.tmp.json"
    tmp_json.write_text(json.dumps(full))
    os.replace(tmp_json, stem.with_suffix(".json"))


_CACHE_VERSION = 1


def _read_metrics(p: Path, engine: str, cache_dir: str | None) -> tuple[np.ndarray, dict, bool, int]:
    """Parse metrics.jsonl, incrementally when ``cache_dir`` holds an earlier parse.

    The file is append-only while a run writes it, so the cache keeps the parsed columns and
    the byte offset they cover; a later read parses only the bytes after it. The cache is used
    only if the file is the same inode, at least as long, and the ``_SIG`` bytes before the
    offset are unchanged (a resume's ``truncate_after`` replaces the file: full re-parse).
    """
    mp = p / METRICS_FILE
    try:
        st = mp.stat()
    except FileNotFoundError:
        return np.zeros(0, np.int64), {}, False, 0
    cpath = _cache_path(cache_dir, p) if cache_dir else None
    cached = _cache_load(cpath) if cpath is not None else None
    with open(mp, "rb") as f:
        if (cached is not None and cached["ino"] == st.st_ino and st.st_size >= cached["offset"]
                and cached["engine"] == engine):
            off = cached["offset"]
            f.seek(max(0, off - _SIG))
            sig = f.read(min(_SIG, off))
            if sig.hex() == cached["sig"]:
                if st.st_size == off:
                    return cached["steps"], cached["cols"], cached["truncated_tail"], cached["bad_lines"]
                parsed, consumed = parse_jsonl_bytes(f.read(), engine=engine)
                new_steps, new_cols = rows_to_columns(parsed.rows)
                steps = np.concatenate([cached["steps"], new_steps])
                n_old, n_new = len(cached["steps"]), len(new_steps)
                cols = {}
                for k in dict.fromkeys([*cached["cols"], *new_cols]):
                    a = cached["cols"].get(k, np.full(n_old, np.nan))
                    b = new_cols.get(k, np.full(n_new, np.nan))
                    cols[k] = np.concatenate([a, b])
                bad = cached["bad_lines"] + parsed.bad_lines
                _cache_save(cpath, {"ino": st.st_ino, "offset": off + consumed, "engine": engine,
                                    "sig": _sig_at(mp, off + consumed), "truncated_tail": parsed.truncated_tail,
                                    "bad_lines": bad}, steps, cols)
                return steps, cols, parsed.truncated_tail, bad
            f.seek(0)
        data = f.read()
    parsed, consumed = parse_jsonl_bytes(data, engine=engine)
    steps, cols = rows_to_columns(parsed.rows)
    if cpath is not None:
        _cache_save(cpath, {"ino": st.st_ino, "offset": consumed, "engine": engine,
                            "sig": data[max(0, consumed - _SIG):consumed].hex(),
                            "truncated_tail": parsed.truncated_tail, "bad_lines": parsed.bad_lines},
                    steps, cols)
    return steps, cols, parsed.truncated_tail, parsed.bad_lines


def _sig_at(path: Path, off: int) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, off - _SIG))
        return f.read(min(_SIG, off)).hex()


def _load_run(path: str, engine: str = "auto", cache_dir: str | None = None) -> dict:
    """Everything collect needs from one run directory (runs in worker processes).

    The cyclic garbage collector is paused meanwhile: parsing creates millions of small
    dicts and floats, none of them in cycles, and the collector's passes over them cost
    10-30% of the time (measured on the benchmark sweep).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _load_run_impl(path, engine, cache_dir)
    finally:
        if was_enabled:
            gc.enable()


def _load_run_impl(path: str, engine: str, cache_dir: str | None) -> dict:
    p = Path(path)
    out: dict = {"exists": p.is_dir()}
    if not out["exists"]:
        return out
    out["status"] = _read_json(p / STATUS_FILE)
    out["summary"] = _read_json(p / SUMMARY_FILE)
    out["has_config"] = (p / CONFIG_FILE).exists()
    out["has_metrics"] = (p / METRICS_FILE).exists()
    steps, cols, truncated, bad = _read_metrics(p, engine, cache_dir)
    out.update(steps=steps, cols=cols, truncated_tail=truncated, bad_lines=bad)
    pe = parse_jsonl(p / EVAL_FILE, engine=engine)
    out["eval"] = eval_entries(pe.rows)
    out["eval_bad_lines"] = pe.bad_lines + int(pe.truncated_tail)
    return out
    out["status"] = _read_json(p / STATUS_FILE)
    out["summary"] = _read_json(p / SUMMARY_FILE)
    out["has_config"] = (p / CONFIG_FILE).exists()
    out["has_metrics"] = (p / METRICS_FILE).exists()
    pm = parse_jsonl(p / METRICS_FILE, engine=engine)
    steps, cols = rows_to_columns(pm.rows)
    out.update(steps=steps, cols=cols, truncated_tail=pm.truncated_tail, bad_lines=pm.bad_lines)
    pe = parse_jsonl(p / EVAL_FILE, engine=engine)
    out["eval"] = eval_entries(pe.rows)
    out["eval_bad_lines"] = pe.bad_lines + int(pe.truncated_tail)
    return out


# --- the collection ----------------------------------------------------------------------


@dataclasses.dataclass
class Collection:
    """The tables of one or more sweeps (see the module docstring for their columns)."""

    runs: pd.DataFrame
    steps: pd.DataFrame
    evals: pd.DataFrame
    problems: pd.DataFrame
    notes: list[str]
    sweep_dirs: list[Path]

    @property
    def metrics(self) -> list[str]:
        """Metric columns present in ``steps``."""
        return [c for c in self.steps.columns if "/" in c]

    def long(self, metrics: Sequence[str] | None = None) -> pd.DataFrame:
        """``steps`` melted to ``run, step, <axes>, arm, metric, value`` (NaN rows dropped)."""
        metrics = list(metrics) if metrics is not None else self.metrics
        metrics = [m for m in metrics if m in self.steps.columns]
        ids = [c for c in self.steps.columns if "/" not in c]
        out = self.steps.melt(id_vars=ids, value_vars=metrics, var_name="metric", value_name="value")
        return out.dropna(subset=["value"]).reset_index(drop=True)

    def arms(self) -> list[tuple[str, str]]:
        """``(fp8, clip)`` pairs of all cells, in display order."""
        pairs = {(str(f), str(c)) for f, c in zip(self.runs["fp8"], self.runs["clip"], strict=True)}
        return sorted(pairs, key=lambda p: arm_order_key(*p))


def _axes_from_name(run: str) -> dict:
    try:
        d = parse_run_name(run)
    except ValueError:
        return {a: None for a in AXES}
    return {**{a: d.get(a) for a in AXES}, "scale": None}


def _classify(loaded: dict, in_manifest: bool) -> tuple[str, str | None]:
    if not loaded.get("exists"):
        return CELL_MISSING, "no run directory"
    st = loaded.get("status")
    has_data = loaded.get("has_config") or loaded.get("has_metrics")
    if st is None:
        if not has_data:
            return CELL_MISSING, "empty run directory (never started)"
        cell, why = CELL_INCOMPLETE, "no status.json"
    elif st.get("__corrupt__"):
        cell, why = CELL_DAMAGED, f"{STATUS_FILE} unreadable ({st['__corrupt__']})"
    elif st.get("state") == DONE:
        cell, why = CELL_OK, None
    elif st.get("state") == FAILED:
        cell, why = CELL_FAILED, st.get("reason") or "FAILED"
    else:
        why = f"{st.get('state')} at step {st.get('step')}"
        if st.get("reason"):
            why += f": {st['reason']}"
        cell = CELL_INCOMPLETE
    if not in_manifest:
        return CELL_UNLISTED, f"run directory not in manifest ({cell}{': ' + why if why else ''})"
    return cell, why


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
    sweep_dirs = [Path(s) for s in sweep_dirs]
    notes: list[str] = []
    cells: list[dict] = []
    for sd in sweep_dirs:
        if not sd.is_dir():
            raise FileNotFoundError(f"sweep directory {sd} does not exist")
        _, cs, ns = _discover(sd)
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
            it = ex.map(_load_run, paths, [engine] * len(paths), [cache] * len(paths),
                        chunksize=max(1, len(paths) // (workers * 8)))
            loaded = list(_progress(it, len(paths), progress, "collect"))
    else:
        loaded = [_load_run(p, engine, cache) for p in _progress(paths, len(paths), progress, "collect")]
    return _assemble(cells, loaded, notes, sweep_dirs)


def _assemble(cells: list[dict], loaded: list[dict], notes: list[str], sweep_dirs: list[Path]) -> Collection:
    run_rows = []
    step_parts: list[tuple[int, np.ndarray, dict]] = []
    eval_parts: list[tuple[int, list]] = []
    for i, (c, ld) in enumerate(zip(cells, loaded, strict=True)):
        cell, why = _classify(ld, c["in_manifest"])
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
            "summary": summary, "run_dir": str(c["path"]),
        })
        if len(steps):
            step_parts.append((i, steps, cols))
        if ld.get("eval"):
            eval_parts.append((i, ld["eval"]))
    runs = pd.DataFrame(run_rows, columns=RUN_COLUMNS)
    for col in ("seed", "status_step", "first_step", "last_step"):
        runs[col] = pd.to_numeric(runs[col], errors="coerce").astype("Int64")
    steps_df = _build_steps(runs, step_parts)
    evals_df = _build_evals(runs, eval_parts)
    problems = runs.loc[runs["cell"] != CELL_OK, ["sweep", "run", *AXES, "arm", "cell", "state",
                                                  "status_step", "last_step", "reason"]]
    return Collection(runs=runs, steps=steps_df, evals=evals_df,
                      problems=problems.reset_index(drop=True), notes=notes, sweep_dirs=sweep_dirs)


def _axis_columns(runs: pd.DataFrame, run_idx: np.ndarray) -> dict[str, object]:
    out: dict[str, object] = {}
    for col in ("run", "algorithm", "model", "fp8", "clip", "scale", "arm"):
        cat = pd.Categorical(runs[col].astype("string"))
        out[col] = pd.Categorical.from_codes(cat.codes[run_idx], categories=cat.categories)
    out["seed"] = runs["seed"].to_numpy()[run_idx]
    return out


def _build_steps(runs: pd.DataFrame, parts: list[tuple[int, np.ndarray, dict]]) -> pd.DataFrame:
    names: dict[str, None] = {}
    for _, _, cols in parts:
        for k in cols:
            names[k] = None
    metric_names = sorted(names, key=_metric_order)
    if not parts:
        return pd.DataFrame(columns=["run", "step", "algorithm", "model", "fp8", "clip", "seed",
                                     "scale", "arm", *metric_names])
    lens = np.array([len(s) for _, s, _ in parts])
    run_idx = np.repeat(np.array([i for i, _, _ in parts]), lens)
    data: dict[str, object] = {}
    ax = _axis_columns(runs, run_idx)
    data["run"] = ax.pop("run")
    data["step"] = np.concatenate([s for _, s, _ in parts])
    data.update(ax)
    for m in metric_names:
        data[m] = np.concatenate([cols[m] if m in cols else np.full(len(s), np.nan) for _, s, cols in parts])
    return pd.DataFrame(data)


def _metric_order(name: str) -> tuple:
    known = {m: i for i, m in enumerate(M.TRAIN_METRICS)}
    return (0, known[name], "") if name in known else (1, 0, name)


def _build_evals(runs: pd.DataFrame, parts: list[tuple[int, list]]) -> pd.DataFrame:
    if not parts:
        return pd.DataFrame(columns=[*EVAL_COLUMNS, "algorithm", "model", "fp8", "clip", "seed",
                                     "scale", "arm"])
    run_idx = np.concatenate([np.full(len(e), i) for i, e in parts])
    flat = [t for _, e in parts for t in e]
    df = pd.DataFrame(flat, columns=["step", "dataset", "stat", "k", "n", "value"])
    ax = _axis_columns(runs, run_idx)
    df.insert(0, "run", ax.pop("run"))
    for k, v in ax.items():
        df[k] = v
    df["k"] = pd.to_numeric(df["k"], errors="coerce").astype("Int64")
    df["n"] = pd.to_numeric(df["n"], errors="coerce").astype("Int64")
    # last row wins per (run, step, dataset, stat)
    df = df.drop_duplicates(subset=["run", "step", "dataset", "stat"], keep="last")
    return df.sort_values(["run", "dataset", "stat", "step"], kind="stable").reset_index(drop=True)


def final_evals(coll: Collection, stat: str = M.EVAL_AVG, *, cells: Sequence[str] = (CELL_OK,)) -> pd.DataFrame:
    """Each run's final evaluation per dataset: ``run, dataset, value, step, source`` + axes.

    Only runs whose ``cell`` is in ``cells`` (default: finished runs). ``source`` is
    ``"summary"`` when ``summary.json`` holds ``eval/<dataset>/<stat>``, else ``"eval"`` (the
    eval row with the largest step).
    """
    runs = coll.runs[coll.runs["cell"].isin(cells)]
    rows = []
    ev = coll.evals
    ev = ev[ev["stat"] == stat] if len(ev) else ev
    last = ev.sort_values("step").groupby(["run", "dataset"], observed=True).tail(1) if len(ev) else ev
    last_by_run: dict[str, list] = {}
    for r in last.itertuples(index=False):
        last_by_run.setdefault(str(r.run), []).append(r)
    for r in runs.itertuples(index=False):
        from_summary: dict[str, float] = {}
        if isinstance(r.summary, dict):
            for key, v in r.summary.items():
                p = M.parse_eval_key(key)
                if p is not None and p[1] == stat:
                    from_summary[p[0]] = _num(v)
        for e in last_by_run.get(r.run, []):
            if e.dataset not in from_summary:
                rows.append((r.run, e.dataset, float(e.value), int(e.step), "eval"))
        for ds, v in from_summary.items():
            rows.append((r.run, ds, v, r.last_step, "summary"))
    df = pd.DataFrame(rows, columns=["run", "dataset", "value", "step", "source"])
    axes = coll.runs[["run", *AXES, "arm"]]
    return df.merge(axes, on="run", how="left")
