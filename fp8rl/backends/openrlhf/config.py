"""Paper-scale settings: models, data, vLLM layout, batch shapes and paths of an OpenRLHF run.

``OpenRLHFRunConfig`` is the shared ``fp8rl.config.RunConfig`` (the four axes, seed, schedule,
optimiser, eval cadence) plus an ``openrlhf`` block (:class:`OpenRLHFSettings`). How the shared
fields map onto OpenRLHF 0.11.2 flags is the command builder's business
(``fp8rl.backends.openrlhf.command``); this module only holds and validates values.

Where the shared fields mean something slightly different at paper scale (each documented
in ``docs/cluster.md``):

- ``steps``: number of RL steps. OpenRLHF runs over the prompt set in episodes and has no step
  limit, so :func:`data_plan` derives ``--train.num_episodes`` and ``--data.max_samples`` from
  the train set's size (``openrlhf.train_set_sizes``), ``steps``, ``prompts_per_step`` and, with
  DAPO's dynamic filtering, the planned refill rounds (``1 + algorithm.max_extra_rounds``: each
  step may draw that many batches of prompts, i.e. at least that fraction of groups is
  assumed kept); the plugin stops training after exactly ``steps`` steps
  (``PluginSpec.max_steps``). A plan that cannot reach ``steps`` raises at expand time.
- ``max_response_len`` at paper scale is ``openrlhf.response_len[algorithm]``
  (``sweeps/scale/paper.yaml`` interpolates it): 16,384 for GRPO (the paper's 16K), 20,480 for
  DAPO (the DAPO paper's L_max, with its 4,096-token soft overlong buffer).
- ``algorithm.overlong_buffer > 0`` only *switches on* DAPO's soft overlong penalty; its length
  at paper scale is ``openrlhf.overlong_buffer_len`` (L_cache = 4096 at 20K responses, DAPO).
  The algorithm files hold mini-scale lengths.
- ``fp8.rollout_recipe`` must have a vLLM online FP8 quantization
  (``plugin.fp8_rollout.VLLM_QUANTIZATION``: tensorwise, rowwise, blockwise).
- ``eval_k`` is OpenRLHF's ``eval.n_samples_per_prompt`` (avg@k = its ``pass1`` on 0/1 rewards;
  on +1/-1 rewards ingestion maps ``pass1`` back to accuracy).
- The reward scheme (``openrlhf.reward_scheme``, per algorithm like ``response_len``): ``binary``
  (correct 1, else 0) for GRPO and Dr. GRPO, ``signed`` (+1/-1) for DAPO, as DAPO's recipe has it.
  It lives here and not in ``algorithm`` (**ours**): the mini backend's exact-match reward is 0/1
  for every algorithm, and a new ``algorithm`` key would change every mini run's identity hash.
- ``fp8.emulate`` must be false: paper scale runs real FP8 GEMMs (H100-class GPUs).

The vLLM layout per model slot (tensor parallel size, colocation) lives here; the number of
nodes and GPUs per node comes from the cluster profile (``slurm/profiles``), and the number of
vLLM engines is derived: ``engines = nodes x gpus_per_node / vllm_tp`` (colocated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from fp8rl.config import MODEL_SLOTS, RunConfig, _require

#: ``openrlhf.device`` values (``plugin.cpu_support`` for ``cpu``).
DEVICES: tuple[str, ...] = ("cuda", "cpu")
#: ``openrlhf.reward_scheme`` values: ``binary`` rewards 1/0, ``signed`` +1/-1 (scores stay 0/1).
REWARD_SCHEMES: tuple[str, ...] = ("binary", "signed")

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
        train_set_sizes: prompts per train set after preparation (``data.py``; DAPO-Math-17k
            deduplicated), lower bounds used to plan episodes (:func:`data_plan`); the run
            checks the prepared file before training.
        response_len: the response cap (``max_response_len``) per algorithm at paper scale.
        reward_scheme: per algorithm, :data:`REWARD_SCHEMES`: ``binary`` (correct 1, else 0) or
            ``signed`` (+1/-1, DAPO's recipe); picks the reward file of the command
            (``command.reward_file``). Dynamic filtering and evaluation read 0/1 scores either way.
        vllm_tp: vLLM tensor-parallel size per model slot.
        colocate_all: actor and vLLM engines share the GPUs (``--train.colocate_all``, sleep mode).
        gpu_memory_utilization: vLLM's share of GPU memory.
        zero_stage: DeepSpeed ZeRO stage.
        micro_train_batch_size: per-GPU training micro-batch (the log-prob recomputation's is the
            shared ``logprob_micro_batch``, ``--rollout.micro_batch_size``).
        max_prompt_len: prompt tokens (``data.max_len = max_prompt_len + max_response_len``).
        overlong_buffer_len: DAPO L_cache in tokens, used when ``algorithm.overlong_buffer > 0``.
        gradient_checkpointing, packing_samples: memory/speed switches of the actor.
        apply_chat_template: wrap the prompt with the tokenizer's chat template.
        save_steps: DeepSpeed checkpoint cadence (resume after preemption); -1 = off.
        lr_warmup_ratio: OpenRLHF's warm-up fraction of the cosine schedule.
        entropy_logging: ``--actor.entropy_coef 0`` (log entropy only).
        final_eval: run ``experiments.evaluate`` on the final checkpoint after training (vLLM with
            the arm's rollout quantization: ``eval/`` keys).
        eval_bf16: that evaluation also scores the base model (step 0) and the final checkpoint
            with a BF16 vLLM engine (``eval_bf16/`` keys), so every arm is evaluated in one
            precision; costs one more evaluation pass for a BF16 arm, two for an FP8 arm
            (``fp8rl.backends.openrlhf.evaluate``). Needs ``final_eval``.
        ray_deadline_s: how long the Ray bootstrap waits for every node and GPU.
        extra_args: raw extra CLI arguments appended verbatim (each one validated against the
            0.11.2 parser by the tests only for what we emit; use sparingly).
        device: ``cuda`` (GPUs) or ``cpu``: the whole job on a CPU machine (``make paper-smoke``;
            ``plugin.cpu_support``): vLLM's CPU build, DeepSpeed's CPU accelerator (gloo), Ray with
            placeholder GPU resources, separate engines (no colocation or sleep), eager
            attention, weight sync over a gloo Ray collective.
        cpu_actors, cpu_engines: with ``device=cpu``, the policy actor's data-parallel ranks and
            the vLLM engines (each a placeholder GPU; the cluster profile's GPUs are ignored).
        dump_loss_inputs: the plugin's loss writes every micro-batch's inputs and bounds under
            ``<run>/openrlhf/dumps`` (for tests that recompute the logged diagnostics).
        engine_max_num_seqs: vLLM's ``max_num_seqs`` for the rollout engines (None: vLLM's
            default). 1 decodes one sequence at a time, so a seeded request's tokens never depend
            on its batch-mates (``plugin.binding.rollout``): the CPU smoke job's exact-resume check
            runs so; it costs rollout throughput.
    """

    models: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_MODELS))
    train_sets: dict[str, str] = field(default_factory=lambda: {
        "grpo": "deepscaler", "dr_grpo": "deepscaler", "dapo": "dapo_math_17k"})
    eval_sets: list[str] = field(default_factory=lambda: [
        "aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench"])
    datasets: dict[str, str] = field(default_factory=dict)
    data_dir: str | None = None
    train_set_sizes: dict[str, int] = field(default_factory=lambda: {"deepscaler": 40315, "dapo_math_17k": 17000})
    response_len: dict[str, int] = field(default_factory=lambda: {"grpo": 16384, "dr_grpo": 16384, "dapo": 20480})
    reward_scheme: dict[str, str] = field(default_factory=lambda: {
        "grpo": "binary", "dr_grpo": "binary", "dapo": "signed"})
    vllm_tp: dict[str, int] = field(default_factory=lambda: {"8b": 1, "14b": 2, "32b": 4})
    colocate_all: bool = True
    gpu_memory_utilization: float = 0.6
    zero_stage: int = 3
    micro_train_batch_size: int = 4
    max_prompt_len: int = 1024
    overlong_buffer_len: int = 4096
    gradient_checkpointing: bool = True
    packing_samples: bool = True
    apply_chat_template: bool = True
    save_steps: int = 10
    lr_warmup_ratio: float = 0.0
    entropy_logging: bool = True
    final_eval: bool = True
    eval_bf16: bool = False
    ray_deadline_s: float = 600.0
    extra_args: list[str] = field(default_factory=list)
    device: str = "cuda"
    cpu_actors: int = 1
    cpu_engines: int = 1
    dump_loss_inputs: bool = False
    engine_max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        _require(self.device in DEVICES, f"openrlhf.device={self.device!r} must be one of {DEVICES} (cuda: "
                 "GPUs; cpu: the whole job on a CPU machine, as make paper-smoke runs it)")
        for f in ("cpu_actors", "cpu_engines"):
            _require(isinstance(getattr(self, f), int) and 1 <= getattr(self, f) <= 8,
                     f"openrlhf.{f} must be an integer in 1..8, got {getattr(self, f)!r}")
        if self.device == "cpu":
            _require(not self.packing_samples, "openrlhf.device=cpu: packed samples need flash-attn (GPU only); "
                     "set openrlhf.packing_samples=false")
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
        _require(self.engine_max_num_seqs is None or (isinstance(self.engine_max_num_seqs, int)
                                                        and self.engine_max_num_seqs >= 1),
                 f"openrlhf.engine_max_num_seqs must be null (vLLM's default) or an integer >= 1, "
                 f"got {self.engine_max_num_seqs!r}")
        _require(0 < self.gpu_memory_utilization < 1,
                 f"openrlhf.gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization}")
        _require(self.zero_stage in (0, 1, 2, 3), f"openrlhf.zero_stage must be 0..3, got {self.zero_stage}")
        for f in ("micro_train_batch_size", "max_prompt_len"):
            _require(getattr(self, f) >= 1, f"openrlhf.{f} must be >= 1, got {getattr(self, f)}")
        _require(self.overlong_buffer_len >= 1, "openrlhf.overlong_buffer_len must be >= 1")
        _require(self.save_steps == -1 or self.save_steps >= 1,
                 f"openrlhf.save_steps must be >= 1 or -1 (off), got {self.save_steps}")
        _require(0 <= self.lr_warmup_ratio < 1, "openrlhf.lr_warmup_ratio must be in [0, 1)")
        _require(self.ray_deadline_s > 0, "openrlhf.ray_deadline_s must be > 0")
        _require(isinstance(self.eval_bf16, bool) and (self.final_eval or not self.eval_bf16),
                 f"openrlhf.eval_bf16={self.eval_bf16!r} is part of the evaluation after training: it needs "
                 "openrlhf.final_eval=true (or set eval_bf16=false)")
        _require(all(isinstance(a, str) for a in self.extra_args), "openrlhf.extra_args must be strings")
        for k, v in self.reward_scheme.items():
            _require(v in REWARD_SCHEMES,
                     f"openrlhf.reward_scheme.{k}={v!r} must be one of {REWARD_SCHEMES} (binary: correct 1, "
                     "else 0; signed: +1/-1 as in DAPO's recipe)")
        for k, n in {**self.train_set_sizes, **self.response_len}.items():
            _require(isinstance(n, int) and n >= 1, f"openrlhf.train_set_sizes / response_len: {k} must be an "
                     f"integer >= 1, got {n!r}")


