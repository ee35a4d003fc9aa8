"""Launchers: how the validated cells of a sweep run (registry ``LAUNCHERS``).

=================  ==================================================================  =======
name               what it does                                                         blocks
=================  ==================================================================  =======
``local``          ``workers`` cells at once (default: one per CPU core) in a pool of   yes
                   worker processes; ``workers=1``: one after the other in this
                   process (the default launcher at mini scale); with a
                   ``scheduler: local`` profile (``cluster=workstation``): one after
                   the other on this machine's GPUs, whatever ``launcher`` says
``local_parallel`` submitit's local executor: up to ``array_parallelism`` (default 2)    yes
                   cells side by side, each in its own process
``slurm``          submitit's Slurm executor: one array job per sweep (one per          no
                   distinct resource request) with ``array_parallelism``, resources
                   from the cluster profile; submit and return (``wait=true`` blocks)
=================  ==================================================================  =======

Why not hydra-submitit-launcher's ``launch()``: it blocks until every job of the sweep has
ended (``[j.results()[0] for j in jobs]``), and each job re-composes its config from the YAML
files when it starts, possibly hours after validation. We use submitit (the library that
launcher wraps) directly, with the same parameter names as its ``SlurmQueueConf``, submit the
already validated configs (``fp8rl.launch.job``), record the job ids in the manifest and
return. Preemption and time-out requeue the task (``CellJob`` is ``Checkpointable``), and the
run resumes from its checkpoint.

Every launcher returns a :class:`LaunchResult`: the job id of each submitted cell (Slurm) and
the cells that failed (blocking launchers). ``preflight(cells, plan)`` runs before the manifest
is written and raises ``SweepError`` when this machine cannot run the plan (the ``local``
launcher with a ``scheduler: local`` profile: fewer CUDA GPUs than a cell asks for).

One GPU machine (a ``scheduler: local`` profile, ``fp8rl.launch.profiles``): the cells run one
after another in this process; while a cell runs, :data:`~fp8rl.procenv.LOCAL_GPUS_ENV`
holds its GPU count (the backend's allocation: ``fp8rl.backends.openrlhf.run.allocation``), and
the backend starts Ray on this host (``fp8rl.backends.openrlhf.ray_cluster.bootstrap``: no Slurm allocation,
so one node and no ``srun``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from fp8rl.registry import Registry


@dataclass
class LaunchResult:
    """``job_ids``: run-dir basename -> job id; ``failed`` / ``skipped``: (run-dir basename,
    reason); a cell is skipped when another live process owned its run directory."""

    job_ids: dict[str, str] = field(default_factory=dict)
    failed: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    waited: bool = True


def _reason_from_rundir(run_dir: Path, fallback: str) -> str:
    from fp8rl.runs import RunDir

    try:
        st = RunDir(run_dir).status() if run_dir.exists() else None
    except (OSError, ValueError) as e:  # a damaged status.json: say so beside the error
        return f"{fallback} ({e})"
    return (st or {}).get("reason") or fallback


class Launcher:
    """Base: ``name``, ``needs_cluster`` and ``launch(cells, plan) -> LaunchResult``."""

    name = "abstract"
    needs_cluster = False
    default_wait = True

    def launch(self, cells: list, plan) -> LaunchResult:  # pragma: no cover - interface
        raise NotImplementedError

    def preflight(self, cells: list, plan) -> None:
        """Raise ``SweepError`` if this machine cannot run ``cells`` (before anything is written)."""
        return None


LAUNCHERS: Registry[Launcher] = Registry("launcher")


def visible_gpus() -> int:
    """CUDA GPUs this process can use (``torch.cuda.device_count()``, honours CUDA_VISIBLE_DEVICES)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@contextlib.contextmanager
def local_allocation(resources):
    """While a cell of a ``scheduler: local`` profile runs: its GPU count in ``LOCAL_GPUS_ENV``."""
    from fp8rl.launch.profiles import LOCAL_GPUS_ENV

    if resources is None or not resources.local:
        yield
        return
    old = os.environ.get(LOCAL_GPUS_ENV)
    os.environ[LOCAL_GPUS_ENV] = str(resources.gpus_per_node)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(LOCAL_GPUS_ENV, None)
        else:
            os.environ[LOCAL_GPUS_ENV] = old


