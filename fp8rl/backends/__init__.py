"""The backends: what trains one cell and writes its run directory.

Two implement the same contract (``fp8rl.launch.backends``: a config class, ``run``,
``resolve_run_dir``, optional ``prepare``/``describe``/``check_cell``) and write the same run
directory (docs/design.md):

- ``mini`` (``fp8rl.backends.mini``): the embedded default, tiny Qwen3-architecture models on a
  synthetic arithmetic task with our own RL loop, on one CPU machine;
- ``openrlhf`` (``fp8rl.backends.openrlhf``): the paper's scale, Qwen3-8B/14B-Base and
  Qwen2.5-32B through OpenRLHF 0.11.2 and vLLM on a Slurm GPU cluster, FP8 and Calibrated
  Clipping added by a worker plugin.

A new backend is one subpackage registered in ``fp8rl.launch.backends.BACKENDS`` and one
``sweeps/backend/<name>.yaml``.
"""
