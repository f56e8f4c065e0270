"""Requests (``requests``): the batch's rows, claims and leases, the queue, history."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import ColumnElement, Select, bindparam, func, select, tuple_, update
from sqlalchemy.engine import CursorResult, RowMapping

from service.store.models import AnalysisRequest, RequestState
from service.store.repositories.base import (
    HistoryFilter,
    Repository,
    insert_rows,
    newest_first,
    storable,
    table_of,
    update_rows,
)


@cache
def _requests_by_ids(lock: bool) -> Select[Any]:
    t = table_of(AnalysisRequest)
    statement = select(t).where(t.c.id.in_(bindparam("ids", expanding=True)))
    return statement.with_for_update() if lock else statement


@cache
def _requests_by_keys() -> Select[Any]:
    t = table_of(AnalysisRequest)
    return select(t).where(tuple_(t.c.analyst, t.c.idempotency_key).in_(bindparam("pairs", expanding=True)))


class RequestRepository(Repository):
    def get(self, request_id: str) -> AnalysisRequest | None:
        return self.session.get(AnalysisRequest, request_id) if storable(request_id) else None

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

    def rows(self, request_ids: Sequence[str], lock: bool = False) -> Sequence[RowMapping]:
        """Plain rows (all columns) of ``request_ids``, read now (the batch path: no ORM identity map);
        with ``lock``, under ``SELECT … FOR UPDATE``."""
        if not request_ids:
            return []
        ids = list(request_ids)
        return self.session.connection().execute(_requests_by_ids(lock), {"ids": ids}).mappings().all()

    def by_keys(self, pairs: Sequence[tuple[str, str]]) -> Sequence[RowMapping]:
        """Plain rows of the requests stored under any (analyst, Idempotency-Key) of ``pairs``."""
        if not pairs:
            return []
        return self.session.connection().execute(_requests_by_keys(), {"pairs": list(pairs)}).mappings().all()

    def insert_many(self, rows: Sequence[dict[str, Any]]) -> None:
        """New request rows (every column given) in one executemany INSERT."""
        if rows:
            insert_rows(self.session, table_of(AnalysisRequest), rows)

    def update_many(self, rows: Sequence[dict[str, Any]]) -> None:
        """Transitions of requests (key ``_id``; the same columns in every row) in one executemany
        UPDATE."""
        if not rows:
            return
        update_rows(self.session, table_of(AnalysisRequest), rows)

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
        if not storable(analyst):
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
        claimed = AnalysisRequest.lease_owner.is_not(None)
        return self._running("request", claimed, AnalysisRequest.lease_expires_at < now, limit=limit)

    def overdue_queued(self, admitted_before: datetime, limit: int = 100) -> Sequence[AnalysisRequest]:
        """Queued requests (never claimed) admitted before ``admitted_before``, oldest first."""
        queued = AnalysisRequest.lease_owner.is_(None)
        return self._running("request", queued, AnalysisRequest.created_at < admitted_before, limit=limit)

    def claimed_by(self, owners: Sequence[str]) -> Sequence[AnalysisRequest]:
        return self._running(None, AnalysisRequest.lease_owner.in_(owners))

    def expired_running(self, now: datetime, kind: str, limit: int = 100) -> Sequence[AnalysisRequest]:
        return self._running(kind, AnalysisRequest.lease_expires_at < now, limit=limit)

    def _running(
        self, kind: str | None, *conditions: ColumnElement[bool], limit: int | None = None
    ) -> Sequence[AnalysisRequest]:
        """Running requests (of ``kind`` when given) meeting ``conditions``, oldest first."""
        query = select(AnalysisRequest).where(AnalysisRequest.state == RequestState.RUNNING, *conditions)
        if kind is not None:
            query = query.where(AnalysisRequest.kind == kind)
        return self.session.scalars(query.order_by(AnalysisRequest.created_at).limit(limit)).all()

    def history(self, wanted: HistoryFilter) -> Sequence[AnalysisRequest]:
        """Requests (not sessions' reservations), newest first: a keyset page (``newest_first``)."""
        query = select(AnalysisRequest).where(AnalysisRequest.kind == "request")
        return self.session.scalars(newest_first(query, AnalysisRequest, wanted)).all()
