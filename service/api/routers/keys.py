from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy.exc import IntegrityError

from service.api.deps import Admin, RuntimeDep
from service.api.schemas import KeyIn, KeyOut
from service.auth import create_key
from service.errors import Conflict
from service.store.repositories import KeyRepository

router = APIRouter(prefix="/v1/keys", tags=["keys"])


@router.post("", status_code=201, summary="Create an API key (the key is shown once)")
def create(body: KeyIn, runtime: RuntimeDep, _admin: Admin) -> KeyOut:
    try:
        with runtime.sessions() as session, session.begin():
            key = create_key(session, body.name, body.role)
    except IntegrityError:  # a concurrent request created the same name first
        raise Conflict(f"a key named {body.name!r} already exists") from None
    return KeyOut(name=body.name, role=body.role, prefix=key[:10], key=key)


@router.get("", summary="List API keys (never the keys themselves)")
def list_keys(runtime: RuntimeDep, _admin: Admin) -> list[KeyOut]:
    with runtime.sessions() as session:
        return [KeyOut(name=k.name, role=k.role, prefix=k.prefix) for k in KeyRepository(session).all()]
