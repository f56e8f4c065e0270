"""Idempotency-Key (DESIGN §4 rule 4): a retry returns the stored release and charges once, per analyst."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import func, select

from service.auth import Role
from service.store.models import AnalysisRequest
from tests.conftest import LiveServer
from tests.integration.helpers import (
    assert_problem,
    db_session,
    get_budget,
    ledger_items,
    make_world,
    upload,
)

COUNT = {"query": {"kind": "count"}, "epsilon": 0.1}


def events_for(items: list[dict[str, object]], request_id: str) -> Counter[str]:
    return Counter(str(item["event"]) for item in items if item["request_id"] == request_id)


def request_rows(server: LiveServer, dataset_id: str) -> int:
    with db_session(server.settings.database_url) as session:
        return int(session.scalar(
            select(func.count()).select_from(AnalysisRequest).where(AnalysisRequest.dataset_id == dataset_id)
        ) or 0)


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
        again = world.request(world.analyst, {"epsilon": 0.10, "query": {"where": [], "kind": "count"}},
                              key="spelling")
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
        clients = [live_server.client(world.analyst.headers["Authorization"].removeprefix("Bearer "))
                   for _ in range(6)]
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
            {"reserve": 1, "commit": 1})
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
        assert world.admin.post(f"/v1/datasets/{other_id}/grants",
                                json={"analyst": world.analyst_name}).status_code == 201
        assert world.admin.put(f"/v1/datasets/{other_id}/budget",
                               json={"epsilon": 1.0, "delta": 0.0}).status_code == 200
        assert world.request(world.analyst, COUNT, key="cross-dataset").status_code == 200
        reused = world.request(world.analyst, COUNT, key="cross-dataset", dataset_id=other_id)
        assert_problem(reused, 422, "/problems/idempotency-key-reused")
        assert get_budget(world.viewer, other_id)["pure"]["spent"] == 0.0
        assert request_rows(live_server, other_id) == 0


class TestKeysArePerAnalyst:
    def test_two_analysts_may_use_the_same_key_independently(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        other_name, other = world.new_key(Role.analyst)
        assert world.admin.post(f"/v1/datasets/{world.dataset_id}/grants",
                                json={"analyst": other_name}).status_code == 201
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
        assert world.request(other, {"query": {"kind": "count"}, "epsilon": 0.2},
                             key="shared-key").json()["id"] == theirs.json()["id"]
        assert world.request(world.analyst, COUNT, key="shared-key").json()["id"] == mine.json()["id"]
        budget = get_budget(world.viewer, world.dataset_id)
        assert budget["pure"]["spent"] == 0.5  # 0.1 + 0.2 + 0.1 + 0.1, each charged once, exactly
        assert get_budget(world.admin, world.dataset_id, world.analyst_name)["pure"]["spent"] == 0.2
        assert get_budget(world.admin, world.dataset_id, other_name)["pure"]["spent"] == 0.3
        assert request_rows(live_server, world.dataset_id) == 4
