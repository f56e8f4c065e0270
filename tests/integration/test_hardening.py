"""Hostile input found by hand: every case a 4xx problem+json naming the field and the reason, never a 500,
never a write. Also the two confirmations around budgets and the ledger a viewer sees.

Each case checks the status, the problem type, the named field, and that nothing was written (the database
rows and the data directory, straight from the test process).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from service.auth import Role
from service.store.engine import make_engine
from service.store.models import (
    AnalysisRequest,
    AnalysisSession,
    ApiKey,
    Dataset,
    Grant,
    LedgerEntry,
    PrivacyFilter,
)
from tests.conftest import LiveServer
from tests.integration.helpers import CSV, SCHEMA, World, assert_problem, ledger_items, make_world

INVALID = "/problems/invalid-input"
COUNT = {"query": {"kind": "count"}, "epsilon": 0.01}
ROW = b"\n21,"  # the start of the CSV's second data row (age 21)

_ENGINES: dict[str, Engine] = {}


@pytest.fixture(scope="module", autouse=True)
def _dispose_engines() -> Iterator[None]:
    yield
    for engine in _ENGINES.values():
        engine.dispose()
    _ENGINES.clear()


@dataclass(frozen=True)
class Written:
    """Everything a write could change, on every dataset of the database, and the stored files."""

    rows: tuple[Any, ...]
    files: tuple[str, ...]


def written(world: World) -> Written:
    url = world.server.settings.database_url
    engine = _ENGINES.setdefault(url, make_engine(url))
    with Session(engine) as session:

        def stats(model: Any, *columns: Any) -> tuple[Any, ...]:
            return tuple(session.execute(select(func.count(), *columns).select_from(model)).one())

        filters = tuple(
            (
                f.dataset_id,
                f.scope,
                f.epsilon,
                f.delta,
                json.dumps(f.capacity),
                json.dumps(f.spent),
                json.dumps(f.reserved),
                f.last_seq,
            )
            for f in session.scalars(select(PrivacyFilter).order_by(PrivacyFilter.id))
        )
        rows = (
            stats(ApiKey, func.max(ApiKey.id)),
            stats(Dataset),
            stats(Grant, func.max(Grant.id)),
            stats(LedgerEntry),
            stats(AnalysisRequest, func.max(AnalysisRequest.updated_at)),
            stats(AnalysisSession, func.max(AnalysisSession.updated_at)),
            filters,
        )
    data_dir = Path(world.server.settings.data_dir)
    return Written(rows, tuple(sorted(p.name for p in data_dir.rglob("*"))))


def assert_names(problem: dict[str, Any], field: str, word: str | None = None) -> str:
    """The problem's first error names ``field`` (and its reason contains ``word``); returns the reason."""
    assert problem.get("errors"), problem
    first = problem["errors"][0]
    assert first["field"] == field, (first, field)
    assert first["reason"], problem
    if word is not None:
        assert word.lower() in first["reason"].lower(), problem
    assert field in problem["detail"], problem
    return str(first["reason"])


@pytest.fixture(scope="class")
def world(live_server: LiveServer) -> World:
    return make_world(live_server, {"epsilon": 1000.0, "delta": 1e-6})


def upload(world: World, csv: bytes, schema: str) -> httpx.Response:
    return world.admin.post(
        "/v1/datasets", files={"file": ("d.csv", csv, "text/csv")}, data={"schema": schema, "name": "hostile"}
    )


# ----- JSON that the decoder cannot take ------------------------------------------------------------------

DIGITS = sys.get_int_max_str_digits() + 700  # beyond Python's int max str digits (4300 by default)
DEEP = 100_000  # far beyond the recursion limit of json.loads

BAD_JSON: list[tuple[str, bytes, str]] = [
    # label, body, a word of the reason
    ("nested too deeply", b"[" * DEEP + b"]" * DEEP, "nested"),
    ("nested objects too deeply", b'{"a":' * DEEP + b"1" + b"}" * DEEP, "nested"),
    ("an integer of 5000 digits", b'{"epsilon": ' + b"1" * DIGITS + b', "delta": 0}', "digits"),
    ("invalid UTF-8", b'{"epsilon": 1, "delta": 0, "x\xff": 1}', "UTF-8"),
]


