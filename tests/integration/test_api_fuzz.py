"""Property-based fuzzing of the whole HTTP API with schemathesis, against the real server.

The OpenAPI document is loaded from the live server and every operation in it is fuzzed with valid
credentials (an admin key for admin routes, a granted analyst key for the others) and, mostly, with path
parameters that name real objects of a small world (its dataset, analyst, request and open session), so the
handlers get past their 404s; sometimes with made-up or malformed ids, sometimes with a made-up key. Every
response must be:

* never a 5xx;
* every 4xx an RFC 9457 ``application/problem+json`` body with ``type``, ``title``, ``status`` and
  ``detail``, and no write to the database or the data directory (no partial write);
* conformant to the OpenAPI document: a documented status code, content type and body schema.

Schemathesis generates positive and negative cases from the schema. Its bodies almost never get past the
first pydantic error of ``params``, so the upload, request, session and query endpoints are also fuzzed
with *near-valid* bodies (``NEAR_VALID``): valid bodies of every mechanism with edge-case values, half of
them with one mutation somewhere inside.

Bounded and reproducible: ``MAX_EXAMPLES`` per operation and mode, derandomized (the seed is derived from
each test), no example database: 25 per operation, mode and database in CI (the file was the suite's
slowest at 40). ``EXPOST_FUZZ_EXAMPLES=500`` makes a deeper run by hand.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from service.store.engine import make_engine
from service.store.models import (
    AnalysisRequest,
    AnalysisSession,
    ApiKey,
    Dataset,
    Grant,
    LedgerEntry,
    PrivacyFilter,
    SecretState,
)
from tests.conftest import LiveServer
from tests.integration.helpers import SCHEMA, World, assert_problem, make_world

MAX_EXAMPLES = int(os.environ.get("EXPOST_FUZZ_EXAMPLES", "25"))  # × 2 databases; was 40 (CI time)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]

# Every operation of the OpenAPI document (/metrics and the dashboard's static files are not in it), with
# the role that may call it. A new operation fails test_every_operation_is_fuzzed until it is listed here.
ADMIN, ANALYST, NOBODY = "admin", "analyst", "nobody"
OPERATIONS: dict[str, str] = {
    "GET /healthz": NOBODY,
    "GET /readyz": NOBODY,
    "GET /v1/keys": ADMIN,
    "POST /v1/keys": ADMIN,
    "DELETE /v1/keys/{name}": ADMIN,  # made-up names only: a 404 (or a 422 for a malformed name)
    "GET /v1/datasets": ANALYST,
    "POST /v1/datasets": ADMIN,
    "GET /v1/datasets/{dataset_id}": ANALYST,
    "POST /v1/datasets/{dataset_id}/grants": ADMIN,
    "GET /v1/datasets/{dataset_id}/grants": ADMIN,
    "GET /v1/datasets/{dataset_id}/budget": ANALYST,
    "GET /v1/datasets/{dataset_id}/analysts/{analyst}/budget": ANALYST,
    "GET /v1/datasets/{dataset_id}/ledger": ANALYST,
    "POST /v1/datasets/{dataset_id}/requests:estimate": ANALYST,
    "POST /v1/datasets/{dataset_id}/requests": ANALYST,
    "POST /v1/datasets/{dataset_id}/sql": ANALYST,
    "POST /v1/datasets/{dataset_id}/sql:translate": ANALYST,
    "GET /v1/requests/{request_id}": ANALYST,
    "POST /v1/requests/{request_id}/cancel": ANALYST,  # the world's request is committed: a 409
    "GET /v1/analysts/{analyst}/limits": ANALYST,
    "POST /v1/datasets/{dataset_id}/sessions": ANALYST,
    "GET /v1/sessions/{session_id}": ANALYST,
    "POST /v1/sessions/{session_id}/queries": ANALYST,
    "GET /v1/mechanisms": ANALYST,
    "GET /v1/datasets/{dataset_id}/activity": ANALYST,
    "GET /v1/datasets/{dataset_id}/refusals": ANALYST,
    "GET /v1/requests": ANALYST,
    "GET /v1/me": ANALYST,
    "GET /v1/sessions": ANALYST,
    "POST /v1/requests/{request_id}/privacy-report": ANALYST,
    "POST /v1/sessions/{session_id}/next": ANALYST,
    # last (the tests run in this order): they close the world's session and change its budgets
    "POST /v1/sessions/{session_id}/close": ANALYST,
    "PUT /v1/datasets/{dataset_id}/analysts/{analyst}/budget": ADMIN,
    "PUT /v1/datasets/{dataset_id}/budget": ADMIN,
    "PUT /v1/analysts/{analyst}/limits": ADMIN,  # may lower the analyst's limits: after every submission
    # the very last: they revoke the world analyst's grant, then archive the world's dataset
    "DELETE /v1/datasets/{dataset_id}/grants/{analyst}": ADMIN,
    "POST /v1/datasets/{dataset_id}/archive": ADMIN,
}
NOT_FUZZED: dict[str, str] = {
    # A generated PostgreSQL source would make the server connect to whatever host the DSN names: no test
    # may send traffic beyond loopback. Its refusals (bad sources, bad DSNs, bad identifiers, the DSN never
    # echoed) are tested with fixed inputs in tests/integration/test_data_sources.py.
    "POST /v1/datasets/register": "the server would connect to fuzzed hosts",
}

# Operations whose only inputs are the key and string path parameters, which no value can make invalid
# against the schema: fuzzed in positive mode only (negative mode would have nothing to negate).
POSITIVE_ONLY = {
    "GET /healthz",
    "GET /readyz",
    "GET /v1/keys",
    "GET /v1/datasets",
    "GET /v1/mechanisms",
    "GET /v1/me",
    "GET /v1/datasets/{dataset_id}",
    "GET /v1/datasets/{dataset_id}/grants",
    "GET /v1/datasets/{dataset_id}/budget",
    "GET /v1/datasets/{dataset_id}/analysts/{analyst}/budget",
    "GET /v1/requests/{request_id}",
    "GET /v1/sessions/{session_id}",
    "POST /v1/sessions/{session_id}/close",
    "POST /v1/requests/{request_id}/cancel",
    "GET /v1/analysts/{analyst}/limits",
    "DELETE /v1/keys/{name}",
    "DELETE /v1/datasets/{dataset_id}/grants/{analyst}",
    "POST /v1/datasets/{dataset_id}/archive",
}

# An int column too, so that histograms over integer bins are reachable.
FUZZ_SCHEMA: dict[str, Any] = {
    **SCHEMA,
    "columns": [{"name": "age", "type": "int", "min": 18, "max": 90}, *SCHEMA["columns"][1:]],
}
FUZZ_BUDGET = {"epsilon": 1000.0, "delta": 1e-6}


# ----- the world and its fingerprint ------------------------------------------------------------------------


@dataclass
class FuzzWorld:
    world: World
    schema: Any
    keys: dict[str, str]
    path_parameters: dict[str, str]
    engine: Engine
    http: requests.Session

    def fingerprint(self) -> tuple[Any, ...]:
        """Everything a write could change (refusals excepted: recording them is part of a 409)."""
        with Session(self.engine) as session:

            def stats(model: Any, *columns: Any) -> tuple[Any, ...]:
                return tuple(session.execute(select(func.count(), *columns).select_from(model)).one())

            filters = tuple(
                (f.id, f.epsilon, f.delta, json.dumps(f.spent), json.dumps(f.reserved), f.last_seq)
                for f in session.scalars(select(PrivacyFilter).order_by(PrivacyFilter.id))
            )
            return (
                stats(ApiKey, func.max(ApiKey.id)),
                stats(Dataset),
                stats(Grant, func.max(Grant.id)),
                stats(LedgerEntry),
                stats(AnalysisRequest, func.max(AnalysisRequest.updated_at)),
                stats(AnalysisSession, func.max(AnalysisSession.updated_at)),
                stats(SecretState, func.max(SecretState.updated_at)),
                filters,
                tuple(sorted(p.name for p in self.world.server.settings.data_dir.rglob("*"))),
            )


@pytest.fixture(scope="module")
def fuzz(live_server: LiveServer) -> Iterator[FuzzWorld]:
    world = make_world(live_server, budget=FUZZ_BUDGET, schema=FUZZ_SCHEMA)
    sub_budget = world.admin.put(
        f"/v1/datasets/{world.dataset_id}/analysts/{world.analyst_name}/budget", json=FUZZ_BUDGET
    )
    assert sub_budget.status_code == 200, sub_budget.text
    released = world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.1})
    assert released.status_code == 200, released.text
    opened = world.analyst.post(  # never halts (threshold far above any count), never fills up
        f"/v1/datasets/{world.dataset_id}/sessions",
        json={
            "mechanism": "above_threshold",
            "params": {
                "threshold": 10**9,
                "epsilon_threshold": 0.01,
                "max_query_epsilon": 1.0,
                "max_queries": 10_000,
            },
        },
    )
    assert opened.status_code == 201, opened.text
    schema = schemathesis.openapi.from_url(live_server.base_url + "/openapi.json")
    engine = make_engine(live_server.settings.database_url)
    with requests.Session() as http:
        yield FuzzWorld(
            world=world,
            schema=schema,
            keys={
                role: client.headers["Authorization"].removeprefix("Bearer ")
                for role, client in ((ADMIN, world.admin), (ANALYST, world.analyst))
            },
            path_parameters={
                "dataset_id": world.dataset_id,
                "analyst": world.analyst_name,
                "request_id": released.json()["id"],
                "session_id": opened.json()["id"],
            },
            engine=engine,
            http=http,
        )
    engine.dispose()


# ----- the properties ---------------------------------------------------------------------------------------


def assert_problem_json(response: schemathesis.Response) -> None:
    """A 4xx is an RFC 9457 problem saying what went wrong."""
    content_type = response.headers.get("content-type", [""])[0]
    assert content_type.startswith("application/problem+json"), (response.status_code, content_type)
    body = response.json()
    assert isinstance(body, dict), body
    for member in ("type", "title", "status", "detail"):
        assert member in body, (member, body)
    assert body["status"] == response.status_code, body
    for member in ("type", "title", "detail"):
        assert isinstance(body[member], str), (member, body)
        assert body[member], (member, body)


def exercise(fuzz: FuzzWorld, case: Case) -> None:
    """Send one case to the live server and check every property of its response."""
    before = fuzz.fingerprint()
    response = case.call(
        base_url=fuzz.world.server.base_url, session=fuzz.http, timeout=30, allow_redirects=False
    )
    case.validate_response(response, checks=CHECKS)
    if 400 <= response.status_code < 500:
        assert_problem_json(response)
        assert fuzz.fingerprint() == before, f"a {response.status_code} wrote to the database"


ODD_IDS = st.one_of(
    st.sampled_from(["\x00", "ds_\x00", "rq_", "ss_0", "..", "%00", "é", " ", "x" * 300, "analyst-0"]),
    st.text(min_size=1, max_size=8),
)


def operation_strategy(
    fuzz: FuzzWorld, label: str, mode: GenerationMode, body: st.SearchStrategy[Any] | None = None
) -> st.SearchStrategy[Case]:
    """Real path parameters and a valid key, with ``body`` if given; without it, up to three cases in seven
    have made-up or malformed ids (schemathesis's or ``ODD_IDS``) or a made-up key."""
    method, path = label.split(" ", 1)
    operation = fuzz.schema[path][method]
    role = OPERATIONS[label]
    auth = {"Authorization": f"Bearer {fuzz.keys[role]}"} if role != NOBODY else None
    names = {p.name for p in operation.path_parameters}
    real = {k: v for k, v in fuzz.path_parameters.items() if k in names} or None
    cases = operation.as_strategy(mode, path_parameters=real, headers=auth)
    if body is not None:
        return st.tuples(cases, body).map(lambda pair: _with_body(*pair))
    variants = [cases] * 4
    if real:  # not empty: /v1/datasets/ is another URL (a redirect to the list)
        made_up = operation.as_strategy(mode, headers=auth)
        variants.append(made_up.filter(lambda case: "" not in (case.path_parameters or {}).values()))
        odd = st.fixed_dictionaries(dict.fromkeys(real, ODD_IDS))
        variants.append(
            odd.flatmap(lambda ids: operation.as_strategy(mode, path_parameters=ids, headers=auth))
        )
    if auth and mode is GenerationMode.POSITIVE:
        variants.append(operation.as_strategy(mode, path_parameters=real))
    return st.sampled_from(range(len(variants))).flatmap(lambda i: variants[i])


def _with_body(case: Case, body: Any) -> Case:
    case.body = body
    return case


FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)


