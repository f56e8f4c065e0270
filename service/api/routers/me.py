"""Who the caller is: the name and role of the API key (for dashboards and CLIs that adapt to the role)."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import AnyRole
from service.api.schemas import MeOut

router = APIRouter(tags=["keys"])


@router.get("/v1/me", operation_id="getMe", summary="The caller's key name and role")
def me(who: AnyRole) -> MeOut:
    return MeOut(name=who.name, role=who.role)
