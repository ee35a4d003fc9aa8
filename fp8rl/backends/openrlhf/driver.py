"""``python -m fp8rl.backends.openrlhf.driver --spec SPEC.json [--log FILE] -- <train_ppo_ray flags>``.

Runs on the head node of a cell's Ray cluster (``RAY_ADDRESS`` set by the bootstrap):

1. checks the installed OpenRLHF is 0.11.2 (loud failure otherwise);
2. ``ray.init`` with a runtime environment whose ``worker_process_setup_hook`` is
   ``fp8rl.backends.openrlhf.plugin.hook.install_from_env`` and whose env vars carry the plugin
   spec, plus the env vars OpenRLHF's own ``ray.init`` would set. The hook runs in every Ray
   worker of the job but only installs an import hook; the plugin binds in the processes that
   import OpenRLHF's trainer modules (the PPO actors), after Ray set their devices
   (``plugin.hook``);
3. in this process (``plugin.binding.install_driver``): makes the vLLM engines FP8, and makes
   the start-up wait for the policy actors and check, in each of them, that the plugin is bound
   with this spec and the FP8 conversion happened -- a cell whose plugin is not active fails
   here, before the first rollout; what the check read is kept in ``attestation.json`` beside
   the spec;
4. runs ``openrlhf.cli.train_ppo_ray`` in-process with ``runpy`` (its ``train()`` skips
   ``ray.init`` because Ray is up).

``--log`` redirects this process's stdout/stderr (and so the Ray actors' forwarded output,
including ``Global step N: {...}``) into FILE, which ``ingest`` reads.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

#: The Ray worker setup hook (``module.function``) that installs the plugin's import hook.
HOOK = "fp8rl.backends.openrlhf.plugin.hook.install_from_env"


def runtime_env(spec_json: str) -> dict:
    """The Ray runtime environment of the job (plugin hook + env vars; a CPU job's extra env vars)."""
    from fp8rl.backends.openrlhf.plugin.spec import SPEC_ENV, PluginSpec

    env = {
        SPEC_ENV: spec_json,
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
    }
    spec = PluginSpec.from_json(spec_json)
    if spec.dump_dir:  # the engines' sync log (binding.vllm_worker) beside the loss dumps
        from fp8rl.backends.openrlhf.plugin.binding.vllm_worker import SYNC_LOG_ENV
        from fp8rl.backends.openrlhf.reward_func import DRIVER_PID_ENV, SAMPLE_LOG_ENV

        env[SYNC_LOG_ENV] = os.path.join(spec.dump_dir, "engine_syncs.jsonl")
        env[SAMPLE_LOG_ENV] = os.path.join(spec.dump_dir, "samples.jsonl")
        env[DRIVER_PID_ENV] = str(os.getpid())  # which attempt graded a sample (a killed one's are aborted)
    if spec.device == "cpu":
        from fp8rl.backends.openrlhf.plugin.cpu_support import worker_env

        env.update(worker_env())
    return {"worker_process_setup_hook": HOOK, "env_vars": env}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m fp8rl.backends.openrlhf.driver --spec SPEC.json [--log FILE] -- FLAGS...")
    i = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m fp8rl.backends.openrlhf.driver")
    p.add_argument("--spec", required=True)
    p.add_argument("--log", default=None)
    args = p.parse_args(argv[:i])
    flags = argv[i + 1:]
    if args.log:
        fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        print(f"[fp8rl driver] logging to {args.log}", flush=True)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        print(f"[fp8rl driver] pid {os.getpid()}, spec {args.spec}", flush=True)
    import ray

    from fp8rl.backends.openrlhf.plugin.binding import install_driver
    from fp8rl.backends.openrlhf.plugin.spec import PluginSpec, check_version

    check_version()
    spec_json = open(args.spec, encoding="utf-8").read()
    if PluginSpec.from_json(spec_json).device == "cpu":
        from fp8rl.backends.openrlhf.plugin.cpu_support import import_standins

        import_standins()  # before OpenRLHF's modules are imported here
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), runtime_env=runtime_env(spec_json))
    install_driver(PluginSpec.from_json(spec_json),
                   record=os.path.join(os.path.dirname(os.path.abspath(args.spec)), "attestation.json"))
    sys.argv = ["train_ppo_ray", *flags]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
