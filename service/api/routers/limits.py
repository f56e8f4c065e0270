from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import Admin, AdminOrAnalyst, RuntimeDep, SessionDep
from service.api.schemas import LimitsIn, LimitsOut
from service.runs import admin as actions
from service.runs import limits

router = APIRouter(prefix="/v1/analysts", tags=["limits"])


@router.get(
    "/{analyst}/limits",
    operation_id="getLimits",
    summary="An analyst's execution limits and what is in use now",
)
def get_limits(analyst: str, runtime: RuntimeDep, session: SessionDep, who: AdminOrAnalyst) -> LimitsOut:
    return LimitsOut(**limits.view(session, who, analyst, runtime.limits()))


@router.put(
    "/{analyst}/limits",
    operation_id="setLimits",
    summary="Set an analyst's limits on requests queued or running at once and on open sessions (admin)",
)
def put_limits(analyst: str, body: LimitsIn, runtime: RuntimeDep, admin: Admin) -> LimitsOut:
    actions.set_limits(runtime.sessions, admin, analyst, body.max_running_requests, body.max_open_sessions)
    with runtime.sessions() as session:
        return LimitsOut(**limits.view(session, admin, analyst, runtime.limits()))