def run(fuzz: FuzzWorld, strategy: st.SearchStrategy[Case]) -> None:
    @FUZZ_SETTINGS
    @given(case=strategy)
    def check(case: Case) -> None:
        exercise(fuzz, case)

    check()


# ----- near-valid bodies for the endpoints that reach the mechanisms ----------------------------------------
# Schema-driven bodies almost never get past the first pydantic error of ``params``; these are valid bodies
# of every mechanism with edge-case values, half of them with one mutation somewhere inside.

WEIRD = st.one_of(
    st.sampled_from(
        [
            None,
            True,
            False,
            "",
            " ",
            "\x00",
            "é",
            "1e400",
            "NaN",
            0,
            -1,
            0.0,
            -0.0,
            1e-320,
            5e-324,
            1e308,
            -1e308,
            2**53 + 1,
            2**63,
            10**300,
            10**301,
            [],
            {},
            [1],
            {"a": 1},
        ]
    ),
    st.text(max_size=5),
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(),
)
EPSILON = st.one_of(st.floats(1e-6, 5.0), st.sampled_from([1e-9, 1e-12, 5.0, 100.0, 1]), st.integers(1, 3))
SIGMA = st.one_of(st.floats(0.1, 1e6), st.sampled_from([1e-9, 1e-300, 1e12, 1e300, 1]), st.integers(1, 10**6))
AGE = st.one_of(st.integers(0, 120), st.floats(-1e20, 1e20), st.sampled_from([18, 90, 17.5, 90.5, 2**53 + 1]))
REGION = st.sampled_from(["north", "south", "east", "west"])


