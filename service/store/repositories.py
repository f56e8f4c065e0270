"""All SQL of the service. Repositories never commit: the domain's unit of work does (a writer batch through
``commit_pipelined``, which sends its COMMIT in the round trip of its last writes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from functools import cache
from typing import Any, TypeVar, cast

import psycopg
from sqlalchemy import Insert, Select, Table, Update, bindparam, func, insert, select, tuple_, update
from sqlalchemy.engine import CursorResult, RowMapping
from sqlalchemy.orm import Session

from service.store.models import (
    DATASET_SCOPE,
    AnalysisRequest,
    AnalysisSession,
    AnalystLimit,
    ApiKey,
    Dataset,
    Grant,
    LedgerEntry,
    PrivacyFilter,
    Refusal,
    RequestState,
    SecretState,
)

SelectT = TypeVar("SelectT", bound=Select[Any])


def _table(model: Any) -> Table:
    """A model's table, for plain (Core) statements on the hot path: no ORM objects, no unit of work. The
    writer's batch statements run on ``session.connection()`` (in the session's transaction), skipping the
    ORM's execution layer and its autoflush: the batch path never adds ORM objects to its session."""
    return cast(Table, model.__table__)


def _storable(key: str) -> bool:
    """No stored id contains NUL, and PostgreSQL cannot even compare text with one (an error, not a
    mismatch): a lookup by such an id finds nothing, on every backend."""
    return "\x00" not in key


# The writer's per-batch statements are built once, with expanding IN parameters: building a statement
# and deriving its cache key cost more CPU than executing it from SQLAlchemy's compiled cache (a fixed
# cost of every batch; benchmarks/writer_cost.py).


@cache
def _insert(table: Table) -> Insert:
    return insert(table)


@cache
def _update_by_id(table: Table) -> Update:
    return update(table).where(table.c.id == bindparam("_id"))


def _insert_rows(session: Session, table: Table, rows: Sequence[dict[str, Any]]) -> None:
    """One executemany INSERT of ``rows`` (column dicts, the same keys in every row)."""
    session.connection().execute(_insert(table), list(rows))


def _update_rows(session: Session, table: Table, rows: Sequence[dict[str, Any]]) -> None:
    """One executemany UPDATE of the rows whose ``id`` is each row's ``_id``, setting its other keys (the
    same in every row)."""
    session.connection().execute(_update_by_id(table), list(rows))


def _psycopg(session: Session) -> psycopg.Connection[Any] | None:
    """The session's driver connection if it is psycopg's (PostgreSQL), else None (SQLite)."""
    raw = session.connection().connection.dbapi_connection
    return raw if isinstance(raw, psycopg.Connection) else None


@contextmanager
def pipelined(session: Session) -> Iterator[None]:
    """Send the statements executed inside in one round trip where the driver can (psycopg's pipeline
    mode on PostgreSQL: one sync at the end); elsewhere (SQLite, in process) a no-op."""
    raw = _psycopg(session)
    if raw is None:
        yield
        return
    with raw.pipeline():
        yield


def commit_pipelined(session: Session, send: Callable[[], None]) -> None:
    """Run ``send`` (statements) and commit the session's transaction, in one round trip on PostgreSQL.

    In psycopg's pipeline mode the ``COMMIT`` is queued as a statement behind the statements of ``send``;
    leaving the pipeline is its single sync, and it raises the first error of any of them (the ``COMMIT``
    of a failed pipeline is not run). Nothing is sent after the ``COMMIT`` is confirmed, so a connection
    lost after that point cannot make a durable transaction look failed (and its work be redone). The
    session's own commit then finds the transaction ended (no I/O) and runs its after-commit hooks.
    Elsewhere (SQLite): ``send``, then the session's commit.
    """
    raw = _psycopg(session)
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


@cache
def _admissible_statement() -> Select[Any]:
    """Datasets (``dataset_ids``) with their archival time and their grants to any of ``analysts`` whose API
    key is not revoked (a grant of a revoked key is not returned)."""
    grants, keys = Grant.__table__, ApiKey.__table__
    active = (
        (Grant.dataset_id == Dataset.id)
        & Grant.analyst.in_(bindparam("analysts", expanding=True))
        & keys.c.revoked_at.is_(None)
    )
    joined = Dataset.__table__.outerjoin(grants.join(keys, keys.c.name == grants.c.analyst), active)
    return (
        select(Dataset.id, Dataset.archived_at, Grant.analyst)
        .select_from(joined)
        .where(Dataset.id.in_(bindparam("dataset_ids", expanding=True)))
    )


