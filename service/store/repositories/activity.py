"""What is in flight on a dataset (``requests`` with ``sessions``), for the dashboard."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select

from service.store.models import AnalysisRequest, AnalysisSession, RequestState
from service.store.repositories.base import Repository


class ActivityRepository(Repository):
    """What is in flight on a dataset: running requests and open sessions (public columns only)."""

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
