"""The application context: settings, engine, sessions, table cache and executor (built once per app)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.auth import Principal, hash_key, principal_for
from service.config import Settings
from service.datasets import TableCache
from service.db.session import make_engine, make_sessionmaker
from service.executor import Executor, InProcessExecutor
from service.logs import failure_fields

if TYPE_CHECKING:
    from service.writer import WriteBatcher

log = structlog.get_logger("expost")


@dataclass
class AppContext:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    tables: TableCache
    executor: Executor
    writer: WriteBatcher
    stop: threading.Event = field(default_factory=threading.Event)
    _principals: dict[str, tuple[Principal, float]] = field(default_factory=dict)

    def authenticate(self, key: str) -> Principal | None:
        """The key's principal, cached for ``auth_cache_seconds`` (keys are looked up by hash)."""
        digest, now = hash_key(key), time.monotonic()
        cached = self._principals.get(digest)
        if cached is not None and cached[1] > now:
            return cached[0]
        with self.sessions() as session:
            principal = principal_for(session, key)
        if principal is not None and self.settings.auth_cache_seconds > 0:
            if len(self._principals) > 10_000:
                self._principals.clear()
            self._principals[digest] = (principal, now + self.settings.auth_cache_seconds)
        return principal

    @classmethod
    def build(cls, settings: Settings) -> AppContext:
        from service.requests import run_request
        from service.writer import WriteBatcher

        engine = make_engine(settings.database_url, settings.pool_size)
        sessions = make_sessionmaker(engine)
        tables = TableCache(settings.data_dir)
        executor: Executor
        if settings.executor == "queue":
            from service.queue import QueueExecutor

            executor = QueueExecutor(settings)
        else:
            executor = InProcessExecutor(
                lambda rid: run_request(
                    sessions, tables, rid, settings.lease_seconds, settings.heartbeat_seconds
                ),
                settings.worker_threads,
            )
        return cls(settings, engine, sessions, tables, executor, WriteBatcher(sessions))

    def start_reaper(self) -> threading.Thread:
        from service.requests import reap_expired
        from service.sessions import expire_sessions

        def loop() -> None:
            while not self.stop.is_set():
                try:
                    reap_expired(self.sessions)
                    expire_sessions(self.sessions)
                except Exception as exc:
                    log.error("reaper pass failed", **failure_fields(exc))
                self.stop.wait(self.settings.reaper_interval_seconds)

        thread = threading.Thread(target=loop, name="expost-reaper", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.stop.set()
        self.executor.shutdown()
        self.writer.stop()
        self.engine.dispose()
