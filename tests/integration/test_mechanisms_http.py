"""The mechanism catalog and the noise-adding mechanisms over HTTP; stored releases; ledger pagination."""

from __future__ import annotations

import json
import math
import secrets
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from service.filter.ledger import GENESIS, canonical_json, chain_hash
from tests.conftest import LiveServer
from tests.integration.helpers import BIG, add_dataset, assert_problem, get_budget, ledger_items, make_world

RDP_BUDGET = {"epsilon": 10.0, "delta": 1e-5}


class TestCatalog:
    def test_lists_laplace_and_gaussian_with_json_schemas(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        response = world.viewer.get("/v1/mechanisms")
        assert response.status_code == 200, response.text
        catalog = {m["name"]: m for m in response.json()}
        assert {"laplace", "gaussian"} <= set(catalog)
        for name, cost in (("laplace", "epsilon"), ("gaussian", "sigma")):
            entry = catalog[name]
            assert entry["cost_parameter"] == cost
            assert entry["summary"]
            schema = entry["params_schema"]
            assert schema["type"] == "object"
            assert set(schema["required"]) == {"query", cost}
            assert set(schema["properties"]) == {"query", cost, "confidence"}
            assert schema["additionalProperties"] is False
            assert schema["properties"][cost]["type"] == "number"
            assert schema["properties"][cost]["exclusiveMinimum"] == 0
            kinds = json.dumps(schema)
            for kind in ("count", "sum", "mean", "histogram"):
                assert f'"const": "{kind}"' in kinds or f'"{kind}"' in kinds


class TestGaussian:
    def test_refused_on_a_pure_budget(self, live_server: LiveServer) -> None:
        world = make_world(live_server, {"epsilon": 1000.0, "delta": 0.0})
        before = ledger_items(world.admin, world.dataset_id)
        refused = world.request(
            world.analyst, {"query": {"kind": "count"}, "sigma": 1000.0}, mechanism="gaussian"
        )
        problem = assert_problem(refused, 409, "/problems/not-admissible")  # σ cannot help
        assert problem["requested"]["pure"] == "inf"  # no pure bound, whatever σ
        assert problem["pure"]["requested"] == "inf"
        assert problem["affordable"] is None
        assert all(row["capacity"] is None for row in problem["orders"])  # δ = 0: no usable order
        assert ledger_items(world.admin, world.dataset_id) == before
        assert get_budget(world.viewer, world.dataset_id)["pure"]["reserved"] == 0.0
        assert world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.1}).status_code == 200

    @pytest.mark.parametrize("sigma", [2.0, 7.5])
    def test_realized_curve_is_alpha_over_two_sigma_squared(
        self, live_server: LiveServer, sigma: float
    ) -> None:
        world = make_world(live_server, RDP_BUDGET)
        response = world.request(
            world.analyst, {"query": {"kind": "count"}, "sigma": sigma}, mechanism="gaussian"
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["state"] == "committed"
        realized = body["realized"]
        assert realized["pure"] == "inf"
        assert realized == body["worst_case"]
        by_order = dict(zip(realized["orders"], realized["values"], strict=True))
        for alpha in (1.25, 2.0, 8.0, 32.0, 256.0):
            expected = alpha * 1.0**2 / (2 * sigma**2)  # count: Δ₂ = 1
            assert by_order[alpha] >= expected  # rounding may only over-charge
            assert by_order[alpha] == pytest.approx(expected, rel=1e-12)
        noise = body["release"]["noise"]
        assert (noise["distribution"], noise["sigma"]) == ("discrete_gaussian", sigma)
        assert noise["granularity"] == 1.0
        assert float(body["release"]["value"]).is_integer()  # a count on the unit grid
        budget = get_budget(world.viewer, world.dataset_id)
        for row in budget["orders"]:
            assert row["spent"] == pytest.approx(by_order[row["alpha"]], abs=1.5e-12)
            assert row["spent"] >= by_order[row["alpha"]] - 1e-15
        assert budget["pure"]["spent"] == "inf"


class TestReleases:
    def test_histogram_has_one_value_per_category(self, live_server: LiveServer) -> None:
        world = make_world(live_server, RDP_BUDGET)
        for mechanism, params in (("laplace", {"epsilon": 1.0}), ("gaussian", {"sigma": 3.0})):
            query = {"kind": "histogram", "column": "region"}
            response = world.request(world.analyst, {"query": query, **params}, mechanism=mechanism)
            assert response.status_code == 200, response.text
            values = response.json()["release"]["values"]
            assert list(values) == ["north", "south", "east", "west"]
            assert all(isinstance(v, float) for v in values.values())
            assert "value" not in response.json()["release"]

    def test_a_stored_release_is_returned_unchanged(self, live_server: LiveServer) -> None:
        world = make_world(live_server, RDP_BUDGET)
        posted = world.request(world.analyst, {"query": {"kind": "sum", "column": "income"}, "epsilon": 0.5})
        assert posted.status_code == 200, posted.text
        rid = posted.json()["id"]
        stamps = ("created_at", "updated_at")
        for client in (world.analyst, world.admin):
            stored = client.get(f"/v1/requests/{rid}")
            assert stored.status_code == 200, stored.text
            assert {k: v for k, v in stored.json().items() if k not in stamps} == {
                k: v for k, v in posted.json().items() if k not in stamps
            }
            for stamp in stamps:  # the same instant (the offset spelling is checked below)
                assert _instant(stored.json()[stamp]) == _instant(posted.json()[stamp])
        assert stored.json()["release"]["value"] == posted.json()["release"]["value"]
        assert stored.json()["release"]["noise"]["distribution"] == "discrete_laplace"
        assert stored.json()["params"]["query"] == {"kind": "sum", "column": "income", "where": []}

    def test_timestamps_carry_a_utc_offset(self, live_server: LiveServer) -> None:
        world = make_world(live_server, RDP_BUDGET)
        posted = world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.5})
        assert posted.status_code == 200, posted.text
        stored = world.analyst.get(f"/v1/requests/{posted.json()['id']}").json()
        dataset = world.analyst.get(f"/v1/datasets/{world.dataset_id}").json()
        for stamp in (
            posted.json()["created_at"],
            stored["created_at"],
            stored["updated_at"],
            dataset["created_at"],
        ):
            assert datetime.fromisoformat(stamp).utcoffset() == timedelta(0), stamp


