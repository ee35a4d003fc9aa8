"""Run one paper-scale cell inside its Slurm allocation (the backend's ``run`` for the launcher).

``run_openrlhf(cfg)`` is called by ``fp8rl.launch.job.run_cell`` on every node of the cell's
allocation (submitit runs one task per node):

- tasks on nodes other than the first return at once (their node joins Ray through the
  bootstrap's ``srun --overlap ... ray start``);
- the first node: resolve the run directory (skip if DONE), write ``config.yaml`` and
  provenance, prepare the data (``<data_dir>/<name>.jsonl``) and check that the train set has
  the prompts the episode plan assumed (``config.data_plan``), build the OpenRLHF command for
  the allocation's GPUs (``command.build_args``; the command is kept in ``openrlhf/command.sh``),
  start Ray across the allocation and run the driver (``fp8rl.backends.openrlhf.ray_cluster.bootstrap``),
  ingest the driver log into ``metrics.jsonl``/``eval.jsonl``, run the final evaluation
  (``experiments.evaluate``) and write ``summary.json`` and ``status.json``.

A run is FAILED (with the reason in ``status.json``) when OpenRLHF exits non-zero -- the reason
then quotes the plugin's error from the log when there is one (``Fp8ConversionError``,
``PluginNotActiveError``, ``ResumeError``, ``UpstreamChangedError``, ...) -- or when it ends
before the cell's ``steps`` (dynamic filtering kept fewer groups than the episode plan assumed).

A requeued job resumes: OpenRLHF reloads its DeepSpeed checkpoint (``--ckpt.load_enable``) and
the plugin its controller state; each attempt logs to ``openrlhf/driver.<attempt>.log``, and
ingestion keeps the last occurrence of every step.

With ``FP8RL_DRIVER_COVERAGE=DIR`` in the environment (``make paper-smoke`` sets it) the driver
process runs under ``coverage run --parallel-mode --source=fp8rl``, its data files in ``DIR``: the
CPU smoke job measures what of ``driver.main`` ran (``tests/integration/test_int_paper_smoke.py``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from fp8rl.backends.openrlhf.config import OpenRLHFRunConfig, data_plan

#: Environment variable: a directory for coverage data of the driver process (see the module docstring).
DRIVER_COVERAGE_ENV = "FP8RL_DRIVER_COVERAGE"

#: Keys left out of the run identity (paths and caches do not change what a run computes).
IDENTITY_EXCLUDE = OpenRLHFRunConfig.BACKEND_IDENTITY_EXCLUDE
#: Logical CPUs of a CPU job's Ray node (more than cores: Ray books one CPU per OpenRLHF actor; Ray
#: starts about as many idle workers, so not many more).
CPU_JOB_LOGICAL_CPUS = 6


def config_dict(cfg: OpenRLHFRunConfig) -> dict:
    return dataclasses.asdict(cfg)


def resolve_run_dir(cfg: OpenRLHFRunConfig) -> Path:
    """The run directory of ``cfg`` (``RunConfig.resolve_run_dir``, with :data:`IDENTITY_EXCLUDE`)."""
    return cfg.resolve_run_dir()


def _runs_root(cfg_output_dir: str) -> Path:
    return Path(cfg_output_dir).parent  # output_dir is <root>/<sweep>


def data_dir_of(cfg: dict | OpenRLHFRunConfig) -> Path:
    """The JSONL directory: ``openrlhf.data_dir`` or ``<runs root>/.cache/openrlhf_data``."""
    if isinstance(cfg, dict):
        o, out = cfg["openrlhf"], cfg["output_dir"]
        d = o.get("data_dir")
    else:
        out, d = cfg.output_dir, cfg.openrlhf.data_dir
    return Path(d) if d else _runs_root(out) / ".cache" / "openrlhf_data"


def paths_for(cfg: OpenRLHFRunConfig, run_dir: Path):
    from fp8rl.backends.openrlhf.command import RunPaths
    from fp8rl.backends.openrlhf.data import output_file
    from fp8rl.backends.openrlhf.smoke import model_path

    ddir = data_dir_of(cfg)
    o = cfg.openrlhf
    return RunPaths(run_dir=run_dir, train_file=output_file(ddir, o.train_sets[cfg.algorithm.name]),
                    model=model_path(o.models[cfg.model.slot], ddir),
                    eval_files=tuple(output_file(ddir, n) for n in o.eval_sets),
                    reward_file=Path(__file__).resolve().with_name("reward_func.py"))


def allocation() -> tuple[int, int]:
    """``(nodes, gpus_per_node)`` of this cell: one node with the local profile's GPUs when the
    local launcher runs it on one machine (``cluster=workstation``: it sets
    ``fp8rl.procenv.LOCAL_GPUS_ENV``), else the Slurm allocation's, else this machine's
    CUDA devices (``torch.cuda.device_count()``)."""
    from fp8rl.procenv import LOCAL_GPUS_ENV

    local = os.environ.get(LOCAL_GPUS_ENV)
    if local:
        return 1, int(local)
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    g = os.environ.get("SLURM_GPUS_ON_NODE") or os.environ.get("SLURM_GPUS_PER_NODE")
    if g:
        return nodes, int(re.sub(r"^.*:", "", g))
    import torch

    return nodes, torch.cuda.device_count()


def _node_rank() -> int:
    return int(os.environ.get("SLURM_NODEID", "0"))


def run_openrlhf(cfg: OpenRLHFRunConfig, overrides: Iterable[str] = (), *, progress: bool = False) -> dict:
    """Run (or resume, or skip) one cell; returns its summary (see the module docstring)."""
    from fp8rl.backends.openrlhf.command import build_args, command_line, layout_for
    from fp8rl.backends.openrlhf.data import prepare
    from fp8rl.backends.openrlhf.ingest import ingest, log_files
    from fp8rl.backends.openrlhf.plugin.spec import PluginSpec, check_version
    from fp8rl.backends.openrlhf.ray_cluster import bootstrap
    from fp8rl.runs import DONE, FAILED, RUNNING, RunDir

    rd = RunDir(resolve_run_dir(cfg))
    if rd.is_done():
        return {**(rd.summary() or {}), "run_dir": str(rd.path), "skipped": True}
    if _node_rank() != 0:
        return {"run_dir": str(rd.path), "worker_node": _node_rank()}
    check_version()
    from fp8rl.config import IDENTITY_EXCLUDE as SHARED

    rd.init(config_dict(cfg), overrides, may_differ=(*SHARED, *IDENTITY_EXCLUDE))
    extra = {"backend": "openrlhf"}
    if rd.resume_changes:  # keys outside the identity that this resume changed
        extra["changed_on_resume"] = rd.resume_changes
    rd.write_provenance(extra, device="slurm allocation")
    rd.set_status(RUNNING, 0)
    o = cfg.openrlhf
    paths = paths_for(cfg, rd.path)
    prepare([o.train_sets[cfg.algorithm.name], *o.eval_sets], data_dir_of(cfg), o.datasets)
    from fp8rl.backends.openrlhf.smoke import prepare_model

    prepare_model(o.models[cfg.model.slot], data_dir_of(cfg))
    problem = check_train_set(cfg, paths.train_file)
    if problem:
        rd.set_status(FAILED, 0, reason=problem)
        rd.write_summary({"state": FAILED, "reason": problem, "steps": 0})
        return {"state": FAILED, "reason": problem, "run_dir": str(rd.path)}
    nodes, gpn = allocation()
    lay = layout_for(cfg, nodes, gpn)
    args = build_args(cfg, lay, paths)
    work = rd.path / "openrlhf"
    work.mkdir(exist_ok=True)
    spec_file = work / "plugin_spec.json"
    spec = PluginSpec.from_config(cfg, run_dir=rd.path)
    spec_file.write_text(spec.to_json())
    if spec.dump_dir:
        Path(spec.dump_dir).mkdir(parents=True, exist_ok=True)
    attempt = len(log_files(rd.path)) + 1
    log = work / f"driver.{attempt}.log"
    (work / "command.sh").write_text(command_line(args, python=sys.executable) + "\n")
    driver = [*driver_python(), "-m", "fp8rl.backends.openrlhf.driver", "--spec", str(spec_file),
              "--log", str(log), "--", *args]
    if o.device == "cpu":  # placeholder GPUs: one per actor rank and per engine (plugin.cpu_support)
        rc = bootstrap(driver, gpus_per_node=lay.gpus + lay.vllm_engines * lay.vllm_tp,
                       deadline_s=o.ray_deadline_s, num_cpus=CPU_JOB_LOGICAL_CPUS, state_file=work / "ray.json")
    else:
        rc = bootstrap(driver, gpus_per_node=gpn, deadline_s=o.ray_deadline_s, state_file=work / "ray.json")
    stats = ingest(rd.path, eval_sizes=_eval_sizes(cfg))
    reason = None
    if rc != 0:
        cause = plugin_error(log)
        reason = f"OpenRLHF exited with status {rc}" + (f": {cause}" if cause else "") + f"; see {log}"
    elif stats["last_step"] < cfg.steps:
        reason = (f"training ended after {stats['last_step']} of {cfg.steps} steps: the prompts ran out "
                  f"(dynamic filtering kept fewer groups than the plan's 1/{data_plan(cfg).rounds}); raise "
                  "algorithm.max_extra_rounds (more episodes) and resubmit: the run resumes")
    if reason is not None:
        rd.set_status(FAILED, stats["last_step"], reason=reason)
        summary = {"state": FAILED, "reason": reason, "steps": stats["last_step"]}
        rd.write_summary(summary)
        return {**summary, "run_dir": str(rd.path)}
    summary = {"state": DONE, "reason": None, "steps": stats["last_step"]}
    rd.write_summary(summary)
    if o.final_eval:
        subprocess.run(evaluate_command(cfg, rd.path), check=True)
    rd.set_status(DONE, stats["last_step"])
    return {**(rd.summary() or summary), "run_dir": str(rd.path)}


def evaluate_command(cfg: OpenRLHFRunConfig, run_dir: Path) -> list[str]:
    """The evaluation after training (``experiments.evaluate``): the arm's own engine on the final
    checkpoint, and with ``openrlhf.eval_bf16`` a BF16 engine on the base model and the final
    checkpoint (``fp8rl.backends.openrlhf.evaluate``); the option is on the command line, so the
    job's log shows what ran."""
    return [sys.executable, "-m", "experiments.evaluate", str(run_dir),
            "--bf16" if cfg.openrlhf.eval_bf16 else "--no-bf16"]


