"""Multi-node Ray inside a Slurm allocation (paper scale): head, workers, readiness, driver, teardown.

``slurm/ray_bootstrap.py`` runs :func:`bootstrap` once per allocation, on the first node (the
batch script's node):

1. the allocation's nodes: ``scontrol show hostnames $SLURM_JOB_NODELIST`` (outside Slurm: this
   host only);
2. ``ray start --head --block`` on the first node, with ``--num-gpus`` = GPUs per node;
3. ``srun --nodes=1 --ntasks=1 -w NODE --overlap ray start --address=HEAD:PORT --block`` for
   every other node (background);
4. readiness: poll ``ray.nodes()`` until every node is alive and the cluster has
   ``nodes x gpus_per_node`` GPUs, with a deadline; past it, raise :class:`RayBootstrapError`
   naming how many nodes and GPUs joined and which hosts are missing;
5. run the backend driver (any command) with ``RAY_ADDRESS`` set, and return its exit status;
6. tear down in every case: stop the worker ``srun`` steps and the head, by process group --
   ``ray start`` runs in a session of its own, and the Ray services and workers it starts stay in
   its group -- so only this job's Ray goes, never another job's on a shared node (``ray stop
   --force`` would stop every Ray on the machine).

On a CPU node the same code runs a one-node Ray with zero GPUs (``gpus_per_node=0``).
OpenRLHF's upstream Slurm example starts Ray the same way but sleeps fixed times instead of
checking that the nodes joined (``reference/openrlhf.md``); here the driver starts only once
the cluster is complete.

Ray is imported lazily (it is in the ``cluster`` extra, not a core dependency).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class RayBootstrapError(RuntimeError):
    """Ray did not come up as requested (the message says what is missing)."""


@dataclass(frozen=True)
class ClusterState:
    """What Ray reports: alive node hosts and the total number of GPUs."""

    hosts: tuple[str, ...]
    gpus: float


def allocation_nodes() -> list[str]:
    """Host names of the Slurm allocation, first = head; outside Slurm ``[this host]``."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return [socket.gethostname()]
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    nodes = [n for n in out.split() if n]
    if not nodes:
        raise RayBootstrapError(f"scontrol returned no hosts for SLURM_JOB_NODELIST={nodelist!r}")
    return nodes


