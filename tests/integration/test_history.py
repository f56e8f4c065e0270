"""History: ``GET /v1/requests`` and ``GET /v1/sessions`` over real HTTP, on SQLite and PostgreSQL.

An analyst lists only their own requests and sessions, an admin everyone's (or one analyst's), a viewer
nothing (403, as for reading a release). Items are exactly what the single GET shows; pages are keyset
pages, newest first, and walking them yields every item once; ``dataset_id`` and ``state`` filter; bad
filter values are 422 problems naming the parameter. The client's ``list_requests`` / ``list_sessions``
(sync and async) walk the same pages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from expost_client import AsyncExpostClient, AuthError, ExpostClient, InvalidInputError
from service.auth import Role
from service.cli import DEMO_LEARNING_SCHEMA, demo_learning_csv
from service.store.models import AnalysisRequest, RequestState
from tests.conftest import LiveServer
from tests.integration.helpers import (
    BIG,
    World,
    add_dataset,
    assert_problem,
    db_session,
    key_of,
    ledger_items,
    make_world,
)

COUNT = {"query": {"kind": "count"}, "epsilon": 0.01}
# never halts (the threshold is far above any count of the data) and never fills up
SESSION = {"threshold": 10**9, "epsilon_threshold": 0.01, "max_query_epsilon": 0.01, "max_queries": 100}
LONG = {  # runs for far longer than the test takes to cancel it
    "features": ["age", "tenure"],
    "label": "churn",
    "steps": 10000,
    "clip": 1.0,
    "target_epsilon": 2.0,
    "target_delta": 1e-6,
}


@dataclass
class History:
    world: World
    other: httpx.Client  # a second analyst, granted on the first dataset
    other_name: str
    second_dataset: str
    requests: dict[str, list[str]]  # analyst name → ids of the requests made
    sessions: dict[str, list[str]]  # analyst name → ids of the sessions opened
    cancelled: str  # a request of the world's analyst cancelled at once (aborted or failed_charged)
    closed: str  # a session of the world's analyst, closed

    @property
    def analyst(self) -> httpx.Client:
        return self.world.analyst


def submitted(world: World, client: httpx.Client, dataset_id: str) -> str:
    response = world.request(client, COUNT, dataset_id=dataset_id)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def opened(client: httpx.Client, dataset_id: str) -> str:
    response = client.post(
        f"/v1/datasets/{dataset_id}/sessions", json={"mechanism": "above_threshold", "params": SESSION}
    )
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


@pytest.fixture(scope="module")
def history(live_server: LiveServer) -> History:
    world = make_world(live_server, BIG)
    second = add_dataset(
        world, demo_learning_csv(rows=2000), DEMO_LEARNING_SCHEMA, {"epsilon": 50.0, "delta": 1e-6}
    )
    other_name, other = world.new_key(Role.analyst)
    granted = world.admin.post(f"/v1/datasets/{world.dataset_id}/grants", json={"analyst": other_name})
    assert granted.status_code == 201, granted.text
    mine = [submitted(world, world.analyst, world.dataset_id) for _ in range(5)]
    mine += [submitted(world, world.analyst, second) for _ in range(2)]
    long = world.analyst.post(
        f"/v1/datasets/{second}/requests",
        json={"mechanism": "dp_gd", "params": LONG},
        headers={"Prefer": "respond-async"},
    )
    assert long.status_code == 202, long.text
    cancelled = world.analyst.post(f"/v1/requests/{long.json()['id']}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["state"] in ("aborted", "failed_charged")
    mine.append(cancelled.json()["id"])
    theirs = [submitted(world, other, world.dataset_id) for _ in range(2)]
    my_sessions = [opened(world.analyst, world.dataset_id) for _ in range(3)]
    my_sessions.append(opened(world.analyst, second))
    closed = world.analyst.post(f"/v1/sessions/{my_sessions[0]}/close")
    assert closed.status_code == 200, closed.text
    their_sessions = [opened(other, world.dataset_id)]
    return History(
        world,
        other,
        other_name,
        second,
        {world.analyst_name: mine, other_name: theirs},
        {world.analyst_name: my_sessions, other_name: their_sessions},
        cancelled.json()["id"],
        my_sessions[0],
    )


def walk(client: httpx.Client, path: str, limit: int = 100, **filters: str) -> list[dict[str, Any]]:
    """Every item of a history listing, page by page; checks the cursor contract on the way."""
    items: list[dict[str, Any]] = []
    after: str | None = None
    for _ in range(1000):
        params: dict[str, Any] = {**filters, "limit": limit} | ({"after": after} if after else {})
        response = client.get(path, params=params)
        assert response.status_code == 200, response.text
        page = response.json()
        assert set(page) == {"items", "next_after"}
        assert len(page["items"]) <= limit
        items += page["items"]
        if page["next_after"] is None:
            return items
        assert len(page["items"]) == limit  # only a full page has a next one
        assert page["next_after"] == page["items"][-1]["id"]
        after = page["next_after"]
    raise AssertionError("the pages never ended")


def ids(items: list[dict[str, Any]]) -> list[str]:
    return [item["id"] for item in items]


def assert_newest_first(items: list[dict[str, Any]]) -> None:
    keys = [(datetime.fromisoformat(item["created_at"]), item["id"]) for item in items]
    assert keys == sorted(keys, reverse=True)


# ----- who sees what ----------------------------------------------------------------------------------------


def test_an_analyst_lists_only_their_own_requests_and_sessions(history: History) -> None:
    me, them = history.world.analyst_name, history.other_name
    requests = walk(history.analyst, "/v1/requests")
    assert sorted(ids(requests)) == sorted(history.requests[me])
    assert_newest_first(requests)
    assert {r["analyst"] for r in requests} == {me}
    sessions = walk(history.analyst, "/v1/sessions")
    assert sorted(ids(sessions)) == sorted(history.sessions[me])
    assert_newest_first(sessions)
    assert sorted(ids(walk(history.other, "/v1/requests"))) == sorted(history.requests[them])
    assert sorted(ids(walk(history.other, "/v1/sessions"))) == sorted(history.sessions[them])
    # naming oneself is allowed; naming another analyst is not
    assert sorted(ids(walk(history.analyst, "/v1/requests", analyst=me))) == sorted(history.requests[me])
    for path in ("/v1/requests", "/v1/sessions"):
        assert_problem(history.analyst.get(path, params={"analyst": them}), 403, "/problems/forbidden")


def test_items_are_what_the_single_get_shows(history: History) -> None:
    for item in walk(history.analyst, "/v1/requests"):
        single = history.analyst.get(f"/v1/requests/{item['id']}")
        assert single.status_code == 200, single.text
        assert item == single.json()
        if item["state"] == "committed":
            assert item["release"] is not None  # releases where the single GET shows them
    ledger = ledger_items(history.world.admin, history.world.dataset_id)
    for item in walk(history.analyst, "/v1/sessions"):
        single = history.analyst.get(f"/v1/sessions/{item['id']}")
        assert single.status_code == 200, single.text
        assert item == single.json()
        assert item["request_id"].startswith("rq_")
        if item["dataset_id"] == history.world.dataset_id:  # its ledger entries carry its request id
            assert "reserve" in [e["event"] for e in ledger if e.get("request_id") == item["request_id"]]


def test_an_admin_lists_everyones_or_one_analysts(history: History) -> None:
    admin, dataset = history.world.admin, history.world.dataset_id
    me, them = history.world.analyst_name, history.other_name
    everyone = walk(admin, "/v1/requests", dataset_id=dataset)
    on_dataset = history.requests[me][:5] + history.requests[them]
    assert sorted(ids(everyone)) == sorted(on_dataset)
    assert_newest_first(everyone)
    assert sorted(ids(walk(admin, "/v1/requests", analyst=them))) == sorted(history.requests[them])
    assert sorted(ids(walk(admin, "/v1/requests", analyst=me))) == sorted(history.requests[me])
    sessions = walk(admin, "/v1/sessions", dataset_id=dataset)
    assert sorted(ids(sessions)) == sorted(history.sessions[me][:3] + history.sessions[them])
    assert sorted(ids(walk(admin, "/v1/sessions", analyst=them))) == sorted(history.sessions[them])
    # an admin may continue after anyone's item
    first = admin.get("/v1/requests", params={"analyst": them, "limit": 1}).json()
    rest = walk(admin, "/v1/requests", analyst=them, after=first["next_after"])
    assert ids(first["items"]) + ids(rest) == ids(walk(admin, "/v1/requests", analyst=them))


def test_a_viewer_is_refused(history: History) -> None:
    for path in ("/v1/requests", "/v1/sessions"):
        assert_problem(history.world.viewer.get(path), 403, "/problems/forbidden")
        assert_problem(history.world.viewer.get(path, params={"dataset_id": history.world.dataset_id}), 403)


# ----- pages and filters ------------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [1, 2, 3, 8, 9])
def test_walking_the_pages_yields_every_item_once(history: History, limit: int) -> None:
    me = history.world.analyst_name
    everything = walk(history.analyst, "/v1/requests")
    assert len(everything) == 8
    paged = walk(history.analyst, "/v1/requests", limit=limit)
    assert ids(paged) == ids(everything)  # same order, each once (8 items: limit 8 ends without a cursor)
    assert len(set(ids(paged))) == len(history.requests[me])
    sessions = walk(history.analyst, "/v1/sessions", limit=limit)
    assert ids(sessions) == ids(walk(history.analyst, "/v1/sessions"))
    assert len(set(ids(sessions))) == len(history.sessions[me])


def test_items_created_at_the_same_instant_are_paged_by_id(live_server: LiveServer, history: History) -> None:
    """The cursor is (created_at, id): ties on the timestamp neither repeat nor skip an item."""
    name, client = history.world.new_key(Role.analyst)
    granted = history.world.admin.post(
        f"/v1/datasets/{history.world.dataset_id}/grants", json={"analyst": name}
    )
    assert granted.status_code == 201, granted.text
    made = [submitted(history.world, client, history.world.dataset_id) for _ in range(5)]
    with db_session(live_server.settings.database_url) as session, session.begin():
        instant = session.get(AnalysisRequest, made[0])
        assert instant is not None
        session.execute(
            update(AnalysisRequest)
            .where(AnalysisRequest.id.in_(made[1:4]))
            .values(created_at=instant.created_at)
        )
    paged = walk(client, "/v1/requests", limit=1)
    assert sorted(ids(paged)) == sorted(made)
    assert_newest_first(paged)
    assert ids(walk(client, "/v1/requests", limit=2)) == ids(paged)


def test_the_dataset_and_state_filters(history: History) -> None:
    me = history.world.analyst_name
    first, second = history.world.dataset_id, history.second_dataset
    mine = walk(history.analyst, "/v1/requests")
    on_first = walk(history.analyst, "/v1/requests", dataset_id=first)
    assert sorted(ids(on_first)) == sorted(history.requests[me][:5])
    assert {i["dataset_id"] for i in on_first} == {first}
    on_second = walk(history.analyst, "/v1/requests", dataset_id=second)
    assert sorted(ids(on_second)) == sorted(history.requests[me][5:])
    cancelled_state = next(i["state"] for i in mine if i["id"] == history.cancelled)
    for state in RequestState:
        shown = walk(history.analyst, "/v1/requests", state=state.value)
        assert sorted(ids(shown)) == sorted(i["id"] for i in mine if i["state"] == state.value), state
    assert ids(walk(history.analyst, "/v1/requests", dataset_id=second, state=cancelled_state)) == [
        history.cancelled
    ]
    assert len(walk(history.analyst, "/v1/requests", state="committed")) == 7
    assert walk(history.analyst, "/v1/requests", dataset_id="ds_nothing_here") == []

    closed = walk(history.analyst, "/v1/sessions", state="closed")
    assert ids(closed) == [history.closed]
    assert closed[0]["state"] == "closed"
    open_on_first = walk(history.analyst, "/v1/sessions", state="open", dataset_id=first)
    assert sorted(ids(open_on_first)) == sorted(history.sessions[me][1:3])
    assert ids(walk(history.analyst, "/v1/sessions", dataset_id=second)) == [history.sessions[me][3]]


@pytest.mark.parametrize("path", ["/v1/requests", "/v1/sessions"])
@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"state": "bogus"}, "query.state"),
        ({"state": ""}, "query.state"),
        ({"limit": 0}, "query.limit"),
        ({"limit": 1001}, "query.limit"),
        ({"limit": "ten"}, "query.limit"),
        ({"dataset_id": "ds\x00x"}, "query.dataset_id"),
        ({"dataset_id": "x" * 41}, "query.dataset_id"),
        ({"analyst": "-nobody"}, "query.analyst"),
        ({"analyst": "a\x00b"}, "query.analyst"),
        ({"after": "rq_does_not_exist"}, "query.after"),
        ({"after": "ss_does_not_exist"}, "query.after"),
        ({"after": "ab\x00"}, "query.after"),
        ({"after": ""}, "query.after"),
    ],
)
def test_bad_filter_values_are_problems_naming_the_parameter(
    history: History, path: str, params: dict[str, Any], field: str
) -> None:
    for client in (history.analyst, history.world.admin):
        body = assert_problem(client.get(path, params=params), 422, "/problems/invalid-input")
        assert body["errors"][0]["field"] == field, body


def test_a_cursor_from_someone_elses_listing_is_bad_input_not_a_leak(history: History) -> None:
    """An analyst cannot continue after another analyst's item: the same 422 as an unknown id."""
    theirs = history.requests[history.other_name][0]
    unknown = assert_problem(history.analyst.get("/v1/requests", params={"after": "rq_unknown"}), 422)
    foreign = assert_problem(history.analyst.get("/v1/requests", params={"after": theirs}), 422)
    assert foreign["errors"][0]["field"] == unknown["errors"][0]["field"] == "query.after"
    assert foreign["detail"].replace(theirs, "X") == unknown["detail"].replace("rq_unknown", "X")
    their_session = history.sessions[history.other_name][0]
    assert_problem(history.analyst.get("/v1/sessions", params={"after": their_session}), 422)
    # a session id is no request cursor, and a request id no session cursor
    assert_problem(history.analyst.get("/v1/requests", params={"after": history.closed}), 422)
    assert_problem(history.analyst.get("/v1/sessions", params={"after": history.cancelled}), 422)


