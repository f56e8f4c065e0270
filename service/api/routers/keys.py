from __future__ import annotations

from fastapi import APIRouter, Request

from service.api.deps import Admin, RuntimeDep
from service.api.schemas import KeyIn, KeyOut, KeyRevokedOut
from service.auth import KeyCache, validate_name
from service.runs import admin as actions
from service.runs import views
from service.runs.sessions import revoke_key

router = APIRouter(prefix="/v1/keys", tags=["keys"])


@router.post(
    "", status_code=201, operation_id="createKey", summary="Create an API key (the key is shown once)"
)
def create(body: KeyIn, runtime: RuntimeDep, _admin: Admin) -> KeyOut:
    key = actions.create_key(runtime.sessions, body.name, body.role)
    return KeyOut(name=body.name, role=body.role, prefix=key[:10], key=key)


@router.get("", operation_id="listKeys", summary="List API keys (never the keys themselves)")
def list_keys(runtime: RuntimeDep, _admin: Admin) -> list[KeyOut]:
    with runtime.sessions() as session:
        listed = views.keys(session)
        return [KeyOut(name=k.name, role=k.role, prefix=k.prefix, revoked_at=k.revoked_at) for k in listed]


@router.delete(
    "/{name}",
    operation_id="revokeKey",
    summary="Revoke an API key (refused from now on, its open sessions closed; its history stays)",
)
def revoke(name: str, request: Request, runtime: RuntimeDep, _admin: Admin) -> KeyRevokedOut:
    validate_name(name)
    key, _ = revoke_key(runtime.sessions, name)  # admissions everywhere refuse it once this returns
    out = KeyRevokedOut(name=key.name, role=key.role, revoked_at=key.revoked_at)
    keys: KeyCache = request.app.state.keys
    keys.forget(name)  # after the commit: this process refuses the key from the next request on
    return out
