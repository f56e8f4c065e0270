"""Malformed input: a 4xx problem+json naming the field, never a 500, never a partial write."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from service.auth import Role
from service.store.engine import make_engine
from service.store.models import AnalysisRequest, ApiKey, Dataset, Grant, LedgerEntry, PrivacyFilter
from tests.conftest import LiveServer, running_server
from tests.integration.helpers import (
    CSV,
    SCHEMA,
    World,
    assert_problem,
    make_world,
    upload,
)

SMALL_LIMIT = 4096


@dataclass
class Snapshot:
    """Everything a write could touch, read straight from the database (every dataset, not only this one)."""

    filters: list[tuple[Any, ...]]
    ledger: tuple[int, int | None, str | None]
    requests: int
    datasets: list[str]
    grants: list[tuple[str, str]]
    keys: int
    files: list[str]


_ENGINES: dict[str, Engine] = {}


@pytest.fixture(scope="module", autouse=True)
def _dispose_engines() -> Iterator[None]:
    yield
    for engine in _ENGINES.values():
        engine.dispose()
    _ENGINES.clear()


def snapshot(world: World) -> Snapshot:
    url = world.server.settings.database_url
    engine = _ENGINES.setdefault(url, make_engine(url))
    with Session(engine) as session:
        filters = [
            (
                f.dataset_id,
                f.scope,
                f.epsilon,
                f.delta,
                f.capacity,
                f.spent,
                f.reserved,
                f.last_seq,
                f.last_hash,
            )
            for f in session.scalars(select(PrivacyFilter).order_by(PrivacyFilter.id))
        ]
        ledger = session.execute(
            select(func.count(), func.max(LedgerEntry.seq), func.max(LedgerEntry.hash))
        ).one()
        requests = session.scalar(select(func.count()).select_from(AnalysisRequest))
        datasets = list(session.scalars(select(Dataset.id).order_by(Dataset.id)))
        grants = [
            tuple(g) for g in session.execute(select(Grant.dataset_id, Grant.analyst).order_by(Grant.id))
        ]
        keys = session.scalar(select(func.count()).select_from(ApiKey))
    data_dir = Path(world.server.settings.data_dir)
    return Snapshot(
        filters=filters,
        ledger=tuple(ledger),
        requests=int(requests or 0),
        datasets=datasets,
        grants=grants,
        keys=int(keys or 0),
        files=sorted(p.name for p in data_dir.rglob("*")) if data_dir.exists() else [],
    )


def assert_field(problem: dict[str, Any], field: str) -> None:
    """``errors[0].field`` is ``field`` (or starts with it when ``field`` ends with ``*``)."""
    assert problem.get("errors"), problem
    got = problem["errors"][0]["field"]
    if field.endswith("*"):
        assert got.startswith(field[:-1]), (got, field)
    else:
        assert got == field, (got, field)
    assert problem["errors"][0]["reason"]


@pytest.fixture(scope="class")
def world(live_server: LiveServer) -> World:
    return make_world(live_server, {"epsilon": 1.0, "delta": 1e-6})


# ----- analysis requests -----------------------------------------------------------------------------------

COUNT_WITH = '{{"mechanism": "laplace", "params": {{"query": {{"kind": "count"}}, "epsilon": {}}}}}'
GAUSS_WITH = '{{"mechanism": "gaussian", "params": {{"query": {{"kind": "count"}}, "sigma": {}}}}}'


def laplace(query: dict[str, Any], **extra: Any) -> str:
    return json.dumps({"mechanism": "laplace", "params": {"query": query, "epsilon": 0.1, **extra}})


REQUEST_CASES: list[tuple[str, str, str]] = [
    ("epsilon NaN", COUNT_WITH.format("NaN"), "params.epsilon"),
    ("epsilon Infinity", COUNT_WITH.format("Infinity"), "params.epsilon"),
    ("epsilon -Infinity", COUNT_WITH.format("-Infinity"), "params.epsilon"),
    ("epsilon overflows to inf", COUNT_WITH.format("1e999"), "params.epsilon"),
    ("epsilon huge integer", COUNT_WITH.format("1" + "0" * 400), "params.epsilon"),
    ("epsilon negative", COUNT_WITH.format("-0.1"), "params.epsilon"),
    ("epsilon zero", COUNT_WITH.format("0"), "params.epsilon"),
    ("epsilon above the cap", COUNT_WITH.format("101"), "params.epsilon"),
    ("epsilon a string", COUNT_WITH.format('"lots"'), "params.epsilon"),
    ("epsilon null", COUNT_WITH.format("null"), "params.epsilon"),
    ("sigma negative", GAUSS_WITH.format("-1"), "params.sigma"),
    ("sigma zero", GAUSS_WITH.format("0"), "params.sigma"),
    ("sigma NaN", GAUSS_WITH.format("NaN"), "params.sigma"),
    (
        "unknown mechanism",
        '{"mechanism": "laplace2", "params": {"query": {"kind": "count"}, "epsilon": 0.1}}',
        "mechanism",
    ),
    ("unknown column", laplace({"kind": "sum", "column": "height"}), "params.query.column"),
    ("sum on a categorical column", laplace({"kind": "sum", "column": "region"}), "params.query.column"),
    (
        "histogram on a float column without bins",
        laplace({"kind": "histogram", "column": "age"}),
        "params.query.bins",
    ),
    (  # a mean with where is a noisy sum over a noisy count (issue 35 item 9); its column is still checked
        "mean with where of a categorical column",
        laplace({"kind": "mean", "column": "region", "where": [{"column": "age", "op": "gt", "value": 30}]}),
        "params.query.column",
    ),
    (
        "where on an unknown column",
        laplace({"kind": "count", "where": [{"column": "x", "op": "eq", "value": 1}]}),
        "params.query.where.0.column",
    ),
    (
        "where with an undeclared category",
        laplace({"kind": "count", "where": [{"column": "region", "op": "eq", "value": "central"}]}),
        "params.query.where.0.value",
    ),
    (
        "where lt on a categorical column",
        laplace({"kind": "count", "where": [{"column": "region", "op": "lt", "value": "north"}]}),
        "params.query.where.0.op",
    ),
    (
        "where compares a number with a string",
        laplace({"kind": "count", "where": [{"column": "age", "op": "gt", "value": "30"}]}),
        "params.query.where.0.value",
    ),
    (
        "where value NaN",
        '{"mechanism": "laplace", "params": {"query": {"kind": "count", "where": '
        '[{"column": "age", "op": "gt", "value": NaN}]}, "epsilon": 0.1}}',
        "params.query*",
    ),
    ("unknown query kind", laplace({"kind": "median", "column": "age"}), "params.query*"),
    ("extra unknown key in params", laplace({"kind": "count"}, seed=42), "params.seed"),
    ("extra unknown key in the query", laplace({"kind": "count", "noise": 0}), "params.query*"),
    ("missing params", '{"mechanism": "laplace"}', "params"),
    ("missing epsilon", '{"mechanism": "laplace", "params": {"query": {"kind": "count"}}}', "params.epsilon"),
    ("missing query", '{"mechanism": "laplace", "params": {"epsilon": 0.1}}', "params.query"),
    ("params as a list", '{"mechanism": "laplace", "params": [{"query": {"kind": "count"}}, 0.1]}', "params"),
    ("params as a string", '{"mechanism": "laplace", "params": "count"}', "params"),
    (
        "mechanism as a number",
        '{"mechanism": 7, "params": {"query": {"kind": "count"}, "epsilon": 0.1}}',
        "mechanism",
    ),
    (
        "extra top-level key",
        '{"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 0.1}, "priority": 1}',
        "priority",
    ),
    ("body is a list", "[1, 2]", "body"),
]


class TestRequestInput:
    @pytest.mark.parametrize("endpoint", ["requests", "requests:estimate"])
    @pytest.mark.parametrize(("label", "body", "field"), REQUEST_CASES, ids=[c[0] for c in REQUEST_CASES])
    def test_malformed_request(self, world: World, endpoint: str, label: str, body: str, field: str) -> None:
        client = world.analyst
        before = snapshot(world)
        response = client.post(
            f"/v1/datasets/{world.dataset_id}/{endpoint}",
            content=body,
            headers={"Content-Type": "application/json"},
        )
        problem = assert_problem(response, 422, "/problems/invalid-input")
        assert_field(problem, field)
        assert snapshot(world) == before

    def test_malformed_json_is_a_problem_not_a_crash(self, world: World) -> None:
        before = snapshot(world)
        response = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/requests",
            content='{"mechanism": "laplace", "params": ',
            headers={"Content-Type": "application/json"},
        )
        assert_problem(response, 422, "/problems/invalid-input")
        assert snapshot(world) == before

    def test_malformed_json_names_the_body(self, world: World) -> None:
        response = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/requests",
            content='{"mechanism": "laplace", "params": ',
            headers={"Content-Type": "application/json"},
        )
        assert_field(assert_problem(response, 422, "/problems/invalid-input"), "body")

    def test_idempotency_key_longer_than_200_chars(self, world: World) -> None:
        before = snapshot(world)
        response = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/requests",
            json={"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 0.1}},
            headers={"Idempotency-Key": "k" * 201},
        )
        problem = assert_problem(response, 422, "/problems/invalid-input")
        assert "idempotency-key" in problem["errors"][0]["field"].lower(), problem
        assert snapshot(world) == before
        ok = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/requests",
            json={"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 0.01}},
            headers={"Idempotency-Key": "k" * 200},
        )
        assert ok.status_code == 200, ok.text  # exactly 200 characters is accepted


# ----- budgets --------------------------------------------------------------------------------------------

BUDGET_CASES: list[tuple[str, str, str]] = [
    ("delta one", '{"epsilon": 1, "delta": 1}', "delta"),
    ("delta above one", '{"epsilon": 1, "delta": 1.5}', "delta"),
    ("delta negative", '{"epsilon": 1, "delta": -1e-6}', "delta"),
    ("delta NaN", '{"epsilon": 1, "delta": NaN}', "delta"),
    ("epsilon negative", '{"epsilon": -1, "delta": 1e-6}', "epsilon"),
    ("epsilon NaN", '{"epsilon": NaN, "delta": 1e-6}', "epsilon"),
    ("epsilon Infinity", '{"epsilon": Infinity, "delta": 1e-6}', "epsilon"),
    ("epsilon above the cap", '{"epsilon": 1e7, "delta": 1e-6}', "epsilon"),
    ("epsilon a string", '{"epsilon": "one", "delta": 1e-6}', "epsilon"),
    ("missing delta", '{"epsilon": 1}', "delta"),
    ("extra key", '{"epsilon": 1, "delta": 1e-6, "orders": [2, 3]}', "orders"),
]


class TestBudgetInput:
    @pytest.mark.parametrize("scope", ["dataset", "analyst"])
    @pytest.mark.parametrize(("label", "body", "field"), BUDGET_CASES, ids=[c[0] for c in BUDGET_CASES])
    def test_malformed_budget(self, world: World, scope: str, label: str, body: str, field: str) -> None:
        path = f"/v1/datasets/{world.dataset_id}" + (
            "/budget" if scope == "dataset" else f"/analysts/{world.analyst_name}/budget"
        )
        before = snapshot(world)
        response = world.admin.put(path, content=body, headers={"Content-Type": "application/json"})
        assert_field(assert_problem(response, 422, "/problems/invalid-input"), field)
        assert snapshot(world) == before

    def test_a_sub_budget_for_an_ungranted_analyst_is_not_found(self, world: World) -> None:
        stranger, _ = world.new_key(Role.analyst)
        before = snapshot(world)
        response = world.admin.put(
            f"/v1/datasets/{world.dataset_id}/analysts/{stranger}/budget",
            json={"epsilon": 0.5, "delta": 1e-6},
        )
        assert_problem(response, 404, "/problems/not-found")
        assert snapshot(world) == before

    def test_the_analyst_budget_route_cannot_reach_the_dataset_filter(self, live_server: LiveServer) -> None:
        world = make_world(live_server)  # its own world: the bug rewrites the dataset budget
        before = snapshot(world)
        response = world.admin.put(
            f"/v1/datasets/{world.dataset_id}/analysts/*/budget", json={"epsilon": 1000.0, "delta": 0.5}
        )
        assert 400 <= response.status_code < 500, response.text
        assert snapshot(world) == before


# ----- uploads --------------------------------------------------------------------------------------------


@pytest.fixture(scope="class")
def small_server(live_server: LiveServer) -> Iterator[LiveServer]:
    """A second real server on the same database with a small upload limit."""
    settings = live_server.settings.model_copy(update={"max_upload_bytes": SMALL_LIMIT})
    with running_server(settings) as server:
        yield server


def schema_with(**changes: Any) -> str:
    return json.dumps({**SCHEMA, **changes})


def column_0(**changes: Any) -> str:
    columns = [{**SCHEMA["columns"][0], **changes}, *SCHEMA["columns"][1:]]
    return schema_with(columns=columns)


UPLOAD_CASES: list[tuple[str, bytes, str | None, str, str | None]] = [
    # label, csv, schema text (None: omit), field, a word the reason must contain
    ("schema not JSON", CSV, "{columns: [", "schema", "JSON"),
    ("schema a JSON list", CSV, "[1, 2]", "schema", None),
    ("schema min > max", CSV, column_0(min=90, max=18), "schema.columns.0*", "min"),
    ("schema NaN bound", CSV, column_0(min=float("nan")), "schema.columns.0*", None),
    ("schema unknown column type", CSV, column_0(type="decimal"), "schema.columns.0*", None),
    (
        "schema duplicate names",
        CSV,
        schema_with(columns=[SCHEMA["columns"][0], SCHEMA["columns"][0], *SCHEMA["columns"][1:]]),
        "schema",
        "age",
    ),
    (
        "schema without neighboring",
        CSV,
        json.dumps({"columns": SCHEMA["columns"]}),
        "schema.neighboring",
        None,
    ),
    ("schema missing", CSV, None, "schema", None),
    ("CSV with a bad number", CSV.replace(b"\n21,", b"\ntwenty-one,", 1), json.dumps(SCHEMA), "file", "age"),
    ("CSV with NaN", CSV.replace(b"\n21,", b"\nnan,", 1), json.dumps(SCHEMA), "file", "age"),
    ("CSV missing a column", b"age,income\n30,1000\n", json.dumps(SCHEMA), "file", "region"),
    (
        "CSV with an extra column",
        b"age,income,region,zip\n30,1000,north,1\n",
        json.dumps(SCHEMA),
        "file",
        "zip",
    ),
    (
        "CSV with an unknown category",
        CSV.replace(b",east\n", b",central\n", 1),
        json.dumps(SCHEMA),
        "file",
        "region",
    ),
    ("CSV ragged row", b"age,income,region\n30,1000\n", json.dumps(SCHEMA), "file", "row"),
    ("CSV empty", b"", json.dumps(SCHEMA), "file", "empty"),
    ("CSV header only", b"age,income,region\n", json.dumps(SCHEMA), "file", "no data"),
    ("CSV not UTF-8", b"age,income,region\n30,1000,\xff\xfe\n", json.dumps(SCHEMA), "file", "UTF-8"),
]


class TestUploadInput:
    @pytest.mark.parametrize(
        ("label", "csv", "schema", "field", "word"), UPLOAD_CASES, ids=[c[0] for c in UPLOAD_CASES]
    )
    def test_malformed_upload(
        self, world: World, label: str, csv: bytes, schema: str | None, field: str, word: str | None
    ) -> None:
        before = snapshot(world)
        data = {"name": "bad"} if schema is None else {"name": "bad", "schema": schema}
        response = world.admin.post("/v1/datasets", files={"file": ("d.csv", csv, "text/csv")}, data=data)
        problem = assert_problem(response, 422, "/problems/invalid-input")
        assert_field(problem, field)
        if word is not None:
            assert word.lower() in problem["errors"][0]["reason"].lower(), problem
        assert snapshot(world) == before

    def test_missing_file_part(self, world: World) -> None:
        before = snapshot(world)
        response = world.admin.post("/v1/datasets", data={"schema": json.dumps(SCHEMA)})
        assert_field(assert_problem(response, 422, "/problems/invalid-input"), "file")
        assert snapshot(world) == before

    def test_name_too_long(self, world: World) -> None:
        before = snapshot(world)
        response = world.admin.post(
            "/v1/datasets",
            files={"file": ("d.csv", CSV, "text/csv")},
            data={"schema": json.dumps(SCHEMA), "name": "n" * 201},
        )
        assert_field(assert_problem(response, 422, "/problems/invalid-input"), "name")
        assert snapshot(world) == before

    def test_oversized_upload_is_413(self, world: World, small_server: LiveServer) -> None:
        admin_key = world.admin.headers["Authorization"].removeprefix("Bearer ")
        before = snapshot(world)
        big = b"age,income,region\n" + b"30,1000,north\n" * (SMALL_LIMIT // 10)
        assert len(big) > SMALL_LIMIT
        with small_server.client(admin_key) as admin:
            problem = assert_problem(upload(admin, big), 413, "/problems/payload-too-large")
            assert_field(problem, "file")
            assert str(SMALL_LIMIT) in problem["detail"]
            assert snapshot(world) == before
            # the same server takes a file under its limit: it is the size that was refused
            small = b"age,income,region\n" + b"30,1000,north\n" * 10
            accepted = upload(admin, small)
            assert accepted.status_code == 201, accepted.text
            assert accepted.json()["n_rows"] == 10


# ----- ledger, grants, keys -----------------------------------------------------------------------------


class TestQueryAndGrantInput:
    @pytest.mark.parametrize(
        ("params", "field"),
        [
            ({"limit": 0}, "limit"),
            ({"limit": 100000}, "limit"),
            ({"limit": -5}, "limit"),
            ({"limit": "ten"}, "limit"),
            ({"after": -1}, "after"),
            ({"after": "x"}, "after"),
        ],
    )
    def test_bad_ledger_paging(self, world: World, params: dict[str, Any], field: str) -> None:
        response = world.admin.get(f"/v1/datasets/{world.dataset_id}/ledger", params=params)
        problem = assert_problem(response, 422, "/problems/invalid-input")
        assert problem["errors"][0]["field"].split(".")[-1] == field, problem

    def test_ledger_limit_bounds_are_inclusive(self, world: World) -> None:
        for limit in (1, 1000):
            response = world.admin.get(f"/v1/datasets/{world.dataset_id}/ledger", params={"limit": limit})
            assert response.status_code == 200, response.text
            assert 1 <= len(response.json()["items"]) <= limit

    def test_ledger_after_beyond_64_bits_is_not_a_server_error(self, world: World) -> None:
        response = world.admin.get(
            f"/v1/datasets/{world.dataset_id}/ledger", params={"after": 10**20, "limit": 10}
        )
        assert response.status_code in (200, 422), response.text
        if response.status_code == 200:
            assert response.json()["items"] == []
        else:
            assert_problem(response, 422, "/problems/invalid-input")

    @pytest.mark.parametrize(
        ("label", "analyst"),
        [
            ("no such key", "nobody-here"),
            ("empty", ""),
            ("too long", "a" * 101),
        ],
    )
    def test_bad_grant(self, world: World, label: str, analyst: str) -> None:
        before = snapshot(world)
        response = world.admin.post(f"/v1/datasets/{world.dataset_id}/grants", json={"analyst": analyst})
        assert_field(assert_problem(response, 422, "/problems/invalid-input"), "analyst")
        assert snapshot(world) == before

    def test_granting_a_viewer_key_is_refused(self, world: World) -> None:
        viewer_name, _ = world.new_key(Role.viewer)
        before = snapshot(world)
        response = world.admin.post(f"/v1/datasets/{world.dataset_id}/grants", json={"analyst": viewer_name})
        assert_field(assert_problem(response, 422, "/problems/invalid-input"), "analyst")
        assert snapshot(world) == before

    def test_malformed_grant_name_names_the_analyst_field(self, world: World) -> None:
        before = snapshot(world)
        response = world.admin.post(f"/v1/datasets/{world.dataset_id}/grants", json={"analyst": "no such!"})
        problem = assert_problem(response, 422, "/problems/invalid-input")
        assert snapshot(world) == before
        assert_field(problem, "analyst")

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"name": "ok-name", "role": "superuser"}, "role"),
            ({"name": "bad name!", "role": "viewer"}, "name"),
            ({"name": "", "role": "viewer"}, "name"),
            ({"role": "viewer"}, "name"),
        ],
    )
    def test_bad_key(self, world: World, body: dict[str, Any], field: str) -> None:
        before = world.admin.get("/v1/keys").json()
        response = world.admin.post("/v1/keys", json=body)
        assert_field(assert_problem(response, 422, "/problems/invalid-input"), field)
        assert world.admin.get("/v1/keys").json() == before

    def test_duplicate_key_name_is_a_conflict(self, world: World) -> None:
        response = world.admin.post("/v1/keys", json={"name": world.analyst_name, "role": "analyst"})
        assert_problem(response, 409, "/problems/conflict")


class TestSnapshotIsSensitive:
    def test_a_successful_request_changes_the_snapshot(self, live_server: LiveServer) -> None:
        """The no-partial-write check can fail: a real write changes every part it watches."""
        world = make_world(live_server)
        before = snapshot(world)
        assert world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.1}).status_code == 200
        after = snapshot(world)
        assert after.ledger[0] == before.ledger[0] + 2  # reserve + commit
        assert after.filters != before.filters
        assert after.requests == before.requests + 1
        assert (
            world.admin.post(
                "/v1/keys", json={"name": f"k-{world.analyst_name}", "role": "viewer"}
            ).status_code
            == 201
        )
        assert snapshot(world).keys == after.keys + 1
