"""Driver-side scenarios of the integration tier; each runs in its own process.

    python tests/integration/support/scenarios.py NAME OUT_DIR '{"param": ...}'   (or @params.json)

A scenario plays the part of OpenRLHF's driver against real upstream code: it starts a real
local Ray (fake GPU resources, so Ray sets ``CUDA_VISIBLE_DEVICES`` as on a cluster), builds the
real ``DeepspeedStrategy`` from arguments parsed by OpenRLHF 0.11.2's own parser and validation
block, creates the real ``PolicyModelActor`` in Ray workers whose runtime environment is the
fp8rl driver's (``fp8rl.backends.openrlhf.driver.runtime_env``; only its setup hook is chained
behind ``worker_hook.setup``, which puts in the CPU stand-ins for CUDA), and records what
happened. It writes ``OUT_DIR/result.pt`` (``torch.save`` of plain containers and tensors); the
tests assert on it and compute their references independently.

Stand-ins, all outside the code under test: ``standins/`` (import stand-ins for vLLM and
flash-attn, on the actor path only), ``cpu_cuda.py`` (torch.cuda entry points), DeepSpeed's own
CPU accelerator (``DS_ACCELERATOR=cpu``, gloo). Packed samples are off (they need flash-attn)
and attention is ``eager``; everything else is the production path.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import time
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
    from fp8rl.launch.grid import build_dataclass

    def y(group, name):
        return yaml.safe_load((REPO / "sweeps" / group / f"{name}.yaml").read_text())

    scale = {k: v for k, v in y("scale", "paper").items() if k not in ("defaults", "scale", "launcher")}
    o = {**y("backend", "openrlhf")["openrlhf"], **y("data", "paper")["openrlhf"]}
    o["models"] = dict.fromkeys(o["models"], str(ckpt))
    o.update(micro_train_batch_size=micro_batch, micro_rollout_batch_size=1, gradient_checkpointing=False,
             packing_samples=False)
    cfg = {"algorithm": {**y("algorithm", algorithm), "n_samples_per_prompt": n}, "model": {"slot": "8b"},
           "fp8": {**y("fp8", fp8), **scale["fp8"]}, "clip": y("clip", clip),
           **{k: v for k, v in scale.items() if k != "fp8"}, "openrlhf": o, "output_dir": str(ckpt_dir / "runs"),
           "prompts_per_step": prompts, "num_mini_batches": mini_batches, "steps": 2, "lr": lr}
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


# ------------------------------------------------------------------------------------------
# scenarios
# ------------------------------------------------------------------------------------------


def policy_recipes(out: Path, recipes: list, world: int = 1, concurrent: int = 4) -> dict:
    """For each ``[recipe, impl, emulate]``: the real PolicyModelActor builds its model (or fails).

    One job with the driver's runtime env; each recipe's actors carry their own spec (actor-level
    ``env_vars``), ``concurrent`` recipes at a time. A ``Probe`` actor of the same job, which never
    imports OpenRLHF (as a vLLM engine actor), reports what the setup hook left in it."""
    import ray

    from fp8rl.backends.openrlhf.plugin.spec import PluginSpec

    ckpt = tiny_checkpoint(out / "ckpt")
    args = openrlhf_args(cell_flags(ckpt, out, world=world))
    from openrlhf.utils import get_strategy

    start_ray(concurrent * world + 1, actor_env(PluginSpec()))
    probe = ray.remote(num_gpus=1)(Probe).remote()
    res = {"probe": ray.get(probe.loaded.remote())}
    ray.kill(probe)
    specs = {}
    for recipe, impl, emulate in recipes:
        key = f"{recipe}/{impl}/{'emulate' if emulate else 'native'}"
        specs[key] = PluginSpec(clip_method="calibrated", clip_options={"period": 1}, eps_low=0.2, eps_high=0.2,
                                trainer_recipe=recipe, trainer_impl=impl, trainer_emulate=emulate, max_steps=2)
    args.actor.eps_clip_low_high = [0.2, 0.2]
    keys = list(specs)
    for i in range(0, len(keys), concurrent):
        t0 = time.perf_counter()
        batch = {k: policy_group(world, specs[k]) for k in keys[i:i + concurrent]}
        refs = {k: [a.init_model_from_pretrained.remote(get_strategy(args), str(ckpt), 4, None) for a in actors]
                for k, actors in batch.items()}
        for k, actors in batch.items():
            try:
                ray.get(refs[k])
                res[k] = {"ok": True, "report": ray.get(actors[0].__ray_call__.remote(model_report))}
            except Exception as e:  # a cell that must fail: its reason is what the test checks
                res[k] = {"ok": False, "error": error_record(e)}
        for k, actors in batch.items():
            res[k]["batch_seconds"] = time.perf_counter() - t0
            for a in actors:
                ray.kill(a)
    return res


class Probe:
    """Any worker of the job that never imports OpenRLHF's trainer (a vLLM engine actor, say)."""

    def loaded(self) -> dict:
        import worker_hook

        heavy = ("deepspeed", "transformers", "vllm", "openrlhf", "flash_attn", "peft")
        return {"heavy": sorted(m for m in sys.modules if m.split(".")[0] in heavy),
                "meta_path": [type(f).__name__ for f in sys.meta_path],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "at_hook": dict(worker_hook.AT_HOOK)}