def _condition(column: str, value: st.SearchStrategy[Any], numeric: bool) -> st.SearchStrategy[Any]:
    ops = ["eq", "ne", "lt", "le", "gt", "ge"] if numeric else ["eq", "ne"]
    single = st.fixed_dictionaries({"column": st.just(column), "op": st.sampled_from(ops), "value": value})
    many = st.fixed_dictionaries(
        {"column": st.just(column), "op": st.just("in"), "value": st.lists(value, min_size=1, max_size=4)}
    )
    return st.one_of(single, many)


WHERE = st.lists(
    st.one_of(
        _condition("age", AGE, True), _condition("income", AGE, True), _condition("region", REGION, False)
    ),
    max_size=3,
)
SCALAR_QUERY = st.one_of(
    st.fixed_dictionaries({"kind": st.just("count")}, optional={"where": WHERE}),
    st.fixed_dictionaries(
        {"kind": st.just("sum"), "column": st.sampled_from(["age", "income"])}, optional={"where": WHERE}
    ),
    st.fixed_dictionaries({"kind": st.just("mean"), "column": st.sampled_from(["age", "income"])}),
)
QUERY = st.one_of(
    SCALAR_QUERY,
    st.fixed_dictionaries(
        {"kind": st.just("histogram"), "column": st.sampled_from(["age", "region"])},
        optional={"where": WHERE},
    ),
)
QUERY_STEP = st.fixed_dictionaries({"query": SCALAR_QUERY}, optional={"epsilon": st.floats(1e-6, 0.5)})
GEOMETRIC = {
    "threshold": st.integers(-(10**6), 10**6),
    "epsilon_threshold": st.floats(1e-6, 0.5),
    "max_query_epsilon": st.floats(0.5, 1.0),
    "max_queries": st.integers(1, 20),
}
LAPLACE_SESSION = {
    "threshold": st.floats(-1e6, 1e6),
    "epsilon": st.floats(1e-6, 1.0),
    "max_queries": st.integers(1, 20),
}


