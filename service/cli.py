"""The ``expost`` command line.

Local commands (they open the database named by ``EXPOST_DATABASE_URL``; the default
``sqlite:///./var/expost.db`` is relative to the current folder): serve, migrate, worker, keys
create/list/revoke, datasets add/archive, ledger verify, demo. keys list/revoke, datasets archive and ledger
verify never create a database: without a migrated one they exit 2 naming where they looked. Remote
commands (they talk to a server over HTTP with :mod:`expost_client`, ``--url``/``EXPOST_URL`` and
``--key``/``EXPOST_KEY``): request submit/get/cancel/estimate, session open/ask/close/get, budget set/show,
grant, grants add/list/revoke.

Remote commands print rich tables by default and the server's raw JSON with ``--json`` (with ``--json``
a problem+json error body is printed on stdout too). Errors go to stderr with the problem's title and
detail; exit 3 for a budget refusal (with a requested / remaining / affordable summary), 2 for any other
4xx or unusable input (bad ``--params`` JSON), 1 otherwise (5xx, unreachable server, a wait that timed
out).
"""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import httpx
import typer
from rich.console import Console, Group
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from expost_client import (
    AnalysisRequest,
    Budget,
    BudgetExhaustedError,
    Curve,
    ExpostClient,
    ExpostError,
    ExpostTimeoutError,
    InvalidInputError,
)
from expost_client import Session as AnalysisSession
from service.config import get_settings
from service.logs import configure_logging

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from mechanisms.base import PublicContext
    from mechanisms.base import Table as DataTable
    from service.store.models import Dataset

# The database, numpy and the service's own modules are imported inside the local commands, so that the
# remote commands (which need only httpx, pydantic and rich) start quickly.

