"""Read endpoints for the dashboard: what is in flight on a dataset, and what the budget refused.

Viewers and admins see everyone's; analysts see only their own (and only on datasets they are granted).
Public information only: no release, no session answer, never any secret state.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from mechanisms.base import has_public_progress
from mechanisms.catalog import MECHANISMS
from service import datasets
from service.api.deps import AnyRole, SessionDep
from service.api.schemas import ActivityOut, RefusalPage
from service.auth import Role
from service.filter.budget import budget_view
from service.filter.refusals import refusal_out
from service.runs import views

router = APIRouter(prefix="/v1/datasets", tags=["dashboard"])

MAX_REFUSAL_ID = 2**31 - 1
"""Refusal ids are 32-bit integers (PostgreSQL ``integer``): a larger cursor is bad input, not a 500."""


def _at(curve: dict[str, Any], alpha: float | str | None) -> float | str | None:
    """The curve's value at a slot (an order, or "pure"); None when there is no such slot."""
    if alpha is None:
        return None
    if alpha == "pure":
        value: float | str | None = curve.get("pure")
        return value
    orders, values = curve.get("orders", []), curve.get("values", [])
    for order, value in zip(orders, values, strict=False):
        if order == alpha:
            return value
    return None


@router.get(
    "/{dataset_id}/activity",
    operation_id="getActivity",
    response_model=ActivityOut,
    summary="In flight: running requests and open sessions with their reserved worst case",
)
def get_activity(
    dataset_id: str,
    session: SessionDep,
    who: AnyRole,
    limit: Annotated[int, Query(ge=1, le=1000, description="at most this many of each")] = 200,
) -> dict[str, Any]:
    dataset = datasets.visible_dataset(session, who, dataset_id)
    flt = views.filter_of(session, dataset_id)
    binding = budget_view(flt, dataset.orders)["binding_alpha"] if flt is not None else None
    requests = [
        {
            "id": row.id,
            "analyst": row.analyst,
            "mechanism": row.mechanism,
            "worst_case_pure": row.worst_case["curve"]["pure"],
            "worst_case_binding": _at(row.worst_case["curve"], binding),
            "since": row.created_at,
            # Heartbeat times track a run's progress: shown only where that progress is public.
            "lease_expires_at": (
                row.lease_expires_at if has_public_progress(MECHANISMS.get(row.mechanism)) else None
            ),
        }
        for row in views.running_requests(session, who, dataset_id, limit)
    ]
    sessions = [
        {
            "id": row.id,
            "analyst": row.analyst,
            "mechanism": row.mechanism,
            "asked": int(row.asked or 0),
            "max_queries": row.params.get("max_queries") if isinstance(row.params, dict) else None,
            "worst_case_pure": row.worst_case["curve"]["pure"],
            "worst_case_binding": _at(row.worst_case["curve"], binding),
            "since": row.created_at,
            "expires_at": row.expires_at,
        }
        for row in views.open_sessions(session, who, dataset_id, limit)
    ]
    return {"dataset_id": dataset_id, "binding_alpha": binding, "requests": requests, "sessions": sessions}


@router.get(
    "/{dataset_id}/refusals",
    operation_id="listRefusals",
    response_model=RefusalPage,
    summary="Refused requests and sessions in order (analysts: their own; viewers: without parameters)",
)
def get_refusals(
    dataset_id: str,
    session: SessionDep,
    who: AnyRole,
    after: Annotated[int, Query(ge=0, le=MAX_REFUSAL_ID, description="return refusals with id > after")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    rows = views.refusals_page(session, who, dataset_id, after, limit)
    next_after = rows[-1].id if len(rows) == limit else None
    items = [refusal_out(row) for row in rows]
    if who.role is Role.viewer:  # viewers see what was refused and why, never the parameters
        items = [{**item, "params": None} for item in items]
    return {"items": items, "next_after": next_after}
