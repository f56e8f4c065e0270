"""Datasets and their grants (``datasets``, ``grants``)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import Select, bindparam, select

from service.store.models import ApiKey, Dataset, Grant
from service.store.repositories.base import Repository, storable


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


class DatasetRepository(Repository):
    def get(self, dataset_id: str) -> Dataset | None:
        return self.session.get(Dataset, dataset_id) if storable(dataset_id) else None

    def add(self, dataset: Dataset) -> None:
        self.session.add(dataset)

    def visible(self, analyst: str | None) -> Sequence[Dataset]:
        query = select(Dataset).order_by(Dataset.created_at, Dataset.id)
        if analyst is not None:
            query = query.join(Grant, Grant.dataset_id == Dataset.id).where(Grant.analyst == analyst)
        return self.session.scalars(query).all()

    def is_granted(self, dataset_id: str, analyst: str) -> bool:
        if not (storable(dataset_id) and storable(analyst)):
            return False
        found = self.session.scalar(
            select(Grant.id).where(Grant.dataset_id == dataset_id, Grant.analyst == analyst)
        )
        return found is not None

    def add_grant(self, grant: Grant) -> None:
        self.session.add(grant)

    def grants(self, dataset_id: str) -> Sequence[str]:
        if not storable(dataset_id):
            return []
        return self.session.scalars(
            select(Grant.analyst).where(Grant.dataset_id == dataset_id).order_by(Grant.analyst)
        ).all()

    def delete_grant(self, dataset_id: str, analyst: str) -> bool:
        """Remove the grant; False if there was none."""
        if not (storable(dataset_id) and storable(analyst)):
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
        if not storable(dataset_id):
            return None
        return self.session.scalar(select(Dataset.archived_at).where(Dataset.id == dataset_id))

    def admissible_many(
        self, dataset_ids: Sequence[str], analysts: Sequence[str]
    ) -> tuple[set[str], set[tuple[str, str]]]:
        """(archived datasets of ``dataset_ids``, their (dataset id, analyst) grants of ``analysts`` whose
        API key is not revoked), read now in one statement."""
        dataset_ids = [d for d in dataset_ids if storable(d)]
        analysts = [a for a in analysts if storable(a)]
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
