"""A TCP proxy that delays every chunk by a fixed time each way: a database "far away" on one machine.

The service's group-commit writer holds a dataset's filter row lock across database round trips, so how
many round trips a batch makes matters most when the database is not local. ``service_load.py
--db-latency-ms`` puts this proxy between the services and PostgreSQL: each chunk of bytes is forwarded
``delay`` seconds after it arrived, in order, so a round trip costs 2 × ``delay`` more (the proxy's own
CPU is a few µs per chunk, on the load generator's process).

    with LatencyProxy("127.0.0.1", 5432, 0.0005) as proxy:
        url = proxied_url(url, proxy.port)
"""

from __future__ import annotations

import asyncio
import threading
from types import TracebackType
from urllib.parse import urlsplit, urlunsplit


class LatencyProxy:
    """Listens on 127.0.0.1 (a free ``port``) and forwards to ``host:port``, ``delay`` s each way."""

    def __init__(self, host: str, port: int, delay: float) -> None:
        self.target, self.delay = (host, port), delay
        self.port = 0
        self._server: asyncio.Server | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="latency-proxy", daemon=True)

    def __enter__(self) -> LatencyProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the latency proxy did not start")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._connection, "127.0.0.1", 0))
        self._server, self.port = server, server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _stop(self) -> None:
        """Stop listening and end every open connection (the services have stopped by then)."""
        if self._server is not None:
            self._server.close()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _connection(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        server_reader, server_writer = await asyncio.open_connection(*self.target)
        await asyncio.gather(
            self._pump(client_reader, server_writer), self._pump(server_reader, client_writer)
        )

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward each chunk ``delay`` after it arrived (timers fire in order: the byte stream is kept)."""
        loop = asyncio.get_running_loop()
        try:
            while chunk := await reader.read(65536):
                loop.call_later(self.delay, writer.write, chunk)
        except ConnectionError:
            pass
        finally:
            loop.call_later(self.delay, writer.close)


def proxied_url(url: str, port: int) -> str:
    """``url`` (a SQLAlchemy URL on 127.0.0.1 or localhost) pointed at the proxy's ``port`` instead."""
    parts = urlsplit(url)
    credentials, _, _ = parts.netloc.rpartition("@")
    netloc = f"{credentials}@127.0.0.1:{port}" if credentials else f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc))
