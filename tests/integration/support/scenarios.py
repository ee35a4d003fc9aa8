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

import json
import sys
import time
from pathlib import Path

from scenario_kit import (
    Probe,
    actor_env,
    bound_modules,
    cell_flags,
    controller,
    error_record,
    instrument,
    model_report,
    openrlhf_args,
    policy_group,
    prepare_process,
    records,
    start_ray,
    tiny_checkpoint,
)


def policy_recipes(out: Path, recipes: list, world: int = 1, concurrent: int = 4) -> dict:
    """For each ``[recipe, impl, emulate]``: the real PolicyModelActor builds its model (or fails).

    One job with the driver's runtime env; each recipe's actors carry their own spec (actor-level
    ``env_vars``: same setup hook, another spec), ``concurrent`` recipes at a time. In the same job,
    alongside: a ``Probe`` actor, which never imports OpenRLHF (as a vLLM engine actor), reports
    what the setup hook left in it; and the real ``PPOTrainer`` (a ``@ray.remote`` class Ray ships
    by value) is fitted over a real prompt file with no vLLM engine and the plugin's ``max_steps``
    already reached: ``fit`` must end without generating (the step limit in
    ``SamplesGenerator.generate_samples`` is reached through the by-value class; without it,
    ``fit`` goes on to generate through vLLM's stand-in, which raises)."""
    import ray

    from fp8rl.backends.openrlhf.plugin.spec import SPEC_ENV, PluginSpec

    ckpt = tiny_checkpoint(out / "ckpt")
    args = openrlhf_args(cell_flags(ckpt, out, world=world))
    prompts = out / "train.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(16)))
    cap_args = openrlhf_args([f for f in cell_flags(ckpt, out, world=1) if f != "--data.apply_chat_template"])
    cap_args.data.prompt_dataset, cap_args.logger.tensorboard_dir = str(prompts), None
    from openrlhf.trainer.ppo_trainer import PPOTrainer
    from openrlhf.utils import get_strategy

    start_ray(concurrent * world + 1, actor_env(PluginSpec()))
    probe = ray.remote(num_gpus=1)(Probe).remote()
    cap = PPOTrainer.options(runtime_env={"env_vars": {SPEC_ENV: PluginSpec(max_steps=0).to_json()}}).remote(
        str(ckpt), get_strategy(cap_args), None, None, None, None, None, do_sample=True, max_len=64,
        max_new_tokens=16, temperature=1.0, top_p=1.0)
    cap_fit = cap.fit.remote()
    res = {"probe": ray.get(probe.loaded.remote())}
    ray.kill(probe)
    specs = {}
    for recipe, impl, emulate in recipes:
        key = f"{recipe}/{impl}/{'emulate' if emulate else 'native'}"
        specs[key] = PluginSpec(clip_method="calibrated", clip_options={"mode": "periodic", "period": 1}, eps_low=0.2, eps_high=0.2,
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
    try:
        ray.get(cap_fit)
        res["cap"] = {"ok": True}
    except Exception as e:
        res["cap"] = {"ok": False, "error": error_record(e)}
    res["cap"]["bound"] = ray.get(cap.__ray_call__.remote(bound_modules))
    return res


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


#: The controller options of each calibration mode in the ``ppo_train`` scenario (``periodic``:
#: every step, smoothed, so that step 1 runs on step 0's bounds; the others: their defaults).
MODE_OPTIONS = {"periodic": {"period": 1, "ema": 0.5}, "pooled": {}, "same_batch": {}}


def ppo_train(out: Path, recipe: str = "tensorwise", world: int = 2, mode: str = "periodic",
              checkpoint: bool = True, holdout_share: float = 0.0) -> dict:
    """Two gloo ranks: the real ``ppo_train`` with calibrated clipping in calibration ``mode``, and
    (``checkpoint``) a checkpoint through the real save path and a fresh pair of actors resuming
    from it. The first pair is created as ``train_ppo_ray`` creates it (``RayActorGroup``), after
    the fp8rl driver's ``install_driver``: its start-up attestation runs for real; a driver with
    another spec must refuse the actors. ``holdout_share``: the spec's held-out rows (issue 46)."""
    import ray
    import torch

    from fp8rl.backends.openrlhf.plugin.binding import install_driver
    from fp8rl.backends.openrlhf.plugin.binding.driver import attest, check_attestations
    from fp8rl.backends.openrlhf.plugin.spec import PluginSpec

    ckpt = tiny_checkpoint(out / "ckpt")
    flags = cell_flags(ckpt, out, world=world)
    args = openrlhf_args(flags)
    from openrlhf.utils import get_strategy

    spec = PluginSpec(clip_method="calibrated",
                      clip_options={"mode": mode, **MODE_OPTIONS[mode], "init_bounds": [0.9, 1.1],
                                    "upper_rule": "proportional"},
                      eps_low=float(args.actor.eps_clip_low_high[0]), eps_high=float(args.actor.eps_clip_low_high[1]),
                      trainer_recipe=recipe, max_steps=2, holdout_share=holdout_share)
    start_ray(2 * world, actor_env(spec))  # the group's placement group keeps its GPUs after the kill
    install_driver(spec)
    from openrlhf.trainer.ray.launcher import RayActorGroup
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    t0 = time.perf_counter()
    group = RayActorGroup(1, world, PolicyModelActor, pg=None, num_gpus_per_actor=1)
    ray.get(group.async_init_model_from_pretrained(get_strategy(args), str(ckpt), 4, None))  # attests inside
    actors = group._actor_handlers
    t_init = time.perf_counter() - t0
    reports = ray.get([a.__ray_call__.remote(attest) for a in actors])
    refusals = {}
    for name, other in {"bf16_trainer": PluginSpec(**{**json.loads(spec.to_json()), "trainer_recipe": "bf16"}),
                        "other_clip": PluginSpec(eps_low=spec.eps_low, eps_high=spec.eps_high,
                                                 trainer_recipe=recipe)}.items():
        try:
            check_attestations(other, reports)
            refusals[name] = None
        except Exception as e:
            refusals[name] = {"type": type(e).__name__, "message": str(e)}
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
    result = {"spec": spec.to_json(), "statuses": statuses, "refusals": refusals, "records": recs, "saved": saved,
              "flags": flags, "seconds": {"init": t_init, "fit_2_steps": t_fit}}
    if not checkpoint:
        return result
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
    result["seconds"]["resume"] = t_resume
    return {**result, "resumed": resumed, "checkpoint_states": states, "report": report}


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


#: The episode of ``episode_end_*``: 11 prompts whose groups DAPO's filter keeps, 2 it drops. With
#: 4 prompts x 4 samples a step, each episode trains 2 full steps (8 groups, 8 or 9 prompts drawn
#: and refilled) and ends with the prompts exhausted after 3 more kept groups: the partial batch.
EPISODE_LABELS = ["keep"] * 11 + ["drop"] * 2


def _dapo_cell(out: Path, ckpt: Path, ckpt_dir: Path, episodes: int):
    """The DAPO main-table cell's arguments (dynamic filtering on), shrunk to 2 CPU ranks:
    4 prompts x 4 samples a step, 2 optimizer steps of 2 micro-batches of 2 samples per rank;
    rollout micro-batches of one prompt group (as the paper's 8 x 8); a checkpoint every step."""
    prompts = out / "train.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": lab}) + "\n"
                               for i, lab in enumerate(EPISODE_LABELS)))
    reward = out / "scripted_reward.py"
    from scenario_kit import SCRIPTED_REWARD

    reward.write_text(SCRIPTED_REWARD)
    flags = [f for f in cell_flags(ckpt, ckpt_dir, world=2, algorithm="dapo") if f != "--data.apply_chat_template"]
    flags += ["--rollout.micro_batch_size", "4", "--train.num_episodes", str(episodes),
              "--data.max_samples", str(len(EPISODE_LABELS)), "--ckpt.save_steps", "1", "--ckpt.max_num", "10"]
    args = openrlhf_args(flags)
    args.data.prompt_dataset, args.reward.remote_url, args.logger.tensorboard_dir = str(prompts), str(reward), None
    assert args.algo.dynamic_filtering_enable and args.rollout.n_samples_per_prompt == 4
    return args, str(reward)


