"""The ledger (``ledger``): appended entries, pages and chains."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select

from service.store.models import AnalysisRequest, Dataset, LedgerEntry
from service.store.repositories.base import Repository, insert_rows, table_of


class LedgerRepository(Repository):
    def add(self, entry: LedgerEntry) -> None:
        self.session.add(entry)

    def insert_many(self, entries: Sequence[dict[str, Any]]) -> None:
        """Append entries (column dicts, chain already computed) in one executemany INSERT."""
        if entries:
            insert_rows(self.session, table_of(LedgerEntry), entries)

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
