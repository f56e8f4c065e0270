"""``POST …/requests`` through its direct route (``service/api/direct.py``) answers exactly as through the
FastAPI route: a second server on the same database with ``direct_submit=False`` (the FastAPI route only)
gets every submission too, and the two answers are compared.

* valid submissions are served by the direct route (it declines none of them) and their responses are the
  same bytes as the FastAPI route's: a request submitted to one server and replayed (same Idempotency-Key) on
  the other returns an identical body, status and content headers, in both directions;
* what the FastAPI route answers with a 422 for its headers or body, or another content type, is declined
  (counted by reason in ``expost_direct_submit_declined_total``) and answered by the FastAPI route itself;
* what the direct route answers itself (authentication, unknown dataset or mechanism, invalid parameters,
  a refusal) is the FastAPI route's problem, member for member.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from service.auth import Role
from tests.conftest import LiveServer, running_server
from tests.integration.helpers import World, make_world
from tests.integration.test_observability import scrape, value

DECLINED = "expost_direct_submit_declined_total"
COUNT = {"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 0.01}}
JSON = {"content-type": "application/json"}
QUANTILE = {"mechanism": "quantile", "params": {"column": "age", "quantiles": [0.5], "epsilon": 0.01}}


@pytest.fixture
def fastapi_only(live_server: LiveServer) -> Iterator[LiveServer]:
    """A server on the shared test server's database and data, every submission on the FastAPI route."""
    settings = live_server.settings.model_copy(
        update={"direct_submit": False, "queue_name": f"t{uuid.uuid4().hex[:12]}"}
    )
    with running_server(settings) as server:
        yield server


def declined(client: httpx.Client) -> dict[str, float]:
    _, metrics = scrape(client)
    return {reason: value(metrics, DECLINED, reason=reason) for reason in ("headers", "content-type", "body")}


def test_valid_submissions_are_served_directly_with_the_fastapi_routes_bytes(
    live_server: LiveServer, fastapi_only: LiveServer
) -> None:
    world = make_world(live_server)
    direct, fastapi = world.analyst, fastapi_only.client(world.analyst.headers["Authorization"][7:])
    url = f"/v1/datasets/{world.dataset_id}/requests"
    before = declined(direct)

    for first, then in ((direct, fastapi), (fastapi, direct)):
        key = {"Idempotency-Key": uuid.uuid4().hex}
        submitted = first.post(url, json=COUNT, headers=key)
        replayed = then.post(url, json=COUNT, headers=key)
        assert submitted.status_code == replayed.status_code == 200, (submitted.text, replayed.text)
        assert submitted.json()["state"] == "committed"
        assert replayed.content == submitted.content  # the same stored request, serialized by each route
        for header in ("content-type", "content-length"):
            assert replayed.headers[header] == submitted.headers[header], header
    inline = direct.post(url, json=COUNT, headers={"Prefer": "respond-async"})
    assert inline.status_code == 200, inline.text  # an inline run is done before the reply
    for client in (direct, fastapi):  # on the executor: 202 at once, with where and when to poll
        queued = client.post(url, json=QUANTILE, headers={"Prefer": "respond-async"})
        assert queued.status_code == 202, queued.text
        assert queued.headers["Location"] == f"/v1/requests/{queued.json()['id']}"
        assert 1 <= int(queued.headers["Retry-After"]) <= 10

    assert declined(direct) == before  # each one was served by the direct route (it matches: see below)