def json_operations(world: World) -> list[tuple[str, str]]:
    """(method, path) of every operation in the OpenAPI document that takes a JSON body."""
    document = world.admin.get("/openapi.json").json()
    return [
        (method.upper(), path)
        for path, item in document["paths"].items()
        for method, operation in item.items()
        if "application/json" in operation.get("requestBody", {}).get("content", {})
    ]


class TestUndecodableJson:
    @pytest.mark.parametrize(
        ("label", "schema", "word"),
        [
            ("nested too deeply", "[" * DEEP + "]" * DEEP, "nested"),
            (
                "nested objects too deeply",
                '{"columns": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}",
                "nested",
            ),
            (
                "an integer of 5000 digits",
                '{"columns": [{"name": "age", "type": "int", "min": 0, "max": ' + "9" * DIGITS + "}], "
                '"neighboring": "replace_one"}',
                "digits",
            ),
        ],
    )
    def test_a_schema_upload_json_decodes_or_names_the_schema(
        self, world: World, label: str, schema: str, word: str
    ) -> None:
        before = written(world)
        problem = assert_problem(upload(world, CSV, schema), 422, INVALID)
        assert_names(problem, "schema", word)
        assert written(world) == before

    def test_a_schema_with_a_nul_character_names_the_value(self, world: World) -> None:
        columns = [*SCHEMA["columns"][:2], {**SCHEMA["columns"][2], "values": ["north", "so\x00uth"]}]
        before = written(world)
        response = upload(world, CSV, json.dumps({**SCHEMA, "columns": columns}))
        assert_names(assert_problem(response, 422, INVALID), "schema.columns.2.values.1", "NUL")
        assert written(world) == before

    @pytest.mark.parametrize(("label", "body", "word"), BAD_JSON, ids=[c[0] for c in BAD_JSON])
    def test_every_json_endpoint_names_the_body(
        self, world: World, label: str, body: bytes, word: str
    ) -> None:
        opened = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={
                "mechanism": "above_threshold",
                "params": {
                    "threshold": 10**9,
                    "epsilon_threshold": 0.01,
                    "max_query_epsilon": 0.01,
                    "max_queries": 5,
                },
            },
        )
        assert opened.status_code == 201, opened.text
        released = world.request(world.analyst, COUNT)
        assert released.status_code == 200, released.text
        ids = {
            "{dataset_id}": world.dataset_id,
            "{analyst}": world.analyst_name,
            "{session_id}": opened.json()["id"],
            "{request_id}": released.json()["id"],
        }
        operations = json_operations(world)
        assert ("PUT", "/v1/datasets/{dataset_id}/budget") in operations
        assert ("POST", "/v1/datasets/{dataset_id}/requests") in operations
        assert ("POST", "/v1/sessions/{session_id}/queries") in operations
        for method, template in operations:
            path = template
            for name, value in ids.items():
                path = path.replace(name, value)
            for client in (world.admin, world.analyst):
                before = written(world)
                response = client.request(
                    method, path, content=body, headers={"Content-Type": "application/json"}
                )
                problem = assert_problem(response, 422, INVALID)
                assert_names(problem, "body", word)
                assert written(world) == before, (method, template)


# ----- the budget PUT: strict numbers, and lowering below what is spent -----------------------------------

