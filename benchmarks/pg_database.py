"""A throw-away PostgreSQL database for one benchmark run (standalone: psycopg only, no pytest).

``fresh_database()`` creates ``expost_bench_<random>`` on the server named by ``EXPOST_BENCH_POSTGRES_URL``
(default: the local server, trust auth, maintenance database ``test``), yields its SQLAlchemy URL and drops
it afterwards (``WITH (FORCE)``, so a server process that is still connected cannot keep it alive).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

DEFAULT_URL = os.environ.get("EXPOST_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def libpq(url: str) -> str:
    """The libpq form of a SQLAlchemy URL (``postgresql+psycopg://`` → ``postgresql://``)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def create_database(server_url: str, name: str) -> str:
    with psycopg.connect(libpq(server_url), autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_url(server_url).set(database=name).render_as_string(hide_password=False)


def drop_database(server_url: str, name: str) -> None:
    with psycopg.connect(libpq(server_url), autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@contextmanager
def fresh_database(server_url: str = DEFAULT_URL, prefix: str = "expost_bench_") -> Iterator[str]:
    """Yield the URL of a new, empty database on ``server_url``; drop it on exit, whatever happens."""
    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    url = create_database(server_url, name)
    try:
        yield url
    finally:
        drop_database(server_url, name)
