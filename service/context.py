"""The application context: settings, engine, sessions, table cache and executor (built once per app)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import structlog
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings
from service.datasets import TableCache
from service.db.session import make_engine, make_sessionmaker
from service.executor import Executor, InProcessExecutor

log = structlog.get_logger("expost")


@dataclass
class AppContext:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    tables: TableCache
    executor: Executor
    stop: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def build(cls, settings: Settings) -> AppContext:
        from service.requests import run_request

        engine = make_engine(settings.database_url, settings.pool_size)
        sessions = make_sessionmaker(engine)
        tables = TableCache(settings.data_dir)
        executor = InProcessExecutor(lambda rid: run_request(sessions, tables, rid), settings.worker_threads)
        return cls(settings, engine, sessions, tables, executor)

    def start_reaper(self) -> threading.Thread:
        from service.requests import reap_expired

        def loop() -> None:
            while not self.stop.is_set():
                try:
                    reap_expired(self.sessions)
                except Exception:
                    log.exception("reaper pass failed")
                self.stop.wait(self.settings.reaper_interval_seconds)

        thread = threading.Thread(target=loop, name="expost-reaper", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.stop.set()
        self.executor.shutdown()
        self.engine.dispose()