app = typer.Typer(
    help="expost: privacy budgets as a persistent ex-post Rényi-DP filter",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
keys_app = typer.Typer(help="API keys", no_args_is_help=True)
datasets_app = typer.Typer(help="Datasets", no_args_is_help=True)
ledger_app = typer.Typer(help="The ledger", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(datasets_app, name="datasets")
app.add_typer(ledger_app, name="ledger")


class KeyRole(StrEnum):
    """The roles of service.auth.Role (kept here so that the CLI starts without SQLAlchemy)."""

    admin = "admin"
    analyst = "analyst"
    viewer = "viewer"


def _sessions() -> sessionmaker[Session]:
    from service.store.engine import make_engine, make_sessionmaker
    from service.store.migrate import NotMigrated, ensure_migrated

    settings = get_settings()
    engine = make_engine(settings.database_url)
    try:
        ensure_migrated(engine, settings.database_url)
    except NotMigrated as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return make_sessionmaker(engine)


DEFAULT_DATABASE_HINT = "set EXPOST_DATABASE_URL or run from the service's folder"


def _database_location(url: str) -> str:
    """Where ``url`` points, for messages: a SQLite file as an absolute path (the default
    ``sqlite:///./var/expost.db`` is relative to the current folder), any other URL without its password."""
    from sqlalchemy.engine import make_url

    from service.store.engine import is_sqlite

    parsed = make_url(url)
    if is_sqlite(url) and parsed.database and parsed.database != ":memory:":
        return str(Path(parsed.database).resolve())
    return parsed.render_as_string(hide_password=True)


def _existing_sessions() -> sessionmaker[Session]:
    """Sessions on the expost database named by ``EXPOST_DATABASE_URL``, which must already exist and be
    migrated: unlike :func:`_sessions` nothing is created or changed (no SQLite file, no folder), so that a
    command run from another folder refuses in one line (exit 2) instead of leaving an empty database
    there."""
    from sqlalchemy.engine import make_url

    from service.store.engine import is_sqlite, make_engine, make_sessionmaker
    from service.store.migrate import head_revision

    url = get_settings().database_url
    where = _database_location(url)
    database = make_url(url).database
    if is_sqlite(url):
        if not (database and database != ":memory:" and Path(database).is_file()):
            _fail(f"no expost database at {where}; {DEFAULT_DATABASE_HINT}", EXIT_INPUT)
        current = _sqlite_revision(Path(database), where)
    else:
        current = _server_revision(url, where)
    if current is None:
        _fail(f"no expost database at {where} (no expost schema in it); {DEFAULT_DATABASE_HINT}", EXIT_INPUT)
    head = head_revision(url)
    if current != head:
        _fail(
            f"the expost database at {where} is at revision {current}, not {head}: run `expost migrate`",
            EXIT_INPUT,
        )
    return make_sessionmaker(make_engine(url))


def _sqlite_revision(path: Path, where: str) -> str | None:
    """The Alembic revision of a SQLite file, read through a read-only connection (an empty or foreign file
    is left exactly as it is: the engine's WAL pragma would rewrite it); None without one."""
    import sqlite3

    try:
        with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as connection:
            tables = connection.execute("SELECT name FROM sqlite_master WHERE name = 'alembic_version'")
            if tables.fetchone() is None:
                return None
            row = connection.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.Error as exc:
        _fail(f"cannot read the expost database at {where} ({exc}); {DEFAULT_DATABASE_HINT}", EXIT_INPUT)
    return None if row is None else str(row[0])


def _server_revision(url: str, where: str) -> str | None:
    """The Alembic revision of a database server's database (None without one); exit 2 if it cannot be
    opened (no such database, server down, refused credentials)."""
    from sqlalchemy.exc import SQLAlchemyError

    from service.store.engine import make_engine
    from service.store.migrate import current_revision

    engine = make_engine(url, pool_size=1)
    try:
        return current_revision(engine)
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        _fail(f"cannot open the expost database at {where} ({reason}); {DEFAULT_DATABASE_HINT}", EXIT_INPUT)
    finally:
        engine.dispose()


@app.command()
def migrate() -> None:
    """Upgrade the database schema to the latest revision."""
    from service.store.migrate import upgrade

    settings = get_settings()
    upgrade(settings.database_url)
    typer.echo("database is at the latest revision")


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be served (already in use, not allowed, no such address), or None.

    Binds and closes a socket the way uvicorn does (SO_REUSEADDR, so a port in TIME_WAIT is free), before
    the server starts, so that a busy port is one clear line and not a start-up followed by Errno 98.
    """
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (
                    f"port {port} on {host} is already in use (another expost or another program). "
                    f"Stop it, or choose another port: `expost serve --port N` (`make run PORT=N`)."
                )
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="interface to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port")] = 8000,
    workers: Annotated[int, typer.Option(help="server processes")] = 1,
) -> None:
    """Run the HTTP service (refuses to start on an unmigrated database or a port in use)."""
    import uvicorn

    from service.api.wire import HTTP_PROTOCOL

    problem = port_problem(host, port)
    if problem is not None:
        typer.echo(f"expost serve: {problem}", err=True)
        raise typer.Exit(1)
    settings = get_settings()
    configure_logging(settings.log_level, settings.log_json)
    _sessions()
    uvicorn.run(
        "service.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level="warning",
        access_log=False,
        http=HTTP_PROTOCOL,  # the parser's own 400s as problem+json
        # SIGTERM: stop accepting, drain (POSTs waiting for a release answer 202 at once), let runs finish
        # within the grace period, then stop them (Runtime.close); this only bounds slow connections.
        timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_seconds)),
    )


@app.command()
def worker(
    interval: Annotated[float, typer.Option(help="seconds between reaper passes")] = 15.0,
    once: Annotated[bool, typer.Option(help="run one reaper pass and exit (no task consumption)")] = False,
    queue: Annotated[
        bool | None,
        typer.Option(
            "--queue/--no-queue",
            help="consume the task queue (default: when EXPOST_EXECUTOR=queue)",
            show_default=False,
        ),
    ] = None,
    threads: Annotated[int, typer.Option(min=1, help="task threads in this process (queue mode)")] = 1,
) -> None:
    """Worker: run queued requests (EXPOST_EXECUTOR=queue) and reap lost ones.

    In queue mode it consumes request ids from the Dramatiq queue on EXPOST_BROKER_URL, claims each
    request in the database (a lease), runs it and settles it once; start as many as you like, on any
    machine that reaches the database and the broker. In every mode it also commits the worst case of
    requests whose lease expired (a lost worker) and closes expired sessions, every ``--interval`` seconds.
    """
    import signal
    import threading
    import time

    from service.runs.sessions import expire_sessions
    from service.runs.worker import reap_expired

    settings = get_settings()
    configure_logging(settings.log_level, settings.log_json)
    sessions = _sessions()
    consume = (settings.executor == "queue") if queue is None else queue
    if once:
        reaped, expired = reap_expired(sessions, settings.max_queue_seconds), expire_sessions(sessions)
        typer.echo(f"reaped {reaped} requests, closed {expired} expired sessions")
        return
    stop = threading.Event()
    signalled: list[float] = []

    def on_signal(*_: object) -> None:  # the grace period starts at the first signal
        if not signalled:
            signalled.append(time.monotonic())
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    consumer = None
    if consume:
        from service.runs.queue import QueueWorker

        consumer = QueueWorker(settings, threads)
        consumer.start()
        typer.echo(f"worker consuming queue {settings.queue_name!r} with {threads} thread(s)")
    try:
        while not stop.is_set():
            try:
                reaped = reap_expired(sessions, settings.max_queue_seconds)
                expired = expire_sessions(sessions)
                if reaped or expired or not consume:
                    typer.echo(f"reaped {reaped} requests, closed {expired} expired sessions")
            except Exception as exc:  # e.g. the database restarting: try again next pass
                typer.echo(f"reaper pass failed: {type(exc).__name__}", err=True)
            stop.wait(interval)
    finally:
        if consumer is not None:
            # SIGTERM: stop consuming; runs in flight may finish within the grace period, then they are
            # stopped and charged their worst case (their data was read); queued requests stay queued.
            started = signalled[0] if signalled else time.monotonic()
            typer.echo(f"worker stopping (grace {settings.shutdown_grace_seconds:g} s)")
            consumer.stop(started + settings.shutdown_grace_seconds)
            typer.echo("worker stopped")


@keys_app.command("create")
def keys_create(
    role: Annotated[KeyRole, typer.Option(help="admin, analyst or viewer")],
    name: Annotated[str, typer.Option(help="unique name; analysts are granted by this name")],
) -> None:
    """Create an API key and print it once."""
    from service.auth import Role, create_key
    from service.errors import ServiceError
    from service.store import unit

    sessions = _sessions()
    try:
        with unit.transaction(sessions) as session:
            key = create_key(session, name, Role(role.value))
    except ServiceError as exc:
        typer.echo(f"error: {exc.detail}", err=True)
        raise typer.Exit(1) from None
    typer.echo(key)


@keys_app.command("list")
def keys_list(
    as_json: Annotated[bool, typer.Option("--json", help="print JSON (for scripts)")] = False,
) -> None:
    """List the API keys in the database (never the keys themselves): name, role, prefix, when created and
    when revoked (– while the key works)."""
    from service.runs import views

    with _existing_sessions()() as session:
        rows = [
            {
                "name": key.name,
                "role": key.role,
                "prefix": key.prefix,
                "created_at": key.created_at.isoformat(),
                "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
            }
            for key in views.keys(session)
        ]
    if as_json:
        _print_json(rows)
        return
    table = Table("name", "role", "prefix", "created (UTC)", "revoked (UTC)", title=f"{len(rows)} API keys")
    for row in rows:
        created, revoked = (_minute(row[column]) for column in ("created_at", "revoked_at"))
        table.add_row(row["name"], row["role"], row["prefix"], created, revoked)
    _show(table)


def _minute(iso: str | None) -> str:
    """An ISO time as ``YYYY-MM-DD HH:MM`` for a table (– for none)."""
    return "–" if iso is None else iso[:16].replace("T", " ")


def _key_name(sessions: sessionmaker[Session], name_or_prefix: str) -> str:
    """The name of the key called ``name_or_prefix``, else of the one key whose prefix (``xp_…``, as `keys
    list` shows it) it is; a prefix shared by several keys exits 2 asking for the name."""
    from sqlalchemy import select

    from service.store.models import ApiKey

    with sessions() as session:
        if session.scalar(select(ApiKey.id).where(ApiKey.name == name_or_prefix)) is not None:
            return name_or_prefix
        named = session.scalars(select(ApiKey.name).where(ApiKey.prefix == name_or_prefix).limit(2)).all()
    if len(named) > 1:
        _fail(f"several keys have the prefix {name_or_prefix!r}: give the key's name", EXIT_INPUT)
    return named[0] if named else name_or_prefix  # unknown: revoke_key names it in its 404


@keys_app.command("revoke")
def keys_revoke(
    name: Annotated[str, typer.Argument(help="the key's name, or its prefix (xp_…) as `keys list` shows it")],
) -> None:
    """Revoke an API key in the database and close its open sessions: every server refuses its new
    requests and sessions at once (other requests within EXPOST_AUTH_CACHE_SECONDS)."""
    from service.errors import ServiceError
    from service.runs.sessions import revoke_key

    sessions = _existing_sessions()
    name = _key_name(sessions, name)
    try:
        key, closed = revoke_key(sessions, name)
        revoked_at = key.revoked_at
    except ServiceError as exc:
        typer.echo(f"error: {exc.detail}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"revoked: {name} (at {revoked_at.isoformat() if revoked_at else '?'})")
    typer.echo(f"{closed} open session{'' if closed == 1 else 's'} closed")


class Accounting(StrEnum):
    """The schema's ``accounting``: one filter for the dataset, or one budget per privacy unit."""

    dataset = "dataset"
    individual = "individual"


@datasets_app.command("add")
def datasets_add(
    file: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="CSV file with a header row")],
    schema: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="JSON schema file")],
    name: Annotated[str | None, typer.Option(help="display name")] = None,
    actor: Annotated[str, typer.Option(help="recorded in the ledger")] = "cli",
    unit_column: Annotated[
        str | None,
        typer.Option(
            help="privacy unit: the column identifying a person (ε then protects each with all rows)"
        ),
    ] = None,
    unit_max_rows: Annotated[
        int | None, typer.Option(help="privacy unit: at most this many of a unit's rows per release")
    ] = None,
    accounting: Annotated[
        Accounting | None,
        typer.Option(
            help="individual: each privacy unit gets its own budget (the dataset's) and releases leave out "
            "the units that cannot afford them; needs a privacy unit and add_remove neighbours"
        ),
    ] = None,
) -> None:
    """Register a dataset from local files; prints its id (and, on stderr, how many values of each column
    lay outside the declared bounds and were clipped to them). ``--unit-column`` with ``--unit-max-rows``
    declares the privacy unit (the schema's ``privacy_unit``; docs/privacy/units.md#units); ``--accounting
    individual`` gives each unit its own budget (the schema's ``accounting``)."""
    from service.datasets import create_dataset, snapshot_store
    from service.errors import ServiceError
    from service.store import unit

    declared = json.loads(schema.read_text())
    if (unit_column is None) != (unit_max_rows is None):
        typer.echo("error: --unit-column and --unit-max-rows go together", err=True)
        raise typer.Exit(2)
    if unit_column is not None and isinstance(declared, dict):
        declared["privacy_unit"] = {"column": unit_column, "max_rows": unit_max_rows}
    if accounting is not None and isinstance(declared, dict):
        if accounting is Accounting.individual and declared.get("privacy_unit") is None:
            typer.echo(
                "error: --accounting individual gives each privacy unit its own budget: declare the unit "
                "with --unit-column and --unit-max-rows (1 if a row is a person)",
                err=True,
            )
            raise typer.Exit(2)
        declared["accounting"] = accounting.value
    sessions = _sessions()
    try:
        with unit.transaction(sessions) as session:
            dataset = create_dataset(
                session,
                get_settings().data_dir,
                name or file.stem,
                file.read_bytes(),
                declared,
                actor,
                store=snapshot_store(get_settings()),
            )
    except ServiceError as exc:
        typer.echo(f"error: {exc.detail}", err=True)
        raise typer.Exit(1) from None
    typer.echo(dataset.id)  # stdout: the id alone (for scripts); the clipping report on stderr
    clipped = ", ".join(f"{column} {count}" for column, count in (dataset.clipped or {}).items())
    typer.echo(f"values clipped to the declared bounds, per column: {clipped or 'none'}", err=True)


