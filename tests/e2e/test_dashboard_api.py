"""What the dashboard polls, over real HTTP on both backends: in-flight activity, refusals, the page itself.

Viewers and admins read everyone's activity and refusals; analysts only their own; nothing secret or
released is ever part of them. Refusals are recorded once per refused request or session (never for a dry
run), and recording can never turn a refusal into an error.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from service.auth import Principal, Role
from service.errors import BudgetExhausted
from service.filter.refusals import record_refusal, refusal_row
from service.runs import admission, settlement
from tests.conftest import LiveServer
from tests.integration.helpers import World, assert_problem, db_session, get_budget, make_world

RDP_BUDGET = {"epsilon": 1.0, "delta": 1e-6}
SESSION_PARAMS = {"threshold": 10_000, "epsilon_threshold": 0.05, "max_query_epsilon": 0.05, "max_queries": 4}
REQUEST_KEYS = {
    "id",
    "analyst",
    "mechanism",
    "worst_case_pure",
    "worst_case_binding",
    "since",
    "lease_expires_at",
}
SESSION_KEYS = {
    "id",
    "analyst",
    "mechanism",
    "asked",
    "max_queries",
    "worst_case_pure",
    "worst_case_binding",
    "since",
    "expires_at",
}
REFUSAL_KEYS = {
    "id",
    "dataset_id",
    "analyst",
    "kind",
    "mechanism",
    "params",
    "problem_type",
    "filter",
    "binding_alpha",
    "requested_pure",
    "shortfall",
    "detail",
    "created_at",
}


def activity(client: Any, dataset_id: str) -> dict[str, Any]:
    response = client.get(f"/v1/datasets/{dataset_id}/activity")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def refusals(client: Any, dataset_id: str, **params: int) -> dict[str, Any]:
    response = client.get(f"/v1/datasets/{dataset_id}/refusals", params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


@contextmanager
def reserved_request(server: LiveServer, world: World, epsilon: float) -> Iterator[str]:
    """A request admitted and reserved through the real admission code, left running (as while a slow
    mechanism runs), then aborted without charge."""
    analyst = Principal(world.analyst_name, Role.analyst)
    params = {"query": {"kind": "count"}, "epsilon": epsilon}
    with db_session(server.settings.database_url) as session:
        validated = admission.validate(session, analyst, world.dataset_id, "laplace", params)
    with db_session(server.settings.database_url) as session:
        request, created = admission.admit(session, analyst, validated, None, lease=3600)
        assert created
        ref = settlement.RequestRef.of(request)
    try:
        yield ref.id
    finally:
        with db_session(server.settings.database_url) as session:
            assert settlement.abort(session, ref, "test over: the data was never read")


class TestActivity:
    def test_running_requests_and_open_sessions_with_their_worst_case(self, live_server: LiveServer) -> None:
        world = make_world(live_server, budget=RDP_BUDGET)
        ds = world.dataset_id
        assert activity(world.viewer, ds) | {"binding_alpha": None} == {
            "dataset_id": ds,
            "binding_alpha": None,
            "requests": [],
            "sessions": [],
        }
        with reserved_request(live_server, world, 0.2) as rid:
            opened = world.analyst.post(
                f"/v1/datasets/{ds}/sessions", json={"mechanism": "above_threshold", "params": SESSION_PARAMS}
            )
            assert opened.status_code == 201, opened.text
            sid = opened.json()["id"]
            asked = world.analyst.post(
                f"/v1/sessions/{sid}/queries", json={"query": {"kind": "count"}, "epsilon": 0.05}
            )
            assert asked.status_code == 200, asked.text
            assert asked.json()["answer"]["above"] is False

            budget = get_budget(world.viewer, ds)
            for reader in (world.viewer, world.admin, world.analyst):
                body = activity(reader, ds)
                assert body["binding_alpha"] == budget["binding_alpha"]
                [running] = body["requests"]
                assert set(running) == REQUEST_KEYS
                assert running["id"] == rid
                assert running["analyst"] == world.analyst_name
                assert running["mechanism"] == "laplace"
                assert running["worst_case_pure"] == pytest.approx(0.2)
                [session] = body["sessions"]
                assert set(session) == SESSION_KEYS  # no params, answers, release or secret state
                assert session["id"] == sid
                assert session["asked"] == 1
                assert session["max_queries"] == 4
                assert session["mechanism"] == "above_threshold"
                assert session["worst_case_pure"] == pytest.approx(0.15)  # 2 · 0.05 + 0.05
            # The reservations are what the budget shows as reserved.
            assert budget["pure"]["reserved"] == pytest.approx(0.35)

            # Another analyst granted on the same dataset sees only their own (nothing here).
            other_name, other = world.new_key(Role.analyst)
            granted = world.admin.post(f"/v1/datasets/{ds}/grants", json={"analyst": other_name})
            assert granted.status_code == 201, granted.text
            assert activity(other, ds)["requests"] == []
            assert activity(other, ds)["sessions"] == []
            closed = world.analyst.post(f"/v1/sessions/{sid}/close")
            assert closed.status_code == 200, closed.text
        assert activity(world.viewer, ds)["requests"] == []
        assert activity(world.viewer, ds)["sessions"] == []
        assert get_budget(world.viewer, ds)["pure"]["reserved"] == 0.0

    def test_access_is_checked_like_the_rest_of_the_api(self, live_server: LiveServer) -> None:
        world = make_world(live_server, budget=RDP_BUDGET)
        ds = world.dataset_id
        _, stranger = world.new_key(Role.analyst)  # not granted: the dataset does not exist for them
        for path in (f"/v1/datasets/{ds}/activity", f"/v1/datasets/{ds}/refusals"):
            assert_problem(stranger.get(path), 404, "/problems/not-found")
            assert_problem(live_server.client().get(path), 401, "/problems/unauthenticated")
            assert_problem(world.viewer.get(path.replace(ds, "ds_" + "0" * 16)), 404, "/problems/not-found")
        assert_problem(world.viewer.get(f"/v1/datasets/{ds}/refusals", params={"limit": 0}), 422)
        assert_problem(world.viewer.get(f"/v1/datasets/{ds}/activity", params={"limit": 5000}), 422)


class TestRefusals:
    def test_refused_requests_and_sessions_are_recorded_once(self, live_server: LiveServer) -> None:
        world = make_world(live_server, budget=RDP_BUDGET)
        ds = world.dataset_id
        assert refusals(world.viewer, ds) == {"items": [], "next_after": None}
        too_much = {"query": {"kind": "count"}, "epsilon": 0.9}
        assert world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.2}).status_code == 200
        estimate = world.analyst.post(
            f"/v1/datasets/{ds}/requests:estimate", json={"mechanism": "laplace", "params": too_much}
        )
        assert estimate.status_code == 200, estimate.text
        assert estimate.json()["admitted"] is False
        assert refusals(world.viewer, ds)["items"] == []  # a dry run is not a refusal

        refused = assert_problem(world.request(world.analyst, too_much), 409, "/problems/budget-exhausted")
        session_params = {**SESSION_PARAMS, "max_query_epsilon": 0.4}
        refused_session = assert_problem(
            world.analyst.post(
                f"/v1/datasets/{ds}/sessions", json={"mechanism": "above_threshold", "params": session_params}
            ),
            409,
            "/problems/budget-exhausted",
        )
        items = refusals(world.viewer, ds)["items"]
        assert [r["kind"] for r in items] == ["request", "session"]
        first, second = items
        assert set(first) == REFUSAL_KEYS
        assert first["dataset_id"] == ds
        assert first["analyst"] == world.analyst_name
        assert first["mechanism"] == "laplace"
        assert first["params"] is None  # viewers never see request parameters (the ledger's rule too)
        assert first["problem_type"] == "/problems/budget-exhausted"
        assert first["filter"] == refused["filter"] == "dataset"
        assert first["binding_alpha"] == refused["binding_alpha"]
        assert first["shortfall"] == pytest.approx(refused["shortfall"])
        assert first["requested_pure"] == pytest.approx(0.9)
        assert first["detail"] == refused["detail"]
        assert second["mechanism"] == "above_threshold"
        assert second["params"] is None
        assert second["detail"] == refused_session["detail"]
        assert second["requested_pure"] == pytest.approx(0.85)

        # Analysts see their own, with parameters; others nothing; admins everything. Paged by id.
        full = refusals(world.admin, ds)["items"]
        assert [r["params"] for r in full] == [too_much, session_params]
        assert [{**r, "params": None} for r in full] == items
        assert refusals(world.analyst, ds)["items"] == full
        other_name, other = world.new_key(Role.analyst)
        assert world.admin.post(f"/v1/datasets/{ds}/grants", json={"analyst": other_name}).status_code == 201
        assert refusals(other, ds)["items"] == []
        page = refusals(world.viewer, ds, limit=1)
        assert page["items"] == items[:1]
        assert page["next_after"] == items[0]["id"]
        assert refusals(world.viewer, ds, after=page["next_after"], limit=1)["items"] == items[1:]
        assert refusals(world.viewer, ds, after=items[1]["id"])["items"] == []

    def test_a_never_admissible_request_is_recorded_as_such(self, live_server: LiveServer) -> None:
        world = make_world(live_server)  # a pure (δ = 0) budget: a Gaussian never fits
        params = {"query": {"kind": "count"}, "sigma": 5}
        refused = world.request(world.analyst, params, mechanism="gaussian")
        assert_problem(refused, 409, "/problems/not-admissible")
        [item] = refusals(world.viewer, world.dataset_id)["items"]
        assert item["problem_type"] == "/problems/not-admissible"
        assert item["requested_pure"] == "inf"
        assert item["mechanism"] == "gaussian"

    def test_recording_never_turns_a_refusal_into_an_error(self) -> None:
        class Broken:
            def sessions(self) -> Any:
                raise RuntimeError("the database is gone")

        problem = BudgetExhausted("refused", filter="dataset", binding_alpha="pure", requested={"pure": 1.0})
        analyst = Principal("a", Role.analyst)
        for params in ({}, {"x": float("nan")}):
            record_refusal(Broken().sessions, analyst, "ds_x", "request", "laplace", params, problem)  # type: ignore[arg-type]
        # Params that are not plain JSON are not stored (the row still is).
        row = refusal_row(analyst, "ds_x", "request", "laplace", {"x": float("nan")}, problem)
        assert row.params is None
        assert row.requested_pure == 1.0
        assert row.binding_alpha == "pure"


class TestPage:
    def test_the_page_and_its_assets_are_served_from_this_server(self, live_server: LiveServer) -> None:
        client = live_server.client()  # no key needed for the page itself
        page = client.get("/dashboard")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'self'" in csp
        assert "script-src 'self'" in csp
        assert re.findall(r"(?:src|href)=\"(https?:)?//", page.text) == []  # nothing from a CDN
        for asset, kind in (
            ("/dashboard/static/dashboard.js", "javascript"),
            ("/dashboard/static/dashboard.css", "text/css"),
            ("/dashboard/static/vendor/chart.umd.min.js", "javascript"),
        ):
            assert f'"{asset}"' in page.text
            response = client.get(asset)
            assert response.status_code == 200, asset
            assert kind in response.headers["content-type"]
            assert response.headers.get("etag")
            assert client.get(asset, headers={"If-None-Match": response.headers["etag"]}).status_code == 304
        assert "Chart.js v4" in client.get("/dashboard/static/vendor/chart.umd.min.js").text[:200]
        for bad in (
            "/dashboard/static/../routers/dashboard.py",
            "/dashboard/static/%2e%2e/app.py",
            "/dashboard/static/missing.js",
            "/dashboard/static/",
        ):
            assert client.get(bad).status_code == 404, bad
        assert client.get("/dashboard/", follow_redirects=False).status_code == 308
