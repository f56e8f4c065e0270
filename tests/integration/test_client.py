"""expost_client (clients/python; sync and async) against a real server on SQLite and PostgreSQL.

Every client method runs at least once against the live server; the retry tests lose a response after the
server has answered it, so the retry must replay the same request (same Idempotency-Key) and the budget
must be charged once.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

import httpx
import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict, Field

from expost_client import (
    AnalysisRequest,
    AsyncExpostClient,
    AuthError,
    Budget,
    BudgetExhaustedError,
    ConflictError,
    ExpostClient,
    ExpostError,
    ExpostTimeoutError,
    InvalidInputError,
    MechanismFailedError,
    NotFoundError,
    PrivacyReport,
    RetryPolicy,
    ServerError,
)
from mechanisms.accounting import RdpCurve
from mechanisms.base import ParamsError, ProgressFn, PublicContext, Release, StepResult, Table, no_progress
from mechanisms.catalog import INTERACTIVE, MECHANISMS
from mechanisms.noise import Noise
from mechanisms.queries.laplace import Laplace
from service.auth import Role
from tests.conftest import LiveServer, running_server, server_settings
from tests.integration.helpers import CSV, SCHEMA

COUNT = {"query": {"kind": "count"}, "epsilon": 0.1}
FAST_RETRY = RetryPolicy(attempts=4, backoff=0.01, max_backoff=0.05)
SESSION_PARAMS = {"threshold": 150, "epsilon_threshold": 1.0, "max_query_epsilon": 0.5, "max_queries": 10}
BELOW = {"kind": "count", "where": [{"column": "region", "op": "eq", "value": "north"}]}  # 50 rows
ABOVE = {"kind": "count"}  # 200 rows


@dataclass
class ClientWorld:
    """A dataset, a budget and admin/analyst/viewer clients, all made through the client."""

    server: LiveServer
    admin: ExpostClient
    analyst: ExpostClient
    analyst_name: str
    analyst_key: str
    viewer: ExpostClient
    dataset_id: str

    def client(self, key: str, **kwargs: Any) -> ExpostClient:
        return ExpostClient(self.server.base_url, key, **kwargs)


def build_world(server: LiveServer, budget: tuple[float, float] | None = (1.0, 0.0)) -> ClientWorld:
    _, admin_key = server.create_key(Role.admin)
    admin = ExpostClient(server.base_url, admin_key)
    analyst_key = admin.create_key(f"analyst-{secrets.token_hex(4)}", "analyst")
    viewer_key = admin.create_key(f"viewer-{secrets.token_hex(4)}", "viewer")
    assert analyst_key.key is not None
    assert viewer_key.key is not None
    dataset = admin.upload_dataset(CSV, SCHEMA, name="client data")
    assert admin.grant(dataset.id, analyst_key.name).created
    if budget is not None:
        admin.set_budget(dataset.id, *budget)
    return ClientWorld(
        server,
        admin,
        ExpostClient(server.base_url, analyst_key.key),
        analyst_key.name,
        analyst_key.key,
        ExpostClient(server.base_url, viewer_key.key),
        dataset.id,
    )


@pytest.fixture
def world(live_server: LiveServer) -> Iterator[ClientWorld]:
    made = build_world(live_server)
    yield made
    for client in (made.admin, made.analyst, made.viewer):
        client.close()


def pure_spent(world: ClientWorld) -> Any:
    budget = world.viewer.get_budget(world.dataset_id)
    assert budget is not None
    return budget.pure.spent


def ledger_events(world: ClientWorld, request_id: str) -> list[str]:
    return [
        str(e["event"]) for e in world.admin.ledger(world.dataset_id) if e.get("request_id") == request_id
    ]


# ----- the import contract ----------------------------------------------------------------------------------


ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIST = ROOT / "clients" / "python"
# Top-level modules of the server and its dependencies: importing the client must load none of them. (Not
# rich: httpx itself imports it for its command line when it happens to be installed.)
SERVER_MODULES = (
    "service",
    "mechanisms",
    "fastapi",
    "starlette",
    "uvicorn",
    "sqlalchemy",
    "alembic",
    "psycopg",
    "dramatiq",
    "redis",
    "limits",
    "typer",
    "structlog",
    "prometheus_client",
    "numpy",
    "scipy",
)


def test_importing_the_client_loads_no_server_module() -> None:
    code = (
        "import sys, expost_client; "
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {SERVER_MODULES!r}); "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def client_only_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter of a plain virtualenv (no system site-packages) where only ``pip install
    clients/python`` ran: the analysts' setup, without any of the server's dependencies."""
    where = tmp_path_factory.mktemp("client-only")
    source = where / "src"  # a copy: pip builds in the source tree, which must stay clean
    shutil.copytree(CLIENT_DIST, source, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return python


CLIENT_ONLY_SCRIPT = """
import asyncio, importlib.metadata, importlib.util, json, sys
from expost_client import AsyncExpostClient, BudgetExhaustedError, ExpostClient

url, key, dataset_id, server_modules = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
with ExpostClient(url, key) as client:
    committed = client.submit(dataset_id, "laplace", {"query": {"kind": "count"}, "epsilon": 0.1})
    try:
        client.submit(dataset_id, "laplace", {"query": {"kind": "count"}, "epsilon": 5.0})
        refusal = None
    except BudgetExhaustedError as refused:
        refusal = refused.summary()


async def fetch():
    async with AsyncExpostClient(url, key) as client:
        return (await client.get_request(committed.id)).state


print(json.dumps({
    "state": committed.state,
    "polled": asyncio.run(fetch()),
    "refusal": refusal,
    "requires": importlib.metadata.requires("expost-client"),
    "installed": sorted(
        d.metadata["Name"].lower().replace("_", "-") for d in importlib.metadata.distributions()
    ),
    "importable": [m for m in server_modules if importlib.util.find_spec(m) is not None],
    "loaded": sorted({m.split(".")[0] for m in sys.modules} & set(server_modules)),
    "typed": importlib.util.find_spec("expost_client").submodule_search_locations[0],
}))
"""


@pytest.mark.slow
def test_the_client_installs_alone_and_works_without_the_server_packages(
    client_only_python: Path, world: ClientWorld
) -> None:
    """``pip install ./clients/python`` into a plain virtualenv brings httpx and pydantic (and their own
    dependencies) only; there the client submits, is refused, and polls against the live server."""
    done = subprocess.run(
        [
            str(client_only_python),
            "-c",
            CLIENT_ONLY_SCRIPT,
            world.server.base_url,
            world.analyst_key,
            world.dataset_id,
            json.dumps(SERVER_MODULES),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=client_only_python.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout)
    assert sorted(seen["requires"]) == ["httpx<1,>=0.27", "pydantic<3,>=2.7"]
    assert seen["importable"] == []  # not even installed
    assert seen["loaded"] == []
    httpx_and_pydantic_closure = {
        "expost-client",
        "httpx",
        "httpcore",
        "h11",
        "anyio",
        "sniffio",
        "idna",
        "certifi",
        "pydantic",
        "pydantic-core",
        "annotated-types",
        "typing-extensions",
        "typing-inspection",
        "pip",
        "setuptools",
    }
    assert set(seen["installed"]) <= httpx_and_pydantic_closure, seen["installed"]
    assert (Path(seen["typed"]) / "py.typed").is_file()  # PEP 561: type checkers use its annotations
    assert seen["state"] == "committed"
    assert seen["polled"] == "committed"
    assert seen["refusal"] is not None
    assert "binding order" in seen["refusal"]
    assert pure_spent(world) == pytest.approx(0.1)  # charged once, from the client-only process


def test_type_checkers_see_the_installed_clients_types(tmp_path: Path) -> None:
    """py.typed: mypy --strict on analyst code reads the real return types from the installed package."""
    user_code = tmp_path / "analysis.py"
    user_code.write_text(
        "from collections.abc import AsyncIterator, Iterator\n"
        "from typing import Any, assert_type\n\n"
        "from expost_client import AnalysisRequest, AsyncExpostClient, Budget, ExpostClient\n\n\n"
        "async def check(sync: ExpostClient, asynchronous: AsyncExpostClient) -> None:\n"
        "    assert_type(sync.submit('d', 'laplace', {}), AnalysisRequest)\n"
        "    assert_type(sync.get_budget('d'), Budget | None)\n"
        "    assert_type(sync.ledger('d'), Iterator[dict[str, Any]])\n"
        "    assert_type(await asynchronous.submit('d', 'laplace', {}), AnalysisRequest)\n"
        "    assert_type(asynchronous.ledger('d'), AsyncIterator[dict[str, Any]])\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(user_code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_both_clients_have_the_same_methods_with_the_same_signatures() -> None:
    sync, asynchronous = ExpostClient("http://expost.test"), AsyncExpostClient("http://expost.test")
    names = {n for n in dir(ExpostClient) if not n.startswith("_")}
    assert names == {n for n in dir(AsyncExpostClient) if not n.startswith("_")}
    assert {"next", "submit", "ledger", "get_budget_cached"} <= names
    for name in names - {"close", "retry_policy", "base_url"}:
        method = getattr(sync, name)
        assert inspect.signature(method) == inspect.signature(getattr(asynchronous, name)), name
        assert "self" not in inspect.signature(method).parameters, name
        assert method.__doc__ == getattr(asynchronous, name).__doc__, name
        iterators = {"ledger", "list_requests", "list_sessions"}  # async iterators, not coroutines
        assert inspect.iscoroutinefunction(getattr(asynchronous, name)) is (name not in iterators), name
        assert not inspect.iscoroutinefunction(method), name
    assert inspect.iscoroutinefunction(asynchronous.close)
    sync.close()
    asyncio.run(asynchronous.close())


# ----- every method against the live server ----------------------------------------------------------------


class TestSyncClient:
    def test_health_readiness_and_catalog(self, world: ClientWorld) -> None:
        assert world.viewer.health() == {"status": "ok"}
        assert world.viewer.ready() == {"status": "ready"}
        catalog = {m.name: m for m in world.viewer.mechanisms()}
        assert catalog["laplace"].kind == "request"
        assert catalog["laplace"].cost_parameter == "epsilon"
        assert "properties" in catalog["laplace"].params_schema
        assert catalog["above_threshold"].kind == "session"
        assert catalog["above_threshold"].query_schema is not None

    def test_keys_datasets_and_grants(self, world: ClientWorld, tmp_path: Path) -> None:
        name = f"analyst-{secrets.token_hex(4)}"
        created = world.admin.create_key(name, "analyst")
        assert created.key is not None
        assert created.key.startswith(created.prefix)
        listed = {k.name: k for k in world.admin.list_keys()}
        assert listed[name].role == "analyst"
        assert listed[name].key is None  # never shown again

        path = tmp_path / "people.csv"
        path.write_bytes(CSV)
        from_path = world.admin.upload_dataset(path, SCHEMA)
        assert from_path.name == "people.csv"  # the file name when no name is given
        assert from_path.n_rows == 200
        assert from_path.schema_["neighboring"] == "replace_one"
        assert world.admin.get_dataset(from_path.id).content_sha256 == from_path.content_sha256
        assert from_path.raw["schema"] == from_path.schema_

        assert world.admin.grant(from_path.id, name).created is True
        assert world.admin.grant(from_path.id, name).created is False  # idempotent
        assert world.admin.grants(from_path.id) == [name]

        admin_sees = {d.id for d in world.admin.list_datasets()}
        assert {from_path.id, world.dataset_id} <= admin_sees
        analyst_sees = {d.id for d in world.analyst.list_datasets()}
        assert world.dataset_id in analyst_sees
        assert from_path.id not in analyst_sees

    def test_budgets_with_etags_and_the_cache(self, world: ClientWorld) -> None:
        updated = world.admin.set_budget(world.dataset_id, 2.0, 1e-6)
        assert updated.epsilon == 2.0
        assert updated.delta == 1e-6
        analyst_budget = world.admin.set_budget(world.dataset_id, 0.5, 0.0, analyst=world.analyst_name)
        assert analyst_budget.scope == "analyst"
        assert analyst_budget.analyst == world.analyst_name

        first = world.viewer.get_budget(world.dataset_id)
        assert isinstance(first, Budget)
        assert first.etag
        assert first.budget_set
        assert len(first.orders) == 20
        assert world.viewer.get_budget(world.dataset_id, etag=first.etag) is None  # 304
        own = world.analyst.get_budget(world.dataset_id, world.analyst_name)
        assert own is not None
        assert own.epsilon == 0.5

        cached = world.viewer.get_budget_cached(world.dataset_id)
        assert world.viewer.get_budget_cached(world.dataset_id) is cached  # revalidated, unchanged
        world.analyst.submit(world.dataset_id, "laplace", COUNT)
        changed = world.viewer.get_budget_cached(world.dataset_id)
        assert changed is not cached
        assert changed.etag != cached.etag
        assert changed.pure.spent == 0.1

    def test_estimate_submit_get_and_the_ledger(self, world: ClientWorld) -> None:
        estimate = world.analyst.estimate(world.dataset_id, "laplace", COUNT)
        assert estimate.admitted
        assert estimate.worst_case.pure == 0.1
        assert estimate.refusal_error is None
        assert pure_spent(world) == 0.0  # a dry run charges nothing

        request = world.analyst.submit(world.dataset_id, "laplace", COUNT)
        assert request.state == "committed"
        assert request.release is not None
        assert isinstance(request.release["value"], float)
        assert request.realized is not None
        assert request.realized.pure == 0.1
        again = world.analyst.get_request(request.id)
        assert again.id == request.id
        assert again.release == request.release
        assert world.admin.get_request(request.id).id == request.id

        world.analyst.submit(
            world.dataset_id, "laplace", {"query": {"kind": "mean", "column": "age"}, "epsilon": 0.2}
        )
        everything = list(world.viewer.ledger(world.dataset_id, page_size=2))  # several pages
        assert [e["seq"] for e in everything] == sorted(e["seq"] for e in everything)
        assert len(everything) == len({e["seq"] for e in everything}) >= 5
        first_page = world.viewer.ledger_page(world.dataset_id, limit=2)
        assert first_page.items == everything[:2]
        assert first_page.next_after == everything[1]["seq"]
        assert ledger_events(world, request.id) == ["reserve", "commit"]
        own = list(world.analyst.ledger(world.dataset_id))
        assert own
        assert all(e.get("request_id") for e in own)  # analysts see only their requests' entries

    def test_sessions(self, world: ClientWorld) -> None:
        world.admin.set_budget(world.dataset_id, 10.0, 0.0)
        session = world.analyst.open_session(world.dataset_id, "above_threshold", SESSION_PARAMS)
        assert session.state == "open"
        assert session.worst_case.pure == pytest.approx(2.0)
        below = world.analyst.ask(session.id, BELOW, 0.5, idempotency_key="step-1")
        assert below.above is False
        assert below.answer["index"] == 0
        replay = world.analyst.ask(session.id, BELOW, 0.5, idempotency_key="step-1")
        assert replay.answer == below.answer
        assert replay.session.asked == 1
        above = world.analyst.ask(session.id, ABOVE)  # ε_i defaults to max_query_epsilon
        assert above.above is True
        assert above.session.state == "closed"
        assert above.session.close_reason == "halted"
        fetched = world.analyst.get_session(session.id)
        assert fetched.asked == 2
        assert [s["answer"]["above"] for s in fetched.steps] == [False, True]
        closed = world.analyst.close_session(session.id)  # idempotent on a closed session
        assert closed.state == "closed"
        assert closed.realized is not None
        assert closed.realized.pure == pytest.approx(2.0)  # 2ε_i + ε′ for a halt

        with pytest.raises(ConflictError) as info:
            world.analyst.ask(session.id, BELOW, 0.5)
        assert not isinstance(info.value, BudgetExhaustedError)
        assert info.value.status == 409


# ----- errors carry the problem's details -------------------------------------------------------------------


class TestErrors:
    def test_an_exhausted_pure_budget_raises_with_the_refusal_details(self, world: ClientWorld) -> None:
        for _ in range(10):
            assert world.analyst.submit(world.dataset_id, "laplace", COUNT).state == "committed"
        with pytest.raises(BudgetExhaustedError) as info:
            world.analyst.submit(world.dataset_id, "laplace", COUNT)
        error = info.value
        assert isinstance(error, ConflictError)
        assert isinstance(error, ExpostError)
        assert error.status == 409
        assert error.type == "/problems/budget-exhausted"
        assert error.title == "Privacy budget exhausted"
        assert "cannot afford" in error.detail
        assert error.not_admissible is False
        assert error.affordable is None  # nothing is left
        assert error.binding_alpha == "pure"
        assert error.filter == "dataset"
        assert error.requested is not None
        assert error.requested["pure"] == 0.1
        assert len(error.orders) == 20
        assert all(
            {"requested", "spent", "reserved", "capacity", "remaining"} <= set(r) for r in error.orders
        )
        assert error.pure is not None
        assert error.pure["spent"] == 1.0
        assert error.binding_row == error.pure
        assert "affordable: nothing now" in error.summary()
        assert error.body["status"] == 409

        estimate = world.analyst.estimate(world.dataset_id, "laplace", COUNT)
        assert not estimate.admitted
        assert isinstance(estimate.refusal_error, BudgetExhaustedError)
        assert estimate.refusal_error.binding_alpha == "pure"

    def test_a_partial_refusal_names_the_affordable_epsilon(self, world: ClientWorld) -> None:
        world.analyst.submit(world.dataset_id, "laplace", {**COUNT, "epsilon": 0.75})
        with pytest.raises(BudgetExhaustedError) as info:
            world.analyst.submit(world.dataset_id, "laplace", {**COUNT, "epsilon": 0.5})
        affordable = info.value.affordable
        assert affordable is not None
        assert affordable["parameter"] == "epsilon"
        assert 0.249 < affordable["value"] <= 0.25
        assert "affordable: epsilon = 0.25" in info.value.summary()

    def test_not_admissible_is_a_budget_refusal_too(self, world: ClientWorld) -> None:
        with pytest.raises(BudgetExhaustedError) as info:  # a Gaussian on a pure budget
            world.analyst.submit(world.dataset_id, "gaussian", {"query": {"kind": "count"}, "sigma": 5})
        assert info.value.type == "/problems/not-admissible"
        assert info.value.not_admissible

    def test_invalid_input_names_the_field(self, world: ClientWorld) -> None:
        with pytest.raises(InvalidInputError) as info:
            world.analyst.submit(world.dataset_id, "laplace", {"query": {"kind": "count"}, "epsilon": -1})
        assert info.value.status == 422
        assert "params.epsilon" in info.value.fields
        assert info.value.errors[0]["reason"]
        assert pure_spent(world) == 0.0
        with pytest.raises(InvalidInputError):
            world.admin.set_budget(world.dataset_id, 1.0, 2.0)  # δ ≥ 1
        world.analyst.submit(world.dataset_id, "laplace", COUNT, idempotency_key="k-1")
        with pytest.raises(InvalidInputError) as reused:  # the same key for a different request
            world.analyst.submit(
                world.dataset_id, "laplace", {**COUNT, "epsilon": 0.2}, idempotency_key="k-1"
            )
        assert reused.value.type == "/problems/idempotency-key-reused"

    def test_not_found_auth_and_conflict(self, world: ClientWorld) -> None:
        with pytest.raises(NotFoundError) as missing:
            world.analyst.get_request("rq_doesnotexist")
        assert missing.value.status == 404
        with pytest.raises(NotFoundError):
            world.admin.get_dataset("ds_doesnotexist")
        with world.client("xp_not-a-key") as stranger, pytest.raises(AuthError) as unauthenticated:
            stranger.list_datasets()
        assert unauthenticated.value.status == 401
        with pytest.raises(AuthError) as forbidden:
            world.viewer.submit(world.dataset_id, "laplace", COUNT)
        assert forbidden.value.status == 403
        with pytest.raises(AuthError):
            world.analyst.create_key("someone", "admin")
        taken = world.admin.list_keys()[0].name
        with pytest.raises(ConflictError) as duplicate:
            world.admin.create_key(taken, "viewer")
        assert duplicate.value.status == 409


# ----- retries reuse the Idempotency-Key ------------------------------------------------------------------


class LosingTransport(httpx.HTTPTransport):
    """Sends every request for real; the first POST's response is read and then lost (ConnectError)."""

    def __init__(self, lose: int = 1) -> None:
        super().__init__()
        self.lose = lose
        self.attempts: list[tuple[str | None, dict[str, Any]]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.method != "POST":
            return response
        response.read()
        self.attempts.append((request.headers.get("Idempotency-Key"), response.json()))
        if len(self.attempts) <= self.lose:
            response.close()
            raise httpx.ConnectError("simulated: the response was lost", request=request)
        return response


class AsyncLosingTransport(httpx.AsyncHTTPTransport):
    def __init__(self, lose: int = 1) -> None:
        super().__init__()
        self.lose = lose
        self.attempts: list[tuple[str | None, dict[str, Any]]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.method != "POST":
            return response
        await response.aread()
        self.attempts.append((request.headers.get("Idempotency-Key"), response.json()))
        if len(self.attempts) <= self.lose:
            await response.aclose()
            raise httpx.ConnectError("simulated: the response was lost", request=request)
        return response


class TestRetries:
    def test_a_lost_response_is_retried_with_the_same_key_and_charged_once(self, world: ClientWorld) -> None:
        transport = LosingTransport(lose=2)
        with world.client(world.analyst_key, transport=transport, retry=FAST_RETRY) as client:
            request = client.submit(world.dataset_id, "laplace", COUNT)
        assert len(transport.attempts) == 3
        keys = {k for k, _ in transport.attempts}
        assert len(keys) == 1
        assert None not in keys
        ids = {body["id"] for _, body in transport.attempts}
        assert ids == {request.id}  # the server replayed the first request
        assert request.state == "committed"
        assert pure_spent(world) == 0.1  # charged once
        assert ledger_events(world, request.id) == ["reserve", "commit"]

    def test_an_explicit_key_is_the_one_retried(self, world: ClientWorld) -> None:
        transport = LosingTransport()
        with world.client(world.analyst_key, transport=transport, retry=FAST_RETRY) as client:
            cheap = {**SESSION_PARAMS, "max_query_epsilon": 0.1, "epsilon_threshold": 0.1}
            session = client.open_session(world.dataset_id, "above_threshold", cheap)
            assert [k for k, _ in transport.attempts] == [transport.attempts[0][0]] * 2
            transport.attempts.clear()
            answer = client.ask(session.id, BELOW, 0.1, idempotency_key="ask-once")
        assert [k for k, _ in transport.attempts] == ["ask-once", "ask-once"]
        assert answer.session.asked == 1  # the lost answer was replayed, not asked twice

    def test_retries_are_bounded(self, world: ClientWorld) -> None:
        transport = LosingTransport(lose=100)
        with (
            world.client(world.analyst_key, transport=transport, retry=FAST_RETRY) as client,
            pytest.raises(httpx.ConnectError),
        ):
            client.submit(world.dataset_id, "laplace", COUNT)
        assert len(transport.attempts) == FAST_RETRY.attempts
        assert len({k for k, _ in transport.attempts}) == 1
        assert pure_spent(world) == 0.1

    def test_async_retry_reuses_the_key(self, world: ClientWorld) -> None:
        transport = AsyncLosingTransport()
        key = world.analyst_key

        async def run() -> AnalysisRequest:
            async with AsyncExpostClient(
                world.server.base_url, key, transport=transport, retry=FAST_RETRY
            ) as c:
                return await c.submit(world.dataset_id, "laplace", COUNT)

        request = asyncio.run(run())
        assert len(transport.attempts) == 2
        assert transport.attempts[0][0] == transport.attempts[1][0]
        assert {body["id"] for _, body in transport.attempts} == {request.id}
        assert pure_spent(world) == 0.1


def test_5xx_is_retried_with_the_same_key_but_4xx_and_mechanism_failures_are_not() -> None:
    """The retry policy itself, on a scripted transport (a live server does not answer 503 on demand)."""
    seen: list[tuple[str, str | None]] = []
    script: list[httpx.Response] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("Idempotency-Key")))
        return script.pop(0)

    def problem(status: int, slug: str) -> httpx.Response:
        body = {"type": f"/problems/{slug}", "title": slug, "status": status, "detail": slug}
        return httpx.Response(status, json=body, headers={"Content-Type": "application/problem+json"})

    committed = {
        "id": "rq_1",
        "dataset_id": "ds_1",
        "analyst": "a",
        "mechanism": "laplace",
        "params": {},
        "state": "committed",
        "worst_case": {"orders": [2.0], "values": [0.1], "pure": 0.1},
        "realized": {"orders": [2.0], "values": [0.1], "pure": 0.1},
        "release": {"value": 1.0},
        "error": None,
        "created_at": "2024-01-01T00:00:00Z",
        "updated_at": "2024-01-01T00:00:00Z",
    }
    with ExpostClient(
        "http://expost.test", "xp_k", transport=httpx.MockTransport(handler), retry=FAST_RETRY
    ) as c:
        script[:] = [problem(503, "unavailable"), httpx.Response(502), httpx.Response(200, json=committed)]
        assert c.submit("ds_1", "laplace", COUNT).id == "rq_1"
        assert len(seen) == 3
        assert len({k for _, k in seen}) == 1

        seen.clear()
        script[:] = [problem(422, "invalid-input")]
        with pytest.raises(InvalidInputError):
            c.submit("ds_1", "laplace", COUNT)
        assert len(seen) == 1

        seen.clear()
        script[:] = [problem(500, "mechanism-failed")]
        with pytest.raises(MechanismFailedError):
            c.submit("ds_1", "laplace", COUNT)
        assert len(seen) == 1

        seen.clear()
        script[:] = [problem(503, "unavailable")] * FAST_RETRY.attempts
        with pytest.raises(ServerError) as info:
            c.submit("ds_1", "laplace", COUNT)
        assert info.value.status == 503
        assert len(seen) == FAST_RETRY.attempts

        seen.clear()
        script[:] = [httpx.Response(503, text="<html>bad gateway</html>")]
        with pytest.raises(ServerError):  # a key is never created twice: no retry on a response
            c.create_key("x", "viewer")
        assert len(seen) == 1


# ----- mechanism failures -------------------------------------------------------------------------------


class ExplodingLaplace(Laplace):
    name = "client_exploding_laplace"

    def run(self, params: BaseModel, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        raise RuntimeError("boom after reading the data")


class SlowLaplace(Laplace):
    """Takes a while: with wait_seconds=0 the POST answers 202 and the client polls."""

    name = "client_slow_laplace"

    def run(self, params: BaseModel, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        time.sleep(1.0)
        return super().run(params, ctx, table, noise)


@pytest.fixture
def extra_mechanisms() -> Iterator[None]:
    MECHANISMS[ExplodingLaplace.name] = ExplodingLaplace()
    MECHANISMS[SlowLaplace.name] = SlowLaplace()
    yield
    del MECHANISMS[ExplodingLaplace.name], MECHANISMS[SlowLaplace.name]


@pytest.mark.usefixtures("extra_mechanisms")
def test_a_mechanism_failure_is_a_server_error_charged_once(world: ClientWorld) -> None:
    with pytest.raises(MechanismFailedError) as info:
        world.analyst.submit(world.dataset_id, ExplodingLaplace.name, COUNT)
    assert isinstance(info.value, ServerError)
    assert info.value.status == 500
    assert pure_spent(world) == 0.1  # the worst case, once: a failure is never retried


# ----- 202 Accepted: polling with progress -----------------------------------------------------------------


@pytest.fixture
def slow_world(database_url: str, tmp_path: Path, extra_mechanisms: None) -> Iterator[ClientWorld]:
    settings = server_settings(database_url, tmp_path, wait_seconds=0, inline_mechanisms=set())
    with running_server(settings) as server:
        made = build_world(server)
        yield made
        for client in (made.admin, made.analyst, made.viewer):
            client.close()


class TestPolling:
    def test_a_202_is_polled_to_completion_with_progress(self, slow_world: ClientWorld) -> None:
        seen: list[dict[str, Any]] = []
        request = slow_world.analyst.submit(
            slow_world.dataset_id, SlowLaplace.name, COUNT, poll_interval=0.05, progress=seen.append
        )
        assert request.state == "committed"
        assert request.release is not None
        assert seen[0]["state"] == "running"  # the 202 body
        assert seen[-1]["state"] == "committed"
        assert len(seen) >= 3
        assert {body["id"] for body in seen} == {request.id}
        assert pure_spent(slow_world) == 0.1

    def test_no_wait_then_timeout_then_wait(self, slow_world: ClientWorld) -> None:
        running = slow_world.analyst.submit(slow_world.dataset_id, SlowLaplace.name, COUNT, wait=False)
        assert running.state == "running"
        assert running.release is None
        with pytest.raises(ExpostTimeoutError) as info:
            slow_world.analyst.wait_request(running.id, timeout=0)
        assert info.value.request_id == running.id
        assert isinstance(info.value, TimeoutError)
        done = slow_world.analyst.wait_request(running.id, timeout=30, poll_interval=0.05)
        assert done.state == "committed"
        with pytest.raises(ExpostTimeoutError):
            slow_world.analyst.submit(slow_world.dataset_id, SlowLaplace.name, COUNT, timeout=0.2)

    def test_a_polled_failure_raises(self, slow_world: ClientWorld) -> None:
        with pytest.raises(MechanismFailedError) as info:
            slow_world.analyst.submit(slow_world.dataset_id, ExplodingLaplace.name, COUNT, poll_interval=0.05)
        assert info.value.body["request_id"].startswith("rq_")

    def test_async_polling_awaits_an_async_progress_callback(self, slow_world: ClientWorld) -> None:
        seen: list[str] = []
        key = slow_world.analyst_key

        async def progress(body: dict[str, Any]) -> None:
            await asyncio.sleep(0)
            seen.append(body["state"])

        async def run() -> AnalysisRequest:
            async with AsyncExpostClient(slow_world.server.base_url, key) as client:
                return await client.submit(
                    slow_world.dataset_id, SlowLaplace.name, COUNT, poll_interval=0.05, progress=progress
                )

        request = asyncio.run(run())
        assert request.state == "committed"
        assert seen[0] == "running"
        assert seen[-1] == "committed"


# ----- the async client: the same methods, the same results ------------------------------------------------


def test_async_client_parity(live_server: LiveServer, tmp_path: Path) -> None:
    _, admin_key = live_server.create_key(Role.admin)
    path = tmp_path / "async.csv"
    path.write_bytes(CSV)

    async def run() -> None:
        async with AsyncExpostClient(live_server.base_url, admin_key) as admin:
            assert await admin.health() == {"status": "ok"}
            assert await admin.ready() == {"status": "ready"}
            assert "laplace" in {m.name for m in await admin.mechanisms()}
            analyst_key = await admin.create_key(f"async-{secrets.token_hex(4)}", "analyst")
            assert analyst_key.key is not None
            assert analyst_key.name in {k.name for k in await admin.list_keys()}
            dataset = await admin.upload_dataset(path, SCHEMA, name="async data")
            assert dataset.name == "async data"
            other = await admin.upload_dataset(CSV, SCHEMA)
            assert {dataset.id, other.id} <= {d.id for d in await admin.list_datasets()}
            assert (await admin.get_dataset(dataset.id)).n_rows == 200
            assert (await admin.grant(dataset.id, analyst_key.name)).created
            assert await admin.grants(dataset.id) == [analyst_key.name]
            await admin.set_budget(dataset.id, 1.0, 0.0)
            await admin.set_budget(dataset.id, 1.0, 0.0, analyst=analyst_key.name)

            async with AsyncExpostClient(live_server.base_url, analyst_key.key) as analyst:
                assert (await analyst.estimate(dataset.id, "laplace", COUNT)).admitted
                budget = await analyst.get_budget(dataset.id, analyst_key.name)
                assert budget is not None
                assert await analyst.get_budget(dataset.id, analyst_key.name, etag=budget.etag) is None
                cached = await analyst.get_budget_cached(dataset.id)
                assert await analyst.get_budget_cached(dataset.id) is cached
                request = await analyst.submit(dataset.id, "laplace", COUNT)
                assert request.state == "committed"
                assert (await analyst.get_request(request.id)).release == request.release
                assert (await analyst.get_budget_cached(dataset.id)).pure.spent == 0.1

                session = await analyst.open_session(
                    dataset.id,
                    "above_threshold",
                    {**SESSION_PARAMS, "epsilon_threshold": 0.1, "max_query_epsilon": 0.1, "max_queries": 2},
                )
                answer = await analyst.ask(session.id, BELOW, 0.1)
                assert answer.session.asked == 1
                assert (await analyst.get_session(session.id)).asked == 1
                closed = await analyst.close_session(session.id)
                assert closed.state == "closed"

                entries = [e async for e in admin.ledger(dataset.id, page_size=1)]
                assert [e["event"] for e in entries if e.get("request_id") == request.id] == [
                    "reserve",
                    "commit",
                ]
                assert (await admin.ledger_page(dataset.id, limit=1)).items == entries[:1]

                with pytest.raises(InvalidInputError) as invalid:
                    await analyst.submit(dataset.id, "laplace", {"query": {"kind": "count"}, "epsilon": -1})
                assert "params.epsilon" in invalid.value.fields
                with pytest.raises(NotFoundError):
                    await analyst.get_request("rq_doesnotexist")
                with pytest.raises(AuthError):
                    await analyst.list_keys()
                with pytest.raises(BudgetExhaustedError) as refused:
                    await analyst.submit(dataset.id, "laplace", {**COUNT, "epsilon": 1.0})
                affordable = refused.value.affordable
                assert affordable is not None
                assert affordable["parameter"] == "epsilon"

    asyncio.run(run())


class TestDashboardEndpoints:
    def test_activity_and_refusals_through_the_client(self, live_server: LiveServer) -> None:
        from tests.integration.helpers import make_world

        world = make_world(live_server, {"epsilon": 1.0, "delta": 0.0})
        analyst = ExpostClient(live_server.base_url, world.analyst.headers["Authorization"].split()[1])
        viewer = ExpostClient(live_server.base_url, world.viewer.headers["Authorization"].split()[1])
        with analyst, viewer:
            session = analyst.open_session(
                world.dataset_id,
                "above_threshold",
                {"threshold": 150, "epsilon_threshold": 0.1, "max_query_epsilon": 0.1, "max_queries": 3},
            )
            with pytest.raises(BudgetExhaustedError):
                analyst.submit(world.dataset_id, "laplace", {"query": {"kind": "count"}, "epsilon": 0.9})
            activity = viewer.activity(world.dataset_id)
            assert [s["id"] for s in activity["sessions"]] == [session.id]
            refusals = viewer.refusals_page(world.dataset_id)
            assert [r["problem_type"] for r in refusals.items] == ["/problems/budget-exhausted"]
            assert refusals.next_after is None

            async def async_side() -> tuple[dict[str, Any], int]:
                key = world.viewer.headers["Authorization"].split()[1]
                async with AsyncExpostClient(live_server.base_url, key) as client:
                    return await client.activity(world.dataset_id), len(
                        (await client.refusals_page(world.dataset_id)).items
                    )

            async_activity, async_refusals = asyncio.run(async_side())
            assert async_activity["sessions"] == activity["sessions"]
            assert async_refusals == 1


# ----- noise-reduction sessions: POST /v1/sessions/{id}/next ---------------------------------------------


class _LevelsParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    epsilons: list[float] = Field(min_length=1, max_length=5, description="ε of each level, increasing")


class _NextQuery(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ReleaseLevels:
    """Test-only, noise-reduction shaped session: level k releases the row count plus fresh Laplace noise of
    scale 1/ε_k (ε_k increasing, so each level is less noisy). The noise is independent across levels, so the
    charge is basic composition of pure ε-DP releases: Σ of the released ε_k (worst case: all of them); the
    count's sensitivity is ≤ 1 under either neighbouring, so this over-charges, never under-charges."""

    name: ClassVar[str] = "client_levels"
    summary: ClassVar[str] = "test only: release a count at increasing ε, one level per POST .../next"
    params_model: ClassVar[type[BaseModel]] = _LevelsParams
    query_model: ClassVar[type[BaseModel]] = _NextQuery

    def check(self, params: BaseModel, ctx: PublicContext) -> None:
        assert isinstance(params, _LevelsParams)
        if any(not 0 < e <= 10 for e in params.epsilons) or params.epsilons != sorted(params.epsilons):
            raise ParamsError("epsilons", "each in (0, 10], increasing")

    def worst_case(self, params: BaseModel, ctx: PublicContext) -> RdpCurve:
        assert isinstance(params, _LevelsParams)
        return RdpCurve.from_pure(sum(params.epsilons), ctx.orders)

    def check_query(self, params: BaseModel, ctx: PublicContext, query: BaseModel, asked: int) -> None:
        assert isinstance(params, _LevelsParams)
        if asked >= len(params.epsilons):
            raise ParamsError("next", "every level was released")

    def start(self, params: BaseModel, ctx: PublicContext, noise: Noise) -> dict[str, Any]:
        return {"level": 0}

    def step(
        self,
        params: BaseModel,
        ctx: PublicContext,
        state: dict[str, Any],
        query: BaseModel,
        table: Table,
        noise: Noise,
    ) -> StepResult:
        assert isinstance(params, _LevelsParams)
        level = int(state["level"])
        epsilon = params.epsilons[level]
        count = len(next(iter(table.values())))
        value = float(count + int(noise.discrete_laplace(Fraction(1) / Fraction(epsilon), 1)[0]))
        halted = level + 1 >= len(params.epsilons)
        return StepResult({"level": level, "epsilon": epsilon, "value": value}, {"level": level + 1}, halted)

    def realized(
        self,
        params: BaseModel,
        ctx: PublicContext,
        steps: list[tuple[dict[str, Any], dict[str, Any]]],
        halted: bool,
    ) -> RdpCurve:
        assert isinstance(params, _LevelsParams)
        return RdpCurve.from_pure(sum(params.epsilons[: len(steps)]), ctx.orders)


LEVELS = {"epsilons": [0.1, 0.2, 0.4]}


@pytest.fixture
def levels_mechanism() -> Iterator[None]:
    INTERACTIVE[ReleaseLevels.name] = ReleaseLevels()
    yield
    del INTERACTIVE[ReleaseLevels.name]


@pytest.mark.usefixtures("levels_mechanism")
class TestNext:
    def test_next_releases_each_level_then_the_session_is_closed(self, world: ClientWorld) -> None:
        session = world.analyst.open_session(world.dataset_id, ReleaseLevels.name, LEVELS)
        assert session.worst_case.pure == pytest.approx(0.7)
        first = world.analyst.next(session.id, idempotency_key="level-0")
        assert first.answer["level"] == 0
        assert first.answer["epsilon"] == 0.1
        assert isinstance(first.answer["value"], float)
        assert first.session.asked == 1
        assert first.session.state == "open"
        replay = world.analyst.next(session.id, idempotency_key="level-0")  # a retry is replayed
        assert replay.answer == first.answer
        assert replay.session.asked == 1
        assert world.analyst.next(session.id).answer["level"] == 1
        last = world.analyst.next(session.id)
        assert last.answer["level"] == 2
        assert last.session.state == "closed"
        assert last.session.close_reason == "halted"
        assert last.session.realized is not None
        assert last.session.realized.pure == pytest.approx(0.7)
        assert [s["answer"]["level"] for s in world.analyst.get_session(session.id).steps] == [0, 1, 2]
        with pytest.raises(ConflictError) as closed:
            world.analyst.next(session.id)
        assert closed.value.status == 409
        assert pure_spent(world) == pytest.approx(0.7)

    def test_closing_early_charges_only_the_released_levels(self, world: ClientWorld) -> None:
        session = world.analyst.open_session(world.dataset_id, ReleaseLevels.name, LEVELS)
        world.analyst.next(session.id)
        closed = world.analyst.close_session(session.id)
        assert closed.realized is not None
        assert closed.realized.pure == pytest.approx(0.1)
        assert pure_spent(world) == pytest.approx(0.1)

    def test_next_errors(self, world: ClientWorld) -> None:
        with pytest.raises(NotFoundError):
            world.analyst.next("se_doesnotexist")
        world.admin.set_budget(world.dataset_id, 10.0, 0.0)
        at = world.analyst.open_session(world.dataset_id, "above_threshold", SESSION_PARAMS)
        with pytest.raises(InvalidInputError) as invalid:  # an AboveThreshold step needs a query
            world.analyst.next(at.id)
        assert invalid.value.status == 422
        assert any(f.startswith("query") for f in invalid.value.fields)
        assert world.analyst.get_session(at.id).asked == 0
        levels = world.analyst.open_session(world.dataset_id, ReleaseLevels.name, LEVELS)
        with pytest.raises(AuthError) as forbidden:
            world.viewer.next(levels.id)
        assert forbidden.value.status == 403

    def test_a_lost_next_is_retried_with_the_same_key_and_released_once(self, world: ClientWorld) -> None:
        session = world.analyst.open_session(world.dataset_id, ReleaseLevels.name, LEVELS)
        transport = LosingTransport(lose=2)
        with world.client(world.analyst_key, transport=transport, retry=FAST_RETRY) as client:
            answer = client.next(session.id)
        assert len(transport.attempts) == 3
        assert len({k for k, _ in transport.attempts}) == 1
        assert None not in {k for k, _ in transport.attempts}
        assert {body["answer"]["value"] for _, body in transport.attempts} == {answer.answer["value"]}
        assert answer.session.asked == 1  # the lost answer was replayed, not the next level released
        assert answer.answer["level"] == 0

    def test_async_next(self, world: ClientWorld) -> None:
        key = world.analyst_key

        async def run() -> list[int]:
            async with AsyncExpostClient(world.server.base_url, key) as client:
                session = await client.open_session(world.dataset_id, ReleaseLevels.name, LEVELS)
                levels = [(await client.next(session.id)).answer["level"] for _ in range(3)]
                with pytest.raises(ConflictError):
                    await client.next(session.id)
                return levels

        assert asyncio.run(run()) == [0, 1, 2]
        assert pure_spent(world) == pytest.approx(0.7)


# ----- progress while polling (scripted: the fields are optional on the server) --------------------------


def _request_body(state: str, **extra: Any) -> dict[str, Any]:
    curve = {"orders": [2.0], "values": [0.1], "pure": 0.1}
    return {
        "id": "rq_1",
        "dataset_id": "ds_1",
        "analyst": "a",
        "mechanism": "laplace",
        "params": {},
        "state": state,
        "worst_case": curve,
        "realized": curve if state == "committed" else None,
        "release": {"value": 1.0} if state == "committed" else None,
        "error": None,
        "created_at": "2024-01-01T00:00:00Z",
        "updated_at": "2024-01-01T00:00:00Z",
        **extra,
    }


def _polled_script() -> list[httpx.Response]:
    return [
        httpx.Response(202, json=_request_body("running", progress=0.0, elapsed_seconds=0.0)),
        httpx.Response(200, json=_request_body("running", progress=0.5, elapsed_seconds=1.5)),
        httpx.Response(200, json=_request_body("running", elapsed_seconds=2.0)),  # progress is not public
        httpx.Response(200, json=_request_body("committed", progress=1.0, elapsed_seconds=3.0)),
    ]


def test_progress_and_elapsed_seconds_reach_the_model_and_the_callback() -> None:
    script = _polled_script()
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(f"{request.method} {request.url.path}")
        return script.pop(0)

    seen: list[dict[str, Any]] = []
    with ExpostClient("http://expost.test", "xp_k", transport=httpx.MockTransport(handler)) as client:
        done = client.submit("ds_1", "laplace", COUNT, poll_interval=0.0, progress=seen.append)
    assert paths == ["POST /v1/datasets/ds_1/requests"] + ["GET /v1/requests/rq_1"] * 3
    assert [body.get("progress") for body in seen] == [0.0, 0.5, None, 1.0]
    assert [body["elapsed_seconds"] for body in seen] == [0.0, 1.5, 2.0, 3.0]
    assert done.state == "committed"
    assert done.progress == 1.0
    assert done.elapsed_seconds == 3.0
    old_server = AnalysisRequest.from_json(_request_body("committed"))  # the fields are optional
    assert old_server.progress is None
    assert old_server.elapsed_seconds is None

    async_script = _polled_script()

    async def async_handler(request: httpx.Request) -> httpx.Response:
        return async_script.pop(0)

    async_seen: list[float | None] = []

    async def progress(body: dict[str, Any]) -> None:
        await asyncio.sleep(0)
        async_seen.append(body.get("progress"))

    async def run() -> AnalysisRequest:
        mock = httpx.MockTransport(async_handler)
        async with AsyncExpostClient("http://expost.test", "xp_k", transport=mock) as client:
            return await client.submit("ds_1", "laplace", COUNT, poll_interval=0.0, progress=progress)

    assert asyncio.run(run()).progress == 1.0
    assert async_seen == [0.0, 0.5, None, 1.0]


class ProgressLaplace(Laplace):
    """Long-running with public progress: reports 1/5 … 4/5 over about a second, then releases."""

    name = "client_progress_laplace"
    long_running = True
    progress_is_public = True

    def run(
        self,
        params: BaseModel,
        ctx: PublicContext,
        table: Table,
        noise: Noise,
        progress: ProgressFn = no_progress,
    ) -> Release:
        for step in range(1, 5):  # four steps of work, not a loop over rows
            time.sleep(0.25)
            progress(step / 5)
        return super().run(params, ctx, table, noise)


class SecretProgressLaplace(ProgressLaplace):
    """The same, but its progress is not public: only the state and the elapsed time are shown."""

    name = "client_secret_progress_laplace"
    progress_is_public = False


@pytest.fixture
def progress_world(database_url: str, tmp_path: Path) -> Iterator[ClientWorld]:
    MECHANISMS[ProgressLaplace.name] = ProgressLaplace()
    MECHANISMS[SecretProgressLaplace.name] = SecretProgressLaplace()
    settings = server_settings(
        database_url, tmp_path, wait_seconds=0, inline_mechanisms=set(), heartbeat_seconds=0.05
    )
    try:
        with running_server(settings) as server:
            made = build_world(server)
            yield made
            for client in (made.admin, made.analyst, made.viewer):
                client.close()
    finally:
        del MECHANISMS[ProgressLaplace.name], MECHANISMS[SecretProgressLaplace.name]


class TestLiveProgress:
    def test_public_progress_reaches_the_callback(self, progress_world: ClientWorld) -> None:
        seen: list[dict[str, Any]] = []
        request = progress_world.analyst.submit(
            progress_world.dataset_id, ProgressLaplace.name, COUNT, poll_interval=0.05, progress=seen.append
        )
        assert request.state == "committed"
        assert request.progress == 1.0
        assert request.elapsed_seconds is not None
        assert request.elapsed_seconds >= 1.0  # four sleeps of 0.25 s
        assert request.started_at is not None
        fractions = [body.get("progress") for body in seen]
        shown = [f for f in fractions if f is not None]
        assert shown == sorted(shown)  # never goes back
        assert any(0 < f < 1 for f in shown), fractions  # a poll saw it partway
        assert fractions[-1] == 1.0
        running = [body["elapsed_seconds"] for body in seen if body["state"] == "running"]
        assert running  # the polls saw it running (elapsed time is wall-clock: no monotonicity check)

    def test_secret_progress_is_never_shown(self, progress_world: ClientWorld) -> None:
        seen: list[dict[str, Any]] = []
        request = progress_world.analyst.submit(
            progress_world.dataset_id,
            SecretProgressLaplace.name,
            COUNT,
            poll_interval=0.05,
            progress=seen.append,
        )
        assert request.state == "committed"
        assert len(seen) >= 3
        assert all(body.get("progress") is None for body in seen)
        assert request.progress is None
        assert request.elapsed_seconds is not None
        assert request.elapsed_seconds >= 1.0


# ----- per-instance privacy reports: POST /v1/requests/{id}/privacy-report ---------------------------------

REPORT_SCHEMA: dict[str, Any] = {
    "columns": [
        {"name": "x1", "type": "float", "min": -1, "max": 1},
        {"name": "x2", "type": "float", "min": -1, "max": 1},
        {"name": "label", "type": "categorical", "values": ["no", "yes"]},
    ],
    "neighboring": "add_remove",
}
REPORT_PARAMS = {
    "features": ["x1", "x2"],
    "label": "label",
    "regularization": 2.0,
    "sigma": 3.0,
    "max_rows": 1000,
}
RECORD = {"x1": 0.4, "x2": -0.2, "label": "yes"}


def _report_csv(n: int = 200) -> bytes:
    rng = np.random.default_rng(7)
    x1, x2 = rng.uniform(-1, 1, n), rng.uniform(-1, 1, n)
    label = (x1 - 0.5 * x2 + 0.3 * rng.normal(size=n)) > 0
    rows = [f"{a:.6f},{b:.6f},{'yes' if y else 'no'}" for a, b, y in zip(x1, x2, label, strict=True)]
    return ("x1,x2,label\n" + "\n".join(rows) + "\n").encode()


def test_privacy_report_is_free_deterministic_and_typed(world: ClientWorld) -> None:
    dataset = world.admin.upload_dataset(_report_csv(), REPORT_SCHEMA, name="report data")
    world.admin.grant(dataset.id, world.analyst_name)
    world.admin.set_budget(dataset.id, 50.0, 1e-5)
    trained = world.analyst.submit(dataset.id, "objpert.logistic", REPORT_PARAMS, poll_interval=0.05)
    assert trained.state == "committed"
    budget = world.viewer.get_budget_cached(dataset.id)
    entries = len(list(world.admin.ledger(dataset.id)))

    report = world.analyst.privacy_report(trained.id, RECORD)
    assert isinstance(report, PrivacyReport)
    assert report.request_id == trained.id
    assert report.mechanism == "objpert.logistic"
    assert report.report_kind == "public"
    assert report.charged == 0.0
    assert isinstance(report.ex_post_epsilon_upper, float)
    assert 0 < report.ex_post_epsilon_upper < 50
    assert 0 < report.confidence < 1
    assert report.terms
    assert report.personalized_rdp.orders == dataset.orders
    assert len(report.personalized_rdp.values) == len(report.personalized_rdp.orders)
    assert world.admin.privacy_report(trained.id, RECORD).raw == report.raw  # deterministic
    assert world.viewer.get_budget_cached(dataset.id) is budget  # nothing charged: the ETag did not move
    assert len(list(world.admin.ledger(dataset.id))) == entries

    async def async_report() -> PrivacyReport:
        async with AsyncExpostClient(world.server.base_url, world.analyst_key) as client:
            return await client.privacy_report(trained.id, RECORD)

    assert asyncio.run(async_report()).raw == report.raw

    with pytest.raises(InvalidInputError) as missing:
        world.analyst.privacy_report(trained.id, {"x1": 0.4, "x2": -0.2})
    assert missing.value.fields == ["record.label"]
    with pytest.raises(InvalidInputError):
        world.analyst.privacy_report(trained.id, {**RECORD, "x1": "high"})
    laplace = world.analyst.submit(world.dataset_id, "laplace", COUNT)
    with pytest.raises(ConflictError) as no_report:  # a Laplace release publishes no report
        world.analyst.privacy_report(laplace.id, RECORD)
    assert no_report.value.status == 409
    with pytest.raises(NotFoundError):
        world.analyst.privacy_report("rq_doesnotexist", RECORD)
    with pytest.raises(AuthError) as forbidden:
        world.viewer.privacy_report(trained.id, RECORD)
    assert forbidden.value.status == 403
