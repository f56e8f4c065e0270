from __future__ import annotations

from fastapi import APIRouter

from service import limits
from service.deps import Admin, AdminOrAnalyst, CtxDep, SessionDep
from service.schemas import LimitsIn, LimitsOut

router = APIRouter(prefix="/v1/analysts", tags=["limits"])


@router.get("/{analyst}/limits", summary="An analyst's execution limits and what is in use now")
def get_limits(analyst: str, ctx: CtxDep, session: SessionDep, who: AdminOrAnalyst) -> LimitsOut:
    return LimitsOut(**limits.view(session, who, analyst, ctx.limits()))


@router.put(
    "/{analyst}/limits",
    summary="Set an analyst's limits on requests queued or running at once and on open sessions (admin)",
)
def put_limits(analyst: str, body: LimitsIn, ctx: CtxDep, admin: Admin) -> LimitsOut:
    with ctx.sessions() as session, session.begin():
        limits.set_limits(session, admin, analyst, body.max_running_requests, body.max_open_sessions)
    with ctx.sessions() as session:
        return LimitsOut(**limits.view(session, admin, analyst, ctx.limits()))
