"""Alembic environment: the URL comes from the Config built in service.store.migrate (or
EXPOST_DATABASE_URL)."""

from __future__ import annotations

from typing import Any

from alembic import context
from sqlalchemy import create_engine

from service.config import get_settings
from service.store.models import Base, UTCDateTime

config = context.config
url = config.get_main_option("sqlalchemy.url") or get_settings().database_url
is_sqlite = url.startswith("sqlite")


def render_item(type_: str, obj: Any, autogen_context: Any) -> str | bool:
    """Render the app's UTCDateTime as a plain timezone-aware DateTime: migrations never import the app."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def run_offline() -> None:
    context.configure(
        url=url,
        target_metadata=Base.metadata,
        literal_binds=True,
        render_as_batch=is_sqlite,
        render_item=render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    engine = create_engine(url)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=is_sqlite,
            render_item=render_item,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
