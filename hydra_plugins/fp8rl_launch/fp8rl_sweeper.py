"""``hydra/sweeper: fp8rl``: the sweeper of ``python -m experiments.launch``.

A thin Hydra ``Sweeper``: it hands the composed config, Hydra's config loader, the grid
(``params``) and the command-line overrides to ``fp8rl.launch.sweep.run_sweep``, which expands
the grid like Hydra's basic sweeper, validates every cell, then dry-runs or launches them with
fp8rl's own launchers (``fp8rl.launch.launchers``). Hydra's configured launcher is not used.
This module stays import-light: Hydra imports every plugin module at start-up.
"""

from __future__ import annotations

from typing import Any

from hydra.plugins.sweeper import Sweeper


class Fp8rlSweeper(Sweeper):
    """Validate the whole grid, then run or submit it (see ``fp8rl.launch.sweep``)."""

    def __init__(self, params: dict[str, str] | None = None) -> None:
        self.params = dict(params or {})
        self.config: Any = None
        self.hydra_context: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.hydra_context = hydra_context
        self.config = config

    def sweep(self, arguments: list[str]) -> Any:
        from fp8rl.launch.sweep import run_sweep

        status = run_sweep(self.config, self.hydra_context.config_loader, self.params, list(arguments))
        if status:
            raise SystemExit(status)
        return []
