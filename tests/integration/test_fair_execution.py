"""Fair, cancellable execution, in one process, on SQLite and PostgreSQL
(docs/privacy/workers.md#fair-execution).

* The claim order is per-analyst round-robin, decided in the database (``worker.claim_next``).
* ``POST /v1/requests/{id}/cancel``: a queued request (no worker claimed it, so no data was read) is
  aborted and charged nothing; a running one is charged its worst case at once and its run stops at its
  next heartbeat; cancelling again returns the same request; a finished one is a 409.
* Per-analyst limits (admin-set, defaults in the settings): requests queued or running and open
  sessions; over a limit the answer is a 429 problem+json naming the limit.
* 202 answers carry ``Retry-After``; a request shows its phase (queued or running), its queue position
  and an ETA from public quantities.

The real-process scenarios (floods, both executors, SIGTERM) are in test_fair_execution_processes.py.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service.auth import Principal, Role, create_key
from service.datasets import create_dataset, grant
from service.filter import budget
from service.filter.ledger import verify
from service.runs import admission, worker
from service.store.models import DATASET_SCOPE, AnalysisRequest, LedgerEntry
from service.store.repositories import FilterRepository, RequestRepository
from tests.conftest import running_server, server_settings
from tests.integration.helpers import CSV, SCHEMA, assert_problem, db_session, get_budget, make_world
from tests.integration.scale_out_support import GatedCount

COUNT = {"query": {"kind": "count"}, "epsilon": 0.2}
EPS_UNITS = 200_000_000_000  # 0.2 in fixed-point units (1e-12)


# ----- the claim order ---------------------------------------------------------------------------------


def test_the_claim_order_is_round_robin_across_analysts(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    names = [f"a-{time.time_ns()}", f"b-{time.time_ns()}", f"c-{time.time_ns()}"]
    with sessions() as session, session.begin():
        dataset = create_dataset(session, tmp_path, "d", CSV, SCHEMA, "admin")
        for name in names:
            create_key(session, name, Role.analyst)
            grant(session, dataset, name, "admin")
        budget.set_budget(session, dataset, DATASET_SCOPE, 100.0, 0.0, "admin")
    a, b, c = (Principal(name, Role.analyst) for name in names)

    queue = f"fair-{time.time_ns()}"  # its own queue: what other tests left queued is not claimed here

    def admit(who: Principal) -> str:
        with sessions() as session:
            validated = replace(admission.validate(session, who, dataset.id, "laplace", COUNT), queue=queue)
        with sessions() as session:
            request, created = admission.admit(session, who, validated, None, 30.0)
        assert created
        return request.id

    # A floods first, then B, then C arrives late: every request is queued (nobody claimed any yet)
    queued = dict.fromkeys([admit(a) for _ in range(5)], "a")
    queued |= dict.fromkeys([admit(b) for _ in range(2)], "b")
    queued |= {admit(c): "c"}
    with sessions() as session:
        rows = [RequestRepository(session).get(rid) for rid in queued]
    assert all(r is not None and r.queued and r.lease_expires_at is None for r in rows)
    # a deployment's workers claim only their own queue's requests
    assert worker.claim_next(sessions, "other-deployment", 30.0, ["laplace"], queue="other") is None
    order = []
    while (claimed := worker.claim_next(sessions, f"w{len(order)}", 30.0, ["laplace"], queue)) is not None:
        order.append(queued[claimed])  # claimed, never settled: each stays running on "its worker"
    # fewest running first, ties to the analyst served least recently: A's burst delays B and C by one
    assert order == ["a", "b", "c", "a", "b", "a", "a", "a"], order
    with sessions() as session:
        started = [RequestRepository(session).get(rid) for rid in queued]
    assert all(r is not None and r.started_at is not None and r.lease_expires_at for r in started)
    # within one analyst, first come first served
    a_ids = [rid for rid, who in queued.items() if who == "a"]
    with sessions() as session:
        starts = [RequestRepository(session).get(rid).started_at for rid in a_ids]  # type: ignore[union-attr]
    assert starts == sorted(starts)  # type: ignore[type-var]


# ----- HTTP: cancel, limits, Retry-After, phase and ETA -----------------------------------------------


def ledger_events(database_url: str, request_id: str) -> list[str]:
    with db_session(database_url) as session:
        return list(
            session.scalars(
                select(LedgerEntry.event)
                .where(LedgerEntry.request_id == request_id)
                .order_by(LedgerEntry.seq)
            )
        )


def wait_for(predicate: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def pure_reserved_spent(client: Any, dataset_id: str) -> tuple[float, float]:
    pure = get_budget(client, dataset_id)["pure"]
    return pure["reserved"], pure["spent"]


def test_cancel_a_queued_request_charges_nothing_and_a_running_one_its_worst_case(
    database_url: str, tmp_path: Path, gated: GatedCount
) -> None:
    settings = server_settings(
        database_url,
        tmp_path,
        worker_threads=1,
        wait_seconds=0.2,
        heartbeat_seconds=0.05,
        inline_mechanisms={"laplace"},
    )
    with running_server(settings) as server:
        world = make_world(server, {"epsilon": 10.0, "delta": 0.0})
        first = world.request(world.analyst, COUNT, mechanism=gated.name)
        assert first.status_code == 202, first.text
        assert first.headers["Location"] == f"/v1/requests/{first.json()['id']}"
        assert first.headers["Retry-After"].isdigit()
        assert 1 <= int(first.headers["Retry-After"]) <= 10
        assert gated.started.wait(10)
        running_id = first.json()["id"]
        second = world.request(world.analyst, COUNT, mechanism=gated.name)  # the only worker is busy
        assert second.status_code == 202, second.text
        queued_id = second.json()["id"]

        shown = world.analyst.get(f"/v1/requests/{queued_id}")
        assert shown.json()["phase"] == "queued"
        assert shown.json()["queue_position"] == 0
        assert shown.json()["started_at"] is None
        assert "Retry-After" in shown.headers
        wait_for(lambda: (world.analyst.get(f"/v1/requests/{running_id}").json()["progress"] or 0) > 0.05)
        running = world.analyst.get(f"/v1/requests/{running_id}").json()
        assert running["phase"] == "running"
        assert running["started_at"] is not None
        assert running["eta_seconds"] is not None
        assert running["eta_seconds"] > 0
        assert pure_reserved_spent(world.viewer, world.dataset_id) == pytest.approx((0.4, 0.0))

        # who may cancel: not a viewer, not another analyst (it is not theirs to see)
        _, other = world.new_key(Role.analyst)
        assert_problem(world.viewer.post(f"/v1/requests/{queued_id}/cancel"), 403)
        assert_problem(other.post(f"/v1/requests/{queued_id}/cancel"), 404)

        cancelled = world.analyst.post(f"/v1/requests/{queued_id}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        body = cancelled.json()
        assert (body["state"], body["realized"], body["release"]) == ("aborted", None, None)
        assert body["cancelled_by"] == world.analyst_name
        assert body["started_at"] is None
        assert ledger_events(database_url, queued_id) == ["reserve", "abort"]
        assert pure_reserved_spent(world.viewer, world.dataset_id) == pytest.approx((0.2, 0.0))

        stopped = world.analyst.post(f"/v1/requests/{running_id}/cancel")
        assert stopped.status_code == 200, stopped.text
        body = stopped.json()
        assert (body["state"], body["release"]) == ("failed_charged", None)
        assert body["realized"] == body["worst_case"]  # the data was read: the worst case
        assert "cancelled" in body["error"]
        assert ledger_events(database_url, running_id) == ["reserve", "commit"]
        assert gated.stopped.wait(5), "the run did not stop at its next heartbeat"
        slices = gated.slices
        time.sleep(0.3)
        assert gated.slices == slices
        assert pure_reserved_spent(world.viewer, world.dataset_id) == pytest.approx((0.0, 0.2))

        again = world.analyst.post(f"/v1/requests/{running_id}/cancel")  # idempotent
        assert again.status_code == 200
        assert again.json()["state"] == "failed_charged"
        assert pure_reserved_spent(world.viewer, world.dataset_id) == pytest.approx((0.0, 0.2))

        done = world.request(world.analyst, COUNT)  # inline, committed at once
        assert done.status_code == 200, done.text
        late = world.analyst.post(f"/v1/requests/{done.json()['id']}/cancel")
        assert assert_problem(late, 409, "/problems/not-cancellable")["state"] == "committed"

        # an admin may cancel anyone's request
        gated.gate.clear()
        gated.started.clear()
        third = world.request(world.analyst, COUNT, mechanism=gated.name)
        fourth = world.request(world.analyst, COUNT, mechanism=gated.name)
        assert gated.started.wait(10)
        by_admin = world.admin.post(f"/v1/requests/{fourth.json()['id']}/cancel")
        assert by_admin.status_code == 200, by_admin.text
        assert by_admin.json()["state"] == "aborted"
        assert by_admin.json()["cancelled_by"] == world.admin_name
        gated.gate.set()
        wait_for(lambda: world.analyst.get(f"/v1/requests/{third.json()['id']}").json()["state"] != "running")
        final = world.analyst.get(f"/v1/requests/{third.json()['id']}").json()
        assert final["state"] == "committed"
        assert final["progress"] == 1.0
        assert final["eta_seconds"] is None
        assert final["phase"] is None
        assert pure_reserved_spent(world.viewer, world.dataset_id) == pytest.approx((0.0, 0.6))
        with db_session(database_url) as session:
            assert [p for p in verify(session).problems if world.dataset_id in p] == []
            unstarted = session.scalars(
                select(AnalysisRequest).where(
                    AnalysisRequest.dataset_id == world.dataset_id,
                    AnalysisRequest.state == "failed_charged",
                    AnalysisRequest.started_at.is_(None),
                )
            ).all()
        assert unstarted == []  # nothing is ever charged for a run that never started


def test_per_analyst_limits_answer_429_naming_the_limit(
    database_url: str, tmp_path: Path, gated: GatedCount
) -> None:
    settings = server_settings(
        database_url,
        tmp_path,
        worker_threads=2,
        wait_seconds=0.2,
        inline_mechanisms={"laplace"},
        max_running_requests_per_analyst=3,
        max_open_sessions_per_analyst=5,
    )
    with running_server(settings) as server:
        world = make_world(server, {"epsilon": 10.0, "delta": 0.0})
        path = f"/v1/analysts/{world.analyst_name}/limits"
        defaults = world.analyst.get(path)  # an analyst sees its own limits
        assert defaults.status_code == 200, defaults.text
        assert defaults.json() == {
            "analyst": world.analyst_name,
            "max_running_requests": 3,
            "max_open_sessions": 5,
            "running_requests": 0,
            "open_sessions": 0,
            "custom": False,
        }
        other_name, other = world.new_key(Role.analyst)
        assert_problem(other.get(path), 403)
        assert_problem(world.analyst.put(path, json={"max_running_requests": 1}), 403)
        bad = assert_problem(world.admin.put(path, json={"max_running_requests": 0}), 422)
        assert bad["errors"][0]["field"] == "max_running_requests"
        assert_problem(world.admin.put(f"/v1/analysts/nobody-{time.time_ns()}/limits", json={}), 404)
        put = world.admin.put(path, json={"max_running_requests": 1, "max_open_sessions": 1})
        assert put.status_code == 200, put.text
        assert put.json()["custom"] is True

        first = world.request(world.analyst, COUNT, mechanism=gated.name)
        assert first.status_code == 202, first.text
        refused = world.request(world.analyst, COUNT, mechanism=gated.name)
        body = assert_problem(refused, 429, "/problems/limit-exceeded")
        assert (body["limit"], body["max"], body["current"]) == ("max_running_requests", 1, 1)
        assert refused.headers["Retry-After"].isdigit()
        assert world.request(world.analyst, COUNT).status_code == 200  # inline requests are not limited
        granted = world.admin.post(f"/v1/datasets/{world.dataset_id}/grants", json={"analyst": other_name})
        assert granted.status_code == 201
        assert world.request(other, COUNT, mechanism=gated.name).status_code == 202  # per analyst

        session_params = {
            "threshold": 100,
            "epsilon_threshold": 0.1,
            "max_query_epsilon": 0.1,
            "max_queries": 2,
        }
        opened = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={"mechanism": "above_threshold", "params": session_params},
        )
        assert opened.status_code == 201, opened.text
        second = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={"mechanism": "above_threshold", "params": session_params},
        )
        body = assert_problem(second, 429, "/problems/limit-exceeded")
        assert (body["limit"], body["max"]) == ("max_open_sessions", 1)
        in_use = world.admin.get(path).json()
        assert (in_use["running_requests"], in_use["open_sessions"]) == (1, 1)

        # a cancel frees the slot at once; a refused submission charged and reserved nothing
        assert world.analyst.post(f"/v1/requests/{first.json()['id']}/cancel").status_code == 200
        gated.gate.set()
        assert world.request(world.analyst, COUNT, mechanism=gated.name).status_code in (200, 202)
        assert world.analyst.post(f"/v1/sessions/{opened.json()['id']}/close").status_code == 200
        reset = world.admin.put(path, json={"max_running_requests": None, "max_open_sessions": None})
        assert reset.json()["max_running_requests"] == 3
        with db_session(database_url) as session:
            assert [p for p in verify(session).problems if world.dataset_id in p] == []
            flt = FilterRepository(session).get(world.dataset_id)
            assert flt is not None


def test_the_client_and_the_cli_cancel(database_url: str, tmp_path: Path, gated: GatedCount) -> None:
    import json

    from typer.testing import CliRunner

    from expost_client import ConflictError, ExpostClient, LimitExceededError
    from service.cli import app

    settings = server_settings(database_url, tmp_path, worker_threads=1, inline_mechanisms={"laplace"})
    with running_server(settings) as server:  # wait window 20 s: only Prefer: respond-async answers at once
        world = make_world(server, {"epsilon": 10.0, "delta": 0.0})
        key = world.analyst.headers["Authorization"].removeprefix("Bearer ")
        admin_key = world.admin.headers["Authorization"].removeprefix("Bearer ")
        with ExpostClient(server.base_url, key) as client, ExpostClient(server.base_url, admin_key) as admin:
            started = time.monotonic()
            running = client.submit(world.dataset_id, gated.name, COUNT, wait=False)
            assert time.monotonic() - started < 5  # the 202 came at once, not after the wait window
            assert running.state == "running"
            assert gated.started.wait(10)
            queued = client.submit(world.dataset_id, gated.name, COUNT, wait=False)
            assert client.get_request(queued.id).phase == "queued"
            env = {"EXPOST_URL": server.base_url, "EXPOST_KEY": key}
            result = CliRunner().invoke(app, ["request", "cancel", queued.id, "--json"], env=env)
            assert result.exit_code == 0, result.output
            printed = result.stdout[result.stdout.index("{\n") :]  # after the server's own log lines
            assert json.loads(printed[: printed.index("\n}") + 2])["state"] == "aborted"
            stopped = client.cancel(running.id)
            assert (stopped.state, stopped.release) == ("failed_charged", None)
            assert stopped.realized == stopped.worst_case
            assert client.cancel(running.id).state == "failed_charged"  # again: the same answer
            done = client.submit(world.dataset_id, "laplace", COUNT)
            with pytest.raises(ConflictError):
                client.cancel(done.id)
            result = CliRunner().invoke(app, ["request", "cancel", done.id], env=env)
            assert result.exit_code == 2  # a 4xx
            assert "already finished" in result.stderr
            limits = admin.set_limits(world.analyst_name, max_running_requests=1)
            assert (limits.max_running_requests, limits.custom) == (1, True)
            assert client.get_limits(world.analyst_name).max_running_requests == 1
            gated.gate.clear()
            gated.started.clear()
            client.submit(world.dataset_id, gated.name, COUNT, wait=False)
            with pytest.raises(LimitExceededError) as refused:
                client.submit(world.dataset_id, gated.name, COUNT, wait=False)
            assert (refused.value.status, refused.value.limit, refused.value.maximum) == (
                429,
                "max_running_requests",
                1,
            )
            gated.gate.set()
        with db_session(database_url) as session:
            assert [p for p in verify(session).problems if world.dataset_id in p] == []
