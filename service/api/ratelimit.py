"""Hostile-input guards in front of the routes: per-key rate limits and request body size limits.

One pure ASGI middleware (no body buffering):

* **Rate limits** per API key (the bearer token's SHA-256, so an unknown key is limited as well and no
  database lookup is needed; without a key, per client address), with the ``limits`` library's moving
  window. ``EXPOST_RATE_LIMIT`` applies to every route except the health checks and ``/metrics``;
  ``EXPOST_RATE_LIMIT_REPORTS`` is a stricter, additional limit for ``POST
  /v1/requests/{rid}/privacy-report`` (each report is a costly solve). Storage is in memory per process
  by default (so N API replicas allow N times the rate); ``EXPOST_RATE_LIMIT_STORAGE=redis://…`` shares
  it. Over the limit: ``429`` problem+json with ``Retry-After`` (whole seconds). If the storage fails the
  request is let through (a rate limit is an availability control, not a privacy one).
* **Body size**: a JSON (or any non-multipart) body over ``EXPOST_MAX_BODY_BYTES`` and a multipart upload
  over ``EXPOST_MAX_UPLOAD_BYTES`` (+64 KiB of multipart framing) are refused with ``413`` before they
  are read: at once from ``Content-Length``, or while streaming when the body is chunked.

Both refusals have a constant shape: the same type, title and fields whatever the key, route or data.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import structlog
from limits import RateLimitItem, parse_many
from limits.aio.strategies import MovingWindowRateLimiter
from limits.storage import storage_from_string
from starlette.exceptions import HTTPException

from service.config import Settings
from service.errors import PROBLEM_JSON

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = structlog.get_logger("expost.guards")

EXEMPT = re.compile(r"^/(healthz|readyz|metrics)(/.*)?$")
REPORT_ROUTE = re.compile(r"^/v1/requests/[^/]+/privacy-report/?$")
MULTIPART_SLACK = 64 * 1024


def _limits(text: str) -> list[RateLimitItem]:
    return parse_many(text) if text.strip() else []


def _async_uri(uri: str) -> str:
    return uri if uri.startswith("async+") else f"async+{uri}"


class GuardMiddleware:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.general = _limits(settings.rate_limit)
        self.reports = _limits(settings.rate_limit_reports)
        uri = _async_uri(settings.rate_limit_storage)
        options: dict[str, Any] = {"implementation": "redispy"} if "redis" in uri.split("://", 1)[0] else {}
        self.limiter = MovingWindowRateLimiter(storage_from_string(uri, **options))
        self.max_body = settings.max_body_bytes
        self.max_upload = settings.max_upload_bytes + MULTIPART_SLACK

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        if EXEMPT.match(path):
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        refused = await self._rate_limited(scope, headers, path)
        if refused is not None:
            rate, retry_after = refused
            await _problem(
                send,
                429,
                "/problems/rate-limited",
                "Too many requests",
                f"rate limit exceeded ({rate} per key); retry later",
                path,
                [(b"retry-after", str(retry_after).encode())],
            )
            return
        multipart = headers.get(b"content-type", b"").startswith(b"multipart/")
        cap = self.max_upload if multipart else self.max_body
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            await _problem(
                send,
                413,
                "/problems/payload-too-large",
                "Payload too large",
                f"the request body is larger than {cap} bytes",
                path,
            )
            return
        await self.app(scope, _capped(receive, cap), send)

    async def _rate_limited(
        self, scope: Scope, headers: dict[bytes, bytes], path: str
    ) -> tuple[str, int] | None:
        items = list(self.general)
        if scope.get("method") == "POST" and REPORT_ROUTE.match(path):
            items += self.reports
        if not items:
            return None
        who = _identity(scope, headers)
        try:
            for item in items:
                if not await self.limiter.hit(item, who):
                    stats = await self.limiter.get_window_stats(item, who)
                    return str(item), max(1, math.ceil(stats.reset_time - time.time()))
        except Exception as exc:  # storage down: fail open
            log.warning("rate limit storage failed; request let through", error=type(exc).__name__)
        return None


def _identity(scope: Scope, headers: dict[bytes, bytes]) -> str:
    auth = headers.get(b"authorization", b"")
    if auth[:7].lower() == b"bearer " and len(auth) > 7:
        return "key:" + hashlib.sha256(auth[7:].strip()).hexdigest()[:32]
    client = scope.get("client") or ("unknown", 0)
    return f"addr:{client[0]}"


def _capped(receive: Receive, limit: int) -> Receive:
    """``receive`` that refuses a (chunked) body once it passes ``limit`` bytes: FastAPI turns the
    HTTPException raised while it reads the body into the app's problem+json response."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HTTPException(413, f"the request body is larger than {limit} bytes")
        return message

    return wrapped


async def _problem(
    send: Send,
    status: int,
    type_: str,
    title: str,
    detail: str,
    instance: str,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    problem: dict[str, Any] = {
        "type": type_,
        "title": title,
        "status": status,
        "detail": detail,
        "instance": instance,
    }
    if status == 413:
        problem["errors"] = [{"field": "body", "reason": detail}]
    body = json.dumps(problem).encode()
    headers = [
        (b"content-type", PROBLEM_JSON.encode()),
        (b"content-length", str(len(body)).encode()),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