@datasets_app.command("archive")
def datasets_archive(
    dataset_id: Annotated[str, typer.Argument(help="dataset id (ds_…)")],
    actor: Annotated[str, typer.Option(help="recorded as archived_by")] = "cli",
) -> None:
    """Archive a dataset in the database (idempotent): every server refuses its new requests and sessions
    at once; running ones finish; nothing is deleted (history, budgets and the ledger stay readable)."""
    from service import datasets
    from service.errors import ServiceError
    from service.store import unit
    from service.store.repositories.datasets import DatasetRepository

    sessions = _existing_sessions()
    try:
        with unit.transaction(sessions) as session:
            before = DatasetRepository(session).get(dataset_id)
            already = before is not None and before.archived_at is not None
            row = datasets.archive(session, dataset_id, actor)
            archived_at, archived_by = row.archived_at, row.archived_by
    except ServiceError as exc:
        typer.echo(f"error: {exc.detail}", err=True)
        raise typer.Exit(1) from None
    when = archived_at.isoformat() if archived_at else "?"
    typer.echo(f"{'already archived' if already else 'archived'}: {dataset_id} (at {when}, by {archived_by})")


@ledger_app.command("verify")
def ledger_verify() -> None:
    """Check every hash chain and rebuild every filter's totals from the ledger, and the unit filters of
    individually accounted datasets from their data (EXPOST_DATA_DIR / EXPOST_STORAGE_URL); exit 1 on any
    mismatch. Problems name counts only, never a unit's budget. Unit filters that cannot be rebuilt (a
    release of a mechanism without a replayable per-unit step) are listed as UNCHECKED. The database is
    EXPOST_DATABASE_URL's (default: var/expost.db under the current folder); when there is no migrated
    expost database there it exits 2 and creates nothing."""
    from service.datasets import build_tables, public_context
    from service.filter.ledger import verify

    sessions = _existing_sessions()  # before anything else: a wrong folder creates nothing
    tables = build_tables(get_settings())

    def data(dataset: Dataset) -> tuple[PublicContext, DataTable]:
        context = public_context(dataset)
        return context, tables.get(dataset, context.schema)

    try:
        with sessions() as session:
            report = verify(session, data)
    finally:
        tables.close()
    for problem in report.problems:
        typer.echo(f"MISMATCH {problem}")
    for unchecked in report.unchecked:
        typer.echo(f"UNCHECKED {unchecked}")
    outcome = "ok" if report.ok else f"{len(report.problems)} problems"
    if report.unchecked:
        outcome += f"; the unit filters of {len(report.unchecked)} datasets were not (fully) rebuilt"
    typer.echo(f"{report.datasets} datasets, {report.entries} entries: {outcome}")
    raise typer.Exit(0 if report.ok else 1)


