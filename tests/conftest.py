"""Suite-wide: the default suite on every core (pytest-xdist), and what the workers share.

``make test`` runs ``pytest -n auto --dist loadgroup``: one worker process per core, each test its
own unit of work, except

- tests marked ``slurm`` (group ``slurm``): one worker runs them one after another, never two at
  once, as they ran before the suite was parallel. They share one small local cluster whose
  tests assume it is theirs alone (``test_impossible_request_is_rejected_at_submit`` asks for
  every CPU of the node and expects its job to start at once; the array tests expect their
  tasks to start together);
- tests that use a module-scoped fixture of their own module (group: the module): one worker
  runs the module, so the fixture (a reference run, a converted model, a collected sweep) is
  built once, as in a serial run.

Each worker runs torch on one thread (``OMP_NUM_THREADS=1``, inherited by the processes tests
start): with a worker per core, more threads only contend (measured: tests/rl/
test_calibration_unbiased.py and tests/mini/test_mini_qwen3.py took 2.5x the CPU time with two
threads per process on a loaded 2-core machine).

Session fixtures that are expensive and safe to share between processes live in one directory
for the whole run (:func:`shared_tmp_path`): the SFT warm-start cache (``fp8rl.backends.mini.sft``
locks each entry, so the first worker to need a warm start trains it and the others load it).

Without ``-n`` (``pytest tests/mini``, a single test) nothing changes: the groups are plain
markers and the shared directory is the session's temporary directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if _is_worker(config):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


def _own_module_fixture(item: pytest.Item) -> bool:
    """True when ``item`` uses a module-scoped fixture defined in its own module."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    module = item.module.__name__ if getattr(item, "module", None) else None
    for defs in info.name2fixturedefs.values():
        for d in defs:
            if d.scope == "module" and getattr(d.func, "__module__", None) == module:
                return True
    return False


def xdist_group(item: pytest.Item) -> str | None:
    """The group ``item`` is scheduled with under ``--dist loadgroup`` (None: a unit of its own)."""
    if item.get_closest_marker("slurm"):
        return "slurm"
    if _own_module_fixture(item):
        return item.nodeid.split("::", 1)[0]
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = xdist_group(item)
        if group and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def shared_tmp_path(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """A directory every worker of this test run sees (the session's own without ``-n``).

    Only for contents that are safe to build concurrently (an entry per key, written under a
    lock or atomically) and that no test changes after it is built."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if _is_worker(request.config) else base
    path = root / "shared"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def shared_sft_cache(shared_tmp_path: Path) -> Path:
    """The SFT warm-start cache of the whole run (``mini.cache_dir``): one training per key."""
    path = shared_tmp_path / "sft_cache"
    path.mkdir(exist_ok=True)
    return path
