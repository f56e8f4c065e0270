"""Fixtures shared by the integration tests (the server and database fixtures are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mechanisms.catalog import MECHANISMS
from tests.integration.scale_out_support import GatedCount


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedCount]:
    """A long-running count held running until its gate opens, in this test process's catalog; the gate is
    opened at teardown, so no worker thread is left waiting on it."""
    mechanism = GatedCount()
    monkeypatch.setitem(MECHANISMS, mechanism.name, mechanism)
    yield mechanism
    mechanism.gate.set()
