"""Run one mini-backend configuration into its run directory (identity, skip-if-DONE, resume).

``run_mini(cfg)``:

1. resolves the run directory: ``cfg.run_dir`` if set, else
   ``<output_dir>/<algo>-<model>-<fp8>-<clip>-s<seed>-<hash8>`` with the hash of the resolved
   config minus ``fp8rl.runs.identity.DEFAULT_EXCLUDE`` and ``fp8rl.config.IDENTITY_EXCLUDE``;
2. takes the run directory (``fp8rl.runs.lock.own``: one live owner at a time; raises
   ``RunOwned`` naming the owner when another process runs it), then returns the stored
   summary if that run is DONE (a sweep asking again skips it);
3. otherwise writes ``config.yaml``/``overrides.txt`` (a resume checks the config is the same
   but for ``IDENTITY_EXCLUDE``: a moved sweep directory or another ``checkpoint_every`` resumes,
   and provenance's ``extra.changed_on_resume`` records what changed), provenance, and runs the
   trainer, which resumes from ``checkpoint/`` when there is one and otherwise starts from step 0,
   dropping what an attempt killed before its first checkpoint logged (``fp8rl.runs.relaunch``).

The SFT cache is ``mini.cache_dir`` or ``<output_dir>/.cache/sft``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from fp8rl.backends.mini.config import MiniRunConfig
from fp8rl.backends.mini.numerics import fingerprint as numerics_fingerprint
from fp8rl.backends.mini.runtime import torch_settings
from fp8rl.backends.mini.trainer import MiniTrainer, config_dict
from fp8rl.config import IDENTITY_EXCLUDE, IDENTITY_LATE_DEFAULTS


def resolve_run_dir(cfg: MiniRunConfig) -> Path:
    """The run directory of ``cfg`` (``cfg.run_dir`` or derived from its identity:
    ``RunConfig.resolve_run_dir``)."""
    return cfg.resolve_run_dir()


def sft_cache_dir(cfg: MiniRunConfig) -> Path:
    return Path(cfg.mini.cache_dir) if cfg.mini.cache_dir else Path(cfg.output_dir) / ".cache" / "sft"


def warm_start_key(cfg: MiniRunConfig) -> str:
    """The SFT warm start a run needs (cache path): runs with equal keys share one."""
    from fp8rl.backends.mini.sft import sft_key
    from fp8rl.backends.mini.tokenizer import CharTokenizer

    return str(sft_cache_dir(cfg) / sft_key(cfg.model.slot, cfg.mini, CharTokenizer()))


def warm_start_progress(cfg: MiniRunConfig) -> Path:
    """Launcher hook (``Backend.prepare_progress``): the file where the run's SFT warm start
    reports its progress while it trains (``sft_partial.progress_path``)."""
    from fp8rl.backends.mini.sft_partial import progress_path

    return progress_path(warm_start_key(cfg))


def prepare_warm_start(cfg: MiniRunConfig) -> None:
    """Train (or find) the run's SFT warm start in the shared cache, as the run itself would."""
    from fp8rl.backends.mini.sft import warm_start
    from fp8rl.backends.mini.task import make_splits
    from fp8rl.backends.mini.tokenizer import CharTokenizer

    m = cfg.mini
    train, _ = make_splits(m.data_seed, m.n_train, m.n_eval, min_terms=m.min_terms,
                           max_terms=m.max_terms, max_operand=m.max_operand)
    with torch_settings(m.deterministic, m.num_threads, m.device):
        warm_start(cfg.model.slot, train, CharTokenizer(), m, sft_cache_dir(cfg))


#: Memory a mini cell asks a scheduler for, in GB (a tiny model, its rollouts and torch: ~1 GB used).
MINI_MEM_GB = 4


def cell_resources(cfg: MiniRunConfig, requested):
    """Launcher hook (``Backend.resources``): what a mini cell asks Slurm for. Not the profile's
    GPU node: one node, a GPU only when ``mini.device`` is CUDA, CPUs = its torch threads
    (``mini.num_threads``; 0, torch's default, asks for one), :data:`MINI_MEM_GB` of memory; the
    profile's time limit is kept. A CUDA cell asks for one GPU only where the profile's nodes have
    GPUs (on a CPU-only cluster it asks none and fails at run time, as on a workstation). A
    ``scheduler: local`` request is returned unchanged."""
    import dataclasses

    if getattr(requested, "local", False):
        return requested
    gpus = min(1, requested.gpus_per_node) if cfg.mini.device.startswith("cuda") else 0
    return dataclasses.replace(requested, nodes=1, gpus_per_node=gpus,
                               cpus_per_task=max(1, cfg.mini.num_threads), mem_gb=MINI_MEM_GB)


def run_mini(cfg: MiniRunConfig, overrides: Iterable[str] = (), *, progress: bool = False) -> dict:
    """Run (or resume, or skip) ``cfg``; returns its summary (with ``run_dir``)."""
    from fp8rl.runs import RunDir
    from fp8rl.runs.lock import own

    rd = RunDir(resolve_run_dir(cfg))
    with own(rd.path):  # raises RunOwned while another live process runs it
        if rd.is_done():
            return {**(rd.summary() or {}), "run_dir": str(rd.path), "skipped": True}
        rd.init(config_dict(cfg), overrides, may_differ=IDENTITY_EXCLUDE, late_defaults=IDENTITY_LATE_DEFAULTS)
        device = torch.device(cfg.mini.device)
        desc = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}"
        extra = {"backend": "mini"}
        if device.type == "cpu":  # what decides the run's bits (numerics.py): analysis groups runs by it
            extra["numerics"] = dict(numerics_fingerprint())
        if rd.resume_changes:  # keys outside the identity that this resume changed
            extra["changed_on_resume"] = rd.resume_changes
        rd.write_provenance(extra, device=desc)
        with torch_settings(cfg.mini.deterministic, cfg.mini.num_threads, cfg.mini.device):
            trainer = MiniTrainer(cfg, rd, sft_cache=sft_cache_dir(cfg), sft_progress=progress)
            summary = trainer.run(progress=progress)
        return {**summary, "run_dir": str(rd.path)}
