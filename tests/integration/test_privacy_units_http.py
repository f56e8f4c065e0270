"""Privacy units over real HTTP (SQLite and PostgreSQL): a dataset declares its unit, every release bounds
each unit's rows, mechanisms without a unit analysis are refused with a 422 before anything is reserved, and
bad declarations are refused with nothing stored (docs/privacy/units.md#units)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
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
            "objpert.logistic",
            {"features": ["amount"], "label": "kind", "regularization": 1.0, "sigma": 1.0, "max_rows": 1000},
            "mechanism",
        ),
        ("laplace", {"query": {"kind": "sum", "column": "user_id"}, "epsilon": 1.0}, "params.query.column"),
        # a mean on a unit dataset is a noisy sum over a noisy count (issue 35 item 9), but not of the unit
        ("laplace", {"query": {"kind": "mean", "column": "user_id"}, "epsilon": 1.0}, "params.query.column"),
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


DP_GD = {
    "features": ["amount"],
    "label": "kind",
    "model": "logistic",
    "steps": 5,
    "clip": 1.0,
    "target_epsilon": 1.0,
    "target_delta": 1e-6,
    "n_hint": 100,
}


def test_dp_gd_clips_per_unit_and_charges_its_curve(world: tuple[httpx.Client, httpx.Client, str]) -> None:
    """User-level DP-GD (docs/privacy/units_learners.md#theorem-dpgd-unit): admitted on a unit dataset, the
    release says what a unit is and the bound in force, and the charge is the estimate's worst case."""
    admin, analyst, dataset_id = world
    renyi = admin.put(f"/v1/datasets/{dataset_id}/budget", json={"epsilon": 1000.0, "delta": 1e-6})
    assert renyi.status_code == 200, renyi.text
    estimate = analyst.post(
        f"/v1/datasets/{dataset_id}/requests:estimate", json={"mechanism": "dp_gd", "params": DP_GD}
    )
    assert estimate.status_code == 200, estimate.text
    released = submit(analyst, dataset_id, "dp_gd", DP_GD)
    assert released.status_code in (200, 202), released.text
    body = released.json()
    deadline = time.monotonic() + 60
    while body["state"] in ("reserved", "running") and time.monotonic() < deadline:
        time.sleep(0.2)
        body = analyst.get(f"/v1/requests/{body['id']}").json()
    assert body["state"] == "committed", body
    unit = body["release"]["privacy_unit"]
    assert unit["column"] == "user_id"
    assert unit["max_rows"] == K
    assert body["realized"]["values"] == estimate.json()["worst_case"]["values"]
    spent = admin.get(f"/v1/datasets/{dataset_id}/budget").json()["epsilon_spent"]
    assert spent > 0


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"features": ["user_id"]}, "params.features"),
        ({"clipping": "adaptive"}, "params.clipping"),
        ({"n_hint": None}, "params.n_hint"),
    ],
)
def test_dp_gd_refusals_on_a_unit_dataset_name_the_field(
    world: tuple[httpx.Client, httpx.Client, str], changes: dict[str, Any], field: str
) -> None:
    admin, analyst, dataset_id = world
    before = admin.get(f"/v1/datasets/{dataset_id}/budget").json()
    refused = submit(analyst, dataset_id, "dp_gd", {**DP_GD, **changes})
    assert refused.status_code == 422, refused.text
    assert any(e["field"].startswith(field) for e in refused.json()["errors"]), refused.text
    after = admin.get(f"/v1/datasets/{dataset_id}/budget").json()
    assert after["epsilon_spent"] == before["epsilon_spent"]


