"""``python -m fp8rl.backends.mini [--config file.yaml] [key=value ...]``: one mini run.

Overrides are dotted ``key=value`` pairs on the structured config ``MiniRunConfig`` (as Hydra
writes them), applied after the optional YAML file, e.g.::

    python -m fp8rl.backends.mini fp8.name=tensorwise fp8.rollout_recipe=tensorwise \\
        fp8.trainer_recipe=tensorwise clip.arm=calibrated seed=1 output_dir=runs/mini

Unknown keys and badly typed values raise (OmegaConf), bad values raise from the config's
validation. ``--print-config`` prints the resolved config and exits. A progress bar shows the
step, the rollout reward and the policy entropy; the summary is printed as JSON at the end.
Ctrl-C stops the run after its current step with a checkpoint (PREEMPTED; a second Ctrl-C stops
at once) and prints the command that resumes it, exit status 130, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from fp8rl.backends.mini.config import MiniRunConfig


def parse_config(argv: list[str]) -> tuple[MiniRunConfig, list[str], argparse.Namespace]:
    """``(config, overrides, args)`` from command-line arguments."""
    from omegaconf import OmegaConf

    p = argparse.ArgumentParser(prog="python -m fp8rl.backends.mini", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML file with (part of) the config")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = p.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        p.error(f"overrides must look like key=value, got {bad}")
    schema = OmegaConf.structured(MiniRunConfig)
    parts = [schema]
    if args.config:
        parts.append(OmegaConf.load(args.config))
    parts.append(OmegaConf.from_dotlist(args.overrides))
    merged = OmegaConf.merge(*parts)
    cfg = OmegaConf.to_object(merged)  # builds the dataclasses: __post_init__ validates
    assert isinstance(cfg, MiniRunConfig)
    return cfg, list(args.overrides), args


def main(argv: list[str] | None = None) -> int:
    cfg, overrides, args = parse_config(sys.argv[1:] if argv is None else argv)
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        return 0
    from fp8rl.backends.mini.run import run_mini

    with _stop_on_ctrl_c():
        try:
            summary = run_mini(cfg, overrides, progress=not args.no_progress)
        except KeyboardInterrupt as e:  # stopped (first Ctrl-C: at a checkpoint) or at once (second)
            import shlex

            from fp8rl.procenv import python_command

            how = str(e) if str(e) else "interrupted at once; it resumes from its last checkpoint"
            print(f"stopped (Ctrl-C): {how}", file=sys.stderr)
            print("resume with: " + shlex.join([python_command(), "-m", "fp8rl.backends.mini",
                                                *(sys.argv[1:] if argv is None else argv)]), file=sys.stderr)
            return 130
    print(json.dumps(summary, indent=1, default=str))
    return 0 if summary.get("state") in ("DONE", None) else 1


class _stop_on_ctrl_c:
    """First Ctrl-C: a stop request (the run checkpoints its last step and stops, PREEMPTED);
    second: ``KeyboardInterrupt`` at once. Either way one message and exit 130, no traceback."""

    def __enter__(self):
        import signal

        from fp8rl.runs import stop

        stop.clear()
        self.count = 0

        def handle(signum, frame):
            self.count += 1
            if self.count > 1:
                raise KeyboardInterrupt
            stop.request_stop()
            print("\nstopping (Ctrl-C): the run stops after its current step and keeps a checkpoint. "
                  "Ctrl-C again to stop at once", file=sys.stderr, flush=True)

        self.old = signal.signal(signal.SIGINT, handle)
        return self

    def __exit__(self, *exc):
        import signal

        from fp8rl.runs import stop

        signal.signal(signal.SIGINT, self.old)
        stop.clear()


if __name__ == "__main__":
    raise SystemExit(main())