STRICT_BUDGETS: list[tuple[str, dict[str, Any], str]] = [
    ("epsilon a numeric string", {"epsilon": "1", "delta": 1e-6}, "epsilon"),
    ("epsilon a boolean", {"epsilon": True, "delta": 1e-6}, "epsilon"),
    ("delta a numeric string", {"epsilon": 1.0, "delta": "0"}, "delta"),
    ("delta a boolean", {"epsilon": 1.0, "delta": False}, "delta"),
    ("delta_share a numeric string", {"epsilon": 1.0, "delta": 1e-6, "delta_share": "1e-7"}, "delta_share"),
    (
        "confirm_below_spent a string",
        {"epsilon": 1.0, "delta": 0, "confirm_below_spent": "true"},
        "confirm_below_spent",
    ),
    (
        "confirm_below_spent a number",
        {"epsilon": 1.0, "delta": 0, "confirm_below_spent": 1},
        "confirm_below_spent",
    ),
]


def budget_path(world: World, scope: str) -> str:
    return f"/v1/datasets/{world.dataset_id}" + (
        "/budget" if scope == "dataset" else f"/analysts/{world.analyst_name}/budget"
    )


class TestBudgetInput:
    @pytest.mark.parametrize("scope", ["dataset", "analyst"])
    @pytest.mark.parametrize(("label", "body", "field"), STRICT_BUDGETS, ids=[c[0] for c in STRICT_BUDGETS])
    def test_numbers_must_be_json_numbers(
        self, world: World, scope: str, label: str, body: dict[str, Any], field: str
    ) -> None:
        before = written(world)
        problem = assert_problem(world.admin.put(budget_path(world, scope), json=body), 422, INVALID)
        assert_names(problem, field)
        assert written(world) == before

    @pytest.mark.parametrize("scope", ["dataset", "analyst"])
    def test_integers_are_numbers(self, live_server: LiveServer, scope: str) -> None:
        world = make_world(live_server, None)
        response = world.admin.put(budget_path(world, scope), json={"epsilon": 2, "delta": 0})
        assert response.status_code == 200, response.text
        assert response.json()["epsilon"] == 2.0
        assert response.json()["pure"]["capacity"] == 2.0


class TestBelowSpent:
    @pytest.mark.parametrize("scope", ["analyst", "dataset"])
    def test_lowering_below_what_is_spent_needs_a_confirmation(
        self, live_server: LiveServer, scope: str
    ) -> None:
        world = make_world(live_server, {"epsilon": 1.0, "delta": 0.0})
        spent = world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.5})
        assert spent.status_code == 200, spent.text
        path = budget_path(world, scope)

        before = written(world)
        refused = world.admin.put(path, json={"epsilon": 0.25, "delta": 0.0})
        problem = assert_problem(refused, 409, "/problems/conflict")
        assert_names(problem, "confirm_below_spent", "spent")
        assert written(world) == before
        explicit_no = world.admin.put(
            path, json={"epsilon": 0.25, "delta": 0.0, "confirm_below_spent": False}
        )
        assert_problem(explicit_no, 409, "/problems/conflict")
        assert written(world) == before

        above = world.admin.put(path, json={"epsilon": 0.75, "delta": 0.0})  # above spent: no question
        assert above.status_code == 200, above.text
        confirmed = world.admin.put(path, json={"epsilon": 0.25, "delta": 0.0, "confirm_below_spent": True})
        assert confirmed.status_code == 200, confirmed.text
        assert confirmed.json()["pure"]["capacity"] == 0.25
        assert confirmed.json()["pure"]["remaining"] == 0.0
        assert_problem(world.request(world.analyst, COUNT), 409, "/problems/budget-exhausted")

    def test_a_budget_with_nothing_spent_needs_no_confirmation(self, live_server: LiveServer) -> None:
        world = make_world(live_server, {"epsilon": 1.0, "delta": 0.0})
        lowered = world.admin.put(
            f"/v1/datasets/{world.dataset_id}/budget", json={"epsilon": 0.0, "delta": 0.0}
        )
        assert lowered.status_code == 200, lowered.text


# ----- Idempotency-Key --------------------------------------------------------------------------------------

BAD_KEYS: list[tuple[str, bytes]] = [
    ("a tab", b"key\tone"),
    ("a C1 control character", b"key\x85one"),
    ("a non-ASCII character", "clé".encode("latin-1")),
    ("over 200 characters", b"k" * 201),
]


