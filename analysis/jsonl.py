"""Fast, tolerant JSONL parsing for ``analysis.collect`` (metrics.jsonl, eval.jsonl).

Each file is read in one go and parsed with a single ``loads`` call on the lines joined into
one JSON array (``orjson`` when installed, the standard library otherwise; a file ``orjson``
refuses, e.g. one with ``NaN`` literals, is re-parsed with the standard library). Rows are
grouped by their key sequence and each group becomes a 2-D float array with one
``np.fromiter`` (:func:`rows_to_columns`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fp8rl.runs import metrics as M

try:  # optional fast parser
    import orjson as _orjson
except ImportError:  # pragma: no cover - exercised where orjson is absent
    _orjson = None


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
