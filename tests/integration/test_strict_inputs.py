"""Inputs that lax parsing would have accepted, and probes that must not reveal what exists."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import LiveServer
from tests.integration.helpers import make_world


class TestStrictParameters:
    @pytest.mark.parametrize("epsilon", ["0.1", True, [0.1], {"value": 0.1}])
    def test_epsilon_must_be_a_json_number(self, live_server: LiveServer, epsilon: object) -> None:
        world = make_world(live_server)
        response = world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": epsilon})
        assert response.status_code == 422
        assert response.json()["errors"][0]["field"] == "params.epsilon"

    def test_an_integer_epsilon_is_a_number(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        response = world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 1})
        assert response.status_code == 200, response.text
        assert response.json()["realized"]["pure"] == 1.0

    def test_an_empty_idempotency_key_is_refused(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        response = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/requests",
            json={"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 0.1}},
            headers={"Idempotency-Key": ""},
        )
        assert response.status_code == 422
        assert world.viewer.get(f"/v1/datasets/{world.dataset_id}/budget").json()["pure"]["spent"] == 0.0


class TestProbes:
    def test_viewers_cannot_tell_which_request_ids_exist(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        real = world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.1}).json()["id"]
        assert world.viewer.get(f"/v1/requests/{real}").status_code == 403
        assert world.viewer.get("/v1/requests/rq_does_not_exist").status_code == 403

    def test_racing_key_creations_with_one_name_give_one_key(self, live_server: LiveServer) -> None:
        world = make_world(live_server)

        def create(_: int) -> int:
            return world.admin.post("/v1/keys", json={"name": f"twin-{world.dataset_id}",
                                                      "role": "viewer"}).status_code

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(create, range(8)))
        assert sorted(codes) == [201] + [409] * 7