def make_experiences(args, world: int, *, seed: int, tokens_per_rank: int = 8):
    """Per rank a batch of ``tokens_per_rank`` sequences (prompt 6 tokens, responses 3-10 tokens):
    one with A > 0, one with A == 0 (a GRPO group of equal rewards), the others A < 0."""
    import torch
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(seed)
    batches = []
    for _rank in range(world):
        B, P, R = tokens_per_rank, 6, 10
        seq = torch.randint(2, 64, (B, P + R), generator=g)
        lens = torch.randint(3, R + 1, (B,), generator=g)
        attn = torch.ones(B, P + R, dtype=torch.long)
        action = torch.zeros(B, R, dtype=torch.bool)
        for b in range(B):
            attn[b, P + int(lens[b]):] = 0
            seq[b, P + int(lens[b]):] = 0
            action[b, : int(lens[b])] = True
        adv = -torch.rand(B, 1, generator=g).expand(B, R).clone() - 0.1
        adv[0] = 0.0
        adv[1] = -adv[1]
        adv = adv * action
        batches.append(Experience(sequences=seq, attention_mask=attn, action_mask=action, advantages=adv,
                                  response_length=lens.float(), total_length=(lens + P).float()))
    return batches


def ppo_train(out: Path, recipe: str = "tensorwise", world: int = 2) -> dict:
    """Two gloo ranks: the real ``ppo_train`` with calibrated clipping, a checkpoint through the
    real save path, and a fresh pair of actors resuming from it."""
    import ray
    import torch

    from fp8rl.backends.openrlhf.plugin.spec import PluginSpec

    ckpt = tiny_checkpoint(out / "ckpt")
    flags = cell_flags(ckpt, out, world=world)
    args = openrlhf_args(flags)
    from openrlhf.utils import get_strategy

    spec = PluginSpec(clip_method="calibrated",
                      clip_options={"period": 1, "ema": 0.5, "init_bounds": [0.9, 1.1], "upper_rule": "proportional"},
                      eps_low=float(args.actor.eps_clip_low_high[0]), eps_high=float(args.actor.eps_clip_low_high[1]),
                      trainer_recipe=recipe, max_steps=2)
    start_ray(world, actor_env(spec))
    t0 = time.perf_counter()
    actors = policy_group(world)
    ray.get([a.init_model_from_pretrained.remote(get_strategy(args), str(ckpt), 4, None) for a in actors])
    t_init = time.perf_counter() - t0
    ray.get([a.__ray_call__.remote(instrument) for a in actors])
    statuses = []
    t0 = time.perf_counter()
    for step in range(2):
        exps = make_experiences(args, world, seed=step)
        old = ray.get([a.forward.remote(e.sequences, e.action_mask, e.attention_mask)
                       for a, e in zip(actors, exps, strict=True)])
        for e, lp in zip(exps, old, strict=True):
            e.action_log_probs = lp
            noise = torch.randn(lp.shape, generator=torch.Generator().manual_seed(100 + step)) * 0.05
            e.rollout_log_probs = (lp + noise) * e.action_mask
        ray.get([a.append.remote(e) for a, e in zip(actors, exps, strict=True)])
        statuses.append(ray.get([a.fit.remote(0.0) for a in actors]))
    t_fit = time.perf_counter() - t0
    recs = ray.get([a.__ray_call__.remote(records) for a in actors])
    saved = ray.get([a.__ray_call__.remote(controller) for a in actors])
    ray.get([a.save_checkpoint.remote("global_step2", {"global_step": 2}) for a in actors])
    for a in actors:
        ray.kill(a)
    args.ckpt.load_enable = True
    t0 = time.perf_counter()
    resumed_actors = policy_group(world)
    ray.get([a.init_model_from_pretrained.remote(get_strategy(args), str(ckpt), 4, None) for a in resumed_actors])
    resumed = ray.get([a.__ray_call__.remote(controller) for a in resumed_actors])
    states = ray.get([a.get_checkpoint_states.remote() for a in resumed_actors])
    t_resume = time.perf_counter() - t0
    report = ray.get(resumed_actors[0].__ray_call__.remote(model_report))
    return {"spec": spec.to_json(), "statuses": statuses, "records": recs, "saved": saved, "resumed": resumed,
            "checkpoint_states": states, "report": report, "flags": flags,
            "seconds": {"init": t_init, "fit_2_steps": t_fit, "resume": t_resume}}


