"""The HTTP parser's own refusals as problem+json (RFC 9457).

uvicorn's parsers (httptools, or h11 where httptools is missing) refuse a malformed request line or header
before any application code runs, e.g. a header value with a C0 control character or DEL, which RFC 9110
§5.5 does not allow. uvicorn then writes a plain-text 400. These protocol classes write the same 400 as a
problem document instead; nothing else changes (the connection is closed, nothing reached the app, so
nothing was read, admitted or charged). ``HTTP_PROTOCOL`` is the class the server uses.
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.h11_impl import H11Protocol

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


class ProblemH11Protocol(H11Protocol):
    """h11 with problem+json parser refusals."""

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

    class ProblemHttpToolsProtocol(HttpToolsProtocol):
        """httptools with problem+json parser refusals."""

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