def _evaluate_line(cfg: OpenRLHFRunConfig) -> str:
    from fp8rl.backends.openrlhf.plugin.fp8_rollout import VLLM_QUANTIZATION

    if not cfg.openrlhf.final_eval:
        return "    evaluate:  none after training (openrlhf.final_eval=false)"
    own = VLLM_QUANTIZATION.get(cfg.fp8.rollout_recipe, "bf16")
    line = f"    evaluate:  checkpoint/final with vLLM {own} (eval/)"
    if cfg.openrlhf.eval_bf16:
        line += "; base model and checkpoint/final with vLLM bf16 (eval_bf16/, openrlhf.eval_bf16)"
    return line


def driver_python() -> list[str]:
    """The interpreter command of the driver: ``python``, or ``python -m coverage run ...`` when
    :data:`DRIVER_COVERAGE_ENV` names a directory (created here)."""
    where = os.environ.get(DRIVER_COVERAGE_ENV)
    if not where:
        return [sys.executable]
    try:
        import coverage  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"{DRIVER_COVERAGE_ENV}={where} asks for the driver's coverage, but the coverage "
                           "package is not installed here: pip install coverage (the integration extra has "
                           "it), or unset the variable") from e
    Path(where).mkdir(parents=True, exist_ok=True)
    return [sys.executable, "-m", "coverage", "run", "--parallel-mode", f"--data-file={Path(where) / '.coverage'}",
            "--source=fp8rl"]


