"""The request lifecycle (docs/privacy/rules.md#rule-reserve-before-read, docs/privacy/workers.md#workers)
over real HTTP: failures are charged, the reaper, sub-budgets, estimates, missing budgets, and the ledger
verifier (in process and through the ``expost`` CLI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from pydantic import BaseModel
from sqlalchemy import delete, select, update

from mechanisms.base import PublicContext, Release, Table
from mechanisms.catalog import MECHANISMS
from mechanisms.noise import Noise
from mechanisms.queries.laplace import Laplace
from service.auth import Role
from service.config import Settings
from service.embedded import free_port
from service.filter.ledger import canonical_json, chain_hash, verify
from service.store.models import AnalysisRequest, LedgerEntry, PrivacyFilter
from tests.conftest import LiveServer, running_server
from tests.integration.helpers import (
    World,
    assert_problem,
    db_session,
    fresh_database,
    get_budget,
    ledger_items,
    make_world,
    upload,
)

COUNT = {"query": {"kind": "count"}, "epsilon": 0.1}
INCOME_SUM = 4_900_000  # sum of the helpers' CSV income column: must never appear in a response
EXPOST = Path(sys.executable).with_name("expost")


class FailingLaplace(Laplace):
    """Reads the data, then raises with a message that contains a data-derived value."""

    name: ClassVar[str] = "failing_laplace"

    def run(self, params: BaseModel, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        total = int(np.sum(table["income"]))
        raise RuntimeError(f"exploded after reading the data (income sum {total})")


class BlockingLaplace(Laplace):
    """Reads the data, then waits until the test lets it finish (a worker that hangs)."""

    name: ClassVar[str] = "blocking_laplace"

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def run(self, params: BaseModel, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        assert table["age"].size > 0
        self.started.set()
        self.release.wait(30)
        return super().run(params, ctx, table, noise)


@pytest.fixture
def failing(monkeypatch: pytest.MonkeyPatch) -> FailingLaplace:
    mechanism = FailingLaplace()
    monkeypatch.setitem(MECHANISMS, mechanism.name, mechanism)
    return mechanism


@pytest.fixture
def blocking(monkeypatch: pytest.MonkeyPatch) -> Iterator[BlockingLaplace]:
    mechanism = BlockingLaplace()
    monkeypatch.setitem(MECHANISMS, mechanism.name, mechanism)
    yield mechanism
    mechanism.release.set()  # never leave a worker thread hanging


def request_row(server: LiveServer, request_id: str) -> AnalysisRequest:
    with db_session(server.settings.database_url) as session:
        row = session.get(AnalysisRequest, request_id)
        assert row is not None
        return row


def events_for(items: list[dict[str, Any]], request_id: str) -> Counter[str]:
    return Counter(str(item["event"]) for item in items if item["request_id"] == request_id)


def assert_charged(budget: dict[str, Any], curve: dict[str, Any]) -> None:
    """The filter's spent equals ``curve`` (to the 1e-12 fixed-point unit, rounded up), nothing reserved."""
    assert budget["pure"]["spent"] == curve["pure"]
    assert budget["pure"]["reserved"] == 0.0
    spent = [row["spent"] for row in budget["orders"]]
    assert [row["alpha"] for row in budget["orders"]] == curve["orders"]
    for have, want in zip(spent, curve["values"], strict=True):
        assert want <= have + 1e-15
        assert have - want < 1.5e-12
    assert all(row["reserved"] == 0.0 for row in budget["orders"])


def verify_report(database_url: str) -> list[str]:
    with db_session(database_url) as session:
        return verify(session).problems


# ----- (a) a mechanism that fails after reading the data --------------------------------------------------


