"""JSON and JSONL files of a run directory: strict JSON, atomic writes, append-only JSONL.

The conventions (non-finite numbers as ``null``, atomic replace, line-by-line flushed JSONL that
tolerates a truncated last line, truncation for resume) are described in
``fp8rl.runs.rundir``'s docstring, which uses these helpers; ``analysis`` reads with them.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from fp8rl.runs.metrics import STEP

__all__ = [
    "JsonlWriter",
    "atomic_write_json",
    "atomic_write_text",
    "dumps",
    "read_jsonl",
    "to_jsonable",
    "truncate_jsonl_after",
]


def to_jsonable(obj: object) -> object:
    """Plain JSON types, with non-finite floats as None (the run directory's convention).

    numpy / torch scalars (anything with ``.item()``) become Python numbers; arrays with
    ``.tolist()`` become lists; tuples become lists. Other types raise TypeError.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    item = getattr(obj, "item", None)
    if callable(item):
        with contextlib.suppress(ValueError, RuntimeError, TypeError):
            return to_jsonable(item())
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return to_jsonable(tolist())
    raise TypeError(
        f"cannot write a {type(obj).__name__} to a run directory; log plain numbers "
        "(float(x), x.item()) or strings"
    )


def dumps(obj: object, **kwargs) -> str:
    """``json.dumps`` of :func:`to_jsonable` (strict JSON: no NaN literals)."""
    return json.dumps(to_jsonable(obj), allow_nan=False, **kwargs)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same directory and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj: object) -> None:
    """Atomically write ``obj`` as indented strict JSON (non-finite floats -> null)."""
    atomic_write_text(path, dumps(obj, indent=2, sort_keys=False) + "\n")


def _parsed(path: Path, lines: list[bytes]):
    """``(line number, line, parsed JSON)`` of the complete, non-blank ``lines``; a line that is
    not JSON raises ValueError naming the file and the line (the file is corrupt)."""
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}: line {i} is not valid JSON ({e}); the file is corrupt") from e
        yield i, line, obj


def _split_complete(data: bytes) -> tuple[list[bytes], bytes]:
    """Split file content into complete lines and a trailing fragment without newline."""
    if not data:
        return [], b""
    if data.endswith(b"\n"):
        return data.split(b"\n")[:-1], b""
    *lines, tail = data.split(b"\n")
    return lines, tail


def _parse_tail(tail: bytes) -> dict | None:
    """A final line without newline: kept when it is a complete JSON object, else dropped."""
    if not tail.strip():
        return None
    try:
        obj = json.loads(tail)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Rows of a JSONL file; ``[]`` if it does not exist.

    A truncated final line (no newline and not valid JSON: the writer died mid-line) is
    dropped; a final line without newline that *is* a complete object is kept. Blank lines are
    skipped. A corrupt line anywhere else raises ValueError naming the file and line number.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines, tail = _split_complete(data)
    rows = []
    for i, _line, obj in _parsed(path, lines):
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: line {i} is not a JSON object")
        rows.append(obj)
    last = _parse_tail(tail)
    if last is not None:
        rows.append(last)
    return rows


def _repair_tail(path: Path) -> None:
    """Cut a truncated last line off ``path`` (or terminate a complete one with a newline)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        # find the start of the last line
        chunk = 1 << 16
        pos = size
        start = 0
        while pos > 0:
            read = min(chunk, pos)
            pos -= read
            f.seek(pos)
            buf = f.read(read)
            idx = buf.rfind(b"\n")
            if idx >= 0:
                start = pos + idx + 1
                break
        f.seek(start)
        tail = f.read()
        if _parse_tail(tail) is not None:
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
        else:
            f.truncate(start)


class JsonlWriter:
    """Append-only JSONL writer: one object per line, flushed after each line.

    Args:
        path: the ``.jsonl`` file (created with its parent directory if missing).
        require: keys every row must carry (``("step",)`` for metrics and eval rows).
        monotonic: if True, each row's ``step`` must be larger than the previous row's,
            including the last row already in the file (catches a step logged twice after a
            resume without :meth:`RunDir.truncate_after`).

    Values follow :func:`to_jsonable`: non-finite floats become ``null``.
    Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self, path: str | os.PathLike, *, require: Iterable[str] = (STEP,), monotonic: bool = False
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.require = tuple(require)
        self.monotonic = monotonic
        _repair_tail(self.path)
        self.last_step: int | None = None
        if monotonic:
            rows = read_jsonl(self.path)
            steps = [r[STEP] for r in rows if isinstance(r.get(STEP), int)]
            self.last_step = max(steps) if steps else None
        self._f: io.TextIOWrapper | None = open(self.path, "a", encoding="utf-8")

    def write(self, row: Mapping) -> None:
        """Append one row (a mapping of str -> JSON-able value) and flush."""
        if self._f is None:
            raise ValueError(f"JsonlWriter for {self.path} is closed")
        if not isinstance(row, Mapping):
            raise TypeError(f"a JSONL row must be a mapping, got {type(row).__name__}")
        missing = [k for k in self.require if k not in row]
        if missing:
            raise ValueError(f"row for {self.path.name} lacks required key(s) {missing}: {dict(row)}")
        clean = to_jsonable(row)
        if STEP in clean:
            step = clean[STEP]
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ValueError(f"row 'step' must be a non-negative int, got {row[STEP]!r}")
            if self.monotonic:
                if self.last_step is not None and step <= self.last_step:
                    raise ValueError(
                        f"{self.path.name}: step {step} is not after the last logged step "
                        f"{self.last_step}; on resume call RunDir.truncate_after(checkpoint_step) "
                        "before logging, and log each step once"
                    )
                self.last_step = step
        self._f.write(json.dumps(clean, allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def truncate_jsonl_after(path: str | os.PathLike, step: int) -> int:
    """Drop rows with ``step > step`` (and a truncated last line); returns rows dropped.

    Rows without a ``step`` key are kept. The file is rewritten atomically; a missing file is
    left missing.
    """
    path = Path(path)
    if not path.exists():
        return 0
    data = path.read_bytes()
    lines, tail = _split_complete(data)
    kept: list[bytes] = []
    dropped = 0
    for _i, line, obj in _parsed(path, lines):
        s = obj.get(STEP) if isinstance(obj, dict) else None
        if isinstance(s, (int, float)) and s > step:
            dropped += 1
        else:
            kept.append(line)
    last = _parse_tail(tail)
    if tail.strip():
        if last is not None and not (isinstance(last.get(STEP), (int, float)) and last[STEP] > step):
            kept.append(tail)
        else:
            dropped += 1
    atomic_write_text(path, "".join(ln.decode("utf-8") + "\n" for ln in kept))
    return dropped
