"""Stored refusals (``refusals``)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select

from service.store.models import Refusal
from service.store.repositories.base import Repository


class RefusalRepository(Repository):
    def add(self, refusal: Refusal) -> None:
        self.session.add(refusal)

    def page(
        self, dataset_id: str, after_id: int, limit: int, analyst: str | None = None
    ) -> Sequence[Refusal]:
        query = select(Refusal).where(Refusal.dataset_id == dataset_id, Refusal.id > after_id)
        if analyst is not None:
            query = query.where(Refusal.analyst == analyst)
        return self.session.scalars(query.order_by(Refusal.id).limit(limit)).all()