@cache
def _lock_statement() -> Select[Any]:
    """The filter rows of (dataset id, scope) ``pairs`` under ``FOR UPDATE``, in the global lock order."""
    t = _table(PrivacyFilter)
    return (
        select(
            t.c.id,
            t.c.dataset_id,
            t.c.scope,
            t.c.capacity,
            t.c.spent,
            t.c.reserved,
            t.c.delta_capacity,
            t.c.delta_spent,
            t.c.delta_reserved,
            t.c.last_seq,
            t.c.last_hash,
        )
        .where(tuple_(t.c.dataset_id, t.c.scope).in_(bindparam("pairs", expanding=True)))
        .order_by(t.c.dataset_id, t.c.id)
        .with_for_update()
    )


@cache
def _requests_by_ids() -> Select[Any]:
    t = _table(AnalysisRequest)
    return select(t).where(t.c.id.in_(bindparam("ids", expanding=True)))


@cache
def _requests_by_keys() -> Select[Any]:
    t = _table(AnalysisRequest)
    return select(t).where(tuple_(t.c.analyst, t.c.idempotency_key).in_(bindparam("pairs", expanding=True)))


class KeyRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def by_hash(self, key_hash: str) -> ApiKey | None:
        return self.session.scalar(
            select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
        )

    def by_name(self, name: str) -> ApiKey | None:
        if not _storable(name):
            return None
        return self.session.scalar(select(ApiKey).where(ApiKey.name == name))

    def add(self, key: ApiKey) -> None:
        self.session.add(key)

    def all(self) -> Sequence[ApiKey]:
        return self.session.scalars(select(ApiKey).order_by(ApiKey.id)).all()

    def active_count(self, role: str) -> int:
        """How many keys of ``role`` are not revoked."""
        active = select(func.count()).select_from(ApiKey).where(ApiKey.revoked_at.is_(None))
        return int(self.session.scalar(active.where(ApiKey.role == role)) or 0)

    def is_active(self, name: str) -> bool:
        """Whether a key named ``name`` exists and is not revoked, read from the database now."""
        if not _storable(name):
            return False
        found = self.session.scalar(select(ApiKey.id).where(ApiKey.name == name, ApiKey.revoked_at.is_(None)))
        return found is not None


class DatasetRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def get(self, dataset_id: str) -> Dataset | None:
        return self.session.get(Dataset, dataset_id) if _storable(dataset_id) else None

    def add(self, dataset: Dataset) -> None:
        self.session.add(dataset)

    def visible(self, analyst: str | None) -> Sequence[Dataset]:
        query = select(Dataset).order_by(Dataset.created_at, Dataset.id)
        if analyst is not None:
            query = query.join(Grant, Grant.dataset_id == Dataset.id).where(Grant.analyst == analyst)
        return self.session.scalars(query).all()

    def is_granted(self, dataset_id: str, analyst: str) -> bool:
        if not (_storable(dataset_id) and _storable(analyst)):
            return False
        found = self.session.scalar(
            select(Grant.id).where(Grant.dataset_id == dataset_id, Grant.analyst == analyst)
        )
        return found is not None

    def add_grant(self, grant: Grant) -> None:
        self.session.add(grant)

    def grants(self, dataset_id: str) -> Sequence[str]:
        if not _storable(dataset_id):
            return []
        return self.session.scalars(
            select(Grant.analyst).where(Grant.dataset_id == dataset_id).order_by(Grant.analyst)
        ).all()

    def delete_grant(self, dataset_id: str, analyst: str) -> bool:
        """Remove the grant; False if there was none."""
        if not (_storable(dataset_id) and _storable(analyst)):
            return False
        grant = self.session.scalar(
            select(Grant).where(Grant.dataset_id == dataset_id, Grant.analyst == analyst)
        )
        if grant is None:
            return False
        self.session.delete(grant)
        return True

    def archived_at(self, dataset_id: str) -> datetime | None:
        """When the dataset was archived (None: open, or no such dataset), read from the database now."""
        if not _storable(dataset_id):
            return None
        return self.session.scalar(select(Dataset.archived_at).where(Dataset.id == dataset_id))

    def admissible_many(
        self, dataset_ids: Sequence[str], analysts: Sequence[str]
    ) -> tuple[set[str], set[tuple[str, str]]]:
        """(archived datasets of ``dataset_ids``, their (dataset id, analyst) grants of ``analysts`` whose
        API key is not revoked), read now in one statement."""
        dataset_ids = [d for d in dataset_ids if _storable(d)]
        analysts = [a for a in analysts if _storable(a)]
        rows = (
            self.session.connection()
            .execute(_admissible_statement(), {"dataset_ids": dataset_ids, "analysts": analysts})
            .tuples()
        )
        archived, granted = set(), set()
        for dataset_id, archived_at, analyst in rows:
            if archived_at is not None:
                archived.add(dataset_id)
            if analyst is not None:
                granted.add((dataset_id, analyst))
        return archived, granted


class FilterRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def get(self, dataset_id: str, scope: str = DATASET_SCOPE) -> PrivacyFilter | None:
        return self.session.scalar(
            select(PrivacyFilter).where(PrivacyFilter.dataset_id == dataset_id, PrivacyFilter.scope == scope)
        )

    def lock(self, dataset_id: str, scope: str = DATASET_SCOPE) -> PrivacyFilter | None:
        """The filter row under ``SELECT … FOR UPDATE`` (PostgreSQL); SQLite holds BEGIN IMMEDIATE."""
        return self.session.scalar(
            select(PrivacyFilter)
            .where(PrivacyFilter.dataset_id == dataset_id, PrivacyFilter.scope == scope)
            .with_for_update()
            .execution_options(populate_existing=True)
        )

    def lock_scopes(self, dataset_id: str, scopes: Sequence[str]) -> Sequence[PrivacyFilter]:
        """Several filter rows of a dataset in one ``SELECT … FOR UPDATE``, locked in id order."""
        return self.session.scalars(
            select(PrivacyFilter)
            .where(PrivacyFilter.dataset_id == dataset_id, PrivacyFilter.scope.in_(scopes))
            .order_by(PrivacyFilter.id)
            .with_for_update()
            .execution_options(populate_existing=True)
        ).all()

    def lock_many(self, scopes: dict[str, Sequence[str]]) -> Sequence[RowMapping]:
        """The filter rows of several datasets' scopes as plain rows (no ORM objects), in one
        ``SELECT … FOR UPDATE`` ordered by (dataset id, id): the global lock order of every locking path
        (datasets in id order, a dataset's filters in id order). SQLite holds BEGIN IMMEDIATE instead."""
        pairs = [(d, s) for d in sorted(scopes) for s in scopes[d]]
        return self.session.connection().execute(_lock_statement(), {"pairs": pairs}).mappings().all()

    def write_totals(self, rows: Sequence[dict[str, Any]]) -> None:
        """One executemany UPDATE of the totals and chain heads of locked filter rows (key ``_id``)."""
        if not rows:
            return
        _update_rows(self.session, _table(PrivacyFilter), rows)

    def add(self, privacy_filter: PrivacyFilter) -> None:
        self.session.add(privacy_filter)

    def datasets_of_scope(self, scope: str) -> list[str]:
        """The ids of the datasets with a filter of ``scope`` (an analyst's sub-filters), in id order."""
        if not _storable(scope):
            return []
        query = select(PrivacyFilter.dataset_id).where(PrivacyFilter.scope == scope)
        return list(self.session.scalars(query.order_by(PrivacyFilter.dataset_id)).all())

    def for_dataset(self, dataset_id: str) -> Sequence[PrivacyFilter]:
        return self.session.scalars(
            select(PrivacyFilter).where(PrivacyFilter.dataset_id == dataset_id).order_by(PrivacyFilter.id)
        ).all()

    def all(self) -> Sequence[PrivacyFilter]:
        return self.session.scalars(select(PrivacyFilter).order_by(PrivacyFilter.id)).all()


class LedgerRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, entry: LedgerEntry) -> None:
        self.session.add(entry)

    def insert_many(self, entries: Sequence[dict[str, Any]]) -> None:
        """Append entries (column dicts, chain already computed) in one executemany INSERT."""
        if entries:
            _insert_rows(self.session, _table(LedgerEntry), entries)

    def page(
        self, dataset_id: str, after_seq: int, limit: int, analyst: str | None = None
    ) -> Sequence[LedgerEntry]:
        query = select(LedgerEntry).where(LedgerEntry.dataset_id == dataset_id, LedgerEntry.seq > after_seq)
        if analyst is not None:
            own = select(AnalysisRequest.id).where(
                AnalysisRequest.dataset_id == dataset_id, AnalysisRequest.analyst == analyst
            )
            query = query.where(LedgerEntry.request_id.in_(own))
        return self.session.scalars(query.order_by(LedgerEntry.seq).limit(limit)).all()

    def count(self, dataset_id: str) -> int:
        return int(
            self.session.scalar(
                select(func.count()).select_from(LedgerEntry).where(LedgerEntry.dataset_id == dataset_id)
            )
            or 0
        )

    def dataset_ids(self) -> Sequence[str]:
        return self.session.scalars(select(Dataset.id).order_by(Dataset.id)).all()

    def bodies_of(self, dataset_id: str, event: str) -> Sequence[str]:
        """The hashed bodies of one kind of entry of a dataset, in chain order (e.g. every budget set)."""
        return self.session.scalars(
            select(LedgerEntry.body)
            .where(LedgerEntry.dataset_id == dataset_id, LedgerEntry.event == event)
            .order_by(LedgerEntry.seq)
        ).all()

    def chain(self, dataset_id: str, after_seq: int, limit: int) -> Sequence[LedgerEntry]:
        return self.session.scalars(
            select(LedgerEntry)
            .where(LedgerEntry.dataset_id == dataset_id, LedgerEntry.seq > after_seq)
            .order_by(LedgerEntry.seq)
            .limit(limit)
        ).all()


class RequestRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def get(self, request_id: str) -> AnalysisRequest | None:
        return self.session.get(AnalysisRequest, request_id) if _storable(request_id) else None

    def fresh(self, request_id: str) -> AnalysisRequest | None:
        """Re-read from the database and lock the row (the caller holds the filter locks): a worker's claim or
        heartbeat, which take only this row, cannot interleave with the caller's check-then-transition."""
        return self.session.get(AnalysisRequest, request_id, populate_existing=True, with_for_update=True)

    def fresh_many(self, request_ids: Sequence[str]) -> Sequence[AnalysisRequest]:
        return self.session.scalars(
            select(AnalysisRequest)
            .where(AnalysisRequest.id.in_(request_ids))
            .execution_options(populate_existing=True)
        ).all()

    def rows(self, request_ids: Sequence[str]) -> Sequence[RowMapping]:
        """Plain rows (all columns) of ``request_ids``, read now (the batch path: no ORM identity map)."""
        if not request_ids:
            return []
        ids = list(request_ids)
        return self.session.connection().execute(_requests_by_ids(), {"ids": ids}).mappings().all()

    def by_keys(self, pairs: Sequence[tuple[str, str]]) -> Sequence[RowMapping]:
        """Plain rows of the requests stored under any (analyst, Idempotency-Key) of ``pairs``."""
        if not pairs:
            return []
        return self.session.connection().execute(_requests_by_keys(), {"pairs": list(pairs)}).mappings().all()

    def insert_many(self, rows: Sequence[dict[str, Any]]) -> None:
        """New request rows (every column given) in one executemany INSERT."""
        if rows:
            _insert_rows(self.session, _table(AnalysisRequest), rows)

    def update_many(self, rows: Sequence[dict[str, Any]]) -> None:
        """Settlements of requests (key ``_id``): state, charge, release, error and lease in one executemany
        UPDATE."""
        if not rows:
            return
        _update_rows(self.session, _table(AnalysisRequest), rows)

    def by_idempotency_key(self, analyst: str, key: str) -> AnalysisRequest | None:
        return self.session.scalar(
            select(AnalysisRequest).where(
                AnalysisRequest.analyst == analyst, AnalysisRequest.idempotency_key == key
            )
        )

    def add(self, request: AnalysisRequest) -> None:
        self.session.add(request)

    def claim(self, request_id: str, owner: str, now: datetime, until: datetime) -> bool:
        """Atomically take a queued request (running, unclaimed) for ``owner``: one conditional UPDATE,
        so of two workers (or two deliveries of one task) exactly one sees a row count of 1. The lease
        starts here; a cancel or the queue timeout (which abort only unclaimed requests, under a row lock)
        and a claim exclude each other."""
        result = self.session.execute(
            update(AnalysisRequest)
            .where(
                AnalysisRequest.id == request_id,
                AnalysisRequest.kind == "request",
                AnalysisRequest.state == RequestState.RUNNING,
                AnalysisRequest.lease_owner.is_(None),
            )
            .values(lease_owner=owner, lease_expires_at=until, started_at=now, updated_at=now)
            .execution_options(synchronize_session=False)
        )
        assert isinstance(result, CursorResult)
        return result.rowcount == 1

    def renew(self, request_id: str, owner: str | None, until: datetime, progress: float | None) -> bool:
        """Heartbeat: extend the lease of a request still running (and still ``owner``'s when given);
        store ``progress`` unless None. False when the request was settled or reaped meanwhile."""
        conditions = [AnalysisRequest.id == request_id, AnalysisRequest.state == RequestState.RUNNING]
        if owner is not None:
            conditions.append(AnalysisRequest.lease_owner == owner)
        values: dict[str, Any] = {"lease_expires_at": until}
        if progress is not None:
            values["progress"] = progress
        result = self.session.execute(
            update(AnalysisRequest)
            .where(*conditions)
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        assert isinstance(result, CursorResult)
        return result.rowcount == 1

    # ----- the claim order (fair queueing across analysts) ---------------------------------------------

    def _queued(self, mechanisms: Sequence[str], queue: str | None) -> list[Any]:
        return [
            AnalysisRequest.kind == "request",
            AnalysisRequest.state == RequestState.RUNNING,
            AnalysisRequest.lease_owner.is_(None),
            AnalysisRequest.queue.is_(None) if queue is None else AnalysisRequest.queue == queue,
            AnalysisRequest.mechanism.in_(mechanisms),
        ]

    def queued_analysts(self, mechanisms: Sequence[str], queue: str | None) -> dict[str, datetime]:
        """Analysts with queued requests that a worker knowing ``mechanisms`` can run, and when their
        oldest queued request was admitted."""
        rows: dict[str, datetime] = dict(
            self.session.execute(
                select(AnalysisRequest.analyst, func.min(AnalysisRequest.created_at))
                .where(*self._queued(mechanisms, queue))
                .group_by(AnalysisRequest.analyst)
            )
            .tuples()
            .all()
        )
        return rows

    def analyst_load(self, analysts: Sequence[str]) -> dict[str, tuple[int, datetime | None]]:
        """Per analyst: requests running on workers now, and when the analyst's latest run started."""
        running: dict[str, int] = dict(
            self.session.execute(
                select(AnalysisRequest.analyst, func.count())
                .where(
                    AnalysisRequest.analyst.in_(analysts),
                    AnalysisRequest.kind == "request",
                    AnalysisRequest.state == RequestState.RUNNING,
                    AnalysisRequest.lease_owner.is_not(None),
                )
                .group_by(AnalysisRequest.analyst)
            )
            .tuples()
            .all()
        )
        latest: dict[str, datetime | None] = dict(
            self.session.execute(
                select(AnalysisRequest.analyst, func.max(AnalysisRequest.started_at))
                .where(AnalysisRequest.analyst.in_(analysts), AnalysisRequest.kind == "request")
                .group_by(AnalysisRequest.analyst)
            )
            .tuples()
            .all()
        )
        return {a: (int(running.get(a, 0)), latest.get(a)) for a in analysts}

    def oldest_queued(self, analyst: str, mechanisms: Sequence[str], queue: str | None) -> str | None:
        return self.session.scalar(
            select(AnalysisRequest.id)
            .where(AnalysisRequest.analyst == analyst, *self._queued(mechanisms, queue))
            .order_by(AnalysisRequest.created_at, AnalysisRequest.id)
            .limit(1)
        )

    def queue_position(self, request: AnalysisRequest) -> int:
        """How many queued requests of the same analyst are ahead of ``request`` (its own, public)."""
        return int(
            self.session.scalar(
                select(func.count())
                .select_from(AnalysisRequest)
                .where(
                    AnalysisRequest.analyst == request.analyst,
                    AnalysisRequest.kind == "request",
                    AnalysisRequest.state == RequestState.RUNNING,
                    AnalysisRequest.lease_owner.is_(None),
                    AnalysisRequest.created_at < request.created_at,
                )
            )
            or 0
        )

    def active_counts(self, analyst: str, not_counted: Sequence[str]) -> tuple[int, int]:
        """(requests queued or running on workers, open sessions) of ``analyst``; requests of the
        mechanisms in ``not_counted`` (run inline by the API) do not count."""
        if not _storable(analyst):
            return 0, 0
        rows: dict[str, int] = dict(
            self.session.execute(
                select(AnalysisRequest.kind, func.count())
                .where(
                    AnalysisRequest.analyst == analyst,
                    AnalysisRequest.state == RequestState.RUNNING,
                    (AnalysisRequest.kind == "session") | AnalysisRequest.mechanism.not_in(not_counted),
                )
                .group_by(AnalysisRequest.kind)
            )
            .tuples()
            .all()
        )
        return int(rows.get("request", 0)), int(rows.get("session", 0))

    def expired_claimed(self, now: datetime, limit: int = 100) -> Sequence[AnalysisRequest]:
        """Requests a worker claimed whose lease expired (no heartbeat): the worker was lost."""
        return self.session.scalars(
            select(AnalysisRequest)
            .where(
                AnalysisRequest.state == RequestState.RUNNING,
                AnalysisRequest.kind == "request",
                AnalysisRequest.lease_owner.is_not(None),
                AnalysisRequest.lease_expires_at < now,
            )
            .limit(limit)
        ).all()

    def overdue_queued(self, admitted_before: datetime, limit: int = 100) -> Sequence[AnalysisRequest]:
        """Queued requests (never claimed) admitted before ``admitted_before``."""
        return self.session.scalars(
            select(AnalysisRequest)
            .where(
                AnalysisRequest.state == RequestState.RUNNING,
                AnalysisRequest.kind == "request",
                AnalysisRequest.lease_owner.is_(None),
                AnalysisRequest.created_at < admitted_before,
            )
            .order_by(AnalysisRequest.created_at)
            .limit(limit)
        ).all()

    def claimed_by(self, owners: Sequence[str]) -> Sequence[AnalysisRequest]:
        return self.session.scalars(
            select(AnalysisRequest).where(
                AnalysisRequest.state == RequestState.RUNNING, AnalysisRequest.lease_owner.in_(owners)
            )
        ).all()

    def expired_running(self, now: datetime, kind: str, limit: int = 100) -> Sequence[AnalysisRequest]:
        return self.session.scalars(
            select(AnalysisRequest)
            .where(
                AnalysisRequest.state == RequestState.RUNNING,
                AnalysisRequest.kind == kind,
                AnalysisRequest.lease_expires_at < now,
            )
            .limit(limit)
        ).all()

    def history(
        self,
        analyst: str | None,
        dataset_id: str | None,
        state: str | None,
        before: tuple[datetime, str] | None,
        limit: int,
    ) -> Sequence[AnalysisRequest]:
        """Requests (not sessions' reservations), newest first (``created_at``, then ``id``, descending),
        of ``analyst`` / ``dataset_id`` / in ``state`` when given; only those listed after the position
        ``before`` (a ``(created_at, id)`` of an earlier page's last item): a keyset page."""
        query = select(AnalysisRequest).where(AnalysisRequest.kind == "request")
        query = _newest_first(query, AnalysisRequest, analyst, dataset_id, state, before)
        return self.session.scalars(query.limit(limit)).all()


def _newest_first(
    query: SelectT,
    model: type[AnalysisRequest] | type[AnalysisSession],
    analyst: str | None,
    dataset_id: str | None,
    state: str | None,
    before: tuple[datetime, str] | None,
) -> SelectT:
    """A history query: the given filters, rows after the keyset position ``before`` (an earlier page's
    last (created_at, id)), newest first with ``id`` breaking ties."""
    if analyst is not None:
        query = query.where(model.analyst == analyst)
    if dataset_id is not None:
        query = query.where(model.dataset_id == dataset_id)
    if state is not None:
        query = query.where(model.state == state)
    if before is not None:
        at, last_id = before
        query = query.where((model.created_at < at) | ((model.created_at == at) & (model.id < last_id)))
    return query.order_by(model.created_at.desc(), model.id.desc())


class SessionRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, row: AnalysisSession) -> None:
        self.session.add(row)

    def get(self, session_id: str) -> AnalysisSession | None:
        return self.session.get(AnalysisSession, session_id) if _storable(session_id) else None

    def fresh(self, session_id: str) -> AnalysisSession | None:
        """Re-read (the caller holds the filter locks that guard every session transition)."""
        return self.session.get(AnalysisSession, session_id, populate_existing=True)

    def open_of(self, analyst: str) -> Sequence[AnalysisSession]:
        """Every open session of ``analyst``, read now (oldest first)."""
        if not _storable(analyst):
            return []
        query = (
            select(AnalysisSession)
            .where(AnalysisSession.analyst == analyst, AnalysisSession.state == "open")
            .order_by(AnalysisSession.created_at, AnalysisSession.id)
        )
        return self.session.scalars(query.execution_options(populate_existing=True)).all()

    def by_request(self, request_id: str) -> AnalysisSession | None:
        return self.session.scalar(select(AnalysisSession).where(AnalysisSession.request_id == request_id))

    def add_secret(self, secret: SecretState) -> None:
        self.session.add(secret)

    def secret(self, request_id: str) -> SecretState | None:
        return self.session.get(SecretState, request_id, populate_existing=True)

    def drop_secret(self, request_id: str) -> None:
        secret = self.secret(request_id)
        if secret is not None:
            self.session.delete(secret)

    def history(
        self,
        analyst: str | None,
        dataset_id: str | None,
        state: str | None,
        before: tuple[datetime, str] | None,
        limit: int,
    ) -> Sequence[tuple[AnalysisSession, AnalysisRequest]]:
        """Sessions with their reservation's request row (one query), newest first (``created_at``, then
        ``id``, descending), of ``analyst`` / ``dataset_id`` / in ``state`` when given; only those listed
        after the position ``before`` (a ``(created_at, id)`` of an earlier page's last item)."""
        query = select(AnalysisSession, AnalysisRequest).join(
            AnalysisRequest, AnalysisRequest.id == AnalysisSession.request_id
        )
        query = _newest_first(query, AnalysisSession, analyst, dataset_id, state, before)
        rows = self.session.execute(query.limit(limit)).tuples().all()
        return [(row, request) for row, request in rows]


class RefusalRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, refusal: Refusal) -> None:
        self.session.add(refusal)

    def page(
        self, dataset_id: str, after_id: int, limit: int, analyst: str | None = None
    ) -> Sequence[Refusal]:
        query = select(Refusal).where(Refusal.dataset_id == dataset_id, Refusal.id > after_id)
        if analyst is not None:
            query = query.where(Refusal.analyst == analyst)
        return self.session.scalars(query.order_by(Refusal.id).limit(limit)).all()


class ActivityRepository:
    """What is in flight on a dataset: running requests and open sessions (public columns only)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def running_requests(self, dataset_id: str, analyst: str | None, limit: int) -> Sequence[Any]:
        query = select(
            AnalysisRequest.id,
            AnalysisRequest.analyst,
            AnalysisRequest.mechanism,
            AnalysisRequest.worst_case,
            AnalysisRequest.created_at,
            AnalysisRequest.lease_expires_at,
        ).where(
            AnalysisRequest.dataset_id == dataset_id,
            AnalysisRequest.state == RequestState.RUNNING,
            AnalysisRequest.kind == "request",
        )
        if analyst is not None:
            query = query.where(AnalysisRequest.analyst == analyst)
        return self.session.execute(
            query.order_by(AnalysisRequest.created_at, AnalysisRequest.id).limit(limit)
        ).all()

    def open_sessions(self, dataset_id: str, analyst: str | None, limit: int) -> Sequence[Any]:
        query = (
            select(
                AnalysisSession.id,
                AnalysisSession.analyst,
                AnalysisSession.mechanism,
                AnalysisSession.params,
                func.json_array_length(AnalysisSession.steps).label("asked"),
                AnalysisSession.created_at,
                AnalysisSession.expires_at,
                AnalysisRequest.worst_case,
            )
            .join(AnalysisRequest, AnalysisRequest.id == AnalysisSession.request_id)
            .where(AnalysisSession.dataset_id == dataset_id, AnalysisSession.state == "open")
        )
        if analyst is not None:
            query = query.where(AnalysisSession.analyst == analyst)
        return self.session.execute(
            query.order_by(AnalysisSession.created_at, AnalysisSession.id).limit(limit)
        ).all()


class LimitRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def get(self, analyst: str) -> AnalystLimit | None:
        return self.session.get(AnalystLimit, analyst) if _storable(analyst) else None

    def add(self, row: AnalystLimit) -> None:
        self.session.add(row)