def _cases(world: World) -> list[tuple[str, dict[str, Any], str | None]]:
    """(what, httpx arguments, the reason the direct route declines it or None if it answers itself)."""
    json_header = JSON
    body = json.dumps(COUNT)
    return [
        ("Idempotency-Key too long", {"json": COUNT, "headers": {"Idempotency-Key": "k" * 201}}, "headers"),
        ("empty Idempotency-Key", {"json": COUNT, "headers": {"Idempotency-Key": ""}}, "headers"),
        ("Idempotency-Key not ASCII", {"json": COUNT, "headers": {"Idempotency-Key": "k\xe9".encode("latin-1")}},
         "headers"),
        ("Prefer too long", {"json": COUNT, "headers": {"Prefer": "respond-async;" + "x" * 200}}, "headers"),
        ("text body", {"content": body, "headers": {"content-type": "text/plain"}}, "content-type"),
        ("form body", {"data": {"mechanism": "laplace"}}, "content-type"),
        ("malformed JSON", {"content": body[:-1], "headers": json_header}, "body"),
        ("empty body", {"content": b"", "headers": json_header}, "body"),
        ("not UTF-8", {"content": b'{"mechanism": "\xff"}', "headers": json_header}, "body"),
        ("nested too deeply", {"content": "[" * 100_000 + "]" * 100_000, "headers": json_header}, "body"),
        ("an integer of 5000 digits", {"content": '{"mechanism": ' + "9" * 5000 + "}", "headers": json_header},
         "body"),
        ("JSON array", {"json": [COUNT]}, "body"),
        ("no mechanism", {"json": {"params": COUNT["params"]}}, "body"),
        ("an extra member", {"json": {**COUNT, "priority": 1}}, "body"),
        ("params not an object", {"json": {"mechanism": "laplace", "params": [1]}}, "body"),
        ("unknown mechanism", {"json": {"mechanism": "nope", "params": {}}}, None),
        ("negative epsilon", {"json": {"mechanism": "laplace", "params": {"query": {"kind": "count"},
                                                                        "epsilon": -1.0}}}, None),
        ("NaN epsilon", {"content": body.replace("0.01", "NaN"), "headers": json_header}, None),
        ("over the budget", {"json": {"mechanism": "laplace", "params": {"query": {"kind": "count"},
                                                                       "epsilon": 1e6}}}, None),
    ]


def _problem(response: httpx.Response) -> tuple[int, str, Any]:
    content_type = response.headers.get("content-type", "")
    return response.status_code, content_type, response.json() if "json" in content_type else response.text


def test_what_the_direct_route_does_not_serve_gets_the_fastapi_routes_answer(
    live_server: LiveServer, fastapi_only: LiveServer
) -> None:
    world = make_world(live_server)
    key = world.analyst.headers["Authorization"][7:]
    direct, fastapi = world.analyst, fastapi_only.client(key)
    url = f"/v1/datasets/{world.dataset_id}/requests"
    for what, arguments, reason in _cases(world):
        before = declined(direct)
        answers = [_problem(client.post(url, **arguments)) for client in (direct, fastapi)]
        assert answers[0] == answers[1], what
        assert answers[0][0] in (404, 409, 422), (what, answers[0])
        expected = dict(before)
        if reason is not None:
            expected[reason] += 1
        assert declined(direct) == expected, what

    _, admin_key = live_server.create_key(Role.admin)
    _, viewer_key = live_server.create_key(Role.viewer)
    for what, credentials, status in (
        ("no key", None, 401), ("unknown key", "xp_unknown", 401), ("admin", admin_key, 403),
        ("viewer", viewer_key, 403),
    ):
        for body, expected in ((json.dumps(COUNT), status), ("{", 422), ('{"mechanism": 1}', status)):
            # FastAPI decodes the body before it authenticates, and validates it after
            answers = [_problem(server.client(credentials).post(url, content=body, headers=JSON))
                       for server in (live_server, fastapi_only)]
            assert answers[0] == answers[1], (what, body)
            assert answers[0][0] == expected, (what, body, answers[0])
    unknown = "/v1/datasets/ds_unknown/requests"
    assert _problem(direct.post(unknown, json=COUNT)) == _problem(fastapi.post(unknown, json=COUNT))
    assert _problem(direct.post(unknown, json=COUNT))[0] == 404
    methods = [direct.get(url), fastapi.get(url)]  # other methods never match the direct route
    assert [m.status_code for m in methods] == [405, 405]
    assert methods[0].headers["allow"] == methods[1].headers["allow"]
