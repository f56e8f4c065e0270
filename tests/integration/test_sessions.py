"""Interactive AboveThreshold sessions over real HTTP (and, for races with the reaper and failing steps,
through the domain functions), on SQLite and PostgreSQL.

CSV of the helpers: 200 rows, 50 per region. With threshold 150 a count of everyone (200) is above by 50
and a count of one region (50) is below by 100; with ε′ = 1 and ε_i ≥ 0.2 the noise makes any other
outcome astronomically unlikely (P(k > 50) = e^{-51}, P(y ≥ 100) = e^{-20}).
"""

from __future__ import annotations

import io
import json
import math
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import UNITS_PER_EPSILON
from mechanisms.catalog import INTERACTIVE
from service.errors import MechanismFailed
from service.filter.ledger import verify
from service.logs import configure_logging
from service.runs import sessions as domain
from service.store.models import AnalysisSession
from service.store.repositories import SessionRepository
from tests.conftest import LiveServer
from tests.integration.helpers import (
    SCHEMA,
    World,
    app_for,
    assert_problem,
    backdate_session_expiry,
    commits_of,
    db_session,
    get_budget,
    key_of,
    laplace_session,
    ledger_items,
    make_world,
    totals,
    wait_until_closed,
    world_in_db,
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

    def test_concurrent_close_and_ask_on_one_session_commit_exactly_once(
        self, live_server: LiveServer
    ) -> None:
        world = make_world(live_server, {"epsilon": 10.0, "delta": 0.0})
        opened = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={
                "mechanism": "above_threshold",
                "params": {
                    "threshold": 150,
                    "epsilon_threshold": 1.0,
                    "max_query_epsilon": 0.5,
                    "max_queries": 50,
                },
            },
        )
        assert opened.status_code == 201, opened.text
        sid, key = opened.json()["id"], key_of(world.analyst)
        barrier = threading.Barrier(16)

        def one(i: int) -> httpx.Response:
            with live_server.client(key) as client:
                barrier.wait()
                if i % 4 == 0:
                    return client.post(f"/v1/sessions/{sid}/close")
                return client.post(
                    f"/v1/sessions/{sid}/queries",
                    json={**BELOW, "epsilon": 0.2},
                    headers={"Idempotency-Key": f"q{i}"},
                )

        with ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(one, range(16)))
        asks = [r for i, r in enumerate(responses) if i % 4]
        assert all(r.status_code in (200, 409) for r in responses), [r.text for r in responses]
        assert all(r.json()["type"] == "/problems/session-closed" for r in asks if r.status_code == 409)
        final = world.analyst.get(f"/v1/sessions/{sid}").json()
        assert final["state"] == "closed"
        assert final["asked"] == sum(r.status_code == 200 for r in asks)
        commits = [e for e in ledger_items(world.admin, world.dataset_id) if e["event"] == "commit"]
        assert len(commits) == 1
        pure = get_budget(world.viewer, world.dataset_id)["pure"]
        assert pure["reserved"] == 0.0
        assert math.isclose(pure["spent"], final["realized"]["pure"], rel_tol=0, abs_tol=2e-12)

    def test_after_close_a_new_query_is_refused_and_a_retry_is_the_stored_answer(
        self, live_server: LiveServer
    ) -> None:
        world = make_world(live_server, {"epsilon": 10.0, "delta": 0.0})
        opened = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={
                "mechanism": "above_threshold.dropping",
                "params": {
                    "threshold": 1e9,
                    "epsilon_threshold": 1.0,
                    "max_query_epsilon": 0.5,
                    "max_queries": 10,
                },
            },
        )
        assert opened.status_code == 201, opened.text
        sid = opened.json()["id"]
        first = world.analyst.post(
            f"/v1/sessions/{sid}/queries", json={**BELOW, "epsilon": 0.5}, headers={"Idempotency-Key": "q0"}
        )
        assert first.status_code == 200, first.text
        assert world.analyst.post(f"/v1/sessions/{sid}/close").status_code == 200
        spent = get_budget(world.viewer, world.dataset_id)["pure"]["spent"]
        again = world.analyst.post(f"/v1/sessions/{sid}/queries", json={**BELOW, "epsilon": 0.5})
        assert_problem(again, 409, "/problems/session-closed")
        retry = world.analyst.post(
            f"/v1/sessions/{sid}/queries", json={**BELOW, "epsilon": 0.5}, headers={"Idempotency-Key": "q0"}
        )
        assert retry.status_code == 200
        assert retry.json()["answer"] == first.json()["answer"]
        assert world.analyst.post(f"/v1/sessions/{sid}/close").status_code == 200  # idempotent
        assert get_budget(world.viewer, world.dataset_id)["pure"]["spent"] == spent
        assert world.analyst.get(f"/v1/sessions/{sid}").json()["asked"] == 1

    def test_expiry_racing_steps_and_reapers_charges_the_transcript_once(
        self, sessions: sessionmaker[Session], tmp_path: Path
    ) -> None:
        dataset_id, (analyst,) = world_in_db(sessions, tmp_path, epsilon=10.0)
        app = app_for(sessions, tmp_path)
        row = laplace_session(sessions, analyst, dataset_id)
        answer = domain.ask(app, analyst, row.id, BELOW, "q0")[1]
        assert answer == {"above": False, "index": 0}
        with sessions() as session, session.begin():
            backdate_session_expiry(session, row.id)
        barrier = threading.Barrier(8)

        def one(i: int) -> Any:
            barrier.wait()
            try:
                if i % 2:
                    return domain.expire_sessions(sessions)
                return domain.ask(app, analyst, row.id, BELOW, f"late{i}")
            except Exception as exc:
                return exc

        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(one, range(8)))
        asked = [o for i, o in enumerate(outcomes) if i % 2 == 0]
        assert all(isinstance(o, domain.SessionClosed) for o in asked), asked
        assert sum(o for i, o in enumerate(outcomes) if i % 2) <= 1
        assert commits_of(sessions, row.request_id) == 1
        with sessions() as session:
            closed = SessionRepository(session).get(row.id)
            assert closed is not None
            assert (closed.state, closed.close_reason, len(closed.steps)) == ("closed", "expired", 1)
            assert SessionRepository(session).secret(row.request_id) is None
        # ⊥ of a Laplace AboveThreshold costs ε/2 (padded up by a few ulps), nothing is left reserved.
        spent, reserved = totals(sessions, dataset_id)
        assert reserved == 0
        assert UNITS_PER_EPSILON // 2 <= spent <= UNITS_PER_EPSILON // 2 + 1
        with sessions() as session:
            assert verify(session).problems == []


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

    def test_a_failed_session_step_does_not_write_the_secret_state_to_the_log(
        self, sessions: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        dataset_id, (analyst,) = world_in_db(sessions, tmp_path, epsilon=10.0)
        row = laplace_session(sessions, analyst, dataset_id)
        with sessions() as session:
            secret = SessionRepository(session).secret(row.request_id)
            assert secret is not None
            # grid units (docs/privacy/finite_precision.md#finite-precision)
            threshold = json.loads(secret.state)["noisy_threshold_units"]
        buffer = io.StringIO()
        configure_logging("INFO", as_json=False, stream=buffer)
        try:
            mechanism = type(INTERACTIVE["above_threshold.laplace"])
            original_step = mechanism.step

            def failing_step(self: Any, params: Any, ctx: Any, state: Any, *rest: Any) -> Any:
                original_step(self, params, ctx, state, *rest)  # reads the data with the secret in scope
                raise RuntimeError(f"step failed near {state}")

            monkeypatch.setattr(mechanism, "step", failing_step)
            with pytest.raises(MechanismFailed):
                domain.ask(app_for(sessions, tmp_path), analyst, row.id, {"query": {"kind": "count"}}, None)
        finally:
            configure_logging("INFO", as_json=False)
        logged = buffer.getvalue()
        assert "session step failed" in logged
        assert repr(threshold) not in logged, f"the secret noisy threshold {threshold!r} is in the log"


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