def _own_ray(gpus: int, runtime_env: dict) -> None:
    """``start_ray`` in a Ray of this scenario's own even where a Ray is already running on the
    machine (``ray.init`` would join it, and refuse the resources)."""
    import os

    os.environ["RAY_ADDRESS"] = "local"
    start_ray(gpus, runtime_env)


def _dapo_run(out: Path, name: str, args, ckpt: Path, engine, spec=None, *, deadline_s: float = 420,
              grace_s: float = 60) -> dict:
    """One ``train_ppo_ray``-shaped run: the real ``PPOTrainer`` actor (by value, as OpenRLHF ships
    it), the real ``RayActorGroup`` of two ``PolicyModelActor`` ranks (ZeRO-3, gloo) and its
    ``fit`` over the prompt file, generating through ``engine`` (``scripted_engine``); bounded by
    ``wait_or_hang``. ``spec``: the trainer's plugin spec when it differs from the job's."""
    import ray
    from openrlhf.trainer.ppo_trainer import PPOTrainer
    from openrlhf.trainer.ray.launcher import RayActorGroup
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
    from openrlhf.utils import get_strategy
    from ray.util.placement_group import placement_group, remove_placement_group
    from scenario_kit import (
        dropped_tails,
        read_records,
        record_micro_batches,
        skip_weight_sync,
        wait_or_hang,
    )

    from fp8rl.backends.openrlhf.plugin.spec import SPEC_ENV

    records = out / f"{name}.records.jsonl"
    before = len(ray.get(engine.requests.remote()))
    t0 = time.perf_counter()
    pg = placement_group([{"GPU": 1, "CPU": 1}] * 2, strategy="PACK")
    ray.get(pg.ready())
    group = RayActorGroup(1, 2, PolicyModelActor, pg=pg, num_gpus_per_actor=1)
    opts = {"runtime_env": {"env_vars": {SPEC_ENV: spec.to_json()}}} if spec is not None else {}
    trainer = PPOTrainer.options(**opts).remote(
        str(ckpt), get_strategy(args), group, None, None, None, [engine], do_sample=True, max_len=64,
        max_new_tokens=16, temperature=1.0, top_p=1.0)
    ray.get(trainer.__ray_call__.remote(skip_weight_sync))
    max_steps = ray.get(trainer.get_max_steps.remote())
    ray.get(group.async_init_model_from_pretrained(get_strategy(args), str(ckpt), max_steps, None))
    ray.get([a.__ray_call__.remote(record_micro_batches, str(records)) for a in group._actor_handlers])
    t_init = time.perf_counter() - t0
    res = wait_or_hang(trainer.fit.remote(), records, deadline_s=deadline_s, grace_s=grace_s)
    res.update(init_s=t_init, records=read_records(records), requests=ray.get(engine.requests.remote())[before:])
    if res["outcome"] == "finished":
        res["dropped"] = ray.get(trainer.__ray_call__.remote(dropped_tails))
    for a in [trainer, *group._actor_handlers]:
        ray.kill(a)
    remove_placement_group(pg)
    return res


