"""Review of the privacy contract under attack (DESIGN §4–5).

Two kinds of tests:

* ``TestOpenFindings``: bugs demonstrated by a failing assertion, marked ``xfail(strict=True)`` with the
  precise defect in the reason, so the suite stays green while each bug is open and turns red (XPASS) the
  day it is fixed, to remind whoever fixes it to drop the marker.
* ``TestVerifiedProperties``: properties of the contract that were attacked and held; regression tests.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import UNITS_PER_EPSILON
from mechanisms.catalog import INTERACTIVE
from service.auth import Principal, Role, create_key
from service.datasets import TableCache, create_dataset, grant
from service.errors import BudgetExhausted, IdempotencyKeyReused, MechanismFailed, ServiceUnavailable
from service.filter import budget
from service.filter.ledger import verify
from service.logs import configure_logging
from service.runs import admission, settlement, worker, writer
from service.runs import sessions as domain
from service.store.engine import make_engine, make_sessionmaker
from service.store.migrate import upgrade
from service.store.models import DATASET_SCOPE, AnalysisRequest, AnalysisSession, LedgerEntry
from service.store.repositories import FilterRepository, RequestRepository, SessionRepository
from tests.conftest import LiveServer, fresh_postgres_database
from tests.integration.helpers import (
    CSV,
    SCHEMA,
    World,
    assert_problem,
    backdate_session_expiry,
    db_session,
    get_budget,
    ledger_items,
    make_world,
    upload,
)

BIG = {"epsilon": 1000.0, "delta": 0.0}
COUNT = {"query": {"kind": "count"}, "epsilon": 0.1}
# A where value that pydantic accepts (StrictInt is unbounded) but that a float64 column cannot compare with.
BEYOND_FLOAT = 10**400
OVERFLOWING_WHERE = {"kind": "count", "where": [{"column": "age", "op": "lt", "value": BEYOND_FLOAT}]}


# ----- shared helpers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pg_sessions() -> Iterator[sessionmaker[Session]]:
    """A fresh migrated PostgreSQL database (a failure, never a skip, under CI=true)."""
    fresh = fresh_postgres_database()
    upgrade(fresh.url)
    engine = make_engine(fresh.url)
    yield make_sessionmaker(engine)
    engine.dispose()
    fresh.drop()


def world_in_db(
    sessions: sessionmaker[Session],
    data_dir: Path,
    analysts: int = 1,
    epsilon: float = 1.0,
    delta: float = 0.0,
    names: list[str] | None = None,
) -> tuple[str, list[Principal]]:
    """A dataset (the helpers' CSV and schema) with a budget and granted analysts, straight in the database.

    ``names``: grant these existing analyst keys instead of creating new ones.
    """
    with sessions() as session, session.begin():
        dataset = create_dataset(session, data_dir, "review", CSV, SCHEMA, "admin")
        if names is None:
            names = [f"rv-{dataset.id}-{i}" for i in range(analysts)]
            for name in names:
                create_key(session, name, Role.analyst)
        for name in names:
            grant(session, dataset, name, "admin")
        budget.set_budget(session, dataset, DATASET_SCOPE, epsilon, delta, "admin")
    return dataset.id, [Principal(name, Role.analyst) for name in names]


def totals(sessions: sessionmaker[Session], dataset_id: str) -> tuple[int, int]:
    """(spent, reserved) of the dataset filter's pure slot, in units."""
    with sessions() as session:
        flt = FilterRepository(session).get(dataset_id)
        assert flt is not None
        return flt.spent["finite"][-1], flt.reserved["finite"][-1]


def commits_of(sessions: sessionmaker[Session], request_id: str) -> int:
    with sessions() as session:
        return len(
            session.query(LedgerEntry)
            .filter(LedgerEntry.request_id == request_id, LedgerEntry.event == "commit")
            .all()
        )


def add_dataset(world: World, csv: bytes, schema: dict[str, Any], budget_body: dict[str, float]) -> str:
    """Upload ``csv`` with ``schema``, grant the world's analyst and set the budget; returns the id."""
    created = upload(world.admin, csv=csv, schema=schema)
    assert created.status_code == 201, created.text
    dataset_id = str(created.json()["id"])
    granted = world.admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": world.analyst_name})
    assert granted.status_code == 201, granted.text
    assert world.admin.put(f"/v1/datasets/{dataset_id}/budget", json=budget_body).status_code == 200
    return dataset_id


def expect(condition: object, message: str) -> None:
    """The failing check of a finding, reported without a Python traceback (``pytrace=False``).

    Formatting a traceback calls ``ast.parse`` (pytest's failure source, and Python 3.11's own caret
    anchors); on CPython 3.11.7 two threads doing that at once can raise ``SystemError: AST constructor
    recursion depth mismatch``, and a live-server thread logs the 500 these findings provoke while pytest
    reports the failure: that aborted the whole run with an INTERNALERROR.
    """
    if not condition:
        pytest.fail(message, pytrace=False)


def key_of(client: httpx.Client) -> str:
    return str(client.headers["Authorization"].split()[1])


def app_for(sessions: sessionmaker[Session], data_dir: Path) -> Any:
    """What ``service.runs.sessions.ask`` needs of the application context (sessions, table cache, settings)."""
    settings = SimpleNamespace(session_ttl_seconds=3600.0)
    return cast(Any, SimpleNamespace(sessions=sessions, tables=TableCache(data_dir), settings=settings))


def laplace_session(
    sessions: sessionmaker[Session], principal: Principal, dataset_id: str, **overrides: Any
) -> AnalysisSession:
    params = {"threshold": 150.0, "epsilon": 1.0, "max_queries": 10, **overrides}
    with sessions() as session:
        validated = domain.validate_open(session, principal, dataset_id, "above_threshold.laplace", params)
    return domain.open_session(sessions, principal, validated, None, 3600.0)


BELOW = {"query": {"kind": "count", "where": [{"column": "region", "op": "eq", "value": "north"}]}}


# ----- open findings --------------------------------------------------------------------------------------


class TestOpenFindings:
    def test_datasets_sharing_a_file_but_not_bounds_share_one_clipped_table(
        self, live_server: LiveServer
    ) -> None:
        world = make_world(live_server, BIG)
        rows = [100 + secrets.randbelow(900) for _ in range(50)]  # random: a file no other test loaded
        csv = b"x\n" + b"".join(f"{v}\n".encode() for v in rows)
        wide, narrow = (
            {"columns": [{"name": "x", "type": "float", "min": 0, "max": high}], "neighboring": "replace_one"}
            for high in (1e6, 1)
        )
        wide_id, narrow_id = add_dataset(world, csv, wide, BIG), add_dataset(world, csv, narrow, BIG)
        query = {"query": {"kind": "sum", "column": "x"}, "epsilon": 100.0}
        assert world.request(world.analyst, query, dataset_id=wide_id).status_code == 200  # loads the cache
        released = world.request(world.analyst, query, dataset_id=narrow_id)
        assert released.status_code == 200, released.text
        assert released.json()["release"]["noise"]["scale"] < 0.011  # calibrated to Δ = max − min = 1
        # Every value is clipped to [0, 1] on the narrow dataset, so its true sum is at most 50.
        value = released.json()["release"]["value"]
        expect(value <= 50 + 5, f"released {value} with scale 0.01; the unclipped sum is {sum(rows)}")

    def test_an_analyst_recovers_a_hidden_row_from_the_content_hash(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BIG)
        known = [secrets.randbelow(1001) for _ in range(30)]
        prefix = b"income\n" + b"".join(f"{v}\n".encode() for v in known)
        hidden = secrets.randbelow(1001)
        schema = {"columns": [{"name": "income", "type": "int", "min": 0, "max": 1000}],
                  "neighboring": "add_remove"}
        dataset_id = add_dataset(world, prefix + f"{hidden}\n".encode(), schema, BIG)
        published = world.analyst.get(f"/v1/datasets/{dataset_id}").json()["content_sha256"]
        recovered = next(
            (c for c in range(1001) if hashlib.sha256(prefix + f"{c}\n".encode()).hexdigest() == published),
            None,
        )
        expect(recovered is None, f"the analyst recovered the hidden row exactly: {recovered} (was {hidden})")

    def test_a_viewer_reads_the_private_row_count_of_an_add_remove_dataset(
        self, live_server: LiveServer
    ) -> None:
        world = make_world(live_server, BIG, schema={**SCHEMA, "neighboring": "add_remove"})
        assert world.viewer.get(f"/v1/datasets/{world.dataset_id}").json()["n_rows"] is None  # hidden here
        entry = next(e for e in ledger_items(world.viewer, world.dataset_id) if e["event"] == "dataset")
        expect("n_rows" not in entry, f"viewer sees n_rows = {entry.get('n_rows')}")

    def test_bounds_that_could_overflow_a_sum_are_refused_at_upload(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BIG)
        schema = {"columns": [{"name": "x", "type": "float", "min": 0, "max": 1e308}],
                  "neighboring": "add_remove"}
        csv = b"x\n1e308\n1e308\n0\n" + f"{secrets.randbelow(10**9)}\n".encode()
        response = world.admin.post("/v1/datasets", files={"file": ("x.csv", csv, "text/csv")},
                                    data={"schema": json.dumps(schema)})
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

    def test_a_failed_session_step_does_not_write_the_secret_state_to_the_log(
        self, sessions: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        dataset_id, (analyst,) = world_in_db(sessions, tmp_path, epsilon=10.0)
        row = laplace_session(sessions, analyst, dataset_id)
        with sessions() as session:
            secret = SessionRepository(session).secret(row.request_id)
            assert secret is not None
            threshold = json.loads(secret.state)["noisy_threshold_units"]  # grid units (docs/privacy.md §10)
        buffer = io.StringIO()
        configure_logging("INFO", as_json=False, stream=buffer)
        try:
            mechanism = type(INTERACTIVE["above_threshold.laplace"])
            original_step = mechanism.step

            def failing_step(self: Any, params: Any, ctx: Any, state: Any, *rest: Any) -> Any:
                original_step(self, params, ctx, state, *rest)  # reads the data with the secret in scope
                raise RuntimeError(f"step failed near {state}")

            monkeypatch.setattr(mechanism, "step", failing_step)
            with pytest.raises(MechanismFailed):
                domain.ask(app_for(sessions, tmp_path), analyst, row.id, {"query": {"kind": "count"}}, None)
        finally:
            configure_logging("INFO", as_json=False)
        logged = buffer.getvalue()
        assert "session step failed" in logged
        assert repr(threshold) not in logged, f"the secret noisy threshold {threshold!r} is in the log"

    def test_racing_session_opens_with_one_key_on_two_datasets_give_a_422(
        self,
        pg_sessions: sessionmaker[Session],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """PostgreSQL only: SQLite serializes whole transactions (BEGIN IMMEDIATE); the race cannot occur."""
        sessions = pg_sessions
        first_id, (analyst,) = world_in_db(sessions, tmp_path, epsilon=10.0)
        second_id, _ = world_in_db(sessions, tmp_path, epsilon=10.0, names=[analyst.name])
        params = {"threshold": 150.0, "epsilon": 1.0, "max_queries": 10}
        with sessions() as session:
            first = domain.validate_open(session, analyst, first_id, "above_threshold.laplace", params)
            second = domain.validate_open(session, analyst, second_id, "above_threshold.laplace", params)
        inserted, gate = threading.Event(), threading.Event()
        original = SessionRepository.add_secret

        def add_secret_slowly(self: SessionRepository, secret: Any) -> None:
            if threading.current_thread().name == "first":  # its request row is flushed, not committed
                inserted.set()
                gate.wait(20)
            original(self, secret)

        monkeypatch.setattr(SessionRepository, "add_secret", add_secret_slowly)
        outcomes: dict[str, Any] = {}

        def run(name: str, validated: admission.Validated) -> None:
            try:
                outcomes[name] = domain.open_session(sessions, analyst, validated, "one-key", 3600.0)
            except Exception as exc:
                outcomes[name] = exc

        threads = [threading.Thread(target=run, args=(n, v), name=n) for n, v in (("first", first),
                                                                                   ("second", second))]
        threads[0].start()
        assert inserted.wait(20)
        threads[1].start()
        time.sleep(2.0)  # the second now waits on the unique index entry of the first's request row
        gate.set()
        for thread in threads:
            thread.join(30)
        assert isinstance(outcomes["first"], AnalysisSession), outcomes
        expect(isinstance(outcomes["second"], IdempotencyKeyReused), f"the loser got {outcomes['second']!r}")

    def test_an_admission_abandoned_on_timeout_leaves_no_orphan_reservation(
        self, sessions: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        dataset_id, (analyst,) = world_in_db(sessions, tmp_path, epsilon=1.0)
        with sessions() as session:
            validated = admission.validate(session, analyst, dataset_id, "laplace", COUNT)
        original = writer._lock_all

        def slow_lock_all(session: Session, batch: list[writer.Job]) -> writer.Locked:
            time.sleep(1.0)  # a slow database (lock wait, busy SQLite file)
            return original(session, batch)

        monkeypatch.setattr(writer, "_lock_all", slow_lock_all)
        batcher = writer.WriteBatcher(sessions, timeout=0.2)
        try:
            with pytest.raises(ServiceUnavailable):
                batcher.admit(analyst, validated, None, 300.0)
            time.sleep(2.0)  # the writer thread goes on with the abandoned job
        finally:
            batcher.stop()
        with sessions() as session:
            mine = session.query(AnalysisRequest).filter(AnalysisRequest.dataset_id == dataset_id).all()
            orphans = [r.id for r in mine if r.state == "running"]
        expect(totals(sessions, dataset_id) == (0, 0), f"orphaned running requests: {orphans}")


# ----- verified properties --------------------------------------------------------------------------------


class TestVerifiedProperties:
    def test_a_key_reused_by_another_analyst_is_their_own_request(self, live_server: LiveServer) -> None:
        """Idempotency keys are per analyst: another analyst's key never replays (or 422s on) a release."""
        world = make_world(live_server, {"epsilon": 10.0, "delta": 0.0})
        other_name, other = world.new_key(Role.analyst)
        assert world.admin.post(f"/v1/datasets/{world.dataset_id}/grants",
                                json={"analyst": other_name}).status_code == 201
        mine = world.request(world.analyst, COUNT, key="shared-key")
        same = world.request(other, COUNT, key="shared-key")  # same key, same body
        different = world.request(other, {**COUNT, "epsilon": 0.2}, key="other-key")
        reused = world.request(other, {**COUNT, "epsilon": 0.3}, key="shared-key")  # other's own key reused
        assert mine.status_code == same.status_code == different.status_code == 200
        assert mine.json()["id"] != same.json()["id"]
        assert same.json()["analyst"] == other_name
        assert mine.json()["release"] != same.json()["release"]  # fresh noise: not a replay of mine
        assert_problem(reused, 422, "/problems/idempotency-key-reused")
        assert world.analyst.get(f"/v1/requests/{same.json()['id']}").status_code == 404
        assert other.get(f"/v1/requests/{mine.json()['id']}").status_code == 404
        assert world.request(world.analyst, COUNT, key="shared-key").json()["id"] == mine.json()["id"]
        assert math.isclose(get_budget(world.viewer, world.dataset_id)["pure"]["spent"], 0.4)

    def test_concurrent_close_and_ask_on_one_session_commit_exactly_once(
        self, live_server: LiveServer
    ) -> None:
        world = make_world(live_server, {"epsilon": 10.0, "delta": 0.0})
        opened = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={"mechanism": "above_threshold", "params": {
                "threshold": 150, "epsilon_threshold": 1.0, "max_query_epsilon": 0.5, "max_queries": 50}},
        )
        assert opened.status_code == 201, opened.text
        sid, key = opened.json()["id"], key_of(world.analyst)
        barrier = threading.Barrier(16)

        def one(i: int) -> httpx.Response:
            with live_server.client(key) as client:
                barrier.wait()
                if i % 4 == 0:
                    return client.post(f"/v1/sessions/{sid}/close")
                return client.post(f"/v1/sessions/{sid}/queries", json={**BELOW, "epsilon": 0.2},
                                   headers={"Idempotency-Key": f"q{i}"})

        with ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(one, range(16)))
        asks = [r for i, r in enumerate(responses) if i % 4]
        assert all(r.status_code in (200, 409) for r in responses), [r.text for r in responses]
        assert all(r.json()["type"] == "/problems/session-closed" for r in asks if r.status_code == 409)
        final = world.analyst.get(f"/v1/sessions/{sid}").json()
        assert final["state"] == "closed"
        assert final["asked"] == sum(r.status_code == 200 for r in asks)
        commits = [e for e in ledger_items(world.admin, world.dataset_id) if e["event"] == "commit"]
        assert len(commits) == 1
        pure = get_budget(world.viewer, world.dataset_id)["pure"]
        assert pure["reserved"] == 0.0
        assert math.isclose(pure["spent"], final["realized"]["pure"], rel_tol=0, abs_tol=2e-12)

    def test_after_close_a_new_query_is_refused_and_a_retry_is_the_stored_answer(
        self, live_server: LiveServer
    ) -> None:
        world = make_world(live_server, {"epsilon": 10.0, "delta": 0.0})
        opened = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={"mechanism": "above_threshold.dropping", "params": {
                "threshold": 1e9, "epsilon_threshold": 1.0, "max_query_epsilon": 0.5, "max_queries": 10}},
        )
        assert opened.status_code == 201, opened.text
        sid = opened.json()["id"]
        first = world.analyst.post(f"/v1/sessions/{sid}/queries", json={**BELOW, "epsilon": 0.5},
                                   headers={"Idempotency-Key": "q0"})
        assert first.status_code == 200, first.text
        assert world.analyst.post(f"/v1/sessions/{sid}/close").status_code == 200
        spent = get_budget(world.viewer, world.dataset_id)["pure"]["spent"]
        again = world.analyst.post(f"/v1/sessions/{sid}/queries", json={**BELOW, "epsilon": 0.5})
        assert_problem(again, 409, "/problems/session-closed")
        retry = world.analyst.post(f"/v1/sessions/{sid}/queries", json={**BELOW, "epsilon": 0.5},
                                   headers={"Idempotency-Key": "q0"})
        assert retry.status_code == 200
        assert retry.json()["answer"] == first.json()["answer"]
        assert world.analyst.post(f"/v1/sessions/{sid}/close").status_code == 200  # idempotent
        assert get_budget(world.viewer, world.dataset_id)["pure"]["spent"] == spent
        assert world.analyst.get(f"/v1/sessions/{sid}").json()["asked"] == 1

    def test_expiry_racing_steps_and_reapers_charges_the_transcript_once(
        self, sessions: sessionmaker[Session], tmp_path: Path
    ) -> None:
        dataset_id, (analyst,) = world_in_db(sessions, tmp_path, epsilon=10.0)
        app = app_for(sessions, tmp_path)
        row = laplace_session(sessions, analyst, dataset_id)
        answer = domain.ask(app, analyst, row.id, BELOW, "q0")[1]
        assert answer == {"above": False, "index": 0}
        with sessions() as session, session.begin():
            backdate_session_expiry(session, row.id)
        barrier = threading.Barrier(8)

        def one(i: int) -> Any:
            barrier.wait()
            try:
                if i % 2:
                    return domain.expire_sessions(sessions)
                return domain.ask(app, analyst, row.id, BELOW, f"late{i}")
            except Exception as exc:
                return exc

        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(one, range(8)))
        asked = [o for i, o in enumerate(outcomes) if i % 2 == 0]
        assert all(isinstance(o, domain.SessionClosed) for o in asked), asked
        assert sum(o for i, o in enumerate(outcomes) if i % 2) <= 1
        assert commits_of(sessions, row.request_id) == 1
        with sessions() as session:
            closed = SessionRepository(session).get(row.id)
            assert closed is not None
            assert (closed.state, closed.close_reason, len(closed.steps)) == ("closed", "expired", 1)
            assert SessionRepository(session).secret(row.request_id) is None
        # ⊥ of a Laplace AboveThreshold costs ε/2 (padded up by a few ulps), nothing is left reserved.
        spent, reserved = totals(sessions, dataset_id)
        assert reserved == 0
        assert UNITS_PER_EPSILON // 2 <= spent <= UNITS_PER_EPSILON // 2 + 1
        with sessions() as session:
            assert verify(session).problems == []

    def test_reaper_racing_the_writer_settles_each_request_once(
        self, sessions: sessionmaker[Session], tmp_path: Path
    ) -> None:
        dataset_id, principals = world_in_db(sessions, tmp_path, analysts=6, epsilon=1.0)
        batcher = writer.WriteBatcher(sessions)
        try:
            admitted = []
            for principal in principals:
                with sessions() as session:
                    validated = admission.validate(session, principal, dataset_id, "laplace", COUNT)
                admitted.append((batcher.admit(principal, validated, None, 300.0)[0], validated))
            with sessions() as session, session.begin():
                session.execute(
                    update(AnalysisRequest)
                    .where(AnalysisRequest.dataset_id == dataset_id)
                    # claimed by a worker that went silent: the reaper may charge them (queued ones, never)
                    .values(lease_owner="lost", lease_expires_at=datetime.now(UTC) - timedelta(seconds=1))
                )
            barrier = threading.Barrier(len(admitted) + 2)

            def settle(item: tuple[AnalysisRequest, admission.Validated]) -> Any:
                request, validated = item
                barrier.wait()
                ref = settlement.RequestRef.of(request)
                return batcher.settle(ref, validated.worst_case, {"value": 1.0}, None)

            def reap(_: int) -> int:
                barrier.wait()
                return worker.reap_expired(sessions)

            with ThreadPoolExecutor(len(admitted) + 2) as pool:
                settling, reaping = pool.map(settle, admitted), pool.map(reap, range(2))  # all submitted
                settled, reaped = list(settling), sum(reaping)
            # (the live server's own reaper may share this database and win some races, too)
            assert sum(s is not None for s in settled) + reaped <= len(admitted)
            for request, _ in admitted:
                assert commits_of(sessions, request.id) == 1
                with sessions() as session:
                    fresh = RequestRepository(session).get(request.id)
                    assert fresh is not None
                    assert fresh.state in ("committed", "failed_charged")
                    assert (fresh.release is None) == (fresh.state == "failed_charged")
            assert totals(sessions, dataset_id) == (len(admitted) * UNITS_PER_EPSILON // 10, 0)
            with sessions() as session:
                assert verify(session).problems == []
        finally:
            batcher.stop()

    def test_batches_spanning_datasets_admit_exactly_what_each_filter_affords(
        self, sessions: sessionmaker[Session], tmp_path: Path
    ) -> None:
        first, principals = world_in_db(sessions, tmp_path, analysts=15, epsilon=1.0)
        second, _ = world_in_db(sessions, tmp_path, epsilon=1.0, names=[p.name for p in principals])
        jobs = [(p, d) for p in principals for d in (first, second)]
        validated = []
        for principal, dataset_id in jobs:
            with sessions() as session:
                validated.append(admission.validate(session, principal, dataset_id, "laplace", COUNT))
        batcher = writer.WriteBatcher(sessions)
        barrier = threading.Barrier(len(jobs))

        def admit(i: int) -> Any:
            barrier.wait()
            try:
                return batcher.admit(jobs[i][0], validated[i], f"k-{jobs[i][1]}", 300.0)
            except BudgetExhausted as exc:
                return exc

        try:
            with ThreadPoolExecutor(len(jobs)) as pool:
                outcomes = list(pool.map(admit, range(len(jobs))))
        finally:
            batcher.stop()
        for dataset_id in (first, second):
            mine = [o for o, (_, d) in zip(outcomes, jobs, strict=True) if d == dataset_id]
            assert sum(not isinstance(o, BudgetExhausted) for o in mine) == 10
            assert totals(sessions, dataset_id) == (0, UNITS_PER_EPSILON)
        with sessions() as session:
            assert verify(session).problems == []

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
        schema = {"columns": [{"name": "x", "type": "float", "min": 10, "max": 20}],
                  "neighboring": neighboring}
        csv = b"x\n" + b"".join(f"{10 + secrets.randbelow(11)}\n".encode() for _ in range(20))
        dataset_id = add_dataset(world, csv, schema, BIG)
        query: dict[str, Any] = {"kind": "sum", "column": "x"}
        if where:
            query["where"] = [{"column": "x", "op": "ge", "value": 15}]
        released = world.request(world.analyst, {"query": query, "epsilon": 1.0}, dataset_id=dataset_id)
        assert released.status_code == 200, released.text
        release = released.json()["release"]
        # the grid (γ ≤ 2⁻¹⁰·Δ) adds ≤ one unit (and float slack) to the sensitivity: docs/privacy.md §10
        assert scale <= release["noise"]["scale"] <= scale * (1 + 2**-9)
        assert math.fmod(release["value"], release["noise"]["granularity"]) == 0.0
        assert released.json()["realized"]["pure"] == 1.0

    def test_mixed_concurrent_traffic_never_deadlocks_and_the_ledger_verifies(
        self, live_server: LiveServer
    ) -> None:
        """Requests, session steps and closes, reapers and budget changes on one dataset at once: no 5xx
        (PostgreSQL would report a deadlock as one) and the ledger rebuilds the filters exactly."""
        world = make_world(live_server, {"epsilon": 100.0, "delta": 1e-6})
        other_name, other = world.new_key(Role.analyst)
        assert world.admin.post(f"/v1/datasets/{world.dataset_id}/grants",
                                json={"analyst": other_name}).status_code == 201
        keys = [key_of(world.analyst), key_of(other)]
        admin_key = key_of(world.admin)
        opened = [
            world.analyst.post(f"/v1/datasets/{world.dataset_id}/sessions", json={
                "mechanism": "above_threshold", "params": {
                    "threshold": 150, "epsilon_threshold": 1.0, "max_query_epsilon": 0.5, "max_queries": 50}})
            for _ in range(3)
        ]
        sids = [o.json()["id"] for o in opened]

        def one(i: int) -> httpx.Response:
            kind = i % 6
            if kind == 5:
                with live_server.client(admin_key) as client:
                    scope = "budget" if i % 12 == 5 else f"analysts/{other_name}/budget"
                    return client.put(f"/v1/datasets/{world.dataset_id}/{scope}",
                                      json={"epsilon": 100.0 + i, "delta": 1e-6})
            with live_server.client(keys[i % 2]) as client:
                if kind in (0, 1):
                    mechanism = "gaussian" if kind else "laplace"
                    params = {"query": {"kind": "count"}, **({"sigma": 5.0} if kind else {"epsilon": 0.05})}
                    return client.post(f"/v1/datasets/{world.dataset_id}/requests",
                                       json={"mechanism": mechanism, "params": params})
                if kind == 2:
                    return client.post(f"/v1/datasets/{world.dataset_id}/requests",
                                       json={"mechanism": "above_threshold.batch", "params": {
                                           "threshold": 150, "epsilon_threshold": 0.5,
                                           "max_query_epsilon": 0.2, "max_queries": 3,
                                           "queries": [BELOW, BELOW]}})
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

    def test_an_infinite_reservation_is_released_bit_for_bit(self, sessions: sessionmaker[Session],
                                                             tmp_path: Path) -> None:
        """A Gaussian (pure slot +∞) reserved and aborted leaves the totals exactly as before."""
        dataset_id, (analyst,) = world_in_db(sessions, tmp_path, epsilon=1.0, delta=1e-6)
        with sessions() as session:
            validated = admission.validate(session, analyst, dataset_id, "gaussian",
                                          {"query": {"kind": "count"}, "sigma": 10.0})
            before = FilterRepository(session).get(dataset_id)
            assert before is not None
            spent, reserved = dict(before.spent), dict(before.reserved)
        with sessions() as session:
            request, _ = admission.admit(session, analyst, validated, None, 300.0)
        with sessions() as session:
            after = FilterRepository(session).get(dataset_id)
            assert after is not None
            assert after.reserved["infinite"][-1] == 1
        with sessions() as session:
            assert settlement.abort(session, settlement.RequestRef.of(request), "never started")
        with sessions() as session:
            restored = FilterRepository(session).get(dataset_id)
            assert restored is not None
            assert (restored.spent, restored.reserved) == (spent, reserved)