class TestFailedMechanismIsCharged:
    def test_failure_after_reading_data_commits_the_worst_case(
        self, live_server: LiveServer, failing: FailingLaplace
    ) -> None:
        world = make_world(live_server, {"epsilon": 1.0, "delta": 1e-6})
        estimate = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/requests:estimate",
            json={"mechanism": failing.name, "params": COUNT},
        )
        assert estimate.status_code == 200, estimate.text
        worst = estimate.json()["worst_case"]
        assert worst["pure"] == 0.1

        response = world.request(world.analyst, COUNT, mechanism=failing.name)
        problem = assert_problem(response, 500, "/problems/mechanism-failed")
        assert str(INCOME_SUM) not in response.text
        rid = problem["request_id"]
        assert problem["charged"] == worst

        stored = world.analyst.get(f"/v1/requests/{rid}")
        assert stored.status_code == 200, stored.text
        assert stored.json()["state"] == "failed_charged"
        assert stored.json()["release"] is None
        assert stored.json()["realized"] == worst
        assert str(INCOME_SUM) not in stored.text

        assert_charged(get_budget(world.viewer, world.dataset_id), worst)
        assert_charged(get_budget(world.admin, world.dataset_id, world.analyst_name), worst)
        items = ledger_items(world.admin, world.dataset_id)
        assert events_for(items, rid) == Counter({"reserve": 1, "commit": 1})
        commit = next(i for i in items if i["request_id"] == rid and i["event"] == "commit")
        assert commit["outcome"] == "failed"
        assert commit["realized"] == commit["worst_case"]
        assert str(INCOME_SUM) not in json.dumps(items)

    def test_a_retry_of_a_failed_request_is_not_charged_again(
        self, live_server: LiveServer, failing: FailingLaplace
    ) -> None:
        world = make_world(live_server)
        first = world.request(world.analyst, COUNT, mechanism=failing.name, key="fails")
        again = world.request(world.analyst, COUNT, mechanism=failing.name, key="fails")
        assert assert_problem(first, 500)["request_id"] == assert_problem(again, 500)["request_id"]
        assert get_budget(world.viewer, world.dataset_id)["pure"]["spent"] == 0.1


# ----- (b) the reaper ------------------------------------------------------------------------------------


class TestReaper:
    def test_an_expired_lease_is_charged_its_worst_case_once(
        self, live_server: LiveServer, blocking: BlockingLaplace
    ) -> None:
        world = make_world(live_server)
        with ThreadPoolExecutor(1) as pool:
            try:
                future = pool.submit(world.request, world.analyst, COUNT, blocking.name)
                assert blocking.started.wait(10), "the mechanism never started"
                with db_session(live_server.settings.database_url) as session:
                    rid = session.scalars(
                        select(AnalysisRequest.id).where(AnalysisRequest.dataset_id == world.dataset_id)
                    ).one()
                assert request_row(live_server, rid).state == "running"
                running = get_budget(world.viewer, world.dataset_id)
                assert (running["pure"]["spent"], running["pure"]["reserved"]) == (0.0, 0.1)

                with db_session(live_server.settings.database_url) as session, session.begin():
                    session.execute(
                        update(AnalysisRequest)
                        .where(AnalysisRequest.id == rid)
                        .values(lease_expires_at=datetime.now(UTC) - timedelta(hours=1))
                    )
                deadline = time.monotonic() + 5
                while request_row(live_server, rid).state == "running" and time.monotonic() < deadline:
                    time.sleep(0.1)
                reaped = request_row(live_server, rid)
                assert reaped.state == "failed_charged"
                assert reaped.worst_case["curve"] == reaped.realized["curve"]  # type: ignore[index]
                assert_charged(get_budget(world.viewer, world.dataset_id), reaped.worst_case["curve"])
            finally:
                blocking.release.set()
            late = future.result(30)

        # the late run finished after the reaper: it must neither charge again nor release anything
        problem = assert_problem(late, 500, "/problems/mechanism-failed")
        assert problem["request_id"] == rid
        final = request_row(live_server, rid)
        assert final.state == "failed_charged"
        assert final.release is None
        assert "worker was lost" in (final.error or "")
        budget = get_budget(world.viewer, world.dataset_id)
        assert (budget["pure"]["spent"], budget["pure"]["reserved"]) == (0.1, 0.0)
        assert events_for(ledger_items(world.admin, world.dataset_id), rid) == Counter(
            {"reserve": 1, "commit": 1}
        )
        stored = world.analyst.get(f"/v1/requests/{rid}").json()
        assert (stored["state"], stored["release"]) == ("failed_charged", None)


