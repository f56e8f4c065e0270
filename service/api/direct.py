"""``POST /v1/datasets/{dataset_id}/requests`` bound directly: the busiest route without FastAPI's
per-request machinery, for the submissions that need none of the FastAPI route's error paths.

Why: measured in one process under 32 concurrent cheap Laplace requests (the same app with and without this
route, alternated round by round; benchmarks/README.md), FastAPI's routing over the included routers, its
dependency resolution and its response validation cost ≈ 0.8 ms of a cheap request's ≈ 2.8 ms of CPU.

The FastAPI route (``service.api.routers.requests.submit``) stays the contract: it is the one in the OpenAPI
document and it answers every submission this route does not serve. This route matches only a
``Content-Type: application/json`` body of at most :data:`MAX_DIRECT_BODY` bytes (its ``Content-Length``),
in an app without dependency overrides; it then takes the FastAPI route's steps with the route's own parts:

1. the body decoded as FastAPI decodes it (``json.loads``), before anything else;
2. the ``Idempotency-Key`` and ``Prefer`` headers through the route's own annotations (``IdempotencyKey``,
   ``Prefer``, validated by pydantic as FastAPI validates them), and the body through ``RequestIn``;
3. the principal from the route's own security dependency (``ANALYST_BEARER``: 401 and 403 raised as there);
4. ``submit_request``, the route's body: admission, the run, refusals and failures raised to the app's
   exception handlers as from the route;
5. the response the route writes: ``RequestOut`` as JSON, status 200 (202 while running) with the headers
   ``submit_request`` set.

A submission that fails step 1 or 2 (where the FastAPI route answers 400 or 422) is declined before it is
authenticated: its body is replayed to the app's own router, which skips this route and reaches the
FastAPI one, so those answers (and their order: FastAPI authenticates before it reports a parameter or
model error) are the route's own. The size bound keeps every body this route decodes, or hands on, at most
512 levels deep, far inside Python's recursion limit, so the few frames by which the two routes' stacks
differ never decide an answer; larger bodies go to the FastAPI route from the start.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from pydantic import TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import Message, Receive, Scope, Send

from service import metrics
from service.api.deps import ANALYST_BEARER, runtime_of
from service.api.routers.requests import SUBMIT_PATH, IdempotencyKey, Prefer, submit_request
from service.api.schemas import RequestIn, RequestOut

#: The largest body (``Content-Length``) this route serves: a cheap request's is ≈ 100 bytes.
MAX_DIRECT_BODY = 1024

_DECLINED = "expost.direct_declined"  # scope key: this submission goes to the FastAPI route
_IDEMPOTENCY_KEY: TypeAdapter[str | None] = TypeAdapter(IdempotencyKey)
_PREFER: TypeAdapter[str | None] = TypeAdapter(Prefer)
_RESPONSE: TypeAdapter[RequestOut] = TypeAdapter(RequestOut)


class DirectSubmitRoute(Route):
    """Matches ``POST`` on the submit path with a small JSON body, and puts itself in the scope as the route
    (access lines and latency metrics carry the same template). Anything else it leaves to the routes after
    it: other methods reach the FastAPI route and its 405."""

    def __init__(self, app: FastAPI) -> None:
        # An ASGI object as the endpoint: Starlette calls it as it is (a function would be wrapped as a
        # Request -> Response endpoint).
        super().__init__(SUBMIT_PATH, endpoint=_DirectSubmit(app), methods=["POST"], include_in_schema=False)
        self.owner = app  # with dependency overrides (tests), every submission takes the FastAPI route

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http" or scope["method"] != "POST" or _DECLINED in scope:
            return Match.NONE, {}
        if self.owner.dependency_overrides or not _small_json(scope["headers"]):
            return Match.NONE, {}
        match, child_scope = super().matches(scope)
        if match is not Match.FULL:
            return Match.NONE, {}
        child_scope["route"] = self
        return match, child_scope


def _small_json(headers: list[tuple[bytes, bytes]]) -> bool:
    """The first ``Content-Type`` is ``application/json`` (FastAPI reads the first too) and the first
    ``Content-Length`` at most :data:`MAX_DIRECT_BODY`."""
    content_type = content_length = None
    for name, value in headers:
        if name == b"content-type" and content_type is None:
            content_type = value
        elif name == b"content-length" and content_length is None:
            content_length = value
    return (
        content_type is not None
        and content_type.partition(b";")[0].strip().lower() == b"application/json"
        and content_length is not None
        and content_length.isdigit()
        and int(content_length) <= MAX_DIRECT_BODY
    )


class _DirectSubmit:
    def __init__(self, app: FastAPI) -> None:
        self.router = app.router  # declined submissions go here (not scope["router"]: the app may be mounted)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            raw = await request.body()
        except HTTPException:  # the body guard's 413 (service/api/ratelimit.py), raised as on the route
            raise
        except Exception:  # the client went away: the route's 400
            await self._decline(scope, receive, send, "body")
            return
        replay = _replaying(raw, receive)
        try:
            document = json.loads(raw)
        except Exception:  # not JSON, too many digits: the route answers 400 or 422
            await self._decline(scope, replay, send, "body")
            return
        headers, body = _submission_headers(request), _parsed(document)
        if headers is None or body is None:
            await self._decline(scope, replay, send, "headers" if headers is None else "body")
            return
        principal = await ANALYST_BEARER(request)
        status = Response()  # collects what submit_request sets: 202, Location, Retry-After
        dataset_id = scope["path_params"]["dataset_id"]
        out = await submit_request(runtime_of(request), principal, dataset_id, body, status, *headers)
        content = _RESPONSE.dump_json(out, by_alias=True)
        response = Response(content, status.status_code, media_type="application/json")
        response.headers.raw.extend(h for h in status.headers.raw if h[0] != b"content-length")
        await response(scope, receive, send)

    async def _decline(self, scope: Scope, receive: Receive, send: Send, reason: str) -> None:
        """Hand the submission to the app's router again, which now skips this route."""
        metrics.DIRECT_SUBMIT_DECLINED.labels(reason).inc()
        scope[_DECLINED] = True
        await self.router(scope, receive, send)


def _submission_headers(request: Request) -> tuple[str | None, str | None] | None:
    """The Idempotency-Key and Prefer values as the FastAPI route reads them, or None where it answers 422."""
    try:
        key = _IDEMPOTENCY_KEY.validate_python(request.headers.get("idempotency-key"))
        prefer = _PREFER.validate_python(request.headers.get("prefer"))
    except ValidationError:
        return None
    return key, prefer


def _parsed(document: Any) -> RequestIn | None:
    """The decoded body as the FastAPI route validates it, or None where it answers 422."""
    try:
        return RequestIn.model_validate(document)
    except ValidationError:
        return None


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the already-read body delivered first, whole."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