def test_estimate_runs_the_submit_checks_and_shows_the_unit(
    world: tuple[httpx.Client, httpx.Client, str],
) -> None:
    """``:estimate`` refuses what a submission refuses (a mechanism without a unit analysis: 422 naming
    ``mechanism``), and on a unit dataset says what a unit is and the bound in force."""
    _admin, analyst, dataset_id = world
    path = f"/v1/datasets/{dataset_id}/requests:estimate"
    objpert = {"features": ["amount"], "label": "kind", "regularization": 1.0, "sigma": 1.0, "max_rows": 1000}
    refused = analyst.post(path, json={"mechanism": "objpert.logistic", "params": objpert})
    assert refused.status_code == 422, refused.text
    assert any(e["field"] == "mechanism" for e in refused.json()["errors"]), refused.text
    assert f"at most {K}" in refused.json()["detail"]
    estimate = analyst.post(
        path, json={"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 1.0}}
    )
    assert estimate.status_code == 200, estimate.text
    unit = estimate.json()["privacy_unit"]
    assert (unit["column"], unit["max_rows"]) == ("user_id", K)
    assert "with all its rows" in unit["meaning"]
    translated = analyst.post(
        f"/v1/datasets/{dataset_id}/sql:translate",
        json={"sql": "SELECT COUNT(DISTINCT user_id) FROM dataset", "epsilon": 1.0},
    )
    assert translated.status_code == 200, translated.text


def test_the_catalog_says_which_mechanisms_support_units(
    world: tuple[httpx.Client, httpx.Client, str],
) -> None:
    _admin, analyst, _dataset_id = world
    catalog = {m["name"]: m for m in analyst.get("/v1/mechanisms").json()}
    assert catalog["dp_gd"]["privacy_units"] is True
    assert catalog["laplace"]["privacy_units"] is True
    assert catalog["objpert.logistic"]["privacy_units"] is False


def test_sql_counts_distinct_units(world: tuple[httpx.Client, httpx.Client, str]) -> None:
    """``COUNT(DISTINCT user_id)``: the number of people (40), charged one unit's move (ε), and refused for
    any other column (422 naming the measure's column, nothing charged)."""
    admin, analyst, dataset_id = world
    answered = analyst.post(
        f"/v1/datasets/{dataset_id}/sql",
        json={"sql": "SELECT COUNT(DISTINCT user_id), COUNT(*) FROM dataset", "epsilon": 100.0},
    )
    assert answered.status_code == 200, answered.text
    values = answered.json()["release"]["values"]
    assert abs(values["count_distinct(user_id)"] - USERS) <= 1  # scale 2/100 per block
    assert answered.json()["realized"]["pure"] == pytest.approx(100.0)
    before = admin.get(f"/v1/datasets/{dataset_id}/budget").json()
    refused = analyst.post(
        f"/v1/datasets/{dataset_id}/sql",
        json={"sql": "SELECT COUNT(DISTINCT kind) FROM dataset", "epsilon": 1.0},
    )
    assert refused.status_code == 422, refused.text
    assert any(e["field"].startswith("params.measures.0.column") for e in refused.json()["errors"]), (
        refused.text
    )
    assert admin.get(f"/v1/datasets/{dataset_id}/budget").json()["epsilon_spent"] == before["epsilon_spent"]


@pytest.mark.parametrize(
    ("unit", "field"),
    [
        ({"column": "nobody", "max_rows": 3}, "schema"),
        ({"column": "user_id", "max_rows": 0}, "schema.privacy_unit.max_rows"),
    ],
)
def test_bad_declarations_are_refused_at_registration_too(
    live_server: LiveServer, unit: dict[str, Any], field: str
) -> None:
    """Registration by reference validates the declaration before it reads the source (here a path that
    does not exist): a 422 naming the schema field, and no dataset."""
    admin = live_server.client(live_server.create_key(Role.admin)[1])
    before = len(admin.get("/v1/datasets").json())
    body = {
        "name": "by-reference",
        "schema": {**SCHEMA, "privacy_unit": unit},
        "source": {"kind": "parquet", "path": "/nonexistent/events.parquet"},
    }
    refused = admin.post("/v1/datasets/register", json=body)
    assert refused.status_code == 422, refused.text
    assert any(e["field"].startswith(field) for e in refused.json()["errors"]), refused.text
    assert len(admin.get("/v1/datasets").json()) == before


def test_the_python_client_declares_the_unit(live_server: LiveServer) -> None:
    from expost_client import ExpostClient

    client = ExpostClient(live_server.base_url, live_server.create_key(Role.admin)[1])
    schema = {k: v for k, v in SCHEMA.items() if k != "privacy_unit"}
    dataset = client.upload_dataset(
        events_csv(), schema, name="via-client", privacy_unit={"column": "user_id", "max_rows": 2}
    )
    shown = client.get_dataset(dataset.id)
    assert shown.schema_["privacy_unit"] == {"column": "user_id", "max_rows": 2}


@pytest.mark.parametrize(("max_rows", "code"), [("2", 0), ("0", 1)])
def test_the_cli_declares_the_unit(live_server: LiveServer, tmp_path: Path, max_rows: str, code: int) -> None:
    """``expost datasets add --unit-column user_id --unit-max-rows k``: the dataset protects each user_id;
    a bad declaration (k = 0) is refused naming the field, and nothing is stored."""
    (tmp_path / "events.csv").write_bytes(events_csv())
    (tmp_path / "schema.json").write_text(
        json.dumps({k: v for k, v in SCHEMA.items() if k != "privacy_unit"})
    )
    admin = live_server.client(live_server.create_key(Role.admin)[1])
    before = len(admin.get("/v1/datasets").json())
    env = {
        **os.environ,
        "EXPOST_DATABASE_URL": live_server.settings.database_url,
        "EXPOST_DATA_DIR": str(live_server.settings.data_dir),
        "NO_COLOR": "1",
    }
    args = [
        "datasets",
        "add",
        "--file",
        str(tmp_path / "events.csv"),
        "--schema",
        str(tmp_path / "schema.json"),
    ]
    args += ["--unit-column", "user_id", "--unit-max-rows", max_rows]
    done = subprocess.run(
        [str(Path(sys.executable).with_name("expost")), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == code, done.stderr
    if code:
        assert "privacy_unit.max_rows" in done.stderr, done.stderr
        assert len(admin.get("/v1/datasets").json()) == before
        return
    shown = admin.get(f"/v1/datasets/{done.stdout.strip()}").json()
    assert shown["schema"]["privacy_unit"] == {"column": "user_id", "max_rows": 2}


def test_a_refusal_on_a_unit_dataset_says_what_epsilon_protects(
    world: tuple[httpx.Client, httpx.Client, str],
) -> None:
    """A 409 over the budget names the unit and its bound beside requested vs remaining (issue 36, item 4)."""
    admin, analyst, dataset_id = world
    assert (
        admin.put(f"/v1/datasets/{dataset_id}/budget", json={"epsilon": 1.0, "delta": 0.0}).status_code == 200
    )
    refused = submit(analyst, dataset_id, "laplace", {"query": {"kind": "count"}, "epsilon": 5.0})
    assert refused.status_code == 409, refused.text
    unit = refused.json()["privacy_unit"]
    assert (unit["column"], unit["max_rows"]) == ("user_id", K)
    assert "with all its rows" in unit["meaning"]
