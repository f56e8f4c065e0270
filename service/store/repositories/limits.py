"""Per-analyst execution limits (``analyst_limits``)."""

from __future__ import annotations

from service.store.models import AnalystLimit
from service.store.repositories.base import Repository, storable


class LimitRepository(Repository):
    def get(self, analyst: str) -> AnalystLimit | None:
        return self.session.get(AnalystLimit, analyst) if storable(analyst) else None

    def add(self, row: AnalystLimit) -> None:
        self.session.add(row)
