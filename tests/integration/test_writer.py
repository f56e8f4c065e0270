"""The group-commit writer on real databases: batches behave exactly like one-by-one transactions."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import UNITS_PER_EPSILON
from service.auth import Principal, Role, create_key
from service.datasets import create_dataset, grant
from service.errors import BudgetExhausted
from service.filter import budget
from service.filter.ledger import verify
from service.runs import admission, settlement, writer
from service.store.models import DATASET_SCOPE
from service.store.repositories import FilterRepository
from tests.integration.helpers import CSV, SCHEMA

COUNT = {"query": {"kind": "count"}, "epsilon": 0.1}


@pytest.fixture
def batcher(sessions: sessionmaker[Session]) -> Iterator[writer.WriteBatcher]:
    batch_writer = writer.WriteBatcher(sessions)
    yield batch_writer
    batch_writer.stop()


def analysts_on_a_pure_budget(
    sessions: sessionmaker[Session], data_dir: Path, count: int
) -> tuple[str, list[Principal]]:
    with sessions() as session, session.begin():
        dataset = create_dataset(session, data_dir, "d", CSV, SCHEMA, "admin")
        principals = []
        for i in range(count):
            name = f"w-{dataset.id}-{i}"
            create_key(session, name, Role.analyst)
            grant(session, dataset, name, "admin")
            principals.append(Principal(name, Role.analyst))
        budget.set_budget(session, dataset, DATASET_SCOPE, 1.0, 0.0, "admin")
    return dataset.id, principals


def race(
    batcher: writer.WriteBatcher,
    sessions: sessionmaker[Session],
    dataset_id: str,
    principals: list[Principal],
    key: str | None = None,
) -> list[Any]:
    """Every principal validates, then all admit at once (released by a barrier)."""
    validated = []
    for principal in principals:
        with sessions() as session:
            validated.append(admission.validate(session, principal, dataset_id, "laplace", COUNT))
    barrier = threading.Barrier(len(principals))

    def admit(i: int) -> Any:
        barrier.wait()
        try:
            return batcher.admit(principals[i], validated[i], key, 300.0)
        except BudgetExhausted as exc:
            return exc

    with ThreadPoolExecutor(len(principals)) as pool:
        return list(pool.map(admit, range(len(principals))))


def spent_and_reserved(sessions: sessionmaker[Session], dataset_id: str) -> tuple[int, int]:
    with sessions() as session:
        flt = FilterRepository(session).get(dataset_id)
        assert flt is not None
        return flt.spent["finite"][-1], flt.reserved["finite"][-1]


class TestWriteBatcher:
    def test_batched_admissions_admit_exactly_what_fits(
        self, sessions: sessionmaker[Session], batcher: writer.WriteBatcher, tmp_path: Path
    ) -> None:
        dataset_id, principals = analysts_on_a_pure_budget(sessions, tmp_path, 40)
        outcomes = race(batcher, sessions, dataset_id, principals)
        admitted = [o for o in outcomes if not isinstance(o, BudgetExhausted)]
        assert len(admitted) == 10
        assert all(o.problem()["pure"]["capacity"] == 1.0 for o in outcomes if isinstance(o, BudgetExhausted))
        assert batcher.batches < 40  # some jobs really were committed together
        assert spent_and_reserved(sessions, dataset_id) == (0, UNITS_PER_EPSILON)
        for request, _ in admitted:  # settle them all through the writer, concurrently
            assert request.state == "running"
        with ThreadPoolExecutor(10) as pool:
            settled = list(
                pool.map(lambda r: batcher.settle(settlement.RequestRef.of(r[0]), None, None, "test"), admitted)
            )
        assert all(s is not None and s.state == "failed_charged" for s in settled)
        assert batcher.settle(settlement.RequestRef.of(admitted[0][0]), None, None, "again") is None
        assert spent_and_reserved(sessions, dataset_id) == (UNITS_PER_EPSILON, 0)
        with sessions() as session:
            assert verify(session).problems == []

    def test_one_idempotency_key_in_one_batch_creates_one_request(
        self, sessions: sessionmaker[Session], batcher: writer.WriteBatcher, tmp_path: Path
    ) -> None:
        dataset_id, principals = analysts_on_a_pure_budget(sessions, tmp_path, 1)
        outcomes = race(batcher, sessions, dataset_id, principals * 8, key="same-key")
        assert len({request.id for request, _ in outcomes}) == 1
        assert sum(created for _, created in outcomes) == 1
        assert spent_and_reserved(sessions, dataset_id) == (0, UNITS_PER_EPSILON // 10)

    def test_a_failed_batch_is_retried_job_by_job(
        self,
        sessions: sessionmaker[Session],
        batcher: writer.WriteBatcher,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        dataset_id, principals = analysts_on_a_pure_budget(sessions, tmp_path, 12)
        calls = {"n": 0}
        original = writer._lock_all

        def flaky(session: Session, batch: list[writer.Job]) -> writer.Locked:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("the database hiccuped")
            return original(session, batch)

        monkeypatch.setattr(writer, "_lock_all", flaky)
        outcomes = race(batcher, sessions, dataset_id, principals)
        assert calls["n"] >= 1
        assert sum(not isinstance(o, BudgetExhausted) for o in outcomes) == 10
        assert spent_and_reserved(sessions, dataset_id) == (0, UNITS_PER_EPSILON)
        with sessions() as session:
            assert verify(session).problems == []
