"""The sweep driver behind ``python -m experiments.launch``: plan, then dry-run or launch.

Called by the Hydra sweeper (``hydra_plugins/fp8rl_launch``) with the composed primary config:

1. ``fp8rl.launch.grid.plan_sweep``: expand the grid and validate every cell (nothing is
   written; any problem aborts with :class:`~fp8rl.launch.grid.SweepError`);
2. ``dry_run=true``: print every cell (run directory, state, resources, command) and stop; a
   warning first where cells' FP8 recipe needs a newer CUDA than the cluster profile's setup
   loads (``fp8rl.launch.cuda``; a launch prints it too);
3. otherwise classify the cells (and let the launcher check that this machine can run those
   to launch, ``Launcher.preflight``: a local GPU profile needs its GPUs here): DONE cells are skipped, cells whose Slurm job (from the
   manifest) is still pending or running are left alone, cells whose run directory is owned
   by another live process (``fp8rl.runs.lock``: a second launch, a duplicate job) are
   skipped naming the owner, cells whose ``status.json`` cannot be read, or says DONE while
   ``metrics.jsonl`` is missing or short, are reported ``DAMAGED`` with the file and its fix and
   not run (exit status 1), all others (new, FAILED, PREEMPTED, interrupted, or whose owner
   died) are launched, and incomplete ones resume from their checkpoints;
4. write ``<output_dir>/<sweep_name>/manifest.json`` *before* launching (cells of earlier
   launches of the same sweep that are not in this grid are kept), launch, and record the job
   ids; a blocking launcher's failed cells are listed and the exit status is 1;
5. Ctrl-C or SIGTERM while a blocking launcher runs (``fp8rl.launch.interrupt``): running cells
   stop at a safe point (a second Ctrl-C: at once), then one summary (DONE, resumable, not
   started, the command that resumes) and exit status 130 (143 for SIGTERM).
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
from dataclasses import dataclass, field

from fp8rl.launch.grid import CellPlan, SweepError, SweepPlan, plan_sweep


def describe_cell(c: CellPlan, plan: SweepPlan) -> list[str]:
    """Lines a dry run prints for one cell."""
    drop = ("dry_run=", "seeds=")
    cmd = ["python", "-m", "experiments.launch", *[o for o in c.overrides if not o.startswith(drop)]]
    if not any(o.startswith("seed=") for o in c.overrides):
        cmd.append(f"seed={c.seed}")
    res = c.resources.describe() if c.resources else "this machine"
    lines = [
        f"{c.label}  [{c.state or 'new'}]",
        f"    run dir:   {c.run_dir}",
        f"    backend:   {c.backend}, launcher: {plan.launcher}, resources: {res}",
        f"    command:   {shlex.join(cmd)}",
    ]
    from fp8rl.launch.backends import BACKENDS
    from fp8rl.launch.job import build_config

    describe = BACKENDS[c.backend].load_describe()
    extra = describe(build_config(c.payload()), c.resources, c.run_dir) if describe is not None else []
    if c.resources is not None and not c.resources.local and not any(x.lstrip().startswith("sbatch:") for x in extra):
        lines.append(f"    sbatch:    {c.resources.sbatch_flags()}")
    return lines + extra  # backend-specific lines (e.g. the OpenRLHF command)


def print_plan(plan: SweepPlan, stream=None) -> None:
    stream = stream or sys.stdout
    n_done = sum(c.state == "DONE" for c in plan.cells)
    prof = f", cluster profile {plan.profile.name} ({plan.profile.path})" if plan.profile else ""
    print(f"sweep {plan.sweep_name}: {len(plan.cells)} cell(s) valid, {n_done} DONE; "
          f"sweep dir {plan.sweep_dir}; launcher {plan.launcher}{prof}", file=stream)
    from fp8rl.launch.cuda import cuda_warnings

    for line in cuda_warnings(plan):  # a recipe that needs a newer CUDA than the profile loads
        print(line, file=stream)
    for c in plan.cells:
        for line in describe_cell(c, plan):
            print(line, file=stream)
    print("dry run: nothing was run, submitted or written", file=stream)


#: The launcher's messages and stop summaries, appended per launch (``fp8rl.launch.progress.log``).
LAUNCH_LOG = "launch.log"


def execute(plan: SweepPlan, stream=None) -> int:
    """Launch the plan's cells that need running; returns an exit status."""
    from fp8rl.launch.launchers import LAUNCHERS
    from fp8rl.runs import MANIFEST_FILE, Cell, read_manifest, write_manifest
    from fp8rl.runs.manifest import ManifestDamaged

    stream = stream or sys.stderr
    if plan.dry_run:
        print_plan(plan, sys.stdout)
        return 0
    previous: dict[str, Cell] = {}
    if (plan.sweep_dir / MANIFEST_FILE).exists():
        try:
            previous = {c.run_dir: c for c in read_manifest(plan.sweep_dir).cells}
        except ManifestDamaged as e:  # one line, nothing run or written
            print(f"Error: {e}; nothing was run, submitted or written", file=stream)
            return 1
    old_ids = {k: c.job_id for k, c in previous.items() if c.job_id}
    t = triage(plan, old_ids)
    todo, skipped_done, skipped_active, elsewhere, damaged = t.todo, t.done, t.active, t.elsewhere, t.damaged

    if todo:  # this machine must be able to run them (a local GPU profile: enough GPUs)
        LAUNCHERS[plan.launcher].preflight(todo, plan)
        from fp8rl.launch.cuda import cuda_warnings

        for line in cuda_warnings(plan):  # as the dry run says it
            print(line, file=stream)

    def manifest_cells(job_ids: dict[str, str]) -> list[Cell]:
        cur = {}
        for c in plan.cells:
            key = c.run_dir.name
            cur[key] = Cell(name=c.name, hash=c.hash, run_dir=key, axes=c.axes, overrides=c.overrides,
                            job_id=job_ids.get(key, old_ids.get(key)))
        kept = [p for k, p in previous.items() if k not in cur]
        return kept + list(cur.values())

    new_dirs = [d for d in (plan.sweep_dir, *plan.sweep_dir.parents) if not d.exists()]
    try:
        plan.sweep_dir.mkdir(parents=True, exist_ok=True)
        write_manifest(plan.sweep_dir, plan.sweep_name, manifest_cells({}))
    except OSError as e:  # a full or read-only disk: one line, and no empty sweep directory left
        for d in new_dirs:  # deepest first
            with contextlib.suppress(OSError):
                d.rmdir()
        print(f"Error: {getattr(e, 'cause', None) or e}; nothing was run", file=stream)
        return 1
    print(f"[{plan.sweep_name}] {len(plan.cells)} cell(s): {len(skipped_done)} DONE (skipped), "
          f"{len(skipped_active)} still queued or running (left alone), "
          f"{len(elsewhere)} running elsewhere (skipped), {len(todo)} to "
          f"{'submit' if LAUNCHERS[plan.launcher].needs_cluster else 'run'}", file=stream)
    for c, owner in elsewhere:
        print(f"  {c.run_dir.name}: running elsewhere, owned by "
              f"{owner.describe() if owner else 'another process'}", file=stream)
    for c, why in damaged:
        print(f"  {c.run_dir.name}: DAMAGED, not run: {why}", file=stream)
    if not todo:
        print(f"[{plan.sweep_name}] nothing to do", file=stream)
        return 1 if damaged else 0
    from fp8rl.launch.interrupt import Interrupt, summary_lines
    from fp8rl.launch.progress import console, log

    with console(plan.sweep_dir / LAUNCH_LOG) as out, Interrupt(plan.sweep_name) as intr:
        try:
            result = LAUNCHERS[plan.launcher].launch(todo, plan)
        except KeyboardInterrupt:  # a second Ctrl-C (or one outside a stop-aware launcher)
            intr.signum = intr.signum or signal.SIGINT
            result = None
        if intr.signum is not None:  # stopped: one summary, no traceback
            if result is not None and result.job_ids:
                write_manifest(plan.sweep_dir, plan.sweep_name, manifest_cells(result.job_ids))
            lines = summary_lines(plan, intr.describe())
            lines.append(f"(this summary is also in {plan.sweep_dir / LAUNCH_LOG})")
            log("\n".join(lines))
            for line in lines:
                print(line, file=out, flush=True)
            return intr.exit_status
    for name, reason in result.skipped:
        print(f"  {name}: skipped, {reason}", file=stream)
    if result.job_ids:
        write_manifest(plan.sweep_dir, plan.sweep_name, manifest_cells(result.job_ids))
    return _outcome(plan, result, len(damaged), stream)


