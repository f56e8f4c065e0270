"""Crash safety with real processes (docs/privacy/workers.md#workers): the budget stays exact through
duplicate wake-up deliveries, workers racing for one request, kill -9 of a worker mid-run, kill -9 of the API
during a burst, and a PostgreSQL restart during a burst.

Every scenario runs real ``expost serve`` and ``expost worker --queue`` processes (Dramatiq on Redis) and
ends with :func:`assert_books_balance`: ``expost ledger verify`` is clean, no request is left running or
reserved, each request has exactly one reserve and one commit (or abort), every committed request has its
release and every failed one none, and each filter's spent total equals the sum of its requests' charges
(realized for released outputs, the worst case for lost runs). The database restart uses a private
throw-away PostgreSQL cluster (initdb + pg_ctl on a free port), never the shared server.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError

from service.store.engine import make_engine, make_sessionmaker
from service.store.models import AnalysisRequest
from tests.integration.scale_out_support import (
    COUNT,
    Cluster,
    Proc,
    assert_books_balance,
    cluster,
    private_postgres,
    wait_until_settled,
)

pytestmark = pytest.mark.slow

TASK_DONE = re.compile(r"task done .*outcome=(\w+).*request_id=(rq_\w+)")


def outcomes(*workers: Proc) -> list[tuple[str, str]]:
    return [(m[1], m[2]) for w in workers for m in TASK_DONE.finditer(w.text())]


def wait_for_tasks(workers: tuple[Proc, ...], count: int, timeout: float = 30) -> list[tuple[str, str]]:
    deadline = time.monotonic() + timeout
    while len(done := outcomes(*workers)) < count:
        assert time.monotonic() < deadline, (len(done), count)
        time.sleep(0.1)
    return done


def wait_for_queue_drained(c: Cluster, timeout: float = 15) -> None:
    """Until the cluster's Dramatiq queue holds no message (each wake-up was consumed), plus a moment
    for the last ones to be handled."""
    import redis

    from tests.integration.scale_out_support import REDIS_URL

    client = redis.Redis.from_url(REDIS_URL)
    queue = c.env["EXPOST_QUEUE_NAME"]
    deadline = time.monotonic() + timeout
    while client.llen(f"expost-tasks:{queue}") or client.hlen(f"expost-tasks:{queue}.msgs"):
        assert time.monotonic() < deadline, "wake-ups left in the queue"
        time.sleep(0.1)
    time.sleep(1.0)


def send_duplicates(c: Cluster, request_ids: list[str], times: int) -> None:
    """Deliver each request id ``times`` more times, as a broker redelivery or a retry would."""
    from service.runs.queue import declare_actor, make_broker

    broker = make_broker(c.env["EXPOST_BROKER_URL"])
    actor = declare_actor(broker, c.env["EXPOST_QUEUE_NAME"], lambda rid: None)
    try:
        for _ in range(times):
            for rid in request_ids:
                actor.send(rid)
    finally:
        broker.close()


def submit(client: httpx.Client, dataset_id: str, mechanism: str) -> dict[str, Any]:
    body = {"mechanism": mechanism, "params": COUNT}
    response = client.post(f"/v1/datasets/{dataset_id}/requests", json=body)
    assert response.status_code in (200, 202), response.text
    body: dict[str, Any] = response.json()
    return body


def rows(c: Cluster, dataset_ids: list[str]) -> list[AnalysisRequest]:
    engine = make_engine(c.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            return list(
                session.scalars(select(AnalysisRequest).where(AnalysisRequest.dataset_id.in_(dataset_ids)))
            )
    finally:
        engine.dispose()


def test_duplicate_deliveries_run_and_charge_each_request_once(database: str, tmp_path: Path) -> None:
    with cluster(tmp_path, database, test_sleep="0.2") as c:
        _, base, started = c.start(workers=2, threads=2)
        workers = tuple(started)
        world = c.setup_world(base)
        with world.client(base) as client:
            ids = [submit(client, world.dataset_id, "test.sleepy_count")["id"] for _ in range(5)]
        send_duplicates(c, ids, times=2)  # 15 wake-ups for 5 requests, some while the first runs
        wait_until_settled(c.database_url, world.dataset_ids, 30)
        wait_for_tasks(workers, 5)
        wait_for_queue_drained(c)  # every duplicate wake-up was consumed (and found nothing to run)
        done = outcomes(*workers)
        per_request = Counter(rid for outcome, rid in done if outcome == "settled")
        assert per_request == Counter(dict.fromkeys(ids, 1)), done
        assert Counter(outcome for outcome, _ in done) == Counter({"settled": 5})
        states = assert_books_balance(c, world.dataset_ids)
        assert states == Counter({"committed": 5})


def test_two_workers_racing_for_one_request_run_it_once(database: str, tmp_path: Path) -> None:
    with cluster(tmp_path, database, test_sleep="0.3") as c:
        _, base, started = c.start(workers=2, threads=2)  # 4 idle threads on two processes
        workers = tuple(started)
        world = c.setup_world(base)
        ids = []
        with world.client(base) as client:
            for _ in range(4):
                # the API's delivery and three more at once: every idle thread races for the claim
                rid = submit(client, world.dataset_id, "test.sleepy_count")["id"]
                send_duplicates(c, [rid], times=3)
                ids.append(rid)
        wait_until_settled(c.database_url, world.dataset_ids, 30)
        wait_for_tasks(workers, 4)
        wait_for_queue_drained(c)
        done = outcomes(*workers)
        assert Counter(rid for outcome, rid in done if outcome == "settled") == Counter(dict.fromkeys(ids, 1))
        assert Counter(outcome for outcome, _ in done) == Counter({"settled": 4}), done
        assert assert_books_balance(c, world.dataset_ids) == Counter({"committed": 4})


def test_kill_9_of_a_worker_mid_run_charges_its_worst_case_once(database: str, tmp_path: Path) -> None:
    with cluster(tmp_path, database, lease_seconds="2", test_sleep="3") as c:
        _, base, (victim, survivor) = c.start(workers=2)
        world = c.setup_world(base)
        with world.client(base) as client:
            ids = [submit(client, world.dataset_id, "test.sleepy_count")["id"] for _ in range(2)]
            deadline = time.monotonic() + 20
            while True:  # both claimed and heart-beating (progress > 0), one per worker
                running = [r for r in rows(c, world.dataset_ids) if r.progress]
                if len(running) == 2:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.05)
            owners = {r.id: r.lease_owner or "" for r in running}
            victim_ids = [rid for rid, owner in owners.items() if f":{victim.pid}:" in owner]
            assert len(victim_ids) == 1, owners
            victim.kill9()
            wait_until_settled(c.database_url, world.dataset_ids, 30)
            final = {r.id: r for r in rows(c, world.dataset_ids)}
            assert final[victim_ids[0]].state == "failed_charged"
            assert final[victim_ids[0]].release is None
            (other,) = set(ids) - set(victim_ids)
            assert final[other].state == "committed"
            # the service goes on with the surviving worker
            after = submit(client, world.dataset_id, "laplace")
        wait_until_settled(c.database_url, world.dataset_ids, 30)
        states = assert_books_balance(c, world.dataset_ids)
        assert states == Counter({"committed": 2, "failed_charged": 1}), after
        assert survivor.alive()


async def burst(
    base: str,
    key: str,
    dataset_id: str,
    total: int,
    concurrency: int,
    mechanisms: list[str],
    stop: threading.Event | None = None,
) -> Counter[str]:
    """``total`` requests with ``concurrency`` in flight; returns status codes and transport errors."""
    seen: Counter[str] = Counter()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)
    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=httpx.Timeout(15.0)
    ) as client:

        async def one() -> None:
            while not queue.empty() and not (stop is not None and stop.is_set()):
                i = queue.get_nowait()
                body = {"mechanism": mechanisms[i % len(mechanisms)], "params": COUNT}
                try:
                    response = await client.post(f"/v1/datasets/{dataset_id}/requests", json=body)
                    seen[str(response.status_code)] += 1
                except httpx.TransportError as exc:
                    seen["transport-error"] += 1
                    seen[type(exc).__name__] += 1
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return seen


def test_kill_9_of_the_api_during_a_burst_loses_no_charge(database: str, tmp_path: Path) -> None:
    with cluster(
        tmp_path, database, lease_seconds="2", inline_mechanisms='["laplace"]', test_sleep="0.2"
    ) as c:
        api, base, _ = c.start(workers=1, threads=2)  # the worker's reaper settles what the API left
        world = c.setup_world(base)
        seen: Counter[str] = Counter()

        def run() -> None:
            seen.update(
                asyncio.run(
                    burst(
                        base,
                        world.analyst_key,
                        world.dataset_id,
                        400,
                        24,
                        ["laplace", "laplace", "laplace", "test.sleepy_count"],
                    )
                )
            )

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 30
        while len(rows(c, world.dataset_ids)) < 40:  # well into the burst
            assert time.monotonic() < deadline
            time.sleep(0.02)
        api.kill9()
        thread.join(60)
        assert seen["transport-error"] > 0, seen  # the burst really was cut
        assert seen["200"] + seen["202"] > 0, seen
        wait_until_settled(c.database_url, world.dataset_ids, 30)
        # a new API process serves on the same database
        _, base2 = c.api()
        with world.client(base2) as client:
            assert submit(client, world.dataset_id, "laplace")["state"] == "committed"
        wait_until_settled(c.database_url, world.dataset_ids, 30)
        states = assert_books_balance(c, world.dataset_ids)
        assert states["committed"] >= seen["200"] + 1, (states, seen)


def wait_for_commits(c: Cluster, dataset_ids: list[str], at_least: int, timeout: float = 60) -> Counter[str]:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(DBAPIError):  # the database may be restarting
            states = Counter(r.state for r in rows(c, dataset_ids))
            if states["committed"] >= at_least:
                return states
        assert time.monotonic() < deadline, f"fewer than {at_least} commits after {timeout} s"
        time.sleep(0.1)


@pytest.mark.postgres
def test_a_postgres_restart_during_a_burst_loses_no_charge(tmp_path: Path) -> None:
    with (
        private_postgres() as pg,
        cluster(
            tmp_path,
            pg.url,
            lease_seconds="3",
            pool_size="4",
            inline_mechanisms='["laplace"]',
            test_busy="0.02",
        ) as c,
    ):
        _, base, _ = c.start(workers=1, threads=2)
        world = c.setup_world(base)
        stop = threading.Event()
        seen: Counter[str] = Counter()

        def run() -> None:
            seen.update(
                asyncio.run(
                    burst(
                        base,
                        world.analyst_key,
                        world.dataset_id,
                        100_000,
                        8,
                        ["laplace", "laplace", "test.busy_count"],
                        stop,
                    )
                )
            )

        thread = threading.Thread(target=run)
        thread.start()
        before = wait_for_commits(c, world.dataset_ids, 20)
        pg.restart()  # immediate shutdown (like a crash: recovery on start) and start again
        restarted = time.monotonic()
        wait_for_commits(c, world.dataset_ids, before["committed"] + 20)  # it serves again
        stop.set()
        thread.join(60)
        # the outage was felt, and the service degraded to retryable 503s: no 500, no dropped connection
        assert seen["503"] > 0, seen
        assert set(seen) <= {"200", "202", "503"}, seen
        assert before["committed"] > 0, before
        wait_until_settled(c.database_url, world.dataset_ids, 60)
        states = assert_books_balance(c, world.dataset_ids)
        assert states["committed"] > before["committed"], (before, states)  # it served after the restart
        assert time.monotonic() - restarted < 120
