"""``python -m experiments.paper_smoke``: the paper's job, whole, on this machine (``make paper-smoke``).

1. launches ``+sweep=paper_smoke scale=paper`` -- on the local Slurm cluster
   (``cluster=local``, one array task per cell) when one answers (``sinfo``), otherwise with the
   local launcher (``launcher=local``: the same cells in this machine's processes, no Slurm) --
   and meanwhile trains the cells' tiny model (``backends.openrlhf.smoke``, under the lock the
   cells take), which the first cell would otherwise train while the others wait;
2. launches the cell it will interrupt once more, alone and never interrupted, as the sweep
   ``paper_smoke_reference`` (``+smoke_cell=grpo_rowwise_calibrated``): the reference its resumed
   twin's metrics must equal (rollouts are seeded, ``plugin.binding.rollout``);
3. interrupts one cell (``--interrupt``, default the GRPO rowwise calibrated cell) once it
   has written a checkpoint: on Slurm ``scontrol requeue`` of its array task (what a preemption
   does: the task is killed and queued again, the job resumes from the checkpoint), the array's
   other pending tasks held meanwhile so that the requeued task gets its slot back at once;
   without Slurm, SIGKILL of the process that owns the run, then a second launch of the sweep,
   which resumes it;
4. waits for every cell to end (``--deadline-s``) and checks each is DONE with its steps;
5. writes the report (``python -m analysis.report runs/paper_smoke``).

Every driver process runs under coverage (``FP8RL_DRIVER_COVERAGE``, ``backends.openrlhf.run``),
its data in ``OUT/paper_smoke_coverage/``: the integration tests check that ``driver.main`` ran
whole.

Prints each phase with its wall time and exits non-zero when a cell did not end DONE, so CI
fails loudly. Run it with the integration venv's interpreter (OpenRLHF, DeepSpeed, Ray and
vLLM's CPU build are there): ``make paper-smoke`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from fp8rl.backends.openrlhf.run import DRIVER_COVERAGE_ENV

SWEEP = ["+sweep=paper_smoke", "scale=paper"]
INTERRUPT = "grpo-8b-rowwise-calibrated"
#: The smoke cell of :data:`INTERRUPT`.
INTERRUPT_CELL = "grpo_rowwise_calibrated"
#: The sweep's cells (``sweeps/smoke_cell/``).
CELLS = ("grpo_bf16_vanilla", "grpo_rowwise_calibrated", "dapo_tensorwise_score_centering_tis",
         "dapo_rollout_only_vanilla")
#: The uninterrupted twin of the interrupted cell: its own sweep directory, one cell.
REFERENCE = [f"+smoke_cell={INTERRUPT_CELL}", "sweep_name=paper_smoke_reference"]
#: ``python -c`` program (argument: the sweep directory): the smoke model where the cells look for it,
#: under the lock they take (``backends.openrlhf.smoke.prepare_model``).
PREPARE_MODEL = """
import sys
from fp8rl.backends.openrlhf.run import data_dir_of
from fp8rl.backends.openrlhf.smoke import MODEL_ID, prepare_model
prepare_model(MODEL_ID, data_dir_of({"openrlhf": {}, "output_dir": sys.argv[1]}))
"""


def slurm_up() -> bool:
    """A Slurm controller answers here (``sinfo``; the local cluster exports ``SLURM_CONF``)."""
    if shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def launch_args(slurm: bool, out: str, extra: tuple[str, ...] = ()) -> list[str]:
    where = ["cluster=local", "wait=false"] if slurm else ["launcher=local"]
    return [sys.executable, "-m", "experiments.launch", *SWEEP, *where, f"output_dir={out}", "progress=false",
            *extra]


def run_dirs(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in sweep_dir.iterdir() if p.is_dir() and (p / "config.yaml").exists()) \
        if sweep_dir.exists() else []


def state(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a checkpoint whose step's metrics line reached the driver log.

    Both are needed before the interruption: the resume starts after the checkpoint's step and
    never logs that step again, and the trainer's ``Global step N:`` line reaches the driver's
    log through Ray's log forwarding, which can lag the checkpoint on a busy machine (a kill in
    between lost step 1's metrics)."""
    actor = run_dir / "checkpoint" / "deepspeed" / "_actor"
    if not actor.exists():
        return False
    steps = [int(p.name[len("global_step"):]) for p in actor.iterdir()
             if p.name.startswith("global_step") and p.name[len("global_step"):].isdigit()]
    if not steps:
        return False
    line = f"Global step {min(steps)}:"
    return any(line in log.read_text(errors="replace") for log in (run_dir / "openrlhf").glob("driver.*.log"))