def _body(mechanism: str, required: dict[str, Any], optional: dict[str, Any] | None = None) -> Any:
    params = st.fixed_dictionaries(required, optional=optional)
    return st.fixed_dictionaries({"mechanism": st.just(mechanism), "params": params})


STEPS = st.lists(QUERY_STEP, min_size=1, max_size=3)
LAPLACE_STEPS = st.lists(st.fixed_dictionaries({"query": SCALAR_QUERY}), min_size=1, max_size=3)
DROPPING = {**GEOMETRIC, "threshold": st.floats(-1e6, 1e6)}
MONOTONE = {"require_monotone": st.booleans()}
SENSITIVITY = {"max_sensitivity": st.floats(1e-3, 1e12)}
REQUEST_BODY = st.one_of(
    _body("laplace", {"query": QUERY, "epsilon": EPSILON}),
    _body("gaussian", {"query": QUERY, "sigma": SIGMA}),
    _body("above_threshold.batch", {**GEOMETRIC, "queries": STEPS}, MONOTONE),
    _body("above_threshold.dropping.batch", {**DROPPING, "queries": STEPS}),
    _body("above_threshold.laplace.batch", {**LAPLACE_SESSION, "queries": LAPLACE_STEPS}, SENSITIVITY),
)
SESSION_BODY = st.one_of(
    _body("above_threshold", GEOMETRIC, MONOTONE),
    _body("above_threshold.dropping", DROPPING),
    _body("above_threshold.laplace", LAPLACE_SESSION, SENSITIVITY),
)


