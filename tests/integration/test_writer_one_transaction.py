"""The writer's one-transaction path for cheap inline requests (admit + reserve, run, commit + release in
one database transaction), on real databases: the same filter decisions, ledger and charges as the
two-phase path, and never a release without its durable charge."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import UNITS_PER_EPSILON
from mechanisms.base import Mechanism
from service.auth import Principal
from service.datasets import TableCache
from service.errors import BudgetExhausted
from service.filter.ledger import verify
from service.runs import admission, writer
from service.runs.worker import execute
from service.store.models import LedgerEntry
from service.store.repositories import FilterRepository
from tests.integration.test_writer import analysts_on_a_pure_budget

COUNT = {"query": {"kind": "count"}, "epsilon": 0.1}


def inline(sessions: sessionmaker[Session], principal: Principal, dataset_id: str) -> admission.Validated:
    with sessions() as session:
        v = admission.validate(session, principal, dataset_id, "laplace", COUNT)
    return admission.Validated(**{**v.__dict__, "inline": True})


def real_run(v: admission.Validated, tables: TableCache) -> writer.RunFn:
    assert isinstance(v.mechanism, Mechanism)
    mechanism = v.mechanism
    return lambda: execute(v.dataset, mechanism, v.params, v.context, tables, v.worst_case)


def pure_totals(sessions: sessionmaker[Session], dataset_id: str) -> tuple[int, int]:
    with sessions() as session:
        flt = FilterRepository(session).get(dataset_id)
        assert flt is not None
        return flt.spent["finite"][-1], flt.reserved["finite"][-1]


def entries(sessions: sessionmaker[Session], request_id: str) -> list[str]:
    with sessions() as session:
        rows = (
            session.query(LedgerEntry).filter(LedgerEntry.request_id == request_id).order_by(LedgerEntry.seq)
        )
        return [row.event for row in rows]



def recorded(run: writer.RunFn) -> tuple[list[Any], writer.RunFn]:
    """``run`` that also records each of its outcomes (the draws of every attempt)."""
    runs: list[Any] = []

    def counted() -> Any:
        runs.append(run())
        return runs[-1]

    return runs, counted


def assert_retried_alone(
    sessions: sessionmaker[Session], dataset_id: str, request: Any, runs: list[Any], charges: int = 1
) -> None:
    """The failed batch's draw was dropped unseen; the retry's release is the one returned, charged once,
    and nothing of the failed batch stayed."""
    assert request.state == "committed"
    assert len(runs) == 2
    assert request.release == runs[1][1]
    assert entries(sessions, request.id) == ["reserve", "commit"]
    assert pure_totals(sessions, dataset_id) == (charges * (UNITS_PER_EPSILON // 10), 0)
    with sessions() as session:
        assert verify(session).problems == []

class TestOneTransaction:
    def test_concurrent_requests_commit_exactly_what_fits_with_their_releases(
        self, sessions: sessionmaker[Session], batcher: writer.WriteBatcher, tmp_path: Path
    ) -> None:
        dataset_id, principals = analysts_on_a_pure_budget(sessions, tmp_path, 30)
        tables = TableCache(tmp_path)
        validated = [inline(sessions, p, dataset_id) for p in principals]
        barrier = threading.Barrier(len(principals))

        def submit(i: int) -> Any:
            barrier.wait()
            try:
                return batcher.admit_and_run(
                    principals[i], validated[i], None, 300.0, real_run(validated[i], tables)
                )
            except BudgetExhausted as exc:
                return exc

        with ThreadPoolExecutor(len(principals)) as pool:
            outcomes = list(pool.map(submit, range(len(principals))))
        done = [request for request, created in (o for o in outcomes if not isinstance(o, BudgetExhausted))]
        assert len(done) == 10  # ten charges of 0.1 fill the pure budget of 1.0 exactly
        assert all(r.state == "committed" and r.release is not None for r in done)
        assert batcher.batches < 30  # jobs really shared transactions
        assert pure_totals(sessions, dataset_id) == (UNITS_PER_EPSILON, 0)
        for request in done:  # the same two ledger entries as the two-phase path
            assert entries(sessions, request.id) == ["reserve", "commit"]
        with sessions() as session:
            assert verify(session).problems == []

    def test_a_release_that_cannot_be_stored_is_charged_its_worst_case_and_not_released(
        self, sessions: sessionmaker[Session], batcher: writer.WriteBatcher, tmp_path: Path
    ) -> None:
        dataset_id, (principal,) = analysts_on_a_pure_budget(sessions, tmp_path, 1)
        v = inline(sessions, principal, dataset_id)
        request, created = batcher.admit_and_run(
            principal, v, None, 300.0, lambda: (v.worst_case, {"value": math.nan}, None)
        )
        assert created
        assert request.state == "failed_charged"
        assert request.release is None
        assert pure_totals(sessions, dataset_id) == (UNITS_PER_EPSILON // 10, 0)
        with sessions() as session:
            assert verify(session).problems == []

    def test_a_failed_batch_drops_its_output_unseen_and_retries_on_the_two_phase_path(
        self,
        sessions: sessionmaker[Session],
        batcher: writer.WriteBatcher,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        dataset_id, (principal,) = analysts_on_a_pure_budget(sessions, tmp_path, 1)
        v = inline(sessions, principal, dataset_id)
        runs, counted = recorded(real_run(v, TableCache(tmp_path)))
        original = writer.RequestBatch._send  # the batch's writes, sent before its COMMIT

        def failing_send(self: writer.RequestBatch) -> None:
            original(self)
            raise RuntimeError("the database went away before the commit")

        monkeypatch.setattr(writer.RequestBatch, "_send", failing_send)
        request, created = batcher.admit_and_run(principal, v, "key-1", 300.0, counted)
        assert created
        assert_retried_alone(sessions, dataset_id, request, runs)
        replay, created_again = batcher.admit_and_run(principal, v, "key-1", 300.0, counted)
        assert not created_again  # replayed, not re-run
        assert replay.id == request.id
        assert len(runs) == 2

    def test_a_statement_failing_at_the_batch_commit_fails_the_whole_batch_and_it_is_retried(
        self,
        sessions: sessionmaker[Session],
        batcher: writer.WriteBatcher,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """The batch's writes and its COMMIT are queued together (one round trip on PostgreSQL), so a
        write the database refuses may surface at any point up to the COMMIT: nothing of the batch may
        stay, and the request is retried alone. Here the batch's request row reuses a stored one's id."""
        dataset_id, (principal,) = analysts_on_a_pure_budget(sessions, tmp_path, 1)
        v = inline(sessions, principal, dataset_id)
        tables = TableCache(tmp_path)
        first, _ = batcher.admit_and_run(principal, v, "key-1", 300.0, real_run(v, tables))
        runs, counted = recorded(real_run(v, tables))
        original = admission.new_request
        taken: list[str] = []

        def clashing(*args: Any) -> dict[str, Any]:
            values = original(*args)
            if not taken:  # the batch's row only: the retry gets a fresh id
                taken.append(values["id"])
                values["id"] = first.id
            return values

        monkeypatch.setattr(admission, "new_request", clashing)
        request, created = batcher.admit_and_run(principal, v, "key-2", 300.0, counted)
        assert created
        assert taken
        assert request.id not in (first.id, taken[0])
        assert entries(sessions, first.id) == ["reserve", "commit"]  # the clash changed nothing stored
        assert_retried_alone(sessions, dataset_id, request, runs, charges=2)

    def test_a_refused_commit_fails_the_whole_batch_and_it_is_retried(
        self,
        sessions: sessionmaker[Session],
        batcher: writer.WriteBatcher,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """The batch's COMMIT itself fails (after every write was sent): no release of the batch may
        leave, and the request is retried alone."""
        dataset_id, (principal,) = analysts_on_a_pure_budget(sessions, tmp_path, 1)
        v = inline(sessions, principal, dataset_id)
        runs, counted = recorded(real_run(v, TableCache(tmp_path)))
        original = Session.commit
        refused: list[Session] = []

        def refusing(self: Session) -> None:
            if not refused:  # the batch's COMMIT only: the retry's transactions commit
                refused.append(self)
                raise RuntimeError("the database refused the COMMIT")
            original(self)

        monkeypatch.setattr(Session, "commit", refusing)
        request, created = batcher.admit_and_run(principal, v, "key-1", 300.0, counted)
        assert created
        assert refused
        assert_retried_alone(sessions, dataset_id, request, runs)
