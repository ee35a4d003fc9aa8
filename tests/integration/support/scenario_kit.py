"""Shared parts of the integration tier's driver-side scenarios (``scenarios.py``).

Process set-up (paths for the import stand-ins, DeepSpeed's CPU accelerator), the tiny Qwen3
checkpoint the tests write, OpenRLHF 0.11.2's own argument parsing, a main-table cell's flags
shrunk to CPU, the local Ray job with the fp8rl driver's runtime env, and the functions run
inside the real actors through ``handle.__ray_call__`` (they record; the tests assert).
"""

from __future__ import annotations

import ast
import os
import sys
import traceback
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
STANDINS = SUPPORT / "standins"
REPO = SUPPORT.parents[2]
VOCAB = ["<pad>", "<eos>", *"0123456789+-=*/ abcdefghijklmnopqrstuvwxyz().,"]


# ------------------------------------------------------------------------------------------
# process set-up, checkpoint, OpenRLHF arguments
# ------------------------------------------------------------------------------------------


def prepare_process() -> None:
    """Paths and environment of this driver process and of the Ray workers it starts."""
    for p in (str(SUPPORT), str(STANDINS)):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(STANDINS), str(SUPPORT), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def tiny_checkpoint(path: Path, *, hidden: int = 128, layers: int = 2, seed: int = 0) -> Path:
    """A random Qwen3-architecture model (bf16) and a character tokenizer, written by us."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    if (path / "config.json").exists():
        return path
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, max_position_embeddings=256)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    fast.save_pretrained(path)
    return path


def openrlhf_args(flags: list[str]):
    """``args`` as OpenRLHF 0.11.2 builds them: its ``__main__`` block (argparse + validation),
    executed from its source with ``train`` replaced by a function that returns the args."""
    import openrlhf.cli.train_ppo_ray as cli

    tree = ast.parse(Path(cli.__file__).read_text())
    main = tree.body[-1]
    assert isinstance(main, ast.If) and "__main__" in ast.unparse(main.test), "train_ppo_ray's __main__ moved"
    ns = dict(vars(cli))
    got = {}
    ns["train"] = lambda args: got.setdefault("args", args)
    argv, sys.argv = sys.argv, ["train_ppo_ray", *flags]
    try:
        exec(compile(ast.Module(body=main.body, type_ignores=[]), cli.__file__, "exec"), ns)
    finally:
        sys.argv = argv
    return got["args"]


def cell_flags(ckpt: Path, ckpt_dir: Path, *, world: int, algorithm: str = "grpo", fp8: str = "tensorwise",
               clip: str = "calibrated", prompts: int = 4, n: int = 4, mini_batches: int = 2,
               micro_batch: int = 2, lr: float = 1e-3) -> list[str]:
    """The flags our command builder emits for a main-table cell, shrunk to a tiny model and
    ``world`` CPU ranks, with the CPU substitutions (no packing, eager attention, gloo weight
    sync, no sleep modes)."""
    import yaml
    from omegaconf import OmegaConf

    from fp8rl.backends.openrlhf.command import Layout, RunPaths, build_args, parse_flags
    from fp8rl.backends.openrlhf.config import OpenRLHFRunConfig
    from fp8rl.launch.configs import build_dataclass

    def y(group, name):
        return yaml.safe_load((REPO / "sweeps" / group / f"{name}.yaml").read_text())

    scale = {k: v for k, v in y("scale", "paper").items() if k not in ("defaults", "scale", "launcher")}
    o = {**y("backend", "openrlhf")["openrlhf"], **y("data", "paper")["openrlhf"]}
    o["models"] = dict.fromkeys(o["models"], str(ckpt))
    o.update(micro_train_batch_size=micro_batch, gradient_checkpointing=False,
             packing_samples=False)
    cfg = {"algorithm": {**y("algorithm", algorithm), "n_samples_per_prompt": n}, "model": {"slot": "8b"},
           "fp8": {**y("fp8", fp8), **scale["fp8"]}, "clip": {**y("clip", clip), **scale["clip"]},
           **{k: v for k, v in scale.items() if k not in ("fp8", "clip")}, "openrlhf": o, "output_dir": str(ckpt_dir / "runs"),
           "prompts_per_step": prompts, "num_mini_batches": mini_batches, "steps": 2, "lr": lr,
           "logprob_micro_batch": 1}
    cfg = build_dataclass(OpenRLHFRunConfig, OmegaConf.to_container(OmegaConf.create(cfg), resolve=True))
    paths = RunPaths(ckpt_dir, ckpt_dir / "train.jsonl", (), ckpt_dir / "reward_func.py")
    args = build_args(cfg, Layout(nodes=1, gpus_per_node=world, vllm_tp=1, vllm_engines=world, colocate_all=True),
                      paths)
    drop = {"ds.packing_samples", "vllm.enable_sleep", "ds.enable_sleep", "train.colocate_all"}
    flags = parse_flags(args)
    out: list[str] = []
    for k, v in flags.items():
        if k in drop:
            continue
        if k == "ckpt.path":
            v = [str(ckpt_dir / "ds")]
        out += [f"--{k}", *v]
    return [*out, "--ds.attn_implementation", "eager", "--vllm.sync_backend", "gloo"]


# ------------------------------------------------------------------------------------------
# Ray
# ------------------------------------------------------------------------------------------


def start_ray(gpus: int, runtime_env: dict) -> None:
    """A local Ray whose job runtime env is ``runtime_env`` (Ray applies ``worker_process_setup_hook``
    at job level only, as the fp8rl driver's ``ray.init`` does); ``gpus`` fake GPU resources."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=8, num_gpus=gpus, include_dashboard=False, object_store_memory=300 * 2**20,
             runtime_env=runtime_env, log_to_driver=bool(os.environ.get("FP8RL_INTEGRATION_VERBOSE")))