_DEMO_DATA = Path(__file__).parent / "demo_data"


def _demo_rows(name: str, rows: int | None) -> bytes:
    """The first ``rows`` records of a shipped demo file (synthetic data, generated once and kept as a file so
    that no module of the service ever creates a random generator outside ``mechanisms.noise``)."""
    lines = (_DEMO_DATA / name).read_text().splitlines()
    kept = lines if rows is None else lines[: rows + 1]
    return ("\n".join(kept) + "\n").encode()


def demo_csv(rows: int | None = None) -> bytes:
    """Synthetic incomes: age, income, region (1000 rows)."""
    return _demo_rows("incomes.csv", rows)


DEMO_SCHEMA = {
    "columns": [
        {"name": "age", "type": "float", "min": 18, "max": 90},
        {"name": "income", "type": "float", "min": 0, "max": 250000},
        {"name": "region", "type": "categorical", "values": ["north", "south", "east", "west"]},
    ],
    "neighboring": "replace_one",
}


def demo_learning_csv(rows: int | None = None) -> bytes:
    """Synthetic customers for the learners (5000 rows): churn is logistic in the features, spend linear."""
    return _demo_rows("customers.csv", rows)


DEMO_LEARNING_SCHEMA = {
    "columns": [
        {"name": "age", "type": "float", "min": 18, "max": 90},
        {"name": "tenure", "type": "float", "min": 0, "max": 30},
        {"name": "visits", "type": "int", "min": 0, "max": 40},
        {"name": "spend", "type": "float", "min": 0, "max": 300},
        {"name": "churn", "type": "categorical", "values": ["no", "yes"]},
    ],
    "neighboring": "replace_one",
}


DEMO_BUDGET: dict[str, float] = {"epsilon": 30.0, "delta": 1e-6, "delta_share": 2e-7}
"""The demo datasets' budget: generous, so that the README's tour and docs/examples.md (one request of every
mechanism) fit with room to spare, and with a δ share so that the approximate-DP mechanisms are admitted
without an admin. A demo setting, not a production one."""


@app.command()
def demo(
    keys_file: Annotated[Path, typer.Option(help="where the demo keys are kept")] = Path(
        "var/demo-keys.json"
    ),
    host: Annotated[str, typer.Option(help="the address `expost serve` will listen on (printed URLs)")] = (
        "127.0.0.1"
    ),
    port: Annotated[
        int, typer.Option(min=1, max=65535, help="its port (printed URLs; `make run PORT=N`)")
    ] = 8000,
) -> None:
    """Create two demo datasets with generous budgets (ε=30, δ=1e-6, of which 2e-7 for approximate-DP
    mechanisms) and admin/analyst/viewer keys (idempotent); print the keys, their names and commands to
    try against http://HOST:PORT."""
    from service.auth import Role, create_key
    from service.datasets import create_dataset, grant, snapshot_store
    from service.filter import budget
    from service.store import unit
    from service.store.models import DATASET_SCOPE

    sessions = _sessions()
    store = snapshot_store(get_settings())
    if keys_file.exists():
        info = json.loads(keys_file.read_text())
    else:
        with unit.transaction(sessions) as session:
            suffix = secrets.randbelow(1 << 30)
            info = {
                role: {
                    "name": f"demo-{role}-{suffix}",
                    "key": create_key(session, f"demo-{role}-{suffix}", Role(role)),
                }
                for role in ("admin", "analyst", "viewer")
            }
            dataset = create_dataset(
                session,
                get_settings().data_dir,
                "demo: synthetic census",
                demo_csv(),
                DEMO_SCHEMA,
                info["admin"]["name"],
                store=store,
            )
            learning = create_dataset(
                session,
                get_settings().data_dir,
                "demo: synthetic customers (for the learners)",
                demo_learning_csv(),
                DEMO_LEARNING_SCHEMA,
                info["admin"]["name"],
                store=store,
            )
            for each in (dataset, learning):
                grant(session, each, info["analyst"]["name"], info["admin"]["name"])
                budget.set_budget(
                    session,
                    each,
                    DATASET_SCOPE,
                    DEMO_BUDGET["epsilon"],
                    DEMO_BUDGET["delta"],
                    info["admin"]["name"],
                    delta_share=DEMO_BUDGET["delta_share"],
                )
            info["dataset"], info["learning_dataset"] = dataset.id, learning.id
            info["budget"] = dict(DEMO_BUDGET)
        keys_file.parent.mkdir(parents=True, exist_ok=True)
        keys_file.write_text(json.dumps(info, indent=2))
        keys_file.chmod(0o600)
    _print_demo(info, f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}", keys_file)


