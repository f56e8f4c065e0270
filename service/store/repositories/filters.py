"""Privacy filters (``filters``): reads, the batch's lock and its totals."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from sqlalchemy import Select, bindparam, select, tuple_
from sqlalchemy.engine import RowMapping

from service.store.models import DATASET_SCOPE, PrivacyFilter
from service.store.repositories.base import Repository, storable, table_of, update_rows


@cache
def _lock_statement() -> Select[Any]:
    """The filter rows of (dataset id, scope) ``pairs`` under ``FOR UPDATE``, in the global lock order."""
    t = table_of(PrivacyFilter)
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


class FilterRepository(Repository):
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
        update_rows(self.session, table_of(PrivacyFilter), rows)

    def add(self, privacy_filter: PrivacyFilter) -> None:
        self.session.add(privacy_filter)

    def datasets_of_scope(self, scope: str) -> list[str]:
        """The ids of the datasets with a filter of ``scope`` (an analyst's sub-filters), in id order."""
        if not storable(scope):
            return []
        query = select(PrivacyFilter.dataset_id).where(PrivacyFilter.scope == scope)
        return list(self.session.scalars(query.order_by(PrivacyFilter.dataset_id)).all())

    def for_dataset(self, dataset_id: str) -> Sequence[PrivacyFilter]:
        return self.session.scalars(
            select(PrivacyFilter).where(PrivacyFilter.dataset_id == dataset_id).order_by(PrivacyFilter.id)
        ).all()

    def all(self) -> Sequence[PrivacyFilter]:
        return self.session.scalars(select(PrivacyFilter).order_by(PrivacyFilter.id)).all()
