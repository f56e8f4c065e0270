"""Slow and half-open clients cannot hold connections (issue 35, item 15): a connection whose request head
is not complete ``EXPOST_HEADER_TIMEOUT_SECONDS`` after it opened, or after its previous response ended, is
closed by the server (service/api/wire.py). Before, 1,500 half-open connections stayed open for good."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer, running_server, server_settings
from tests.integration.scale_out_support import Cluster

HEAD = b"GET /healthz HTTP/1.1\r\nHost: expost\r\n"


def _connect(base_url: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=10)
    return conn


def _closed_within(conn: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``conn`` (reads and drops any response), or None if still open."""
    start = time.monotonic()
    conn.settimeout(0.2)
    while time.monotonic() - start < seconds:
        try:
            if conn.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - start
    return None


@pytest.fixture(scope="module")
def server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = server_settings(database_url, tmp_path_factory.mktemp("slow"), header_timeout_seconds=1.0)
    with running_server(settings) as live:
        yield live


def test_silent_and_half_sent_heads_are_closed_after_the_deadline(server: LiveServer) -> None:
    silent = _connect(server.base_url)
    half = _connect(server.base_url)
    half.sendall(HEAD)  # the blank line that ends the head never comes
    for conn in (silent, half):
        waited = _closed_within(conn, 8.0)
        assert waited is not None, "the server kept a connection whose head never completed"
        conn.close()


def test_a_kept_alive_connection_gets_a_new_deadline_for_its_next_head(server: LiveServer) -> None:
    conn = _connect(server.base_url)
    conn.sendall(HEAD + b"\r\n")
    conn.settimeout(5)
    assert b"200" in conn.recv(65536).split(b"\r\n", 1)[0]
    conn.sendall(b"GET /healthz HTTP/1.1\r\n")  # the next head, cut short: uvicorn's keep-alive timer is off
    assert _closed_within(conn, 8.0) is not None
    conn.close()


def test_a_head_completed_in_time_is_answered(server: LiveServer) -> None:
    conn = _connect(server.base_url)
    conn.sendall(b"GET /healthz HTTP/1.1\r\n")
    time.sleep(0.5)
    conn.sendall(b"Host: expost\r\n\r\n")
    conn.settimeout(5)
    assert b"200" in conn.recv(65536).split(b"\r\n", 1)[0]
    conn.close()
    assert httpx.get(server.base_url + "/healthz").status_code == 200


def test_expost_serve_reads_the_deadline_from_its_environment(tmp_path: Path) -> None:
    cluster = Cluster.create(
        tmp_path, f"sqlite:///{tmp_path}/slow.db", executor="inprocess", header_timeout_seconds="1"
    )
    try:
        _, base = cluster.api()
        half = _connect(base)
        half.sendall(HEAD)
        assert _closed_within(half, 8.0) is not None
        half.close()
        assert httpx.get(base + "/healthz").status_code == 200
    finally:
        for proc in cluster.procs:
            proc.stop()
