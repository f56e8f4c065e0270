"""FastAPI dependencies: the runtime, read sessions, the authenticated principal, role checks at the route.

The dependencies that do no I/O are ``async``: FastAPI runs a sync dependency in its thread pool, one hop
per dependency per request. Authentication reads the database (in the thread pool) only on a key-cache miss.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.auth import REVOKED, KeyCache, Principal, Role
from service.errors import Forbidden, Unauthenticated
from service.runs.runtime import Runtime

BEARER_DESCRIPTION = "an API key: `Authorization: Bearer xp_…`"


def runtime_of(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


async def get_runtime(request: Request) -> Runtime:
    return runtime_of(request)


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def get_session(runtime: RuntimeDep) -> Iterator[Session]:
    """A read session; write paths open their own unit of work and commit before responding."""
    with runtime.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


async def authenticate(request: Request, credentials: HTTPAuthorizationCredentials | None) -> Principal:
    """The principal of the request's API key (401 without a valid one)."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise Unauthenticated("send an API key as `Authorization: Bearer <key>`")
    keys: KeyCache = request.app.state.keys
    principal = keys.cached(credentials.credentials)
    if principal is None:  # not cached: read the database in the thread pool
        principal = await run_in_threadpool(keys.authenticate, credentials.credentials)
    if principal is None:
        raise Unauthenticated(REVOKED)
    return principal


class RoleBearer(HTTPBearer):
    """A route's security dependency: the API key of ``Authorization: Bearer``, authenticated (401) and its
    role checked at the route (403). An ``HTTPBearer``, so the OpenAPI document declares the bearer scheme
    as before, and one dependency instead of three levels (the key, authentication, the role): FastAPI
    resolves every level of every request's dependency tree."""

    def __init__(self, roles: tuple[Role, ...]) -> None:
        super().__init__(auto_error=False, scheme_name="HTTPBearer", description=BEARER_DESCRIPTION)
        self.roles = roles

    async def __call__(self, request: Request) -> Principal:  # type: ignore[override]
        principal = await authenticate(request, await super().__call__(request))
        if principal.role not in self.roles:
            allowed = ", ".join(r.value for r in self.roles)
            raise Forbidden(
                f"this endpoint needs one of the roles: {allowed}", your_role=principal.role.value
            )
        return principal


def require(*roles: Role) -> object:
    """Authenticate and check the role at the route: one dependency (each level costs per request)."""
    return Depends(RoleBearer(roles))


AnyRole = Annotated[Principal, require(Role.admin, Role.analyst, Role.viewer)]
Admin = Annotated[Principal, require(Role.admin)]
#: The analysts' security dependency, one instance: POST …/requests's direct route calls it too.
ANALYST_BEARER = RoleBearer((Role.analyst,))
Analyst = Annotated[Principal, Depends(ANALYST_BEARER)]
AdminOrAnalyst = Annotated[Principal, require(Role.admin, Role.analyst)]