def episode_end_upstream(out: Path) -> dict:
    """OpenRLHF 0.11.2 alone (the plugin installed nowhere: the job's setup hook stops at the CPU
    stand-ins): a DAPO cell's run over one episode, on two ranks, up to the episode's end."""
    from scenario_kit import scripted_engine

    from fp8rl.backends.openrlhf.plugin.spec import PluginSpec

    ckpt = tiny_checkpoint(out / "ckpt")
    args, reward = _dapo_cell(out, ckpt, out / "run", episodes=1)
    env = actor_env(PluginSpec())
    env["env_vars"]["FP8RL_TEST_HOOK"] = "cpu_cuda.apply"  # the driver's hook replaced: no plugin
    _own_ray(2, env)
    engine = scripted_engine(reward, args.rollout.n_samples_per_prompt)
    return {"upstream": _dapo_run(out, "upstream", args, ckpt, engine)}


def episode_end_resume(out: Path) -> dict:
    """The same cell with the plugin (FP8 tensorwise, calibrated clipping), two episodes, a
    checkpoint every step: an uninterrupted run; then a fresh run (``--ckpt.load_enable``, as a
    requeued job) resuming from the checkpoint directory as a job killed during step 2 leaves it:
    the uninterrupted run's ``global_step1`` tag, ``latest`` naming it. (A separate run stopped
    after step 1 would not do as the reference: nothing seeds the PPO trainer process, so each
    fresh run draws its own prompt order; a resume continues the one in its checkpoint.)"""
    import shutil

    from scenario_kit import scripted_engine

    from fp8rl.backends.openrlhf.plugin.spec import PluginSpec

    ckpt = tiny_checkpoint(out / "ckpt")
    args, reward = _dapo_cell(out, ckpt, out / "full", episodes=2)
    spec = PluginSpec(clip_method="calibrated", clip_options={"mode": "periodic", "period": 1},
                      eps_low=float(args.actor.eps_clip_low_high[0]), eps_high=float(args.actor.eps_clip_low_high[1]),
                      trainer_recipe="tensorwise")
    _own_ray(2, actor_env(spec))
    engine = scripted_engine(reward, args.rollout.n_samples_per_prompt)
    res = {"full": _dapo_run(out, "full", args, ckpt, engine)}
    if res["full"]["outcome"] != "finished":
        return res
    saved, requeued = Path(args.ckpt.path) / "_actor", out / "requeued" / "ds" / "_actor"
    shutil.copytree(saved / "global_step1", requeued / "global_step1")
    (requeued / "latest").write_text("global_step1")
    args.ckpt.path = str(requeued.parent)
    res["resumed"] = _dapo_run(out, "resumed", args, ckpt, engine)
    return res


SCENARIOS = {"policy_recipes": policy_recipes, "ppo_train": ppo_train,
             "cli_parse": cli_parse, "episode_end_upstream": episode_end_upstream,
             "episode_end_resume": episode_end_resume}


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
