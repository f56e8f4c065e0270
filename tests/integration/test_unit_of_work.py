"""The unit of work (``service.store.unit``): every transaction of the service begins and ends there.

Its pipelined COMMIT relies on psycopg's pipeline mode: statements and a queued ``COMMIT`` go in one round
trip; leaving the pipeline is the one sync and raises the first error of any statement, and then the
queued ``COMMIT`` is not run, so nothing of a failed batch is durable. The first tests pin that behaviour of
psycopg itself (an upgrade that changed it would fail here first); the others check ``unit.commit`` and
``unit.transaction`` on both backends, with a second connection as the judge of what is durable.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, make_url, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from service.store import unit
from service.store.engine import make_engine, make_sessionmaker
from tests.conftest import POSTGRES_URL, postgres_available


@pytest.fixture
def probe(database_url: str) -> Iterator[tuple[Engine, sessionmaker[Session], str]]:
    """A scratch table ``name`` (one primary key) on the backend, dropped afterwards."""
    engine = make_engine(database_url)
    name = "uow_probe_" + uuid.uuid4().hex[:12]
    with engine.begin() as connection:
        connection.execute(text(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY)"))
    try:
        yield engine, make_sessionmaker(engine), name
    finally:
        with engine.begin() as connection:
            connection.execute(text(f"DROP TABLE {name}"))
        engine.dispose()


def durable(engine: Engine, table: str) -> list[int]:
    """What another connection sees committed in ``table``."""
    with engine.connect() as connection:
        return [row[0] for row in connection.execute(text(f"SELECT id FROM {table} ORDER BY id"))]


def insert(session: Session, table: str, *ids: int) -> None:
    for row_id in ids:
        session.execute(text(f"INSERT INTO {table} (id) VALUES (:id)"), {"id": row_id})


@pytest.fixture
def raw_postgres() -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    if not postgres_available():
        pytest.fail("PostgreSQL is needed for the pipeline tests (see tests/conftest.py)")
    libpq = make_url(POSTGRES_URL).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(libpq) as connection:
        connection.execute("CREATE TEMP TABLE pinned (id INTEGER PRIMARY KEY)")
        connection.commit()
        yield connection


@pytest.mark.postgres
class TestPsycopgPipelineAsRelied:
    def test_a_queued_commit_is_confirmed_by_the_pipelines_one_sync(
        self, raw_postgres: psycopg.Connection[tuple[object, ...]]
    ) -> None:
        cursor = raw_postgres.cursor()
        with raw_postgres.pipeline():
            cursor.execute("INSERT INTO pinned (id) VALUES (1)")
            cursor.execute("COMMIT")
        assert cursor.statusmessage == "COMMIT"
        assert raw_postgres.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        raw_postgres.rollback()  # nothing to roll back: the row stays
        assert raw_postgres.execute("SELECT id FROM pinned").fetchall() == [(1,)]

    def test_a_failed_statement_raises_at_the_sync_and_its_commit_never_runs(
        self, raw_postgres: psycopg.Connection[tuple[object, ...]]
    ) -> None:
        cursor = raw_postgres.cursor()

        def twice_then_commit() -> None:
            with raw_postgres.pipeline():
                cursor.execute("INSERT INTO pinned (id) VALUES (2)")
                cursor.execute("INSERT INTO pinned (id) VALUES (2)")  # fails
                cursor.execute("COMMIT")

        with pytest.raises(psycopg.errors.UniqueViolation):
            twice_then_commit()
        assert cursor.statusmessage != "COMMIT"
        raw_postgres.rollback()
        assert raw_postgres.execute("SELECT id FROM pinned").fetchall() == []  # the first insert too


class TestUnitOfWork:
    @pytest.mark.parametrize("pipeline", [True, False])
    def test_commit_makes_the_writes_and_the_pending_objects_durable(
        self, probe: tuple[Engine, sessionmaker[Session], str], pipeline: bool
    ) -> None:
        engine, sessions, table = probe
        with sessions() as session:
            unit.begin(session)
            insert(session, table, 1)  # before the commit's own writes
            unit.commit(session, lambda: insert(session, table, 2, 3), pipeline)
        assert durable(engine, table) == [1, 2, 3]

    @pytest.mark.parametrize("pipeline", [True, False])
    def test_a_failed_write_fails_the_commit_and_nothing_is_durable(
        self, probe: tuple[Engine, sessionmaker[Session], str], pipeline: bool
    ) -> None:
        engine, sessions, table = probe
        with sessions() as session:
            unit.begin(session)
            insert(session, table, 1)
            with pytest.raises((IntegrityError, psycopg.errors.UniqueViolation)):
                unit.commit(session, lambda: insert(session, table, 2, 2), pipeline)
            unit.rollback(session)
        assert durable(engine, table) == []

    def test_a_transaction_commits_on_return_and_rolls_back_on_raise(
        self, probe: tuple[Engine, sessionmaker[Session], str]
    ) -> None:
        engine, sessions, table = probe
        with unit.transaction(sessions) as session:
            insert(session, table, 1)

        def failing() -> None:
            with unit.transaction(sessions) as session:
                insert(session, table, 2)
                raise RuntimeError("the caller failed")

        with pytest.raises(RuntimeError):
            failing()
        with sessions() as session, unit.begun(session):
            insert(session, table, 3)
        assert durable(engine, table) == [1, 3]
