"""Reading one run directory (``analysis.collect`` runs :func:`load_run` per cell, possibly in
worker processes): ``status.json``, ``summary.json``, ``metrics.jsonl`` (through the incremental
cache when ``cache_dir`` is given) and ``eval.jsonl``.

Cache: the parsed columns of each ``metrics.jsonl`` (a ``.npy`` and a ``.json`` per run) with the
byte offset they cover; the file is append-only, so a later read parses only the appended lines
(a file that was replaced, e.g. by a resume's ``truncate_after``, is re-parsed whole).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from analysis.evals import eval_entries
from analysis.jsonl import parse_jsonl, parse_jsonl_bytes, rows_to_columns
from fp8rl.runs.rundir import CONFIG_FILE, EVAL_FILE, METRICS_FILE, STATUS_FILE, SUMMARY_FILE

PROVENANCE_FILE = "provenance.json"
NOT_RECORDED = "not recorded"


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
    full = {**meta, "version": _CACHE_VERSION, "columns": names, "rows": len(steps)}
    tmp_json = stem.parent / f".{stem.name}.{os.getpid()}.tmp.json"
    try:
        np.save(tmp, data, allow_pickle=False)
        os.replace(tmp, stem.with_suffix(".npy"))
        tmp_json.write_text(json.dumps(full))
        os.replace(tmp_json, stem.with_suffix(".json"))
    except BaseException:  # a full disk: no temporary left behind
        for t in (tmp, tmp_json):
            t.unlink(missing_ok=True)
        raise


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


def load_run(path: str, engine: str = "auto", cache_dir: str | None = None) -> dict:
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


def _config(path: Path) -> dict:
    """``config.yaml`` as a mapping ({} when absent), ``{"__corrupt__": why}`` when it cannot be read."""
    import yaml

    try:
        d = yaml.load(path.read_bytes(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, yaml.YAMLError) as e:
        return {"__corrupt__": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    if d is None:
        return {}
    return d if isinstance(d, dict) else {"__corrupt__": f"holds a YAML {type(d).__name__}, not a mapping"}


def run_origin(p: Path) -> dict:
    """What a run's ``provenance.json`` and ``config.yaml`` say about where its numbers come from:

    - ``code``: the commit (``git.sha``, 7 digits, ``+dirty`` for a modified tree);
    - ``cpu``: the CPU numerics, ``"<model> (<flags>), <n> thread(s)[, numerics <level> <probe>]"``
      (``cpu.flags`` of provenance: the vector extensions that pick oneDNN/MKL kernels;
      ``mini.num_threads`` of the config: the summation order; ``extra.numerics`` where the run
      recorded its numerics fingerprint: torch's kernel level and the probe of the kernels' bits);
      a GPU run (``device`` not ``cpu``) is named by its device;
    - ``steps_configured``: the config's ``steps`` (None when absent).

    Absent or unreadable files give :data:`NOT_RECORDED` (never an error): a run made before
    provenance recorded the CPU is its own group, not silently any machine's. An unreadable one is
    also named in ``origin_damaged`` (``(file, error)``, None when both read):
    ``analysis.collect`` lists that cell as damaged and keeps it out of every group.
    """
    prov = _read_json(p / PROVENANCE_FILE) or {}
    cfg = _config(p / CONFIG_FILE)
    damaged = None
    for name, d in ((PROVENANCE_FILE, prov), (CONFIG_FILE, cfg)):
        if d.get("__corrupt__"):
            damaged = damaged or (name, d["__corrupt__"])
    prov = {} if prov.get("__corrupt__") else prov
    cfg = {} if cfg.get("__corrupt__") else cfg
    git = prov.get("git") if isinstance(prov.get("git"), dict) else {}
    sha = git.get("sha")
    code = (str(sha)[:7] + ("+dirty" if git.get("dirty") else "")) if sha else NOT_RECORDED
    device = str(prov.get("device") or "")
    cpu_d = prov.get("cpu") if isinstance(prov.get("cpu"), dict) else {}
    mini = cfg.get("mini") if isinstance(cfg.get("mini"), dict) else {}
    threads = mini.get("num_threads")
    if device and not device.startswith("cpu"):
        cpu = device
    elif cpu_d.get("flags") is not None:
        cpu = f"{cpu_d.get('model') or 'CPU'} ({' '.join(map(str, cpu_d['flags'])) or 'no AVX'})"
    else:
        cpu = NOT_RECORDED
    if cpu != NOT_RECORDED and threads is not None and not (device and not device.startswith("cpu")):
        cpu += f", {threads} thread{'s' if threads != 1 else ''}"
    extra = prov.get("extra") if isinstance(prov.get("extra"), dict) else {}
    numerics = extra.get("numerics") if isinstance(extra.get("numerics"), dict) else {}
    if cpu != NOT_RECORDED and numerics.get("aten") and numerics.get("probe"):
        # what decides the bits (fp8rl/backends/mini/numerics.py): runs of two fingerprints are other samples
        cpu += f", numerics {numerics['aten']} {numerics['probe']}"
    steps = cfg.get("steps")
    return {"code": code, "cpu": cpu, "origin_damaged": damaged,
            "steps_configured": int(steps) if isinstance(steps, int) and not isinstance(steps, bool) else None}


def _load_run_impl(path: str, engine: str, cache_dir: str | None) -> dict:
    p = Path(path)
    out: dict = {"exists": p.is_dir()}
    if not out["exists"]:
        return out
    out["status"] = _read_json(p / STATUS_FILE)
    out["summary"] = _read_json(p / SUMMARY_FILE)
    out["has_config"] = (p / CONFIG_FILE).exists()
    out.update(run_origin(p))
    out["has_metrics"] = (p / METRICS_FILE).exists()
    steps, cols, truncated, bad = _read_metrics(p, engine, cache_dir)
    out.update(steps=steps, cols=cols, truncated_tail=truncated, bad_lines=bad)
    pe = parse_jsonl(p / EVAL_FILE, engine=engine)
    out["eval"] = eval_entries(pe.rows)
    out["eval_bad_lines"] = pe.bad_lines + int(pe.truncated_tail)
    return out
