"""The queue executor in one process (fast): a real Dramatiq broker on Redis, a real API server thread and a
``QueueWorker`` thread, on SQLite and PostgreSQL; plus what happens when the broker is unreachable, and
rate limits shared by replicas through Redis. The multi-process crash scenarios are in
test_crash_safety.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mechanisms.catalog import MECHANISMS
from service.auth import Role
from service.embedded import free_port
from service.runs.queue import QueueWorker
from tests.conftest import LiveServer, running_server, server_settings
from tests.integration.helpers import assert_problem, get_budget, make_world
from tests.integration.scale_out_support import REDIS_URL, SleepyCount, purge_queue, require_redis

COUNT = {"query": {"kind": "count"}, "epsilon": 0.1}


@pytest.fixture
def queue_server(database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    require_redis()
    monkeypatch.setenv("EXPOST_TEST_SLEEP", "0.6")
    monkeypatch.setitem(MECHANISMS, SleepyCount.name, SleepyCount())
    queue = f"t{time.time_ns()}"
    settings = server_settings(
        database_url,
        tmp_path,
        executor="queue",
        broker_url=REDIS_URL,
        queue_name=queue,
        wait_seconds=0.2,
        heartbeat_seconds=0.1,
        inline_mechanisms={"laplace"},
    )
    with running_server(settings) as server:
        yield server
    purge_queue(queue)


def test_queued_requests_run_on_a_worker_with_progress_and_one_charge(queue_server: LiveServer) -> None:
    world = make_world(queue_server)
    worker = QueueWorker(queue_server.settings, threads=2)
    worker.start()
    try:
        submitted = world.request(world.analyst, COUNT, mechanism=SleepyCount.name)
        assert submitted.status_code == 202, submitted.text
        rid = submitted.json()["id"]
        seen = []
        deadline = time.monotonic() + 30
        while (body := world.analyst.get(f"/v1/requests/{rid}").json())["state"] == "running":
            seen.append(body["progress"])
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert body["state"] == "committed"
        assert body["release"] is not None
        assert body["progress"] == 1.0
        assert any(p is not None and 0 < p < 1 for p in seen), seen  # progress reached the API mid-run
        cheap = world.request(world.analyst, COUNT)  # inline: answered by the API process itself
        assert cheap.status_code == 200, cheap.text
        spent = get_budget(world.viewer, world.dataset_id)["pure"]
        assert spent["spent"] == pytest.approx(0.2, abs=1e-12)
        assert spent["reserved"] == 0
        assert worker.outcomes == {"settled": 1}
    finally:
        worker.stop()


def test_an_unreachable_broker_aborts_the_request_and_charges_nothing(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(MECHANISMS, SleepyCount.name, SleepyCount())
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    settings = server_settings(database_url, tmp_path, executor="queue", broker_url=dead, wait_seconds=1)
    with running_server(settings) as server:
        world = make_world(server)
        refused = world.request(world.analyst, COUNT, mechanism=SleepyCount.name, key="retry-me")
        body = assert_problem(refused, 503)
        assert "retry" in body["detail"]
        budget = get_budget(world.viewer, world.dataset_id)["pure"]
        assert (budget["spent"], budget["reserved"]) == (0, 0)
        # The retry the 503 asks for, same key: admitted afresh (and refused again), never a replay of the
        # aborted request as a 200 without a release.
        retried = world.request(world.analyst, COUNT, mechanism=SleepyCount.name, key="retry-me")
        assert assert_problem(retried, 503)["type"] == "/problems/unavailable"
        assert world.request(world.analyst, COUNT).status_code == 200  # inline mechanisms still work


def test_replicas_share_one_rate_limit_through_redis(database_url: str, tmp_path: Path) -> None:
    require_redis()
    storage = REDIS_URL.rsplit("/", 1)[0] + "/1"
    settings = server_settings(database_url, tmp_path, rate_limit="6/minute", rate_limit_storage=storage)
    with running_server(settings) as one, running_server(settings) as two:
        _, key = one.create_key(Role.viewer)
        statuses = []
        with one.client(key) as a, two.client(key) as b:
            for i in range(7):
                statuses.append((a if i % 2 else b).get("/v1/datasets").status_code)
        assert statuses == [200] * 6 + [429]


def test_a_worker_stops_cleanly_while_idle(database_url: str, tmp_path: Path) -> None:
    require_redis()
    settings = server_settings(
        database_url, tmp_path, executor="queue", broker_url=REDIS_URL, queue_name=f"t{time.time_ns()}"
    )
    worker = QueueWorker(settings, threads=1)
    worker.start()
    stopper = threading.Thread(target=worker.stop)
    started = time.monotonic()
    stopper.start()
    stopper.join(30)
    assert not stopper.is_alive()
    assert time.monotonic() - started < 30