def owner(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "owner.json").read_text())
    except (OSError, ValueError):
        return {}


def interrupt(run_dir: Path, slurm: bool, log) -> tuple[str, list[str]]:
    """Interrupt the cell's job the way a preemption does: ``(what was done, tasks held)``.

    On Slurm the array's pending tasks are held first (``scontrol hold``), so that the slot the
    requeued task frees goes back to it rather than to the next cell (a requeued task is not
    eligible for a moment; without the hold it waited for a whole other cell to end); ``main``
    releases them once the task runs again."""
    o = owner(run_dir)
    if slurm:
        job = str(o.get("slurm_array") or o.get("slurm_job_id"))
        held = [t for t in pending_tasks(job.split("_")[0]) if t != job and _scontrol("hold", t)] \
            if "_" in job else []
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
        return f"scontrol requeue {job}" + (f" ({', '.join(held)} held until it runs again)" if held else ""), held
    pid = int(o["pid"])
    os.killpg(os.getpgid(pid), signal.SIGKILL) if os.getpgid(pid) != os.getpgid(0) else os.kill(pid, signal.SIGKILL)
    return f"SIGKILL pid {pid}", []


def pending_tasks(array_job: str) -> list[str]:
    """The pending tasks of a Slurm array job, one id each (``squeue -r``: ``8_2``, ``8_3``)."""
    out = subprocess.run(["squeue", "-h", "-r", "-j", array_job, "-t", "PENDING", "-o", "%i"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.split() if out.returncode == 0 else []


def _scontrol(*args: str) -> bool:
    """``scontrol ARGS``; False where it refuses (e.g. ``release`` of a task that has ended)."""
    return subprocess.run(["scontrol", *args], capture_output=True, timeout=60).returncode == 0


def taken_over(run_dir: Path, since: str | None) -> bool:
    """Another attempt owns the run than the one that owned it ``since`` (``owner.json``), or it ended."""
    return owner(run_dir).get("since") != since or state(run_dir).get("state") in ("DONE", "FAILED")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.paper_smoke", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The paper's job, whole, on this machine: the paper_smoke sweep on the local Slurm cluster\n"
                    "(or the local launcher), one cell interrupted and resumed, every cell checked DONE, the report.",
        epilog="examples (in the integration venv; make paper-smoke does it):\n"
               "  python -m experiments.paper_smoke\n"
               "  python -m experiments.paper_smoke --no-slurm --cell grpo_bf16_vanilla --interrupt ''")
    p.add_argument("--out", default="runs", help="runs root (the sweep goes to OUT/paper_smoke)")
    p.add_argument("--interrupt", default=INTERRUPT, help="run-name prefix of the cell to interrupt ('' = none)")
    p.add_argument("--deadline-s", type=float, default=1500.0, help="give up after this many seconds")
    p.add_argument("--no-slurm", action="store_true", help="use the local launcher even if Slurm answers")
    p.add_argument("--no-report", action="store_true")
    p.add_argument("--cell", action="append", default=[], choices=CELLS, metavar="CELL",
                   help=f"run only this smoke cell (repeatable; default all four: {', '.join(CELLS)}); "
                        "the planted-bug checks of docs/cluster.md run one")
    args = p.parse_args(argv)
    if args.cell and INTERRUPT_CELL not in args.cell:
        args.interrupt = ""  # the interrupted cell (and its reference) are not among those run
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[paper_smoke {time.monotonic() - t0:6.0f} s] {msg}", flush=True)

    slurm = not args.no_slurm and slurm_up()
    sweep_dir = Path(args.out) / "paper_smoke"
    reference_dir = Path(args.out) / "paper_smoke_reference"
    os.environ[DRIVER_COVERAGE_ENV] = str((Path(args.out) / "paper_smoke_coverage").resolve())
    log(f"launching {' '.join(SWEEP)} on {'the local Slurm cluster (cluster=local)' if slurm else 'this machine (launcher=local, no Slurm)'}")
    # the cells' tiny model, trained while the launchers compose the sweep (the cells would wait for
    # the first of them to train it, under its lock, with a core idle)
    model = subprocess.Popen([sys.executable, "-c", PREPARE_MODEL, str(sweep_dir)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    only = (f"+smoke_cell={','.join(args.cell)}",) if args.cell else ()
    expected = len(args.cell) or len(CELLS)
    first = subprocess.Popen(launch_args(slurm, args.out, only), start_new_session=not slurm)
    reference = None
    if args.interrupt:
        log(f"launching its uninterrupted reference: {' '.join(REFERENCE)}")
        reference = subprocess.Popen(launch_args(slurm, args.out, (*REFERENCE, "workers=1")),
                                     start_new_session=not slurm)
    out, _ = model.communicate()
    log("smoke model ready" if model.returncode == 0 else
        f"preparing the smoke model failed (the cells try again themselves):\n{out[-3000:]}")
    done_interrupt = not args.interrupt
    relaunch: subprocess.Popen | None = None
    held: list[str] = []  # the array's pending tasks, held until the requeued task runs again
    target: Path | None = None
    killed_since: str | None = None
    try:
        while True:
            time.sleep(1)
            dirs = run_dirs(sweep_dir)
            states = {d.name: state(d).get("state") for d in dirs}
            if not done_interrupt:
                target = next((d for d in dirs if d.name.startswith(args.interrupt)), None)
                if target is not None and has_checkpoint(target) and states.get(target.name) == "RUNNING":
                    killed_since = owner(target).get("since")
                    what, held = interrupt(target, slurm, log)
                    log(f"interrupting {target.name} after its first checkpoint: {what}")
                    done_interrupt = True
                    if not slurm:  # the killed cell is relaunched by a second launch once the first ends
                        first.wait()
                        log("first launch ended; relaunching the sweep (DONE cells are skipped, the "
                            "interrupted one resumes)")
                        relaunch = subprocess.Popen(launch_args(slurm, args.out, only))
            if held and target is not None and taken_over(target, killed_since):
                log(f"{target.name} runs again; releasing {', '.join(t for t in held if _scontrol('release', t))}")
                held = []
            launcher_done = (relaunch or first).poll() is not None
            ref_states = [state(d).get("state") for d in run_dirs(reference_dir)] if reference else ["DONE"]
            terminal = (dirs and all(s in ("DONE", "FAILED") for s in states.values()) and len(dirs) == expected
                        and ref_states and all(s in ("DONE", "FAILED") for s in ref_states)
                        and (slurm or reference is None or reference.poll() is not None))
            if done_interrupt and terminal and (slurm or launcher_done):
                break
            if not slurm and launcher_done and done_interrupt and not terminal:
                break
            if time.monotonic() - t0 > args.deadline_s:
                log(f"deadline of {args.deadline_s:.0f} s passed; states: {states}")
                return 1
    finally:  # never leave the sweep's tasks held (an error, a deadline, Ctrl-C)
        for t in held:
            _scontrol("release", t)
    for proc in (first, relaunch, reference):
        if proc is not None and proc.poll() is None:
            proc.wait(timeout=120)
    bad = []
    for d in run_dirs(sweep_dir) + (run_dirs(reference_dir) if reference else []):
        st = state(d)
        attempts = len(list((d / "openrlhf").glob("driver.*.log")))
        log(f"{d.name}: {st.get('state')} at step {st.get('step')} ({attempts} attempt(s))"
            + (f": {st.get('reason')}" if st.get("reason") else ""))
        if st.get("state") != "DONE":
            bad.append(d.name)
    if not args.no_report:
        rc = subprocess.run([sys.executable, "-m", "analysis.report", str(sweep_dir), "--no-progress"]).returncode
        log(f"report {'written to ' + str(sweep_dir / 'report') if rc == 0 else f'failed ({rc})'}")
        bad += [] if rc == 0 else ["report"]
    log(f"{'FAILED: ' + ', '.join(bad) if bad else 'every cell DONE'}; wall time {time.monotonic() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
