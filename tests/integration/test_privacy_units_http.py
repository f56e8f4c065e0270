"""Privacy units over real HTTP (SQLite and PostgreSQL): a dataset declares its unit, every release bounds
each unit's rows, mechanisms without a unit analysis are refused with a 422 before anything is reserved, and
bad declarations are refused with nothing stored (docs/privacy.md §15)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from service.auth import Role
from tests.conftest import LiveServer
from tests.integration.helpers import BIG

K = 3
USERS = 40
ROWS_PER_USER = [1 + (u * 7) % 12 for u in range(USERS)]  # 1..12 rows: many above the bound
SCHEMA: dict[str, Any] = {
    "columns": [
        {"name": "user_id", "type": "int", "min": 0, "max": 100000},
        {"name": "amount", "type": "float", "min": 0, "max": 50},
        {"name": "kind", "type": "categorical", "values": ["a", "b"]},
    ],
    "neighboring": "add_remove",
    "privacy_unit": {"column": "user_id", "max_rows": K},
}


def events_csv() -> bytes:
    lines = ["user_id,amount,kind"]
    for user, count in enumerate(ROWS_PER_USER):
        lines += [f"{1000 + user},{(user + i) % 50}.5,{'ab'[i % 2]}" for i in range(count)]
    return ("\n".join(lines) + "\n").encode()


def upload(admin: httpx.Client, schema: dict[str, Any]) -> httpx.Response:
    return admin.post(
        "/v1/datasets",
        files={"file": ("events.csv", events_csv(), "text/csv")},
        data={"schema": json.dumps(schema), "name": "events"},
    )


@pytest.fixture
def world(live_server: LiveServer) -> tuple[httpx.Client, httpx.Client, str]:
    admin = live_server.client(live_server.create_key(Role.admin)[1])
    name, key = live_server.create_key(Role.analyst)
    created = upload(admin, SCHEMA)
    assert created.status_code == 201, created.text
    dataset_id = created.json()["id"]
    assert admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": name}).status_code == 201
    assert admin.put(f"/v1/datasets/{dataset_id}/budget", json=BIG).status_code == 200
    return admin, live_server.client(key), dataset_id


def submit(client: httpx.Client, dataset_id: str, mechanism: str, params: dict[str, Any]) -> httpx.Response:
    return client.post(f"/v1/datasets/{dataset_id}/requests", json={"mechanism": mechanism, "params": params})


def test_a_unit_dataset_bounds_every_release(world: tuple[httpx.Client, httpx.Client, str]) -> None:
    _admin, analyst, dataset_id = world
    shown = analyst.get(f"/v1/datasets/{dataset_id}").json()
    assert shown["schema"]["privacy_unit"] == {"column": "user_id", "max_rows": K}
    assert shown["n_rows"] is None  # a unit dataset's row count is private
    released = submit(analyst, dataset_id, "laplace", {"query": {"kind": "count"}, "epsilon": 100.0})
    assert released.status_code == 200, released.text
    bounded = sum(min(c, K) for c in ROWS_PER_USER)
    assert abs(released.json()["release"]["value"] - bounded) <= 1  # noise scale K/100
    assert sum(ROWS_PER_USER) - bounded > 50  # the bounding really dropped rows
    charged = released.json()["realized"]
    assert charged["pure"] == pytest.approx(100.0)


@pytest.mark.parametrize(
    ("mechanism", "params", "field"),
    [
        (
            "dp_gd",
            {
                "features": ["amount"],
                "label": "kind",
                "model": "logistic",
                "steps": 5,
                "clip": 1.0,
                "target_epsilon": 1.0,
                "target_delta": 1e-6,
                "n_hint": 100,
            },
            "mechanism",
        ),
        ("laplace", {"query": {"kind": "sum", "column": "user_id"}, "epsilon": 1.0}, "params.query.column"),
        ("laplace", {"query": {"kind": "mean", "column": "amount"}, "epsilon": 1.0}, "params.query.kind"),
    ],
)
def test_what_has_no_unit_analysis_is_refused_before_any_reservation(
    world: tuple[httpx.Client, httpx.Client, str], mechanism: str, params: dict[str, Any], field: str
) -> None:
    admin, analyst, dataset_id = world
    before = admin.get(f"/v1/datasets/{dataset_id}/budget").json()
    refused = submit(analyst, dataset_id, mechanism, params)
    assert refused.status_code == 422, refused.text
    assert refused.headers["content-type"].startswith("application/problem+json")
    assert any(e["field"].startswith(field) for e in refused.json()["errors"]), refused.text
    after = admin.get(f"/v1/datasets/{dataset_id}/budget").json()
    assert after["epsilon_spent"] == before["epsilon_spent"]


@pytest.mark.parametrize(
    ("unit", "reason"),
    [
        ({"column": "nobody", "max_rows": 3}, "no column named"),
        ({"column": "amount", "max_rows": 3}, "float column"),
        ({"column": "user_id", "max_rows": 0}, "greater than or equal to 1"),
    ],
)
def test_bad_declarations_are_refused_and_nothing_is_stored(
    live_server: LiveServer, unit: dict[str, Any], reason: str
) -> None:
    admin = live_server.client(live_server.create_key(Role.admin)[1])
    before = len(admin.get("/v1/datasets").json())
    refused = upload(admin, {**SCHEMA, "privacy_unit": unit})
    assert refused.status_code == 422, refused.text
    assert reason in refused.text
    assert any(e["field"].startswith("schema") for e in refused.json()["errors"]), refused.text
    assert len(admin.get("/v1/datasets").json()) == before
