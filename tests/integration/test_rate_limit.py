"""Hostile input at the door: per-key rate limits (a stricter one for privacy reports) and body size limits,
on a real server (docs/operations.md, Configuration). Every refusal is an RFC 9457 problem of a constant
shape."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.auth import Role
from tests.conftest import LiveServer, running_server, server_settings
from tests.integration.helpers import assert_problem, make_world

PROBLEM_KEYS = {"type", "title", "status", "detail", "instance"}


@pytest.fixture(scope="module")
def limited(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = server_settings(
        database_url,
        tmp_path_factory.mktemp("limited"),
        rate_limit="8/minute",
        rate_limit_reports="2/minute",
        max_body_bytes=4000,
    )
    with running_server(settings) as server:
        yield server


def test_a_key_over_its_limit_gets_429_with_retry_after_and_others_do_not(limited: LiveServer) -> None:
    _, key_a = limited.create_key(Role.analyst)
    _, key_b = limited.create_key(Role.analyst)
    with limited.client(key_a) as a, limited.client(key_b) as b:
        statuses = [a.get("/v1/datasets").status_code for _ in range(8)]
        assert statuses == [200] * 8
        refused = a.get("/v1/datasets")
        body = assert_problem(refused, 429, "/problems/rate-limited")
        assert set(body) == PROBLEM_KEYS
        retry = int(refused.headers["Retry-After"])
        assert 1 <= retry <= 60
        assert b.get("/v1/datasets").status_code == 200  # per key
        # health checks are never limited
        assert all(a.get("/healthz").status_code == 200 for _ in range(5))


def test_refusals_have_one_shape_for_good_and_unknown_keys(limited: LiveServer) -> None:
    _, key = limited.create_key(Role.viewer)
    shapes = []
    for credential in (key, "xp_not_a_key_" + "x" * 20):
        with limited.client(credential) as client:
            for _ in range(8):
                client.get("/v1/datasets")
            refused = client.get("/v1/datasets")
            body = assert_problem(refused, 429, "/problems/rate-limited")
            shapes.append(
                (
                    sorted(body),
                    body["type"],
                    body["title"],
                    body["detail"],
                    sorted(k for k in refused.headers if k in ("retry-after", "content-type")),
                )
            )
    assert shapes[0] == shapes[1]


def test_privacy_reports_have_a_stricter_limit(limited: LiveServer) -> None:
    _, key = limited.create_key(Role.analyst)
    with limited.client(key) as client:
        statuses = [
            client.post("/v1/requests/rq_missing/privacy-report", json={"record": {}}).status_code
            for _ in range(3)
        ]
        assert 429 not in statuses[:2]
        assert statuses[2] == 429
        assert client.get("/v1/datasets").status_code == 200  # only that route is exhausted so far


def test_bodies_over_the_limit_are_413_declared_or_chunked(limited: LiveServer, tmp_path: Path) -> None:
    world = make_world(limited)
    path = f"/v1/datasets/{world.dataset_id}/requests"
    big = {"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 0.1, "pad": "x" * 5000}}
    before = world.admin.get(f"/v1/datasets/{world.dataset_id}/budget").json()
    body = assert_problem(world.analyst.post(path, json=big), 413, "/problems/payload-too-large")
    assert "4000" in body["detail"]

    def chunks() -> Iterator[bytes]:
        yield b'{"mechanism": "laplace", "params": {"pad": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}}'

    chunked = world.analyst.post(path, content=chunks(), headers={"content-type": "application/json"})
    assert_problem(chunked, 413)
    after = world.admin.get(f"/v1/datasets/{world.dataset_id}/budget").json()
    assert after == before  # nothing was charged or reserved
    small = world.analyst.post(
        path, json={"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 0.1}}
    )
    assert small.status_code == 200, small.text


def test_the_limit_window_moves_on(database_url: str, tmp_path: Path) -> None:
    settings = server_settings(database_url, tmp_path, rate_limit="3/5 seconds")
    with running_server(settings) as server:
        _, key = server.create_key(Role.viewer)
        with server.client(key) as client:
            assert [client.get("/v1/datasets").status_code for _ in range(4)] == [200, 200, 200, 429]
            time.sleep(5.1)
            assert client.get("/v1/datasets").status_code == 200


def test_disabled_limits_let_bursts_through(database_url: str, tmp_path: Path) -> None:
    settings = server_settings(database_url, tmp_path, rate_limit="", rate_limit_reports="")
    with running_server(settings) as server:
        _, key = server.create_key(Role.viewer)
        with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}) as client:
            assert {client.get("/v1/datasets").status_code for _ in range(40)} == {200}


def test_failed_authentications_from_one_address_are_limited_but_its_working_keys_go_on(
    database_url: str, tmp_path: Path
) -> None:
    """Rotating random keys escaped the per-key limit (each unknown key had a window of its own): now every
    401 counts against the client's address (issue 35, item 15)."""
    settings = server_settings(database_url, tmp_path, rate_limit_failed_auth="5/minute")
    with running_server(settings) as server:
        _, known = server.create_key(Role.viewer)
        _, fresh = server.create_key(Role.viewer)
        with server.client(known) as client:
            assert client.get("/v1/datasets").status_code == 200  # accepted: remembered by the process
        guesses = []
        for _ in range(6):
            with server.client("xp_guess_" + secrets.token_hex(16)) as guesser:
                guesses.append(guesser.get("/v1/datasets"))
        assert [r.status_code for r in guesses[:5]] == [401] * 5
        body = assert_problem(guesses[5], 429, "/problems/rate-limited")
        assert set(body) == PROBLEM_KEYS
        assert "failed authentications" in body["detail"]
        assert 1 <= int(guesses[5].headers["Retry-After"]) <= 60
        with server.client(known) as client:
            assert client.get("/v1/datasets").status_code == 200  # the address's working key goes on
        with server.client(fresh) as client:  # a key this process never accepted waits like a guess
            assert_problem(client.get("/v1/datasets"), 429, "/problems/rate-limited")
        assert all(httpx.get(server.base_url + "/healthz").status_code == 200 for _ in range(3))
