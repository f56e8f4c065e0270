"""Fixtures shared by the integration tests (the server and database fixtures are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mechanisms.catalog import MECHANISMS
from tests.conftest import fresh_postgres_database
from tests.integration.scale_out_support import GatedCount


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedCount]:
    """A long-running count held running until its gate opens, in this test process's catalog; the gate is
    opened at teardown, so no worker thread is left waiting on it."""
    mechanism = GatedCount()
    monkeypatch.setitem(MECHANISMS, mechanism.name, mechanism)
    yield mechanism
    mechanism.gate.set()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database of this test alone (a file, or a fresh PostgreSQL database dropped afterwards): for tests
    whose server processes must not share state with the session's test server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'expost.db'}"
        return
    fresh = fresh_postgres_database()
    try:
        yield fresh.url
    finally:
        fresh.drop()
