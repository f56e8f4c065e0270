from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import Field

from service.api.deps import AdminOrAnalyst, SessionDep
from service.api.schemas import StrictModel
from service.runs import reports

router = APIRouter(tags=["requests"])


class PrivacyReportIn(StrictModel):
    record: dict[str, Any] = Field(
        max_length=201,
        description="the caller's own record: feature values and the label, by column name",
        examples=[{"age": 42.0, "region": "north", "churn": "yes"}],
    )


@router.post(
    "/v1/requests/{request_id}/privacy-report",
    summary="Evaluate a release's per-instance privacy report on your own record (no data access, no charge)",
    description=(
        "Serves the reporting functions of `objpert.logistic` and `adaops.ridge` (public and data-dependent "
        "families). Callable by whoever may read the release: the admin and the requesting analyst. Viewers "
        "get 403 and other analysts 404, as for reading the release, because the report reveals the model "
        "(docs/privacy/adaops.md#adaops-reports)."
    ),
)
def privacy_report(
    request_id: str, body: PrivacyReportIn, session: SessionDep, who: AdminOrAnalyst
) -> dict[str, Any]:
    return reports.privacy_report(session, who, request_id, body.record)
