"""Shared fixtures: real databases (SQLite file and a fresh PostgreSQL database) and live HTTP servers.

PostgreSQL: ``EXPOST_TEST_POSTGRES_URL`` (default: the local server, database ``test``) is used to
create a throw-away database per test session. With ``CI=true`` an unreachable server is an error, never
a skip.

S3: ``s3_server`` is a real moto server on loopback (session-scoped, one bucket), for the snapshot store.

Hypothesis: two profiles. ``dev`` (the default) keeps the property tests small so that the unit layer
stays quick; ``ci`` runs them at full size (200 examples, 40 steps per stateful run). ``ci`` is chosen by
``CI=true`` or ``HYPOTHESIS_PROFILE=ci``; ``HYPOTHESIS_PROFILE`` names any registered profile. A test that
sets ``max_examples`` itself keeps its own number under both.
"""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from service.auth import Role, create_key
from service.config import Settings
from service.embedded import serve_in_thread
from service.runs.writer import WriteBatcher
from service.store.engine import make_engine, make_sessionmaker
from service.store.migrate import upgrade

POSTGRES_URL = os.environ.get("EXPOST_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
IN_CI = os.environ.get("CI", "").lower() == "true"

# No per-example deadline and no too-slow health check: on a loaded 2-core machine an example's wall time says
# nothing about the property under test (a deadline failure is the machine's, not the code's).
_UNTIMED = hypothesis_settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.register_profile("dev", _UNTIMED, max_examples=30, stateful_step_count=20)
hypothesis_settings.register_profile("ci", _UNTIMED, max_examples=200, stateful_step_count=40)
# Loaded here, before any test module builds its ``settings(...)``: those inherit the profile's numbers.
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if IN_CI else "dev"))

# The slowest files, measured (junit times of a full CI run): collected first, so that `--dist loadfile`
# hands them out first and the two workers finish together instead of one running a long file alone at
# the end (longest-first scheduling). Order within a file is unchanged.
SLOW_FIRST = (
    "integration/test_api_fuzz.py",
    "integration/test_crash_safety.py",
    "statistical/test_above_threshold_audit.py",
    "statistical/test_noise_reduction_audit.py",
    "integration/test_fair_execution_processes.py",
    "unit/test_rgm_gd.py",
    "e2e/test_dashboard.py",
    "statistical/test_accuracy_first_erm_audit.py",
    "statistical/test_adaptive_clipping_audit.py",
    "unit/test_relative_gaussian.py",
    "statistical/test_relative_gaussian_audit.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    root = Path(__file__).parent

    def slowness(item: pytest.Item) -> int:
        return rank.get(item.path.relative_to(root).as_posix(), len(SLOW_FIRST))

    items.sort(key=slowness)  # stable: files and tests keep their order otherwise


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def postgres_available() -> bool:
    try:
        with psycopg.connect(_libpq(POSTGRES_URL), connect_timeout=3):
            return True
    except psycopg.OperationalError:
        return False


@dataclass
class FreshDatabase:
    url: str
    drop: Callable[[], None]


def fresh_postgres_database() -> FreshDatabase:
    if not postgres_available():
        message = f"PostgreSQL is not reachable at {POSTGRES_URL}"
        if IN_CI:
            pytest.fail(f"{message} (CI=true: PostgreSQL tests must run)", pytrace=False)
        pytest.skip(f"{message}; start it with pg_ctlcluster (see README)")
    name = f"expost_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_libpq(POSTGRES_URL), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(_libpq(POSTGRES_URL), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    url = make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    return FreshDatabase(url, drop)


@pytest.fixture(scope="session", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A migrated database on each backend (SQLite file, fresh PostgreSQL database)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'expost.db'}"
        upgrade(url)
        yield url
        return
    fresh = fresh_postgres_database()
    upgrade(fresh.url)
    yield fresh.url
    fresh.drop()


@pytest.fixture
def sessions(database_url: str) -> Iterator[sessionmaker[Session]]:
    """A session factory on ``database_url`` (one engine per test, disposed afterwards)."""
    engine = make_engine(database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture
def batcher(sessions: sessionmaker[Session]) -> Iterator[WriteBatcher]:
    """A group-commit writer on ``sessions`` (its thread stopped afterwards)."""
    batch_writer = WriteBatcher(sessions)
    yield batch_writer
    batch_writer.stop()


@dataclass
class LiveServer:
    base_url: str
    settings: Settings

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=30)

    def create_key(self, role: Role, name: str | None = None) -> tuple[str, str]:
        """A new key straight in the database (as `expost keys create` does): (name, key)."""
        name = name or f"{role.value}-{secrets.token_hex(4)}"
        engine = make_engine(self.settings.database_url)
        try:
            with make_sessionmaker(engine)() as session, session.begin():
                key = create_key(session, name, role)
        finally:
            engine.dispose()
        return name, key


@contextmanager
def running_server(settings: Settings) -> Iterator[LiveServer]:
    """uvicorn serving the real app on a real port, in a thread of the test process."""
    with serve_in_thread(settings) as base_url:
        yield LiveServer(base_url, settings)


def server_settings(database_url: str, data_dir: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "database_url": database_url,
        "data_dir": data_dir,
        "wait_seconds": 20,
        "reaper_interval_seconds": 0.5,
        # Each test server its own queue: the database is the queue, and servers sharing a test database
        # must not run each other's requests (a deployment's workers claim only its queue's requests).
        "queue_name": f"t{uuid.uuid4().hex[:12]}",
        # The suite sends hundreds of bad keys from 127.0.0.1 on purpose (authorization checks); the
        # failed-authentication limit is tested on servers of its own (test_rate_limit.py).
        "rate_limit_failed_auth": "",
        **overrides,
    }
    return Settings.model_validate(values)


@pytest.fixture(scope="session")
def live_server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The shared test server of a backend (one per test session and backend)."""
    with running_server(server_settings(database_url, tmp_path_factory.mktemp("data"))) as server:
        yield server


@dataclass(frozen=True)
class S3Server:
    """An S3-compatible server (moto) on loopback, with one bucket; ``endpoint_url`` is ``http://…``."""

    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str
    region: str


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A real moto S3 server in this test process (one per session, shared): tests that share it use their
    own key prefix in ``bucket``. No network: it listens on 127.0.0.1, on a free port."""
    import boto3  # test-only: the service reaches S3 through pyarrow.fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Server(f"http://{host}:{port}", "expost-test", "testing-key", "testing-secret", "us-east-1")
    client = boto3.client(
        "s3",
        endpoint_url=s3.endpoint_url,
        aws_access_key_id=s3.access_key,
        aws_secret_access_key=s3.secret_key,
        region_name=s3.region,
    )
    client.create_bucket(Bucket=s3.bucket)
    yield s3
    server.stop()
