"""The app served inside the calling process, for tests and benchmarks: a free loopback port and a uvicorn
server on a daemon thread. Production runs ``expost serve`` (service/cli.py) instead."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from service.api.wire import protocol_with_head_timeout
from service.app import create_app
from service.config import Settings


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve_in_thread(settings: Settings, *, start_timeout: float = 20.0) -> Iterator[str]:
    """Serve ``create_app(settings)`` on a free port in a daemon thread; yields the base URL and stops the
    server on exit. RuntimeError if it has not started within ``start_timeout`` seconds."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
            http=protocol_with_head_timeout(settings.header_timeout_seconds),
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the embedded server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
