"""Idempotency-Key (docs/privacy/rules.md#rule-no-rerolls): a retry returns the stored release and charges
once, per analyst."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.auth import Role
from service.errors import IdempotencyKeyReused
from service.runs import admission
from service.runs import sessions as domain
from service.store.engine import make_engine, make_sessionmaker
from service.store.migrate import upgrade
from service.store.models import AnalysisRequest, AnalysisSession
from service.store.repositories import SessionRepository
from tests.conftest import LiveServer, fresh_postgres_database
from tests.integration.helpers import (
    assert_problem,
    db_session,
    expect,
    get_budget,
    ledger_items,
    make_world,
    upload,
    world_in_db,
)

COUNT = {"query": {"kind": "count"}, "epsilon": 0.1}


def events_for(items: list[dict[str, object]], request_id: str) -> Counter[str]:
    return Counter(str(item["event"]) for item in items if item["request_id"] == request_id)


def request_rows(server: LiveServer, dataset_id: str) -> int:
    with db_session(server.settings.database_url) as session:
        return int(
            session.scalar(
                select(func.count())
                .select_from(AnalysisRequest)
                .where(AnalysisRequest.dataset_id == dataset_id)
            )
            or 0
        )


@pytest.fixture(scope="module")
def pg_sessions() -> Iterator[sessionmaker[Session]]:
    """A fresh migrated PostgreSQL database (a failure, never a skip, under CI=true)."""
    fresh = fresh_postgres_database()
    upgrade(fresh.url)
    engine = make_engine(fresh.url)
    yield make_sessionmaker(engine)
    engine.dispose()
    fresh.drop()


class TestReplay:
    def test_same_key_same_body_returns_the_stored_release_and_charges_once(
        self, live_server: LiveServer
    ) -> None:
        world = make_world(live_server)
        first = world.request(world.analyst, COUNT, key="retry-1")
        assert first.status_code == 200, first.text
        second = world.request(world.analyst, COUNT, key="retry-1")
        assert second.status_code == 200, second.text
        assert second.json()["id"] == first.json()["id"]
        assert second.json()["state"] == "committed"
        assert second.json()["release"]["value"] == first.json()["release"]["value"]
        assert second.json()["release"] == first.json()["release"]

        assert get_budget(world.viewer, world.dataset_id)["pure"]["spent"] == 0.1
        assert get_budget(world.admin, world.dataset_id, world.analyst_name)["pure"]["spent"] == 0.1
        items = ledger_items(world.admin, world.dataset_id)
        assert events_for(items, first.json()["id"]) == Counter({"reserve": 1, "commit": 1})
        assert sum(1 for item in items if item["event"] in ("reserve", "commit")) == 2
        assert request_rows(live_server, world.dataset_id) == 1

    def test_equivalent_spelling_of_the_same_params_is_the_same_request(
        self, live_server: LiveServer
    ) -> None:
        world = make_world(live_server)
        first = world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.1}, key="spelling")
        assert first.status_code == 200, first.text
        # keys in another order, a default spelled out, an int-valued float written as such
        again = world.request(
            world.analyst, {"epsilon": 0.10, "query": {"where": [], "kind": "count"}}, key="spelling"
        )
        assert again.status_code == 200, again.text
        assert again.json()["id"] == first.json()["id"]
        assert get_budget(world.viewer, world.dataset_id)["pure"]["spent"] == 0.1

    def test_replay_still_answers_after_the_budget_is_exhausted(self, live_server: LiveServer) -> None:
        world = make_world(live_server, {"epsilon": 0.1, "delta": 0.0})
        first = world.request(world.analyst, COUNT, key="last-one")
        assert first.status_code == 200, first.text
        assert_problem(world.request(world.analyst, COUNT), 409, "/problems/budget-exhausted")
        replay = world.request(world.analyst, COUNT, key="last-one")
        assert replay.status_code == 200, replay.text
        assert replay.json()["id"] == first.json()["id"]
        assert replay.json()["release"] == first.json()["release"]
        assert get_budget(world.viewer, world.dataset_id)["pure"]["spent"] == 0.1

    def test_concurrent_retries_with_one_key_charge_once(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        clients = [
            live_server.client(world.analyst.headers["Authorization"].removeprefix("Bearer "))
            for _ in range(6)
        ]
        try:
            with ThreadPoolExecutor(len(clients)) as pool:
                responses = list(pool.map(lambda c: world.request(c, COUNT, key="racing"), clients))
        finally:
            for client in clients:
                client.close()
        assert [r.status_code for r in responses] == [200] * len(clients), [r.text for r in responses]
        assert len({r.json()["id"] for r in responses}) == 1
        assert len({r.json()["release"]["value"] for r in responses}) == 1
        assert get_budget(world.viewer, world.dataset_id)["pure"]["spent"] == 0.1
        assert events_for(ledger_items(world.admin, world.dataset_id), responses[0].json()["id"]) == Counter(
            {"reserve": 1, "commit": 1}
        )
        assert request_rows(live_server, world.dataset_id) == 1


class TestKeyReuse:
    def test_same_key_different_body_is_refused_and_not_charged(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        first = world.request(world.analyst, COUNT, key="reuse-me")
        assert first.status_code == 200, first.text
        ledger_before = ledger_items(world.admin, world.dataset_id)
        for other, mechanism in (
            ({"query": {"kind": "count"}, "epsilon": 0.2}, "laplace"),
            ({"query": {"kind": "sum", "column": "age"}, "epsilon": 0.1}, "laplace"),
            ({"query": {"kind": "count"}, "sigma": 5.0}, "gaussian"),
        ):
            reused = world.request(world.analyst, other, mechanism=mechanism, key="reuse-me")
            problem = assert_problem(reused, 422, "/problems/idempotency-key-reused")
            assert problem["idempotency_key"] == "reuse-me"
        assert get_budget(world.viewer, world.dataset_id)["pure"]["spent"] == 0.1
        assert ledger_items(world.admin, world.dataset_id) == ledger_before
        assert request_rows(live_server, world.dataset_id) == 1

    def test_same_key_same_params_on_another_dataset_is_a_different_request(
        self, live_server: LiveServer
    ) -> None:
        world = make_world(live_server)
        other = upload(world.admin)
        assert other.status_code == 201, other.text
        other_id = other.json()["id"]
        assert (
            world.admin.post(
                f"/v1/datasets/{other_id}/grants", json={"analyst": world.analyst_name}
            ).status_code
            == 201
        )
        assert (
            world.admin.put(
                f"/v1/datasets/{other_id}/budget", json={"epsilon": 1.0, "delta": 0.0}
            ).status_code
            == 200
        )
        assert world.request(world.analyst, COUNT, key="cross-dataset").status_code == 200
        reused = world.request(world.analyst, COUNT, key="cross-dataset", dataset_id=other_id)
        assert_problem(reused, 422, "/problems/idempotency-key-reused")
        assert get_budget(world.viewer, other_id)["pure"]["spent"] == 0.0
        assert request_rows(live_server, other_id) == 0

    def test_racing_session_opens_with_one_key_on_two_datasets_give_a_422(
        self,
        pg_sessions: sessionmaker[Session],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """PostgreSQL only: SQLite serializes whole transactions (BEGIN IMMEDIATE); the race cannot occur."""
        sessions = pg_sessions
        first_id, (analyst,) = world_in_db(sessions, tmp_path, epsilon=10.0)
        second_id, _ = world_in_db(sessions, tmp_path, epsilon=10.0, names=[analyst.name])
        params = {"threshold": 150.0, "epsilon": 1.0, "max_queries": 10}
        with sessions() as session:
            first = domain.validate_open(session, analyst, first_id, "above_threshold.laplace", params)
            second = domain.validate_open(session, analyst, second_id, "above_threshold.laplace", params)
        inserted, gate = threading.Event(), threading.Event()
        original = SessionRepository.add_secret

        def add_secret_slowly(self: SessionRepository, secret: Any) -> None:
            if threading.current_thread().name == "first":  # its request row is flushed, not committed
                inserted.set()
                gate.wait(20)
            original(self, secret)

        monkeypatch.setattr(SessionRepository, "add_secret", add_secret_slowly)
        outcomes: dict[str, Any] = {}

        def run(name: str, validated: admission.Validated) -> None:
            try:
                outcomes[name] = domain.open_session(sessions, analyst, validated, "one-key", 3600.0)
            except Exception as exc:
                outcomes[name] = exc

        threads = [
            threading.Thread(target=run, args=(n, v), name=n)
            for n, v in (("first", first), ("second", second))
        ]
        threads[0].start()
        assert inserted.wait(20)
        threads[1].start()
        time.sleep(2.0)  # the second now waits on the unique index entry of the first's request row
        gate.set()
        for thread in threads:
            thread.join(30)
        assert isinstance(outcomes["first"], AnalysisSession), outcomes
        expect(isinstance(outcomes["second"], IdempotencyKeyReused), f"the loser got {outcomes['second']!r}")


class TestKeysArePerAnalyst:
    def test_two_analysts_may_use_the_same_key_independently(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        other_name, other = world.new_key(Role.analyst)
        assert (
            world.admin.post(
                f"/v1/datasets/{world.dataset_id}/grants", json={"analyst": other_name}
            ).status_code
            == 201
        )
        mine = world.request(world.analyst, COUNT, key="shared-key")
        theirs = world.request(other, {"query": {"kind": "count"}, "epsilon": 0.2}, key="shared-key")
        assert mine.status_code == 200, mine.text
        assert theirs.status_code == 200, theirs.text  # a different body is fine: another analyst's key
        assert mine.json()["id"] != theirs.json()["id"]
        assert (mine.json()["analyst"], theirs.json()["analyst"]) == (world.analyst_name, other_name)
        same_body = world.request(other, COUNT, key="shared-key-2")
        mine_again = world.request(world.analyst, COUNT, key="shared-key-2")
        assert same_body.status_code == mine_again.status_code == 200
        assert same_body.json()["id"] != mine_again.json()["id"]

        # each analyst's replay returns that analyst's own request
        assert (
            world.request(other, {"query": {"kind": "count"}, "epsilon": 0.2}, key="shared-key").json()["id"]
            == theirs.json()["id"]
        )
        assert world.request(world.analyst, COUNT, key="shared-key").json()["id"] == mine.json()["id"]
        budget = get_budget(world.viewer, world.dataset_id)
        assert budget["pure"]["spent"] == 0.5  # 0.1 + 0.2 + 0.1 + 0.1, each charged once, exactly
        assert get_budget(world.admin, world.dataset_id, world.analyst_name)["pure"]["spent"] == 0.2
        assert get_budget(world.admin, world.dataset_id, other_name)["pure"]["spent"] == 0.3
        assert request_rows(live_server, world.dataset_id) == 4

    def test_a_key_reused_by_another_analyst_is_their_own_request(self, live_server: LiveServer) -> None:
        """Idempotency keys are per analyst: another analyst's key never replays (or 422s on) a release."""
        world = make_world(live_server, {"epsilon": 10.0, "delta": 0.0})
        other_name, other = world.new_key(Role.analyst)
        assert (
            world.admin.post(
                f"/v1/datasets/{world.dataset_id}/grants", json={"analyst": other_name}
            ).status_code
            == 201
        )
        mine = world.request(world.analyst, COUNT, key="shared-key")
        same = world.request(other, COUNT, key="shared-key")  # same key, same body
        different = world.request(other, {**COUNT, "epsilon": 0.2}, key="other-key")
        reused = world.request(other, {**COUNT, "epsilon": 0.3}, key="shared-key")  # other's own key reused
        assert mine.status_code == same.status_code == different.status_code == 200
        assert mine.json()["id"] != same.json()["id"]
        assert same.json()["analyst"] == other_name
        # not a replay of mine: a request of its own, charged again (two independent noisy counts at scale 10
        # are equal with probability ≈ 2.5 %, so the releases themselves are not compared)
        assert same.json()["realized"]["pure"] == 0.1
        assert_problem(reused, 422, "/problems/idempotency-key-reused")
        assert world.analyst.get(f"/v1/requests/{same.json()['id']}").status_code == 404
        assert other.get(f"/v1/requests/{mine.json()['id']}").status_code == 404
        assert world.request(world.analyst, COUNT, key="shared-key").json()["id"] == mine.json()["id"]
        assert math.isclose(get_budget(world.viewer, world.dataset_id)["pure"]["spent"], 0.4)
