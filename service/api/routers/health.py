from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from service.api.deps import RuntimeDep
from service.errors import NotReady

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers (no database access)")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: the database answers")
def readyz(runtime: RuntimeDep) -> dict[str, str]:
    try:
        with runtime.sessions() as session:
            session.execute(text("SELECT 1"))
    except Exception as exc:
        raise NotReady("the database is not reachable") from exc
    return {"status": "ready"}
