"""The ``expost`` command line: serve, migrate, keys, datasets, ledger verify, demo."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from sqlalchemy.orm import Session, sessionmaker

from service.auth import Role, create_key
from service.config import get_settings
from service.db.migrate import NotMigrated, ensure_migrated, upgrade
from service.db.session import make_engine, make_sessionmaker

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


def _sessions() -> sessionmaker[Session]:
    settings = get_settings()
    engine = make_engine(settings.database_url)
    try:
        ensure_migrated(engine, settings.database_url)
    except NotMigrated as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return make_sessionmaker(engine)


@app.command()
def migrate() -> None:
    """Upgrade the database schema to the latest revision."""
    settings = get_settings()
    upgrade(settings.database_url)
    typer.echo("database is at the latest revision")


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="interface to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    workers: Annotated[int, typer.Option(help="server processes")] = 1,
) -> None:
    """Run the HTTP service (refuses to start on an unmigrated database)."""
    import uvicorn

    _sessions()
    uvicorn.run(
        "service.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level="warning",
        access_log=False,
    )


@app.command()
def worker(
    interval: Annotated[float, typer.Option(help="seconds between passes")] = 15.0,
    once: Annotated[bool, typer.Option(help="run one pass and exit")] = False,
) -> None:
    """Maintenance worker: commit the worst case of requests whose worker was lost, close expired sessions.

    Every API process already does this in the background; a separate worker keeps it going when the API
    is scaled to zero. (The distributed executor for mechanisms arrives with the scale-out work.)
    """
    import time

    from service.requests import reap_expired
    from service.sessions import expire_sessions

    sessions = _sessions()
    while True:
        reaped, expired = reap_expired(sessions), expire_sessions(sessions)
        typer.echo(f"reaped {reaped} requests, closed {expired} expired sessions")
        if once:
            return
        time.sleep(interval)


@keys_app.command("create")
def keys_create(
    role: Annotated[Role, typer.Option(help="admin, analyst or viewer")],
    name: Annotated[str, typer.Option(help="unique name; analysts are granted by this name")],
) -> None:
    """Create an API key and print it once."""
    from service.errors import ServiceError

    sessions = _sessions()
    try:
        with sessions() as session, session.begin():
            key = create_key(session, name, role)
    except ServiceError as exc:
        typer.echo(f"error: {exc.detail}", err=True)
        raise typer.Exit(1) from None
    typer.echo(key)


@datasets_app.command("add")
def datasets_add(
    file: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="CSV file with a header row")],
    schema: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="JSON schema file")],
    name: Annotated[str | None, typer.Option(help="display name")] = None,
    actor: Annotated[str, typer.Option(help="recorded in the ledger")] = "cli",
) -> None:
    """Register a dataset from local files; prints its id."""
    from service.datasets import create_dataset
    from service.errors import ServiceError

    sessions = _sessions()
    try:
        with sessions() as session, session.begin():
            dataset = create_dataset(
                session,
                get_settings().data_dir,
                name or file.stem,
                file.read_bytes(),
                json.loads(schema.read_text()),
                actor,
            )
    except ServiceError as exc:
        typer.echo(f"error: {exc.detail}", err=True)
        raise typer.Exit(1) from None
    typer.echo(dataset.id)


@ledger_app.command("verify")
def ledger_verify() -> None:
    """Check every hash chain and rebuild every filter's totals from the ledger; exit 1 on any mismatch."""
    from service.ledger import verify

    with _sessions()() as session:
        report = verify(session)
    for problem in report.problems:
        typer.echo(f"MISMATCH {problem}")
    typer.echo(
        f"{report.datasets} datasets, {report.entries} entries: "
        + ("ok" if report.ok else f"{len(report.problems)} problems")
    )
    raise typer.Exit(0 if report.ok else 1)


def demo_csv(rows: int = 1000, seed: int = 7) -> bytes:
    rng = np.random.default_rng(seed)
    age = np.clip(rng.normal(41, 13, rows), 18, 90).round(1)
    income = np.clip(rng.lognormal(10.5, 0.6, rows), 0, 250000).round(0)
    group = rng.choice(["north", "south", "east", "west"], rows)
    lines = ["age,income,region", *(f"{a},{i:.0f},{g}" for a, i, g in zip(age, income, group, strict=True))]
    return ("\n".join(lines) + "\n").encode()


DEMO_SCHEMA = {
    "columns": [
        {"name": "age", "type": "float", "min": 18, "max": 90},
        {"name": "income", "type": "float", "min": 0, "max": 250000},
        {"name": "region", "type": "categorical", "values": ["north", "south", "east", "west"]},
    ],
    "neighboring": "replace_one",
}


@app.command()
def demo(
    keys_file: Annotated[Path, typer.Option(help="where the demo keys are kept")] = Path(
        "var/demo-keys.json"
    ),
) -> None:
    """Create a demo dataset with a budget (ε=1, δ=1e-6) and admin/analyst/viewer keys (idempotent)."""
    from service import budget
    from service.datasets import create_dataset, grant
    from service.db.models import DATASET_SCOPE

    sessions = _sessions()
    if keys_file.exists():
        info = json.loads(keys_file.read_text())
    else:
        with sessions() as session, session.begin():
            suffix = np.random.default_rng().integers(1 << 30)
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
            )
            grant(session, dataset, info["analyst"]["name"], info["admin"]["name"])
            budget.set_budget(session, dataset, DATASET_SCOPE, 1.0, 1e-6, info["admin"]["name"])
            info["dataset"] = dataset.id
        keys_file.parent.mkdir(parents=True, exist_ok=True)
        keys_file.write_text(json.dumps(info, indent=2))
        keys_file.chmod(0o600)
    _print_demo(info)


def _print_demo(info: dict[str, object]) -> None:
    keys = {role: info[role]["key"] for role in ("admin", "analyst", "viewer")}  # type: ignore[index]
    ds = info["dataset"]
    sys.stdout.write(f"""
Demo dataset: {ds}   (budget ε = 1, δ = 1e-6; keys kept in var/demo-keys.json)
  admin key:   {keys["admin"]}
  analyst key: {keys["analyst"]}
  viewer key:  {keys["viewer"]}

Try (in another terminal):
  curl -s -H 'Authorization: Bearer {keys["analyst"]}' -H 'Content-Type: application/json' \\
       -d '{{"mechanism": "laplace", "params": {{"query": {{"kind": "count"}}, "epsilon": 0.1}}}}' \\
       http://127.0.0.1:8000/v1/datasets/{ds}/requests
  curl -s -H 'Authorization: Bearer {keys["viewer"]}' http://127.0.0.1:8000/v1/datasets/{ds}/budget
  API docs: http://127.0.0.1:8000/docs
""")


if __name__ == "__main__":
    app()