# ----- (c) analyst sub-budgets ------------------------------------------------------------------------------


class TestAnalystSubBudget:
    def test_the_analyst_filter_refuses_while_others_still_spend(self, live_server: LiveServer) -> None:
        world = make_world(live_server, {"epsilon": 1.0, "delta": 0.0})
        other_name, other = world.new_key(Role.analyst)
        assert (
            world.admin.post(
                f"/v1/datasets/{world.dataset_id}/grants", json={"analyst": other_name}
            ).status_code
            == 201
        )
        capped = world.admin.put(
            f"/v1/datasets/{world.dataset_id}/analysts/{world.analyst_name}/budget",
            json={"epsilon": 0.25, "delta": 0.0},
        )
        assert capped.status_code == 200, capped.text
        assert (capped.json()["scope"], capped.json()["analyst"]) == ("analyst", world.analyst_name)

        for _ in range(2):
            assert world.request(world.analyst, COUNT).status_code == 200
        refused = assert_problem(world.request(world.analyst, COUNT), 409, "/problems/budget-exhausted")
        assert refused["filter"] == f"analyst:{world.analyst_name}"
        assert refused["pure"]["capacity"] == 0.25
        assert refused["pure"]["spent"] == 0.2
        assert refused["affordable"]["parameter"] == "epsilon"
        assert 0.0499 < refused["affordable"]["value"] <= 0.05

        for _ in range(3):
            assert world.request(other, COUNT).status_code == 200  # the dataset filter still has room
        assert world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.05}).status_code == 200

        mine = get_budget(world.analyst, world.dataset_id, world.analyst_name)
        assert (mine["pure"]["spent"], mine["pure"]["remaining"]) == (0.25, 0.0)
        assert get_budget(world.admin, world.dataset_id, other_name)["pure"]["spent"] == 0.3
        assert get_budget(world.viewer, world.dataset_id)["pure"]["spent"] == 0.55

        # the dataset filter binds everyone: once it is full, the uncapped analyst is refused by it
        assert world.request(other, {"query": {"kind": "count"}, "epsilon": 0.45}).status_code == 200
        over = assert_problem(world.request(other, {"query": {"kind": "count"}, "epsilon": 0.01}), 409)
        assert over["filter"] == "dataset"


# ----- (d) estimates -----------------------------------------------------------------------------------


