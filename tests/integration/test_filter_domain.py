"""The filter's transitions as domain functions on real databases: reserve, abort, reap, verify."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from service.auth import Principal, Role, create_key
from service.datasets import create_dataset, grant
from service.filter import budget
from service.filter.ledger import verify
from service.runs import admission, settlement, worker
from service.store.models import DATASET_SCOPE
from service.store.repositories import FilterRepository, RequestRepository
from tests.integration.helpers import CSV, SCHEMA, world_in_db


@pytest.fixture
def setup(sessions: sessionmaker[Session], tmp_path: Path) -> tuple[str, Principal]:
    with sessions() as session, session.begin():
        create_key(session, name := f"analyst-{datetime.now(UTC).timestamp()}", Role.analyst)
        dataset = create_dataset(session, tmp_path, "d", CSV, SCHEMA, "admin")
        grant(session, dataset, name, "admin")
        budget.set_budget(session, dataset, DATASET_SCOPE, 1.0, 0.0, "admin")
    return dataset.id, Principal(name, Role.analyst)


def reserved_pure(sessions: sessionmaker[Session], dataset_id: str) -> tuple[int, int]:
    with sessions() as session:
        flt = FilterRepository(session).get(dataset_id)
        assert flt is not None
        return flt.reserved["finite"][-1], flt.spent["finite"][-1]


def admitted(sessions: sessionmaker[Session], setup: tuple[str, Principal]) -> settlement.RequestRef:
    dataset_id, principal = setup
    with sessions() as session:
        validated = admission.validate(
            session, principal, dataset_id, "laplace", {"query": {"kind": "count"}, "epsilon": 0.3}
        )
    with sessions() as session:
        request, created = admission.admit(session, principal, validated, None, 300.0)
    assert created
    return settlement.RequestRef.of(request)


def verified(sessions: sessionmaker[Session]) -> list[str]:
    with sessions() as session:
        return verify(session).problems


class TestTransitions:
    def test_abort_releases_the_reservation_without_charge(
        self, sessions: sessionmaker[Session], setup: tuple[str, Principal]
    ) -> None:
        ref = admitted(sessions, setup)
        assert reserved_pure(sessions, setup[0]) == (300_000_000_000, 0)
        with sessions() as session:
            assert settlement.abort(session, ref, "never started")
        assert reserved_pure(sessions, setup[0]) == (0, 0)
        with sessions() as session:
            assert not settlement.abort(session, ref, "twice")  # only once
            request = RequestRepository(session).get(ref.id)
            assert request is not None
            assert request.state == "aborted"
        assert verified(sessions) == []

    def test_reaper_commits_the_worst_case_of_an_expired_lease_once(
        self, sessions: sessionmaker[Session], setup: tuple[str, Principal]
    ) -> None:
        ref = admitted(sessions, setup)
        with sessions() as session, session.begin():
            request = RequestRepository(session).get(ref.id)
            assert request is not None
            request.lease_owner = "lost-worker"  # claimed (the data may have been read), then silent
            request.lease_expires_at = datetime.now(UTC) - timedelta(seconds=1)
        assert worker.reap_expired(sessions) >= 1
        assert reserved_pure(sessions, setup[0]) == (0, 300_000_000_000)
        with sessions() as session:
            # a late worker finishing now must not charge again
            assert settlement.settle(session, ref, None, {"value": 1.0}, None) is None
            request = RequestRepository(session).get(ref.id)
            assert request is not None
            assert (request.state, request.release) == ("failed_charged", None)
        assert reserved_pure(sessions, setup[0]) == (0, 300_000_000_000)
        assert verified(sessions) == []

    def test_an_infinite_reservation_is_released_bit_for_bit(
        self, sessions: sessionmaker[Session], tmp_path: Path
    ) -> None:
        """A Gaussian (pure slot +∞) reserved and aborted leaves the totals exactly as before."""
        dataset_id, (analyst,) = world_in_db(sessions, tmp_path, epsilon=1.0, delta=1e-6)
        with sessions() as session:
            validated = admission.validate(
                session, analyst, dataset_id, "gaussian", {"query": {"kind": "count"}, "sigma": 10.0}
            )
            before = FilterRepository(session).get(dataset_id)
            assert before is not None
            spent, reserved = dict(before.spent), dict(before.reserved)
        with sessions() as session:
            request, _ = admission.admit(session, analyst, validated, None, 300.0)
        with sessions() as session:
            after = FilterRepository(session).get(dataset_id)
            assert after is not None
            assert after.reserved["infinite"][-1] == 1
        with sessions() as session:
            assert settlement.abort(session, settlement.RequestRef.of(request), "never started")
        with sessions() as session:
            restored = FilterRepository(session).get(dataset_id)
            assert restored is not None
            assert (restored.spent, restored.reserved) == (spent, reserved)