def _print_demo(info: dict[str, Any], url: str, keys_file: Path) -> None:
    keys = {role: info[role]["key"] for role in ("admin", "analyst", "viewer")}
    names = {role: info[role]["name"] for role in ("admin", "analyst", "viewer")}
    ds = info["dataset"]
    learning = info.get("learning_dataset", "(none: an older demo; delete var/demo-keys.json to remake it)")
    demo_budget = info.get("budget")
    if demo_budget is None:
        budget_line = "budget ε = 1, δ = 1e-6: an older, small demo; delete var/demo-keys.json to remake it"
    else:
        budget_line = (
            f"budget on each: ε = {demo_budget['epsilon']:g}, δ = {demo_budget['delta']:g} "
            f"({demo_budget['delta_share']:g} of it for approximate-DP mechanisms): generous, a demo "
            "setting, not a production one"
        )
    learner = {
        "features": ["age", "tenure", "visits"],
        "label": "churn",
        "steps": 20,
        "target_epsilon": 0.5,
        "target_delta": 1e-6,
    }
    learner_body = json.dumps({"mechanism": "dp_gd", "params": learner})
    sys.stdout.write(f"""
Demo dataset: {ds}   (synthetic census: age, income, region; 1000 rows)
Learning demo dataset: {learning}   (age, tenure, visits, spend, churn yes/no; for the learners)
  {budget_line}
  keys kept in {keys_file}
  admin key:   {keys["admin"]}   (name {names["admin"]})
  analyst key: {keys["analyst"]}   (name {names["analyst"]}: grants and sub-budgets name it)
  viewer key:  {keys["viewer"]}   (name {names["viewer"]})

Server: {url}   API docs: {url}/docs   Dashboard: {url}/dashboard
The command line (`expost request|session|budget …`) as the analyst:
  export EXPOST_URL={url} EXPOST_KEY={keys["analyst"]}

Try (in another terminal):
  curl -s -H 'Authorization: Bearer {keys["analyst"]}' -H 'Content-Type: application/json' \\
       -d '{{"mechanism": "laplace", "params": {{"query": {{"kind": "count"}}, "epsilon": 0.1}}}}' \\
       {url}/v1/datasets/{ds}/requests
  curl -s -H 'Authorization: Bearer {keys["viewer"]}' {url}/v1/datasets/{ds}/budget
  curl -s -H 'Authorization: Bearer {keys["analyst"]}' -H 'Content-Type: application/json' \\
       -d '{learner_body}' \\
       {url}/v1/datasets/{learning}/requests
One request of every mechanism on these two datasets: docs/examples.md
""")


# ----- remote commands: talk to a server over HTTP with expost_client -------------------------------------

request_app = typer.Typer(help="Analysis requests on a server (analyst)", no_args_is_help=True)
session_app = typer.Typer(help="Interactive sessions on a server (analyst)", no_args_is_help=True)
budget_app = typer.Typer(help="Budgets on a server (set: admin; show: any role)", no_args_is_help=True)
app.add_typer(request_app, name="request")
app.add_typer(session_app, name="session")
app.add_typer(budget_app, name="budget")

UrlOption = Annotated[
    str, typer.Option("--url", envvar="EXPOST_URL", help="server base URL", show_default=True)
]
KeyOption = Annotated[str | None, typer.Option("--key", envvar="EXPOST_KEY", help="API key (xp_…)")]
JsonOption = Annotated[bool, typer.Option("--json", help="print the raw JSON response (for scripts)")]
ParamsOption = Annotated[
    str, typer.Option("--params", help="mechanism params as a JSON object (or @file.json)")
]
AnalystOption = Annotated[
    str | None, typer.Option("--analyst", help="an analyst's sub-budget instead of the dataset's")
]
DEFAULT_URL = "http://127.0.0.1:8000"

EXIT_OTHER, EXIT_INPUT, EXIT_REFUSED = 1, 2, 3


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _json_object(text: str, option: str) -> dict[str, Any]:
    """A JSON object from an option value (``@path`` reads a file); exit 2 when it is not one."""
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            _fail(f"{option}: cannot read {text[1:]!r}: {exc.strerror}", EXIT_INPUT)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        _fail(f"{option}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})", EXIT_INPUT)
    if not isinstance(value, dict):
        _fail(f"{option}: must be a JSON object, got {type(value).__name__}", EXIT_INPUT)
    return value


def _print_json(body: Any) -> None:
    typer.echo(json.dumps(body, indent=2, ensure_ascii=False))