def actor_env(spec, hook: str = "worker_hook.setup") -> dict:
    """The fp8rl driver's runtime env for ``spec``, its hook chained behind ``hook`` (``worker_hook``)."""
    from fp8rl.backends.openrlhf.driver import runtime_env

    env = runtime_env(spec.to_json())
    env["env_vars"] = {**env["env_vars"], "FP8RL_TEST_HOOK": env["worker_process_setup_hook"],
                       "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.environ["PYTHONPATH"],
                       "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"],
                       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["worker_process_setup_hook"] = hook
    return env


def policy_group(world: int, spec=None):
    """``world`` real ``PolicyModelActor``s wired like ``RayActorGroup._initiate_actors`` (rank 0
    picks the master address and port), in workers of the current job (its runtime env). With
    ``spec``, the actors' runtime env carries that plugin spec instead of the job's (Ray merges
    an actor's ``env_vars`` into the job's: same setup hook, another spec)."""
    import ray
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    from fp8rl.backends.openrlhf.plugin.spec import SPEC_ENV

    opts = {"num_gpus": 1}
    if spec is not None:
        opts["runtime_env"] = {"env_vars": {SPEC_ENV: spec.to_json()}}
    master = PolicyModelActor.options(**opts).remote(world, 0, None, None)
    addr, port = ray.get(master.get_master_addr_port.remote())
    return [master] + [PolicyModelActor.options(**opts).remote(world, r, addr, port) for r in range(1, world)]


def error_record(e: BaseException) -> dict:
    cause = getattr(e, "cause", None) or e
    return {"type": type(cause).__name__, "message": str(cause), "text": "".join(
        traceback.format_exception(type(e), e, e.__traceback__))[-4000:]}


# ------------------------------------------------------------------------------------------
# functions run inside the actors (handle.__ray_call__.remote(fn, ...))
# ------------------------------------------------------------------------------------------


def model_report(actor) -> dict:
    """What the built actor holds: linear layer types, parameter names, the plugin's attestation."""
    import torch

    from fp8rl.backends.openrlhf.plugin.binding import attest

    module = actor.actor.model.module
    linears = {n: type(m).__name__ for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)
               or hasattr(m, "fp8_recipe")}
    import worker_hook

    return {"linears": linears, "params": [n for n, _ in module.named_parameters()],
            "at_hook": dict(worker_hook.AT_HOOK),
            "engine": type(actor.actor.model).__name__, "zero_stage": actor.actor.model.zero_optimization_stage(),
            "attest": attest(actor), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def instrument(actor) -> None:
    """Record every call of the real loss (inputs, bounds in force, outputs) and of the clip
    controller's ``update`` (inputs, returned bounds)."""
    import torch

    loss = actor.trainer.actor_loss_fn
    rec = actor._fp8rl_test_rec = {"forward": [], "update": []}

    def pre(module, args, kwargs):
        shadow = module.pending_shadow
        rec["forward"].append({"shadow": None if shadow is None else shadow.detach().clone(),
                               "step": module.step})

    def post(module, args, kwargs, out):
        lp, old, adv = args[:3]
        roll = kwargs.get("rollout_log_probs")
        rec["forward"][-1].update(
            lp=lp.detach().float().clone(), old=old.detach().float().clone(), adv=adv.detach().float().clone(),
            mask=kwargs["action_mask"].detach().clone(), roll=None if roll is None else roll.detach().float().clone(),
            bounds=module.clipper.bounds(module.step).as_tuple(), clip_ratio=float(out[1]), loss=float(out[0]))

    loss.register_forward_pre_hook(pre, with_kwargs=True)
    loss.register_forward_hook(post, with_kwargs=True)
    orig_update = loss.clipper.update

    def update(step, **kw):
        bounds = orig_update(step, **kw)
        rec["update"].append({"step": step, "bounds": bounds.as_tuple(),
                              **{k: v.detach().clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}})
        return bounds

    loss.clipper.update = update


def records(actor) -> dict:
    return actor._fp8rl_test_rec


def controller(actor) -> dict:
    from fp8rl.backends.openrlhf.plugin.binding import controller_state

    return controller_state(actor.trainer)


class Probe:
    """Any worker of the job that never imports OpenRLHF's trainer (a vLLM engine actor, say)."""

    def loaded(self) -> dict:
        import worker_hook

        heavy = ("deepspeed", "transformers", "vllm", "openrlhf", "flash_attn", "peft")
        return {"heavy": sorted(m for m in sys.modules if m.split(".")[0] in heavy),
                "meta_path": [type(f).__name__ for f in sys.meta_path],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "at_hook": dict(worker_hook.AT_HOOK)}


def bound_modules(_trainer) -> dict:
    return {n: getattr(sys.modules.get(n), "_fp8rl_spec_json", None) is not None
            for n in ("openrlhf.trainer.ppo_trainer", "openrlhf.trainer.ppo_utils.samples_generator",
                      "openrlhf.trainer.ray.ppo_actor")}