def wait_for_cluster(get_state: Callable[[], ClusterState | None], *, nodes: int, gpus: float,
                     deadline_s: float, poll_s: float = 1.0, expected_hosts: Sequence[str] = (),
                     clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> ClusterState:
    """Poll ``get_state`` until ``nodes`` nodes and ``gpus`` GPUs are up; raise past the deadline.

    ``get_state`` returns ``None`` while the head does not answer.
    """
    t0 = clock()
    state: ClusterState | None = None
    while True:
        state = get_state()
        if state is not None and len(state.hosts) >= nodes and state.gpus >= gpus:
            return state
        if clock() - t0 >= deadline_s:
            if state is None:
                raise RayBootstrapError(f"the Ray head did not answer within {deadline_s:.0f} s")
            missing = sorted(set(expected_hosts) - set(state.hosts))
            raise RayBootstrapError(
                f"Ray cluster incomplete after {deadline_s:.0f} s: {len(state.hosts)}/{nodes} nodes "
                f"and {state.gpus:g}/{gpus:g} GPUs joined"
                + (f"; missing hosts: {', '.join(missing)}" if missing else "")
                + "; check the worker logs (srun output) and that GPUs are visible on every node"
            )
        sleep(poll_s)


def _ray_state(address: str) -> Callable[[], ClusterState | None]:
    """A ``get_state`` for :func:`wait_for_cluster` that asks Ray (connects lazily)."""
    import ray

    host, port = address.rsplit(":", 1)

    def get() -> ClusterState | None:
        if not ray.is_initialized():
            try:
                with socket.create_connection((host, int(port)), timeout=1):
                    pass
            except OSError:
                return None
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        alive = [n for n in ray.nodes() if n.get("Alive")]
        return ClusterState(hosts=tuple(sorted(n.get("NodeManagerHostname", "?") for n in alive)),
                            gpus=float(sum(n.get("Resources", {}).get("GPU", 0) for n in alive)))

    return get


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def reap(state_file: str | os.PathLike, log=None) -> None:
    """Kill the Ray a previous attempt of this job left on this host (its process group).

    Slurm cancels and requeues a task by signalling its own processes; Ray's services run in a
    session of their own (``ray start``) and are not among them, so a killed attempt can leave
    its Ray running. :func:`bootstrap` records the head's process group in ``state_file``; the next
    attempt calls this first. Only a group that still runs a ``ray`` process is killed."""
    log = sys.stderr if log is None else log  # resolved per call: a worker redirects it per cell
    import json

    try:
        state = json.loads(open(state_file, encoding="utf-8").read())
    except (OSError, ValueError):
        return
    if state.get("host") != socket.gethostname():
        return
    pgid = int(state["pgid"])
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        members.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
            except (OSError, IndexError, ValueError):
                continue
    if members and any("ray" in m for m in members):
        print(f"[ray_bootstrap] killing {len(members)} process(es) of a previous attempt's Ray (group {pgid})",
              file=log)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def bootstrap(command: Sequence[str], *, gpus_per_node: int, port: int | None = None,
              deadline_s: float = 300.0, ray_bin: str | None = None, log=None,
              num_cpus: int | None = None, state_file: str | os.PathLike | None = None) -> int:
    """Start Ray on the allocation, run ``command`` against it, tear down; returns its status.

    ``num_cpus``: logical CPUs per node (None: Ray counts them). A CPU job passes placeholder
    GPUs (``gpus_per_node``) and more logical CPUs than cores, so that OpenRLHF's actors (one
    CPU each in Ray's bookkeeping) all get scheduled on a small machine. ``state_file``: where the
    head's process group is recorded, and a previous attempt's Ray reaped first (:func:`reap`)."""
    log = sys.stderr if log is None else log  # resolved per call: a worker redirects it per cell
    if not command:
        raise RayBootstrapError("no driver command given (usage: ray_bootstrap.py [options] -- CMD ...)")
    ray_bin = ray_bin or shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    if not os.path.exists(ray_bin):
        raise RayBootstrapError(f"the ray CLI was not found ({ray_bin}); install the cluster extra: "
                                "pip install -e '.[cluster]'")
    nodes = allocation_nodes()
    head = nodes[0]
    head_ip = socket.gethostbyname(head)
    port = port or _free_port()
    address = f"{head_ip}:{port}"
    procs: list[subprocess.Popen] = []
    print(f"[ray_bootstrap] head {head} ({address}), {len(nodes)} node(s) x {gpus_per_node} GPU(s)", file=log)
    if state_file is not None:
        reap(state_file, log=log)
    try:
        procs.append(subprocess.Popen(
            [ray_bin, "start", "--head", f"--node-ip-address={head_ip}", f"--port={port}",
             f"--num-gpus={gpus_per_node}", *([f"--num-cpus={num_cpus}"] if num_cpus else []),
             "--block", "--disable-usage-stats", "--include-dashboard=false"],
            stdin=subprocess.DEVNULL, start_new_session=True))
        if state_file is not None:
            import json

            with open(state_file, "w", encoding="utf-8") as f:
                json.dump({"host": socket.gethostname(), "pgid": procs[0].pid}, f)
        for node in nodes[1:]:
            procs.append(subprocess.Popen(
                ["srun", "--nodes=1", "--ntasks=1", "-w", node, "--overlap",
                 ray_bin, "start", f"--address={address}", f"--num-gpus={gpus_per_node}", "--block",
                 "--disable-usage-stats"],
                stdin=subprocess.DEVNULL, start_new_session=True))
        state = wait_for_cluster(_ray_state(address), nodes=len(nodes), gpus=len(nodes) * gpus_per_node,
                                 deadline_s=deadline_s, expected_hosts=nodes)
        print(f"[ray_bootstrap] ready: {len(state.hosts)} node(s), {state.gpus:g} GPU(s); running "
              f"{' '.join(command)}", file=log)
        import ray

        ray.shutdown()
        return subprocess.run(list(command), env={**os.environ, "RAY_ADDRESS": address}, check=False).returncode
    finally:
        teardown(procs, ray_bin, log=log)


def teardown(procs: list[subprocess.Popen], ray_bin: str, *, timeout_s: float = 30.0, log=None) -> None:
    """Stop the worker steps and the head: SIGTERM to each process group, SIGKILL to what is left."""
    log = sys.stderr if log is None else log  # resolved per call: a worker redirects it per cell
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except ImportError:
        pass
    for p in reversed(procs):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:  # the Ray services and workers this job started share the group; nothing else does
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    print("[ray_bootstrap] Ray stopped (this job's processes only)", file=log)
