"""The paper-scale backend: OpenRLHF 0.11.2 + vLLM on a Slurm GPU cluster, one array task per cell.

``config`` (``OpenRLHFRunConfig``: the shared run config plus the ``openrlhf:`` block: model
paths per slot, GPUs, vLLM tensor parallelism), ``data`` (the training and evaluation sets,
staged into ``<output_dir>/.cache/openrlhf_data``), ``command`` (the exact OpenRLHF command of a
cell), ``run`` (the backend's ``run``: writes the command and the plugin's spec, starts the
``driver`` under Ray, ingests its log into ``metrics.jsonl`` / ``eval.jsonl``: ``ingest``),
``evaluate`` (the final evaluation, in the arm's precision and optionally BF16), ``grading`` and
``reward_func`` (math answers graded with a deadline), ``smoke`` (the paper-smoke cells).

``plugin/`` is loaded in OpenRLHF's own processes and is the only code that touches OpenRLHF or
vLLM: FP8 rollout (``fp8_rollout``), FP8 training (``fp8_training``), the weight sync
(``vllm_sync``), Calibrated Clipping in the actor's loss (``loss``, ``calibration``), each
wrapped upstream signature checked when it binds (``binding/``). docs/cluster.md says how to run
it, on one's own cluster included.
"""
