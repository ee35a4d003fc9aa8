"""Sweeps and launching: grid expansion and validation, backends, launchers, cluster profiles.

``python -m experiments.launch`` (docs/launch.md) is a thin Hydra entry point over this package:

- :mod:`fp8rl.launch.schema`: the typed config schema (``RunConfig`` + backend blocks +
  launch fields) registered in Hydra's ConfigStore;
- :mod:`fp8rl.launch.backends`: ``BACKENDS`` (``mini``);
- :mod:`fp8rl.launch.grid`: ``plan_sweep`` (expand + validate every cell, ``SweepError``), with
  :mod:`fp8rl.launch.compose` (grid expansion, composition) and :mod:`fp8rl.launch.validate`
  (launch fields, profiles, paths, the error report);
- :mod:`fp8rl.launch.sweep`: dry run, skip DONE / resume, manifest, launch;
- :mod:`fp8rl.launch.launchers`: ``LAUNCHERS`` (``local``, ``local_parallel``, ``slurm``);
- :mod:`fp8rl.launch.job`: what runs inside a job (``run_cell``, ``CellJob``);
- :mod:`fp8rl.launch.profiles`: cluster profiles (``slurm/profiles/*.yaml``);
- :mod:`fp8rl.launch.progress`: the sweep-level progress display;
- :mod:`fp8rl.launch.status`: the status table of a sweep (``experiments/status.py``);

Importing this package does not import torch or submitit.
"""

from fp8rl.launch.backends import BACKENDS, Backend
from fp8rl.launch.profiles import ClusterProfile, ProfileError, Resources, load_profile

__all__ = ["BACKENDS", "Backend", "ClusterProfile", "ProfileError", "Resources", "load_profile"]
