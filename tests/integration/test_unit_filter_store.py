"""The stored per-unit filters (service/filter/individual.py) on SQLite and PostgreSQL: blocks appended under
a version check, a base block every ``BASE_EVERY`` versions, and ``read_state`` equal to the replay of every
release's charges (docs/privacy/individual.md#unit-state)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import numpy as np
import pytest
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting.individual import UnitCharges, UnitLedger
from service.filter.individual import BASE_EVERY, UnitUpdate, read_state
from service.store import unit
from service.store.models import Dataset, UnitFilterBlock
from service.store.repositories import UnitFilterRepository


@pytest.fixture
def dataset_id(sessions: sessionmaker[Session]) -> str:
    now, name = datetime.now(UTC), f"ds_units_{uuid.uuid4().hex[:12]}"
    with unit.transaction(sessions) as session:
        session.add(
            Dataset(
                id=name,
                name="units",
                schema_json={},
                neighboring="add_remove",
                n_rows=0,
                file_name="x.parquet",
                content_sha256="0" * 64,
                orders=[2.0],
                clipped={},
                created_by="test",
                created_at=now,
            )
        )
    return name


def _charges(rng: np.random.Generator) -> UnitCharges:
    units = np.unique(rng.integers(0, 500, 40))
    return UnitCharges(units, rng.integers(0, 10**9, units.size), rng.integers(0, 10**9, units.size))


def test_read_state_replays_every_release_across_base_blocks(
    sessions: sessionmaker[Session], dataset_id: str
) -> None:
    rng = np.random.default_rng(7)
    expected = UnitLedger.empty()
    for version in range(2 * BASE_EVERY + 5):
        charges = _charges(rng)
        update = UnitUpdate.of(dataset_id, version, expected, charges)
        expected = update.ledger
        with unit.transaction(sessions) as session:
            repository = UnitFilterRepository(session)
            assert repository.version(dataset_id) == version
            repository.append(dataset_id, version, update.base, update.block, datetime.now(UTC))
        with sessions() as session:
            stored_version, ledger = read_state(session, dataset_id)
        assert stored_version == version + 1
        assert np.array_equal(ledger.spent.units, expected.spent.units)
        assert np.array_equal(ledger.spent.pure, expected.spent.pure)
        assert np.array_equal(ledger.spent.slope, expected.spent.slope)
    with sessions() as session:
        kept = session.query(UnitFilterBlock).filter_by(dataset_id=dataset_id).count()
    assert kept == 6  # the base of version 64 and the five deltas after it: older blocks were deleted


def test_a_missing_block_is_an_error_not_an_empty_state(
    sessions: sessionmaker[Session], dataset_id: str
) -> None:
    rng = np.random.default_rng(8)
    ledger = UnitLedger.empty()
    for version in range(3):
        update = UnitUpdate.of(dataset_id, version, ledger, _charges(rng))
        ledger = update.ledger
        with unit.transaction(sessions) as session:
            UnitFilterRepository(session).append(
                dataset_id, version, update.base, update.block, datetime.now(UTC)
            )
    with unit.transaction(sessions) as session:
        session.query(UnitFilterBlock).filter_by(dataset_id=dataset_id, version=2).delete()
    with sessions() as session, pytest.raises(ValueError, match="missing version 2"):
        read_state(session, dataset_id)
