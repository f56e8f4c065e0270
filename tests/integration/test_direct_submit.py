"""``POST …/requests`` through its direct route (``service/api/direct.py``) answers exactly as through the
FastAPI route: a second server on the same database with ``direct_submit=False`` (the FastAPI route only)
gets every submission too, and the two answers are compared.

* valid submissions are served by the direct route (it declines none of them) and their responses are the
  same bytes as the FastAPI route's: a request submitted to one server and replayed (same Idempotency-Key) on
  the other returns an identical body, status and content headers, in both directions; a 202 carries the
  same Location and Retry-After;
* what the FastAPI route answers with a 400 or 422 for its headers or body is declined (counted by reason
  in ``expost_direct_submit_declined_total``) and answered by the FastAPI route itself; another content
  type or a body over ``MAX_DIRECT_BODY`` never matches the direct route;
* what the direct route answers itself (authentication, unknown dataset or mechanism, invalid parameters,
  a refusal) is the FastAPI route's problem, member for member;
* an app mounted under a prefix hands what its direct route declines to its own router.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from service.api.direct import MAX_DIRECT_BODY
from service.app import create_app
from service.auth import Role
from tests.conftest import LiveServer, running_server
from tests.integration.helpers import make_world
from tests.integration.scale_out_support import GatedCount
from tests.integration.test_observability import scrape, value

DECLINED = "expost_direct_submit_declined_total"
COUNT = {"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 0.01}}
JSON = {"content-type": "application/json"}
KEY = "Idempotency-Key"


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
    return {reason: value(metrics, DECLINED, reason=reason) for reason in ("headers", "body")}


def test_valid_submissions_are_served_directly_with_the_fastapi_routes_bytes(
    live_server: LiveServer, fastapi_only: LiveServer, gated: GatedCount
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
    running = []
    for client in (direct, fastapi):  # held running by its gate: 202 at once, with where and when to poll
        body = {"mechanism": gated.name, "params": COUNT["params"]}
        running.append(client.post(url, json=body, headers={"Prefer": "respond-async"}))
    gated.gate.set()
    for answer in running:
        assert answer.status_code == 202, answer.text
        assert answer.headers["Location"] == f"/v1/requests/{answer.json()['id']}"
        assert 1 <= int(answer.headers["Retry-After"]) <= 10
    assert running[0].headers["content-type"] == running[1].headers["content-type"]

    assert declined(direct) == before  # each one was served by the direct route (it matches: see below)


def _cases() -> list[tuple[str, dict[str, Any], str | None, int]]:
    """(what, httpx arguments, why the direct route declines it — None if it answers itself or never
    matches —, the status both routes answer)."""
    body = json.dumps(COUNT)
    epsilon = {"json": {"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": -1.0}}}
    huge = {"json": {"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 50.0}}}
    return [
        ("Idempotency-Key too long", {"json": COUNT, "headers": {KEY: "k" * 201}}, "headers", 422),
        ("empty Idempotency-Key", {"json": COUNT, "headers": {KEY: ""}}, "headers", 422),
        (
            "Idempotency-Key not ASCII",
            {"json": COUNT, "headers": {KEY: "k\xe9".encode("latin-1")}},
            "headers",
            422,
        ),
        ("Prefer too long", {"json": COUNT, "headers": {"Prefer": "async;" + "x" * 200}}, "headers", 422),
        ("text body", {"content": body, "headers": {"content-type": "text/plain"}}, None, 422),
        ("form body", {"data": {"mechanism": "laplace"}}, None, 422),
        ("JSON with an empty content type", {"content": body, "headers": {"content-type": ""}}, None, 422),
        ("over the direct route's bound", {"json": {**COUNT, "pad": "x" * MAX_DIRECT_BODY}}, None, 422),
        ("malformed JSON", {"content": body[:-1], "headers": JSON}, "body", 422),
        ("empty body", {"content": b"", "headers": JSON}, "body", 422),
        ("not UTF-8", {"content": b'{"mechanism": "\xff"}', "headers": JSON}, "body", 422),
        ("nested too deeply", {"content": "[" * 100_000 + "]" * 100_000, "headers": JSON}, None, 422),
        ("nested within the bound", {"content": "[" * 500 + "]" * 500, "headers": JSON}, "body", 422),
        (
            "an integer of 5000 digits",
            {"content": '{"mechanism": ' + "9" * 5000 + "}", "headers": JSON},
            None,
            422,
        ),
        ("JSON array", {"json": [COUNT]}, "body", 422),
        ("no mechanism", {"json": {"params": COUNT["params"]}}, "body", 422),
        ("an extra member", {"json": {**COUNT, "priority": 1}}, "body", 422),
        ("params not an object", {"json": {"mechanism": "laplace", "params": [1]}}, "body", 422),
        ("unknown mechanism", {"json": {"mechanism": "nope", "params": {}}}, None, 422),
        ("negative epsilon", epsilon, None, 422),
        ("NaN epsilon", {"content": body.replace("0.01", "NaN"), "headers": JSON}, None, 422),
        ("over the budget", huge, None, 409),
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
    for what, arguments, reason, status in _cases():
        before = declined(direct)
        answers = [_problem(client.post(url, **arguments)) for client in (direct, fastapi)]
        assert answers[0] == answers[1], what
        assert answers[0][0] == status, (what, answers[0])
        expected = dict(before)
        if reason is not None:
            expected[reason] += 1
        assert declined(direct) == expected, what

    _, admin_key = live_server.create_key(Role.admin)
    _, viewer_key = live_server.create_key(Role.viewer)
    for what, credentials, status in (
        ("no key", None, 401),
        ("unknown key", "xp_unknown", 401),
        ("admin", admin_key, 403),
        ("viewer", viewer_key, 403),
    ):
        for body, expected in ((json.dumps(COUNT), status), ("{", 422), ('{"mechanism": 1}', status)):
            # FastAPI decodes the body before it authenticates, and validates it after
            answers = [
                _problem(server.client(credentials).post(url, content=body, headers=JSON))
                for server in (live_server, fastapi_only)
            ]
            assert answers[0] == answers[1], (what, body)
            assert answers[0][0] == expected, (what, body, answers[0])
    unknown = "/v1/datasets/ds_unknown/requests"
    assert _problem(direct.post(unknown, json=COUNT)) == _problem(fastapi.post(unknown, json=COUNT))
    assert _problem(direct.post(unknown, json=COUNT))[0] == 404
    methods = [direct.get(url), fastapi.get(url)]  # other methods never match the direct route
    assert [m.status_code for m in methods] == [405, 405]
    assert methods[0].headers["allow"] == methods[1].headers["allow"]


def test_a_mounted_app_hands_what_it_declines_to_its_own_router(live_server: LiveServer) -> None:
    """Under ``Mount("/api", app)`` the scope's router is the outer one: a declined submission must still
    reach this app's FastAPI route (not the outer router, which would answer 404)."""
    world = make_world(live_server)
    path = f"/api/v1/datasets/{world.dataset_id}/requests"
    declined_ones = [
        {"json": COUNT, "headers": {KEY: "k" * 201}},
        {"content": "{", "headers": JSON},
        {"json": {**COUNT, "priority": 1}},
    ]

    async def answers(direct_submit: bool) -> list[tuple[int, str, Any]]:
        inner = create_app(
            live_server.settings.model_copy(
                update={"direct_submit": direct_submit, "queue_name": f"t{uuid.uuid4().hex[:12]}"}
            )
        )
        outer = Starlette(routes=[Mount("/api", app=inner)])
        transport = httpx.ASGITransport(app=outer)
        async with (
            inner.router.lifespan_context(inner),
            httpx.AsyncClient(
                transport=transport, base_url="http://test", headers=world.analyst.headers
            ) as client,
        ):
            served = await client.post(path, json=COUNT)
            assert served.status_code == 200, served.text
            return [_problem(await client.post(path, **arguments)) for arguments in declined_ones]

    direct, fastapi = asyncio.run(answers(True)), asyncio.run(answers(False))
    assert direct == fastapi
    assert [answer[0] for answer in direct] == [422, 422, 422]