class TestEstimate:
    def estimate(self, world: World, client: Any, epsilon: float) -> dict[str, Any]:
        response = client.post(
            f"/v1/datasets/{world.dataset_id}/requests:estimate",
            json={"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": epsilon}},
        )
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def test_estimate_charges_nothing_and_predicts_admission(self, live_server: LiveServer) -> None:
        world = make_world(live_server, {"epsilon": 1.0, "delta": 0.0})

        def state() -> tuple[Any, ...]:
            return ledger_items(world.admin, world.dataset_id), get_budget(world.viewer, world.dataset_id)

        before = state()
        yes = self.estimate(world, world.analyst, 0.5)
        assert yes["admitted"] is True
        assert yes["worst_case"]["pure"] == 0.5
        assert yes["refusal"] is None  # the typed EstimateOut names the field; null when admitted
        assert self.estimate(world, world.admin, 1.0)["admitted"] is True
        no = self.estimate(world, world.analyst, 1.5)
        assert no["admitted"] is False
        assert no["refusal"]["type"] == "/problems/not-admissible"
        assert no["refusal"]["affordable"]["value"] == 1.0
        assert state() == before

        assert world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.75}).status_code == 200
        ledger_count = len(ledger_items(world.admin, world.dataset_id))
        refused = self.estimate(world, world.analyst, 0.5)
        assert refused["admitted"] is False
        assert refused["refusal"]["status"] == 409
        assert refused["refusal"]["filter"] == "dataset"
        assert refused["refusal"]["pure"]["spent"] == 0.75
        assert 0.249 < refused["refusal"]["affordable"]["value"] <= 0.25
        assert self.estimate(world, world.analyst, 0.25)["admitted"] is True
        assert len(ledger_items(world.admin, world.dataset_id)) == ledger_count
        # the estimate was right: 0.5 is refused, 0.25 admitted
        assert world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.5}).status_code == 409
        assert world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.25}).status_code == 200

    def test_estimate_reports_the_analyst_filter(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        assert (
            world.admin.put(
                f"/v1/datasets/{world.dataset_id}/analysts/{world.analyst_name}/budget",
                json={"epsilon": 0.1, "delta": 0.0},
            ).status_code
            == 200
        )
        no = self.estimate(world, world.analyst, 0.2)
        assert no["admitted"] is False
        assert no["refusal"]["filter"] == f"analyst:{world.analyst_name}"
        assert self.estimate(world, world.admin, 0.2)["admitted"] is True  # admins have no sub-filter


# ----- (e) no budget ------------------------------------------------------------------------------------


class TestNoBudget:
    def test_requests_on_a_dataset_without_budget_are_refused(self, live_server: LiveServer) -> None:
        world = make_world(live_server, budget=None)
        before = ledger_items(world.admin, world.dataset_id)
        assert get_budget(world.viewer, world.dataset_id)["budget_set"] is False
        assert_problem(world.request(world.analyst, COUNT), 409, "/problems/no-budget")
        assert_problem(world.request(world.analyst, COUNT, key="nb"), 409, "/problems/no-budget")
        estimate = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/requests:estimate",
            json={"mechanism": "laplace", "params": COUNT},
        )
        assert estimate.status_code == 200, estimate.text
        assert estimate.json()["admitted"] is False
        assert "budget" in estimate.json()["reason"]
        assert ledger_items(world.admin, world.dataset_id) == before
        with db_session(live_server.settings.database_url) as session:
            assert (
                session.scalars(
                    select(AnalysisRequest).where(AnalysisRequest.dataset_id == world.dataset_id)
                ).all()
                == []
            )
        # nothing was left behind: once a budget is set the same key works
        assert (
            world.admin.put(
                f"/v1/datasets/{world.dataset_id}/budget", json={"epsilon": 1.0, "delta": 0.0}
            ).status_code
            == 200
        )
        assert world.request(world.analyst, COUNT, key="nb").status_code == 200
        assert get_budget(world.viewer, world.dataset_id)["pure"]["spent"] == 0.1


# ----- (f) ledger verify ----------------------------------------------------------------------------------


@dataclass
class FreshWorld:
    database_url: str
    datasets: list[str]


@contextmanager
def fresh_world(like: LiveServer, directory: Path, n_datasets: int) -> Iterator[FreshWorld]:
    """A new database on the live server's backend, filled through a real server that is then stopped."""
    with fresh_database(like.settings.database_url, directory) as url:
        settings = Settings(
            database_url=url, data_dir=directory / "data", wait_seconds=20, reaper_interval_seconds=0.5
        )
        with running_server(settings) as server:
            world = make_world(server, {"epsilon": 1.0, "delta": 1e-6})
            ids = [world.dataset_id]
            for _ in range(n_datasets - 1):
                created = upload(world.admin)
                assert created.status_code == 201, created.text
                ids.append(created.json()["id"])
                assert (
                    world.admin.post(
                        f"/v1/datasets/{ids[-1]}/grants", json={"analyst": world.analyst_name}
                    ).status_code
                    == 201
                )
                assert (
                    world.admin.put(
                        f"/v1/datasets/{ids[-1]}/budget", json={"epsilon": 1.0, "delta": 1e-6}
                    ).status_code
                    == 200
                )
            for dataset_id in ids:
                assert world.request(world.analyst, COUNT, dataset_id=dataset_id).status_code == 200
                assert (
                    world.request(
                        world.analyst,
                        {"query": {"kind": "count"}, "sigma": 20.0},
                        mechanism="gaussian",
                        dataset_id=dataset_id,
                    ).status_code
                    == 200
                )
                assert (
                    world.request(
                        world.analyst, {"query": {"kind": "count"}, "epsilon": 5.0}, dataset_id=dataset_id
                    ).status_code
                    == 409
                )
            for client in (world.admin, world.analyst, world.viewer):
                client.close()
        yield FreshWorld(url, ids)


