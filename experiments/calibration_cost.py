"""The calibration modes' cost at paper scale, on the configs the paper-scale dry run composes.

    python -m experiments.calibration_cost

prints the tables of ``docs/benchmarks.md`` ("Calibration cost at paper scale"): the arithmetic is
``fp8rl.rl.calibration.cost``; this entry point composes the paper-scale configs through the
launcher (``plan_sweep``) and hands them to it, so the library of RL maths imports no launcher.
"""

from __future__ import annotations

import functools

from fp8rl.rl.calibration.cost import (
    PAPER_CELLS,
    cost_table,
    markdown,
    paper_shapes,
    sensitivity_table,
)

__all__ = ["main", "paper_configs", "tables"]


@functools.lru_cache(maxsize=1)
def paper_configs() -> dict[tuple[str, str], object]:
    """``{(algorithm, slot): OpenRLHFRunConfig}`` of :data:`PAPER_CELLS`' calibrated tensorwise cells,
    as ``python -m experiments.launch scale=paper cluster=example dry_run=true`` composes and
    validates them (``fp8rl.launch.grid.plan_sweep``; cached: do not modify them)."""
    import tempfile

    from fp8rl.launch.grid import plan_command
    from fp8rl.launch.job import build_config

    with tempfile.TemporaryDirectory() as tmp:
        plan = plan_command(["scale=paper", "cluster=example", "fp8=tensorwise", "clip=calibrated", "dry_run=true",
                             f"algorithm={','.join(sorted(set(PAPER_CELLS.values())))}",
                             f"model={','.join(PAPER_CELLS)}", f"output_dir={tmp}"])
        return {(c.axes["algorithm"], c.axes["model"]): build_config(c.payload()) for c in plan.cells}


def tables() -> str:
    """The markdown tables docs/benchmarks.md shows."""
    configs = paper_configs()
    return markdown(cost_table(paper_shapes(configs)), sensitivity_table(configs))


def main() -> None:
    print(tables())


if __name__ == "__main__":
    main()
