"""Both execution paths: inline (reserve, run, commit in one transaction) and reserve → worker → commit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from mechanisms.base import PublicContext, Release, Table
from mechanisms.catalog import MECHANISMS
from mechanisms.noise import Noise
from mechanisms.queries.laplace import Laplace
from service.filter.ledger import verify
from service.store.engine import make_engine, make_sessionmaker
from tests.conftest import LiveServer, running_server, server_settings
from tests.integration.helpers import make_world

COUNT = {"query": {"kind": "count"}, "epsilon": 0.25}
LEAK_MARKER = "rows-seen-"


class ExplodingLaplace(Laplace):
    """Reads the data, then fails: the service must charge the worst case."""

    name = "exploding_laplace"

    def run(self, params: BaseModel, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        rows = len(next(iter(table.values())))  # the data was read
        raise RuntimeError(f"boom after reading the data: {LEAK_MARKER}{rows * 7919}")


class OverclaimingLaplace(Laplace):
    """Breaks the seam's contract: reports a realized loss above its worst case."""

    name = "overclaiming_laplace"

    def run(self, params: BaseModel, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        honest = super().run(params, ctx, table, noise)
        return Release(honest.output, honest.realized + honest.realized)


@pytest.fixture
def exploding_mechanism() -> Iterator[None]:
    MECHANISMS["exploding_laplace"] = ExplodingLaplace()
    MECHANISMS["overclaiming_laplace"] = OverclaimingLaplace()
    yield
    del MECHANISMS["exploding_laplace"], MECHANISMS["overclaiming_laplace"]


@pytest.fixture(params=["inline", "worker"])
def server(request: pytest.FixtureRequest, database_url: str, tmp_path: Any) -> Iterator[LiveServer]:
    inline = {"laplace", "exploding_laplace", "overclaiming_laplace"} if request.param == "inline" else set()
    with running_server(server_settings(database_url, tmp_path, inline_mechanisms=inline)) as live:
        yield live


def verify_clean(server: LiveServer) -> None:
    engine = make_engine(server.settings.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            report = verify(session)
    finally:
        engine.dispose()
    assert report.ok, report.problems


class TestExecutionPaths:
    def test_release_commits_its_realized_charge(self, server: LiveServer) -> None:
        world = make_world(server, {"epsilon": 1.0, "delta": 0.0})
        response = world.request(world.analyst, COUNT)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["state"] == "committed"
        assert body["realized"]["pure"] == 0.25
        budget = world.viewer.get(f"/v1/datasets/{world.dataset_id}/budget").json()
        assert budget["pure"]["spent"] == 0.25
        assert budget["pure"]["reserved"] == 0.0
        ledger = world.viewer.get(f"/v1/datasets/{world.dataset_id}/ledger").json()["items"]
        events = [entry["event"] for entry in ledger]
        assert events[-2:] == ["reserve", "commit"]
        verify_clean(server)

    @pytest.mark.usefixtures("exploding_mechanism")
    @pytest.mark.parametrize("mechanism", ["exploding_laplace", "overclaiming_laplace"])
    def test_failure_after_reading_data_charges_the_worst_case(
        self, server: LiveServer, mechanism: str, capfd: pytest.CaptureFixture[str]
    ) -> None:
        world = make_world(server, {"epsilon": 1.0, "delta": 0.0})
        response = world.request(world.analyst, COUNT, mechanism=mechanism)
        assert response.status_code == 500
        problem = response.json()
        assert problem["type"] == "/problems/mechanism-failed"
        assert "boom" not in response.text  # no internals leak into the response
        logs = capfd.readouterr()
        assert LEAK_MARKER not in logs.out + logs.err  # nor into the logs (type and place only)
        state = world.analyst.get(f"/v1/requests/{problem['request_id']}").json()
        assert state["state"] == "failed_charged"
        assert state["release"] is None
        budget = world.viewer.get(f"/v1/datasets/{world.dataset_id}/budget").json()
        assert budget["pure"]["spent"] == 0.25
        assert budget["pure"]["reserved"] == 0.0
        verify_clean(server)
