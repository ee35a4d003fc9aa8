"""The layers hold: who may import whom (docs/design.md, "Layout"), read from the source.

- ``fp8rl.rl`` (pure RL maths) imports neither the launcher (``fp8rl.launch``) nor the entry points
  (``experiments``): what needs a composed config takes it as an argument
  (``fp8rl.rl.calibration.cost`` takes the configs ``experiments.calibration_cost`` composes);
- the backends never import the launcher: the launcher runs backends, and what both need lives
  in a neutral module (``fp8rl.procenv``; the Ray bootstrap lives with the backend that starts Ray);
- nothing in ``fp8rl`` or ``analysis`` imports ``experiments``; ``analysis`` imports no backend.

Lazy imports inside functions count (``tests/test_import_cycles.py``'s graph, every ``import``).
"""

from __future__ import annotations

import pytest
from test_import_cycles import import_graph

#: (importer prefix, forbidden prefixes, why)
RULES = [
    ("fp8rl.rl", ("fp8rl.launch", "experiments", "fp8rl.backends"), "the RL maths takes configs and tensors as arguments"),
    ("fp8rl.backends", ("fp8rl.launch", "experiments"), "the launcher runs backends, not the reverse"),
    ("fp8rl.quant", ("fp8rl.launch", "experiments", "fp8rl.backends"), "formats and recipes are below every backend"),
    ("fp8rl.runs", ("fp8rl.launch", "experiments", "fp8rl.backends", "fp8rl.rl", "fp8rl.quant"),
     "the run-directory format needs no torch"),
    ("fp8rl", ("experiments",), "nothing imports the entry points"),
    ("analysis", ("experiments", "fp8rl.backends", "fp8rl.launch"), "analysis reads run directories only"),
]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for importer, deps in sorted(graph.items()):
        for prefix, forbidden, why in RULES:
            if not _under(importer, prefix):
                continue
            for dep in sorted(deps):
                if any(_under(dep, f) for f in forbidden):
                    out.append(f"{importer} imports {dep} ({prefix} must not: {why})")
    return out


def test_every_layer_imports_only_what_it_may():
    assert violations(import_graph()) == []


@pytest.mark.parametrize("edge", [("fp8rl.rl.calibration.cost", "fp8rl.launch.grid"),
                                  ("fp8rl.backends.openrlhf.run", "fp8rl.launch.profiles"),
                                  ("fp8rl.backends.mini.__main__", "experiments.launch"),
                                  ("analysis.report", "fp8rl.backends.mini.run")])
def test_a_planted_reach_up_is_caught(edge):
    """The check itself: the edges this rule removed (and one it never allowed) are reported."""
    graph = import_graph()
    importer, dep = edge
    graph[importer] = {*graph[importer], dep}
    assert any(v.startswith(f"{importer} imports {dep} ") for v in violations(graph))
