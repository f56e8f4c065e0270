"""Individual accounting over real HTTP (SQLite and PostgreSQL): each unit keeps its own filter, a release
leaves out the units that cannot afford it, and the dataset-level budget never stops a request
(docs/privacy/individual.md#theorem-individual).

Counts at a large ε (or a tiny σ) are exact here: the discrete noise is 0 except with probability below
e^-40, so an excluded thread shows as exactly 0 and the others as exactly their user counts."""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.accounting.conversion import capacity_units
from mechanisms.accounting.individual import UnitCharges, UnitFilter
from mechanisms.catalog import MECHANISMS, WITH_INDIVIDUAL
from service.auth import Principal, Role
from service.cli import app
from service.config import get_settings
from service.datasets import build_tables, dataset_by_id
from service.filter.individual import decode, encode, read_state
from service.filter.ledger import differing_units, verify
from service.runs import admission, settlement, worker
from service.store.engine import make_engine, make_sessionmaker
from service.store.migrate import upgrade
from service.store.models import AnalysisRequest, UnitFilterBlock
from service.store.repositories import UnitFilterRepository
from tests.conftest import LiveServer, running_server, server_settings
from tests.integration.test_learners_http import settled

THREADS = 4
SCHEMA: dict[str, Any] = {
    "columns": [
        {"name": "user_id", "type": "int", "min": 0, "max": 100000},
        {"name": "thread", "type": "int", "min": 1, "max": THREADS},
        {"name": "score", "type": "int", "min": 0, "max": 100},
    ],
    "neighboring": "add_remove",
    "privacy_unit": {"column": "user_id", "max_rows": 1},
    "accounting": "individual",
}
USERS_PER_THREAD = 50


SCORES = {
    t * 1000 + u: (u * 37 + t * 11) % 101 for t in range(1, THREADS + 1) for u in range(USERS_PER_THREAD)
}
"""user_id → score (thread = user_id // 1000)."""


def threads_csv() -> bytes:
    lines = ["user_id,thread,score"]
    lines += [f"{user},{user // 1000},{score}" for user, score in SCORES.items()]
    return ("\n".join(lines) + "\n").encode()


def upload(admin: httpx.Client, schema: dict[str, Any], name: str = "threads") -> httpx.Response:
    return admin.post(
        "/v1/datasets",
        files={"file": ("threads.csv", threads_csv(), "text/csv")},
        data={"schema": json.dumps(schema), "name": name},
    )


def individual_world(
    server: LiveServer, epsilon: float, delta: float = 0.0
) -> tuple[httpx.Client, httpx.Client, str, str]:
    """(admin, analyst, dataset id, analyst name): the threads dataset with a budget of (ε, δ)."""
    admin = server.client(server.create_key(Role.admin)[1])
    name, key = server.create_key(Role.analyst)
    created = upload(admin, SCHEMA)
    assert created.status_code == 201, created.text
    dataset_id = created.json()["id"]
    assert admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": name}).status_code == 201
    budget = admin.put(f"/v1/datasets/{dataset_id}/budget", json={"epsilon": epsilon, "delta": delta})
    assert budget.status_code == 200, budget.text
    return admin, server.client(key), dataset_id, name


@pytest.fixture
def world(live_server: LiveServer) -> tuple[httpx.Client, httpx.Client, str]:
    admin, analyst, dataset_id, _ = individual_world(live_server, 1.0)
    return admin, analyst, dataset_id


def where(thread: int | None) -> list[dict[str, Any]]:
    return [] if thread is None else [{"column": "thread", "op": "eq", "value": thread}]


def count(client: httpx.Client, dataset_id: str, thread: int | None, epsilon: float) -> httpx.Response:
    params = {"query": {"kind": "count", "where": where(thread)}, "epsilon": epsilon}
    return client.post(f"/v1/datasets/{dataset_id}/requests", json={"mechanism": "laplace", "params": params})


def gaussian_count(client: httpx.Client, dataset_id: str, thread: int | None, sigma: float) -> httpx.Response:
    params = {"query": {"kind": "count", "where": where(thread)}, "sigma": sigma}
    body = {"mechanism": "gaussian", "params": params}
    return client.post(f"/v1/datasets/{dataset_id}/requests", json=body)


def released(response: httpx.Response) -> float:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["state"] == "committed", body
    return float(body["release"]["value"])


