"""Cluster profiles: the Slurm resources of a sweep, selected with ``cluster=NAME``.

A profile is a YAML file in ``slurm/profiles/`` (``cluster=example`` reads
``slurm/profiles/example.yaml``) or any path to a YAML file (``cluster=/path/to/mine.yaml``).
It says where jobs go (partition, account, qos), what one cell gets (time, nodes, GPUs and CPUs
per node, memory; per model slot where sizes differ), how the job's environment is prepared
(``setup`` shell lines run by the batch script before ``srun``, or a ``container`` image for
pyxis), and how many array tasks run at once. ``slurm/profiles/example.yaml`` documents every
field (``scheduler``, default ``slurm``: ``slurm/profiles/workstation.yaml``, below);
:class:`ClusterProfile` is the typed, validating form.

Choices (the issue left them open):

- ``cluster`` is a plain config field resolved here, not a Hydra config group: profiles live
  with the Slurm scripts in ``slurm/profiles/`` and users keep their own outside the repository
  by path. A typo fails with the list of available profiles, like a group typo.
- Resources are a ``default`` block plus optional per-slot blocks (``8b``, ``14b``, ``32b``) that
  override single fields; every cell's slot must resolve to a complete request.
- Time is in minutes (``time_min``), as submitit and hydra-submitit-launcher spell it.
- ``container`` becomes ``srun --container-image=... [--container-mounts=...]`` (pyxis); the
  job then runs ``python`` from inside the image (``python`` field, default ``python3``).
  Without a container the job runs the submitting interpreter (``sys.executable``), so the
  same virtual environment must be visible on the compute nodes (shared file system).

**No Slurm: one GPU machine** (``scheduler: local``, ``slurm/profiles/workstation.yaml``). Such a
profile describes this machine: one node with 1 to :data:`MAX_LOCAL_GPUS` GPUs, and nothing
else (the Slurm fields, CPUs, memory and time are refused: nothing would read them). Its cells
run with the ``local`` launcher, one after another in the launching process (a paper-scale cell
takes every GPU), whatever ``launcher`` says (``scale=paper`` sets ``slurm``); each cell runs with
:data:`LOCAL_GPUS_ENV` set to its GPU count, the local counterpart of Slurm's
``SLURM_GPUS_ON_NODE`` (``fp8rl.backends.openrlhf.run.allocation``). The launch field
``gpus_per_node=N`` replaces every slot's GPU count of the selected profile (validated like the
file: 1-8 for a local profile), e.g. ``cluster=workstation gpus_per_node=4``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fp8rl.procenv import LOCAL_GPUS_ENV  # noqa: F401  (re-exported: the launcher's name for it)

#: Directory of the shipped profiles, relative to the repository root.
PROFILES_DIR = Path(__file__).resolve().parents[2] / "slurm" / "profiles"

_RESOURCE_KEYS = ("nodes", "gpus_per_node", "cpus_per_task", "mem_gb", "time_min")
#: ``scheduler`` values: submit to Slurm, or run the cells on this machine (no Slurm).
SCHEDULERS = ("slurm", "local")
#: Most GPUs a ``scheduler: local`` profile may give a cell (one machine).
MAX_LOCAL_GPUS = 8
#: Resource fields of a ``scheduler: local`` profile (the others are Slurm requests).
_LOCAL_RESOURCE_KEYS = ("nodes", "gpus_per_node")


#: ``additional_parameters`` that claim GPUs or a whole node; dropped for cells that ask for no
#: GPU (a mini cell sent with a GPU profile asks for CPUs and memory only).
GPU_NODE_PARAMETERS = frozenset({"exclusive", "gres", "gpus", "gpus_per_node", "gpus_per_task",
                                 "gpus_per_socket", "gpu_bind", "gpu_freq", "cpus_per_gpu", "mem_per_gpu"})


class ProfileError(ValueError):
    """A missing or malformed cluster profile (the message names the file and the field)."""


@dataclass(frozen=True)
class Resources:
    """What one cell (one array task) asks for; ``local``: this machine, no Slurm (a
    ``scheduler: local`` profile's resources)."""

    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: int | None = None
    time_min: int = 60
    local: bool = False

    def __post_init__(self) -> None:
        for f in ("nodes", "cpus_per_task", "time_min"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ProfileError(f"resources.{f} must be an integer >= 1, got {v!r}")
        if not isinstance(self.gpus_per_node, int) or isinstance(self.gpus_per_node, bool) or self.gpus_per_node < 0:
            raise ProfileError(f"resources.gpus_per_node must be an integer >= 0, got {self.gpus_per_node!r}")
        if self.mem_gb is not None and (not isinstance(self.mem_gb, int) or self.mem_gb < 1):
            raise ProfileError(f"resources.mem_gb must be an integer >= 1 or null, got {self.mem_gb!r}")

    def describe(self) -> str:
        if self.local:
            return f"this machine (no Slurm), {self.nodes} node x {self.gpus_per_node} GPU(s)"
        mem = f", {self.mem_gb} GB" if self.mem_gb else ", no memory request"
        gpus = f"{self.gpus_per_node} GPU(s)" if self.gpus_per_node else "no GPU"
        return (f"{self.nodes} node(s) x {gpus}, {self.cpus_per_task} CPU(s)/task"
                f"{mem}, {self.time_min} min")

    def sbatch_flags(self) -> str:
        """The request as ``sbatch`` flags (no GPU flag when the cell asks for none)."""
        gpus = f" --gpus-per-node={self.gpus_per_node}" if self.gpus_per_node else ""
        mem = f" --mem={self.mem_gb}G" if self.mem_gb else ""
        return (f"--nodes={self.nodes} --ntasks-per-node=1{gpus} --cpus-per-task={self.cpus_per_task}"
                f"{mem} --time={self.time_min}")


@dataclass(frozen=True)
class ClusterProfile:
    """A validated cluster profile (fields: see ``slurm/profiles/example.yaml``)."""

    name: str
    path: str
    scheduler: str = "slurm"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    array_parallelism: int = 16
    resources: dict[str, Resources] = field(default_factory=dict)
    setup: tuple[str, ...] = ()
    container: str | None = None
    container_mounts: str | None = None
    python: str | None = None
    signal_delay_s: int = 120
    max_num_timeout: int = 3
    additional_parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def local(self) -> bool:
        """``scheduler: local``: the cells run on this machine, no Slurm."""
        return self.scheduler == "local"

    def resources_for(self, slot: str) -> Resources:
        """The request of a cell of model slot ``slot`` (``default`` overridden by ``slot``)."""
        return self.resources.get(slot, self.resources["default"])

    def with_gpus_per_node(self, gpus: Any) -> ClusterProfile:
        """This profile with every slot's ``gpus_per_node`` replaced (the ``gpus_per_node=N``
        launch field); validated as the file is."""
        where = f"gpus_per_node={gpus!r} (overriding cluster profile {self.name!r}, {self.path})"
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ProfileError(f"{where}: give an integer >= 1 (GPUs per node for every model slot), "
                               "or leave gpus_per_node unset to keep the profile's")
        if self.local:
            _check_local_gpus(gpus, where, hint="")
        return dataclasses.replace(self, resources={k: dataclasses.replace(r, gpus_per_node=gpus)
                                                    for k, r in self.resources.items()})

    def python_command(self) -> str | None:
        """The job's ``python`` (submitit's ``slurm_python``, an executor constructor argument, not
        an ``update_parameters`` one): ``python``, else ``python3`` in a container, else None
        (the submitting interpreter)."""
        if self.python:
            return self.python
        return "python3" if self.container else None

    def executor_parameters(self, res: Resources, *, array_parallelism: int | None = None) -> dict:
        """Keyword arguments for ``submitit.AutoExecutor.update_parameters`` (the job's python:
        :meth:`python_command`)."""
        if self.local:
            raise ProfileError(f"cluster profile {self.path} has scheduler: local (no Slurm); its cells "
                               "run with the local launcher, not as Slurm jobs")
        params: dict[str, Any] = {
            "timeout_min": res.time_min,
            "nodes": res.nodes,
            "tasks_per_node": 1,
            "cpus_per_task": res.cpus_per_task,
            "slurm_array_parallelism": array_parallelism or self.array_parallelism,
            "slurm_signal_delay_s": self.signal_delay_s,
        }
        if res.gpus_per_node:  # a cell without GPUs carries no GPU flag at all
            params["gpus_per_node"] = res.gpus_per_node
        if res.mem_gb:
            params["mem_gb"] = res.mem_gb
        for key in ("partition", "account", "qos", "constraint", "exclude"):
            if getattr(self, key):
                params[f"slurm_{key}"] = getattr(self, key)
        if self.setup:
            params["slurm_setup"] = list(self.setup)
        if self.container:
            srun = [f"--container-image={self.container}"]
            if self.container_mounts:
                srun.append(f"--container-mounts={self.container_mounts}")
            params["slurm_srun_args"] = srun
        extra = dict(self.additional_parameters)
        if not res.gpus_per_node:  # a CPU cell (mini scale) must not hold a GPU node whole
            extra = {k: v for k, v in extra.items() if k.replace("-", "_") not in GPU_NODE_PARAMETERS}
        if extra:
            params["slurm_additional_parameters"] = extra
        return params


_TOP_KEYS = {f.name for f in dataclasses.fields(ClusterProfile)} - {"name", "path"}


def available_profiles(search_dir: Path = PROFILES_DIR) -> list[str]:
    """Names of the profiles shipped in ``search_dir``."""
    if not search_dir.is_dir():
        return []
    return sorted(p.stem for p in search_dir.glob("*.yaml"))


def profile_path(name: str, search_dir: Path = PROFILES_DIR) -> Path:
    """The file of profile ``name`` (a name in ``search_dir`` or a path); raises if missing."""
    if not isinstance(name, str) or not name.strip():
        raise ProfileError(f"cluster must be a profile name or a YAML path, got {name!r}")
    looks_like_path = os.sep in name or name.endswith((".yaml", ".yml"))
    path = Path(name).expanduser() if looks_like_path else search_dir / f"{name}.yaml"
    if not path.is_file():
        avail = ", ".join(available_profiles(search_dir)) or "(none)"
        where = str(path) if looks_like_path else f"{search_dir}/{name}.yaml"
        raise ProfileError(
            f"cluster profile {name!r} not found ({where} does not exist); available profiles "
            f"in slurm/profiles: {avail}; or pass cluster=/path/to/profile.yaml "
            "(slurm/profiles/example.yaml documents the fields)"
        )
    return path


def load_profile(name: str, search_dir: Path = PROFILES_DIR) -> ClusterProfile:
    """Read and validate a cluster profile; raises :class:`ProfileError` naming the field."""
    path = profile_path(name, search_dir)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ProfileError(f"cluster profile {path} is not valid YAML: {e}") from e
    return parse_profile(raw, name=Path(name).stem, path=str(path))


def parse_profile(raw: Any, *, name: str, path: str) -> ClusterProfile:
    """Validate a profile's parsed YAML (a mapping)."""
    where = f"cluster profile {path}"
    if not isinstance(raw, dict):
        raise ProfileError(f"{where} must be a mapping of fields, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise ProfileError(f"{where}: unknown field(s) {unknown}; valid fields: {sorted(_TOP_KEYS)}")
    kw = dict(raw)
    scheduler = kw.get("scheduler", "slurm")
    if scheduler not in SCHEDULERS:
        raise ProfileError(f"{where}: scheduler must be one of {', '.join(SCHEDULERS)} (slurm: submit "
                           f"array jobs; local: run the cells on this machine, no Slurm), got {scheduler!r}")
    if scheduler == "local":
        slurm_only = sorted(k for k in raw if k not in ("scheduler", "resources"))
        if slurm_only:
            raise ProfileError(
                f"{where}: field(s) {slurm_only} apply to Slurm jobs only, and this profile has scheduler: "
                "local (its cells run on this machine, in the launching process); remove them, or set "
                "scheduler: slurm")
    for key in ("partition", "account", "qos", "constraint", "exclude", "container",
                "container_mounts", "python"):
        v = kw.get(key)
        if v is not None and not isinstance(v, str):
            raise ProfileError(f"{where}: {key} must be a string or null, got {v!r}")
        _check_no_control(v, key, where)
    for key, lo in (("array_parallelism", 1), ("signal_delay_s", 0), ("max_num_timeout", 0)):
        if key in kw:
            v = kw[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ProfileError(f"{where}: {key} must be an integer >= {lo}, got {v!r}")
    setup = kw.get("setup") or []
    if not isinstance(setup, list) or not all(isinstance(s, str) for s in setup):
        raise ProfileError(f"{where}: setup must be a list of shell lines (strings), got {setup!r}")
    for i, line in enumerate(setup):
        _check_no_control(line, f"setup[{i}]", where)
    kw["setup"] = tuple(setup)
    extra = kw.get("additional_parameters") or {}
    if not isinstance(extra, dict):
        raise ProfileError(f"{where}: additional_parameters must be a mapping, got {extra!r}")
    for k, v in extra.items():
        _check_no_control(str(k), f"additional_parameters key {str(k)!r}", where)
        _check_no_control(v if isinstance(v, str) else None, f"additional_parameters.{k}", where)
    kw["additional_parameters"] = extra
    kw["resources"] = _parse_resources(kw.get("resources"), where, local=scheduler == "local")
    try:
        return ClusterProfile(name=name, path=path, **kw)
    except ProfileError as e:
        raise ProfileError(f"{where}: {e}") from e


def _check_no_control(value: str | None, field: str, where: str) -> None:
    """Refuse control characters (C0, DEL) in a string the sbatch script will hold: a newline
    would start a new ``#SBATCH`` or shell line, a NUL or CR corrupts the script."""
    if value is None:
        return
    bad = sorted({c for c in value if ord(c) < 0x20 or ord(c) == 0x7F})
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        raise ProfileError(f"{where}: {field} holds control character(s) {shown} (in {value!r}); a "
                           "profile value must be one line of printable text (a newline would add "
                           "lines to the sbatch script)")


def _check_local_gpus(gpus: int, where: str, hint: str = "; the launch field gpus_per_node=N overrides it") -> None:
    if not 1 <= gpus <= MAX_LOCAL_GPUS:
        raise ProfileError(
            f"{where}: a scheduler: local profile runs each cell on this one machine with 1 to "
            f"{MAX_LOCAL_GPUS} GPUs, got {gpus}; give the number of GPUs the cells use "
            f"(1-{MAX_LOCAL_GPUS}{hint})")


def _parse_resources(raw: Any, where: str, *, local: bool = False) -> dict[str, Resources]:
    if not isinstance(raw, dict) or "default" not in raw:
        raise ProfileError(
            f"{where}: resources must be a mapping with a 'default' block (and optional per-slot "
            f"blocks 8b/14b/32b), got {raw!r}"
        )
    from fp8rl.config import MODEL_SLOTS

    default = raw["default"]
    out: dict[str, Resources] = {}
    for key, block in raw.items():
        if key != "default" and key not in MODEL_SLOTS:
            raise ProfileError(f"{where}: resources.{key}: unknown block; valid: default, {', '.join(MODEL_SLOTS)}")
        if not isinstance(block, dict):
            raise ProfileError(f"{where}: resources.{key} must be a mapping, got {block!r}")
        bad = sorted(set(block) - set(_RESOURCE_KEYS))
        if bad:
            raise ProfileError(f"{where}: resources.{key}: unknown field(s) {bad}; valid: {list(_RESOURCE_KEYS)}")
        if local:
            slurm_only = sorted(set(block) - set(_LOCAL_RESOURCE_KEYS))
            if slurm_only:
                raise ProfileError(f"{where}: resources.{key}: field(s) {slurm_only} are Slurm requests; a "
                                   f"scheduler: local profile has {list(_LOCAL_RESOURCE_KEYS)} only")
        merged = {**default, **block} if key != "default" else dict(block)
        try:
            out[key] = Resources(**merged, local=local)
        except ProfileError as e:
            raise ProfileError(f"{where}: resources.{key}: {e}") from e
        except TypeError as e:
            raise ProfileError(f"{where}: resources.{key}: {e}") from e
        if local:
            if out[key].nodes != 1:
                raise ProfileError(f"{where}: resources.{key}: a scheduler: local profile is one machine, "
                                   f"so nodes must be 1, got {out[key].nodes}; use a Slurm profile for "
                                   "several nodes")
            _check_local_gpus(out[key].gpus_per_node, f"{where}: resources.{key}")
    return out
