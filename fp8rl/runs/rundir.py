"""The run directory: the one interface between running and analysing (DESIGN.md).

::

    <run-dir>/
      config.yaml       fully resolved config (yaml.safe_dump, keys in the config's order)
      overrides.txt     the command-line overrides that produced it, one per line
      provenance.json   git sha + dirty flag, package versions, host, device, Slurm ids, times
      status.json       {"state": "RUNNING|DONE|FAILED|PREEMPTED", "step": n, "reason": ..., "time": ...}
      metrics.jsonl     one JSON object per training step, appended and flushed line by line
      eval.jsonl        one JSON object per evaluation of one dataset
      summary.json      final numbers the tables read
      samples/          a few decoded rollouts every N steps
      checkpoint/       latest resumable state (mini backend)

Conventions chosen here (the design left them open):

- **Non-finite numbers are written as JSON ``null``.** Python's ``json`` would write ``NaN``,
  which strict JSON readers (and ``orjson``, browsers) refuse. ``null`` reads back as ``None``
  with ``json.loads`` and as NaN in pandas. The price: NaN, +inf and -inf are not told apart,
  and "null" means "not finite" (a metric that was not measured is simply absent).
  numpy / torch scalars are converted with ``.item()``; other non-JSON types raise.
- **Atomic files** (``config.yaml``, ``status.json``, ``summary.json``, ``provenance.json``)
  are written to a temporary file in the same directory and moved with ``os.replace``, so a
  reader sees the old or the new file, never half of one.
- **JSONL files** are append-only and flushed after every line (not fsynced: a crash of the
  machine may lose the last lines, a crash of the process does not). A reader tolerates a
  truncated last line (the writer died mid-line) and drops it; a corrupt line elsewhere is an
  error. A writer opening a file whose last line is truncated cuts that fragment off first,
  so the next row does not get glued onto it.
- **Resume**: :meth:`RunDir.truncate_after` drops rows with ``step > k`` (and a truncated last
  line) from ``metrics.jsonl`` and ``eval.jsonl`` so that a run resumed from the checkpoint
  of step ``k`` logs no step twice. The metrics writer additionally refuses a step that is not
  larger than the last one it saw in the file.
- **Config conflicts**: :meth:`RunDir.init` on a directory holding a *different* config raises
  :class:`RunDirConflict` (the hash collided or someone reused a directory); the same config is
  a resume and passes. ``overrides.txt`` is written once; a resume keeps the original.
- **Provenance on resume**: :meth:`RunDir.write_provenance` keeps the earlier attempts in a
  ``previous_attempts`` list, so a preempted and resumed Slurm run shows both jobs.
- **Times** are ISO 8601 UTC strings with seconds (``2026-11-30T12:00:00Z``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import io
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path

import yaml

from fp8rl.runs.metrics import STEP

CONFIG_FILE = "config.yaml"
OVERRIDES_FILE = "overrides.txt"
PROVENANCE_FILE = "provenance.json"
STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
SUMMARY_FILE = "summary.json"
SAMPLES_DIR = "samples"
CHECKPOINT_DIR = "checkpoint"

RUNNING, DONE, FAILED, PREEMPTED = "RUNNING", "DONE", "FAILED", "PREEMPTED"
STATES: tuple[str, ...] = (RUNNING, DONE, FAILED, PREEMPTED)
TERMINAL_STATES: tuple[str, ...] = (DONE, FAILED, PREEMPTED)

#: Packages whose versions go into provenance.json (None when not installed).
PROVENANCE_PACKAGES: tuple[str, ...] = ("torch", "torchao", "transformers", "fp8rl")
#: Slurm variables recorded in provenance.json when set.
SLURM_VARS: tuple[str, ...] = (
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_NODELIST",
    "SLURM_NNODES",
    "SLURM_RESTART_COUNT",
    "SLURM_CLUSTER_NAME",
)


class RunDirConflict(RuntimeError):
    """The run directory already holds a different config."""


def utc_now() -> str:
    """Current time as ISO 8601 UTC with seconds, e.g. ``2026-11-30T12:00:00Z``."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- JSON helpers ------------------------------------------------------------------------


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
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}: line {i} is not valid JSON ({e}); the file is corrupt") from e
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
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}: line {i} is not valid JSON ({e}); the file is corrupt") from e
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


