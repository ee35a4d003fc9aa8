"""The run directory: the one interface between running and analysing (docs/design.md).

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
      owner.json        the lock of the live process writing the run, and who it is
      tensorboard/      TensorBoard event files (the metrics.jsonl names; for watching)

Conventions chosen here (the design left them open):

- **Non-finite numbers are written as JSON ``null``.** Python's ``json`` would write ``NaN``,
  which strict JSON readers (and ``orjson``, browsers) refuse. ``null`` reads back as ``None``
  with ``json.loads`` and as NaN in pandas. The price: NaN, +inf and -inf are not told apart,
  and "null" means "not finite" (a metric that was not measured is simply absent).
  numpy / torch scalars are converted with ``.item()``; other non-JSON types raise.
- **Atomic files** (``config.yaml``, ``status.json``, ``summary.json``, ``provenance.json``)
  are written to a temporary file in the same directory, fsynced and moved with
  ``os.replace``, so a reader sees the old or the new file, never half of one.
- **JSONL files** are append-only; each line is written whole and fsynced (a crash of the
  process or of the machine loses no logged row), and a failed write is cut back off. A
  reader tolerates a truncated last line (the writer died mid-line) and drops it; a corrupt
  line elsewhere is an error. A writer opening a file whose last line is truncated cuts that
  fragment off first, so the next row does not get glued onto it.
- **Disk full, read-only, symlinks, damage** (``fp8rl.runs.safe_io``): ``RunDirWriteError``
  names the path and the fix, the run stays resumable; a symlinked run file is refused, never
  followed (``RunDirSymlink``); a damaged one is refused naming it (``RunDirDamaged``).
- **Resume**: :meth:`RunDir.truncate_after` drops rows with ``step > k`` (and a truncated last
  line) from ``metrics.jsonl`` and ``eval.jsonl`` so that a run resumed from the checkpoint
  of step ``k`` logs no step twice. The metrics writer additionally refuses a step that is not
  larger than the last one it saw in the file. Without a checkpoint a relaunch starts again
  from step 0 (``fp8rl.runs.relaunch``).
- **Config conflicts**: :meth:`RunDir.init` on a directory holding a *different* config raises
  :class:`RunDirConflict` (the hash collided or someone reused a directory); the same config is
  a resume and passes. Keys that say how a run is launched and logged (``DEFAULT_EXCLUDE``:
  ``logging``, ...) and the caller's ``may_differ`` keys (the backend's identity exclusions:
  ``output_dir``, ``checkpoint_every``, ``mini.cache_dir``: a moved sweep directory, another
  checkpoint cadence) may differ on a resume; ``config.yaml`` keeps the first attempt's and
  :attr:`RunDir.resume_changes` lists what changed (the backends record it in provenance).
  ``overrides.txt`` is written once; a resume keeps the original.
- **Ownership**: ``owner.json`` is the lock of the live process that writes the run
  (``fp8rl.runs.lock``); ``tensorboard/`` holds TensorBoard event files (``fp8rl.runs.live``),
  a view for humans: ``metrics.jsonl`` is the source of truth.
- **Provenance on resume**: :meth:`RunDir.write_provenance` keeps the earlier attempts in a
  ``previous_attempts`` list, so a preempted and resumed Slurm run shows both jobs.
- **Times** are ISO 8601 UTC strings with seconds (``2026-11-30T12:00:00Z``).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

from fp8rl.runs.identity import changed_values
from fp8rl.runs.jsonl import (  # noqa: F401  (re-exported: the run directory's file helpers)
    JsonlWriter,
    RunDirDamaged,
    atomic_write_json,
    atomic_write_text,
    dumps,
    read_json,
    read_jsonl,
    to_jsonable,
    truncate_jsonl_after,
)
from fp8rl.runs.metrics import STEP
from fp8rl.runs.provenance import (  # noqa: F401  (PROVENANCE_PACKAGES, SLURM_VARS re-exported)
    PROVENANCE_PACKAGES,
    SLURM_VARS,
    cpu_info,
    git_info,
    package_versions,
    slurm_env,
)
from fp8rl.runs.safe_io import refuse_symlink

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

class RunDirConflict(RuntimeError):
    """The run directory already holds a different config."""


#: The fix of a DONE run whose ``metrics.jsonl`` lost step rows (:func:`missing_step_rows`).
METRICS_REPAIR = (f"restore {METRICS_FILE} from a copy, or delete {STATUS_FILE} and {CHECKPOINT_DIR}/ and relaunch: "
                  "the cell runs again from step 0 (its steps' rows cannot be made again from the final checkpoint)")


def missing_step_rows(done_step: int, logged_steps: Iterable[object] | None) -> str | None:
    """Why a run that says DONE at ``done_step`` lacks step rows, with the fix; None when
    ``logged_steps`` (the ``step`` of each ``metrics.jsonl`` row; None: no file) holds every step
    1..``done_step``. Pure: the one rule of the launcher, ``experiments.status`` and the report."""
    if logged_steps is None:
        return f"missing, but {STATUS_FILE} says the run finished {done_step} step(s); {METRICS_REPAIR}"
    logged = set(logged_steps)
    have = sum(1 for s in range(1, done_step + 1) if s in logged)
    if have < done_step:
        return (f"holds {have} of the {done_step} step rows that {STATUS_FILE} says the run finished (the file "
                f"was cut or emptied); {METRICS_REPAIR}")
    return None


def utc_now() -> str:
    """Current time as ISO 8601 UTC with seconds, e.g. ``2026-11-30T12:00:00Z``."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- the run directory -------------------------------------------------------------------


