"""Fixtures of the OpenRLHF backend tests (helpers live in ``orl_helpers``)."""

import pytest
from orl_helpers import load_upstream_loss


@pytest.fixture
def upstream_loss(monkeypatch):
    return load_upstream_loss(monkeypatch)
