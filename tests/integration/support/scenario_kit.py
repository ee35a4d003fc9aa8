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
REPO = SUPPORT.parents[2]
STANDINS = REPO / "fp8rl" / "backends" / "openrlhf" / "plugin" / "cpu_standins"  # flash-attn only
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
    ray.init(address="local", num_cpus=8, num_gpus=gpus, include_dashboard=False, object_store_memory=300 * 2**20,
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


#: Rendezvous ports handed to rank 0 of each group: below the kernel's ephemeral range (32768+),
#: above Ray's worker ports (10002-19999). Upstream's ``_get_free_port`` binds port 0 and releases
#: it; with several groups starting at once, another process can take that port before
#: ``init_process_group`` listens on it (EADDRINUSE, seen in CI). A port outside the ephemeral
#: range is never handed out by the kernel to anyone else in the meantime.
_PORTS = iter(range(25000 + 97 * (os.getpid() % 40), 30000))


def rendezvous_port() -> int:
    """The next port of :data:`_PORTS` that nothing listens on now."""
    import socket

    for port in _PORTS:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free rendezvous port left in 25000-29999")


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
    master = PolicyModelActor.options(**opts).remote(world, 0, None, rendezvous_port())
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
    """Record every call of the real loss (inputs, the BF16 shadow and measured rows the plan
    handed it, bounds used, outputs) and of the clip controller's calibrations -- the pooled
    update after a step (``update_step``) and a window's (``calibrate_window``: inputs, returned
    bounds) -- and the calibration mode the loss's controller was built with."""
    import torch

    loss = actor.trainer.actor_loss_fn
    rec = actor._fp8rl_test_rec = {"forward": [], "update": [], "update_batch": [],
                                   "mode": getattr(loss.clipper, "mode", None)}

    def pre(module, args, kwargs):
        p = module.pending
        shadow = None if p is None or p.shadow is None else p.shadow
        rec["forward"].append({"shadow": None if shadow is None else shadow.detach().clone(),
                               "rows_measured": None if p is None else p.measured.clone(),
                               "rows_holdout": None if p is None else p.holdout.clone(),
                               "step": module.step, "n_update_batch": len(rec["update_batch"]),
                               "measured": module.sink is not None and p is not None and bool(p.measured.any())})

    def post(module, args, kwargs, out):
        lp, old, adv = args[:3]
        roll = kwargs.get("rollout_log_probs")
        w = module.window
        rec["forward"][-1].update(
            lp=lp.detach().float().clone(), old=old.detach().float().clone(), adv=adv.detach().float().clone(),
            mask=kwargs["action_mask"].detach().clone(), roll=None if roll is None else roll.detach().float().clone(),
            bounds=(w.bounds() if w is not None else module.clipper.bounds(module.step)).as_tuple(),
            clip_ratio=float(out[1]), loss=float(out[0]))

    loss.register_forward_pre_hook(pre, with_kwargs=True)
    loss.register_forward_hook(post, with_kwargs=True)
    ctl = loss.clipper
    if not hasattr(ctl, "update_step"):  # vanilla: nothing calibrates
        return
    orig_step, orig_window = ctl.update_step, ctl.calibrate_window

    def update_step(step, parts):
        bounds = orig_step(step, parts)
        rec["update"].append({"step": step, "bounds": bounds.as_tuple(),
                              "ratio": torch.cat([p[0] for p in parts]).clone(),
                              "shadow_ratio": torch.cat([p[1] for p in parts]).clone(),
                              "advantages": torch.cat([p[2] for p in parts]).clone()})
        return bounds

    def calibrate_window(step, tokens, **kw):
        bounds = orig_window(step, tokens, **kw)
        rec["update_batch"].append({"step": step, "bounds": bounds.as_tuple(), "ratio": tokens[0].clone(),
                                    "shadow_ratio": None if tokens[1] is None else tokens[1].clone(),
                                    "advantages": tokens[2].clone(),
                                    "seq": None if kw.get("seq") is None else kw["seq"].clone()})
        return bounds

    ctl.update_step, ctl.calibrate_window = update_step, calibrate_window


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


# ------------------------------------------------------------------------------------------
# episode ends and resumes (test_int_episode_end): a scripted rollout engine, per-rank records
# ------------------------------------------------------------------------------------------

#: The scripted reward (written next to the prompts): a group labelled ``keep`` scores 0, 1, 0, 1,
#: ... (its mean lies inside DAPO's ``(0, 1)``: kept), a ``drop`` group scores 0 throughout
#: (filtered). The engine ends the k-th response of a group in ``y`` for odd k, else ``n``.
SCRIPTED_REWARD = '''
def reward_func(queries, prompts, labels):
    r = [1.0 if label == "keep" and q.rstrip().endswith("y") else 0.0 for q, label in zip(queries, labels)]
    v = r[0] if len(r) == 1 else r
    return {"rewards": v, "scores": v, "extra_logs": {}}
'''


def scripted_engine(reward_file: str, n_samples: int):
    """A rollout engine for ``SamplesGenerator`` with vLLM stood in. What ``SamplesGenerator`` calls
    on an engine, as OpenRLHF 0.11.2's ``RolloutRayActor`` does it: ``generate_responses`` gathers
    ``num_samples`` runs of OpenRLHF's own ``SingleTurnAgentExecutor.execute`` (prompt
    tokenization, the response record, rollout log-prob alignment, the reward function loaded by
    path), as ``vllm_engine.py:183-206``; ``get_num_unfinished_requests`` is 0. vLLM's part, the
    ``generate`` the executor awaits, returns a scripted ``RequestOutput``-shaped answer: 3-10
    letters fixed by the prompt and the sample's index in its group, log-prob -1 per token
    (without importing vLLM in this actor). A synchronous actor (each request's executors run
    under ``asyncio.run``): Ray runs one caller's tasks in submission order, so requests complete
    in dispatch order (an async actor may start them out of order). Which rank a kept group
    reaches still follows the order ``SamplesGenerator`` collects finished requests in
    (``ray.wait(..., num_returns=1)``, any ready one), as with vLLM: not an RNG, not reproducible."""
    import asyncio
    import types
    import zlib

    import ray

    letters = [VOCAB.index(c) for c in "abcdefghijklmnopqrstuvwx"]
    yes, no = VOCAB.index("y"), VOCAB.index("n")

    class ScriptedVllm:  # what the executor awaits of its ``llm_engine``
        def __init__(self):
            self.calls: dict = {}

        async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
            key = tuple(prompt_token_ids)
            k = self.calls.get(key, 0) % n_samples
            self.calls[key] = self.calls.get(key, 0) + 1
            h = zlib.crc32(bytes(str((key, k)), "ascii"))
            body = [letters[(h >> (3 * i)) % len(letters)] for i in range(2 + h % 8)]
            tokens = [*body, yes if k % 2 else no]
            logprobs = [{t: types.SimpleNamespace(logprob=-1.0)} for t in tokens] if sampling_params.logprobs else None
            out = types.SimpleNamespace(token_ids=tokens, finish_reason="stop", logprobs=logprobs)
            return types.SimpleNamespace(outputs=[out])

    class ScriptedEngine:  # no async method: a synchronous Ray actor
        def __init__(self):
            from openrlhf.utils.agent import SingleTurnAgentExecutor

            self.executor, self.vllm = SingleTurnAgentExecutor(reward_file), ScriptedVllm()
            self.log: list[str] = []

        def get_num_unfinished_requests(self) -> int:
            return 0

        def requests(self) -> list[str]:
            """The prompts of every ``generate_responses`` so far, in the order they ran."""
            return list(self.log)

        def generate_responses(self, prompt, label, sampling_params, max_length, hf_tokenizer,
                               num_samples=1, images=None):
            self.log.append(prompt)
            async def gather():
                return await asyncio.gather(*[
                    self.executor.execute(prompt=prompt, label=label, sampling_params=sampling_params,
                                          max_length=max_length, hf_tokenizer=hf_tokenizer, llm_engine=self.vllm,
                                          images=images) for _ in range(num_samples)])

            return asyncio.run(gather())

    return ray.remote(ScriptedEngine).options(num_cpus=0).remote()


def skip_weight_sync(trainer) -> None:
    """``PPOTrainer.broadcast_to_vllm`` (after every step, and when a resumed ``fit`` starts) does
    nothing: the scripted engine has no weights. Without a rollout engine (``vllm_engines=None``)
    the sampler could not generate; with one, the sync needs NCCL (OpenRLHF's
    ``stateless_init_process_group`` is PyNccl-only)."""
    trainer.broadcast_to_vllm = lambda: None


def dropped_tails(_trainer) -> list:
    """The episode tails the plugin dropped in this trainer process (empty without the plugin)."""
    mod = sys.modules.get("fp8rl.backends.openrlhf.plugin.binding.trainer")
    return list(mod.DROPPED_TAILS) if mod is not None else []


def sample_id(sequence, attention_mask) -> int:
    """A sample's identity across runs: CRC-32 of its unpadded tokens."""
    import zlib

    import torch

    return zlib.crc32(sequence[attention_mask.bool()].to(torch.int64).numpy().tobytes())


def record_micro_batches(actor, path: str) -> None:
    """Record, as JSON lines appended to ``path`` (readable while the actor is stuck), every
    ``ppo_train`` of this rank (``fit_start``: the replay buffer's samples, in buffer order, and
    the micro-batches its loader yields; ``fit_end``) and every micro-batch it trained
    (``micro``: its samples, in order). Instance wrappers around the bound methods: the code
    under test runs unchanged."""
    import json

    import torch.distributed as dist

    trainer, rank, fit = actor.trainer, dist.get_rank(), {"n": 0}
    inner_ppo_train, inner_training_step = trainer.ppo_train, trainer.training_step

    def write(rec: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps({"rank": rank, **rec}) + "\n")

    def ppo_train(kl_ctl):
        fit["n"] += 1
        buf = trainer.replay_buffer
        write({"event": "fit_start", "fit": fit["n"], "buffer": [sample_id(i.sequences, i.attention_mask)
                                                                  for i in buf.items],
               "planned": len(buf) // buf.sample_batch_size})
        status = inner_ppo_train(kl_ctl)
        write({"event": "fit_end", "fit": fit["n"]})
        return status

    def training_step(experience, kl_ctl, step, loss_batch_info=None):
        ids = [sample_id(s, m) for s, m in zip(experience.sequences, experience.attention_mask, strict=True)]
        out = inner_training_step(experience, kl_ctl, step, loss_batch_info)
        write({"event": "micro", "fit": fit["n"], "step": step, "ids": ids})
        return out

    trainer.ppo_train, trainer.training_step = ppo_train, training_step


def read_records(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_or_hang(ref, records: Path, *, deadline_s: float, grace_s: float, poll_s: float = 1.0) -> dict:
    """Wait for ``ref`` (``PPOTrainer.fit``) with a bound: ``finished``, ``error``, ``timeout``
    (past ``deadline_s``), or ``hung``: a rank is inside a ``ppo_train`` and no rank has recorded
    anything for ``grace_s`` (a micro-batch of the tiny model takes about a second; a rank left
    alone in a collective waits out the 60-minute process-group timeout). ``open``: the
    ``[rank, fit]`` inside a ``ppo_train`` when it was declared hung."""
    import time

    import ray

    t0 = last_change = time.perf_counter()
    seen = -1
    while True:
        done, _ = ray.wait([ref], timeout=poll_s)
        now = time.perf_counter()
        if done:
            try:
                ray.get(ref)
                return {"outcome": "finished", "seconds": now - t0}
            except Exception as e:
                return {"outcome": "error", "seconds": now - t0, "error": error_record(e)}
        recs = read_records(records)
        if len(recs) != seen:
            seen, last_change = len(recs), now
        open_fits = {(r["rank"], r["fit"]) for r in recs if r["event"] == "fit_start"} - {
            (r["rank"], r["fit"]) for r in recs if r["event"] == "fit_end"}
        if open_fits and now - last_change > grace_s:
            return {"outcome": "hung", "seconds": now - t0, "stalled_s": now - last_change,
                    "open": sorted(list(k) for k in open_fits)}
        if now - t0 > deadline_s:
            return {"outcome": "timeout", "seconds": now - t0}