def problems_of(problems: list[str], dataset_id: str) -> list[str]:
    return [p for p in problems if p.startswith(dataset_id)]


def entries(database_url: str, dataset_id: str) -> list[LedgerEntry]:
    with db_session(database_url) as session:
        return list(
            session.scalars(
                select(LedgerEntry).where(LedgerEntry.dataset_id == dataset_id).order_by(LedgerEntry.seq)
            )
        )


def zero_spent(database_url: str, dataset_id: str) -> None:
    with db_session(database_url) as session, session.begin():
        row = session.scalars(
            select(PrivacyFilter).where(PrivacyFilter.dataset_id == dataset_id, PrivacyFilter.scope == "*")
        ).one()
        slots = len(row.spent["finite"])
        row.spent = {"finite": [0] * slots, "infinite": [0] * slots}


@pytest.fixture(scope="class")
def tamperable(live_server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FreshWorld]:
    with fresh_world(live_server, tmp_path_factory.mktemp("tamper"), n_datasets=5) as world:
        assert verify_report(world.database_url) == []  # clean before anyone touches it
        yield world


def entry_key(dataset_id: str, seq: int) -> tuple[Any, Any]:
    return LedgerEntry.dataset_id == dataset_id, LedgerEntry.seq == seq


class TestLedgerVerify:
    def test_the_live_database_verifies_clean_after_every_flow(
        self, live_server: LiveServer, failing: FailingLaplace
    ) -> None:
        world = make_world(live_server, {"epsilon": 1.0, "delta": 1e-6})
        assert (
            world.admin.put(
                f"/v1/datasets/{world.dataset_id}/analysts/{world.analyst_name}/budget",
                json={"epsilon": 0.6, "delta": 1e-6},
            ).status_code
            == 200
        )
        assert world.request(world.analyst, COUNT, key="v").status_code == 200
        assert world.request(world.analyst, COUNT, key="v").status_code == 200
        assert world.request(world.analyst, COUNT, mechanism=failing.name).status_code == 500
        assert (
            world.request(
                world.analyst,
                {"query": {"kind": "histogram", "column": "region"}, "sigma": 50.0},
                mechanism="gaussian",
            ).status_code
            == 200
        )
        assert world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.5}).status_code == 409
        with db_session(live_server.settings.database_url) as session:
            report = verify(session)
        assert report.problems == []
        assert report.ok
        assert report.datasets >= 1
        assert report.entries >= len(ledger_items(world.admin, world.dataset_id)) > 0

    def test_an_edited_ledger_body_breaks_the_chain(self, tamperable: FreshWorld) -> None:
        target, untouched = tamperable.datasets[0], tamperable.datasets[-1]
        commit = next(e for e in entries(tamperable.database_url, target) if e.event == "commit")
        body = json.loads(commit.body)
        body["realized"]["finite"] = [0] * len(body["realized"]["finite"])
        with db_session(tamperable.database_url) as session, session.begin():
            session.execute(
                update(LedgerEntry).where(*entry_key(target, commit.seq)).values(body=canonical_json(body))
            )
        problems = verify_report(tamperable.database_url)
        assert f"{target}#{commit.seq}: hash chain broken" in problems
        assert problems_of(problems, untouched) == []

    def test_an_edited_filter_total_is_caught(self, tamperable: FreshWorld) -> None:
        target, untouched = tamperable.datasets[1], tamperable.datasets[-1]
        zero_spent(tamperable.database_url, target)
        found = problems_of(verify_report(tamperable.database_url), target)
        assert any(p.startswith(f"{target}/*: spent is") for p in found), found
        assert not any("hash chain" in p for p in found), found
        assert problems_of(verify_report(tamperable.database_url), untouched) == []

    def test_a_rehashed_forgery_still_disagrees_with_the_totals(self, tamperable: FreshWorld) -> None:
        """An attacker rewrites the last commit (lower charge) and re-hashes it: the replay catches it."""
        target, untouched = tamperable.datasets[2], tamperable.datasets[-1]
        chain = entries(tamperable.database_url, target)
        last = chain[-1]
        assert last.event == "commit"
        body = json.loads(last.body)
        body["realized"]["finite"] = [0] * len(body["realized"]["finite"])
        body["realized"]["infinite"] = [0] * len(body["realized"]["infinite"])
        forged = canonical_json(body)
        new_hash = chain_hash(last.prev_hash, forged)
        with db_session(tamperable.database_url) as session, session.begin():
            session.execute(
                update(LedgerEntry).where(*entry_key(target, last.seq)).values(body=forged, hash=new_hash)
            )
            session.execute(
                update(PrivacyFilter)
                .where(PrivacyFilter.dataset_id == target, PrivacyFilter.scope == "*")
                .values(last_hash=new_hash)
            )
        found = problems_of(verify_report(tamperable.database_url), target)
        assert not any("hash chain" in p for p in found), found
        assert any(p.startswith(f"{target}/*: spent is") for p in found), found
        assert problems_of(verify_report(tamperable.database_url), untouched) == []

    def test_a_deleted_entry_is_caught(self, tamperable: FreshWorld) -> None:
        target, untouched = tamperable.datasets[3], tamperable.datasets[-1]
        reserve = next(e for e in entries(tamperable.database_url, target) if e.event == "reserve")
        with db_session(tamperable.database_url) as session, session.begin():
            session.execute(delete(LedgerEntry).where(*entry_key(target, reserve.seq)))
        found = problems_of(verify_report(tamperable.database_url), target)
        assert f"{target}#{reserve.seq + 1}: expected sequence number {reserve.seq}" in found, found
        assert f"{target}#{reserve.seq + 1}: hash chain broken" in found, found
        assert problems_of(verify_report(tamperable.database_url), untouched) == []


