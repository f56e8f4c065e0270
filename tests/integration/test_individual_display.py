"""Individual accounting is visible wherever a user looks (SQLite and PostgreSQL): the catalog flags the
mechanisms that support it; dataset views, estimates, budget views and refusals say that each unit has its
own budget and that the dataset's totals are a public record, not a budget; the CLI and the Python client
declare it. No response carries any per-unit state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from mechanisms.catalog import WITH_INDIVIDUAL
from service.auth import Role
from tests.conftest import LiveServer
from tests.integration.test_individual_http import SCHEMA, threads_csv

BUDGET = {"epsilon": 1.0, "delta": 0.0}
PLAIN_SCHEMA = {k: v for k, v in SCHEMA.items() if k not in ("privacy_unit", "accounting")}
COUNT = {"query": {"kind": "count"}, "epsilon": 0.9}


def upload(admin: httpx.Client, schema: dict[str, Any], name: str) -> str:
    created = admin.post(
        "/v1/datasets",
        files={"file": ("threads.csv", threads_csv(), "text/csv")},
        data={"schema": json.dumps(schema), "name": name},
    )
    assert created.status_code == 201, created.text
    dataset_id = str(created.json()["id"])
    assert admin.put(f"/v1/datasets/{dataset_id}/budget", json=BUDGET).status_code == 200
    return dataset_id


class World:
    """An admin, a granted analyst, an individual dataset and an ordinary one (the same rows)."""

    def __init__(self, server: LiveServer) -> None:
        self.admin = server.client(server.create_key(Role.admin)[1])
        self.analyst_name, key = server.create_key(Role.analyst)
        self.analyst = server.client(key)
        self.individual = upload(self.admin, SCHEMA, "threads-individual")
        self.plain = upload(self.admin, PLAIN_SCHEMA, "threads-plain")
        for dataset_id in (self.individual, self.plain):
            granted = self.admin.post(
                f"/v1/datasets/{dataset_id}/grants", json={"analyst": self.analyst_name}
            )
            assert granted.status_code == 201, granted.text

    def submit(self, dataset_id: str, params: dict[str, Any]) -> httpx.Response:
        body = {"mechanism": "laplace", "params": params}
        return self.analyst.post(f"/v1/datasets/{dataset_id}/requests", json=body)


@pytest.fixture
def world(live_server: LiveServer) -> World:
    return World(live_server)


def says_individual(body: dict[str, Any]) -> None:
    assert body["accounting"] == "individual", body
    meaning = body["accounting_meaning"]
    assert "each user_id has its own privacy budget" in meaning, meaning
    assert "leaves out every user_id that cannot afford it" in meaning, meaning
    assert "not a budget" in meaning, meaning


def says_dataset(body: dict[str, Any]) -> None:
    assert body["accounting"] == "dataset", body
    assert body["accounting_meaning"] is None, body


def test_the_catalog_flags_the_mechanisms_with_individual_accounting(world: World) -> None:
    catalog = {m["name"]: m for m in world.analyst.get("/v1/mechanisms").json()}
    flagged = {name for name, m in catalog.items() if m["individual_accounting"]}
    assert flagged == WITH_INDIVIDUAL
    assert {"laplace", "gaussian"} <= flagged
    assert any(not m["individual_accounting"] for m in catalog.values() if m["kind"] == "request")
    assert all(m["individual_accounting"] is False for m in catalog.values() if m["kind"] == "session")


def test_dataset_views_say_individual_accounting(world: World) -> None:
    """Listing and one dataset, for the admin and the analyst: the declaration and its meaning."""
    for client in (world.admin, world.analyst):
        listed = {d["id"]: d for d in client.get("/v1/datasets").json()}
        says_individual(listed[world.individual])
        says_dataset(listed[world.plain])
        shown = client.get(f"/v1/datasets/{world.individual}").json()
        says_individual(shown)
        assert shown["schema"]["accounting"] == "individual"


def test_the_dataset_budget_is_marked_not_binding(world: World) -> None:
    """On the individual dataset the dataset's filter is ``binding: false`` (its totals exceed the capacity
    and requests still run), an analyst's sub-budget is binding; the ordinary dataset's filter is binding.
    Both views have the same members: nothing per unit."""
    put = world.admin.put(f"/v1/datasets/{world.individual}/budget", json=BUDGET)
    assert put.status_code == 200, put.text
    assert put.json()["binding"] is False
    says_individual(put.json())
    for thread in (1, 2):  # 2 × 0.9 > 1: the totals pass the capacity, each thread's users are fresh
        released = world.submit(world.individual, {**COUNT, "query": thread_count(thread)})
        assert released.status_code == 200, released.text
    view = world.analyst.get(f"/v1/datasets/{world.individual}/budget")
    assert view.status_code == 200, view.text
    body = view.json()
    assert body["binding"] is False
    says_individual(body)
    assert body["pure"]["spent"] == pytest.approx(1.8)
    assert body["pure"]["spent"] > body["pure"]["capacity"]
    again = world.analyst.get(
        f"/v1/datasets/{world.individual}/budget", headers={"If-None-Match": view.headers["ETag"]}
    )
    assert again.status_code == 304
    plain = world.analyst.get(f"/v1/datasets/{world.plain}/budget").json()
    assert plain["binding"] is True
    says_dataset(plain)
    assert set(body) == set(plain)
    path = f"/v1/datasets/{world.individual}/analysts/{world.analyst_name}/budget"
    assert world.admin.put(path, json={"epsilon": 5.0, "delta": 0.0}).status_code == 200
    own = world.analyst.get(path).json()
    assert own["binding"] is True
    says_individual(own)


def thread_count(thread: int) -> dict[str, Any]:
    return {"kind": "count", "where": [{"column": "thread", "op": "eq", "value": thread}]}


def test_estimates_say_individual_accounting(world: World) -> None:
    path = "/v1/datasets/{}/requests:estimate"
    body = {"mechanism": "laplace", "params": COUNT}
    estimate = world.analyst.post(path.format(world.individual), json=body)
    assert estimate.status_code == 200, estimate.text
    assert estimate.json()["admitted"] is True
    says_individual(estimate.json())
    assert estimate.json()["privacy_unit"]["column"] == "user_id"
    plain = world.analyst.post(path.format(world.plain), json=body)
    assert plain.status_code == 200, plain.text
    says_dataset(plain.json())


def test_a_refusal_says_individual_accounting(world: World) -> None:
    """A worst case above the whole budget: no unit could ever afford it; the 409 says how the dataset is
    accounted. The same refusal on the ordinary dataset carries no accounting members."""
    refused = world.submit(world.individual, {**COUNT, "epsilon": 5.0})
    assert refused.status_code == 409, refused.text
    body = refused.json()
    says_individual(body)
    assert body["privacy_unit"]["column"] == "user_id"
    plain = world.submit(world.plain, {**COUNT, "epsilon": 5.0})
    assert plain.status_code == 409, plain.text
    assert "accounting" not in plain.json()
    assert set(body) - set(plain.json()) == {"accounting", "accounting_meaning", "privacy_unit"}


def run_cli(server: LiveServer, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "EXPOST_DATABASE_URL": server.settings.database_url,
        "EXPOST_DATA_DIR": str(server.settings.data_dir),
        "NO_COLOR": "1",
    }
    return subprocess.run(
        [str(Path(sys.executable).with_name("expost")), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("schema", "extra", "code", "message"),
    [
        (
            PLAIN_SCHEMA,
            ["--unit-column", "user_id", "--unit-max-rows", "1", "--accounting", "individual"],
            0,
            "",
        ),
        (SCHEMA, [], 0, ""),  # declared in the schema file: the flag is not needed
        (PLAIN_SCHEMA, ["--accounting", "individual"], 2, "--unit-column"),
        (PLAIN_SCHEMA, ["--accounting", "personal"], 2, "personal"),
        (
            {**PLAIN_SCHEMA, "neighboring": "replace_one"},
            ["--unit-column", "user_id", "--unit-max-rows", "1", "--accounting", "individual"],
            1,
            "add_remove",
        ),
    ],
)
def test_the_cli_declares_individual_accounting(
    live_server: LiveServer,
    tmp_path: Path,
    schema: dict[str, Any],
    extra: list[str],
    code: int,
    message: str,
) -> None:
    """``expost datasets add … --accounting individual``: stored and shown; refused (nothing stored) without
    a privacy unit, with an unknown value, or with replace_one neighbours."""
    (tmp_path / "threads.csv").write_bytes(threads_csv())
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    admin = live_server.client(live_server.create_key(Role.admin)[1])
    before = len(admin.get("/v1/datasets").json())
    files = ["--file", str(tmp_path / "threads.csv"), "--schema", str(tmp_path / "schema.json")]
    done = run_cli(live_server, "datasets", "add", *files, *extra)
    assert done.returncode == code, done.stderr
    if code:
        assert message in done.stderr, done.stderr
        assert len(admin.get("/v1/datasets").json()) == before
        return
    shown = admin.get(f"/v1/datasets/{done.stdout.strip()}").json()
    assert shown["schema"]["privacy_unit"] == {"column": "user_id", "max_rows": 1}
    says_individual(shown)


def test_the_python_client_declares_and_shows_individual_accounting(live_server: LiveServer) -> None:
    from expost_client import BudgetExhaustedError, ExpostClient, InvalidInputError

    client = ExpostClient(live_server.base_url, live_server.create_key(Role.admin)[1])
    unit = {"column": "user_id", "max_rows": 1}
    dataset = client.upload_dataset(
        threads_csv(), PLAIN_SCHEMA, name="via-client", privacy_unit=unit, accounting="individual"
    )
    assert dataset.accounting == "individual"
    says_individual(client.get_dataset(dataset.id).raw)
    budget = client.set_budget(dataset.id, 1.0, 0.0)
    assert (budget.accounting, budget.binding) == ("individual", False)
    estimate = client.estimate(dataset.id, "laplace", COUNT)
    assert estimate.accounting == "individual"
    says_individual(estimate.raw)
    flagged = {m.name for m in client.mechanisms() if m.individual_accounting}
    assert flagged == WITH_INDIVIDUAL
    before = len(client.list_datasets())
    with pytest.raises(InvalidInputError) as refused:
        client.upload_dataset(threads_csv(), PLAIN_SCHEMA, name="no-unit", accounting="individual")
    assert "privacy_unit" in refused.value.detail + json.dumps(refused.value.errors)
    assert len(client.list_datasets()) == before
    analyst_name, analyst_key = live_server.create_key(Role.analyst)
    client.grant(dataset.id, analyst_name)
    analyst = ExpostClient(live_server.base_url, analyst_key)
    with pytest.raises(BudgetExhaustedError) as over:
        analyst.submit(dataset.id, "laplace", {**COUNT, "epsilon": 5.0})
    assert over.value.accounting == "individual"
    assert "each user_id has its own privacy budget" in over.value.summary()
