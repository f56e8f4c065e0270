"""The group-commit writer on real databases: batches behave exactly like one-by-one transactions."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Text, cast, select, update
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import UNITS_PER_EPSILON
from service.auth import Principal, Role, create_key
from service.datasets import create_dataset, grant
from service.errors import BudgetExhausted, ServiceUnavailable
from service.filter import budget
from service.filter.ledger import verify
from service.runs import admission, settlement, worker, writer
from service.store.models import DATASET_SCOPE, AnalysisRequest
from service.store.repositories import FilterRepository, RequestRepository
from tests.integration.helpers import CSV, SCHEMA, commits_of, expect, totals, world_in_db

COUNT = {"query": {"kind": "count"}, "epsilon": 0.1}


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
                pool.map(
                    lambda r: batcher.settle(settlement.RequestRef.of(r[0]), None, None, "test"), admitted
                )
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
        original = writer._reads

        def flaky(batch: list[writer.Job]) -> admission.BatchReads:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("the database hiccuped")
            return original(batch)

        monkeypatch.setattr(writer, "_reads", flaky)
        outcomes = race(batcher, sessions, dataset_id, principals)
        assert calls["n"] >= 1
        assert sum(not isinstance(o, BudgetExhausted) for o in outcomes) == 10
        assert spent_and_reserved(sessions, dataset_id) == (0, UNITS_PER_EPSILON)
        with sessions() as session:
            assert verify(session).problems == []

    def test_an_admission_abandoned_on_timeout_leaves_no_orphan_reservation(
        self, sessions: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        dataset_id, (analyst,) = world_in_db(sessions, tmp_path, epsilon=1.0)
        with sessions() as session:
            validated = admission.validate(session, analyst, dataset_id, "laplace", COUNT)
        original = writer._reads

        def slow_lock_all(batch: list[writer.Job]) -> admission.BatchReads:
            time.sleep(1.0)  # a slow database (lock wait, busy SQLite file)
            return original(batch)

        monkeypatch.setattr(writer, "_reads", slow_lock_all)
        batcher = writer.WriteBatcher(sessions, timeout=0.2)
        try:
            with pytest.raises(ServiceUnavailable):
                batcher.admit(analyst, validated, None, 300.0)
            time.sleep(2.0)  # the writer thread goes on with the abandoned job
        finally:
            batcher.stop()
        with sessions() as session:
            mine = session.query(AnalysisRequest).filter(AnalysisRequest.dataset_id == dataset_id).all()
            orphans = [r.id for r in mine if r.state == "running"]
        expect(totals(sessions, dataset_id) == (0, 0), f"orphaned running requests: {orphans}")

    def test_reaper_racing_the_writer_settles_each_request_once(
        self, sessions: sessionmaker[Session], tmp_path: Path
    ) -> None:
        dataset_id, principals = world_in_db(sessions, tmp_path, analysts=6, epsilon=1.0)
        batcher = writer.WriteBatcher(sessions)
        try:
            admitted = []
            for principal in principals:
                with sessions() as session:
                    validated = admission.validate(session, principal, dataset_id, "laplace", COUNT)
                admitted.append((batcher.admit(principal, validated, None, 300.0)[0], validated))
            with sessions() as session, session.begin():
                session.execute(
                    update(AnalysisRequest)
                    .where(AnalysisRequest.dataset_id == dataset_id)
                    # claimed by a worker that went silent: the reaper may charge them (queued ones, never)
                    .values(lease_owner="lost", lease_expires_at=datetime.now(UTC) - timedelta(seconds=1))
                )
            barrier = threading.Barrier(len(admitted) + 2)

            def settle(item: tuple[AnalysisRequest, admission.Validated]) -> Any:
                request, validated = item
                barrier.wait()
                ref = settlement.RequestRef.of(request)
                return batcher.settle(ref, validated.worst_case, {"value": 1.0}, None)

            def reap(_: int) -> int:
                barrier.wait()
                return worker.reap_expired(sessions)

            with ThreadPoolExecutor(len(admitted) + 2) as pool:
                settling, reaping = pool.map(settle, admitted), pool.map(reap, range(2))  # all submitted
                settled, reaped = list(settling), sum(reaping)
            # (the live server's own reaper may share this database and win some races, too)
            assert sum(s is not None for s in settled) + reaped <= len(admitted)
            for request, _ in admitted:
                assert commits_of(sessions, request.id) == 1
                with sessions() as session:
                    fresh = RequestRepository(session).get(request.id)
                    assert fresh is not None
                    assert fresh.state in ("committed", "failed_charged")
                    assert (fresh.release is None) == (fresh.state == "failed_charged")
            assert totals(sessions, dataset_id) == (len(admitted) * UNITS_PER_EPSILON // 10, 0)
            with sessions() as session:
                assert verify(session).problems == []
        finally:
            batcher.stop()

    def test_batches_spanning_datasets_admit_exactly_what_each_filter_affords(
        self, sessions: sessionmaker[Session], tmp_path: Path
    ) -> None:
        first, principals = world_in_db(sessions, tmp_path, analysts=15, epsilon=1.0)
        second, _ = world_in_db(sessions, tmp_path, epsilon=1.0, names=[p.name for p in principals])
        jobs = [(p, d) for p in principals for d in (first, second)]
        validated = []
        for principal, dataset_id in jobs:
            with sessions() as session:
                validated.append(admission.validate(session, principal, dataset_id, "laplace", COUNT))
        batcher = writer.WriteBatcher(sessions)
        barrier = threading.Barrier(len(jobs))

        def admit(i: int) -> Any:
            barrier.wait()
            try:
                return batcher.admit(jobs[i][0], validated[i], f"k-{jobs[i][1]}", 300.0)
            except BudgetExhausted as exc:
                return exc

        try:
            with ThreadPoolExecutor(len(jobs)) as pool:
                outcomes = list(pool.map(admit, range(len(jobs))))
        finally:
            batcher.stop()
        for dataset_id in (first, second):
            mine = [o for o, (_, d) in zip(outcomes, jobs, strict=True) if d == dataset_id]
            assert sum(not isinstance(o, BudgetExhausted) for o in mine) == 10
            assert totals(sessions, dataset_id) == (0, UNITS_PER_EPSILON)
        with sessions() as session:
            assert verify(session).problems == []


def test_the_batch_insert_stores_what_an_orm_insert_stores(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """The writer's batch INSERT (one executemany statement on the connection, no ORM object) stores every
    column as the ORM's INSERT does: the same JSON text (``None`` in a JSON column as JSON null),
    timestamps, states, NULLs. (Kept from a tried ``COPY`` path, which had to pass it too.)"""
    dataset_id, (principal,) = world_in_db(sessions, tmp_path)
    now = datetime.now(UTC)
    columns: dict[str, Any] = {
        "kind": "request",
        "dataset_id": dataset_id,
        "analyst": principal.name,
        "mechanism": "laplace",
        "params": {"query": {"kind": "count"}, "epsilon": 0.25, "note": 'ü\\\t"x'},
        "fingerprint": "f" * 64,
        "state": "committed",
        "scopes": ["*", principal.name],
        "worst_case": {"curve": [0.5, "inf"], "delta": "0"},
        "realized": None,
        "release": {"value": 1e-06, "big": 2**62},
        "error": None,
        "created_at": now,
        "updated_at": now,
        "lease_expires_at": None,
        "lease_owner": None,
        "started_at": now,
        "progress": 0.5,
        "cancelled_by": None,
        "queue": None,
    }
    with sessions() as session, session.begin():
        batched = {**columns, "id": "batched", "idempotency_key": "k\tey"}
        RequestRepository(session).insert_many([batched])  # the writer's statement
        session.add(AnalysisRequest(**columns, id="orm", idempotency_key="k\tey 2"))
    with sessions() as session:
        table = AnalysisRequest.__table__
        compared = [c.name for c in table.columns if c.name not in ("id", "idempotency_key")]
        stored = {
            row.id: {name: getattr(row, name) for name in compared}
            for row in session.execute(select(*(cast(c, Text) for c in table.columns))).all()
        }
    assert stored["batched"] == stored["orm"]
    assert stored["batched"]["realized"] is not None  # JSON null, as SQLAlchemy writes a None
    with sessions() as session:
        assert RequestRepository(session).by_keys([(principal.name, "k\tey")])[0]["id"] == "batched"
