"""Fixtures of the analysis tests: the known sweep of ``analysis_known`` and its collection."""

import pytest
from analysis_known import write_known_sweep


@pytest.fixture(scope="session")
def known_sweep(tmp_path_factory):
    return write_known_sweep(tmp_path_factory.mktemp("sweeps") / "known")


@pytest.fixture(scope="session")
def known_coll(known_sweep):
    from analysis.collect import collect

    return collect(known_sweep, workers=1, progress=False)
