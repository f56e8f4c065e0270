"""Helpers shared by the integration tests: a small world of keys, a dataset, grants and budgets, over HTTP
or straight in the database."""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from service.auth import Principal, Role, create_key
from service.datasets import TableCache, create_dataset, grant
from service.filter import budget
from service.runs import sessions as domain
from service.store.engine import is_sqlite, make_engine, make_sessionmaker
from service.store.migrate import upgrade
from service.store.models import DATASET_SCOPE, AnalysisRequest, AnalysisSession, LedgerEntry
from service.store.repositories import FilterRepository
from tests.conftest import LiveServer, fresh_postgres_database

CSV = b"age,income,region\n" + b"".join(
    f"{20 + (i % 60)},{1000 * (i % 50)},{['north', 'south', 'east', 'west'][i % 4]}\n".encode()
    for i in range(200)
)
SCHEMA: dict[str, Any] = {
    "columns": [
        {"name": "age", "type": "float", "min": 18, "max": 90},
        {"name": "income", "type": "float", "min": 0, "max": 100000},
        {"name": "region", "type": "categorical", "values": ["north", "south", "east", "west"]},
    ],
    "neighboring": "replace_one",
}


@dataclass
class World:
    server: LiveServer
    admin: httpx.Client
    admin_name: str
    analyst: httpx.Client
    analyst_name: str
    viewer: httpx.Client
    dataset_id: str

    def new_key(self, role: Role) -> tuple[str, httpx.Client]:
        response = self.admin.post(
            "/v1/keys", json={"name": f"{role.value}-{secrets.token_hex(4)}", "role": role.value}
        )
        assert response.status_code == 201, response.text
        body = response.json()
        return body["name"], self.server.client(body["key"])

    def request(
        self,
        client: httpx.Client,
        params: dict[str, Any],
        mechanism: str = "laplace",
        key: str | None = None,
        dataset_id: str | None = None,
    ) -> httpx.Response:
        headers = {"Idempotency-Key": key} if key else {}
        return client.post(
            f"/v1/datasets/{dataset_id or self.dataset_id}/requests",
            json={"mechanism": mechanism, "params": params},
            headers=headers,
        )


def upload(admin: httpx.Client, csv: bytes = CSV, schema: dict[str, Any] | None = None) -> httpx.Response:
    return admin.post(
        "/v1/datasets",
        files={"file": ("data.csv", csv, "text/csv")},
        data={"schema": json.dumps(schema or SCHEMA), "name": "test data"},
    )


PURE_BUDGET: dict[str, float] = {"epsilon": 1.0, "delta": 0.0}
BIG: dict[str, float] = {"epsilon": 1000.0, "delta": 0.0}  # a budget no test here comes close to spending


def make_world(
    server: LiveServer,
    budget: dict[str, float] | None = PURE_BUDGET,
    schema: dict[str, Any] | None = None,
    csv: bytes = CSV,
) -> World:
    admin_name, admin_key = server.create_key(Role.admin)
    admin = server.client(admin_key)
    created = upload(admin, csv, schema)
    assert created.status_code == 201, created.text
    dataset_id = created.json()["id"]
    world = World(server, admin, admin_name, admin, "", admin, dataset_id)
    world.analyst_name, world.analyst = world.new_key(Role.analyst)
    _, world.viewer = world.new_key(Role.viewer)
    granted = admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": world.analyst_name})
    assert granted.status_code == 201, granted.text
    if budget is not None:
        response = admin.put(f"/v1/datasets/{dataset_id}/budget", json=budget)
        assert response.status_code == 200, response.text
    return world


# ----- assertions and views shared by the integration tests ------------------------------------------------


def assert_problem(response: httpx.Response, status: int, type_: str | None = None) -> dict[str, Any]:
    """``response`` is an RFC 9457 problem with this status (and type); returns its body."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/problem+json"), response.headers
    body = response.json()
    for member in ("type", "title", "status", "detail"):
        assert member in body, (member, body)
    assert body["status"] == status, body
    assert isinstance(body["title"], str)
    assert body["title"]
    assert isinstance(body["detail"], str)
    assert body["detail"]
    if type_ is not None:
        assert body["type"] == type_, body
    return body


def ledger_items(client: httpx.Client, dataset_id: str, page: int = 1000) -> list[dict[str, Any]]:
    """Every ledger entry the caller may see, walking the pagination to its end."""
    items: list[dict[str, Any]] = []
    after = 0
    while True:
        response = client.get(f"/v1/datasets/{dataset_id}/ledger", params={"after": after, "limit": page})
        assert response.status_code == 200, response.text
        body = response.json()
        items += body["items"]
        if body["next_after"] is None:
            return items
        assert body["next_after"] > after
        after = body["next_after"]


def get_budget(client: httpx.Client, dataset_id: str, analyst: str | None = None) -> dict[str, Any]:
    path = (
        f"/v1/datasets/{dataset_id}/budget"
        if analyst is None
        else (f"/v1/datasets/{dataset_id}/analysts/{analyst}/budget")
    )
    response = client.get(path)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


@contextmanager
def db_session(database_url: str) -> Iterator[Session]:
    """A session on ``database_url`` from the test process (its own engine, disposed afterwards)."""
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            yield session
    finally:
        engine.dispose()


@contextmanager
def fresh_database(like_url: str, directory: Path, migrated: bool = True) -> Iterator[str]:
    """A brand-new database on the same backend as ``like_url`` (migrated unless told otherwise)."""
    if is_sqlite(like_url):
        url = f"sqlite:///{directory / f'fresh-{secrets.token_hex(4)}.db'}"
        if migrated:
            upgrade(url)
        yield url
        return
    fresh = fresh_postgres_database()
    try:
        if migrated:
            upgrade(fresh.url)
        yield fresh.url
    finally:
        fresh.drop()


def backdate_session_expiry(session: Session, session_id: str) -> None:
    """Make an open session look idle past its TTL: its expiry and its reservation's lease are in the past."""
    row = session.get(AnalysisSession, session_id)
    assert row is not None
    past = datetime.now(UTC) - timedelta(seconds=1)
    session.execute(update(AnalysisSession).where(AnalysisSession.id == row.id).values(expires_at=past))
    session.execute(
        update(AnalysisRequest).where(AnalysisRequest.id == row.request_id).values(lease_expires_at=past)
    )


