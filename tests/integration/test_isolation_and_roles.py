"""Analyst isolation and the role × endpoint matrix (docs/api.md, Keys and roles: admin / analyst / viewer),
over real HTTP."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from service.auth import Role
from tests.conftest import LiveServer
from tests.integration.helpers import (
    World,
    assert_problem,
    ledger_items,
    make_world,
    upload,
)

COUNT = {"query": {"kind": "count"}, "epsilon": 0.01}
RDP_BUDGET = {"epsilon": 10.0, "delta": 1e-5}


def grant(world: World, dataset_id: str, analyst: str) -> None:
    response = world.admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": analyst})
    assert response.status_code == 201, response.text


def same_shape(a: dict[str, object], b: dict[str, object], a_id: str, b_id: str) -> None:
    """Two 404 problems that differ only by the id they name (no existence oracle)."""
    assert {k: v for k, v in a.items() if k not in ("detail", "instance")} == {
        k: v for k, v in b.items() if k not in ("detail", "instance")
    }
    assert str(a["detail"]).replace(a_id, "X") == str(b["detail"]).replace(b_id, "X")


class TestAnalystIsolation:
    def test_an_ungranted_analyst_sees_the_dataset_as_missing(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        b_name, b = world.new_key(Role.analyst)
        ds = world.dataset_id
        ledger_before = ledger_items(world.admin, ds)
        missing = "ds_" + "0" * 16
        for method, path, body in (
            ("GET", f"/v1/datasets/{ds}", None),
            ("GET", f"/v1/datasets/{ds}/budget", None),
            ("GET", f"/v1/datasets/{ds}/analysts/{b_name}/budget", None),
            ("GET", f"/v1/datasets/{ds}/ledger", None),
            ("POST", f"/v1/datasets/{ds}/requests", {"mechanism": "laplace", "params": COUNT}),
            ("POST", f"/v1/datasets/{ds}/requests:estimate", {"mechanism": "laplace", "params": COUNT}),
        ):
            hidden = assert_problem(b.request(method, path, json=body), 404, "/problems/not-found")
            absent = assert_problem(b.request(method, path.replace(ds, missing), json=body), 404)
            same_shape(hidden, absent, ds, missing)
        assert ledger_items(world.admin, ds) == ledger_before
        assert world.viewer.get(f"/v1/datasets/{ds}/budget").json()["pure"]["spent"] == 0.0

    def test_an_analyst_cannot_read_another_analysts_request(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        b_name, b = world.new_key(Role.analyst)
        grant(world, world.dataset_id, b_name)  # even on a shared dataset
        mine = world.request(world.analyst, COUNT)
        assert mine.status_code == 200, mine.text
        rid = mine.json()["id"]
        hidden = assert_problem(b.get(f"/v1/requests/{rid}"), 404, "/problems/not-found")
        missing = "rq_" + "0" * 20
        same_shape(hidden, assert_problem(b.get(f"/v1/requests/{missing}"), 404), rid, missing)
        assert "release" not in hidden
        assert world.analyst.get(f"/v1/requests/{rid}").json()["release"] == mine.json()["release"]
        assert world.admin.get(f"/v1/requests/{rid}").status_code == 200

    def test_the_dataset_list_shows_only_granted_datasets(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        b_name, b = world.new_key(Role.analyst)
        second = upload(world.admin)
        assert second.status_code == 201, second.text
        second_id = second.json()["id"]
        grant(world, second_id, b_name)
        assert [d["id"] for d in world.analyst.get("/v1/datasets").json()] == [world.dataset_id]
        assert [d["id"] for d in b.get("/v1/datasets").json()] == [second_id]
        _, c = world.new_key(Role.analyst)
        assert c.get("/v1/datasets").json() == []
        everything = {d["id"] for d in world.admin.get("/v1/datasets").json()}
        assert {world.dataset_id, second_id} <= everything
        assert {world.dataset_id, second_id} <= {d["id"] for d in world.viewer.get("/v1/datasets").json()}

    def test_an_analysts_ledger_shows_only_their_own_request_entries(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        b_name, b = world.new_key(Role.analyst)
        grant(world, world.dataset_id, b_name)
        mine = {world.request(world.analyst, COUNT).json()["id"] for _ in range(2)}
        theirs = {world.request(b, COUNT).json()["id"] for _ in range(3)}
        mine_seen = ledger_items(world.analyst, world.dataset_id)
        theirs_seen = ledger_items(b, world.dataset_id)
        assert {item["request_id"] for item in mine_seen} == mine
        assert {item["request_id"] for item in theirs_seen} == theirs
        assert len(mine_seen) == 2 * len(mine)  # reserve + commit each
        assert len(theirs_seen) == 2 * len(theirs)
        assert all(item["actor"] == world.analyst_name for item in mine_seen)
        admin_view = ledger_items(world.admin, world.dataset_id)
        assert {item["request_id"] for item in admin_view} == mine | theirs | {None}
        assert {item["event"] for item in admin_view} == {"dataset", "grant", "budget", "reserve", "commit"}

    def test_analysts_read_only_their_own_sub_budget(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        b_name, b = world.new_key(Role.analyst)
        grant(world, world.dataset_id, b_name)
        own = world.analyst.get(f"/v1/datasets/{world.dataset_id}/analysts/{world.analyst_name}/budget")
        assert own.status_code == 200, own.text
        assert own.json()["analyst"] == world.analyst_name
        other = world.analyst.get(f"/v1/datasets/{world.dataset_id}/analysts/{b_name}/budget")
        assert_problem(other, 403, "/problems/forbidden")
        assert b.get(f"/v1/datasets/{world.dataset_id}/analysts/{b_name}/budget").status_code == 200
        viewer = world.viewer.get(f"/v1/datasets/{world.dataset_id}/analysts/{b_name}/budget")
        assert viewer.status_code == 200, viewer.text


# ----- the role × endpoint matrix ------------------------------------------------------------------------


@dataclass
class Matrix:
    world: World
    request_id: str
    callers: dict[str, httpx.Client]


@pytest.fixture(scope="class")
def matrix(live_server: LiveServer) -> Iterator[Matrix]:
    world = make_world(live_server, RDP_BUDGET)
    first = world.request(world.analyst, COUNT)
    assert first.status_code == 200, first.text
    callers = {
        "no key": live_server.client(),
        "bad key": live_server.client("xp_" + secrets.token_urlsafe(32)),
        "admin": world.admin,
        "analyst": world.analyst,
        "viewer": world.viewer,
    }
    yield Matrix(world, first.json()["id"], callers)
    for client in (callers["no key"], callers["bad key"], world.admin, world.analyst, world.viewer):
        client.close()


Call = Callable[[httpx.Client, Matrix], httpx.Response]


def _ds(m: Matrix) -> str:
    return f"/v1/datasets/{m.world.dataset_id}"


ENDPOINTS: dict[str, Call] = {
    "POST /v1/datasets": lambda c, m: upload(c),
    "GET /v1/datasets": lambda c, m: c.get("/v1/datasets"),
    "GET /v1/datasets/{id}": lambda c, m: c.get(_ds(m)),
    "POST grants": lambda c, m: c.post(f"{_ds(m)}/grants", json={"analyst": m.world.analyst_name}),
    "GET grants": lambda c, m: c.get(f"{_ds(m)}/grants"),
    "PUT budget": lambda c, m: c.put(f"{_ds(m)}/budget", json=RDP_BUDGET),
    "PUT analyst budget": lambda c, m: c.put(
        f"{_ds(m)}/analysts/{m.world.analyst_name}/budget", json=RDP_BUDGET
    ),
    "GET budget": lambda c, m: c.get(f"{_ds(m)}/budget"),
    "GET analyst budget": lambda c, m: c.get(f"{_ds(m)}/analysts/{m.world.analyst_name}/budget"),
    "POST requests": lambda c, m: c.post(
        f"{_ds(m)}/requests", json={"mechanism": "laplace", "params": COUNT}
    ),
    "POST requests:estimate": lambda c, m: c.post(
        f"{_ds(m)}/requests:estimate", json={"mechanism": "laplace", "params": COUNT}
    ),
    "GET /v1/requests/{rid}": lambda c, m: c.get(f"/v1/requests/{m.request_id}"),
    "GET ledger": lambda c, m: c.get(f"{_ds(m)}/ledger"),
    "GET /v1/mechanisms": lambda c, m: c.get("/v1/mechanisms"),
    "POST /v1/keys": lambda c, m: c.post(
        "/v1/keys", json={"name": f"k-{secrets.token_hex(4)}", "role": "viewer"}
    ),
    "GET /v1/keys": lambda c, m: c.get("/v1/keys"),
}

#                          admin analyst viewer      (no key / bad key: 401 everywhere)
EXPECTED: dict[str, tuple[int, int, int]] = {
    "POST /v1/datasets": (201, 403, 403),
    "GET /v1/datasets": (200, 200, 200),
    "GET /v1/datasets/{id}": (200, 200, 200),
    "POST grants": (201, 403, 403),
    "GET grants": (200, 403, 403),
    "PUT budget": (200, 403, 403),
    "PUT analyst budget": (200, 403, 403),
    "GET budget": (200, 200, 200),
    "GET analyst budget": (200, 200, 200),
    "POST requests": (403, 200, 403),
    "POST requests:estimate": (200, 200, 403),
    "GET /v1/requests/{rid}": (200, 200, 403),
    "GET ledger": (200, 200, 200),
    "GET /v1/mechanisms": (200, 200, 200),
    "POST /v1/keys": (201, 403, 403),
    "GET /v1/keys": (200, 403, 403),
}
assert set(EXPECTED) == set(ENDPOINTS)

CASES = [
    (endpoint, caller, status)
    for endpoint, (admin, analyst, viewer) in EXPECTED.items()
    for caller, status in (
        ("no key", 401),
        ("bad key", 401),
        ("admin", admin),
        ("analyst", analyst),
        ("viewer", viewer),
    )
]


class TestRoleMatrix:
    @pytest.mark.parametrize(("endpoint", "caller", "status"), CASES)
    def test_status(self, matrix: Matrix, endpoint: str, caller: str, status: int) -> None:
        response = ENDPOINTS[endpoint](matrix.callers[caller], matrix)
        if status >= 400:
            kind = {401: "/problems/unauthenticated", 403: "/problems/forbidden"}[status]
            problem = assert_problem(response, status, kind)
            assert "release" not in problem
            if "your_role" in problem:  # the route's role check says which role was refused
                assert problem["your_role"] == caller
        else:
            assert response.status_code == status, response.text
            assert response.headers["content-type"].startswith("application/json")

    def test_a_non_bearer_scheme_is_unauthenticated(self, matrix: Matrix, live_server: LiveServer) -> None:
        key = matrix.world.admin.headers["Authorization"].removeprefix("Bearer ")
        with httpx.Client(base_url=live_server.base_url, headers={"Authorization": f"Basic {key}"}) as client:
            assert_problem(client.get("/v1/datasets"), 401, "/problems/unauthenticated")

    def test_401_names_the_auth_scheme(self, matrix: Matrix) -> None:
        response = matrix.callers["no key"].get("/v1/datasets")
        assert response.status_code == 401
        assert response.headers.get("www-authenticate", "").lower().startswith("bearer")
