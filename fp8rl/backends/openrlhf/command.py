"""Resolved config -> the ``openrlhf.cli.train_ppo_ray`` argument list of OpenRLHF 0.11.2.

``build_args(cfg, layout, paths)`` returns the flags (dotted 0.11.2 names; values as strings)
that make one grid cell; ``command_line`` shell-quotes them behind
``python -m fp8rl.backends.openrlhf.driver``. Every flag and choice emitted here is checked
against the 0.11.2 parser, read with ``ast`` from ``openrlhf/cli/train_ppo_ray.py``
(``tests/openrlhf/test_orl_command.py``), for every main-table cell.

Mapping (``reference/openrlhf.md``):

============================  ====================================================================
ours                          OpenRLHF 0.11.2
============================  ====================================================================
GRPO (``grpo`` estimator)     ``--algo.advantage.estimator group_norm``, n samples per prompt
Dr.GRPO                       ``--algo.advantage.estimator dr_grpo``
eps_low / eps_high            ``--actor.eps_clip_low_high LOW HIGH``; ``dual_clip`` -> ``--actor.dual_clip``
loss_agg_mode                 ``--actor.loss_agg_mode`` (token-mean | seq-mean-token-mean)
KL off (``kl_coef == 0``)     ``--algo.kl.init_coef 0`` (no reference model); on: coef + ``use_loss`` + k3
DAPO dynamic sampling         ``--algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1``
DAPO overlong penalty         ``--reward.overlong_buffer_len L --reward.overlong_penalty_factor f``
TIS (cap C)                   ``--algo.advantage.is_correction_level token --..._mode clip --..._threshold 0 C``
ICEPOP (low, high)            level token, mode mask, threshold low high
entropy                       ``--actor.entropy_coef 0`` (logged only, as ``entropy_loss``)
num_mini_batches M            ``--train.batch_size = prompts x n / M`` (M optimizer steps per rollout)
steps                         ``--train.num_episodes`` and ``--data.max_samples`` from
                              ``config.data_plan`` (the plugin stops after ``steps``)
reward scheme                 ``--reward.remote_url``: ``reward_func.py`` (binary, 1/0) or
                              ``reward_func_signed.py`` (signed, +1/-1: DAPO) (:func:`reward_file`)
============================  ====================================================================

The clip method (vanilla / calibrated), the FP8 recipes, Score Centering's options (mode,
bounds, k) and the held-out share (``clip.holdout_share``; :func:`plugin_lines` prints these two
in a dry run) have no OpenRLHF flag: they reach the
workers through the plugin spec (``fp8rl.backends.openrlhf.plugin.PluginSpec``) that the driver
installs. The TIS threshold's low end is 0 (Yao et al.'s TIS does not clamp from below;
OpenRLHF's default 0.5 would), matching ``fp8rl.rl.correction``.

Resource rules that ``train_ppo_ray`` asserts at start-up are checked here before submission
(:func:`check_resources`): colocation needs actor GPUs == vLLM engines x TP; the rollout batch
must give every actor process at least one micro-batch; group estimators and dynamic filtering
need n > 1; dynamic filtering and evaluation need the reward function.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from fp8rl.runs.live import TENSORBOARD_DIR

#: The driver module that runs the CLI in-process (the CLI itself is ``openrlhf.cli.train_ppo_ray``).
DRIVER_MODULE = "fp8rl.backends.openrlhf.driver"
CLI_MODULE = "openrlhf.cli.train_ppo_ray"
ESTIMATORS = {"grpo": "group_norm", "dr_grpo": "dr_grpo"}
#: Reward file per ``openrlhf.reward_scheme`` (``signed``: the sibling of ``RunPaths.reward_file``).
SIGNED_REWARD_FILE = "reward_func_signed.py"


#: Flags of a CPU job (``openrlhf.device=cpu``, ``plugin.cpu_support``): no NCCL (the weights go to
#: the engines through Ray, ``plugin.binding.cpu_sync``), eager attention, eager vLLM.
CPU_FLAGS = ["--vllm.sync_backend", "gloo", "--ds.attn_implementation", "eager", "--vllm.enforce_eager"]


class ResourceError(ValueError):
    """A layout OpenRLHF would reject at start-up (the message names the numbers and the fix)."""


@dataclass(frozen=True)
class Layout:
    """GPUs of one cell and how vLLM uses them (colocated: every GPU trains and generates)."""

    nodes: int
    gpus_per_node: int
    vllm_tp: int
    vllm_engines: int
    colocate_all: bool

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def layout_for(cfg, nodes: int, gpus_per_node: int) -> Layout:
    """The layout of ``cfg`` on ``nodes x gpus_per_node`` GPUs (engines derived from the TP)."""
    o = cfg.openrlhf
    if o.device == "cpu":  # plugin.cpu_support: placeholder GPUs, engines apart from the actor
        return Layout(nodes=1, gpus_per_node=o.cpu_actors, vllm_tp=1, vllm_engines=o.cpu_engines,
                      colocate_all=False)
    tp = int(o.vllm_tp[cfg.model.slot])
    gpus = nodes * gpus_per_node
    if gpus < 1:
        raise ResourceError(f"a paper-scale cell needs GPUs; the profile gives {nodes} node(s) x "
                            f"{gpus_per_node} GPU(s)")
    if gpus < tp:
        raise ResourceError(f"model slot {cfg.model.slot} runs vLLM with tensor-parallel size {tp} "
                            f"(openrlhf.vllm_tp.{cfg.model.slot}) but the cell has {gpus} GPU(s) ({nodes} node(s) "
                            f"x {gpus_per_node}); give it at least {tp} GPUs (a profile with more GPUs for "
                            f"{cfg.model.slot}, or gpus_per_node={tp}+ on one machine), or leave this slot "
                            f"out of the sweep (model=...)")
    if gpus % tp:
        raise ResourceError(f"{gpus} GPUs do not split into vLLM engines of tensor-parallel size "
                            f"{tp} (openrlhf.vllm_tp.{cfg.model.slot}); change the profile's nodes/GPUs "
                            "or the TP")
    if not o.colocate_all:
        raise ResourceError("openrlhf.colocate_all=false needs separate vLLM GPUs, which this "
                            "builder does not lay out; keep colocate_all=true")
    return Layout(nodes=nodes, gpus_per_node=gpus_per_node, vllm_tp=tp, vllm_engines=gpus // tp,
                  colocate_all=True)


@dataclass(frozen=True)
class RunPaths:
    """Files and directories a run's command refers to (``reward_file``: the binary reward file;
    signed cells use :data:`SIGNED_REWARD_FILE` beside it, see :func:`reward_file`)."""

    run_dir: Path
    train_file: Path
    eval_files: tuple[Path, ...]
    reward_file: Path
    #: The actor's model (HF id or directory); None = ``openrlhf.models[slot]`` as given.
    model: str | None = None

    @property
    def tensorboard_dir(self) -> Path:
        return self.run_dir / TENSORBOARD_DIR  # the mini backend's layout (fp8rl.runs.live)

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoint" / "deepspeed"

    @property
    def final_model_dir(self) -> Path:
        return self.run_dir / "checkpoint" / "final"


def _num(x: float) -> str:
    """Shortest round-trip text of a number (``1e-06``, ``0.2``, ``3``)."""
    if isinstance(x, bool):
        raise TypeError("booleans are flags, not values")
    return repr(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


def reward_file(cfg, paths: RunPaths) -> Path:
    """The reward file of ``cfg``'s reward scheme: ``paths.reward_file`` (binary) or its signed
    sibling. OpenRLHF loads it in the vLLM Ray actors of every node, so the scheme travels in the
    command itself rather than in an environment variable."""
    from fp8rl.backends.openrlhf.config import reward_scheme

    scheme = reward_scheme(cfg)
    if scheme == "binary":
        return paths.reward_file
    if scheme == "signed":
        return paths.reward_file.with_name(SIGNED_REWARD_FILE)
    raise ValueError(f"reward scheme {scheme!r} has no reward file")


def train_batch_size(cfg) -> int:
    return cfg.prompts_per_step * cfg.algorithm.n_samples_per_prompt // cfg.num_mini_batches


def is_correction_flags(cfg) -> list[str]:
    """IS-correction flags of the clip arm (none for ``vanilla``)."""
    corr = cfg.clip.is_correction
    if corr == "none":
        return []
    if corr == "tis":
        return ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip",
                "--algo.advantage.is_correction_threshold", "0", _num(cfg.clip.tis_cap)]
    if corr == "icepop":
        p = cfg.clip.correction_params()
        return ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "mask",
                "--algo.advantage.is_correction_threshold", _num(p.get("low", 0.5)), _num(p.get("high", 5.0))]
    raise ValueError(f"IS correction {corr!r} has no OpenRLHF 0.11.2 flags")


def build_args(cfg, layout: Layout, paths: RunPaths) -> list[str]:
    """The ``train_ppo_ray`` flags of one cell (a flat list of strings, unquoted)."""
    from fp8rl.runs.identity import run_name

    a, o = cfg.algorithm, cfg.openrlhf
    args: list[str] = [
        # models and resources
        "--actor.model_name_or_path", paths.model or o.models[cfg.model.slot],
        "--actor.num_nodes", str(layout.nodes), "--actor.num_gpus_per_node", str(layout.gpus_per_node),
        "--ref.num_nodes", str(layout.nodes), "--ref.num_gpus_per_node", str(layout.gpus_per_node),
        "--vllm.num_engines", str(layout.vllm_engines), "--vllm.tensor_parallel_size", str(layout.vllm_tp),
        "--vllm.gpu_memory_utilization", _num(o.gpu_memory_utilization),
    ]
    if layout.colocate_all:
        args += ["--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep"]
    if o.device == "cpu":  # no NCCL/IPC, no flash-attn, no CUDA graphs (plugin.cpu_support)
        args += CPU_FLAGS
    args += [
        "--ds.zero_stage", str(o.zero_stage), "--ds.param_dtype", "bf16",
        # algorithm
        "--algo.advantage.estimator", ESTIMATORS[a.advantage_estimator],
        "--rollout.n_samples_per_prompt", str(a.n_samples_per_prompt),
        "--actor.eps_clip_low_high", _num(a.eps_low), _num(a.eps_high),
        "--actor.loss_agg_mode", a.loss_agg_mode,
        "--actor.policy_loss_type", "ppo",
    ]
    if a.dual_clip is not None:
        args += ["--actor.dual_clip", _num(a.dual_clip)]
    if a.kl_coef > 0:
        args += ["--algo.kl.init_coef", _num(a.kl_coef), "--algo.kl.use_loss", "--algo.kl.estimator", "k3"]
    else:
        args += ["--algo.kl.init_coef", "0"]
    if a.dynamic_sampling:
        args += ["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0", "1"]
    if a.overlong_buffer > 0:
        args += ["--reward.overlong_buffer_len", str(o.overlong_buffer_len),
                 "--reward.overlong_penalty_factor", _num(a.overlong_penalty)]
    args += is_correction_flags(cfg)
    if o.entropy_logging:
        args += ["--actor.entropy_coef", "0"]
    # batch shapes: prompts_per_step prompts x n samples per rollout, num_mini_batches updates
    from fp8rl.backends.openrlhf.config import data_plan

    plan = data_plan(cfg)
    args += [
        "--rollout.batch_size", str(cfg.prompts_per_step),
        "--train.batch_size", str(train_batch_size(cfg)),
        "--train.micro_batch_size", str(o.micro_train_batch_size),
        "--rollout.micro_batch_size", str(cfg.logprob_micro_batch),
        "--train.max_epochs", "1", "--train.num_episodes", str(plan.episodes),
        "--data.max_samples", str(plan.max_samples),
        "--data.max_len", str(o.max_prompt_len + cfg.max_response_len),
        "--rollout.max_new_tokens", str(cfg.max_response_len),
        "--rollout.temperature", _num(cfg.temperature), "--rollout.top_p", "1",
        # optimiser
        "--actor.adam.lr", _num(cfg.lr),
        "--actor.adam.betas", _num(cfg.adam_betas[0]), _num(cfg.adam_betas[1]),
        "--actor.adam.weight_decay", _num(cfg.weight_decay),
        "--actor.max_norm", _num(cfg.max_grad_norm),
        "--actor.lr_scheduler", "constant_with_warmup", "--actor.lr_warmup_ratio", _num(o.lr_warmup_ratio),
        # data and reward
        "--data.prompt_dataset", str(paths.train_file),
        "--data.input_key", "input", "--data.label_key", "label",
        "--reward.remote_url", str(reward_file(cfg, paths)),
    ]
    if o.apply_chat_template:
        args += ["--data.apply_chat_template"]
    if o.gradient_checkpointing:
        args += ["--actor.gradient_checkpointing_enable"]
    if o.packing_samples:
        args += ["--ds.packing_samples"]
    if paths.eval_files:
        args += [
            "--eval.dataset", ",".join(str(p) for p in paths.eval_files),
            "--eval.steps", str(cfg.eval_every if cfg.eval_every > 0 else -1),
            "--eval.n_samples_per_prompt", str(cfg.eval_k),
            "--eval.temperature", _num(cfg.eval_temperature),
        ]
    name = run_name(a.name, cfg.model.slot, cfg.fp8.name, cfg.clip.arm, cfg.seed)
    args += [
        # logging, checkpoints, seed
        "--logger.tensorboard_dir", str(paths.tensorboard_dir), "--logger.wandb.run_name", name,
        "--logger.logging_steps", "1",
        "--ckpt.path", str(paths.ckpt_dir), "--ckpt.output_dir", str(paths.final_model_dir),
        "--ckpt.save_steps", str(o.save_steps), "--ckpt.max_num", "2", "--ckpt.load_enable",
        "--ckpt.best_metric_key", "none",
        "--train.seed", str(cfg.seed),
        *o.extra_args,
    ]
    check_resources(args)
    return args


def parse_flags(args: list[str]) -> dict[str, list[str]]:
    """``["--a", "1", "--b", "--c", "x", "y"]`` -> ``{"a": ["1"], "b": [], "c": ["x", "y"]}``."""
    out: dict[str, list[str]] = {}
    key = None
    for tok in args:
        if tok.startswith("--") and not _is_number(tok):
            key = tok[2:]
            if key in out:
                raise ValueError(f"flag --{key} given twice")
            out[key] = []
        elif key is None:
            raise ValueError(f"value {tok!r} before any flag")
        else:
            out[key].append(tok)
    return out


def _is_number(tok: str) -> bool:
    try:
        float(tok)
        return True
    except ValueError:
        return False


def check_resources(args: list[str]) -> None:
    """OpenRLHF 0.11.2's start-up assertions on a flag list; raises :class:`ResourceError`."""
    f = parse_flags(args)

    def one(key: str, default: str) -> str:
        return (f.get(key) or [default])[0]

    nodes, gpn = int(one("actor.num_nodes", "1")), int(one("actor.num_gpus_per_node", "8"))
    engines, tp = int(one("vllm.num_engines", "0")), int(one("vllm.tensor_parallel_size", "1"))
    n = int(one("rollout.n_samples_per_prompt", "1"))
    rollout_bs, micro = int(one("rollout.batch_size", "1024")), int(one("rollout.micro_batch_size", "1"))
    train_bs, micro_train = int(one("train.batch_size", "128")), int(one("train.micro_batch_size", "1"))
    problems = []
    if "train.colocate_all" in f and engines > 0 and nodes * gpn != engines * tp:
        problems.append(f"colocate_all needs actor GPUs ({nodes} x {gpn} = {nodes * gpn}) == vLLM engines "
                        f"x TP ({engines} x {tp} = {engines * tp})")
    if n * rollout_bs // micro < nodes * gpn:
        problems.append(f"n x rollout batch / rollout micro batch = {n} x {rollout_bs} / {micro} = "
                        f"{n * rollout_bs // micro} must be >= the {nodes * gpn} actor processes; raise "
                        "prompts_per_step or lower logprob_micro_batch")
    if (n * rollout_bs) % train_bs:
        problems.append(f"the rollout batch ({n} x {rollout_bs}) must be a multiple of the train batch "
                        f"({train_bs}) so every optimizer step is full")
    if train_bs % (micro_train * nodes * gpn):
        problems.append(f"the train batch ({train_bs}) must split into micro-batches of {micro_train} on "
                        f"each of the {nodes * gpn} actor ranks (DeepSpeed's train_batch_size check)")
    if one("algo.advantage.estimator", "gae") in ("rloo", "reinforce_baseline", "group_norm", "dr_grpo") and n <= 1:
        problems.append("group estimators need n_samples_per_prompt > 1")
    if "algo.dynamic_filtering_enable" in f:
        lo, hi = (float(x) for x in f.get("algo.dynamic_filtering_range", ["0", "1"]))
        if not lo < hi:
            problems.append("dynamic_filtering_range needs low < high")
        if "reward.remote_url" not in f or n <= 1:
            problems.append("dynamic filtering needs --reward.remote_url and n_samples_per_prompt > 1")
    if "eval.dataset" in f and "reward.remote_url" not in f:
        problems.append("--eval.dataset needs --reward.remote_url")
    if "ds.packing_samples" in f and engines <= 0:
        problems.append("--ds.packing_samples needs vLLM engines")
    if problems:
        raise ResourceError("OpenRLHF would reject this cell at start-up: " + "; ".join(problems))