def available_cores() -> int:
    """CPU cores this process may use (its affinity mask, e.g. a Slurm allocation)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class LocalLauncher(Launcher):
    """Run the cells on this machine, ``workers`` at a time (default: one per CPU core).

    With more than one worker the cells run in a :class:`~fp8rl.launch.pool.WorkerPool` (one
    torch thread per worker); one-time work the cells share (the backend's ``prepare``: the
    mini backend's SFT warm starts) is queued first, once per distinct key, so that workers
    prepare different things side by side instead of waiting for each other. With one worker
    the cells run one after another in this process. A cell whose run directory another live
    process owns is skipped and reported (``fp8rl.runs.lock``).
    """

    name = "local"

    def preflight(self, cells: list, plan) -> None:
        profile = plan.profile
        if profile is None or not profile.local:
            return
        need = max((c.resources.gpus_per_node for c in cells if c.resources is not None), default=0)
        have = visible_gpus()
        if have < need:
            from fp8rl.launch.errors import SweepError

            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            seen = f"{have} CUDA GPU(s) (torch.cuda.device_count()" + (
                f", CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ")")
            fix = (f"give gpus_per_node={have} (each slot's vLLM TP must fit it)" if have else
                   "run on a GPU machine, or submit the cells with a Slurm profile (cluster=NAME)")
            raise SweepError(f"cluster={profile.name} gives each cell {need} GPU(s), but this machine shows "
                             f"{seen}; nothing was run or written; {fix}")

    def launch(self, cells: list, plan) -> LaunchResult:
        from fp8rl.launch.progress import SweepProgress, echo

        local_gpus = plan.profile is not None and plan.profile.local
        width = 1 if local_gpus else max(1, min(plan.workers or available_cores(), len(cells)))
        how = "in this process" if width == 1 else f"{width} at a time in worker processes"
        if local_gpus:
            how = (f"one after another in this process on this machine's GPUs (cluster profile "
                   f"{plan.profile.name}, no Slurm)")
        echo(f"[{plan.sweep_name}] running {len(cells)} cell(s) {how}")
        res = LaunchResult()
        with SweepProgress(cells, name=plan.sweep_name, workers=width) if plan.progress else _Null():
            if width == 1:
                self._sequential(cells, res)
            else:
                self._pool(cells, width, res)
        return res

    @staticmethod
    def _record(res: LaunchResult, c, summary: dict | None, error: str | None) -> None:
        if error is not None:
            res.failed.append((c.run_dir.name, _reason_from_rundir(c.run_dir, error)))
        elif summary and summary.get("owned_by") is not None:
            res.skipped.append((c.run_dir.name, f"running elsewhere, owned by {summary['owned_by']}"))

    def _sequential(self, cells: list, res: LaunchResult) -> None:
        from fp8rl.launch.job import run_cell
        from fp8rl.runs.stop import RunStopped, stop_requested

        for c in cells:
            if stop_requested():  # Ctrl-C: no new cell starts
                return
            try:
                with local_allocation(c.resources):
                    summary = run_cell(c.payload(progress=False))
                self._record(res, c, summary, None)
            except RunStopped:  # stopped at a safe point on request: resumable
                return
            except Exception as e:
                self._record(res, c, None, f"{type(e).__name__}: {e}")

    def _pool(self, cells: list, width: int, res: LaunchResult) -> None:
        from fp8rl.launch.job import prepare_key
        from fp8rl.launch.pool import WorkerPool

        tasks: list[tuple] = []
        seen: set = set()
        for c in cells:
            key = prepare_key(c.payload())
            if key is not None and key not in seen:
                seen.add(key)
                tasks.append((("prepare", key), "fp8rl.launch.job:prepare_cell", (c.payload(),)))
        by_index = {c.index: c for c in cells}
        tasks += [(("cell", c.index), "fp8rl.launch.job:run_cell", (c.payload(),)) for c in cells]
        from fp8rl.launch.progress import echo
        from fp8rl.runs.stop import stop_requested

        for out in WorkerPool(width).run(tasks, stopping=stop_requested):
            kind, ident = out.key
            if out.stopped:  # Ctrl-C: resumable, summarised by the launch (fp8rl.launch.interrupt)
                continue
            if kind == "prepare":
                if not out.ok:  # the cells will meet (and report) the same error themselves
                    echo(f"preparing {ident} failed: {out.error}")
                continue
            self._record(res, by_index[ident], out.value, None if out.ok else out.error)


class LocalParallelLauncher(Launcher):
    """submitit's local executor (``submitit_local``): a window of parallel processes."""

    name = "local_parallel"

    def launch(self, cells: list, plan) -> LaunchResult:
        import submitit

        from fp8rl.launch.job import CellJob
        from fp8rl.launch.progress import SweepProgress

        executor = submitit.LocalExecutor(folder=plan.sweep_dir / ".submitit" / "%j")
        executor.update_parameters(timeout_min=24 * 60, tasks_per_node=1, nodes=1, gpus_per_node=0)
        width = plan.array_parallelism or 2
        res = LaunchResult()
        pending, running = list(cells), []
        display = SweepProgress(cells, name=plan.sweep_name) if plan.progress else None
        if display:
            display.__enter__()
        from fp8rl.runs.stop import stop_requested

        cancelled = False
        try:
            while pending or running:
                if stop_requested() and not cancelled:  # Ctrl-C: start nothing more, interrupt the rest
                    pending, cancelled = [], True
                    for _, job in running:
                        with contextlib.suppress(Exception):
                            job.cancel(check=False)
                while pending and len(running) < width:
                    c = pending.pop(0)
                    job = executor.submit(CellJob(), c.payload())
                    res.job_ids[c.run_dir.name] = str(job.job_id)
                    running.append((c, job))
                still = []
                for c, job in running:
                    if not job.done():
                        still.append((c, job))
                        continue
                    exc = job.exception()
                    if exc is not None and not cancelled:
                        res.failed.append((c.run_dir.name, _reason_from_rundir(c.run_dir, str(exc).strip().splitlines()[-1])))
                running = still
                time.sleep(0.5)
        except BaseException:
            for _, job in running:  # a second Ctrl-C: interrupt what still runs
                with contextlib.suppress(Exception):
                    job.cancel(check=False)
            raise
        finally:
            if display:
                display.__exit__(None, None, None)
        return res


class SlurmLauncher(Launcher):
    """One Slurm array per sweep (per distinct resource request); submit and return."""

    name = "slurm"
    needs_cluster = True
    default_wait = False

    def launch(self, cells: list, plan) -> LaunchResult:
        import subprocess

        import submitit
        from submitit.core.utils import FailedJobError

        from fp8rl.launch.errors import SweepError
        from fp8rl.launch.job import CellJob

        profile = plan.profile
        assert profile is not None, "validated plans for launcher=slurm carry a cluster profile"
        assert not profile.local, "scheduler: local profiles run with the local launcher (fp8rl.launch.grid)"
        python = {"slurm_python": profile.python_command()} if profile.python_command() else {}
        executor = submitit.AutoExecutor(folder=plan.sweep_dir / ".submitit" / "%j", cluster="slurm",
                                         slurm_max_num_timeout=profile.max_num_timeout, **python)
        groups: dict = defaultdict(list)
        for c in cells:
            groups[c.resources].append(c)
        res = LaunchResult(waited=False)
        jobs = []
        for resources, group in groups.items():
            executor.update_parameters(name=f"fp8rl-{plan.sweep_name}",
                                       **profile.executor_parameters(resources, array_parallelism=plan.array_parallelism))
            try:
                submitted = executor.map_array(CellJob(), [c.payload() for c in group])
            except (subprocess.CalledProcessError, FailedJobError, OSError) as e:
                raise SweepError(_refused(e, group, resources, sorted(res.job_ids))) from e
            for c, job in zip(group, submitted, strict=True):
                res.job_ids[c.run_dir.name] = str(job.job_id)
                jobs.append((c, job))
        arrays = sorted({j.split("_", 1)[0] for j in res.job_ids.values()})
        print(f"[{plan.sweep_name}] submitted {len(cells)} cell(s) as Slurm array job(s) "
              f"{', '.join(arrays)}; follow with: python -m experiments.status {plan.sweep_dir}",
              file=sys.stderr)
        wait = plan.wait if plan.wait is not None else self.default_wait
        if wait:
            res.waited = True
            from fp8rl.launch.progress import SweepProgress

            with SweepProgress(cells, name=plan.sweep_name) if plan.progress else _Null():
                from fp8rl.runs.stop import stop_requested

                while not all(job.done(force_check=True) for _, job in jobs):
                    if stop_requested():  # Ctrl-C: stop waiting; the jobs keep running on the cluster
                        res.waited = False
                        return res
                    time.sleep(2.0)
            for c, job in jobs:
                if job.state not in ("COMPLETED",):
                    res.failed.append((c.run_dir.name, _reason_from_rundir(c.run_dir, f"Slurm state {job.state}")))
        return res


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


LAUNCHERS.add("local", LocalLauncher())
LAUNCHERS.add("local_parallel", LocalParallelLauncher())
LAUNCHERS.add("slurm", SlurmLauncher())


def _refused(e: BaseException, group: list, resources, submitted: list[str]) -> str:
    """One message for an array that sbatch refused: what was asked, sbatch's own last line,
    what was already submitted, and how to check the request."""
    detail = getattr(e, "stderr", None) or getattr(e, "output", None) or ""
    detail = detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
    lines = [ln for ln in (detail.strip() or str(e)).splitlines() if ln.strip()]
    why = lines[-1] if lines else type(e).__name__
    done = (f"{len(submitted)} cell(s) of earlier arrays were submitted ({', '.join(submitted)})"
            if submitted else "nothing was submitted")
    return (f"sbatch refused the array of {len(group)} cell(s) asking for {resources.describe()}: {why}; "
            f"{done}. Check the cluster profile's partition and resources (sinfo, scontrol show "
            f"partition) or look at the request with dry_run=true")