@contextmanager
def _remote(url: str, key: str | None, as_json: bool = False) -> Iterator[ExpostClient]:
    """A client for ``url``; maps the client's errors to messages on stderr and exit codes."""
    try:
        with ExpostClient(url, key) as client:
            yield client
    except ExpostError as exc:
        if as_json:
            _print_json(exc.body)
        typer.echo(f"error: {exc.title} ({exc.status}): {exc.detail}", err=True)
        if isinstance(exc, InvalidInputError):
            for item in exc.errors:
                typer.echo(f"  {item.get('field')}: {item.get('reason')}", err=True)
        if isinstance(exc, BudgetExhaustedError):
            typer.echo(f"  {exc.summary()}", err=True)
            raise typer.Exit(EXIT_REFUSED) from None
        raise typer.Exit(EXIT_INPUT if 400 <= exc.status < 500 else EXIT_OTHER) from None
    except ExpostTimeoutError as exc:
        _fail(f"{exc}; it keeps running: check with `expost request get {exc.request_id}`", EXIT_OTHER)
    except httpx.HTTPError as exc:
        _fail(
            f"cannot talk to {url}: {exc.__class__.__name__}: {exc}\n"
            "  Is the server running there? Give its address with --url or EXPOST_URL (`make run PORT=N` "
            "serves http://127.0.0.1:N and prints the `export EXPOST_URL=…` line).",
            EXIT_OTHER,
        )


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _kv(title: str, rows: list[tuple[str, Any]]) -> Group:
    table = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for name, value in rows:
        table.add_row(name, _fmt(value))
    return Group(Text(title, style="bold underline"), table)


def _show(*renderables: Any) -> None:
    console = Console(highlight=False)
    for renderable in renderables:
        console.print(renderable)


def _curve_summary(curve: Curve | None) -> str:
    if curve is None:
        return "–"
    finite = [float(v) for v in curve.values if isinstance(v, int | float)]
    if not finite:
        return f"pure ε {_fmt(curve.pure)}"
    return f"pure ε {_fmt(curve.pure)}; Rényi ε(α) {min(finite):.4g} … {max(finite):.4g}"


def _request_table(request: AnalysisRequest) -> Group:
    rows: list[tuple[str, Any]] = [
        ("id", request.id),
        ("state", request.state),
        ("dataset", request.dataset_id),
        ("mechanism", request.mechanism),
        ("params", request.params),
    ]
    rows += list((request.release or {}).items())  # value (or values) and the noise description
    rows += [
        ("worst case", _curve_summary(request.worst_case)),
        ("charged", _curve_summary(request.realized)),
    ]
    if request.state == "running" and request.phase:
        rows.append(("phase", request.phase))
    if request.eta_seconds is not None:
        rows.append(("eta (s)", request.eta_seconds))
    if request.cancelled_by:
        rows.append(("cancelled by", request.cancelled_by))
    if request.error:
        rows.append(("error", request.error))
    return _kv(f"request {request.id}", rows)


def _session_tables(session: AnalysisSession) -> list[Group | Table]:
    summary = _kv(
        f"session {session.id}",
        [
            ("state", session.state),
            ("close reason", session.close_reason),
            ("dataset", session.dataset_id),
            ("mechanism", session.mechanism),
            ("params", session.params),
            ("asked", session.asked),
            ("expires", session.expires_at.isoformat()),
            ("reserved (worst case)", _curve_summary(session.worst_case)),
            ("charged", _curve_summary(session.realized)),
        ],
    )
    if not session.steps:
        return [summary]
    steps = Table("#", "query", "answer", title="transcript", title_justify="left")
    for i, step in enumerate(session.steps):
        steps.add_row(str(i), _fmt(step.get("query")), _fmt(step.get("answer")))
    return [summary, steps]


def _budget_tables(budget: Budget) -> list[Group | Table]:
    who = f"analyst {budget.analyst}" if budget.analyst else "dataset"
    target = f"ε = {_fmt(budget.epsilon)}, δ = {_fmt(budget.delta)}" if budget.budget_set else "not set"
    summary = _kv(
        f"budget of {budget.dataset_id} ({who})",
        [
            ("target", target),
            ("ε spent (at δ)", budget.epsilon_spent),
            ("largest ε admissible", budget.epsilon_remaining),
            ("binding order", budget.binding_alpha),
            *(
                [
                    (
                        "δ share used (approximate DP)",
                        f"{_fmt(budget.delta_spent + budget.delta_reserved)} of {_fmt(budget.delta_share)}",
                    )
                ]
                if budget.delta_share is not None
                else []
            ),
            *([("note", budget.accounting_meaning or "")] if budget.binding is False else []),
        ],
    )
    slots = Table("α", "capacity", "spent", "reserved", "remaining", title="per order", title_justify="left")
    for row in [*budget.orders, budget.pure]:
        slots.add_row(*(_fmt(v) for v in (row.alpha, row.capacity, row.spent, row.reserved, row.remaining)))
    return [summary, slots]


@contextmanager
def _spinner(enabled: bool | None, description: str) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A rich spinner on stderr while a request runs; yields the client's progress callback."""
    console = Console(stderr=True, force_terminal=True if enabled else None)
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not (enabled if enabled is not None else console.is_terminal),
    )
    task = progress.add_task(description, total=None)
    polls = 0

    def update(request: dict[str, Any]) -> None:
        nonlocal polls
        polls += 1
        state = request.get("phase") or request.get("state")
        done = request.get("progress")
        eta = request.get("eta_seconds")
        extra = "" if done is None else f" {100 * float(done):.0f}%"
        extra += "" if eta is None else f", about {float(eta):.0f} s left"
        progress.update(task, description=f"request {request.get('id')}: {state}{extra} (poll {polls})")

    with progress:
        yield update


