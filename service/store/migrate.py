"""Alembic, driven from code: ``expost migrate`` upgrades; the app refuses an unmigrated database."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from service.store.engine import ensure_sqlite_directory

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    ensure_sqlite_directory(database_url)
    command.upgrade(alembic_config(database_url), revision)


def head_revision(database_url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


class NotMigrated(RuntimeError):
    pass


def ensure_migrated(engine: Engine, database_url: str) -> None:
    current, head = current_revision(engine), head_revision(database_url)
    if current != head:
        raise NotMigrated(
            f"the database at {engine.url.render_as_string(hide_password=True)} is not migrated "
            f"(current revision: {current or 'none'}, expected: {head}). Run `expost migrate` first."
        )