class TestIdempotencyKey:
    @pytest.mark.parametrize(("label", "key"), BAD_KEYS, ids=[c[0] for c in BAD_KEYS])
    def test_a_bad_key_is_named(self, world: World, label: str, key: bytes) -> None:
        opened = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={
                "mechanism": "above_threshold",
                "params": {
                    "threshold": 10**9,
                    "epsilon_threshold": 0.01,
                    "max_query_epsilon": 0.01,
                    "max_queries": 5,
                },
            },
        )
        assert opened.status_code == 201, opened.text
        session_id = opened.json()["id"]
        calls: list[tuple[str, dict[str, Any] | None]] = [
            (f"/v1/datasets/{world.dataset_id}/requests", {"mechanism": "laplace", "params": COUNT}),
            (
                f"/v1/datasets/{world.dataset_id}/sessions",
                {
                    "mechanism": "above_threshold",
                    "params": {
                        "threshold": 10**9,
                        "epsilon_threshold": 0.01,
                        "max_query_epsilon": 0.01,
                        "max_queries": 5,
                    },
                },
            ),
            (f"/v1/sessions/{session_id}/queries", {"query": {"kind": "count"}, "epsilon": 0.01}),
        ]
        for path, body in calls:
            before = written(world)
            response = world.analyst.post(path, json=body, headers=[(b"Idempotency-Key", key)])
            problem = assert_problem(response, 422, INVALID)
            assert_names(problem, "header.Idempotency-Key")
            assert written(world) == before, path

    def test_a_printable_key_with_a_space_is_accepted(self, world: World) -> None:
        key = "retry key 1 (~!@#$%^&*)"
        first = world.request(world.analyst, COUNT, key=key)
        assert first.status_code == 200, first.text
        again = world.request(world.analyst, COUNT, key=key)
        assert again.json()["id"] == first.json()["id"]

    def test_c0_control_characters_never_reach_the_service(self, world: World) -> None:
        # The HTTP server (uvicorn's parser) refuses a header with a C0 control character itself, before the
        # application runs (service.api.wire writes its 400 as problem+json): nothing is written either.
        before = written(world)
        response = world.request(world.analyst, COUNT, key="key\x01one")
        assert response.status_code == 400, response.text
        assert response.headers["content-type"] == "application/problem+json", response.text
        assert written(world) == before


# ----- CSV uploads ----------------------------------------------------------------------------------------

LONG = 5000


def long_cell(fill: str) -> bytes:
    return (fill * LONG).encode()


CSV_CASES: list[tuple[str, bytes, str]] = [
    # label, csv, a word of the reason
    ("NUL in a categorical cell", CSV.replace(b",east\n", b",ea\x00st\n", 1), "NUL"),
    ("NUL in a numeric cell", CSV.replace(ROW, b"\n2\x001,", 1), "NUL"),
    ("NUL alone in a cell", CSV.replace(ROW, b"\n\x00,", 1), "NUL"),
    ("NUL in the header", b"a\x00ge,income,region\n30,1000,north\n", "NUL"),
    ("UTF-16", "age,income,region\n30,1000,north\n".encode("utf-16-le"), "NUL"),
]

