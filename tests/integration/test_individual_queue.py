"""Review 37: an individual dataset's releases on the queue executor (``QueueWorker``, real Redis broker)
charge the units' filters (docs/privacy/individual.md#unit-state).

The queue worker settles through ``service.runs.queue.settle_with_retry``, which must hand the run's unit
update to the settlement: a settlement that fails leaves every request running until the reaper charges its
worst case (nothing is ever released), and one that drops the update would release without the units'
debit (the second release below would then count every user again)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.auth import Role
from service.runs.queue import QueueWorker
from tests.conftest import LiveServer, running_server, server_settings
from tests.integration.scale_out_support import REDIS_URL, purge_queue, require_redis

USERS = 200
SCHEMA: dict[str, Any] = {
    "columns": [{"name": "user_id", "type": "int", "min": 0, "max": 100000}],
    "neighboring": "add_remove",
    "privacy_unit": {"column": "user_id", "max_rows": 1},
    "accounting": "individual",
}


@pytest.fixture
def queue_server(database_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    require_redis()
    queue = f"r37{time.time_ns()}"
    settings = server_settings(
        database_url,
        tmp_path,
        executor="queue",
        broker_url=REDIS_URL,
        queue_name=queue,
        wait_seconds=0.2,
        heartbeat_seconds=0.1,
    )
    with running_server(settings) as server:
        yield server
    purge_queue(queue)


def _settled(client: httpx.Client, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while (body := client.get(f"/v1/requests/{request_id}").json())["state"] == "running":
        assert time.monotonic() < deadline, "the queue worker never settled the request"
        time.sleep(0.05)
    return dict(body)


def test_queue_worker_releases_and_charges_each_unit(queue_server: LiveServer) -> None:
    admin = queue_server.client(queue_server.create_key(Role.admin)[1])
    name, key = queue_server.create_key(Role.analyst)
    analyst = queue_server.client(key)
    csv = ("user_id\n" + "\n".join(str(u) for u in range(USERS)) + "\n").encode()
    created = admin.post(
        "/v1/datasets",
        files={"file": ("users.csv", csv, "text/csv")},
        data={"schema": json.dumps(SCHEMA), "name": "users"},
    )
    assert created.status_code == 201, created.text
    dataset_id = created.json()["id"]
    assert admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": name}).status_code == 201
    budget = admin.put(f"/v1/datasets/{dataset_id}/budget", json={"epsilon": 1.0, "delta": 0})
    assert budget.status_code == 200, budget.text
    worker = QueueWorker(queue_server.settings, threads=1)
    worker.start()
    try:
        values = []
        for _ in range(2):  # 2 × ε = 0.6 > every user's budget of 1: the second release leaves all out
            params = {"query": {"kind": "count"}, "epsilon": 0.6}
            submitted = analyst.post(
                f"/v1/datasets/{dataset_id}/requests", json={"mechanism": "laplace", "params": params}
            )
            assert submitted.status_code in (200, 202), submitted.text
            body = _settled(analyst, submitted.json()["id"])
            assert body["state"] == "committed", body
            values.append(body["release"]["value"])
    finally:
        worker.stop()
    assert abs(values[0] - USERS) < 60  # noise scale 1/0.6: |Z| ≥ 60 has probability < 1e-15
    assert abs(values[1]) < 60  # every user was charged 0.6 by the first release
