"""The unit of work: the one module of ``service/`` that begins and commits transactions.

Every write of the service is one transaction opened here (:func:`transaction` on a new session, or
:func:`begun` on a session the caller holds), and every transaction ends here: committed when the block
returns, rolled back when it raises. Repositories never commit. The writer's batches commit through
:func:`commit`, which on PostgreSQL sends the batch's last writes and its ``COMMIT`` in one round trip
(psycopg's pipeline mode: :func:`pipelined`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from sqlalchemy.orm import Session, sessionmaker


@contextmanager
def transaction(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """A new session in a transaction: committed when the block returns, rolled back when it raises."""
    with sessions() as session, session.begin():
        yield session


@contextmanager
def begun(session: Session) -> Iterator[Session]:
    """A transaction on ``session`` (which has none yet): committed when the block returns, rolled back
    when it raises."""
    with session.begin():
        yield session


def begin(session: Session) -> None:
    """Begin a transaction on ``session`` that :func:`commit` ends (closing the session uncommitted, or
    :func:`rollback`, rolls it back)."""
    session.begin()


def rollback(session: Session) -> None:
    session.rollback()


def _psycopg(session: Session) -> psycopg.Connection[Any] | None:
    """The session's driver connection if it is psycopg's (PostgreSQL), else None (SQLite)."""
    raw = session.connection().connection.dbapi_connection
    return raw if isinstance(raw, psycopg.Connection) else None


@contextmanager
def pipelined(session: Session) -> Iterator[None]:
    """Send the statements executed inside in one round trip where the driver can (psycopg's pipeline
    mode on PostgreSQL: one sync at the end); elsewhere (SQLite, in process) a no-op. An error of any
    statement is raised at the end, as psycopg's own exception."""
    raw = _psycopg(session)
    if raw is None:
        yield
        return
    with raw.pipeline():
        yield


def commit(session: Session, send: Callable[[], None], pipeline: bool = False) -> None:
    """Run ``send`` (the last statements), then commit the session's transaction begun by :func:`begin`.
    Pending ORM objects are flushed first, so they are in the same transaction.

    With ``pipeline`` on PostgreSQL, the statements of ``send`` and the ``COMMIT`` go in one round trip: in
    psycopg's pipeline mode the ``COMMIT`` is queued behind them; leaving the pipeline is its single sync,
    and it raises the first error of any of them (the ``COMMIT`` of a failed pipeline is not run). Nothing
    is sent after the ``COMMIT`` is confirmed, so a connection lost after that point cannot make a durable
    transaction look failed (and its work be redone). The session's own commit then finds the transaction
    ended (no I/O) and runs its after-commit hooks. Elsewhere (SQLite, or without ``pipeline``): ``send``,
    then the session's commit (errors as SQLAlchemy's exceptions).
    """
    session.flush()
    raw = _psycopg(session) if pipeline else None
    if raw is None:
        send()
        session.commit()
        return
    cursor = raw.cursor()
    try:
        with raw.pipeline():
            send()
            cursor.execute("COMMIT")
        status = cursor.statusmessage
    finally:
        cursor.close()
    if status != "COMMIT":  # PostgreSQL answers ROLLBACK for a transaction that had failed
        raise RuntimeError(f"the database did not commit the transaction ({status})")
    session.commit()
