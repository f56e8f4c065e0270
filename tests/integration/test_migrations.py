"""Migrations are the only way the schema is built: they must match the models on both backends."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from service.store.engine import make_engine
from service.store.migrate import alembic_config, current_revision, head_revision, upgrade
from service.store.models import Base


def test_the_migrated_schema_matches_the_models(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
        assert diff == []
        assert current_revision(engine) == head_revision(database_url)
    finally:
        engine.dispose()


def test_downgrade_and_upgrade_round_trip(tmp_path: object) -> None:
    from alembic import command

    url = f"sqlite:///{tmp_path}/roundtrip.db"
    upgrade(url)
    command.downgrade(alembic_config(url), "base")
    engine = make_engine(url)
    try:
        assert current_revision(engine) is None
        upgrade(url)
        assert current_revision(engine) == head_revision(url)
    finally:
        engine.dispose()
