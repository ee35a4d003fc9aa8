"""``python -m experiments.launch [+sweep=NAME] [key=value ...]``: run or submit a sweep.

With no overrides: one mini run (GRPO, model slot 8b, BF16, vanilla clip, seed 0) on this
machine. ``+sweep=main_table`` (or ``entropy_granularity``, ``calibration_ablation``,
``quick``, ``smoke``) runs a paper artefact's grid; ``seeds=3`` adds a seed axis;
``dry_run=true`` prints every cell and runs nothing; ``launcher=slurm cluster=NAME`` submits
the grid as a Slurm array and returns. The config tree is ``sweeps/`` and docs/launch.md
describes everything. ``--help`` lists the sweeps, scales, cluster profiles, groups and main
keys (``fp8rl.launch.cli_help``); Hydra's own options are under ``--hydra-help``.

Before Hydra composes anything, every override's key or config group is checked against the
schema (``fp8rl.launch.keys``): ``+stepz=3``, ``clip.epslow=0.1`` or ``hydra/launcher=...``
stop with one message naming the key and the nearest valid ones, exit status 2. A config file the
command line selects that is not valid YAML (a sweep file with a typo) stops with one line naming
the file, line and column, exit status 2 (``fp8rl.launch.yamlcheck``). A value Hydra would refuse
while composing (``fp8=fp9``: no such option of a config group; ``steps=abc``: the wrong type) stops
with one line naming the override, the valid options or type and an example, exit status 1
as for any bad value (``fp8rl.launch.values``); a sweep's invalid cells are listed one line each, without Hydra's
``HYDRA_FULL_ERROR`` hint.

The config always runs in Hydra's multirun mode (``hydra.mode: MULTIRUN`` in
``sweeps/config.yaml``): the ``fp8rl`` sweeper expands and validates the whole grid and
launches it (``fp8rl.launch.sweep``). The task function below is what Hydra would call for a
single job; it is used only if someone forces ``hydra.mode=RUN``, and then it runs the one
composed config through the same planning and launching code.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from fp8rl.launch.schema import register_configs

register_configs()

#: The config tree (absolute, so the app also works when imported, e.g. from tests).
CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "sweeps")


def main() -> None:
    """The command line: ``--help``, the key check, then Hydra (``_hydra_main``)."""
    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:
        from fp8rl.launch.cli_help import launch_help

        print(launch_help())
        raise SystemExit(0)
    from fp8rl.launch.keys import cli_groups, cli_overrides, override_key_errors

    errors = override_key_errors(cli_overrides(argv), cli_groups(argv))
    if errors:
        print("Error: unknown key(s) or config group(s); nothing was run, submitted or written:\n  "
              + "\n  ".join(errors), file=sys.stderr)
        raise SystemExit(2)
    from fp8rl.launch.yamlcheck import yaml_errors

    for line in yaml_errors(argv):  # before Hydra, whose answer is a 100-line traceback
        print(f"Error: {line}; nothing was run, submitted or written", file=sys.stderr)
        raise SystemExit(2)
    from fp8rl.launch.values import config_dirs, override_value_errors

    errors = override_value_errors(cli_overrides(argv), config_dirs(argv))
    if errors:  # before Hydra, whose answer names its config search path and HYDRA_FULL_ERROR
        print("Error: bad value(s); nothing was run, submitted or written:\n  " + "\n  ".join(errors),
              file=sys.stderr)
        raise SystemExit(1)  # as a bad value the sweep's validation refuses
    _hydra_main()


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    """``hydra.mode=RUN``: plan and launch the composed config as a one-cell sweep."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from fp8rl.launch.sweep import run_sweep

    del cfg  # recomposed with its hydra node, as the sweeper gets it
    hc = HydraConfig.get()
    loader = GlobalHydra.instance().config_loader()
    overrides = list(hc.overrides.task)
    master = loader.load_configuration(hc.job.config_name, overrides=overrides, run_mode=RunMode.MULTIRUN)
    status = run_sweep(master, loader, dict(master.hydra.sweeper.params), overrides)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    main()