def _instant(stamp: str) -> datetime:
    """A timestamp as an aware UTC datetime (a naive one is read as UTC)."""
    parsed = datetime.fromisoformat(stamp)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


class TestLedgerPagination:
    def test_pages_walk_every_entry_in_order_on_one_hash_chain(self, live_server: LiveServer) -> None:
        world = make_world(live_server, RDP_BUDGET)
        for i in range(4):
            assert (
                world.request(
                    world.analyst, {"query": {"kind": "count"}, "epsilon": 0.1 + i / 100}
                ).status_code
                == 200
            )
        assert world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 50.0}).status_code == 409
        full = world.admin.get(f"/v1/datasets/{world.dataset_id}/ledger", params={"limit": 1000}).json()
        assert full["next_after"] is None
        everything: list[dict[str, Any]] = full["items"]
        assert len(everything) == 3 + 2 * 4  # dataset, grant, budget, then reserve + commit per request

        for limit in (1, 2, 3, len(everything)):
            walked: list[dict[str, Any]] = []
            after, pages = 0, 0
            while True:
                page = world.admin.get(
                    f"/v1/datasets/{world.dataset_id}/ledger", params={"after": after, "limit": limit}
                )
                assert page.status_code == 200, page.text
                body = page.json()
                pages += 1
                assert len(body["items"]) <= limit
                walked += body["items"]
                if body["next_after"] is None:
                    break
                assert body["next_after"] == body["items"][-1]["seq"]
                after = body["next_after"]
            assert walked == everything, limit
            assert pages in (len(everything) // limit, len(everything) // limit + 1)

        assert [e["seq"] for e in everything] == list(range(1, len(everything) + 1))
        assert [e["event"] for e in everything[:3]] == ["dataset", "grant", "budget"]
        previous = GENESIS
        for entry in everything:
            assert entry["prev_hash"] == previous
            body = {k: v for k, v in entry.items() if k not in ("hash", "prev_hash")}
            assert entry["hash"] == chain_hash(previous, canonical_json(body))
            previous = entry["hash"]
        assert ledger_items(world.admin, world.dataset_id, page=4) == everything
        beyond = world.admin.get(
            f"/v1/datasets/{world.dataset_id}/ledger", params={"after": everything[-1]["seq"]}
        ).json()
        assert beyond == {"items": [], "next_after": None}


class TestSumSensitivity:
    """A sum's noise scale is its sensitivity under the dataset's neighbour relation
    (docs/privacy/queries.md#query-charges)."""

    @pytest.mark.parametrize(
        ("neighboring", "where", "scale"),
        [
            ("replace_one", False, 10.0),  # max − min
            ("replace_one", True, 20.0),  # max(max, 0) − min(min, 0): the row may leave the selection
            ("add_remove", False, 20.0),  # max(|min|, |max|)
            ("add_remove", True, 20.0),
        ],
    )
    def test_sum_noise_is_calibrated_to_the_neighbour_relation_and_where(
        self, live_server: LiveServer, neighboring: str, where: bool, scale: float
    ) -> None:
        world = make_world(live_server, BIG)
        schema = {
            "columns": [{"name": "x", "type": "float", "min": 10, "max": 20}],
            "neighboring": neighboring,
        }
        csv = b"x\n" + b"".join(f"{10 + secrets.randbelow(11)}\n".encode() for _ in range(20))
        dataset_id = add_dataset(world, csv, schema, BIG)
        query: dict[str, Any] = {"kind": "sum", "column": "x"}
        if where:
            query["where"] = [{"column": "x", "op": "ge", "value": 15}]
        released = world.request(world.analyst, {"query": query, "epsilon": 1.0}, dataset_id=dataset_id)
        assert released.status_code == 200, released.text
        release = released.json()["release"]
        # the grid (γ ≤ 2⁻¹⁰·Δ) adds ≤ one unit (and float slack) to the sensitivity:
        # docs/privacy/finite_precision.md#finite-precision
        assert scale <= release["noise"]["scale"] <= scale * (1 + 2**-9)
        assert math.fmod(release["value"], release["noise"]["granularity"]) == 0.0
        assert released.json()["realized"]["pure"] == 1.0
