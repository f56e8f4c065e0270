"""``POST /v1/datasets/{dataset_id}/requests`` bound directly: the busiest route without FastAPI's
per-request machinery, for the submissions that need none of the FastAPI route's error paths.

Why: measured in one process under 32 concurrent cheap Laplace requests (the same app with and without this
route, alternated round by round; benchmarks/README.md), FastAPI's routing over the included routers, its
dependency resolution and its response validation cost ≈ 0.8 ms of a cheap request's ≈ 2.8 ms of CPU.

The FastAPI route (``service.api.routers.requests.submit``) stays the contract: it is the one in the OpenAPI
document and it answers every submission this route declines. This route calls the same code in the same
order, so its answers are the FastAPI route's:

1. a ``Content-Type: application/json`` body, read and decoded as FastAPI decodes it (``json.loads``)
   before it resolves any dependency;
2. the principal from the route's own security dependency (``ANALYST_BEARER``: 401 and 403 raised as there);
3. the ``Idempotency-Key`` and ``Prefer`` headers through the route's own annotations (``IdempotencyKey``,
   ``Prefer``, validated by pydantic as FastAPI validates them), and the body through ``RequestIn``;
4. ``submit_request``, the route's body: admission, the run, refusals and failures raised to the app's
   exception handlers as from the route;
5. the response the route writes: ``RequestOut`` as JSON, status 200 (202 while running) with the headers
   ``submit_request`` set.

A submission that fails step 1 or 3 (where the FastAPI route answers 400 or 422) or sends another content
type is declined: its body is replayed to the app's router, which skips this route and reaches the FastAPI
one, so those answers are the route's own.
"""

from __future__ import annotations

import json
from typing import Any

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

_DECLINED = "expost.direct_declined"  # scope key: this submission goes to the FastAPI route
_IDEMPOTENCY_KEY: TypeAdapter[str | None] = TypeAdapter(IdempotencyKey)
_PREFER: TypeAdapter[str | None] = TypeAdapter(Prefer)
_RESPONSE: TypeAdapter[RequestOut] = TypeAdapter(RequestOut)


class DirectSubmitRoute(Route):
    """Matches ``POST`` on the submit path only (other methods reach the FastAPI route and its 405), and
    puts itself in the scope as the route, so access lines and latency metrics carry the same template."""

    def __init__(self) -> None:
        # An ASGI object as the endpoint: Starlette calls it as it is (a function would be wrapped as a
        # Request -> Response endpoint).
        super().__init__(SUBMIT_PATH, endpoint=_DirectSubmit(), methods=["POST"], include_in_schema=False)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http" or scope["method"] != "POST" or _DECLINED in scope:
            return Match.NONE, {}
        match, child_scope = super().matches(scope)
        if match is not Match.FULL:
            return Match.NONE, {}
        child_scope["route"] = self
        return match, child_scope


class _DirectSubmit:
    """The FastAPI route's steps in its order: the body decoded (its failures answered before
    authentication), the security dependency, then the parameters and the body model."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        if not _is_json(request):
            await _decline(scope, receive, send, "content-type")
            return
        try:
            raw = await request.body()
        except HTTPException:  # the body guard's 413 (service/api/ratelimit.py), raised as on the route
            raise
        except Exception:  # the client went away: the route's 400
            await _decline(scope, receive, send, "body")
            return
        try:
            document = json.loads(raw)
        except Exception:  # not JSON, nested too deeply, too many digits: the route answers 400 or 422
            await _decline(scope, _replaying(raw, receive), send, "body")
            return
        principal = await ANALYST_BEARER(request)
        headers, body = _submission_headers(request), _parsed(document)
        if headers is None or body is None:
            await _decline(scope, _replaying(raw, receive), send, "headers" if headers is None else "body")
            return
        status = Response()  # collects what submit_request sets: 202, Location, Retry-After
        dataset_id = scope["path_params"]["dataset_id"]
        out = await submit_request(runtime_of(request), principal, dataset_id, body, status, *headers)
        content = _RESPONSE.dump_json(out, by_alias=True)
        response = Response(content, status.status_code, media_type="application/json")
        response.headers.raw.extend(h for h in status.headers.raw if h[0] != b"content-length")
        await response(scope, receive, send)


def _submission_headers(request: Request) -> tuple[str | None, str | None] | None:
    """The Idempotency-Key and Prefer values as the FastAPI route reads them, or None where it answers 422."""
    try:
        key = _IDEMPOTENCY_KEY.validate_python(request.headers.get("idempotency-key"))
        prefer = _PREFER.validate_python(request.headers.get("prefer"))
    except ValidationError:
        return None
    return key, prefer


def _is_json(request: Request) -> bool:
    media_type = request.headers.get("content-type", "").partition(";")[0]
    return media_type.strip().lower() == "application/json"


def _parsed(document: Any) -> RequestIn | None:
    """The decoded body as the FastAPI route validates it, or None where it answers 422."""
    try:
        return RequestIn.model_validate(document)
    except ValidationError:
        return None


async def _decline(scope: Scope, receive: Receive, send: Send, reason: str) -> None:
    """Hand the submission to the app's router again, which now skips this route."""
    metrics.DIRECT_SUBMIT_DECLINED.labels(reason).inc()
    scope[_DECLINED] = True
    await scope["router"](scope, receive, send)


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