def sometimes(usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``usual`` three times in four, else ``odd`` (and shrinking goes to ``usual``)."""
    return st.integers(0, 3).flatmap(lambda i: odd if i == 3 else usual)


COLUMN_NAMES = sometimes(
    st.sampled_from(["a", "b", "c", "é", "x y"]),
    st.sampled_from(["", " a", "a,b", 'a"b', "\x00", "\n", "a" * 201]),
)
CATEGORIES = sometimes(
    st.lists(st.sampled_from(["north", "south", "é", "x y"]), min_size=1, max_size=3, unique=True),
    st.lists(st.sampled_from(["north", "", "\x00", " "]), min_size=0, max_size=3),
)
ODD_CELLS = st.sampled_from(
    ["", " 1 ", "x", "1e400", "-inf", "nan", "\x00", "é", '"', "3.0", "0x10", "1_000"]
)


@st.composite
def dataset_upload(draw: st.DrawFn) -> dict[str, Any]:
    """A CSV file and its schema that mostly agree, with odd names, bounds and cells."""
    names = draw(st.lists(COLUMN_NAMES, min_size=1, max_size=3, unique=True))
    columns: list[dict[str, Any]] = []
    cells: list[st.SearchStrategy[str]] = []
    for name in names:
        kind = draw(st.sampled_from(["float", "int", "categorical"]))
        if kind == "categorical":
            values = draw(CATEGORIES)
            columns.append({"name": name, "type": kind, "values": values})
            cells.append(sometimes(st.sampled_from(values), ODD_CELLS) if values else ODD_CELLS)
        else:
            low = draw(sometimes(st.integers(-100, 100), st.sampled_from([-(2**53), 2**53, 1e16, 0.5])))
            high = low + draw(sometimes(st.integers(0, 200), st.integers(-200, -1)))  # rarely max < min
            columns.append({"name": name, "type": kind, "min": low, "max": high})
            number = st.one_of(st.integers(-300, 300), st.floats(allow_nan=False, allow_infinity=False))
            cells.append(sometimes(number.map(str), ODD_CELLS))
    neighboring = draw(sometimes(st.sampled_from(["replace_one", "add_remove"]), st.just("other")))
    schema = {"columns": columns, "neighboring": neighboring}
    rows = draw(st.lists(st.tuples(*cells), min_size=1, max_size=4))
    if draw(sometimes(st.just(False), st.just(True))):  # a row that does not match
        rows.append(draw(st.lists(st.one_of(*cells), max_size=4)))
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows([names, *rows])
    upload: dict[str, Any] = {
        "file": text.getvalue().encode("utf-8", "surrogatepass"),
        "schema": json.dumps(draw(mutated(st.just(schema)))),
    }
    odd_names = st.sampled_from(["a\x00b", "\x00", " ", "é" * 201])
    name = draw(sometimes(st.sampled_from(["people", None]), odd_names))
    if name is not None:
        upload["name"] = name
    return upload


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[Any]) -> Any:
    """A value of ``valid``; half the time with one node replaced, removed, or given an unknown key."""
    value = copy.deepcopy(draw(valid))
    if not draw(st.booleans()):
        return value
    paths: list[tuple[Any, ...]] = []

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        paths.append(path)
        if isinstance(node, dict | list):
            for key, child in node.items() if isinstance(node, dict) else enumerate(node):
                walk(child, (*path, key))

    walk(value, ())
    path = draw(st.sampled_from(paths[1:] + paths[:1]))  # the root last: it would shrink to it
    if not path:
        return draw(WEIRD)
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    action = draw(st.sampled_from(["replace", "remove", "extra"]))
    if action == "replace":
        parent[path[-1]] = draw(WEIRD)
    elif action == "remove":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent["unexpected"] = draw(WEIRD)
    else:
        parent.append(draw(WEIRD))
    return value


NEAR_VALID: dict[str, st.SearchStrategy[Any]] = {
    "POST /v1/datasets": dataset_upload(),
    "POST /v1/datasets/{dataset_id}/requests:estimate": mutated(REQUEST_BODY),
    "POST /v1/datasets/{dataset_id}/requests": mutated(REQUEST_BODY),
    "POST /v1/datasets/{dataset_id}/sessions": mutated(SESSION_BODY),
    "POST /v1/sessions/{session_id}/queries": mutated(QUERY_STEP),
}


# ----- the tests (they run in this order) ------------------------------------------------------------------


def test_every_operation_is_fuzzed(fuzz: FuzzWorld) -> None:
    operations = [result.ok() for result in fuzz.schema.get_all_operations()]
    fuzzed = [op for op in operations if op.label not in NOT_FUZZED]
    assert {op.label for op in operations} == set(OPERATIONS) | set(NOT_FUZZED)
    nothing_to_negate = {
        op.label
        for op in fuzzed
        if not op.body and not op.query and [h.name for h in op.headers] in ([], ["Authorization"])
    }
    assert nothing_to_negate == POSITIVE_ONLY


@pytest.mark.parametrize("label", list(NEAR_VALID))
def test_fuzz_near_valid_bodies(fuzz: FuzzWorld, label: str) -> None:
    run(fuzz, operation_strategy(fuzz, label, GenerationMode.POSITIVE, body=NEAR_VALID[label]))


@pytest.mark.parametrize(
    ("label", "mode"),
    [
        (label, mode)
        for label in OPERATIONS
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        if mode is GenerationMode.POSITIVE or label not in POSITIVE_ONLY
    ],
)
def test_fuzz_operation(fuzz: FuzzWorld, label: str, mode: GenerationMode) -> None:
    run(fuzz, operation_strategy(fuzz, label, mode))


# ----- regressions: what the fuzzing found ------------------------------------------------------------------


PROBLEM_REF = {"$ref": "#/components/schemas/Problem"}


def test_errors_are_documented_as_problems(live_server: LiveServer) -> None:
    """Every operation documents its 4xx as application/problem+json (it said FastAPI's HTTPValidationError,
    application/json, which the service never sends)."""
    document = httpx.get(live_server.base_url + "/openapi.json").json()
    assert "HTTPValidationError" not in document["components"]["schemas"]
    problem = document["components"]["schemas"]["Problem"]
    assert set(problem["required"]) == {"type", "title", "status", "detail"}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            documented = operation["responses"]["4XX"]["content"]
            assert documented == {"application/problem+json": {"schema": PROBLEM_REF}}, (method, path)


def test_a_refusals_cursor_past_the_id_range_is_bad_input(live_server: LiveServer) -> None:
    """``after`` beyond a 32-bit refusal id was a 500 on PostgreSQL (integer out of range)."""
    world = make_world(live_server)
    path = f"/v1/datasets/{world.dataset_id}/refusals"
    body = assert_problem(world.viewer.get(path, params={"after": 2**31}), 422, "/problems/invalid-input")
    assert body["errors"][0]["field"] == "query.after"
    page = world.viewer.get(path, params={"after": 2**31 - 1})
    assert page.status_code == 200, page.text
    assert page.json() == {"items": [], "next_after": None}


def test_an_id_with_a_nul_character_names_nothing(live_server: LiveServer) -> None:
    """A NUL in a path id was a 500 on PostgreSQL (text cannot hold it); now a 404 on both backends."""
    world = make_world(live_server)
    assert_problem(world.viewer.get("/v1/datasets/%00"), 404, "/problems/not-found")
    assert_problem(world.viewer.get("/v1/datasets/ds_%00/budget"), 404, "/problems/not-found")
    assert_problem(world.analyst.get("/v1/requests/rq_%00"), 404, "/problems/not-found")
    assert_problem(world.analyst.get("/v1/sessions/%00"), 404, "/problems/not-found")
    assert_problem(world.analyst.post("/v1/sessions/ss_%00/close"), 404, "/problems/not-found")
    asked = world.analyst.post("/v1/sessions/%00/queries", json={"query": {"kind": "count"}, "epsilon": 0.1})
    assert_problem(asked, 404, "/problems/not-found")
    body = {"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 0.1}}
    refused = world.analyst.post(f"/v1/datasets/%00{world.dataset_id}/requests", json=body)
    assert_problem(refused, 404, "/problems/not-found")
    for who in (world.admin, world.analyst):  # the dry run checked archived/granted before visibility
        estimated = who.post("/v1/datasets/ds_%00/requests:estimate", json=body)
        assert_problem(estimated, 404, "/problems/not-found")
    dataset = f"/v1/datasets/{world.dataset_id}"
    for response in (
        world.admin.delete(f"{dataset}/grants/an%00alyst"),
        world.admin.get(f"{dataset}/analysts/an%00alyst/budget"),
        world.admin.put(f"{dataset}/analysts/an%00alyst/budget", json={"epsilon": 1.0, "delta": 1e-6}),
        world.admin.delete("/v1/keys/k%00ey"),
        world.admin.get("/v1/analysts/an%00alyst/limits"),
        world.admin.put("/v1/analysts/an%00alyst/limits", json={"max_running_requests": 2}),
        world.admin.post(f"{dataset}/grants", json={"analyst": "an\x00alyst"}),
    ):
        assert response.status_code < 500, (response.request.url, response.text)


def test_a_dataset_name_with_a_nul_character_is_bad_input(live_server: LiveServer) -> None:
    """It was a 500 on PostgreSQL, after the CSV had been stored (a partial write); now a 422 before."""
    world = make_world(live_server)
    data_dir = live_server.settings.data_dir
    files = sorted(p.name for p in data_dir.rglob("*"))
    before = world.admin.get("/v1/datasets").json()
    csv_bytes = b"n\n" + b"".join(f"{i}\n".encode() for i in range(7919, 7930))  # no other test's file
    schema = {
        "columns": [{"name": "n", "type": "int", "min": 0, "max": 10_000}],
        "neighboring": "replace_one",
    }
    response = world.admin.post(
        "/v1/datasets",
        files={"file": ("nul.csv", csv_bytes, "text/csv")},
        data={"schema": json.dumps(schema), "name": "a\x00b"},
    )
    body = assert_problem(response, 422, "/problems/invalid-input")
    assert body["errors"] == [{"field": "name", "reason": "must not contain a NUL character"}]
    assert sorted(p.name for p in data_dir.rglob("*")) == files
    assert world.admin.get("/v1/datasets").json() == before
