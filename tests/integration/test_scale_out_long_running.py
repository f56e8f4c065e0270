"""Long-running requests and worker leases, on SQLite and PostgreSQL (docs/privacy/workers.md#workers).

A long-running mechanism's ``progress`` callback is the worker's heartbeat: it renews the request's lease
(so a live run is never reaped) and stores the fraction only when the mechanism says it is public. A run
that stops heart-beating is reaped (worst case committed once) and its late settlement is discarded; a
reaped run stops at its next heartbeat. Workers claim a request with one conditional UPDATE, so of many
workers racing for one request exactly one runs it.

The test mechanisms are Laplace counts (same worst case and realized curve) whose ``run`` first loops
with progress calls; they are registered in the catalog only inside this test process.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import BaseModel
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.base import ProgressFn, PublicContext, Release, Table, no_progress
from mechanisms.catalog import MECHANISMS
from mechanisms.noise import Noise
from mechanisms.queries.laplace import Laplace
from service.auth import Principal, Role, create_key
from service.datasets import TableCache, create_dataset, grant
from service.filter import budget
from service.filter.ledger import verify
from service.runs import admission
from service.runs import worker as runs_worker
from service.store.models import DATASET_SCOPE, AnalysisRequest, LedgerEntry
from service.store.repositories import FilterRepository, RequestRepository
from tests.conftest import running_server, server_settings
from tests.integration.helpers import CSV, SCHEMA, make_world

COUNT = {"query": {"kind": "count"}, "epsilon": 0.2}
EPS_UNITS = 200_000_000_000  # 0.2 in fixed-point units (1e-12)


class SlowCount(Laplace):
    """A Laplace count that first does ``steps`` slices of 'work', calling ``progress`` after each."""

    name: ClassVar[str] = "test.slow_count"
    long_running: ClassVar[bool] = True
    progress_is_public: ClassVar[bool] = True

    def __init__(
        self, steps: int, pause: float, beat: bool = True, gate: threading.Event | None = None
    ) -> None:
        self.steps, self.pause, self.beat, self.gate = steps, pause, beat, gate
        self.done_steps = 0

    def run(
        self,
        params: BaseModel,
        ctx: PublicContext,
        table: Table,
        noise: Noise,
        progress: ProgressFn = no_progress,
    ) -> Release:
        for i in range(self.steps):
            if self.gate is not None and i == 1:
                assert self.gate.wait(30)
            time.sleep(self.pause)
            self.done_steps = i + 1
            if self.beat:
                progress((i + 1) / self.steps)
        return super().run(params, ctx, table, noise)


class SecretSlowCount(SlowCount):
    name: ClassVar[str] = "test.secret_slow_count"
    progress_is_public: ClassVar[bool] = False


@pytest.fixture
def setup(sessions: sessionmaker[Session], tmp_path: Path) -> tuple[str, Principal, TableCache]:
    with sessions() as session, session.begin():
        create_key(session, name := f"analyst-lr-{time.time_ns()}", Role.analyst)
        dataset = create_dataset(session, tmp_path, "d", CSV, SCHEMA, "admin")
        grant(session, dataset, name, "admin")
        budget.set_budget(session, dataset, DATASET_SCOPE, 1.0, 0.0, "admin")
    return dataset.id, Principal(name, Role.analyst), TableCache(tmp_path)


def admit(
    sessions: sessionmaker[Session], setup: tuple[str, Principal, TableCache], mechanism: str, lease: float
) -> str:
    dataset_id, principal, _ = setup
    with sessions() as session:
        validated = admission.validate(session, principal, dataset_id, mechanism, COUNT)
    with sessions() as session:
        request, created = admission.admit(session, principal, validated, None, lease)
    assert created
    return request.id


def row(sessions: sessionmaker[Session], request_id: str) -> AnalysisRequest:
    with sessions() as session:
        found = RequestRepository(session).get(request_id)
        assert found is not None
        return found


def commits(sessions: sessionmaker[Session], request_id: str) -> int:
    with sessions() as session:
        events = session.scalars(select(LedgerEntry.event).where(LedgerEntry.request_id == request_id)).all()
    return sum(event == "commit" for event in events)


def spent_reserved(sessions: sessionmaker[Session], dataset_id: str) -> tuple[int, int]:
    with sessions() as session:
        flt = FilterRepository(session).get(dataset_id)
        assert flt is not None
        return flt.spent["finite"][-1], flt.reserved["finite"][-1]


def in_thread(fn: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)), daemon=True)
    thread.start()
    return thread, out


class TestHeartbeat:
    @pytest.mark.parametrize("mechanism", [SlowCount, SecretSlowCount])
    def test_a_heart_beating_run_outlives_its_lease_and_is_never_reaped(
        self,
        sessions: sessionmaker[Session],
        setup: tuple[str, Principal, TableCache],
        monkeypatch: pytest.MonkeyPatch,
        mechanism: type[SlowCount],
    ) -> None:
        slow = mechanism(steps=30, pause=0.07)  # ~2.1 s of work against a 0.6 s lease
        monkeypatch.setitem(MECHANISMS, slow.name, slow)
        rid = admit(sessions, setup, slow.name, lease=5.0)
        worker, outcome = in_thread(
            runs_worker.run_request, sessions, setup[2], rid, lease_seconds=0.6, heartbeat_seconds=0.15
        )
        samples: list[tuple[float | None, datetime | None, str]] = []
        reaped = 0
        while worker.is_alive():
            reaped += runs_worker.reap_expired(sessions)
            current = row(sessions, rid)
            samples.append((current.progress, current.lease_expires_at, current.state))
            time.sleep(0.05)
        worker.join()
        assert outcome == ["settled"]
        assert reaped == 0
        final = row(sessions, rid)
        assert final.state == "committed"
        assert final.release is not None
        assert final.lease_owner is not None
        assert final.started_at is not None
        assert commits(sessions, rid) == 1
        assert spent_reserved(sessions, setup[0]) == (EPS_UNITS, 0)
        running = [s for s in samples if s[2] == "running"]
        assert len(running) >= 10
        leases = [lease for _, lease, _ in running if lease is not None]
        assert len(set(leases)) >= 4, "the lease was renewed several times"
        progress = [p for p, _, _ in running if p is not None]
        if mechanism.progress_is_public:
            assert len(set(progress)) >= 3
            assert progress == sorted(progress)
            assert all(0 < p <= 1 for p in progress)
        else:
            assert progress == []
            assert final.progress is None
        with sessions() as session:
            assert verify(session).problems == []

    def test_a_silent_run_is_reaped_once_and_its_late_release_discarded(
        self,
        sessions: sessionmaker[Session],
        setup: tuple[str, Principal, TableCache],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        silent = SlowCount(steps=4, pause=0.4, beat=False)  # 1.6 s without a heartbeat, 0.4 s lease
        monkeypatch.setitem(MECHANISMS, silent.name, silent)
        rid = admit(sessions, setup, silent.name, lease=5.0)
        worker, outcome = in_thread(runs_worker.run_request, sessions, setup[2], rid, lease_seconds=0.4)
        reaped = 0
        while worker.is_alive():
            reaped += runs_worker.reap_expired(sessions)
            time.sleep(0.05)
        worker.join()
        assert reaped >= 1
        assert outcome == ["lost"]
        final = row(sessions, rid)
        assert (final.state, final.release) == ("failed_charged", None)
        assert commits(sessions, rid) == 1
        assert spent_reserved(sessions, setup[0]) == (EPS_UNITS, 0)  # the worst case, once
        with sessions() as session:
            assert verify(session).problems == []

    def test_a_reaped_run_stops_at_its_next_heartbeat(
        self,
        sessions: sessionmaker[Session],
        setup: tuple[str, Principal, TableCache],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        gate = threading.Event()
        slow = SlowCount(steps=50, pause=0.01, gate=gate)
        monkeypatch.setitem(MECHANISMS, slow.name, slow)
        rid = admit(sessions, setup, slow.name, lease=5.0)
        worker, outcome = in_thread(
            runs_worker.run_request, sessions, setup[2], rid, lease_seconds=30, heartbeat_seconds=0.0
        )
        deadline = time.monotonic() + 10
        while slow.done_steps < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with sessions() as session, session.begin():  # as if the worker had been silent for too long
            session.execute(
                update(AnalysisRequest)
                .where(AnalysisRequest.id == rid)
                .values(lease_expires_at=datetime.now(UTC) - timedelta(seconds=1))
            )
        assert runs_worker.reap_expired(sessions) >= 1
        gate.set()
        worker.join(30)
        assert outcome == ["lost"]
        assert slow.done_steps < slow.steps  # stopped early: LeaseLost from its heartbeat
        assert row(sessions, rid).state == "failed_charged"
        assert commits(sessions, rid) == 1
        assert spent_reserved(sessions, setup[0]) == (EPS_UNITS, 0)


class TestClaim:
    def test_of_many_workers_racing_for_one_request_exactly_one_runs_it(
        self,
        sessions: sessionmaker[Session],
        setup: tuple[str, Principal, TableCache],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        slow = SlowCount(steps=3, pause=0.05)
        monkeypatch.setitem(MECHANISMS, slow.name, slow)
        rid = admit(sessions, setup, slow.name, lease=30.0)
        barrier = threading.Barrier(6)

        def race() -> str:
            barrier.wait()
            return runs_worker.run_request(sessions, setup[2], rid, lease_seconds=30.0)

        threads = [in_thread(race) for _ in range(6)]
        for thread, _ in threads:
            thread.join(30)
        outcomes = sorted(out[0] for _, out in threads)
        assert outcomes == ["duplicate"] * 5 + ["settled"]
        assert commits(sessions, rid) == 1
        assert spent_reserved(sessions, setup[0]) == (EPS_UNITS, 0)
        # and a later redelivery of the task does nothing either
        assert runs_worker.run_request(sessions, setup[2], rid) == "duplicate"
        assert commits(sessions, rid) == 1

    def test_a_queued_request_is_never_reaped_and_its_lease_starts_at_the_claim(
        self, sessions: sessionmaker[Session], setup: tuple[str, Principal, TableCache]
    ) -> None:
        rid = admit(sessions, setup, "laplace", lease=30.0)
        queued = row(sessions, rid)
        assert (queued.lease_owner, queued.lease_expires_at, queued.started_at) == (None, None, None)
        with sessions() as session, session.begin():  # as if it had waited in the queue for an hour
            session.execute(
                update(AnalysisRequest)
                .where(AnalysisRequest.id == rid)
                .values(created_at=datetime.now(UTC) - timedelta(hours=1))
            )
        assert runs_worker.reap_expired(sessions) == 0  # waiting is not failing: nothing charged
        assert row(sessions, rid).state == "running"
        before = datetime.now(UTC)
        assert runs_worker.run_request(sessions, setup[2], rid, lease_seconds=30.0) == "settled"
        final = row(sessions, rid)
        assert final.state == "committed"
        assert final.started_at is not None
        assert final.started_at >= before
        assert commits(sessions, rid) == 1

    def test_a_queued_request_past_the_queue_timeout_is_aborted_without_charge(
        self, sessions: sessionmaker[Session], setup: tuple[str, Principal, TableCache]
    ) -> None:
        rid = admit(sessions, setup, "laplace", lease=30.0)
        with sessions() as session, session.begin():
            session.execute(
                update(AnalysisRequest)
                .where(AnalysisRequest.id == rid)
                .values(created_at=datetime.now(UTC) - timedelta(seconds=120))
            )
        assert runs_worker.reap_expired(sessions, max_queue_seconds=60) == 0  # none charged
        final = row(sessions, rid)
        assert (final.state, final.realized, final.started_at) == ("aborted", None, None)
        assert "nothing was charged" in (final.error or "")
        assert spent_reserved(sessions, setup[0]) == (0, 0)
        assert not runs_worker.claim(sessions, rid, "late-worker", 30.0)  # and nobody can start it now
        with sessions() as session:
            assert verify(session).problems == []

    def test_a_request_this_worker_cannot_run_is_aborted_unread_and_uncharged(
        self,
        sessions: sessionmaker[Session],
        setup: tuple[str, Principal, TableCache],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        slow = SlowCount(steps=1, pause=0.0)
        monkeypatch.setitem(MECHANISMS, slow.name, slow)
        rid = admit(sessions, setup, slow.name, lease=30.0)
        monkeypatch.delitem(MECHANISMS, slow.name)  # a worker of a version without this mechanism
        assert runs_worker.run_request(sessions, setup[2], rid) == "unrunnable"
        final = row(sessions, rid)
        assert (final.state, final.lease_owner, final.realized) == ("aborted", None, None)
        assert spent_reserved(sessions, setup[0]) == (0, 0)
        with sessions() as session:
            assert verify(session).problems == []


class TestHttp:
    def test_progress_and_elapsed_while_running_and_never_inline(
        self, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        public_gate, secret_gate = threading.Event(), threading.Event()
        public = SlowCount(steps=4, pause=0.05, gate=public_gate)
        secret = SecretSlowCount(steps=4, pause=0.05, gate=secret_gate)
        monkeypatch.setitem(MECHANISMS, public.name, public)
        monkeypatch.setitem(MECHANISMS, secret.name, secret)
        # listed as inline on purpose: a long-running mechanism must still go to the executor
        settings = server_settings(
            database_url,
            tmp_path,
            wait_seconds=0.3,
            heartbeat_seconds=0.0,
            inline_mechanisms={public.name, secret.name, "laplace"},
        )
        with running_server(settings) as server:
            world = make_world(server)
            ids = {}
            for slow in (public, secret):
                started = time.monotonic()
                response = world.request(world.analyst, COUNT, mechanism=slow.name)
                assert time.monotonic() - started < 5
                assert response.status_code == 202, response.text  # blocked on its gate: not inline
                assert response.headers["Location"] == f"/v1/requests/{response.json()['id']}"
                ids[slow.name] = response.json()["id"]
            time.sleep(0.3)
            shown = {name: world.analyst.get(f"/v1/requests/{rid}").json() for name, rid in ids.items()}
            assert shown[public.name]["state"] == "running"
            assert shown[public.name]["progress"] == pytest.approx(0.25)  # one of four steps done
            assert shown[public.name]["elapsed_seconds"] >= 0.3
            assert shown[secret.name]["state"] == "running"
            assert shown[secret.name]["progress"] is None
            assert shown[secret.name]["elapsed_seconds"] >= 0.3
            public_gate.set()
            secret_gate.set()
            for name, rid in ids.items():
                deadline = time.monotonic() + 20
                while (body := world.analyst.get(f"/v1/requests/{rid}").json())["state"] == "running":
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                assert body["state"] == "committed"
                assert body["release"] is not None
                assert body["progress"] == (1.0 if name == public.name else None)
                assert body["started_at"] is not None
                first = body["elapsed_seconds"]
                time.sleep(0.05)
                assert world.analyst.get(f"/v1/requests/{rid}").json()["elapsed_seconds"] == first  # frozen
            # a cheap inline request: still answered at once, with elapsed time and no progress
            cheap = world.request(world.analyst, COUNT)
            assert cheap.status_code == 200, cheap.text
            assert cheap.json()["progress"] is None
            assert cheap.json()["elapsed_seconds"] >= 0