@dataclass
class Triage:
    """The plan's cells by what a launch does with them (:func:`triage`)."""

    todo: list = field(default_factory=list)  #: to run or submit
    done: list = field(default_factory=list)  #: DONE: skipped
    active: list = field(default_factory=list)  #: their Slurm job is still queued or running: left alone
    elsewhere: list = field(default_factory=list)  #: ``(cell, owner)``: another live process runs it
    damaged: list = field(default_factory=list)  #: ``(cell, why)``: a run file cannot be trusted: not run


def triage(plan: SweepPlan, old_ids: dict[str, str]) -> Triage:
    """Sort the plan's cells: damaged, DONE, with a live Slurm job (``old_ids``: the manifest's job
    id per run directory name), owned by another process, or to run."""
    from fp8rl.launch.slurm import active_jobs
    from fp8rl.runs import DONE
    from fp8rl.runs.lock import probe

    active = active_jobs(old_ids.values()) if old_ids else set()
    t = Triage()
    for c in plan.cells:
        why = damaged_status(c.run_dir)
        if why is not None:  # its status.json cannot be read: say so, run the other cells
            t.damaged.append((c, why))
        elif c.state == DONE:
            t.done.append(c)
        elif old_ids.get(c.run_dir.name) in active:
            t.active.append(c)
        else:
            held, owner = probe(c.run_dir)
            if held:  # another live process (a second launch, a Slurm task) runs it
                t.elsewhere.append((c, owner))
            else:
                t.todo.append(c)
    return t


