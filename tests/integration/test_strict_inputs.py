"""Inputs that lax parsing would have accepted, and probes that must not reveal what exists."""

from __future__ import annotations

import json
import math
import secrets
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import LiveServer
from tests.integration.helpers import BIG, expect, get_budget, make_world

# A where value that pydantic accepts (StrictInt is unbounded) but that a float64 column cannot compare with.
BEYOND_FLOAT = 10**400
OVERFLOWING_WHERE = {"kind": "count", "where": [{"column": "age", "op": "lt", "value": BEYOND_FLOAT}]}


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
            return world.admin.post(
                "/v1/keys", json={"name": f"twin-{world.dataset_id}", "role": "viewer"}
            ).status_code

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(create, range(8)))
        assert sorted(codes) == [201] + [409] * 7


class TestNumericExtremes:
    """Numbers at the edge of the float range: a 422 (nothing charged) or a finite release, never a 500."""

    def test_bounds_that_could_overflow_a_sum_are_refused_at_upload(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BIG)
        schema = {
            "columns": [{"name": "x", "type": "float", "min": 0, "max": 1e308}],
            "neighboring": "add_remove",
        }
        csv = b"x\n1e308\n1e308\n0\n" + f"{secrets.randbelow(10**9)}\n".encode()
        response = world.admin.post(
            "/v1/datasets", files={"file": ("x.csv", csv, "text/csv")}, data={"schema": json.dumps(schema)}
        )
        assert response.status_code == 422
        assert response.json()["errors"][0]["field"].startswith("schema.columns.0")

    def test_an_overflowing_laplace_scale_is_refused_up_front(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BIG)
        response = world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 1e-320})
        if response.status_code == 422:
            return
        expect(response.status_code == 200, f"{response.status_code}: {response.text[:300]}")
        release = response.json()["release"]
        numbers = (release["value"], release["noise"]["scale"])
        finite = [isinstance(v, float) and math.isfinite(v) for v in numbers]
        expect(all(finite), f"release {release!r}")

    def test_a_where_value_beyond_the_float_range_is_a_422_and_not_charged(
        self, live_server: LiveServer
    ) -> None:
        world = make_world(live_server, BIG)
        response = world.request(world.analyst, {"query": OVERFLOWING_WHERE, "epsilon": 1.0})
        pure = get_budget(world.viewer, world.dataset_id)["pure"]
        outcome = (response.status_code, pure["spent"], pure["reserved"])
        expect(outcome == (422, 0.0, 0.0), f"(status, spent, reserved) = {outcome}: {response.text[:200]}")

    def test_a_subnormal_delta_is_not_a_server_error(self, live_server: LiveServer) -> None:
        world = make_world(live_server, None)
        response = world.admin.put(
            f"/v1/datasets/{world.dataset_id}/budget", json={"epsilon": 1.0, "delta": 1e-310}
        )
        expect(response.status_code in (200, 422), f"{response.status_code}: {response.text[:200]}")
