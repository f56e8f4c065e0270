"""Concurrency with real server processes (docs/privacy/rules.md#rule-serialized-admission): many clients race
for the last of a budget.

Each backend gets a real ``expost serve`` process tree started as a subprocess (PostgreSQL: two server
processes sharing one database, so admission must serialize on ``SELECT … FOR UPDATE`` across processes;
SQLite: one process, serialized by ``BEGIN IMMEDIATE``). Keys are created and the schema is migrated with
the real CLI; everything else goes through HTTP. A race releases every client at once (an asyncio barrier
after each client has opened its connection) and checks exact admission counts, exact totals, that no
reservation is left behind, and that ``expost ledger verify`` rebuilds the same totals from the ledger.

``TestMixedTraffic`` mixes every kind of traffic on one dataset (requests, session steps and closes,
budget changes, with the reaper running) on the shared in-thread server of each backend.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from mechanisms.accounting import RdpCurve, UnitsVector, capacity_units, units_to_epsilon
from service.auth import Role
from service.embedded import free_port
from service.filter.ledger import verify
from tests.conftest import FreshDatabase, LiveServer, fresh_postgres_database
from tests.integration.helpers import db_session, get_budget, key_of, make_world, upload
from tests.integration.scale_out_support import (
    EXPOST,
    cli_create_key,
    cli_keys_from,
    run_cli,
    stop_server,
    wait_ready,
)

pytestmark = pytest.mark.slow

CLIENTS = 120  # concurrent requests per race
EXTRA_ANALYSTS = 3  # created over HTTP, on top of the one made with `expost keys create`
PURE_COUNT = {"query": {"kind": "count"}, "epsilon": 0.1}
GAUSSIAN_SIGMA = 25.0  # count (ℓ2 sensitivity 1) at σ = 25: a handful fit in (ε, δ) = (1, 1e-6)
LOG_ALARMS = ("unhandled error", "Traceback", "reaper pass failed", "mechanism failed")
BELOW = {"query": {"kind": "count", "where": [{"column": "region", "op": "eq", "value": "north"}]}}
TLS = ssl.create_default_context()  # unused on http://, but httpx builds one per client unless given (~30 ms)


# ----- real processes -------------------------------------------------------------------------------


@dataclass
class Service:
    backend: str
    base_url: str
    env: dict[str, str]
    workdir: Path
    log_path: Path
    admin_key: str
    analysts: dict[str, str]  # name -> key

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=60
        )

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(self.env, self.workdir, *args)

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def log_since(self, offset: int) -> str:
        with self.log_path.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("postgres", 2), marks=pytest.mark.postgres, id="postgres-2-processes"),
        pytest.param(("sqlite", 1), id="sqlite-1-process"),
    ],
)
def service(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    backend, workers = request.param
    workdir = tmp_path_factory.mktemp(f"concurrency-{backend}")
    fresh: FreshDatabase | None = None
    proc: subprocess.Popen[bytes] | None = None
    log_path = workdir / "server.log"
    try:
        if backend == "postgres":
            fresh = fresh_postgres_database()
            url = fresh.url
        else:
            url = f"sqlite:///{workdir / 'expost.db'}"
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("EXPOST_")},
            "EXPOST_DATABASE_URL": url,
            "EXPOST_DATA_DIR": str(workdir / "data"),
            "EXPOST_WAIT_SECONDS": "60",  # a slow release must not turn into a 202 and blur the counts
            "EXPOST_LOG_LEVEL": "INFO",  # one "expost started" line per server process
        }
        migrated = run_cli(env, workdir, "migrate")
        assert migrated.returncode == 0, migrated.stderr
        admin_proc = cli_create_key(env, workdir, "admin", "race-admin")
        analyst_proc = cli_create_key(env, workdir, "analyst", "race-analyst-0")
        admin_key, analyst_key = cli_keys_from(admin_proc, analyst_proc)

        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [EXPOST, "serve", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)],
                env=env,
                cwd=workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_ready(proc, base_url, log_path, workers)
        service = Service(
            backend, base_url, env, workdir, log_path, admin_key, {"race-analyst-0": analyst_key}
        )
        with service.admin() as admin:
            for i in range(1, 1 + EXTRA_ANALYSTS):
                created = admin.post("/v1/keys", json={"name": f"race-analyst-{i}", "role": "analyst"})
                assert created.status_code == 201, created.text
                service.analysts[created.json()["name"]] = created.json()["key"]
        yield service
    finally:
        if proc is not None:
            stop_server(proc)
        if fresh is not None:
            fresh.drop()


# ----- the race ---------------------------------------------------------------------------------------


@dataclass
class RaceResult:
    responses: list[tuple[str, httpx.Response]]  # (analyst, response)
    seconds: float

    @property
    def statuses(self) -> Counter[int]:
        return Counter(r.status_code for _, r in self.responses)

    def admitted(self) -> list[tuple[str, httpx.Response]]:
        return [(a, r) for a, r in self.responses if r.status_code == 200]


async def _race_async(service: Service, dataset_id: str, body: dict[str, Any], n: int) -> RaceResult:
    """One keep-alive connection per client (one pool for all is O(n) per request in httpcore)."""
    analysts = sorted(service.analysts)
    barrier = asyncio.Barrier(n + 1)

    async def one(i: int) -> tuple[str, httpx.Response]:
        analyst = analysts[i % len(analysts)]
        headers = {"Authorization": f"Bearer {service.analysts[analyst]}"}
        async with httpx.AsyncClient(
            base_url=service.base_url, timeout=120, headers=headers, verify=TLS
        ) as client:
            await client.get("/healthz")  # open this client's connection before the start
            await barrier.wait()
            response = await client.post(f"/v1/datasets/{dataset_id}/requests", json=body)
            return analyst, response

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await asyncio.wait_for(barrier.wait(), timeout=60)
    started = time.monotonic()
    responses = await asyncio.gather(*tasks)
    return RaceResult(list(responses), time.monotonic() - started)


def race(service: Service, dataset_id: str, body: dict[str, Any], n: int = CLIENTS) -> RaceResult:
    return asyncio.run(_race_async(service, dataset_id, body, n))


def prepare_dataset(service: Service, budget: dict[str, float]) -> dict[str, Any]:
    with service.admin() as admin:
        created = upload(admin)
        assert created.status_code == 201, created.text
        dataset = created.json()
        for analyst in service.analysts:
            granted = admin.post(f"/v1/datasets/{dataset['id']}/grants", json={"analyst": analyst})
            assert granted.status_code == 201, granted.text
        response = admin.put(f"/v1/datasets/{dataset['id']}/budget", json=budget)
        assert response.status_code == 200, response.text
    return dataset  # type: ignore[no-any-return]


def check_outcome(service: Service, result: RaceResult, admitted: int, log_offset: int) -> None:
    """Exactly ``admitted`` releases, every other response a budget-exhausted refusal, nothing else."""
    unexpected = [r for _, r in result.responses if r.status_code not in (200, 409)]
    assert not unexpected, (
        f"{result.statuses}: first unexpected response {unexpected[0].status_code} "
        f"{unexpected[0].text[:500]}\nserver log:\n{service.log_since(log_offset)[-4000:]}"
    )
    assert result.statuses == Counter({200: admitted, 409: len(result.responses) - admitted}), result.statuses
    for _, response in result.responses:
        if response.status_code == 200:
            body = response.json()
            assert body["state"] == "committed", body
            assert body["release"] is not None
        else:
            assert response.headers["content-type"].startswith("application/problem+json")
            assert response.json()["type"] == "/problems/budget-exhausted", response.text
    log = service.log_since(log_offset).splitlines()
    alarms = [line for line in log if any(alarm in line for alarm in LOG_ALARMS)]
    assert not alarms, "\n".join(alarms[:20])


def check_ledger(service: Service, dataset_id: str, admitted: int) -> None:
    with service.admin() as admin:
        ledger = admin.get(f"/v1/datasets/{dataset_id}/ledger", params={"limit": 1000})
    assert ledger.status_code == 200, ledger.text
    events = Counter(item["event"] for item in ledger.json()["items"])
    assert events["reserve"] == admitted, events
    assert events["commit"] == admitted, events
    assert events["abort"] == 0, events
    verified = service.cli("ledger", "verify")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "ok" in verified.stdout, verified.stdout


def budget_of(service: Service, dataset_id: str, analyst: str | None = None) -> dict[str, Any]:
    path = (
        f"/v1/datasets/{dataset_id}/budget"
        if analyst is None
        else f"/v1/datasets/{dataset_id}/analysts/{analyst}/budget"
    )
    with service.admin() as admin:
        response = admin.get(path)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def assert_nothing_reserved(view: dict[str, Any]) -> None:
    assert view["pure"]["reserved"] == 0.0, view["pure"]
    assert all(row["reserved"] == 0.0 for row in view["orders"]), view["orders"]


# ----- tests --------------------------------------------------------------------------------------------


def test_pure_budget_race_admits_exactly_ten(service: Service) -> None:
    """ε = 1 pure, 120 concurrent requests of ε = 0.1: exactly ten releases, spent exactly 1.0."""
    dataset = prepare_dataset(service, {"epsilon": 1.0, "delta": 0.0})
    offset = service.log_size()

    result = race(service, dataset["id"], {"mechanism": "laplace", "params": PURE_COUNT})

    check_outcome(service, result, admitted=10, log_offset=offset)
    for _, response in result.admitted():
        assert response.json()["realized"]["pure"] == 0.1
    view = budget_of(service, dataset["id"])
    assert view["pure"]["spent"] == 1.0
    assert view["pure"]["capacity"] == 1.0
    assert view["epsilon_remaining"] == 0.0
    assert_nothing_reserved(view)
    per_analyst = Counter(a for a, _ in result.admitted())
    for analyst in service.analysts:  # each analyst's tracking filter holds exactly its own releases
        own = budget_of(service, dataset["id"], analyst)
        assert own["pure"]["spent"] == units_to_epsilon(per_analyst[analyst] * 10**11), (analyst, own["pure"])
        assert_nothing_reserved(own)
    check_ledger(service, dataset["id"], admitted=10)
    print(f"\n[{service.backend}] pure race: {dict(result.statuses)} in {result.seconds:.2f} s")


def sequential_admissions(orders: list[float], epsilon: float, delta: float, curve: RdpCurve) -> int:
    """The k such that k copies of ``curve`` fit the filter and k + 1 do not (the admission rule in order)."""
    capacity = capacity_units(epsilon, delta, orders)
    charge = UnitsVector.charge(curve)
    total, k = UnitsVector.zeros(len(charge)), 0
    while any((total + charge).fits(capacity)):
        total, k = total + charge, k + 1
        assert k <= CLIENTS, "the budget is too large for this race"
    return k


def test_rdp_budget_race_admits_what_sequential_admission_admits(service: Service) -> None:
    """(ε, δ) = (1, 1e-6), 120 concurrent Gaussian counts: admitted = the sequential rule's count, exactly."""
    dataset = prepare_dataset(service, {"epsilon": 1.0, "delta": 1e-6})
    orders = dataset["orders"]
    curve = RdpCurve.gaussian(1.0, GAUSSIAN_SIGMA, orders)  # a count moves by 1: ℓ2 sensitivity 1
    expected = sequential_admissions(orders, 1.0, 1e-6, curve)
    assert 1 < expected < CLIENTS // 2
    offset = service.log_size()

    result = race(
        service,
        dataset["id"],
        {"mechanism": "gaussian", "params": {"query": {"kind": "count"}, "sigma": GAUSSIAN_SIGMA}},
    )

    check_outcome(service, result, admitted=expected, log_offset=offset)
    for _, response in result.admitted():
        assert response.json()["worst_case"] == curve.as_dict()
        assert response.json()["realized"] == curve.as_dict()
    charge = UnitsVector.charge(curve)
    view = budget_of(service, dataset["id"])
    assert [row["spent"] for row in view["orders"]] == [
        units_to_epsilon(expected * units) for units in charge.finite[:-1]
    ]
    assert view["pure"]["spent"] == "inf"  # the Gaussian has no pure bound
    assert_nothing_reserved(view)
    check_ledger(service, dataset["id"], admitted=expected)
    print(
        f"\n[{service.backend}] RDP race: {dict(result.statuses)} (sequential rule: {expected}) "
        f"in {result.seconds:.2f} s"
    )