def ppo_trainer_cap(out: Path, max_steps_values: list) -> dict:
    """The real ``PPOTrainer`` (a ``@ray.remote`` class Ray ships by value) in a worker of a job
    with our runtime env, fitted over a real prompt file with no vLLM engine: with the plugin's
    ``max_steps`` reached, ``fit`` must end without generating (the step cap in
    ``SamplesGenerator.generate_samples`` is reached through the by-value class); ``None`` is the
    control (it goes on to generate and fails without engines)."""
    import ray

    from fp8rl.backends.openrlhf.plugin.spec import PluginSpec

    ckpt = tiny_checkpoint(out / "ckpt")
    prompts = out / "train.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(16)))
    args = openrlhf_args([f for f in cell_flags(ckpt, out, world=1) if f != "--data.apply_chat_template"])
    args.data.prompt_dataset, args.logger.tensorboard_dir = str(prompts), None
    from openrlhf.trainer.ppo_trainer import PPOTrainer
    from openrlhf.utils import get_strategy

    res = {}
    for max_steps in max_steps_values:
        start_ray(1, actor_env(PluginSpec(max_steps=max_steps)))
        trainer = PPOTrainer.remote(str(ckpt), get_strategy(args), None, None, None, None, None, do_sample=True,
                                    max_len=64, max_new_tokens=16, temperature=1.0, top_p=1.0)
        try:
            ray.get(trainer.fit.remote())
            res[str(max_steps)] = {"ok": True}
        except Exception as e:
            res[str(max_steps)] = {"ok": False, "error": error_record(e)}
        res[str(max_steps)]["bound"] = ray.get(trainer.__ray_call__.remote(_bound_modules))
    return res


def _bound_modules(_trainer) -> dict:
    return {n: getattr(sys.modules.get(n), "_fp8rl_spec_json", None) is not None
            for n in ("openrlhf.trainer.ppo_trainer", "openrlhf.trainer.ppo_utils.samples_generator",
                      "openrlhf.trainer.ray.ppo_actor")}


def cli_parse(out: Path, lines: list) -> dict:
    """Each dry-run command line through OpenRLHF 0.11.2's own parser and validation block."""
    import shlex

    parsed, errors = [], []
    for line in lines:
        argv = shlex.split(line)
        flags = argv[argv.index("--") + 1:]
        try:
            args = openrlhf_args(flags)
        except BaseException as e:  # argparse exits with SystemExit
            errors.append({"line": line[:300], "error": repr(e)})
            continue
        parsed.append({"estimator": args.algo.advantage.estimator, "num_episodes": args.train.num_episodes,
                       "max_samples": args.data.max_samples, "max_new_tokens": args.rollout.max_new_tokens,
                       "overlong_buffer_len": args.reward.overlong_buffer_len,
                       "dynamic_filtering": args.algo.dynamic_filtering_enable,
                       "eps": list(args.actor.eps_clip_low_high)})
    return {"parsed": parsed, "errors": errors}


SCENARIOS = {"policy_recipes": policy_recipes, "ppo_train": ppo_train,
             "ppo_trainer_cap": ppo_trainer_cap, "cli_parse": cli_parse}


def main() -> int:
    name, out = sys.argv[1], Path(sys.argv[2])
    raw = sys.argv[3] if len(sys.argv) > 3 else "{}"
    params = json.loads(Path(raw[1:]).read_text() if raw.startswith("@") else raw)
    prepare_process()
    import torch

    out.mkdir(parents=True, exist_ok=True)
    try:
        result = SCENARIOS[name](out, **params)
    finally:
        if "ray" in sys.modules:
            import ray

            if ray.is_initialized():
                ray.shutdown()
    torch.save(result, out / "result.pt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
