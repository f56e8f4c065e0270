from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from service.api.deps import RuntimeDep
from service.api.schemas import StatusOut
from service.errors import NotReady

router = APIRouter(tags=["health"])


@router.get(
    "/healthz", operation_id="getLiveness", summary="Liveness: the process answers (no database access)"
)
async def healthz() -> StatusOut:
    """On the event loop: a real no-op (a sync route would hop to the thread pool, which is work the
    liveness probe and the throughput benchmark's no-op baseline must not include)."""
    return StatusOut(status="ok")


@router.get("/readyz", operation_id="getReadiness", summary="Readiness: the database answers")
def readyz(runtime: RuntimeDep) -> StatusOut:
    if runtime.draining.is_set():  # SIGTERM: load balancers stop sending work while runs finish
        raise NotReady("the server is shutting down")
    try:
        with runtime.sessions() as session:
            session.execute(text("SELECT 1"))
    except Exception as exc:
        raise NotReady("the database is not reachable") from exc
    return StatusOut(status="ready")
