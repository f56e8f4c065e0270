"""Individual accounting of noise reduction and grouped measures over real HTTP (SQLite and PostgreSQL): a
release charges each unit from its own rows, and a unit that cannot afford the next release is left out of
it (docs/privacy/individual.md#individual-noise-reduction-proof,
docs/privacy/individual.md#individual-measures-proof)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.auth import Role
from service.store.migrate import upgrade
from tests.conftest import LiveServer, running_server, server_settings
from tests.integration.test_individual_http import ledger_verify

THREADS = ("t1", "t2", "t3", "t4")
USERS_PER_THREAD = 50
SCHEMA: dict[str, Any] = {
    "columns": [
        {"name": "user_id", "type": "int", "min": 0, "max": 100000},
        {"name": "thread", "type": "categorical", "values": list(THREADS)},
    ],
    "neighboring": "add_remove",
    "privacy_unit": {"column": "user_id", "max_rows": 1},
    "accounting": "individual",
}


def threads_csv() -> bytes:
    lines = ["user_id,thread"]
    lines += [f"{t * 1000 + u},{name}" for t, name in enumerate(THREADS) for u in range(USERS_PER_THREAD)]
    return ("\n".join(lines) + "\n").encode()


def threads_world(server: LiveServer, epsilon: float, delta: float) -> tuple[httpx.Client, str]:
    """(analyst, dataset id): the threads dataset with a budget of (ε, δ)."""
    admin = server.client(server.create_key(Role.admin)[1])
    name, key = server.create_key(Role.analyst)
    created = admin.post(
        "/v1/datasets",
        files={"file": ("threads.csv", threads_csv(), "text/csv")},
        data={"schema": json.dumps(SCHEMA), "name": "threads"},
    )
    assert created.status_code == 201, created.text
    dataset_id = created.json()["id"]
    assert admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": name}).status_code == 201
    budget = admin.put(f"/v1/datasets/{dataset_id}/budget", json={"epsilon": epsilon, "delta": delta})
    assert budget.status_code == 200, budget.text
    return server.client(key), dataset_id


@pytest.fixture
def world(live_server: LiveServer) -> tuple[httpx.Client, str]:
    return threads_world(live_server, 1.0, 0.0)


def release(client: httpx.Client, dataset_id: str, mechanism: str, params: dict[str, Any]) -> dict[str, Any]:
    response = client.post(
        f"/v1/datasets/{dataset_id}/requests", json={"mechanism": mechanism, "params": params}
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()["release"]
    return result


def test_accuracy_first_laplace_charges_each_thread_its_own_users(world: tuple[httpx.Client, str]) -> None:
    analyst, dataset_id = world

    def count(thread: str) -> dict[str, Any]:
        query = {"kind": "count", "where": [{"column": "thread", "op": "eq", "value": thread}]}
        params = {"query": query, "epsilons": [0.3, 0.9], "target": {"absolute": 40.0, "confidence": 0.5}}
        return release(analyst, dataset_id, "accuracy_first.laplace", params)

    first = count("t1")  # a fixed level (public): ε = 0.3 meets the target, each t1 user pays ≤ 0.3
    assert first["level"] == 0
    assert abs(first["value"] - USERS_PER_THREAD) < 40
    for thread in THREADS:  # 0.3 + 0.3 + 0.3 ≤ 1 for t1's users; 0.3 for the others
        assert abs(count(thread)["value"] - USERS_PER_THREAD) < 40
    third = count("t1")
    assert abs(third["value"] - USERS_PER_THREAD) < 40
    left_out = count("t1")  # 4 × 0.3 > 1: every t1 user is left out, the count is noise around 0
    assert abs(left_out["value"]) < 40
    assert abs(count("t2")["value"] - USERS_PER_THREAD) < 40  # t2's users still have room


def test_grouped_measures_leave_out_the_units_that_spent_their_budget(
    world: tuple[httpx.Client, str],
) -> None:
    analyst, dataset_id = world
    params = {"measures": [{"kind": "count"}], "group_by": ["thread"], "epsilon": 0.6}
    first = release(analyst, dataset_id, "measures.laplace", params)
    assert [group["thread"] for group in (g["key"] for g in first["groups"])] == list(THREADS)
    assert all(abs(group["count"] - USERS_PER_THREAD) < 40 for group in first["groups"])
    second = release(analyst, dataset_id, "measures.laplace", params)  # 0.6 + 0.6 > 1: everyone left out
    assert all(abs(group["count"]) < 40 for group in second["groups"])
    where = [{"column": "thread", "op": "eq", "value": "t1"}]
    small = release(analyst, dataset_id, "measures.laplace", {**params, "epsilon": 0.3, "where": where})
    counts = {group["key"]["thread"]: group["count"] for group in small["groups"]}
    assert abs(counts["t1"] - USERS_PER_THREAD) < 40  # 0.6 + 0.3 ≤ 1: t1's users fit once more


def test_ledger_verify_replays_the_families_units(database: str, tmp_path: Path) -> None:
    """The stored unit filters equal the replay of every committed release: noise reduction at the level
    each release stopped at (read from its stored output), measures at their fixed charge."""
    upgrade(database)
    data_dir = tmp_path / "data"
    with running_server(server_settings(database, data_dir)) as server:
        analyst, dataset_id = threads_world(server, 4.0, 1e-6)
        query = {"kind": "count", "where": [{"column": "thread", "op": "eq", "value": "t1"}]}
        levels = []
        for _ in range(3):  # a relative target: the level each walk stops at is random (ε = 0.2 usually)
            stopped = release(
                analyst,
                dataset_id,
                "accuracy_first.laplace",
                {"query": query, "epsilons": [0.05, 0.1, 0.2, 0.4], "target": {"relative": 0.3}},
            )
            levels.append(stopped["level"])
        assert min(levels) < 3  # a stop before the last level: its units paid less than their worst case
        gaussian = {"query": query, "variances": [400.0, 100.0, 50.0], "target": {"relative": 0.3}}
        release(analyst, dataset_id, "accuracy_first.gaussian", gaussian)
        private = {"epsilon_a": 0.1, "threshold": 0.0}
        nr_private = {"query": query, "epsilons": [0.1, 0.3], "target": {"relative": 0.3}}
        release(
            analyst,
            dataset_id,
            "accuracy_first.laplace",
            {**nr_private, "check": "private", "private": private},
        )
        grouped = {"measures": [{"kind": "count"}], "group_by": ["thread"]}
        release(analyst, dataset_id, "measures.laplace", {**grouped, "epsilon": 0.3})
        release(analyst, dataset_id, "measures.gaussian", {**grouped, "noise_multiplier": 10.0})
        code, out = ledger_verify(database, data_dir)
        assert code == 0, out
        assert "MISMATCH" not in out
        assert "UNCHECKED" not in out
        assert "ok" in out
