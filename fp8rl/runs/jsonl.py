"""JSON and JSONL files of a run directory: strict JSON, atomic writes, append-only JSONL.

The conventions (non-finite numbers as ``null``, atomic replace, line-by-line fsynced JSONL that
tolerates a truncated last line, truncation for resume) are described in
``fp8rl.runs.rundir``'s docstring, which uses these helpers; ``analysis`` reads with them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from fp8rl.runs.metrics import STEP
from fp8rl.runs.safe_io import (
    append_bytes,
    atomic_write_bytes,
    open_nofollow,
    refuse_symlink,
    writing,
)

__all__ = [
    "JsonlWriter",
    "RunDirDamaged",
    "atomic_write_json",
    "atomic_write_text",
    "dumps",
    "read_json",
    "read_jsonl",
    "to_jsonable",
    "truncate_jsonl_after",
]


#: How to repair a damaged run file, by name, where it is less than running the cell again.
REPAIRS = {
    # the run's state is re-derived from its checkpoint: nothing else is lost
    "status.json": "delete it and relaunch: the cell resumes from its checkpoint (from step 0 if it has "
                   "none), keeping the rest of its run directory",
    # the relaunch writes it again: only the record of earlier attempts is lost
    "provenance.json": "delete it and relaunch: the relaunch writes it again (only its record of earlier "
                       "attempts is lost) and the cell resumes from its checkpoint, keeping the rest of its "
                       "run directory",
    # the relaunch writes it again from the same sweep config, whose hash names the run directory
    "config.yaml": "delete it and relaunch with the same command: the relaunch writes it again (the run "
                   "directory's name holds the config's hash) and the cell resumes from its checkpoint, "
                   "keeping the rest of its run directory",
}


class RunDirDamaged(ValueError):
    """A run file is not what fp8rl wrote (truncated, emptied or overwritten)."""

    def __init__(self, path: Path, what: str, detail: object) -> None:
        detail = " ".join(str(detail).split())  # parsers' messages span lines
        fix = REPAIRS.get(Path(path).name, "restore it from a copy, or delete the run directory to run the "
                                           "cell again from scratch")
        super().__init__(f"{path} is damaged (not {what}: {detail}); {fix}")
        self.path = Path(path)


def read_json(path: Path) -> dict | None:
    """A run's JSON file, None when missing; a symlink or a damaged file (not UTF-8, not JSON)
    is refused."""
    refuse_symlink(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError included
        raise RunDirDamaged(path, "JSON", e) from e


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
    """Atomically replace ``path`` with ``text`` (``fp8rl.runs.safe_io.atomic_write_bytes``:
    temporary file, fsync, ``os.replace``; a symlink at ``path`` is refused)."""
    atomic_write_bytes(path, text.encode("utf-8"))


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


def _repair_tail(fd: int, path: Path) -> None:
    """Cut a truncated last line off the file ``fd`` (or terminate a complete one with a newline)."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    # find the start of the last line
    chunk = 1 << 16
    pos = size
    start = 0
    while pos > 0:
        read = min(chunk, pos)
        pos -= read
        idx = os.pread(fd, read, pos).rfind(b"\n")
        if idx >= 0:
            start = pos + idx + 1
            break
    with writing(path):
        if _parse_tail(os.pread(fd, size - start, start)) is not None:
            append_bytes(fd, path, b"\n")
        else:
            os.ftruncate(fd, start)
            os.fsync(fd)


class JsonlWriter:
    """Append-only JSONL writer: one object per line, written whole and fsynced.

    A write that fails (disk full) leaves the file as it was before it (no torn line) and raises
    ``RunDirWriteError``; a symlink in place of the file is refused (``RunDirSymlink``).

    Args:
        path: the ``.jsonl`` file (created with its parent directory if missing).
        require: keys every row must carry (``("step",)`` for metrics and eval rows).
        monotonic: if True, each row's ``step`` must be larger than the previous row's,
            including the last row already in the file (catches a step logged twice after a
            resume without :meth:`RunDir.truncate_after`).
        fsync: fsync every line (default; ``False`` for fabricated data such as
            ``fp8rl.runs.synthetic``'s, where a machine crash loses nothing of value).

    Values follow :func:`to_jsonable`: non-finite floats become ``null``.
    Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self, path: str | os.PathLike, *, require: Iterable[str] = (STEP,), monotonic: bool = False,
        fsync: bool = True,
    ) -> None:
        self.path = Path(path)
        with writing(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.require = tuple(require)
        self.monotonic, self.fsync = monotonic, fsync
        self._fd: int | None = open_nofollow(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        try:
            _repair_tail(self._fd, self.path)
            self.last_step: int | None = None
            if monotonic:
                rows = read_jsonl(self.path)
                steps = [r[STEP] for r in rows if isinstance(r.get(STEP), int)]
                self.last_step = max(steps) if steps else None
        except BaseException:
            self.close()
            raise

    def write(self, row: Mapping) -> None:
        """Append one row (a mapping of str -> JSON-able value), whole, and fsync it."""
        if self._fd is None:
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
        append_bytes(self._fd, self.path, (json.dumps(clean, allow_nan=False) + "\n").encode("utf-8"),
                     fsync=self.fsync)
        if self.monotonic and STEP in clean:
            self.last_step = clean[STEP]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

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
    refuse_symlink(path)
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
