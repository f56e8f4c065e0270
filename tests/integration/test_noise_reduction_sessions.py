"""Noise-reduction sessions and accuracy-first requests over real HTTP, on SQLite and PostgreSQL.

A session reserves its last level at open, ``POST /v1/sessions/{sid}/next`` releases the next, less noisy
level of one correlated chain, and close (or expiry) commits the charge of the last released level.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer
from tests.integration.helpers import (
    World,
    assert_problem,
    backdate_session_expiry,
    db_session,
    get_budget,
    make_world,
    wait_until_closed,
)

COUNT = {"kind": "count"}  # 200 rows in the helpers' CSV
EPSILONS = [0.1, 0.2, 0.4, 0.8]
BUDGET = {"epsilon": 5.0, "delta": 0.0}


def open_nr(world: World, epsilons: list[float] = EPSILONS) -> dict[str, Any]:
    response = world.analyst.post(
        f"/v1/datasets/{world.dataset_id}/sessions",
        json={"mechanism": "noise_reduction.laplace", "params": {"query": COUNT, "epsilons": epsilons}},
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def next_level(world: World, sid: str, key: str | None = None) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return world.analyst.post(f"/v1/sessions/{sid}/next", headers=headers)


def pure(world: World) -> dict[str, Any]:
    return dict(get_budget(world.viewer, world.dataset_id)["pure"])


def exact(value: float, expected: float) -> bool:
    return expected <= value <= expected + 1e-12


class TestSessions:
    def test_levels_come_in_order_and_close_charges_the_last(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        opened = open_nr(world)
        assert exact(opened["worst_case"]["pure"], 0.8)
        assert exact(pure(world)["reserved"], 0.8)
        answers = [next_level(world, opened["id"]) for _ in range(2)]
        assert [a.status_code for a in answers] == [200, 200], answers[-1].text
        assert [a.json()["answer"]["level"] for a in answers] == [0, 1]
        assert [a.json()["answer"]["epsilon"] for a in answers] == [0.1, 0.2]
        closed = world.analyst.post(f"/v1/sessions/{opened['id']}/close")
        assert closed.status_code == 200, closed.text
        assert exact(closed.json()["realized"]["pure"], 0.2)
        assert exact(pure(world)["spent"], 0.2)
        assert pure(world)["reserved"] == 0.0
        again = next_level(world, opened["id"])
        assert assert_problem(again, 409)["type"] == "/problems/session-closed"  # no re-roll after close

    def test_the_last_level_closes_the_session(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        sid = open_nr(world, [0.5, 1.0])["id"]
        assert next_level(world, sid).json()["session"]["state"] == "open"
        last = next_level(world, sid).json()["session"]
        assert last["state"] == "closed"
        assert exact(last["realized"]["pure"], 1.0)

    def test_closing_before_any_release_charges_nothing(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        sid = open_nr(world)["id"]
        closed = world.analyst.post(f"/v1/sessions/{sid}/close")
        assert closed.status_code == 200, closed.text
        assert pure(world)["spent"] == 0.0
        assert pure(world)["reserved"] == 0.0

    def test_concurrent_next_calls_never_release_one_level_twice(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        sid = open_nr(world)["id"]
        barrier = threading.Barrier(4)

        def one(_: int) -> httpx.Response:
            barrier.wait()
            return next_level(world, sid)

        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(one, range(4)))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        levels = sorted(r.json()["answer"]["level"] for r in responses)
        assert levels == [0, 1, 2, 3]
        final = world.analyst.get(f"/v1/sessions/{sid}").json()
        assert final["state"] == "closed"
        assert exact(pure(world)["spent"], 0.8)

    def test_a_retried_next_returns_the_stored_level(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        sid = open_nr(world)["id"]
        first = next_level(world, sid, key="nr-step-1")
        replay = next_level(world, sid, key="nr-step-1")
        assert first.json()["answer"] == replay.json()["answer"]
        assert next_level(world, sid).json()["answer"]["level"] == 1

    def test_an_idle_session_expires_at_its_realized_charge(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        opened = open_nr(world)
        assert next_level(world, opened["id"]).status_code == 200
        with db_session(live_server.settings.database_url) as session, session.begin():
            backdate_session_expiry(session, opened["id"])
        state = wait_until_closed(world.analyst, opened["id"])
        assert state["close_reason"] == "expired"
        assert exact(state["realized"]["pure"], 0.1)
        assert exact(pure(world)["spent"], 0.1)
        assert assert_problem(next_level(world, opened["id"]), 409)["type"] == "/problems/session-closed"

    def test_a_worst_case_above_the_budget_is_refused_at_open(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        response = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={"mechanism": "noise_reduction.laplace", "params": {"query": COUNT, "epsilons": [1.0, 6.0]}},
        )
        assert assert_problem(response, 409)["type"] == "/problems/not-admissible"
        assert pure(world)["reserved"] == 0.0


class TestOneShot:
    @pytest.mark.parametrize("mechanism", ["accuracy_first.laplace", "accuracy_first.gaussian"])
    def test_the_first_level_meeting_the_target_is_released(
        self, live_server: LiveServer, mechanism: str
    ) -> None:
        world = make_world(live_server, {"epsilon": 5.0, "delta": 1e-6})
        grid: dict[str, Any] = (
            {"epsilons": [0.01, 0.05, 0.2, 1.0, 4.0]}
            if mechanism.endswith("laplace")
            else {"variances": [1e4, 1e3, 100.0, 50.0, 25.0]}
        )
        params = {"query": COUNT, "target": {"relative": 0.1}, **grid}
        response = world.request(world.analyst, params, mechanism)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["state"] == "committed"
        release = body["release"]
        assert release["reached"] is True
        assert 200 * 0.5 < release["value"] < 200 * 1.5
        realized = [float(v) for v in body["realized"]["values"]]
        worst = [float(v) for v in body["worst_case"]["values"]]
        assert all(r <= w for r, w in zip(realized, worst, strict=True))
        assert realized != worst  # it stopped before the last level (count 200 needs scale ≤ 9.5)