# ----- (g) the CLI --------------------------------------------------------------------------------------


def expost(database_url: str, directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPOST_")}
    env.update(EXPOST_DATABASE_URL=database_url, EXPOST_DATA_DIR=str(directory / "data"))
    assert EXPOST.exists(), EXPOST
    return subprocess.run(
        [str(EXPOST), *args], env=env, cwd=directory, capture_output=True, text=True, timeout=60, check=False
    )


class TestCli:
    def test_ledger_verify_exits_0_when_clean_and_1_when_tampered(
        self, live_server: LiveServer, tmp_path: Path
    ) -> None:
        with fresh_world(live_server, tmp_path, n_datasets=2) as world:
            clean = expost(world.database_url, tmp_path, "ledger", "verify")
            assert clean.returncode == 0, clean.stdout + clean.stderr
            assert "2 datasets" in clean.stdout
            assert clean.stdout.rstrip().endswith("ok")
            assert "MISMATCH" not in clean.stdout

            zero_spent(world.database_url, world.datasets[1])
            tampered = expost(world.database_url, tmp_path, "ledger", "verify")
            assert tampered.returncode == 1, tampered.stdout + tampered.stderr
            assert f"MISMATCH {world.datasets[1]}/*: spent is" in tampered.stdout
            assert world.datasets[0] not in tampered.stdout

    def test_serve_refuses_an_unmigrated_database(self, live_server: LiveServer, tmp_path: Path) -> None:
        with fresh_database(live_server.settings.database_url, tmp_path, migrated=False) as url:
            result = expost(url, tmp_path, "serve", "--port", str(free_port()))
        assert result.returncode == 2, result.stdout + result.stderr
        assert "expost migrate" in result.stderr
        assert "not migrated" in result.stderr