class TestMixedTraffic:
    """Every kind of traffic at once on the shared in-thread server of each backend."""

    def test_mixed_concurrent_traffic_never_deadlocks_and_the_ledger_verifies(
        self, live_server: LiveServer
    ) -> None:
        """Requests, session steps and closes, reapers and budget changes on one dataset at once: no 5xx
        (PostgreSQL would report a deadlock as one) and the ledger rebuilds the filters exactly."""
        world = make_world(live_server, {"epsilon": 100.0, "delta": 1e-6})
        other_name, other = world.new_key(Role.analyst)
        assert (
            world.admin.post(
                f"/v1/datasets/{world.dataset_id}/grants", json={"analyst": other_name}
            ).status_code
            == 201
        )
        keys = [key_of(world.analyst), key_of(other)]
        admin_key = key_of(world.admin)
        opened = [
            world.analyst.post(
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
            for _ in range(3)
        ]
        sids = [o.json()["id"] for o in opened]

        def one(i: int) -> httpx.Response:
            kind = i % 6
            if kind == 5:
                with live_server.client(admin_key) as client:
                    scope = "budget" if i % 12 == 5 else f"analysts/{other_name}/budget"
                    return client.put(
                        f"/v1/datasets/{world.dataset_id}/{scope}", json={"epsilon": 100.0 + i, "delta": 1e-6}
                    )
            with live_server.client(keys[i % 2]) as client:
                if kind in (0, 1):
                    mechanism = "gaussian" if kind else "laplace"
                    params = {"query": {"kind": "count"}, **({"sigma": 5.0} if kind else {"epsilon": 0.05})}
                    return client.post(
                        f"/v1/datasets/{world.dataset_id}/requests",
                        json={"mechanism": mechanism, "params": params},
                    )
                if kind == 2:
                    return client.post(
                        f"/v1/datasets/{world.dataset_id}/requests",
                        json={
                            "mechanism": "above_threshold.batch",
                            "params": {
                                "threshold": 150,
                                "epsilon_threshold": 0.5,
                                "max_query_epsilon": 0.2,
                                "max_queries": 3,
                                "queries": [BELOW, BELOW],
                            },
                        },
                    )
                if i % 2:  # the other analyst cannot see the sessions: 404, never a 5xx
                    return client.post(f"/v1/sessions/{sids[i % 3]}/queries", json={**BELOW, "epsilon": 0.1})
                if kind == 3:
                    return client.post(f"/v1/sessions/{sids[i % 3]}/queries", json={**BELOW, "epsilon": 0.1})
                return client.post(f"/v1/sessions/{sids[i % 3]}/close")

        with ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(one, range(72)))
        errors = [r.text for r in responses if r.status_code >= 500]
        assert errors == []
        for sid in sids:
            world.analyst.post(f"/v1/sessions/{sid}/close")
        with db_session(live_server.settings.database_url) as session:
            problems = [p for p in verify(session).problems if world.dataset_id in p]
        assert problems == []
        view = get_budget(world.viewer, world.dataset_id)
        assert all(row["reserved"] == 0.0 for row in [*view["orders"], view["pure"]]), view