class RunDir:
    """One run's directory (see the module docstring for the layout and conventions).

    ``RunDir(path)`` does not touch the disk; :meth:`init` creates the directory.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        #: After :meth:`init` on an existing run: ``{dotted key: {"before": ..., "now": ...}}`` of
        #: the keys outside the run identity that this attempt changed.
        self.resume_changes: dict[str, dict] = {}

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
    def init(self, config: Mapping, overrides: Iterable[str] = (), *, may_differ: Iterable[str] = (),
             late_defaults: Mapping[str, object] | None = None) -> RunDir:
        """Create the directory and write ``config.yaml`` and ``overrides.txt``.

        If ``config.yaml`` exists and holds the same config (compared after a YAML round trip),
        this is a resume and nothing is rewritten; if it holds a different one,
        :class:`RunDirConflict` is raised naming the first differing keys. ``may_differ``: dotted
        keys that are not part of what runs (they may change on a resume; see
        :attr:`resume_changes`). ``late_defaults``: options added after runs were made; at their
        default they are left out of the comparison (``identity.drop_defaults``), so a run
        written before they existed resumes.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping, got {type(config).__name__}")
        overrides = list(overrides)
        if any(not isinstance(o, str) or "\n" in o for o in overrides):
            raise ValueError(f"overrides must be single-line strings, got {overrides!r}")
        text = yaml.safe_dump(to_jsonable(config), sort_keys=False, default_flow_style=False)
        existing = self.config()
        if existing is not None:
            may_differ = tuple(may_differ)
            new_full = yaml.safe_load(text)
            self.resume_changes = changed_values(existing, new_full, may_differ)
            if late_defaults:
                from fp8rl.runs.identity import drop_defaults

                existing, new_full = drop_defaults(existing, late_defaults), drop_defaults(new_full, late_defaults)
            existing, new = _what_runs(existing, may_differ), _what_runs(new_full, may_differ)
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
        refuse_symlink(self.config_path)
        if not self.config_path.exists():
            return None
        try:
            config = yaml.safe_load(self.config_path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise RunDirDamaged(self.config_path, "YAML", e) from e
        if not isinstance(config, dict):
            raise RunDirDamaged(self.config_path, "a YAML mapping", f"it holds {type(config).__name__}")
        return config

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
        ``"cuda:0 NVIDIA H100"``), ``cpu`` (model and the vector extensions that change CPU
        numerics: :func:`fp8rl.runs.provenance.cpu_info`), ``slurm`` (SLURM_* ids set at call time), ``argv``,
        ``time_started``, ``time_ended`` (filled by a terminal :meth:`set_status`), and
        ``extra``. Earlier attempts (a resume) move to ``previous_attempts``.
        """
        import fp8rl

        prov = {
            "git": git_info(Path(fp8rl.__file__).resolve().parent),
            "packages": package_versions(PROVENANCE_PACKAGES),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "host": socket.gethostname(),
            "device": device,
            "cpu": cpu_info(),
            "slurm": slurm_env(),
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
        """``provenance.json``, None when absent; one that is not JSON or not a provenance record
        (checked field by field: ``fp8rl.runs.provenance.provenance_problem``) raises
        :class:`RunDirDamaged` naming the file, the field and the fix (delete it and relaunch)."""
        from fp8rl.runs.provenance import provenance_problem

        prov = read_json(self.provenance_path)
        why = None if prov is None else provenance_problem(prov)
        if why:
            raise RunDirDamaged(self.provenance_path, "a provenance record", why)
        return prov

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
            try:
                prov = self.provenance()
            except RunDirDamaged:  # refused where the run reads it; marking the end must not fail again
                prov = None
            if prov is not None:
                prov["time_ended"] = now
                atomic_write_json(self.provenance_path, prov)

    def status(self) -> dict | None:
        """``status.json`` as a dict, or None if the run never wrote one; a damaged one raises
        :class:`RunDirDamaged`."""
        st = read_json(self.status_path)
        if st is not None and not isinstance(st, dict):
            raise RunDirDamaged(self.status_path, "a JSON object", f"it holds a {type(st).__name__}")
        return st

    @property
    def state(self) -> str | None:
        st = self.status()
        return None if st is None else st.get("state")

    def is_done(self) -> bool:
        return self.state == DONE

    def done_damage(self) -> str | None:
        """For a run whose ``status.json`` says DONE: why its logged steps do not back that up
        (``metrics.jsonl`` missing, or holding fewer step rows than the status's step, or
        unreadable), with the fix; None otherwise (not DONE, or whole). A DONE run is skipped by
        every relaunch, so a missing row would never be made again: such a run is DAMAGED, not
        DONE (``experiments.status`` and the launcher say so)."""
        st = self.status()
        if not st or st.get("state") != DONE:
            return None
        step = st.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            return None
        refuse_symlink(self.metrics_path)
        if not self.metrics_path.exists():
            return f"{self.metrics_path}: {missing_step_rows(step, None)}"
        try:
            rows = read_jsonl(self.metrics_path)
        except ValueError as e:
            return f"{' '.join(str(e).split())}; {METRICS_REPAIR}"
        lost = missing_step_rows(step, [r.get(STEP) for r in rows if isinstance(r, dict)])
        return None if lost is None else f"{self.metrics_path}: {lost}"

    # jsonl
    def metrics_writer(self, *, fsync: bool = True) -> JsonlWriter:
        """Writer for ``metrics.jsonl``: rows need ``step``, strictly increasing."""
        return JsonlWriter(self.metrics_path, require=(STEP,), monotonic=True, fsync=fsync)

    def eval_writer(self, *, fsync: bool = True) -> JsonlWriter:
        """Writer for ``eval.jsonl``: rows need ``step`` (see ``fp8rl.runs.metrics.eval_row``)."""
        return JsonlWriter(self.eval_path, require=(STEP,), monotonic=False, fsync=fsync)

    def read_metrics(self) -> list[dict]:
        refuse_symlink(self.metrics_path)
        return read_jsonl(self.metrics_path)

    def read_eval(self) -> list[dict]:
        refuse_symlink(self.eval_path)
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
        return read_json(self.summary_path)


def _what_runs(config: object, may_differ: tuple[str, ...] = ()) -> object:
    """A config without the keys that say how a run is launched and logged (``DEFAULT_EXCLUDE``)
    and without ``may_differ`` (dotted): a resume may log differently (say, to W&B as well), from
    a moved directory or with another checkpoint cadence, and is still the same run."""
    import copy

    from fp8rl.runs.identity import DEFAULT_EXCLUDE, _drop

    if not isinstance(config, dict):
        return config
    out = copy.deepcopy({k: v for k, v in config.items() if k not in DEFAULT_EXCLUDE})
    for dotted in may_differ:
        _drop(out, dotted)
    return out


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
