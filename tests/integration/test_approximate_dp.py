"""(ε, δ) mechanisms through the filter's δ-ledger (docs/privacy/approximate.md#approximate-dp), over real
HTTP on SQLite and PostgreSQL: the δ share, admission and refusal on δ, the ledger, concurrency, and `ledger
verify`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import Any

import httpx
import pytest

from expost_client import BudgetExhaustedError
from mechanisms.accounting.approximate import DELTA_UNITS, delta_units_down, delta_units_up
from service.filter.ledger import verify
from service.store.engine import make_engine, make_sessionmaker
from service.store.models import DATASET_SCOPE
from service.store.repositories import FilterRepository
from tests.conftest import LiveServer
from tests.integration.helpers import assert_problem, get_budget, ledger_items, make_world

OPS = {"features": {"features": ["age"], "label": "income"}, "lam": 50.0, "epsilon": 1.0, "delta": 1e-7}
BUDGET = {"epsilon": 100.0, "delta": 1e-5, "delta_share": 3.5e-7}  # 3 × δ_k fit (δ_k rounds up)


def ops(delta: float = 1e-7, epsilon: float = 1.0) -> dict[str, Any]:
    return {**OPS, "delta": delta, "epsilon": epsilon}


def stored_filter(server: LiveServer, dataset_id: str) -> dict[str, Any]:
    engine = make_engine(server.settings.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            flt = FilterRepository(session).get(dataset_id, DATASET_SCOPE)
            assert flt is not None
            return {"spent": flt.delta_spent, "reserved": flt.delta_reserved, "capacity": flt.delta_capacity}
    finally:
        engine.dispose()


def ledger_ok(server: LiveServer) -> None:
    engine = make_engine(server.settings.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            report = verify(session)
        assert report.ok, report.problems
    finally:
        engine.dispose()


class TestDeltaShare:
    def test_an_approximate_request_needs_a_share(self, live_server: LiveServer) -> None:
        world = make_world(live_server, {"epsilon": 100.0, "delta": 1e-5})
        body = assert_problem(
            world.request(world.analyst, ops(), "ptr.ops_linear"), 409, "/problems/not-admissible"
        )
        assert "delta_share" in body["detail"]
        assert body["delta"]["requested"] == float(Fraction(delta_units_up(1e-7), DELTA_UNITS))
        assert body["delta"]["delta_share"] is None

    def test_the_share_is_validated_and_only_grows(self, live_server: LiveServer) -> None:
        world = make_world(live_server, None)
        path = f"/v1/datasets/{world.dataset_id}/budget"
        assert_problem(world.admin.put(path, json={"epsilon": 1.0, "delta": 1e-6, "delta_share": 1e-6}), 422)
        assert_problem(world.admin.put(path, json={"epsilon": 1.0, "delta": 0.0, "delta_share": 1e-9}), 422)
        assert (
            world.admin.put(path, json={"epsilon": 1.0, "delta": 1e-6, "delta_share": 4e-7}).status_code
            == 200
        )
        shrunk = assert_problem(
            world.admin.put(path, json={"epsilon": 1.0, "delta": 1e-6, "delta_share": 3e-7}), 422
        )
        assert shrunk["errors"][0]["field"] == "delta_share"
        rest_shrunk = world.admin.put(path, json={"epsilon": 1.0, "delta": 1e-6, "delta_share": 5e-7})
        assert_problem(rest_shrunk, 422)
        grown = world.admin.put(path, json={"epsilon": 2.0, "delta": 2e-6, "delta_share": 5e-7})
        assert grown.status_code == 200, grown.text
        view = grown.json()
        assert view["delta_share"] == float(Fraction(5 * 10**23, DELTA_UNITS))
        assert view["delta_spent"] == 0.0
        assert view["delta_remaining"] == view["delta_share"]

    def test_lowering_first_does_not_open_a_larger_share(self, live_server: LiveServer) -> None:
        """The largest δ_R ever used counts: (1e-5) → (1e-9) → (1e-5 with share 9.99e-6) would make the
        guarantee sup δ_R + sup δ_A ≈ 2e-5 while every δ shown is ≤ 1e-5; it is refused."""
        world = make_world(live_server, {"epsilon": 10.0, "delta": 1e-5})
        path = f"/v1/datasets/{world.dataset_id}/budget"
        assert world.admin.put(path, json={"epsilon": 10.0, "delta": 1e-9}).status_code == 200
        sneaky = world.admin.put(path, json={"epsilon": 10.0, "delta": 1e-5, "delta_share": 9.99e-6})
        assert assert_problem(sneaky, 422)["errors"][0]["field"] == "delta_share"
        raised = world.admin.put(path, json={"epsilon": 10.0, "delta": 2e-5, "delta_share": 9.99e-6})
        assert raised.status_code == 200, raised.text  # δ raised by the share: δ_R stays ≥ 1e-5
        removed = world.admin.put(path, json={"epsilon": 10.0, "delta": 2e-5})
        assert assert_problem(removed, 422)["errors"][0]["field"] == "delta_share"

    def test_the_rdp_slots_use_the_remainder(self, live_server: LiveServer) -> None:
        plain = make_world(live_server, {"epsilon": 1.0, "delta": 1e-6})
        shared = make_world(live_server, {"epsilon": 1.0, "delta": 1e-6, "delta_share": 5e-7})
        a, b = get_budget(plain.admin, plain.dataset_id), get_budget(shared.admin, shared.dataset_id)
        for row_a, row_b in zip(a["orders"], b["orders"], strict=True):
            if row_a["capacity"] is not None and row_b["capacity"] is not None:
                assert row_b["capacity"] < row_a["capacity"]  # log(|A|/δ_R) > log(|A|/δ)
        assert a["pure"]["capacity"] == b["pure"]["capacity"] == 1.0


class TestAdmission:
    def test_delta_is_reserved_spent_and_refused_when_the_share_is_used(
        self, live_server: LiveServer
    ) -> None:
        world = make_world(live_server, BUDGET)
        unit = delta_units_up(1e-7)
        for i in range(3):
            response = world.request(world.analyst, ops(), "ptr.ops_linear")
            assert response.status_code == 200, (i, response.text)
            assert stored_filter(live_server, world.dataset_id)["spent"] == str((i + 1) * unit)
        refused = assert_problem(
            world.request(world.analyst, ops(), "ptr.ops_linear"), 409, "/problems/budget-exhausted"
        )
        assert refused["delta"]["delta_spent"] == float(Fraction(3 * unit, DELTA_UNITS))
        assert refused["delta"]["delta_remaining"] == float(
            Fraction(delta_units_down(3.5e-7) - 3 * unit, DELTA_UNITS)
        )
        # issue 35 item 5: the refusal says δ binds, not a misleading order with a negative shortfall
        assert refused["binding"] == "delta"
        assert refused["binding_alpha"] is None
        assert refused["shortfall"] is None
        assert refused["delta"]["shortfall"] > 0
        assert "δ share cannot afford" in refused["detail"]
        assert "its ε fits" in refused["detail"]
        summary = BudgetExhaustedError(
            409, refused["type"], refused["title"], refused["detail"], refused
        ).summary()
        assert "δ binds" in summary
        assert "binding order" not in summary  # no unrelated order row (issue 35 item 5)
        # a request without δ is unaffected by the spent share
        assert world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.1}).status_code == 200
        budget = get_budget(world.admin, world.dataset_id)
        assert budget["delta_spent"] == float(Fraction(3 * unit, DELTA_UNITS))
        reserves = [
            e for e in ledger_items(world.admin, world.dataset_id) if e["event"] in ("reserve", "commit")
        ]
        assert sum(1 for e in reserves if e.get("delta") == unit) == 6
        ledger_ok(live_server)

    def test_the_charge_is_the_declared_epsilon(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        response = world.request(world.analyst, ops(epsilon=0.5), "ptr.ops_linear")
        assert response.status_code == 200, response.text
        charged = response.json()["realized"]["pure"]
        assert 0.5 <= charged <= 0.5 * (1 + 1e-12)  # the declared ε, its parts' sum rounded up
        dry = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/requests:estimate",
            json={"mechanism": "ptr.ops_linear", "params": ops()},
        )
        assert dry.status_code == 200, dry.text

    def test_a_sub_budget_limits_the_analysts_delta(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BUDGET)
        path = f"/v1/datasets/{world.dataset_id}/analysts/{world.analyst_name}/budget"
        set_sub = world.admin.put(
            path, json={"epsilon": 50.0, "delta": 5e-6, "delta_share": 1.5e-7}
        )  # one δ_k
        assert set_sub.status_code == 200, set_sub.text
        assert world.request(world.analyst, ops(), "ptr.ops_linear").status_code == 200
        refused = assert_problem(world.request(world.analyst, ops(), "ptr.ops_linear"), 409)
        assert refused["filter"] == f"analyst:{world.analyst_name}"
        ledger_ok(live_server)


def admitted_one_by_one(server: LiveServer, budget: dict[str, float]) -> int:
    """How many approximate requests a budget admits when they come one at a time."""
    world = make_world(server, budget)
    for admitted in range(100):
        if world.request(world.analyst, ops(), "ptr.ops_linear").status_code != 200:
            return admitted
    raise AssertionError("the budget admitted 100 requests")


@pytest.mark.parametrize(
    "budget",
    [
        {"epsilon": 1000.0, "delta": 1e-5, "delta_share": 7.5e-7},  # δ binds: 7 × δ_k fit
        {"epsilon": 3.5, "delta": 1e-5, "delta_share": 5e-6},  # ε binds: 3 × ε = 1 fit
    ],
    ids=["delta-binds", "epsilon-binds"],
)
def test_parallel_requests_never_overspend(live_server: LiveServer, budget: dict[str, float]) -> None:
    """100 concurrent approximate requests admit exactly as many as one-by-one submission does, and the
    stored totals stay within capacity (ε slots and δ-ledger)."""
    expected = admitted_one_by_one(live_server, budget)
    assert expected == (7 if budget["epsilon"] > 100 else 3)
    world = make_world(live_server, budget)
    key = world.analyst.headers["Authorization"]

    def submit(_: int) -> int:
        with httpx.Client(
            base_url=str(world.analyst.base_url), headers={"Authorization": key}, timeout=120
        ) as c:
            return world.request(c, ops(), "ptr.ops_linear").status_code

    with ThreadPoolExecutor(max_workers=16) as pool:
        codes = list(pool.map(submit, range(100)))
    assert codes.count(200) + codes.count(202) == expected, codes
    assert codes.count(409) == 100 - expected, codes
    stored = stored_filter(live_server, world.dataset_id)
    assert int(stored["spent"]) + int(stored["reserved"]) == expected * delta_units_up(1e-7)
    assert int(stored["spent"]) + int(stored["reserved"]) <= int(stored["capacity"])
    view = get_budget(world.admin, world.dataset_id)
    assert view["pure"]["spent"] + view["pure"]["reserved"] <= budget["epsilon"]
    ledger_ok(live_server)


class TestPtrMechanismsOverHttp:
    def test_classic_releases_the_median_and_select_picks_a_proposal(self, live_server: LiveServer) -> None:
        world = make_world(live_server, {"epsilon": 20.0, "delta": 1e-5, "delta_share": 5e-6})
        classic = {"column": "age", "beta": 10.0, "epsilon": 2.0, "delta": 1e-6}
        response = world.request(world.analyst, classic, "ptr.classic")
        assert response.status_code == 200, response.text
        body = response.json()
        released = body["release"]
        # 200 rows of ages 20..79: at β = 10 the distance to instability is 27, the pass threshold 14, so
        # ⊥ has probability ≤ e^-13; the noise is Laplace with scale β/(ε/2) = 10 (|Z| > 150: e^-15)
        assert released["released"] is True
        assert abs(released["median"] - 49) <= 150
        assert "distance" not in json_text(released)
        assert 2.0 <= body["realized"]["pure"] <= 2.0 * (1 + 1e-12)
        select = {"column": "age", "betas": [0.5, 5.0, 20.0], "epsilon": 2.0, "delta": 1e-6}
        chosen = world.request(world.analyst, select, "ptr.select")
        assert chosen.status_code == 200, chosen.text
        assert get_budget(world.admin, world.dataset_id)["delta_spent"] >= 2e-6
        catalog = {m["name"]: m for m in world.analyst.get("/v1/mechanisms").json()}
        assert all(catalog[name]["approximate"] for name in ("ptr.classic", "ptr.select", "ptr.ops_linear"))
        assert not catalog["laplace"]["approximate"]
        ledger_ok(live_server)


def json_text(value: Any) -> str:
    import json

    return json.dumps(value)
