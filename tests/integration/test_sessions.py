"""Interactive AboveThreshold sessions over real HTTP, on SQLite and PostgreSQL.

CSV of the helpers: 200 rows, 50 per region. With threshold 150 a count of everyone (200) is above by 50
and a count of one region (50) is below by 100; with ε′ = 1 and ε_i ≥ 0.2 the noise makes any other
outcome astronomically unlikely (P(k > 50) = e^{-51}, P(y ≥ 100) = e^{-20}).
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from service.store.models import AnalysisSession
from service.store.repositories import SessionRepository
from tests.conftest import LiveServer
from tests.integration.helpers import (
    SCHEMA,
    World,
    backdate_session_expiry,
    db_session,
    get_budget,
    ledger_items,
    make_world,
    wait_until_closed,
)

BELOW = {"query": {"kind": "count", "where": [{"column": "region", "op": "eq", "value": "north"}]}}
ABOVE = {"query": {"kind": "count"}}
BUDGET = {"epsilon": 10.0, "delta": 0.0}


def session_params(**overrides: Any) -> dict[str, Any]:
    return {
        "threshold": 150,
        "epsilon_threshold": 1.0,
        "max_query_epsilon": 0.5,
        "max_queries": 10,
        **overrides,
    }


def open_session(world: World, **overrides: Any) -> dict[str, Any]:
    response = world.analyst.post(
        f"/v1/datasets/{world.dataset_id}/sessions",
        json={"mechanism": "above_threshold", "params": session_params(**overrides)},
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def ask(
    world: World, session_id: str, query: dict[str, Any], epsilon: float, key: str | None = None
) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return world.analyst.post(
        f"/v1/sessions/{session_id}/queries", json={**query, "epsilon": epsilon}, headers=headers
    )


def charged(value: float, exact: float) -> bool:
    """Charges are exact or padded up by a few ulps (never below the theorem's value)."""
    return exact <= value <= exact + 1e-12


def pure(world: World) -> dict[str, Any]:
    return dict(get_budget(world.viewer, world.dataset_id)["pure"])


class TestOutcomes:
    def test_open_reserves_the_worst_case(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        opened = open_session(world)
        assert opened["state"] == "open"
        assert charged(opened["worst_case"]["pure"], 2 * 0.5 + 1.0)
        assert charged(pure(world)["reserved"], 2.0)
        assert pure(world)["spent"] == 0.0

    def test_a_halt_at_i_costs_two_eps_i_plus_eps_prime(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        sid = open_session(world)["id"]
        for _ in range(2):
            below = ask(world, sid, BELOW, 0.2)
            assert below.status_code == 200, below.text
            assert below.json()["answer"]["above"] is False
        halted = ask(world, sid, ABOVE, 0.3)
        assert halted.status_code == 200, halted.text
        body = halted.json()
        assert body["answer"]["above"] is True
        assert body["answer"]["index"] == 2
        assert body["session"]["state"] == "closed"
        assert body["session"]["close_reason"] == "halted"
        assert charged(body["session"]["realized"]["pure"], 2 * 0.3 + 1.0)
        assert charged(pure(world)["spent"], 1.6)
        assert pure(world)["reserved"] == 0.0
        closed = ask(world, sid, BELOW, 0.2)
        assert closed.status_code == 409
        assert closed.json()["type"] == "/problems/session-closed"

    def test_an_explicit_close_costs_eps_prime(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        sid = open_session(world)["id"]
        assert ask(world, sid, BELOW, 0.5).status_code == 200
        closed = world.analyst.post(f"/v1/sessions/{sid}/close")
        assert closed.status_code == 200
        assert closed.json()["close_reason"] == "closed"
        assert charged(closed.json()["realized"]["pure"], 1.0)
        spent = pure(world)["spent"]
        assert charged(spent, 1.0)
        assert pure(world)["reserved"] == 0.0
        again = world.analyst.post(f"/v1/sessions/{sid}/close")
        assert again.status_code == 200
        assert pure(world)["spent"] == spent  # closing twice charges once

    def test_max_queries_closes_the_session(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        sid = open_session(world, max_queries=2)["id"]
        assert ask(world, sid, BELOW, 0.5).json()["session"]["state"] == "open"
        last = ask(world, sid, BELOW, 0.5).json()["session"]
        assert (last["state"], last["close_reason"]) == ("closed", "max_queries")
        assert charged(last["realized"]["pure"], 1.0)

    def test_expiry_closes_the_session_with_the_charge_of_its_outcome(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        opened = open_session(world)
        assert ask(world, opened["id"], BELOW, 0.5).status_code == 200
        with db_session(live_server.settings.database_url) as session, session.begin():
            backdate_session_expiry(session, opened["id"])
        state = wait_until_closed(world.analyst, opened["id"])
        assert state["close_reason"] == "expired"
        assert charged(state["realized"]["pure"], 1.0)
        assert charged(pure(world)["spent"], 1.0)
        assert pure(world)["reserved"] == 0.0

    def test_an_answered_query_pushes_the_idle_expiry_back(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        opened = open_session(world)
        threading.Event().wait(0.2)
        asked = ask(world, opened["id"], BELOW, 0.5)
        assert asked.status_code == 200, asked.text
        expires = datetime.fromisoformat(asked.json()["session"]["expires_at"])
        assert expires > datetime.fromisoformat(opened["expires_at"])
        ttl = timedelta(seconds=live_server.settings.session_ttl_seconds)
        assert expires - datetime.now(UTC) <= ttl

    def test_monotone_queries_cost_eps_i_plus_eps_prime(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET, schema={**SCHEMA, "neighboring": "add_remove"})
        opened = open_session(world, require_monotone=True)
        assert charged(opened["worst_case"]["pure"], 0.5 + 1.0)
        halted = ask(world, opened["id"], ABOVE, 0.3).json()
        assert charged(halted["session"]["realized"]["pure"], 0.3 + 1.0)

    def test_monotone_sessions_need_add_remove_neighbours(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        response = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={"mechanism": "above_threshold", "params": session_params(require_monotone=True)},
        )
        assert response.status_code == 422
        assert response.json()["errors"][0]["field"].startswith("params.require_monotone")
        assert pure(world)["reserved"] == 0.0

    def test_the_worst_case_must_fit_the_budget(self, live_server: LiveServer) -> None:
        world = make_world(live_server, {"epsilon": 1.5, "delta": 0.0})
        response = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={"mechanism": "above_threshold", "params": session_params()},
        )
        assert response.status_code == 409
        assert charged(response.json()["pure"]["requested"], 2.0)


class TestSerializationAndRetries:
    def test_concurrent_queries_to_one_session_are_serialized(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        sid = open_session(world, max_queries=12)["id"]
        barrier = threading.Barrier(12)

        def one(i: int) -> httpx.Response:
            with live_server.client(world.analyst.headers["Authorization"].split()[1]) as client:
                barrier.wait()
                return client.post(
                    f"/v1/sessions/{sid}/queries",
                    json={**BELOW, "epsilon": 0.1},
                    headers={"Idempotency-Key": f"q{i}"},
                )

        with ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(one, range(12)))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        assert sorted(r.json()["answer"]["index"] for r in responses) == list(range(12))
        final = world.analyst.get(f"/v1/sessions/{sid}").json()
        assert (final["asked"], final["close_reason"]) == (12, "max_queries")
        request_id = final["id"]
        commits = [e for e in ledger_items(world.admin, world.dataset_id) if e["event"] == "commit"]
        assert len(commits) == 1, request_id
        assert charged(pure(world)["spent"], 1.0)
        assert pure(world)["reserved"] == 0.0

    def test_a_retried_query_returns_the_stored_answer(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        sid = open_session(world)["id"]
        first = ask(world, sid, BELOW, 0.2, key="same")
        again = ask(world, sid, BELOW, 0.2, key="same")
        assert first.json()["answer"] == again.json()["answer"]
        assert again.json()["session"]["asked"] == 1
        assert ask(world, sid, ABOVE, 0.2, key="same").status_code == 422

    def test_other_analysts_and_viewers_cannot_see_a_session(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        sid = open_session(world)["id"]
        from service.auth import Role

        _, stranger = world.new_key(Role.analyst)
        assert stranger.get(f"/v1/sessions/{sid}").status_code == 404
        assert stranger.post(f"/v1/sessions/{sid}/queries", json={**BELOW, "epsilon": 0.1}).status_code == 404
        assert stranger.post(f"/v1/sessions/{sid}/close").status_code == 404
        assert world.viewer.get(f"/v1/sessions/{sid}").status_code == 403
        assert world.admin.get(f"/v1/sessions/{sid}").status_code == 200


class TestSecrets:
    def test_the_secret_state_never_leaves_its_table(
        self, live_server: LiveServer, capfd: pytest.CaptureFixture[str]
    ) -> None:
        world = make_world(live_server, BUDGET)
        opened = open_session(world, epsilon_threshold=1e-6, threshold=-1_000_000)  # k ≈ 1e6: distinctive
        with db_session(live_server.settings.database_url) as session:
            row = session.get(AnalysisSession, opened["id"])
            assert row is not None
            secret = SessionRepository(session).secret(row.request_id)
            assert secret is not None
            state = json.loads(secret.state)
            request_id = row.request_id
        texts = [json.dumps(opened)]
        texts.append(ask(world, opened["id"], BELOW, 0.1).text)
        texts.append(world.analyst.get(f"/v1/sessions/{opened['id']}").text)
        texts.append(world.analyst.post(f"/v1/sessions/{opened['id']}/close").text)
        texts.append(json.dumps(ledger_items(world.admin, world.dataset_id)))
        texts.append(world.admin.get("/metrics/").text)
        texts.append(capfd.readouterr().out)
        public = {"mechanism", "asked", "halted"}
        secret = {name: value for name, value in state.items() if name not in public}
        assert secret, "the state holds the secret noise"
        for name, value in secret.items():
            token = re.compile(rf"(?<![\w.\-]){re.escape(json.dumps(value))}(?![\w.])")
            for text in texts:
                assert f'"{name}"' not in text  # the secret's key never appears
                if abs(value) >= 1000:  # distinctive enough to search for as a bare number
                    assert not token.search(text), (value, text[:200])
        with db_session(live_server.settings.database_url) as session:
            assert SessionRepository(session).secret(request_id) is None  # deleted at close


class TestBatchForm:
    @pytest.mark.parametrize(
        ("queries", "charge", "halt_index"),
        [
            (
                [{**BELOW, "epsilon": 0.2}, {**ABOVE, "epsilon": 0.3}, {**BELOW, "epsilon": 0.4}],
                2 * 0.3 + 1.0,
                1,
            ),
            ([{**BELOW, "epsilon": 0.2}, {**BELOW, "epsilon": 0.5}], 1.0, None),
        ],
    )
    def test_a_batch_is_charged_like_the_session_it_replays(
        self, live_server: LiveServer, queries: list[dict[str, Any]], charge: float, halt_index: int | None
    ) -> None:
        world = make_world(live_server, BUDGET)
        params = {**session_params(max_queries=5), "queries": queries}
        response = world.request(world.analyst, params, mechanism="above_threshold.batch")
        assert response.status_code == 200, response.text
        body = response.json()
        assert charged(body["worst_case"]["pure"], 2.0)
        assert charged(body["realized"]["pure"], charge)
        answers = body["release"]["answers"]
        halts = [a["index"] for a in answers if a["above"]]
        assert halts == ([] if halt_index is None else [halt_index])
        assert len(answers) == (len(queries) if halt_index is None else halt_index + 1)  # stops at the halt
        assert charged(pure(world)["spent"], charge)
        assert pure(world)["reserved"] == 0.0

    def test_a_batch_longer_than_max_queries_is_refused(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        params = {**session_params(max_queries=1), "queries": [{**BELOW, "epsilon": 0.1}] * 2}
        response = world.request(world.analyst, params, mechanism="above_threshold.batch")
        assert response.status_code == 422
        assert pure(world)["reserved"] == 0.0


class TestOtherVariants:
    def test_the_catalog_lists_sessions_with_query_schemas(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        catalog = {m["name"]: m for m in world.analyst.get("/v1/mechanisms").json()}
        for name in ("above_threshold", "above_threshold.dropping", "above_threshold.laplace"):
            assert catalog[name]["kind"] == "session"
            assert "properties" in catalog[name]["query_schema"]
        assert catalog["above_threshold.batch"]["kind"] == "request"

    def test_a_dropping_session_halts_on_a_kept_candidate(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        params = {"threshold": 150.0, "epsilon_threshold": 5.0, "max_query_epsilon": 1.0, "max_queries": 10}
        opened = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={"mechanism": "above_threshold.dropping", "params": params},
        )
        assert opened.status_code == 201, opened.text
        assert charged(opened.json()["worst_case"]["pure"], 2 * 1.0 + 5.0)
        sid = opened.json()["id"]
        for _ in range(10):  # a candidate is dropped with probability 1 − e^{−ε_i·k}; k = 0 w.p. 0.993
            body = ask(world, sid, ABOVE, 1.0).json()
            if body["session"]["state"] == "closed":
                break
        assert body["answer"]["above"] is True
        assert body["answer"]["value"] >= 150.0
        assert charged(body["session"]["realized"]["pure"], 2 * 1.0 + 5.0)

    def test_a_laplace_session_charges_half_its_epsilon_for_nothing_above(
        self, live_server: LiveServer
    ) -> None:
        world = make_world(live_server, BUDGET)
        params = {"threshold": 150.0, "epsilon": 0.8, "max_sensitivity": 1.0, "max_queries": 3}
        opened = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={"mechanism": "above_threshold.laplace", "params": params},
        )
        assert opened.status_code == 201, opened.text
        sid = opened.json()["id"]
        assert (
            world.analyst.post(f"/v1/sessions/{sid}/queries", json=BELOW).json()["answer"]["above"] is False
        )
        closed = world.analyst.post(f"/v1/sessions/{sid}/close").json()
        assert charged(closed["realized"]["pure"], 0.4)  # ⊥ reveals only the threshold noise: ε/2
        sum_query = {"query": {"kind": "sum", "column": "age"}}
        again = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={"mechanism": "above_threshold.laplace", "params": params},
        ).json()
        too_sensitive = world.analyst.post(f"/v1/sessions/{again['id']}/queries", json=sum_query)
        assert too_sensitive.status_code == 422  # Δ(sum of age) = 72 > max_sensitivity
