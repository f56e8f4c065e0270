"""Fair, cancellable execution with real processes, on SQLite and PostgreSQL, with the in-process executor
(``expost serve``) and the queue executor (``expost serve`` + ``expost worker`` on Dramatiq/Redis).

* A flood: analyst A submits many long runs; analyst B's short run is claimed by the next worker that
  frees up (per-analyst round-robin in the database), so it waits at most the remainder of one of A's
  runs (bound checked: B's queue wait ≤ one long run + 1.5 s, where first-come-first-served would make
  it wait four runs). A cancels a queued request (charged 0) and a running one (charged its worst case,
  and its worker frees up at the run's next heartbeat). Nothing is ever charged with ``started_at`` null;
  the books balance (``ledger verify`` clean, one reserve and one commit or abort per request, totals
  equal to the charges).
* SIGTERM to ``expost serve`` / ``expost worker`` with runs in flight: the process exits within the grace
  period + 5 s; a run that finishes within the grace period commits its release; one that does not is
  stopped and charged its worst case (its data was read); a queued request stays queued, uncharged, and
  runs on the next worker.

The test mechanism ``test.steps_count`` (tests/integration/scale_out_support.py) works ``steps`` (a public
parameter) slices of 0.1 s with public progress after each.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from service.store.engine import make_engine, make_sessionmaker
from service.store.models import AnalysisRequest
from tests.integration.scale_out_support import (
    Cluster,
    Proc,
    World,
    assert_books_balance,
    purge_queue,
    require_redis,
    wait_until_settled,
)

pytestmark = pytest.mark.slow

STEP = 0.1  # seconds per step of test.steps_count
LONG_STEPS = 30  # a long run: 3 s
WORKERS = 2  # worker threads, in the API (in-process) or in the one queue worker
QUEUE_WAIT_BOUND = LONG_STEPS * STEP + 1.5  # B waits at most one of A's runs, plus the wake-up and slack


CHEAP_COUNT = {"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 0.01}}


@contextlib.contextmanager
def make_cluster(workdir: Path, database_url: str, executor: str, **settings: str) -> Iterator[Cluster]:
    if executor == "queue":
        require_redis()
    made = Cluster.create(
        workdir,
        database_url,
        executor=executor,
        test_step=str(STEP),
        worker_threads=str(WORKERS),
        wait_seconds="0",
        poll_seconds="0.5",
        heartbeat_seconds="0.2",
        **settings,
    )
    try:
        yield made
    finally:
        made.close()
        purge_queue(made.env["EXPOST_QUEUE_NAME"])


def start(c: Cluster, executor: str) -> tuple[str, list[Proc]]:
    if executor == "queue":
        _, base, workers = c.start(workers=1, threads=WORKERS)
        return base, workers
    _, base = c.api()
    return base, []


def second_analyst(c: Cluster, base: str, world: World) -> httpx.Client:
    admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {c.admin_key}"}, timeout=60)
    with admin:
        made = admin.post("/v1/keys", json={"name": f"b-{time.time_ns()}", "role": "analyst"})
        assert made.status_code == 201, made.text
        for dataset_id in world.dataset_ids:
            granted = admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": made.json()["name"]})
            assert granted.status_code == 201, granted.text
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {made.json()['key']}"}, timeout=60)


def submit(client: httpx.Client, dataset_id: str, steps: int) -> str:
    params = {"query": {"kind": "count"}, "epsilon": 0.01, "steps": steps}
    response = client.post(
        f"/v1/datasets/{dataset_id}/requests", json={"mechanism": "test.steps_count", "params": params}
    )
    assert response.status_code == 202, response.text
    assert response.headers["Retry-After"].isdigit()
    rid: str = response.json()["id"]
    return rid


def rows(database_url: str, dataset_ids: list[str]) -> dict[str, AnalysisRequest]:
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            query = select(AnalysisRequest).where(AnalysisRequest.dataset_id.in_(dataset_ids))
            found = session.scalars(query)
            return {r.id: r for r in found}
    finally:
        engine.dispose()


def wait_rows(
    database_url: str, dataset_ids: list[str], predicate: Any, timeout: float = 30
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        found = rows(database_url, dataset_ids)
        if predicate(found):
            return found
        assert time.monotonic() < deadline, {r.id: (r.state, r.lease_owner) for r in found.values()}
        time.sleep(0.05)


def claimed(found: dict[str, AnalysisRequest], ids: list[str]) -> list[str]:
    return [rid for rid in ids if found[rid].state == "running" and found[rid].lease_owner is not None]


def assert_never_charged_unstarted(found: dict[str, AnalysisRequest]) -> None:
    for r in found.values():
        if r.state in ("committed", "failed_charged"):
            assert r.started_at is not None, (r.id, r.state, r.error)
        if r.state == "aborted":
            assert r.realized is None, (r.id, r.error)
            assert r.started_at is None, (r.id, r.error)


@pytest.mark.parametrize("executor", ["inprocess", "queue"])
def test_a_flood_from_one_analyst_does_not_starve_another(
    database: str, tmp_path: Path, executor: str
) -> None:
    with make_cluster(tmp_path, database, executor) as c:
        base, _ = start(c, executor)
        world = c.setup_world(base)
        ds = world.dataset_id
        with world.client(base) as a, second_analyst(c, base, world) as b:
            flood = [submit(a, ds, LONG_STEPS) for _ in range(4 * WORKERS)]
            wait_rows(c.database_url, [ds], lambda f: len(claimed(f, flood)) == WORKERS)
            submitted = time.monotonic()
            short = submit(b, ds, 1)
            while (body := b.get(f"/v1/requests/{short}").json())["state"] == "running":
                assert time.monotonic() - submitted < 30, body
                time.sleep(0.05)
            answered = time.monotonic() - submitted
            assert body["state"] == "committed", body
            assert body["release"] is not None, body
            found = rows(c.database_url, [ds])
            waited = (found[short].started_at - found[short].created_at).total_seconds()  # type: ignore[operator]
            print(
                f"\n[{executor}] B's short run: queue wait {waited:.2f} s, answered in {answered:.2f} s "
                f"(bound {QUEUE_WAIT_BOUND:.1f} s; FIFO would wait ~{len(flood) // WORKERS} runs)"
            )
            assert waited <= QUEUE_WAIT_BOUND, waited
            assert sum(found[rid].state == "committed" for rid in flood) <= WORKERS  # B overtook the flood

            # A cancels its last queued request (no worker claimed it): aborted, charged nothing
            queued = [rid for rid in flood if found[rid].queued]
            cancelled = a.post(f"/v1/requests/{queued[-1]}/cancel")
            assert cancelled.status_code == 200, cancelled.text
            assert (cancelled.json()["state"], cancelled.json()["realized"]) == ("aborted", None)
            # ... and one that is running: charged its worst case; its worker frees up at the next heartbeat
            running = claimed(rows(c.database_url, [ds]), flood)
            stopped = a.post(f"/v1/requests/{running[0]}/cancel")
            assert stopped.status_code == 200, stopped.text
            assert stopped.json()["state"] == "failed_charged"
            assert stopped.json()["realized"] == stopped.json()["worst_case"]
            before = set(claimed(rows(c.database_url, [ds]), flood))
            wait_rows(c.database_url, [ds], lambda f: set(claimed(f, flood)) - before, timeout=5)
            # the rest of the flood is cancelled: charged nothing if still queued, the worst case if the
            # freed worker claimed it meanwhile (the database decides, under the row lock)
            outcomes: Counter[str] = Counter()
            for rid in queued[:-1]:
                response = a.post(f"/v1/requests/{rid}/cancel")
                assert response.status_code == 200, response.text
                outcomes[response.json()["state"]] += 1
            assert set(outcomes) <= {"aborted", "failed_charged"}, outcomes
        wait_until_settled(c.database_url, world.dataset_ids, 30)
        states = assert_books_balance(c, world.dataset_ids, cli=False)
        final = rows(c.database_url, [ds])
        assert_never_charged_unstarted(final)
        assert final[short].state == "committed"
        assert final[running[0]].state == "failed_charged"
        assert states["failed_charged"] == 1 + outcomes["failed_charged"], states  # cancelled while running
        assert states["aborted"] == 1 + outcomes["aborted"], states  # cancelled while queued
        assert sum(states.values()) == len(flood) + 1


@pytest.mark.parametrize("role", ["serve", "worker"])
def test_sigterm_with_runs_in_flight_exits_within_the_grace_period_and_settles(
    database: str, tmp_path: Path, role: str
) -> None:
    grace = 3.0
    executor = "queue" if role == "worker" else "inprocess"
    settings = {"shutdown_grace_seconds": str(grace), "lease_seconds": "4"}
    with make_cluster(tmp_path, database, executor, **settings) as c:
        api_base, workers = start(c, executor)
        world = c.setup_world(api_base)
        ds = world.dataset_id
        with world.client(api_base) as a:
            finishes = submit(a, ds, 15)  # 1.5 s: ends within the grace period
            too_long = submit(a, ds, 300)  # 30 s: stopped at the end of the grace period
            wait_rows(c.database_url, [ds], lambda f: len(claimed(f, [finishes, too_long])) == 2)
            waiting = submit(a, ds, 2)  # both threads are busy: it stays queued
        victim = workers[0] if role == "worker" else next(p for p in c.procs if p.kind == "api")
        signalled = time.monotonic()
        os.killpg(victim.pid, signal.SIGTERM)
        if role == "serve":  # it goes on answering while its runs finish: new work gets 503, reads work
            time.sleep(0.3)
            with world.client(api_base) as fresh:  # a new connection
                refused = fresh.post(f"/v1/datasets/{ds}/requests", json=CHEAP_COUNT)
                assert refused.status_code == 503, refused.text
                assert refused.headers["content-type"].startswith("application/problem+json")
                assert fresh.get(f"/v1/requests/{finishes}").status_code == 200
                assert fresh.get("/readyz").status_code == 503
        try:
            victim.popen.wait(grace + 5)
        except Exception:
            pytest.fail(f"{role} still alive {grace + 5} s after SIGTERM:\n{victim.text()[-3000:]}")
        exited = time.monotonic() - signalled
        print(f"\n[{role}] exited {exited:.2f} s after SIGTERM (grace {grace} s)")
        assert exited <= grace + 5
        found = rows(c.database_url, [ds])
        assert found[finishes].state == "committed", (found[finishes].state, found[finishes].error)
        assert found[too_long].state == "failed_charged"
        assert found[too_long].realized == found[too_long].worst_case
        assert "shutdown" in (found[too_long].error or "")
        assert found[waiting].state == "running"
        assert found[waiting].lease_owner is None
        assert found[waiting].realized is None
        # the next process runs what was left in the queue
        if role == "worker":
            c.worker(threads=1)
        else:
            c.api()
        wait_until_settled(c.database_url, world.dataset_ids, 30)
        states = assert_books_balance(c, world.dataset_ids, cli=False)
        assert states == Counter({"committed": 2, "failed_charged": 1}), states
        assert_never_charged_unstarted(rows(c.database_url, [ds]))


@pytest.mark.parametrize("executor", ["inprocess", "queue"])
def test_an_analyst_never_holds_more_workers_than_its_share(
    database: str, tmp_path: Path, executor: str
) -> None:
    """Issue 35 item 14: with a cap of one running request per analyst, a flood from analyst A keeps one
    of the two worker threads, and analyst B's request starts at once on the other."""
    with make_cluster(tmp_path, database, executor, max_claimed_per_analyst="1") as c:
        base, _ = start(c, executor)
        world = c.setup_world(base)
        ds = world.dataset_id
        with world.client(base) as a, second_analyst(c, base, world) as b:
            flood = [submit(a, ds, LONG_STEPS) for _ in range(2 * WORKERS)]
            wait_rows(c.database_url, [ds], lambda f: len(claimed(f, flood)) == 1)
            deadline = time.monotonic() + 2 * STEP * 10  # a free thread would have claimed by now
            while time.monotonic() < deadline:
                assert len(claimed(rows(c.database_url, [ds]), flood)) == 1  # the other thread stays free
                time.sleep(0.1)
            short = submit(b, ds, 1)
            found = wait_rows(c.database_url, [ds], lambda f: f[short].state == "committed", timeout=30)
            waited = (found[short].started_at - found[short].created_at).total_seconds()  # type: ignore[operator]
            assert waited < LONG_STEPS * STEP / 2, waited  # not behind the remainder of A's run
            for rid in flood:
                a.post(f"/v1/requests/{rid}/cancel")
        wait_until_settled(c.database_url, world.dataset_ids, 30)
        assert_books_balance(c, world.dataset_ids, cli=False)
