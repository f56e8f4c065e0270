"""Budget exhaustion with exact counts, over real HTTP, on SQLite and PostgreSQL."""

from __future__ import annotations

from mechanisms.accounting import UNITS_PER_EPSILON
from service.store.engine import make_engine, make_sessionmaker
from service.store.models import DATASET_SCOPE
from service.store.repositories import FilterRepository
from tests.conftest import LiveServer
from tests.integration.helpers import make_world

COUNT = {"query": {"kind": "count"}, "epsilon": 0.1}


def spent_units(server: LiveServer, dataset_id: str) -> dict[str, list[int]]:
    engine = make_engine(server.settings.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            flt = FilterRepository(session).get(dataset_id, DATASET_SCOPE)
            assert flt is not None
            return flt.spent
    finally:
        engine.dispose()


class TestPureBudgetExhaustion:
    def test_ten_tenths_fit_and_the_eleventh_is_refused(self, live_server: LiveServer) -> None:
        world = make_world(live_server, {"epsilon": 1.0, "delta": 0.0})
        for i in range(10):
            response = world.request(world.analyst, COUNT)
            assert response.status_code == 200, (i, response.text)
            assert response.json()["realized"]["pure"] == 0.1
        refused = world.request(world.analyst, COUNT)
        assert refused.status_code == 409
        assert refused.headers["content-type"].startswith("application/problem+json")
        problem = refused.json()
        assert problem["type"] == "/problems/budget-exhausted"
        assert problem["pure"]["spent"] == 1.0
        assert problem["pure"]["capacity"] == 1.0
        assert problem["binding_alpha"] == "pure"
        assert problem["binding"] == "epsilon"
        assert "ε binds at order pure (short by 0.1)" in problem["detail"]
        assert problem["affordable"] is None  # nothing is left: no ε > 0 fits
        spent = spent_units(live_server, world.dataset_id)
        assert spent["finite"][-1] == 1 * UNITS_PER_EPSILON
        assert spent["infinite"][-1] == 0

    def test_refusal_names_the_largest_affordable_epsilon(self, live_server: LiveServer) -> None:
        world = make_world(live_server, {"epsilon": 1.0, "delta": 0.0})
        assert world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.75}).status_code == 200
        refused = world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.5})
        assert refused.status_code == 409
        affordable = refused.json()["affordable"]
        assert affordable["parameter"] == "epsilon"
        assert 0.249 < affordable["value"] <= 0.25
        assert (
            world.request(
                world.analyst, {"query": {"kind": "count"}, "epsilon": affordable["value"]}
            ).status_code
            == 200
        )

    def test_budget_view_and_etag(self, live_server: LiveServer) -> None:
        world = make_world(live_server, {"epsilon": 1.0, "delta": 1e-6})
        first = world.viewer.get(f"/v1/datasets/{world.dataset_id}/budget")
        assert first.status_code == 200
        etag = first.headers["etag"]
        again = world.viewer.get(f"/v1/datasets/{world.dataset_id}/budget", headers={"If-None-Match": etag})
        assert again.status_code == 304
        assert world.request(world.analyst, COUNT).status_code == 200
        changed = world.viewer.get(f"/v1/datasets/{world.dataset_id}/budget", headers={"If-None-Match": etag})
        assert changed.status_code == 200
        assert changed.json()["pure"]["spent"] == 0.1
        assert changed.json()["epsilon_remaining"] < first.json()["epsilon_remaining"]