# --- provenance helpers ------------------------------------------------------------------


def _git_info(start: Path) -> dict:
    """``{"sha": ..., "dirty": bool}`` of the git work tree containing ``start``, or Nones."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(start), *args],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        return {"sha": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": None if status is None else bool(status)}


def _package_versions(names: Iterable[str]) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _slurm_env() -> dict:
    return {k: os.environ[k] for k in SLURM_VARS if k in os.environ}


# --- the run directory -------------------------------------------------------------------


class RunDir:
    """One run's directory (see the module docstring for the layout and conventions).

    ``RunDir(path)`` does not touch the disk; :meth:`init` creates the directory.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    # paths
    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def overrides_path(self) -> Path:
        return self.path / OVERRIDES_FILE

    @property
    def provenance_path(self) -> Path:
        return self.path / PROVENANCE_FILE

    @property
    def status_path(self) -> Path:
        return self.path / STATUS_FILE

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def eval_path(self) -> Path:
        return self.path / EVAL_FILE

    @property
    def summary_path(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def samples_dir(self) -> Path:
        return self.path / SAMPLES_DIR

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / CHECKPOINT_DIR

    # config
    def init(self, config: Mapping, overrides: Iterable[str] = ()) -> RunDir:
        """Create the directory and write ``config.yaml`` and ``overrides.txt``.

        If ``config.yaml`` exists and holds the same config (compared after a YAML round trip),
        this is a resume and nothing is rewritten; if it holds a different one,
        :class:`RunDirConflict` is raised naming the first differing keys.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping, got {type(config).__name__}")
        overrides = list(overrides)
        if any(not isinstance(o, str) or "\n" in o for o in overrides):
            raise ValueError(f"overrides must be single-line strings, got {overrides!r}")
        text = yaml.safe_dump(to_jsonable(config), sort_keys=False, default_flow_style=False)
        if self.config_path.exists():
            existing = yaml.safe_load(self.config_path.read_text(encoding="utf-8"))
            new = yaml.safe_load(text)
            if existing != new:
                diffs = _diff_keys(existing, new)
                shown = ", ".join(diffs[:5]) + (" ..." if len(diffs) > 5 else "")
                raise RunDirConflict(
                    f"{self.config_path} holds a different config (differs at: {shown}). "
                    "A run directory belongs to one config: use a new directory (the config hash "
                    "in the name normally guarantees this) or delete the old run deliberately"
                )
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.config_path, text)
        if not self.overrides_path.exists():
            atomic_write_text(self.overrides_path, "".join(o + "\n" for o in overrides))
        self.samples_dir.mkdir(exist_ok=True)
        return self

    def config(self) -> dict | None:
        """The logged config, or None if there is none."""
        if not self.config_path.exists():
            return None
        return yaml.safe_load(self.config_path.read_text(encoding="utf-8"))

    def overrides(self) -> list[str]:
        if not self.overrides_path.exists():
            return []
        return [ln for ln in self.overrides_path.read_text(encoding="utf-8").splitlines() if ln]

    # provenance
    def write_provenance(self, extra: Mapping | None = None, *, device: str | None = None) -> dict:
        """Record where and with what this attempt runs; returns what was written.

        Fields: ``git`` (sha + dirty flag of the work tree containing the fp8rl package, Nones
        when it is not in one), ``packages`` (torch, torchao, transformers, fp8rl versions),
        ``python``, ``platform``, ``host``, ``device`` (the caller's description, e.g.
        ``"cuda:0 NVIDIA H100"``), ``slurm`` (SLURM_* ids set at call time), ``argv``,
        ``time_started``, ``time_ended`` (filled by a terminal :meth:`set_status`), and
        ``extra``. Earlier attempts (a resume) move to ``previous_attempts``.
        """
        import fp8rl

        prov = {
            "git": _git_info(Path(fp8rl.__file__).resolve().parent),
            "packages": _package_versions(PROVENANCE_PACKAGES),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "host": socket.gethostname(),
            "device": device,
            "slurm": _slurm_env(),
            "argv": list(sys.argv),
            "time_started": utc_now(),
            "time_ended": None,
            "extra": dict(extra) if extra else {},
        }
        previous = []
        old = self.provenance()
        if old is not None:
            previous = list(old.pop("previous_attempts", []))
            previous.append(old)
        prov["previous_attempts"] = previous
        atomic_write_json(self.provenance_path, prov)
        return prov

    def provenance(self) -> dict | None:
        return _read_json(self.provenance_path)

    # status
    def set_status(self, state: str, step: int, reason: str | None = None) -> None:
        """Atomically write ``status.json``; a terminal state also stamps provenance's end time."""
        if state not in STATES:
            raise ValueError(f"run state must be one of {STATES}, got {state!r}")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"status step must be a non-negative int, got {step!r}")
        if reason is not None and not isinstance(reason, str):
            reason = str(reason)
        self.path.mkdir(parents=True, exist_ok=True)
        now = utc_now()
        atomic_write_json(
            self.status_path, {"state": state, "step": step, "reason": reason, "time": now}
        )
        if state in TERMINAL_STATES:
            prov = self.provenance()
            if prov is not None:
                prov["time_ended"] = now
                atomic_write_json(self.provenance_path, prov)

    def status(self) -> dict | None:
        """``status.json`` as a dict, or None if the run never wrote one."""
        return _read_json(self.status_path)

    @property
    def state(self) -> str | None:
        st = self.status()
        return None if st is None else st.get("state")

    def is_done(self) -> bool:
        return self.state == DONE

    # jsonl
    def metrics_writer(self) -> JsonlWriter:
        """Writer for ``metrics.jsonl``: rows need ``step``, strictly increasing."""
        return JsonlWriter(self.metrics_path, require=(STEP,), monotonic=True)

    def eval_writer(self) -> JsonlWriter:
        """Writer for ``eval.jsonl``: rows need ``step`` (see ``fp8rl.runs.metrics.eval_row``)."""
        return JsonlWriter(self.eval_path, require=(STEP,), monotonic=False)

    def read_metrics(self) -> list[dict]:
        return read_jsonl(self.metrics_path)

    def read_eval(self) -> list[dict]:
        return read_jsonl(self.eval_path)

    def truncate_after(self, step: int) -> dict:
        """For resume from step ``step``: drop logged rows with a larger step.

        Returns ``{"metrics.jsonl": n_dropped, "eval.jsonl": n_dropped}``.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"truncate_after needs a non-negative int step, got {step!r}")
        return {
            METRICS_FILE: truncate_jsonl_after(self.metrics_path, step),
            EVAL_FILE: truncate_jsonl_after(self.eval_path, step),
        }

    # summary
    def write_summary(self, summary: Mapping) -> None:
        """Atomically write ``summary.json`` (non-finite floats -> null)."""
        if not isinstance(summary, Mapping):
            raise TypeError(f"summary must be a mapping, got {type(summary).__name__}")
        atomic_write_json(self.summary_path, summary)

    def summary(self) -> dict | None:
        return _read_json(self.summary_path)


def _read_json(path: Path) -> dict | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    return json.loads(text)


def _diff_keys(a: object, b: object, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            p = f"{prefix}.{k}" if prefix else str(k)
            if k not in a or k not in b:
                out.append(p)
            else:
                out.extend(_diff_keys(a[k], b[k], p))
        return out
    return [] if a == b else [prefix or "<root>"]