@dataclass
class OpenRLHFRunConfig(RunConfig):
    """``RunConfig`` plus the ``openrlhf`` block; validates the paper-scale cross-field rules."""

    openrlhf: OpenRLHFSettings = field(default_factory=OpenRLHFSettings)
    #: OpenRLHF hands ``eval.temperature`` to vLLM, which decodes greedily at 0.
    GREEDY_EVAL_TEMPERATURE: ClassVar[bool] = True
    #: Paths and caches do not change what a run computes (``fp8rl.backends.openrlhf.run.IDENTITY_EXCLUDE``).
    BACKEND_IDENTITY_EXCLUDE: ClassVar[tuple[str, ...]] = (
        "openrlhf.data_dir", "openrlhf.final_eval", "openrlhf.eval_bf16", "openrlhf.ray_deadline_s",
        "openrlhf.save_steps", "openrlhf.dump_loss_inputs")

    def validate(self) -> None:
        super().validate()
        o, a = self.openrlhf, self.algorithm
        _require(not self.fp8.emulate,
                 "fp8.emulate=true is a CPU emulation for the mini backend; paper scale runs real "
                 "FP8 GEMMs: set fp8.emulate=false (scale=paper does)")
        _require(a.name in o.train_sets,
                 f"openrlhf.train_sets has no dataset for algorithm {a.name!r} "
                 f"(has {sorted(o.train_sets)})")
        _require(a.name in o.reward_scheme,
                 f"openrlhf.reward_scheme has no scheme for algorithm {a.name!r} (has "
                 f"{sorted(o.reward_scheme)}); add openrlhf.reward_scheme.{a.name}=binary or signed")
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
        _require(self.fp8.compute_dtype == "bf16",
                 f"fp8.compute_dtype={self.fp8.compute_dtype!r}: paper scale computes in BF16 (DeepSpeed "
                 "bf16, vLLM bfloat16); the fp32 arm exists at mini scale only")
        _require(self.lr_lm_head is None and self.lr_final_norm is None,
                 "lr_lm_head / lr_final_norm are mini-scale learning rates; OpenRLHF trains every "
                 "parameter at one learning rate (lr): leave them null at paper scale")
        _require(not self.eval_greedy,
                 "eval_greedy: OpenRLHF evaluates avg@k / pass@k by sampling; set eval_greedy=false "
                 "(scale=paper does)")
        _require(self.logging.wandb_project is None,
                 "logging.wandb_project: OpenRLHF 0.11.2 logs to W&B only with an API key on its "
                 "command line (--logger.wandb.key), which would put the key into process lists and "
                 "job logs; watch paper-scale runs in TensorBoard (<run-dir>/tensorboard), or add the "
                 "--logger.wandb.* flags yourself through openrlhf.extra_args")
        from fp8rl.backends.openrlhf.plugin.fp8_rollout import (
            check_paper_scale_recipes,
            check_rollout_recipe,
        )

        check_paper_scale_recipes(self.fp8.rollout_recipe, self.fp8.trainer_recipe)  # FP4/FP6: one line
        check_rollout_recipe(self.fp8.rollout_recipe)
        data_plan(self)  # raises when the train set cannot supply `steps`
        n_seq = self.prompts_per_step * a.n_samples_per_prompt
        _require((n_seq // self.num_mini_batches) % o.micro_train_batch_size == 0,
                 f"the train batch ({n_seq} // {self.num_mini_batches} mini-batches) must be a "
                 f"multiple of openrlhf.micro_train_batch_size={o.micro_train_batch_size}")


def reward_scheme(cfg: OpenRLHFRunConfig | dict) -> str:
    """The reward scheme of a cell: its config, or the ``config.yaml`` dict a run recorded.

    A recorded config without ``openrlhf.reward_scheme`` (written before the field existed) ran
    with binary rewards.
    """
    if isinstance(cfg, dict):
        schemes = (cfg.get("openrlhf") or {}).get("reward_scheme") or {}
        name = (cfg.get("algorithm") or {}).get("name")
    else:
        schemes, name = cfg.openrlhf.reward_scheme, cfg.algorithm.name
    scheme = schemes.get(name, "binary")
    _require(scheme in REWARD_SCHEMES, f"openrlhf.reward_scheme.{name}={scheme!r} must be one of {REWARD_SCHEMES}")
    return scheme


@dataclass(frozen=True)
class DataPlan:
    """How many prompts OpenRLHF reads, and how often, so that a cell reaches its ``steps``.

    Attributes:
        train_set: the train set's name; ``size`` its planned prompt count.
        rounds: prompt batches one step may draw (``1 + max_extra_rounds`` with dynamic filtering).
        steps_per_episode: steps one pass over the data supplies at that draw rate.
        episodes: ``--train.num_episodes``; ``max_samples``: ``--data.max_samples``.
    """

    train_set: str
    size: int
    rounds: int
    steps_per_episode: int
    episodes: int
    max_samples: int


def data_plan(cfg: OpenRLHFRunConfig) -> DataPlan:
    """The episodes and ``data.max_samples`` of ``cfg`` (raises if ``steps`` cannot be reached).

    One step trains ``prompts_per_step`` prompts; with dynamic filtering OpenRLHF replaces every
    dropped group with a fresh prompt, so a step consumes ``prompts_per_step / kept fraction``
    prompts. We plan for a kept fraction of at least ``1 / rounds`` (``rounds = 1 +
    max_extra_rounds``): ``steps_per_episode = size // (prompts_per_step x rounds)`` and enough
    episodes for ``steps``; the plugin stops after ``steps`` (a faster keep rate does not overrun),
    and a slower one ends the run early, which the run reports as a failure naming the rates.
    """
    o, a = cfg.openrlhf, cfg.algorithm
    name = o.train_sets.get(a.name)
    _require(name is not None, f"openrlhf.train_sets has no dataset for algorithm {a.name!r}")
    _require(name in o.train_set_sizes,
             f"openrlhf.train_set_sizes has no size for train set {name!r}; add its prompt count "
             "(after `python -m fp8rl.backends.openrlhf.data`) so the episodes can be planned")
    size = int(o.train_set_sizes[name])
    rounds = 1 + a.max_extra_rounds if a.dynamic_sampling else 1
    per_step = cfg.prompts_per_step * rounds
    steps_per_episode = size // per_step
    _require(steps_per_episode >= 1,
             f"train set {name!r} has {size} prompts, fewer than one step needs ({cfg.prompts_per_step} "
             f"prompts x {rounds} planned draw round(s)); lower prompts_per_step or algorithm.max_extra_rounds")
    episodes = math.ceil(cfg.steps / steps_per_episode)
    max_samples = size if episodes > 1 else min(size, cfg.steps * per_step)
    return DataPlan(train_set=name, size=size, rounds=rounds, steps_per_episode=steps_per_episode,
                    episodes=episodes, max_samples=max_samples)
