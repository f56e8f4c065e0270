"""The HTTP parser's own refusals as problem+json (RFC 9457).

uvicorn's parsers (httptools, or h11 where httptools is missing) refuse a malformed request line or header
before any application code runs, e.g. a header value with a C0 control character or DEL, which RFC 9110
§5.5 does not allow. uvicorn then writes a plain-text 400. These protocol classes write the same 400 as a
problem document instead; nothing else changes (the connection is closed, nothing reached the app, so
nothing was read, admitted or charged). ``HTTP_PROTOCOL`` is the class the server uses.

They also bound the time a client may take to send a request's head (request line and headers): a
connection whose head is not complete ``EXPOST_HEADER_TIMEOUT_SECONDS`` after it opened, or after its
previous response ended, is closed (uvicorn itself times out idle keep-alive connections only, so a client
that sends half a head, or nothing, would hold its connection forever: slowloris).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from service.config import get_settings

PROBLEM_TYPE = "/problems/malformed-request"


def problem_bytes(parser_message: str) -> bytes:
    """The problem document of a request the HTTP parser refused (its message is uvicorn's, not the
    client's bytes: nothing of the request is echoed)."""
    body = {
        "type": PROBLEM_TYPE,
        "title": "Malformed HTTP request",
        "status": 400,
        "detail": (
            "the request line or a header is not valid HTTP/1.1 (header values must not contain control "
            f"characters); the server's parser said: {parser_message}"
        ),
    }
    return json.dumps(body).encode("ascii")


class HeadDeadline:
    """The deadline for the head of the next request on one connection."""

    def __init__(self, protocol: Any, seconds: float) -> None:
        self.protocol, self.seconds = protocol, seconds
        self._timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """Start the clock (the connection opened, or its previous response ended)."""
        self.disarm()
        if self.seconds > 0 and not self.protocol.transport.is_closing():
            self._timer = self.protocol.loop.call_later(self.seconds, self._passed)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _passed(self) -> None:
        self._timer = None
        cycle = self.protocol.cycle  # set once a head is complete; a finished one means we wait for the next
        if (cycle is None or cycle.response_complete) and not self.protocol.transport.is_closing():
            self.protocol.transport.close()


def header_timeout(protocol_class: type) -> float:
    """The head deadline of a protocol class: its own ``head_timeout`` (the embedded server's settings), or
    the process's ``EXPOST_HEADER_TIMEOUT_SECONDS``."""
    seconds = getattr(protocol_class, "head_timeout", None)
    return float(seconds) if seconds is not None else get_settings().header_timeout_seconds


class HeadDeadlineMixin:
    """Arms a :class:`HeadDeadline` when a connection opens and after each response (put it first among
    the bases of a uvicorn protocol class)."""

    head_timeout: float | None = None
    head_deadline: HeadDeadline

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self.head_deadline = HeadDeadline(self, header_timeout(type(self)))
        self.head_deadline.arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self.head_deadline.arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.head_deadline.disarm()
        super().connection_lost(exc)  # type: ignore[misc]


class ProblemH11Protocol(HeadDeadlineMixin, H11Protocol):
    """h11 with problem+json parser refusals and a deadline on each request's head."""

    def send_400_response(self, msg: str) -> None:
        import h11

        body = problem_bytes(msg)
        headers = [
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode("ascii")),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()


HTTP_PROTOCOL: type = ProblemH11Protocol
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class ProblemHttpToolsProtocol(HeadDeadlineMixin, HttpToolsProtocol):
        """httptools with problem+json parser refusals and a deadline on each request's head."""

        def send_400_response(self, msg: str) -> None:
            body = problem_bytes(msg)
            head = [b"HTTP/1.1 400 Bad Request\r\n"]
            for name, value in self.server_state.default_headers:
                head.extend([name, b": ", value, b"\r\n"])
            head.extend(
                [
                    b"content-type: application/problem+json\r\n",
                    b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                    b"connection: close\r\n\r\n",
                ]
            )
            self.transport.write(b"".join(head) + body)
            self.transport.close()

    HTTP_PROTOCOL = ProblemHttpToolsProtocol
except ImportError:  # httptools not installed: uvicorn would use h11 too
    pass


def protocol_with_head_timeout(seconds: float) -> type:
    """``HTTP_PROTOCOL`` with its own head deadline (an embedded server: its settings, not the
    environment's)."""
    return type(HTTP_PROTOCOL.__name__, (HTTP_PROTOCOL,), {"head_timeout": seconds})