@request_app.command("submit")
def request_submit(
    dataset_id: Annotated[str, typer.Argument(help="dataset id (ds_…)")],
    params: ParamsOption,
    mechanism: Annotated[str, typer.Option(help="mechanism name (see GET /v1/mechanisms)")] = "laplace",
    idempotency_key: Annotated[
        str | None, typer.Option(help="retry-safe key (default: a new one, reused by the client's retries)")
    ] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for a long request")] = 300.0,
    show_progress: Annotated[
        bool | None, typer.Option("--progress/--no-progress", help="spinner on stderr (default: on a TTY)")
    ] = None,
    as_json: JsonOption = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Run a mechanism on a dataset and print its release and charge (waits for long requests)."""
    body = _json_object(params, "--params")
    with (
        _remote(url, key, as_json) as client,
        _spinner(show_progress, f"{mechanism} on {dataset_id}: submitting") as progress,
    ):
        request = client.submit(
            dataset_id, mechanism, body, idempotency_key=idempotency_key, timeout=timeout, progress=progress
        )
    if as_json:
        _print_json(request.raw)
    else:
        _show(_request_table(request))


@app.command("sql")
def sql_command(
    dataset_id: Annotated[str, typer.Argument(help="dataset id (ds_…)")],
    statement: Annotated[str, typer.Argument(help="SELECT agg(col), … FROM dataset [WHERE …] [GROUP BY …]")],
    epsilon: Annotated[float | None, typer.Option(help="pure ε (laplace noise and quantiles)")] = None,
    noise: Annotated[str, typer.Option(help="laplace or gaussian")] = "laplace",
    noise_multiplier: Annotated[float | None, typer.Option(help="gaussian: σ/ℓ2 per block")] = None,
    candidates: Annotated[int | None, typer.Option(help="quantiles: public candidate grid size")] = None,
    as_json: JsonOption = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Answer one SQL SELECT with a DP release (POST /v1/datasets/{id}/sql) and print it with its charge."""
    with _remote(url, key, as_json) as client:
        request = client.sql(
            dataset_id,
            statement,
            epsilon=epsilon,
            noise=noise,
            noise_multiplier=noise_multiplier,
            candidates=candidates,
        )
    if as_json:
        _print_json(request.raw)
    else:
        _show(_request_table(request))


@request_app.command("get")
def request_get(
    request_id: Annotated[str, typer.Argument(help="request id (rq_…)")],
    as_json: JsonOption = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Show a request, its state and (when committed) its release."""
    with _remote(url, key, as_json) as client:
        request = client.get_request(request_id)
    if as_json:
        _print_json(request.raw)
    else:
        _show(_request_table(request))


@request_app.command("cancel")
def request_cancel(
    request_id: Annotated[str, typer.Argument(help="request id (rq_…)")],
    as_json: JsonOption = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Cancel a request: still queued, it is aborted and charged nothing; already running, it is stopped
    and charged its worst case (its data was read)."""
    with _remote(url, key, as_json) as client:
        request = client.cancel(request_id)
    if as_json:
        _print_json(request.raw)
    else:
        _show(_request_table(request))


@request_app.command("estimate")
def request_estimate(
    dataset_id: Annotated[str, typer.Argument(help="dataset id (ds_…)")],
    params: ParamsOption,
    mechanism: Annotated[str, typer.Option(help="mechanism name")] = "laplace",
    as_json: JsonOption = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Dry run: the worst-case charge and whether it would be admitted now (nothing is charged)."""
    body = _json_object(params, "--params")
    with _remote(url, key, as_json) as client:
        estimate = client.estimate(dataset_id, mechanism, body)
    if as_json:
        _print_json(estimate.raw)
        return
    refusal = estimate.refusal_error
    rows: list[tuple[str, Any]] = [
        ("admitted now", "yes" if estimate.admitted else "no"),
        ("worst case", _curve_summary(estimate.worst_case)),
    ]
    if estimate.reason:
        rows.append(("reason", estimate.reason))
    if refusal is not None:
        rows += [("refusal", refusal.detail), ("summary", refusal.summary())]
    _show(_kv(f"estimate: {mechanism} on {dataset_id}", rows))


def _print_session(session: AnalysisSession, as_json: bool) -> None:
    if as_json:
        _print_json(session.raw)
    else:
        _show(*_session_tables(session))


@session_app.command("open")
def session_open(
    dataset_id: Annotated[str, typer.Argument(help="dataset id (ds_…)")],
    params: ParamsOption,
    mechanism: Annotated[str, typer.Option(help="session mechanism")] = "above_threshold",
    idempotency_key: Annotated[str | None, typer.Option(help="retry-safe key")] = None,
    as_json: JsonOption = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Open an interactive session (reserves its worst case); prints its id."""
    body = _json_object(params, "--params")
    with _remote(url, key, as_json) as client:
        session = client.open_session(dataset_id, mechanism, body, idempotency_key=idempotency_key)
    _print_session(session, as_json)


@session_app.command("ask")
def session_ask(
    session_id: Annotated[str, typer.Argument(help="session id (ss_…)")],
    query: Annotated[
        str,
        typer.Option(
            "--query",
            help='the query as JSON, e.g. {"kind": "count"} (or a whole step: {"query": …, "epsilon": …})',
        ),
    ],
    epsilon: Annotated[
        float | None, typer.Option(help="ε_i of this query (default: the session's max_query_epsilon)")
    ] = None,
    idempotency_key: Annotated[str | None, typer.Option(help="retry-safe key")] = None,
    as_json: JsonOption = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Ask one query of an open session: "below", or "above" (the session halts)."""
    body = _json_object(query, "--query")
    if isinstance(body.get("query"), dict):
        step_query: dict[str, Any] = body["query"]
        if epsilon is None and isinstance(body.get("epsilon"), int | float):
            epsilon = float(body["epsilon"])
    else:
        step_query = body
    with _remote(url, key, as_json) as client:
        answer = client.ask(session_id, step_query, epsilon, idempotency_key=idempotency_key)
    if as_json:
        _print_json(answer.raw)
        return
    verdict = "ABOVE (the session halted)" if answer.above else "below"
    rows = [("answer", verdict), *((k, v) for k, v in answer.answer.items() if k != "above")]
    _show(_kv(f"session {session_id}", [*rows, ("session state", answer.session.state)]))


@session_app.command("close")
def session_close(
    session_id: Annotated[str, typer.Argument(help="session id (ss_…)")],
    as_json: JsonOption = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Close a session now and commit the charge of what it revealed."""
    with _remote(url, key, as_json) as client:
        session = client.close_session(session_id)
    _print_session(session, as_json)


@session_app.command("get")
def session_get(
    session_id: Annotated[str, typer.Argument(help="session id (ss_…)")],
    as_json: JsonOption = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Show a session's state and public transcript."""
    with _remote(url, key, as_json) as client:
        session = client.get_session(session_id)
    _print_session(session, as_json)


@budget_app.command("set")
def budget_set(
    dataset_id: Annotated[str, typer.Argument(help="dataset id (ds_…)")],
    epsilon: Annotated[float, typer.Option(help="target ε")],
    delta: Annotated[float, typer.Option(help="target δ (0: a pure filter)")],
    analyst: AnalystOption = None,
    delta_share: Annotated[
        float | None,
        typer.Option(help="part of δ set aside for approximate-DP (ptr.*) mechanisms; only grows once set"),
    ] = None,
    confirm_below_spent: Annotated[
        bool, typer.Option(help="allow a capacity below what is already spent (refuses everything new)")
    ] = False,
    as_json: JsonOption = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Set the dataset's (or an analyst's) (ε, δ) budget (admin)."""
    with _remote(url, key, as_json) as client:
        budget = client.set_budget(
            dataset_id,
            epsilon,
            delta,
            analyst,
            delta_share=delta_share,
            confirm_below_spent=confirm_below_spent,
        )
    if as_json:
        _print_json(budget.raw)
    else:
        _show(*_budget_tables(budget))


@budget_app.command("show")
def budget_show(
    dataset_id: Annotated[str, typer.Argument(help="dataset id (ds_…)")],
    analyst: AnalystOption = None,
    as_json: JsonOption = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Show spent, reserved and remaining budget per order.

    With an analyst's key and no --analyst, also the caller's own sub-budget when one is set, and which of
    the two binds (a request must fit both). --json prints only the view asked for, as the server sends it.
    """
    with _remote(url, key, as_json) as client:
        budget = client.get_budget(dataset_id, analyst)
        own = None if analyst is not None or as_json else _own_sub_budget(client, dataset_id)
    assert budget is not None  # no ETag was sent, so never 304
    if as_json:
        _print_json(budget.raw)
    elif own is None:
        _show(*_budget_tables(budget))
    else:
        _show(_binding_summary(budget, own), *_budget_tables(own), *_budget_tables(budget))


def _own_sub_budget(client: ExpostClient, dataset_id: str) -> Budget | None:
    """The caller's own sub-budget on the dataset when the key is an analyst's and one is set, else None."""
    me = client.me()
    if me.role != "analyst":
        return None
    name = me.name
    own = client.get_budget(dataset_id, name)
    return own if own is not None and own.budget_set else None


def _binding_summary(dataset: Budget, own: Budget) -> Group:
    """Which filter binds an analyst: the smaller remaining ε (no budget or no usable slot admits nothing)."""

    def left(view: Budget) -> float:
        return (view.epsilon_remaining or 0.0) if view.budget_set else 0.0

    mine, theirs = left(own), left(dataset)
    binding = "your sub-budget" if mine < theirs else "dataset" if mine > theirs else "both"
    return _kv(
        f"what binds you on {dataset.dataset_id}",
        [
            ("largest ε admissible", min(mine, theirs)),
            ("binding", binding),
            ("your sub-budget: ε remaining", own.epsilon_remaining),
            ("dataset: ε remaining", dataset.epsilon_remaining),
        ],
    )


@app.command("grant")
def grant_command(
    dataset_id: Annotated[str, typer.Argument(help="dataset id (ds_…)")],
    analyst: Annotated[str, typer.Argument(help="name of an analyst key")],
    as_json: JsonOption = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Grant an analyst key access to a dataset on a server (admin)."""
    with _remote(url, key, as_json) as client:
        granted = client.grant(dataset_id, analyst)
    if as_json:
        _print_json(granted.raw)
    else:
        state = "granted" if granted.created else "already granted"
        typer.echo(f"{state}: {granted.analyst} on {granted.dataset_id}")


grants_app = typer.Typer(help="Grants of datasets to analysts on a server (admin)", no_args_is_help=True)
app.add_typer(grants_app, name="grants")
grants_app.command("add", help="Grant an analyst key access to a dataset (the same as `expost grant`).")(
    grant_command
)


@grants_app.command("list")
def grants_list(
    dataset_id: Annotated[str, typer.Argument(help="dataset id (ds_…)")],
    as_json: JsonOption = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """List the analysts granted on a dataset (admin), one name a line."""
    with _remote(url, key, as_json) as client:
        analysts = client.grants(dataset_id)
    if as_json:
        _print_json(analysts)
        return
    for analyst in analysts:
        typer.echo(analyst)
    typer.echo(
        f"{len(analysts)} analyst{'' if len(analysts) == 1 else 's'} granted on {dataset_id}", err=True
    )


@grants_app.command("revoke")
def grants_revoke(
    dataset_id: Annotated[str, typer.Argument(help="dataset id (ds_…)")],
    analyst: Annotated[str, typer.Argument(help="name of an analyst key")],
    as_json: JsonOption = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Revoke an analyst's grant on a dataset (admin; idempotent): no new request or session of theirs is
    admitted; their history, sub-budget and the ledger stay (the ledger gets a `revoke` entry)."""
    with _remote(url, key, as_json) as client:
        revoked = client.revoke_grant(dataset_id, analyst)
    if as_json:
        _print_json(revoked)
    else:
        state = "revoked" if revoked.get("revoked") else "not granted (nothing to revoke)"
        typer.echo(f"{state}: {analyst} on {dataset_id}")


if __name__ == "__main__":
    app()