#: Errors the plugin raises in the workers (quoted into a FAILED run's reason).
PLUGIN_ERRORS = ("Fp8ConversionError", "PluginNotActiveError", "ResumeError", "UpstreamChangedError",
                 "PluginVersionError", "Fp8UnsupportedError")


def plugin_error(log: Path) -> str | None:
    """The last line of ``log`` naming one of :data:`PLUGIN_ERRORS` (None if there is none)."""
    if not log.exists():
        return None
    found = None
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        for name in PLUGIN_ERRORS:
            i = line.find(name + ":")
            if i >= 0:
                found = line[i:].strip()[:500]
    return found


def check_train_set(cfg: OpenRLHFRunConfig, train_file: Path) -> str | None:
    """A reason to fail before training if the prepared train set is smaller than planned."""
    from fp8rl.backends.openrlhf.config import data_plan

    plan = data_plan(cfg)
    n = sum(1 for ln in train_file.read_text(encoding="utf-8").splitlines() if ln.strip())
    needed = plan.max_samples if plan.episodes == 1 else plan.size  # several episodes: every planned prompt
    if n < needed:
        return (f"{train_file} has {n} prompts but openrlhf.train_set_sizes.{plan.train_set}={plan.size} planned "
                f"{plan.episodes} episode(s) over {needed} for {cfg.steps} steps; set it to {n} (the cell's "
                "command changes) and resubmit")
    return None