# Cells and header names of LONG characters: the reason names the column and row, and quotes no long value.
ECHO_CASES: list[tuple[str, bytes, dict[str, Any], str]] = [
    ("not a number", CSV.replace(ROW, b"\n" + long_cell("x") + b",", 1), SCHEMA, "age"),
    ("not a finite number", CSV.replace(ROW, b"\n" + long_cell(" ") + b"inf,", 1), SCHEMA, "age"),
    ("not a declared value", CSV.replace(b",east\n", b"," + long_cell("y") + b"\n", 1), SCHEMA, "region"),
    (
        "not an integer",
        CSV.replace(ROW, b"\n21." + long_cell("5") + b",", 1),
        {**SCHEMA, "columns": [{"name": "age", "type": "int", "min": 18, "max": 90}, *SCHEMA["columns"][1:]]},
        "age",
    ),
    (
        "a column not in the schema",
        b"age,income,region," + long_cell("z") + b"\n30,1000,north,1\n",
        SCHEMA,
        "schema",
    ),
    (
        "duplicate columns",
        b"age,income,region," + long_cell("d") + b"," + long_cell("d") + b"\n1,2,north,3,4\n",
        SCHEMA,
        "duplicate",
    ),
    (
        "many columns not in the schema",
        b"age,income,region,"
        + b",".join(b"c%d" % i for i in range(LONG))
        + b"\n30,1000,north"
        + b",1" * LONG
        + b"\n",
        SCHEMA,
        "more",
    ),
]


class TestCsvUpload:
    @pytest.mark.parametrize(("label", "csv", "word"), CSV_CASES, ids=[c[0] for c in CSV_CASES])
    def test_nul_characters_are_refused(self, world: World, label: str, csv: bytes, word: str) -> None:
        before = written(world)
        problem = assert_problem(upload(world, csv, json.dumps(SCHEMA)), 422, INVALID)
        assert_names(problem, "file", word)
        assert written(world) == before

    @pytest.mark.parametrize(("label", "csv", "schema", "word"), ECHO_CASES, ids=[c[0] for c in ECHO_CASES])
    def test_errors_never_echo_a_long_value(
        self, world: World, label: str, csv: bytes, schema: dict[str, Any], word: str
    ) -> None:
        before = written(world)
        problem = assert_problem(upload(world, csv, json.dumps(schema)), 422, INVALID)
        reason = assert_names(problem, "file", word)
        assert len(reason) < 200, reason
        assert len(problem["detail"]) < 220, problem
        assert written(world) == before


# ----- the ledger a viewer reads ---------------------------------------------------------------------------


class TestLedgerViews:
    def test_viewers_see_no_request_parameters(self, live_server: LiveServer) -> None:
        world = make_world(live_server, {"epsilon": 1.0, "delta": 1e-6})
        released = world.request(world.analyst, {"query": {"kind": "sum", "column": "age"}, "epsilon": 0.1})
        assert released.status_code == 200, released.text
        request_id = released.json()["id"]

        def reserve_entry(client: httpx.Client) -> dict[str, Any]:
            [entry] = [
                e
                for e in ledger_items(client, world.dataset_id)
                if e["event"] == "reserve" and e["request_id"] == request_id
            ]
            return entry

        _, stranger = world.new_key(Role.analyst)
        admin, owner, viewer = (reserve_entry(c) for c in (world.admin, world.analyst, world.viewer))
        assert admin["params"]["query"]["column"] == "age"
        assert owner["params"] == admin["params"]
        assert "params" not in viewer
        assert viewer == {k: v for k, v in admin.items() if k != "params"}  # everything else is kept
        assert all("params" not in e for e in ledger_items(world.viewer, world.dataset_id))
        # an analyst without a grant sees neither the entry nor the dataset
        assert stranger.get(f"/v1/datasets/{world.dataset_id}/ledger").status_code == 404


def test_every_lookup_by_a_name_with_a_nul_character_finds_nothing(
    sessions: sessionmaker[Session],
) -> None:
    """PostgreSQL cannot compare text with a NUL (an error, not a mismatch): the repositories' lookups by
    dataset id or analyst answer "nothing" for one, on both backends, instead of failing the request."""
    from service.store.repositories import DatasetRepository, RequestRepository

    nul = "ds_\x00"
    with sessions() as session:
        datasets = DatasetRepository(session)
        assert datasets.grants(nul) == []
        assert datasets.delete_grant(nul, "alice") is False
        assert datasets.delete_grant("ds_x", "al\x00ice") is False
        assert datasets.admissible_many([nul], ["al\x00ice"]) == (set(), set())
        assert RequestRepository(session).active_counts("al\x00ice", ["laplace"]) == (0, 0)
