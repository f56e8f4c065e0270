"""Engine and session setup for SQLite (embedded default) and PostgreSQL (production).

SQLite: WAL, busy timeout and foreign keys on every connection, and every transaction starts with
``BEGIN IMMEDIATE`` so admission takes the write lock up front (two debits can never both read the old
balance). PostgreSQL: admission locks the filter rows with ``SELECT … FOR UPDATE``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def ensure_sqlite_directory(url: str) -> None:
    """SQLite creates the file but not its directory (e.g. ./var on a fresh checkout)."""
    database = make_url(url).database
    if is_sqlite(url) and database and database != ":memory:":
        Path(database).parent.mkdir(parents=True, exist_ok=True)


def json_text(value: Any) -> str:
    """A JSON column's text: orjson (several times faster than ``json.dumps`` on the writer's hot path),
    or ``json.dumps`` for what orjson does not take (integers beyond 64 bits, non-string keys). Both parse
    back to the same value, except that orjson writes a NaN or an infinity as ``null`` (``json.dumps``
    wrote a token PostgreSQL refuses) and stores datetimes as ISO strings (``json.dumps`` raised).
    Releases are checked free of both before they are stored (``settlement.storable``); curves store +∞
    as the string "inf"."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(value)


def make_engine(url: str, pool_size: int = 10) -> Engine:
    if is_sqlite(url):
        ensure_sqlite_directory(url)
        engine = create_engine(
            url, connect_args={"timeout": 30, "check_same_thread": False}, json_serializer=json_text
        )
        _configure_sqlite(engine)
        return engine
    return create_engine(
        url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True, json_serializer=json_text
    )


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # let SQLAlchemy's begin event emit BEGIN itself
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)