def _eval_sizes(cfg: OpenRLHFRunConfig) -> dict[str, int]:
    from fp8rl.backends.openrlhf.data import output_file

    out = {}
    for n in cfg.openrlhf.eval_sets:
        p = output_file(data_dir_of(cfg), n)
        if p.exists():
            out[n] = sum(1 for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip())
    return out


def describe(cfg: OpenRLHFRunConfig, resources, run_dir: Path) -> list[str]:
    """Dry-run lines of one cell: the OpenRLHF command for the profile's GPUs (launcher hook)."""
    from fp8rl.backends.openrlhf.command import build_args, command_line, layout_for, plugin_lines

    if resources is None and cfg.openrlhf.device == "cpu":  # the CPU job without Slurm (launcher=local)
        lay = layout_for(cfg, 1, 0)
        args = build_args(cfg, lay, paths_for(cfg, run_dir))
        return [f"    local:     this machine, no Slurm, CPU job (openrlhf.device=cpu): {lay.gpus} actor rank(s), "
                f"{lay.vllm_engines} vLLM engine(s); trainer {cfg.fp8.trainer_recipe}, rollout "
                f"{cfg.fp8.rollout_recipe}, clip {cfg.clip.arm}",
                f"    openrlhf:  {command_line(args)}", *plugin_lines(cfg, run_dir), _evaluate_line(cfg)]
    if resources is None:
        return ["    openrlhf:  (no cluster profile: cannot lay out GPUs)"]
    lay = layout_for(cfg, resources.nodes, resources.gpus_per_node)
    args = build_args(cfg, lay, paths_for(cfg, run_dir))
    if getattr(resources, "local", False):  # a scheduler: local profile (cluster=workstation)
        where = (f"    local:     this machine, no Slurm: {resources.gpus_per_node} GPU(s), Ray started on "
                 "this host, one cell at a time")
    else:
        where = (f"    sbatch:    --nodes={resources.nodes} --ntasks-per-node=1 --gpus-per-node={resources.gpus_per_node} "
                 f"--cpus-per-task={resources.cpus_per_task}"
                 + (f" --mem={resources.mem_gb}G" if resources.mem_gb else "") + f" --time={resources.time_min}")
    return [
        where,
        f"    layout:    {lay.gpus} GPU(s): {lay.vllm_engines} vLLM engine(s) x TP {lay.vllm_tp}, "
        f"colocate_all={lay.colocate_all}; trainer {cfg.fp8.trainer_recipe}, rollout {cfg.fp8.rollout_recipe}, "
        f"clip {cfg.clip.arm}",
        f"    openrlhf:  {command_line(args)}",
        *plugin_lines(cfg, run_dir),
        _evaluate_line(cfg),
    ]


def check_cell(cfg: OpenRLHFRunConfig, resources) -> None:
    """Launcher hook: the cell's command must pass OpenRLHF's start-up checks on ``resources``."""
    from fp8rl.backends.openrlhf.command import build_args, layout_for

    if resources is None and cfg.openrlhf.device == "cpu":  # the CPU job lays itself out
        build_args(cfg, layout_for(cfg, 1, 0), paths_for(cfg, resolve_run_dir(cfg)))
        return
    if resources is None:
        raise ValueError("a paper-scale cell needs a cluster profile (cluster=NAME; cluster=workstation on one "
                         "GPU machine without Slurm) for its GPU layout")
    build_args(cfg, layout_for(cfg, resources.nodes, resources.gpus_per_node),
               paths_for(cfg, resolve_run_dir(cfg)))
