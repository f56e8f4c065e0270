"""The shared pieces of the repositories: a model's table for plain statements, the NUL guard and
the executemany helpers of the batch path."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any, TypeVar, cast

from sqlalchemy import Insert, Select, Table, Update, bindparam, insert, update
from sqlalchemy.orm import Session

SelectT = TypeVar("SelectT", bound=Select[Any])


class Repository:
    """The SQL of one table (or two that are read together), on the caller's session: it never begins or
    commits (``service.store.unit`` does)."""

    def __init__(self, session: Session) -> None:
        self.session = session


@dataclass(frozen=True)
class HistoryFilter:
    """A history listing's filters (each None: any), its keyset position ``before`` (an earlier page's
    last ``(created_at, id)``) and how many rows to fetch."""

    analyst: str | None
    dataset_id: str | None
    state: str | None
    before: tuple[datetime, str] | None
    limit: int


def table_of(model: Any) -> Table:
    """A model's table, for plain (Core) statements on the hot path: no ORM objects, no unit of work. The
    writer's batch statements run on ``session.connection()`` (in the session's transaction), skipping the
    ORM's execution layer and its autoflush: the batch path never adds ORM objects to its session."""
    return cast(Table, model.__table__)


def storable(key: str) -> bool:
    """No stored id contains NUL, and PostgreSQL cannot even compare text with one (an error, not a
    mismatch): a lookup by such an id finds nothing, on every backend."""
    return "\x00" not in key


@cache
def _insert(table: Table) -> Insert:
    return insert(table)


@cache
def _update_by_id(table: Table) -> Update:
    return update(table).where(table.c.id == bindparam("_id"))


def insert_rows(session: Session, table: Table, rows: Sequence[dict[str, Any]]) -> None:
    """One executemany INSERT of ``rows`` (column dicts, the same keys in every row)."""
    session.connection().execute(_insert(table), list(rows))


def update_rows(session: Session, table: Table, rows: Sequence[dict[str, Any]]) -> None:
    """One executemany UPDATE of the rows whose ``id`` is each row's ``_id``, setting its other keys (the
    same in every row)."""
    session.connection().execute(_update_by_id(table), list(rows))


def newest_first(query: SelectT, model: Any, wanted: HistoryFilter) -> SelectT:
    """A history query: the given filters, rows after the keyset position ``before`` (an earlier page's
    last (created_at, id)), newest first with ``id`` breaking ties."""
    if wanted.analyst is not None:
        query = query.where(model.analyst == wanted.analyst)
    if wanted.dataset_id is not None:
        query = query.where(model.dataset_id == wanted.dataset_id)
    if wanted.state is not None:
        query = query.where(model.state == wanted.state)
    if wanted.before is not None:
        at, last_id = wanted.before
        query = query.where((model.created_at < at) | ((model.created_at == at) & (model.id < last_id)))
    return query.order_by(model.created_at.desc(), model.id.desc()).limit(wanted.limit)
