"""Wide uploads over real HTTP (issue 35, hole 13): a CSV header of 100 000 columns is answered with a clear
problem within a second (the quadratic header check took minutes), and a schema of more than
``MAX_COLUMNS`` columns is a 422 naming ``schema.columns``. Nothing is stored either way."""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import func, select

from mechanisms.data.schema import MAX_COLUMNS
from service.store.models import Dataset
from tests.conftest import LiveServer
from tests.integration.helpers import SCHEMA, assert_problem, db_session, make_world, upload

WIDE = 100_000
BOUND = 1.0  # seconds, measured around the whole HTTP round trip; generous for a loaded machine


def _datasets(url: str) -> int:
    with db_session(url) as session:
        return int(session.scalar(select(func.count()).select_from(Dataset)) or 0)


def _wide_schema(columns: int) -> dict[str, Any]:
    return {
        "columns": [{"name": f"c{i}", "type": "float", "min": 0, "max": 1} for i in range(columns)],
        "neighboring": "replace_one",
    }


def test_a_header_of_100k_columns_is_refused_within_a_second(live_server: LiveServer) -> None:
    world = make_world(live_server)
    before = _datasets(live_server.settings.database_url)
    names = [c["name"] for c in SCHEMA["columns"]] + [f"x{i}" for i in range(WIDE)]
    csv = (",".join(names) + "\n" + ",".join(["1", "1", "north"] + ["0"] * WIDE) + "\n").encode()
    started = time.monotonic()
    response = upload(world.admin, csv=csv)
    elapsed = time.monotonic() - started
    body = assert_problem(response, 422, "/problems/invalid-input")
    assert body["errors"][0]["field"] == "file", body
    assert body["detail"].startswith("file: columns not in the schema: 'x0', 'x1'"), body
    assert body["detail"].endswith(f"and {WIDE - 5} more"), body
    assert elapsed <= BOUND, f"answered in {elapsed:.2f} s"
    assert _datasets(live_server.settings.database_url) == before


def test_a_schema_wider_than_max_columns_is_a_422_naming_schema_columns(live_server: LiveServer) -> None:
    world = make_world(live_server)
    before = _datasets(live_server.settings.database_url)
    for columns in (MAX_COLUMNS + 1, WIDE):
        schema = _wide_schema(columns)
        csv = (
            ",".join(c["name"] for c in schema["columns"]) + "\n" + ",".join(["0"] * columns) + "\n"
        ).encode()
        started = time.monotonic()
        # the wide schema (5 MB of JSON) as a file part: a form field is capped at 1 MB by the form parser
        response = world.admin.post(
            "/v1/datasets",
            files={
                "file": ("data.csv", csv, "text/csv"),
                "schema": ("schema.json", json.dumps(schema).encode(), "application/json"),
            },
        )
        elapsed = time.monotonic() - started
        body = assert_problem(response, 422, "/problems/invalid-input")
        assert body["errors"][0]["field"] == "schema.columns", body
        assert f"at most {MAX_COLUMNS} columns" in body["detail"], body
        assert elapsed <= BOUND, f"{columns} columns: answered in {elapsed:.2f} s"
    assert _datasets(live_server.settings.database_url) == before


def test_a_schema_of_max_columns_is_accepted(live_server: LiveServer) -> None:
    world = make_world(live_server)
    schema = _wide_schema(MAX_COLUMNS)
    csv = (
        ",".join(c["name"] for c in schema["columns"]) + "\n" + ",".join(["0.5"] * MAX_COLUMNS) + "\n"
    ).encode()
    response = upload(world.admin, csv=csv, schema=schema)
    assert response.status_code == 201, response.text
    assert len(response.json()["schema"]["columns"]) == MAX_COLUMNS
