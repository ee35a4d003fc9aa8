"""``make paper-smoke`` at two revisions, in alternating rounds: wall time, CPU time, where it goes.

    .venv-integration/bin/python benchmarks/bench_paper_smoke.py --base REV [--new REV] [--rounds R]
        [--out DIR] [-- paper_smoke options]

Each revision is exported into ``OUT/<label>/`` (``git archive``; ``--new`` omitted: this working
tree, uncommitted changes included) and its ``python -m experiments.paper_smoke`` runs there
(``PYTHONPATH`` on the export, a fresh ``runs/`` each round, the Slurm cluster of the environment
when one answers), new and base alternating ``--rounds`` times so that a load change on a shared
machine hits both alike. Meanwhile every process of the job is sampled every ``--every`` seconds:
the ones whose environment carries this round's marker (``FP8RL_BENCH_MARK``, which Slurm, Ray and
the job's subprocesses inherit), their CPU time (user + system, ``/proc/PID/stat``), their
proportional memory (PSS) and their titles (Ray renames its workers ``ray::Actor``).

Printed per round: wall time, the job's CPU seconds, its peak PSS, the 1-minute load average
(median over the round; the machine's other work included). Then per revision the medians and
the spread (min-max) over rounds, the ratio new / base of wall time and CPU time, and the CPU
seconds by kind of process (driver, engine core, actors, final evaluation, Ray services, ...),
medians over rounds. A process's CPU after its last sample is not counted (at most ``--every``
seconds each). Written to ``OUT/bench.json`` too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARK_ENV = "FP8RL_BENCH_MARK"
#: Process kinds, first match on any of a process's titles (Ray actors first: ``ray::Name``).
KINDS = (
    (r"VLLM::Worker", "vLLM worker process (the model)"),
    (r"VLLM::EngineCore", "vLLM engine core"),
    (r"experiments\.evaluate", "final evaluation (experiments.evaluate)"),
    (r"fp8rl\.backends\.openrlhf\.driver", "driver (under coverage)"),
    (r"submitit", "Slurm task (run_openrlhf)"),
    (r"bin/ray start", "ray start (CLI)"),
    (r"gcs_server|raylet/raylet|dashboard|DashboardAgent|RuntimeEnvAgent|log_monitor|monitor\.py",
     "Ray services"),
    (r"multiprocessing\.spawn|resource_tracker", "process pools (grading)"),
    (r"analysis\.report", "report"),
    (r"experiments\.launch", "launcher (sweep composition, submission)"),
    (r"backends\.openrlhf\.smoke|prepare_model", "smoke model"),
)


def kind(titles: list[str]) -> str:
    actors = [m.group(1) for t in titles for m in [re.search(r"ray::(\w+)", t)] if m]
    named = [a for a in actors if a != "IDLE"]
    if named:
        return "ray::" + named[0]
    for pattern, name in KINDS:
        if any(re.search(pattern, t) for t in titles):
            return name
    if actors or any("default_worker.py" in t for t in titles):
        return "Ray idle worker"
    return "other"


class Sampler(threading.Thread):
    """Samples the processes whose environment holds ``mark`` until stopped."""

    def __init__(self, mark: str, every: float) -> None:
        super().__init__(daemon=True)
        self.mark, self.every = mark.encode(), every
        self.procs: dict[tuple[int, int], dict] = {}
        self.pss: list[int] = []
        self.loads: list[float] = []
        self.seen: dict[tuple[int, int], bool] = {}
        self.stop = threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        while not self.stop.is_set():
            total = 0
            for name in os.listdir("/proc"):
                if name.isdigit():
                    total += self._sample(int(name))
            self.pss.append(total)
            self.loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
            self.stop.wait(self.every)

    def _sample(self, pid: int) -> int:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rfind(")") + 2:].split()
            key = (pid, int(fields[19]))
            if key not in self.seen:
                self.seen[key] = self.mark in Path(f"/proc/{pid}/environ").read_bytes()
            if not self.seen[key]:
                return 0
            rec = self.procs.setdefault(key, {"titles": []})
            rec["cpu"] = (int(fields[11]) + int(fields[12])) / self.tick
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
            if title and (not rec["titles"] or rec["titles"][-1] != title):
                rec["titles"].append(title)
            pss = next((int(ln.split()[1]) // 1024 for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
                        if ln.startswith("Pss:")), 0)
            return pss
        except (OSError, ValueError, IndexError):
            return 0


def export(rev: str | None, dest: Path) -> Path:
    """The tree of ``rev`` (None: this working tree, uncommitted changes included) in ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    if rev is None:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
        tar = subprocess.run(["tar", "-c", "--null", "-T", "-"], cwd=REPO, input=files, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=tar.stdout, check=True)
    else:
        archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def one_round(label: str, tree: Path, rnd: int, args) -> dict:
    import shutil

    shutil.rmtree(tree / "runs", ignore_errors=True)
    mark = f"{label}-{rnd}-{os.getpid()}"
    env = {**os.environ, "PYTHONPATH": str(tree), MARK_ENV: mark}
    sampler = Sampler(mark, args.every)
    sampler.start()
    t0 = time.monotonic()
    with open(tree / f"paper_smoke.{rnd}.log", "w") as log:
        rc = subprocess.run([sys.executable, "-m", "experiments.paper_smoke", *args.smoke], cwd=tree, env=env,
                            stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - t0
    sampler.stop.set()
    sampler.join()
    by_kind: dict[str, float] = defaultdict(float)
    for rec in sampler.procs.values():
        by_kind[kind(rec["titles"])] += rec.get("cpu", 0.0)
    row = {"label": label, "round": rnd, "rc": rc, "wall_s": wall, "cpu_s": sum(by_kind.values()),
           "peak_pss_mb": max(sampler.pss, default=0), "load1_median": statistics.median(sampler.loads or [0.0]),
           "by_kind": dict(by_kind)}
    print(f"round {rnd} {label:4s}: rc {rc}, wall {wall:6.0f} s, CPU {row['cpu_s']:6.0f} s, peak PSS "
          f"{row['peak_pss_mb'] / 1024:4.1f} GiB, load1 median {row['load1_median']:.1f}", flush=True)
    return row


def summary(rows: list[dict]) -> None:
    def stat(label: str, key: str) -> tuple[float, float, float]:
        xs = [r[key] for r in rows if r["label"] == label]
        return statistics.median(xs), min(xs), max(xs)

    for key, name in (("wall_s", "wall time (s)"), ("cpu_s", "CPU time (s)")):
        (nm, nlo, nhi), (bm, blo, bhi) = stat("new", key), stat("base", key)
        print(f"{name:14s} new {nm:6.0f} [{nlo:.0f}, {nhi:.0f}]   base {bm:6.0f} [{blo:.0f}, {bhi:.0f}]   "
              f"new / base {nm / bm:.2f} [{nlo / bhi:.2f}, {nhi / blo:.2f}]")
    kinds = sorted({k for r in rows for k in r["by_kind"]},
                   key=lambda k: -statistics.median(r["by_kind"].get(k, 0.0) for r in rows))
    print(f"\nCPU seconds by kind of process (median over rounds)\n{'kind':44s} {'new':>6s} {'base':>6s}")
    for k in kinds:
        med = {lab: statistics.median(r["by_kind"].get(k, 0.0) for r in rows if r["label"] == lab)
               for lab in ("new", "base")}
        if max(med.values()) >= 1:
            print(f"{k[:44]:44s} {med['new']:6.0f} {med['base']:6.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/bench_paper_smoke.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the baseline revision (e.g. a commit of main)")
    p.add_argument("--new", default=None, help="the revision to compare (default: this working tree)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--every", type=float, default=1.5, help="sampling period (s)")
    p.add_argument("--out", default="build/bench_paper_smoke", help="where the trees and results go")
    p.add_argument("smoke", nargs="*", help="options for experiments.paper_smoke (after --)")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    trees = {"new": export(args.new, out / "new"), "base": export(args.base, out / "base")}
    print(f"new = {args.new or 'this working tree'}, base = {args.base}; {args.rounds} round(s); "
          f"{os.cpu_count()} CPU(s); load at start {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)
    rows = []
    for rnd in range(args.rounds):
        order = ("new", "base") if rnd % 2 == 0 else ("base", "new")
        rows += [one_round(label, trees[label], rnd, args) for label in order]
    (out / "bench.json").write_text(json.dumps(rows, indent=1))
    summary(rows)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
