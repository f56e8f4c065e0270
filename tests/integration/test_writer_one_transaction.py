"""The writer's one-transaction path for cheap inline requests (admit + reserve, run, commit + release in
one database transaction), on real databases: the same filter decisions, ledger and charges as the
two-phase path, and never a release without its durable charge."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import UNITS_PER_EPSILON
from mechanisms.base import Mechanism
from service.auth import Principal
from service.datasets import TableCache
from service.errors import BudgetExhausted
from service.filter.ledger import verify
from service.runs import admission, writer
from service.runs.worker import execute
from service.store.engine import make_engine, make_sessionmaker
from service.store.migrate import upgrade
from service.store.models import AnalysisRequest, LedgerEntry
from service.store.repositories import FilterRepository
from tests.conftest import fresh_postgres_database
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
        original = writer.RequestBatch.send  # the batch's writes, sent before its COMMIT

        def failing_send(self: writer.RequestBatch) -> None:
            original(self)
            if self.pipeline:  # the writer's batch; its retry (a batch of one) goes through
                raise RuntimeError("the database went away before the commit")

        monkeypatch.setattr(writer.RequestBatch, "send", failing_send)
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
        refuse_the_next_commit: Callable[[], Callable[[], int]],
    ) -> None:
        """The database refuses the batch's COMMIT itself (after every write of it ran): no release of
        the batch may leave, and the request is retried alone."""
        dataset_id, (principal,) = analysts_on_a_pure_budget(sessions, tmp_path, 1)
        v = inline(sessions, principal, dataset_id)
        runs, counted = recorded(real_run(v, TableCache(tmp_path)))
        refusals = refuse_the_next_commit()
        request, created = batcher.admit_and_run(principal, v, "key-1", 300.0, counted)
        assert created
        assert refusals() == 1
        assert_retried_alone(sessions, dataset_id, request, runs)


@pytest.fixture
def refuse_the_next_commit(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[], Callable[[], int]]]:
    """Arms a refusal of the next COMMIT that appends to the ledger; the armed call returns how many
    COMMITs were refused so far. PostgreSQL: a deferred constraint trigger, checked at COMMIT, after every
    write of the transaction ran (a sequence counts its calls: it is not rolled back with the refused
    transaction; all three are dropped afterwards, the database serves later tests). SQLite: its COMMIT
    is the session's own, so the next one is refused there."""
    with sessions() as session:
        dialect = session.get_bind().dialect.name
    armed: list[bool] = []

    def arm() -> Callable[[], int]:
        armed.append(True)
        if dialect != "postgresql":
            original, refused = Session.commit, []

            def refusing(self: Session) -> None:
                if not refused:
                    refused.append(self)
                    raise RuntimeError("the database refused the COMMIT")
                original(self)

            monkeypatch.setattr(Session, "commit", refusing)
            return lambda: len(refused)
        with sessions() as session, session.begin():
            for statement in REFUSE_FIRST_COMMIT:
                session.execute(text(statement))

        def refused_commits() -> int:
            with sessions() as session:
                called = session.scalar(text("SELECT is_called FROM refused_commits"))
                return 1 if called else 0  # only the trigger's first call refuses

        return refused_commits

    yield arm
    if armed and dialect == "postgresql":
        with sessions() as session, session.begin():
            session.execute(text("DROP TRIGGER refuse_first_commit ON ledger"))
            session.execute(text("DROP FUNCTION refuse_first_commit()"))
            session.execute(text("DROP SEQUENCE refused_commits"))


REFUSE_FIRST_COMMIT = (
    "CREATE SEQUENCE refused_commits",
    "CREATE FUNCTION refuse_first_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
    "IF nextval('refused_commits') = 1 THEN RAISE EXCEPTION 'the COMMIT is refused'; END IF; "
    "RETURN NULL; END $$",
    "CREATE CONSTRAINT TRIGGER refuse_first_commit AFTER INSERT ON ledger "
    "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_first_commit()",
)


@pytest.fixture
def postgres_writer() -> Iterator[tuple[Engine, sessionmaker[Session], writer.WriteBatcher]]:
    """A fresh migrated PostgreSQL database of its own, with an engine and a writer on it."""
    fresh = fresh_postgres_database()
    try:
        upgrade(fresh.url)
        engine = make_engine(fresh.url)
        batcher = writer.WriteBatcher(make_sessionmaker(engine))
        try:
            yield engine, batcher.sessions, batcher
        finally:
            batcher.stop()
            engine.dispose()
    finally:
        fresh.drop()


def test_a_connection_lost_after_the_batch_commit_does_not_redo_the_batch(
    tmp_path: Path, postgres_writer: tuple[Engine, sessionmaker[Session], writer.WriteBatcher]
) -> None:
    """Nothing is sent after a batch's COMMIT is confirmed (``unit.commit``): if the connection is
    lost right then, the batch still counts as committed, and its request is neither run nor charged
    again (it was, when the pipeline's exit sent one more sync after the COMMIT). PostgreSQL only: the
    writer's server process is ended from an after-commit hook."""
    engine, sessions, batcher = postgres_writer
    dataset_id, (principal,) = analysts_on_a_pure_budget(sessions, tmp_path, 1)
    v = inline(sessions, principal, dataset_id)
    runs, counted = recorded(real_run(v, TableCache(tmp_path)))
    ended: list[int] = []

    def end_the_writers_connection(session: Session) -> None:
        if ended or threading.current_thread().name != "expost-writer":
            return
        connection = batcher._connection
        assert connection is not None
        pid = connection.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
        with engine.connect() as admin:
            admin.execute(text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": pid})
        ended.append(pid)

    event.listen(Session, "after_commit", end_the_writers_connection)
    try:
        request, created = batcher.admit_and_run(principal, v, None, 300.0, counted)
    finally:
        event.remove(Session, "after_commit", end_the_writers_connection)
    assert ended
    assert created
    assert request.state == "committed"
    assert len(runs) == 1
    assert request.release == runs[0][1]
    assert pure_totals(sessions, dataset_id) == (UNITS_PER_EPSILON // 10, 0)
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(AnalysisRequest)) == 1
        assert verify(session).problems == []
    again, _ = batcher.admit_and_run(principal, v, None, 300.0, counted)  # the writer reconnects
    assert again.state == "committed"
    assert pure_totals(sessions, dataset_id) == (2 * (UNITS_PER_EPSILON // 10), 0)
