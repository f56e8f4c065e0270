"""Request ids, access log and HTTP latency: one pure ASGI middleware (no body buffering).

For each HTTP request it

* takes the ``X-Request-ID`` header when it is a plain token (letters, digits, ``._:-``, at most 128
  characters) or generates one, binds it with ``structlog.contextvars`` as ``http_request_id``
  together with the method, and makes the route template available to the log processors
  (``service.logs.add_route``), so every log line of the request carries all three; and returns it in
  the response's ``X-Request-ID`` header;
* observes ``expost_http_request_duration_seconds{route, method, status}`` with the route *template*
  (``/v1/datasets/{dataset_id}/requests``), never the raw path; unmatched paths are ``(unmatched)``;
* writes one access line at INFO: ``http request`` with method, route, status and duration_ms.

Never logged: the query string, headers (so neither the Authorization header nor API keys), bodies.

With multiprocess metrics (``PROMETHEUS_MULTIPROC_DIR``), the lifespan shutdown of the app also drops
this process's live gauges.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import structlog

from service import logs, metrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

HEADER = "X-Request-ID"
_HEADER_KEY = b"x-request-id"
_VALID_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "(unmatched)"

access_log = structlog.get_logger("expost.access")


def request_id_from(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == _HEADER_KEY and _VALID_ID.fullmatch(value):
            return str(value.decode("ascii"))
    return uuid.uuid4().hex


def route_template(scope: Scope, root_path: str = "") -> str:
    """The path template of the route that handled (or is handling) the request, once routed.

    An endpoint's template is on the route the router put in the scope; a mounted app (``/metrics``) is
    named by its mount prefix (the part the router appended to the root path); anything else, e.g. a 404,
    is UNMATCHED. Never the raw path, so ids never become label values.
    """
    path = getattr(scope.get("route"), "path", None)
    if isinstance(path, str) and path and "{path}" not in path:
        return path
    mounted = str(scope.get("root_path", ""))
    if len(mounted) > len(root_path) and mounted.startswith(root_path):
        return mounted[len(root_path) :]
    return UNMATCHED


class ObservabilityMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, _after_shutdown(send))
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = request_id_from(scope)
        method = scope.get("method", "")
        method_label = method if method in METHODS else "other"
        root_path = str(scope.get("root_path", ""))
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(http_request_id=request_id, method=method_label)
        # Log lines written while the request is handled get its route template (known once routed).
        logs.CURRENT_ROUTE.set(lambda: route_template(scope, root_path))
        status = 500  # if the app raises before it answers, the server's error response is a 500
        header = (_HEADER_KEY, request_id.encode("ascii"))

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != _HEADER_KEY]
                message["headers"] = [*headers, header]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = route_template(scope, root_path)
            elapsed = time.perf_counter() - started
            metrics.HTTP_LATENCY.labels(route, method_label, f"{status // 100}xx").observe(elapsed)
            # Left bound after the request: the app's log of an unhandled exception, written after this
            # by the outermost error middleware in the same context, carries them too.
            structlog.contextvars.bind_contextvars(route=route)
            access_log.info("http request", status=status, duration_ms=round(elapsed * 1000, 3))


def _after_shutdown(send: Send) -> Send:
    async def wrapped(message: Message) -> None:
        await send(message)
        if message["type"] == "lifespan.shutdown.complete":
            metrics.process_exited()

    return wrapped
