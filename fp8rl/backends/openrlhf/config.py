"""Paper-scale settings: models, data, vLLM layout, batch shapes and paths of an OpenRLHF run.

``OpenRLHFRunConfig`` is the shared ``fp8rl.config.RunConfig`` (the four axes, seed, schedule,
optimiser, eval cadence) plus an ``openrlhf`` block (:class:`OpenRLHFSettings`). How the shared
fields map onto OpenRLHF 0.11.2 flags is the command builder's business
(``fp8rl.backends.openrlhf.command``); this module only holds and validates values.

Where the shared fields mean something slightly different at paper scale (each documented
in ``docs/cluster.md``):

- ``steps``: number of RL steps; OpenRLHF runs over the prompt set, so the data preparation
  writes ``steps x prompts_per_step`` prompts (``data.max_samples``) and one episode.
- ``algorithm.overlong_buffer > 0`` only *switches on* DAPO's soft overlong penalty; its length
  at paper scale is ``openrlhf.overlong_buffer_len`` (L_cache = 4096 at 20K responses, DAPO).
  The algorithm files hold mini-scale lengths.
- ``eval_k`` is OpenRLHF's ``eval.n_samples_per_prompt`` (avg@k = its ``pass1`` on 0/1 rewards).
- ``fp8.emulate`` must be false: paper scale runs real FP8 GEMMs (H100-class GPUs).

The vLLM layout per model slot (tensor parallel size, colocation) lives here; the number of
nodes and GPUs per node comes from the cluster profile (``slurm/profiles``), and the number of
vLLM engines is derived: ``engines = nodes x gpus_per_node / vllm_tp`` (colocated).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fp8rl.config import MODEL_SLOTS, RunConfig, _require

#: The paper's models per slot (paper, Setup).
DEFAULT_MODELS = {
    "8b": "Qwen/Qwen3-8B-Base",
    "14b": "Qwen/Qwen3-14B-Base",
    "32b": "Qwen/Qwen2.5-32B",
}


@dataclass
class OpenRLHFSettings:
    """Settings only the OpenRLHF backend has (``openrlhf.*`` in the Hydra config).

    Attributes:
        models: HF model id (or local path) per model slot.
        train_sets: training dataset name per algorithm name (keys of ``datasets``).
        eval_sets: evaluation dataset names (keys of ``datasets``).
        datasets: dataset name -> Hugging Face dataset id (``sweeps/data/paper.yaml``).
        data_dir: where ``python -m fp8rl.backends.openrlhf.data`` writes the JSONL files;
            ``None`` = ``<output_dir>/../.cache/openrlhf_data`` (shared by all sweeps of a root).
        cache_dir: pre-quantized FP8 rollout checkpoints (one per model and rollout recipe);
            ``None`` = ``<runs root>/.cache/fp8_rollout``.
        vllm_tp: vLLM tensor-parallel size per model slot.
        colocate_all: actor and vLLM engines share the GPUs (``--train.colocate_all``, sleep mode).
        gpu_memory_utilization: vLLM's share of GPU memory.
        zero_stage: DeepSpeed ZeRO stage.
        micro_train_batch_size, micro_rollout_batch_size: per-GPU micro-batches.
        max_prompt_len: prompt tokens (``data.max_len = max_prompt_len + max_response_len``).
        overlong_buffer_len: DAPO L_cache in tokens, used when ``algorithm.overlong_buffer > 0``.
        gradient_checkpointing, packing_samples: memory/speed switches of the actor.
        apply_chat_template: wrap the prompt with the tokenizer's chat template.
        save_steps: DeepSpeed checkpoint cadence (resume after preemption); -1 = off.
        lr_warmup_ratio: OpenRLHF's warm-up fraction of the cosine schedule.
        entropy_logging: ``--actor.entropy_coef 0`` (log entropy only).
        final_eval: run ``experiments.evaluate`` on the final checkpoint after training.
        ray_deadline_s: how long the Ray bootstrap waits for every node and GPU.
        extra_args: raw extra CLI arguments appended verbatim (each one validated against the
            0.11.2 parser by the tests only for what we emit; use sparingly).
    """

    models: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_MODELS))
    train_sets: dict[str, str] = field(default_factory=lambda: {
        "grpo": "deepscaler", "dr_grpo": "deepscaler", "dapo": "dapo_math_17k"})
    eval_sets: list[str] = field(default_factory=lambda: ["aime24", "aime25", "amc23", "math500"])
    datasets: dict[str, str] = field(default_factory=dict)
    data_dir: str | None = None
    cache_dir: str | None = None
    vllm_tp: dict[str, int] = field(default_factory=lambda: {"8b": 1, "14b": 2, "32b": 4})
    colocate_all: bool = True
    gpu_memory_utilization: float = 0.6
    zero_stage: int = 3
    micro_train_batch_size: int = 4
    micro_rollout_batch_size: int = 8
    max_prompt_len: int = 1024
    overlong_buffer_len: int = 4096
    gradient_checkpointing: bool = True
    packing_samples: bool = True
    apply_chat_template: bool = True
    save_steps: int = 10
    lr_warmup_ratio: float = 0.0
    entropy_logging: bool = True
    final_eval: bool = True
    ray_deadline_s: float = 600.0
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        missing = [s for s in MODEL_SLOTS if s not in self.models]
        _require(not missing, f"openrlhf.models lacks slot(s) {missing}; give an HF id per slot")
        missing = [s for s in MODEL_SLOTS if s not in self.vllm_tp]
        _require(not missing, f"openrlhf.vllm_tp lacks slot(s) {missing}")
        for s, tp in self.vllm_tp.items():
            _require(isinstance(tp, int) and tp >= 1 and (tp & (tp - 1)) == 0,
                     f"openrlhf.vllm_tp.{s} must be a power of two >= 1, got {tp}")
        if self.datasets:
            unknown = sorted({*self.train_sets.values(), *self.eval_sets} - set(self.datasets))
            _require(not unknown, f"openrlhf: dataset(s) {unknown} are not in openrlhf.datasets "
                     f"({sorted(self.datasets)}); add their HF ids in sweeps/data/paper.yaml")
        _require(0 < self.gpu_memory_utilization < 1,
                 f"openrlhf.gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization}")
        _require(self.zero_stage in (0, 1, 2, 3), f"openrlhf.zero_stage must be 0..3, got {self.zero_stage}")
        for f in ("micro_train_batch_size", "micro_rollout_batch_size", "max_prompt_len"):
            _require(getattr(self, f) >= 1, f"openrlhf.{f} must be >= 1, got {getattr(self, f)}")
        _require(self.overlong_buffer_len >= 1, "openrlhf.overlong_buffer_len must be >= 1")
        _require(self.save_steps == -1 or self.save_steps >= 1,
                 f"openrlhf.save_steps must be >= 1 or -1 (off), got {self.save_steps}")
        _require(0 <= self.lr_warmup_ratio < 1, "openrlhf.lr_warmup_ratio must be in [0, 1)")
        _require(self.ray_deadline_s > 0, "openrlhf.ray_deadline_s must be > 0")
        _require(all(isinstance(a, str) for a in self.extra_args), "openrlhf.extra_args must be strings")


@dataclass
class OpenRLHFRunConfig(RunConfig):
    """``RunConfig`` plus the ``openrlhf`` block; validates the paper-scale cross-field rules."""

    openrlhf: OpenRLHFSettings = field(default_factory=OpenRLHFSettings)

    def validate(self) -> None:
        super().validate()
        o, a = self.openrlhf, self.algorithm
        _require(not self.fp8.emulate,
                 "fp8.emulate=true is a CPU emulation for the mini backend; paper scale runs real "
                 "FP8 GEMMs: set fp8.emulate=false (scale=paper does)")
        _require(a.name in o.train_sets,
                 f"openrlhf.train_sets has no dataset for algorithm {a.name!r} "
                 f"(has {sorted(o.train_sets)})")
        _require(a.loss_agg_mode in ("token-mean", "seq-mean-token-mean"),
                 f"algorithm.loss_agg_mode={a.loss_agg_mode!r} has no OpenRLHF 0.11.2 equivalent "
                 "(--actor.loss_agg_mode takes token-mean or seq-mean-token-mean)")
        _require(a.advantage_estimator in ("grpo", "dr_grpo"),
                 f"algorithm.advantage_estimator={a.advantage_estimator!r} has no mapping to "
                 "OpenRLHF's --algo.advantage.estimator here (grpo -> group_norm, dr_grpo -> dr_grpo)")
        if a.overlong_buffer > 0:
            _require(o.overlong_buffer_len < self.max_response_len,
                     f"openrlhf.overlong_buffer_len ({o.overlong_buffer_len}) must be smaller than "
                     f"max_response_len ({self.max_response_len})")
        n_seq = self.prompts_per_step * a.n_samples_per_prompt
        _require((n_seq // self.num_mini_batches) % o.micro_train_batch_size == 0,
                 f"the train batch ({n_seq} // {self.num_mini_batches} mini-batches) must be a "
                 f"multiple of openrlhf.micro_train_batch_size={o.micro_train_batch_size}")