def wait_until_closed(client: httpx.Client, session_id: str) -> dict[str, Any]:
    """The session once the test server's reaper (every 0.5 s) has closed it, or its state after 10 s."""
    for _ in range(100):
        state: dict[str, Any] = client.get(f"/v1/sessions/{session_id}").json()
        if state["state"] == "closed":
            break
        threading.Event().wait(0.1)
    return state


def add_dataset(world: World, csv: bytes, schema: dict[str, Any], budget_body: dict[str, float]) -> str:
    """Upload ``csv`` with ``schema``, grant the world's analyst and set the budget; returns the id."""
    created = upload(world.admin, csv=csv, schema=schema)
    assert created.status_code == 201, created.text
    dataset_id = str(created.json()["id"])
    granted = world.admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": world.analyst_name})
    assert granted.status_code == 201, granted.text
    assert world.admin.put(f"/v1/datasets/{dataset_id}/budget", json=budget_body).status_code == 200
    return dataset_id


def key_of(client: httpx.Client) -> str:
    """The API key a client sends."""
    return str(client.headers["Authorization"].split()[1])


def expect(condition: object, message: str) -> None:
    """A failing check reported without a Python traceback (``pytrace=False``).

    Formatting a traceback calls ``ast.parse`` (pytest's failure source, and Python 3.11's own caret
    anchors); on CPython 3.11.7 two threads doing that at once can raise ``SystemError: AST constructor
    recursion depth mismatch``, and a live-server thread logs the 500 such a failure may provoke while
    pytest reports the failure: that aborted the whole run with an INTERNALERROR.
    """
    if not condition:
        pytest.fail(message, pytrace=False)


# ----- the domain functions on a database, without HTTP -----------------------------------------------------


def world_in_db(
    sessions: sessionmaker[Session],
    data_dir: Path,
    analysts: int = 1,
    epsilon: float = 1.0,
    delta: float = 0.0,
    names: list[str] | None = None,
) -> tuple[str, list[Principal]]:
    """A dataset (the helpers' CSV and schema) with a budget and granted analysts, straight in the database.

    ``names``: grant these existing analyst keys instead of creating new ones.
    """
    with sessions() as session, session.begin():
        dataset = create_dataset(session, data_dir, "d", CSV, SCHEMA, "admin")
        if names is None:
            names = [f"an-{dataset.id}-{i}" for i in range(analysts)]
            for name in names:
                create_key(session, name, Role.analyst)
        for name in names:
            grant(session, dataset, name, "admin")
        budget.set_budget(session, dataset, DATASET_SCOPE, epsilon, delta, "admin")
    return dataset.id, [Principal(name, Role.analyst) for name in names]


def totals(sessions: sessionmaker[Session], dataset_id: str) -> tuple[int, int]:
    """(spent, reserved) of the dataset filter's pure slot, in units."""
    with sessions() as session:
        flt = FilterRepository(session).get(dataset_id)
        assert flt is not None
        return flt.spent["finite"][-1], flt.reserved["finite"][-1]


def commits_of(sessions: sessionmaker[Session], request_id: str) -> int:
    """How many commit entries the ledger holds for ``request_id``."""
    with sessions() as session:
        return len(
            session.query(LedgerEntry)
            .filter(LedgerEntry.request_id == request_id, LedgerEntry.event == "commit")
            .all()
        )


def app_for(sessions: sessionmaker[Session], data_dir: Path) -> Any:
    """What ``service.runs.sessions.ask`` needs of the application context: sessions, tables, settings."""
    settings = SimpleNamespace(session_ttl_seconds=3600.0)
    return cast(Any, SimpleNamespace(sessions=sessions, tables=TableCache(data_dir), settings=settings))


def laplace_session(
    sessions: sessionmaker[Session], principal: Principal, dataset_id: str, **overrides: Any
) -> AnalysisSession:
    """An open ``above_threshold.laplace`` session (threshold 150, ε = 1, 10 queries), from the domain."""
    params = {"threshold": 150.0, "epsilon": 1.0, "max_queries": 10, **overrides}
    with sessions() as session:
        validated = domain.validate_open(session, principal, dataset_id, "above_threshold.laplace", params)
    return domain.open_session(sessions, principal, validated, None, 3600.0)