# ----- the client -------------------------------------------------------------------------------------------


@pytest.fixture
def clients(live_server: LiveServer, history: History) -> Iterator[tuple[ExpostClient, ExpostClient]]:
    with (
        ExpostClient(live_server.base_url, key_of(history.analyst)) as analyst,
        ExpostClient(live_server.base_url, key_of(history.world.admin)) as admin,
    ):
        yield analyst, admin


def test_the_client_walks_the_history(history: History, clients: tuple[ExpostClient, ExpostClient]) -> None:
    analyst, admin = clients
    me = history.world.analyst_name
    over_http = ids(walk(history.analyst, "/v1/requests"))
    listed = list(analyst.list_requests(page_size=3))
    assert [r.id for r in listed] == over_http
    assert {r.analyst for r in listed} == {me}
    assert all(r.worst_case.pure is not None for r in listed)
    on_first = history.world.dataset_id
    committed = list(analyst.list_requests(dataset_id=on_first, state="committed", page_size=2))
    assert sorted(r.id for r in committed) == sorted(history.requests[me][:5])
    assert all(r.release is not None for r in committed)
    page = analyst.requests_page(limit=3)
    assert [r.id for r in page.items] == over_http[:3]
    assert page.next_after == over_http[2]
    assert [r.id for r in analyst.list_requests(after=page.next_after)] == over_http[3:]

    sessions = list(analyst.list_sessions(page_size=1))
    assert [s.id for s in sessions] == ids(walk(history.analyst, "/v1/sessions"))
    assert all(s.request_id is not None and s.request_id.startswith("rq_") for s in sessions)
    assert [s.id for s in analyst.list_sessions(state="closed")] == [history.closed]
    closed = analyst.sessions_page(state="closed")
    assert closed.next_after is None
    assert [s.request_id for s in closed.items] == [analyst.get_session(history.closed).request_id]
    their = [s.id for s in admin.list_sessions(analyst=history.other_name, page_size=1)]
    assert their == history.sessions[history.other_name]

    with pytest.raises(AuthError) as refused:
        list(analyst.list_requests(analyst=history.other_name))
    assert refused.value.status == 403
    with pytest.raises(InvalidInputError):
        analyst.sessions_page(state="bogus")


def test_the_async_client_walks_the_history(live_server: LiveServer, history: History) -> None:
    async def both() -> tuple[list[str], list[str], list[str]]:
        async with AsyncExpostClient(live_server.base_url, key_of(history.analyst)) as client:
            requests = [r.id async for r in client.list_requests(page_size=2)]
            sessions = [s.id async for s in client.list_sessions(state="open", page_size=2)]
            page = await client.sessions_page(limit=2)
            return requests, sessions, [s.id for s in page.items]

    requests, sessions, first_page = asyncio.run(both())
    assert requests == ids(walk(history.analyst, "/v1/requests"))
    assert sessions == ids(walk(history.analyst, "/v1/sessions", state="open"))
    assert first_page == ids(walk(history.analyst, "/v1/sessions"))[:2]