def _outcome(plan: SweepPlan, result, n_damaged: int, stream) -> int:
    """Say how a launch that ran to its end went (failed cells with their run logs and the resume
    command, damaged ones, or all finished); its exit status."""
    if result.failed:
        print(f"[{plan.sweep_name}] {len(result.failed)} cell(s) FAILED:", file=stream)
        from fp8rl.runs.runlog import log_path

        for name, reason in result.failed:
            log = log_path(plan.sweep_dir / name)
            print(f"  {name}: {reason}" + (f"; run log: {log}" if log.is_file() else ""), file=stream)
        if result.waited:  # a relaunch resumes each from its checkpoint and skips the DONE ones
            from fp8rl.launch.interrupt import resume_command

            print(f"[{plan.sweep_name}] after fixing the cause, resume with: {resume_command()}", file=stream)
        return 1
    if n_damaged:
        print(f"[{plan.sweep_name}] {n_damaged} cell(s) DAMAGED, not run (the fix is above)", file=stream)
        return 1
    if result.waited:
        print(f"[{plan.sweep_name}] all {len(plan.cells)} cell(s) finished; runs in {plan.sweep_dir}", file=stream)
    return 0


def damaged_status(run_dir) -> str | None:
    """Why the ``status.json`` of ``run_dir`` cannot be read (damaged, a symlink), or why the DONE
    it says is not backed by its ``metrics.jsonl`` (missing or short: ``RunDir.done_damage``), with
    the fix; None when neither."""
    from fp8rl.runs import RunDir

    try:
        return RunDir(run_dir).done_damage()
    except (OSError, ValueError) as e:
        return str(e)


def run_sweep(config, config_loader, params, arguments) -> int:
    """Plan (validate) and execute. A ``SweepError`` is printed here, its lines alone (Hydra would
    add its ``HYDRA_FULL_ERROR`` hint): exit status 1, or 2 for unknown keys and groups
    (``fp8rl.launch.keys.UnknownKeyError``). A Ctrl-C while the grid is validated ends with one
    line and status 130, nothing run or written."""
    try:
        plan = plan_sweep(config, config_loader, params, arguments)
    except SweepError as e:
        return _say_error(e)
    except KeyboardInterrupt:
        print("interrupted while validating the grid: nothing was run, submitted or written", file=sys.stderr)
        return 130
    try:
        return execute(plan)
    except SweepError as e:  # the launcher's preflight (a local GPU profile on this machine)
        return _say_error(e)


def _say_error(e: SweepError) -> int:
    print(f"Error: {e}", file=sys.stderr)
    return getattr(e, "exit_status", 1)


__all__ = ["SweepError", "damaged_status", "describe_cell", "execute", "print_plan", "run_sweep"]
