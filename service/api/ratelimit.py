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
* **Failed authentication** per client address: every ``401`` (an unknown, malformed or revoked key) counts
  against ``EXPOST_RATE_LIMIT_FAILED_AUTH``; over it, the address gets ``429`` for every key that has not
  been accepted recently by this process. Guessing keys from one address is slowed down, and rotating
  random keys no longer escapes the per-key limit, while the address's working keys go on.
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
from collections import OrderedDict
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
ACCEPTED_KEYS_KEPT = 10_000


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
        self.failed_auth = _limits(settings.rate_limit_failed_auth)
        self.accepted: OrderedDict[str, None] = OrderedDict()  # keys answered other than 401, newest last

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        if EXEMPT.match(path):
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        who = _identity(scope, headers)
        refused = await self._rate_limited(scope, who, path) or await self._failed_auth_blocked(scope, who)
        if refused is not None:
            detail, retry_after = refused
            await _problem(
                send,
                429,
                "/problems/rate-limited",
                "Too many requests",
                detail,
                path,
                [(b"retry-after", str(retry_after).encode())],
            )
            return
        if self.failed_auth:
            send = self._counting_failed_auth(scope, who, send)
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

    async def _rate_limited(self, scope: Scope, who: str, path: str) -> tuple[str, int] | None:
        """The refusal's detail and Retry-After when the key (or the address, without a key) is over its
        limit."""
        items = list(self.general)
        if scope.get("method") == "POST" and REPORT_ROUTE.match(path):
            items += self.reports
        if not items:
            return None
        try:
            for item in items:
                if not await self.limiter.hit(item, who):
                    retry_after = await self._retry_after(item, who)
                    return f"rate limit exceeded ({item} per key); retry later", retry_after
        except Exception as exc:  # storage down: fail open
            log.warning("rate limit storage failed; request let through", error=type(exc).__name__)
        return None

    async def _failed_auth_blocked(self, scope: Scope, who: str) -> tuple[str, int] | None:
        """The refusal when the client's address is over its failed-authentication limit and the key has
        not been accepted recently (a known key's requests cost one dictionary lookup here)."""
        if not self.failed_auth or who in self.accepted:
            return None
        address = _failed_auth_identity(scope)
        try:
            for item in self.failed_auth:
                if not await self.limiter.test(item, address):
                    retry_after = await self._retry_after(item, address)
                    detail = f"too many failed authentications from this address ({item}); retry later"
                    return detail, retry_after
        except Exception as exc:  # storage down: fail open
            log.warning("rate limit storage failed; request let through", error=type(exc).__name__)
        return None

    def _counting_failed_auth(self, scope: Scope, who: str, send: Send) -> Send:
        """``send`` that counts a 401 against the client's address, and remembers a key answered otherwise."""

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                if message["status"] == 401:
                    await self._count_failed_auth(_failed_auth_identity(scope))
                elif who.startswith("key:"):
                    self._remember_accepted(who)
            await send(message)

        return watched

    async def _count_failed_auth(self, address: str) -> None:
        try:
            for item in self.failed_auth:
                await self.limiter.hit(item, address)
        except Exception as exc:  # storage down: fail open
            log.warning("rate limit storage failed; failure not counted", error=type(exc).__name__)

    def _remember_accepted(self, who: str) -> None:
        self.accepted[who] = None
        self.accepted.move_to_end(who)
        if len(self.accepted) > ACCEPTED_KEYS_KEPT:
            self.accepted.popitem(last=False)

    async def _retry_after(self, item: RateLimitItem, who: str) -> int:
        stats = await self.limiter.get_window_stats(item, who)
        return max(1, math.ceil(stats.reset_time - time.time()))


def _identity(scope: Scope, headers: dict[bytes, bytes]) -> str:
    auth = headers.get(b"authorization", b"")
    if auth[:7].lower() == b"bearer " and len(auth) > 7:
        return "key:" + hashlib.sha256(auth[7:].strip()).hexdigest()[:32]
    return f"addr:{_client_address(scope)}"


def _failed_auth_identity(scope: Scope) -> str:
    return f"failed-auth:{_client_address(scope)}"


def _client_address(scope: Scope) -> str:
    client = scope.get("client") or ("unknown", 0)
    return str(client[0])


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
