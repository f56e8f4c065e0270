"""Interactive sessions (``sessions``) and their secret states (``secret_states``)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select

from service.store.models import AnalysisRequest, AnalysisSession, SecretState
from service.store.repositories.base import HistoryFilter, Repository, newest_first, storable


class SessionRepository(Repository):
    def add(self, row: AnalysisSession) -> None:
        self.session.add(row)

    def get(self, session_id: str) -> AnalysisSession | None:
        return self.session.get(AnalysisSession, session_id) if storable(session_id) else None

    def fresh(self, session_id: str) -> AnalysisSession | None:
        """Re-read (the caller holds the filter locks that guard every session transition)."""
        return self.session.get(AnalysisSession, session_id, populate_existing=True)

    def open_of(self, analyst: str) -> Sequence[AnalysisSession]:
        """Every open session of ``analyst``, read now (oldest first)."""
        if not storable(analyst):
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

    def history(self, wanted: HistoryFilter) -> Sequence[tuple[AnalysisSession, AnalysisRequest]]:
        """Sessions with their reservation's request row (one query), newest first: a keyset page
        (``newest_first``)."""
        query = select(AnalysisSession, AnalysisRequest).join(
            AnalysisRequest, AnalysisRequest.id == AnalysisSession.request_id
        )
        rows = self.session.execute(newest_first(query, AnalysisSession, wanted)).tuples().all()
        return [(row, request) for row, request in rows]