def plugin_lines(cfg, run_dir) -> list[str]:
    """Dry-run lines of what reaches the workers through the plugin spec and has no OpenRLHF flag
    (``run.describe``), read from the spec the driver would write: Score Centering's options and
    the vLLM settings they give, and a non-zero held-out share (none for a cell with neither)."""
    if cfg.clip.score_centering_options() is None and not cfg.clip.holdout_share:
        return []
    from fp8rl.backends.openrlhf.plugin.spec import PluginSpec

    spec = PluginSpec.from_config(cfg, run_dir=run_dir)
    out = []
    sc = spec.score_centering
    if sc is not None:
        from fp8rl.backends.openrlhf.plugin.score_centering import engine_kwargs

        engine = ", ".join(f"{k}={v}" for k, v in engine_kwargs(sc).items())
        bounds = "none" if sc["bounds"] is None else f"[{_num(sc['bounds'][0])}, {_num(sc['bounds'][1])}]"
        out.append(f"    plugin:    score_centering mode={sc['mode']} bounds={bounds} topk={sc['topk']}; vLLM train "
                   f"requests logprobs={sc['topk']}, engines {engine}")
    if spec.holdout_share:
        out.append(f"    plugin:    holdout_share={_num(spec.holdout_share)} (held-out rows per step and rank: BF16 "
                   "shadow, never calibrated on, logged as shadow/ho_*)")
    return out


def command_line(args: list[str], *, python: str = "python") -> str:
    """The shell-quoted driver command (what the job runs after the Ray bootstrap)."""
    return shlex.join([python, "-m", DRIVER_MODULE, "--", *args])