@pytest.fixture
def database_sessions(live_server: LiveServer) -> Iterator[sessionmaker[Session]]:
    """Sessions on the live server's own database (to read what the API must not show)."""
    engine = make_engine(live_server.settings.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def test_each_thread_spends_only_its_own_users(world: tuple[httpx.Client, httpx.Client, str]) -> None:
    _admin, analyst, dataset_id = world
    for thread in range(1, THREADS + 1):  # 4 × ε = 0.9: four times the dataset's budget of 1
        released = count(analyst, dataset_id, thread, 0.9)
        assert released.status_code == 200, released.text
        assert abs(released.json()["release"]["value"] - USERS_PER_THREAD) < 40
    again = count(analyst, dataset_id, 1, 0.9)  # thread 1's users have 0.1 left: all left out
    assert again.status_code == 200, again.text
    assert abs(again.json()["release"]["value"]) < 40


# ----- declarations and refusals ----------------------------------------------------------------------------


def _without_unit() -> dict[str, Any]:
    return {k: v for k, v in SCHEMA.items() if k != "privacy_unit"}


@pytest.mark.parametrize(
    ("schema", "field"),
    [
        (_without_unit(), "accounting"),
        ({**SCHEMA, "neighboring": "replace_one"}, "accounting"),
        ({**SCHEMA, "accounting": "per_person"}, "accounting"),
    ],
    ids=["no-privacy-unit", "replace-one", "unknown-accounting"],
)
def test_a_bad_declaration_is_refused_naming_the_field_and_nothing_is_stored(
    live_server: LiveServer, schema: dict[str, Any], field: str
) -> None:
    admin = live_server.client(live_server.create_key(Role.admin)[1])
    before = admin.get("/v1/datasets").json()
    name = f"bad-{field}-{len(before)}"
    refused = upload(admin, schema, name=name)
    assert refused.status_code == 422, refused.text
    problem = refused.json()
    error = problem["errors"][0]
    assert error["field"].startswith("schema"), problem
    assert field in error["field"] + ": " + error["reason"].split(";")[0], problem
    after = admin.get("/v1/datasets").json()
    assert len(after) == len(before)
    assert name not in {d["name"] for d in after}


def ledger_of(client: httpx.Client, dataset_id: str) -> list[dict[str, Any]]:
    response = client.get(f"/v1/datasets/{dataset_id}/ledger", params={"limit": 1000})
    assert response.status_code == 200, response.text
    items: list[dict[str, Any]] = response.json()["items"]
    return items


REFUSED = [
    ("quantile", {"column": "score", "quantiles": [0.5], "epsilon": 0.5, "candidates": 64}),
    (
        "above_threshold.batch",
        {
            "threshold": 10,
            "epsilon_threshold": 0.5,
            "max_query_epsilon": 0.2,
            "max_queries": 3,
            "queries": [{"query": {"kind": "count", "where": where(1)}}],
        },
    ),
]


@pytest.mark.parametrize(("mechanism", "params"), REFUSED, ids=[m for m, _ in REFUSED])
def test_a_mechanism_without_individual_analysis_is_refused_before_anything_is_reserved(
    live_server: LiveServer, mechanism: str, params: dict[str, Any]
) -> None:
    assert mechanism not in WITH_INDIVIDUAL
    admin, analyst, dataset_id, _ = individual_world(live_server, 10.0)
    ledger_before = ledger_of(admin, dataset_id)
    budget_before = admin.get(f"/v1/datasets/{dataset_id}/budget").json()
    body = {"mechanism": mechanism, "params": params}
    for path in ("requests", "requests:estimate"):
        refused = analyst.post(f"/v1/datasets/{dataset_id}/{path}", json=body)
        assert refused.status_code == 422, refused.text
        assert refused.json()["errors"][0]["field"] == "mechanism"
        assert "individual" in refused.json()["errors"][0]["reason"]
    session = {"threshold": 10**9, "epsilon_threshold": 0.5, "max_query_epsilon": 0.5, "max_queries": 5}
    opened = analyst.post(
        f"/v1/datasets/{dataset_id}/sessions", json={"mechanism": "above_threshold", "params": session}
    )
    assert opened.status_code == 422, opened.text
    assert opened.json()["errors"][0]["field"] == "mechanism"
    assert ledger_of(admin, dataset_id) == ledger_before
    assert admin.get(f"/v1/datasets/{dataset_id}/budget").json() == budget_before
    assert analyst.get("/v1/requests", params={"dataset_id": dataset_id}).json()["items"] == []


# ----- exclusion --------------------------------------------------------------------------------------------


def test_laplace_leaves_out_exactly_the_users_who_spent_their_budget(live_server: LiveServer) -> None:
    _admin, analyst, dataset_id, _ = individual_world(live_server, 100.0)
    assert released(count(analyst, dataset_id, 1, 60.0)) == USERS_PER_THREAD
    assert released(count(analyst, dataset_id, 1, 60.0)) == 0  # 60 + 60 > 100: thread 1 is left out
    # everyone: threads 2–4 afford 60, thread 1 (60 spent) does not
    assert released(count(analyst, dataset_id, None, 60.0)) == (THREADS - 1) * USERS_PER_THREAD
    assert released(count(analyst, dataset_id, 2, 30.0)) == USERS_PER_THREAD  # 60 + 30 ≤ 100
    assert released(count(analyst, dataset_id, 1, 30.0)) == USERS_PER_THREAD  # 60 + 30 ≤ 100 too


def sigma_for_one_release(epsilon: float, delta: float, orders: list[float]) -> float:
    """σ (grid units, a count's unit shift 1) such that a unit affords one Gaussian release but not two:
    its α-slope 1/(2σ²) is 0.7 of the largest B(α)/α, so α/(2σ²) ≤ B(α) at the best order and twice that
    exceeds B(α) at every order."""
    capacity = capacity_units(epsilon, delta, orders)[:-1]
    best = max(cap / 1e12 / alpha for alpha, cap in zip(orders, capacity, strict=True) if cap is not None)
    return math.sqrt(1.0 / (2.0 * 0.7 * best))


def test_gaussian_leaves_out_exactly_the_users_who_spent_their_budget(live_server: LiveServer) -> None:
    admin, analyst, dataset_id, _ = individual_world(live_server, 150.0, 1e-6)
    orders = admin.get(f"/v1/datasets/{dataset_id}").json()["orders"]
    sigma = sigma_for_one_release(150.0, 1e-6, orders)
    assert sigma < 0.15  # the discrete Gaussian is then 0 except with probability < 2·e^-22
    assert released(gaussian_count(analyst, dataset_id, 1, sigma)) == USERS_PER_THREAD
    assert released(gaussian_count(analyst, dataset_id, 1, sigma)) == 0
    assert released(gaussian_count(analyst, dataset_id, None, sigma)) == (THREADS - 1) * USERS_PER_THREAD
    assert released(gaussian_count(analyst, dataset_id, 3, sigma)) == 0  # now thread 3 has spent too
    assert released(gaussian_count(analyst, dataset_id, None, sigma)) == 0


# ----- secrecy ----------------------------------------------------------------------------------------------


def test_no_response_carries_per_unit_information(
    live_server: LiveServer, database_sessions: sessionmaker[Session]
) -> None:
    admin, analyst, dataset_id, _ = individual_world(live_server, 100.0)
    viewer = live_server.client(live_server.create_key(Role.viewer)[1])
    sum_params = {"query": {"kind": "sum", "column": "score", "where": where(1)}, "epsilon": 10.0}
    body = {"mechanism": "laplace", "params": sum_params}
    first = analyst.post(f"/v1/datasets/{dataset_id}/requests", json=body)
    second = analyst.post(f"/v1/datasets/{dataset_id}/requests", json={**body, "params": {**sum_params}})
    excluded = count(analyst, dataset_id, 1, 95.0)  # thread 1 has spent up to 20: many left out
    for response in (first, second, excluded):
        assert response.status_code == 200, response.text

    with database_sessions() as session:
        version, state = read_state(session, dataset_id)
        blocks = UnitFilterRepository(session).blocks(dataset_id, 0, version)
    assert version == 3
    assert blocks
    # a unit whose score is strictly inside (0, 100) was charged a fraction of each sum's public ε: its total
    # is a secret amount (a unit at a bound pays exactly the public worst case)
    inside = np.isin(state.spent.units, [u for u, score in SCORES.items() if 0 < score < 100])
    secret_values = {int(v) for v in state.spent.pure[inside]}
    assert len(secret_values) >= 20  # per-unit amounts that a leak would show

    responses = [
        *(
            client.get(f"/v1/requests/{r.json()['id']}")
            for client in (analyst, admin)
            for r in (first, excluded)
        ),
        *(client.get("/v1/requests", params={"dataset_id": dataset_id}) for client in (analyst, admin)),
        *(client.get(f"/v1/datasets/{dataset_id}/ledger") for client in (analyst, admin, viewer)),
        *(client.get(f"/v1/datasets/{dataset_id}") for client in (analyst, admin, viewer)),
        *(client.get(f"/v1/datasets/{dataset_id}/budget") for client in (analyst, admin, viewer)),
        analyst.post(f"/v1/datasets/{dataset_id}/requests:estimate", json=body),
    ]
    for response in responses:
        assert response.status_code == 200, (response.request.url, response.text)
        text = response.text
        for _, _, data in blocks:
            assert data.hex()[:32] not in text
            assert base64.b64encode(data).decode()[:32] not in text
        numbers = set(re.findall(r"\d+", text))
        assert not {str(v) for v in secret_values} & numbers, response.request.url
        assert not any(repr(v / 1e12) in text for v in secret_values), response.request.url
        assert "excluded" not in text

    commits = [e for e in ledger_of(admin, dataset_id) if e["event"] == "commit"]
    assert [e["unit_filters_version"] for e in commits] == [1, 2, 3]
    for entry in commits:  # of everything per unit, the commit carries only the new state's version
        assert [key for key in entry if "unit" in key] == ["unit_filters_version"]
        assert entry["outcome"] == "released"


# ----- a stale unit state -----------------------------------------------------------------------------------


def test_a_release_computed_on_a_stale_unit_state_is_discarded_and_charges_no_unit(
    live_server: LiveServer, database_sessions: sessionmaker[Session]
) -> None:
    admin, analyst, dataset_id, name = individual_world(live_server, 100.0)
    assert released(count(analyst, dataset_id, 2, 10.0)) == USERS_PER_THREAD  # version 1
    sessions = database_sessions
    principal = Principal(name, Role.analyst)
    params = {"query": {"kind": "count", "where": where(1)}, "epsilon": 10.0}
    with sessions() as session:
        validated = admission.validate(session, principal, dataset_id, "laplace", params)
        request, created = admission.admit(session, principal, validated, None, 300.0)
        ref = settlement.RequestRef.of(request)
        dataset = dataset_by_id(session, dataset_id)
    assert created
    assert request.state == "running"
    assert dataset is not None
    tables = build_tables(live_server.settings)
    try:  # the worker's own run, on version 1 …
        version, unit_filter = worker.load_unit_filters(sessions, dataset)
        realized, output, error, units = worker.run_individual(
            dataset, MECHANISMS["laplace"], validated.params, tables, None, version, unit_filter
        )
    finally:
        tables.close()
    assert error is None
    assert output is not None
    assert units is not None
    assert units.expected == 1
    assert released(count(analyst, dataset_id, 3, 10.0)) == USERS_PER_THREAD  # … which moves on to 2
    with sessions() as session:
        stored_before = read_state(session, dataset_id)
    with sessions() as session:
        settled = settlement.settle(session, ref, realized, output, None, units)
    assert settled is not None
    assert settled.state == "failed_charged"

    with sessions() as session:
        version, ledger = read_state(session, dataset_id)
        row = session.get(AnalysisRequest, ref.id)
        assert row is not None
        assert row.release is None
        assert row.state == "failed_charged"
    assert version == stored_before[0] == 2
    assert len(ledger) == len(stored_before[1]) == USERS_PER_THREAD * 2  # threads 2 and 3
    assert differing_units(ledger, stored_before[1]) == 0  # thread 1's users were charged nothing
    seen = analyst.get(f"/v1/requests/{ref.id}").json()
    assert seen["state"] == "failed_charged"
    assert seen.get("release") is None
    commit = [e for e in ledger_of(admin, dataset_id) if e.get("request_id") == ref.id][-1]
    assert commit["event"] == "commit"
    assert commit["outcome"] == "failed"
    assert "unit_filters_version" not in commit
    assert released(count(analyst, dataset_id, 1, 90.0)) == USERS_PER_THREAD  # thread 1 still has 100
    with sessions() as session:
        assert verify(session).problems == []


# ----- expost ledger verify ---------------------------------------------------------------------------------


def ledger_verify(database: str, data_dir: Path) -> tuple[int, str]:
    env = {"EXPOST_DATABASE_URL": database, "EXPOST_DATA_DIR": str(data_dir), "EXPOST_STORAGE_URL": ""}
    get_settings.cache_clear()  # the command reads its settings from this environment
    try:
        result = CliRunner().invoke(app, ["ledger", "verify"], env=env)
    finally:
        get_settings.cache_clear()
    return result.exit_code, result.stdout


def tamper(sessions: sessionmaker[Session], dataset_id: str) -> None:
    """Add one ledger unit to one unit's spent budget in the newest stored block."""
    with sessions() as session, session.begin():
        version = UnitFilterRepository(session).version(dataset_id)
        row = session.scalars(
            select(UnitFilterBlock).where(
                UnitFilterBlock.dataset_id == dataset_id, UnitFilterBlock.version == version
            )
        ).one()
        blocks = UnitFilterRepository(session).blocks(dataset_id, version - 1, version)
        charges = decode(blocks[0][2])
        pure = charges.pure.copy()
        pure[0] += 1
        changed = encode(UnitCharges(charges.units, pure, charges.slope))
        session.execute(
            update(UnitFilterBlock)
            .where(UnitFilterBlock.dataset_id == row.dataset_id, UnitFilterBlock.version == version)
            .values(state=changed)
        )


def test_ledger_verify_rebuilds_the_unit_filters_and_finds_a_tampered_state(
    database: str, tmp_path: Path
) -> None:
    upgrade(database)
    data_dir = tmp_path / "data"
    with running_server(server_settings(database, data_dir)) as server:
        admin, analyst, dataset_id, _ = individual_world(server, 150.0, 1e-6)
        orders = admin.get(f"/v1/datasets/{dataset_id}").json()["orders"]
        sigma = sigma_for_one_release(150.0, 1e-6, orders)
        sum_params = {"query": {"kind": "sum", "column": "score", "where": where(2)}, "epsilon": 20.0}
        sum_body = {"mechanism": "laplace", "params": sum_params}
        assert released(count(analyst, dataset_id, 1, 60.0)) == USERS_PER_THREAD
        released(analyst.post(f"/v1/datasets/{dataset_id}/requests", json=sum_body))
        # thread 1 (60 spent) cannot afford the Gaussian step, threads 2–4 can
        assert released(gaussian_count(analyst, dataset_id, None, sigma)) == (THREADS - 1) * USERS_PER_THREAD
        assert released(gaussian_count(analyst, dataset_id, 2, sigma)) == 0  # excluded: charged nothing
        # a new budget: later steps use its capacity (the dataset's public record already exceeds it)
        raised = {"epsilon": 200.0, "delta": 1e-6, "confirm_below_spent": True}
        budget = admin.put(f"/v1/datasets/{dataset_id}/budget", json=raised)
        assert budget.status_code == 200, budget.text
        released(count(analyst, dataset_id, None, 40.0))
        code, out = ledger_verify(database, data_dir)
        assert code == 0, out
        assert "MISMATCH" not in out
        assert "UNCHECKED" not in out
        assert "ok" in out

        engine = make_engine(database)
        sessions = make_sessionmaker(engine)
        try:
            with sessions() as session:
                without_data = verify(session)  # no data access: says so, and finds nothing wrong
            assert without_data.ok
            assert not without_data.complete
            assert [u.split(":")[0] for u in without_data.unchecked] == [dataset_id]
            tamper(sessions, dataset_id)
            code, out = ledger_verify(database, data_dir)
            assert code == 1, out
            assert f"{dataset_id}: unit filters differ from the replay for 1 units" in out
        finally:
            engine.dispose()


def test_dp_gd_runs_longer_than_one_unit_could_pay_and_keeps_every_unit_within_budget(
    live_server: LiveServer, database_sessions: sessionmaker[Session]
) -> None:
    """dp_gd on an individual dataset (docs/privacy/individual.md#individual-dp-gd-proof): admitted when ONE
    step fits a fresh unit, although the whole run's worst case is far above a unit's budget; each unit
    stops taking part when its own filter runs out, so after two such runs every unit is still within
    its budget, and the dataset's public record is the runs' full worst case."""
    admin, analyst, dataset_id, _ = individual_world(live_server, 1.0, 1e-6)
    params: dict[str, Any] = {
        "model": "ridge",
        "features": ["thread"],
        "label": "score",
        "steps": 600,
        "noise_multiplier": 6.0,
        "n_hint": 200,
        "clip": 1.0,
    }
    capacity = capacity_units(1.0, 1e-6, DEFAULT_ORDERS)
    for run in (1, 2):
        submitted = analyst.post(
            f"/v1/datasets/{dataset_id}/requests", json={"mechanism": "dp_gd", "params": params}
        )
        body = settled(analyst, submitted)
        assert body["state"] == "committed", body
        assert ledger_of(admin, dataset_id)[-1]["unit_filters_version"] == run
        with database_sessions() as session:
            _, ledger = read_state(session, dataset_id)
        assert len(ledger) > 0
        nothing = UnitCharges(
            ledger.spent.units, np.zeros(len(ledger), np.int64), np.zeros(len(ledger), np.int64)
        )
        assert UnitFilter(DEFAULT_ORDERS, capacity, ledger).admits(nothing).all()  # every unit within budget
    spent = admin.get(f"/v1/datasets/{dataset_id}/budget").json()
    assert spent["binding"] is False
    assert max(row["spent"] for row in spent["orders"] if isinstance(row["spent"], float)) > 1.0  # the record
