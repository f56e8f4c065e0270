"""The application context: settings, engine, sessions, table cache and executor (built once per app)."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

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
    from service.requests import Limits
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
    # Set on SIGTERM: no new work is admitted or started; waiting POSTs answer 202 at once.
    draining: threading.Event = field(default_factory=threading.Event)
    drain_started: float | None = None
    _principals: dict[str, tuple[Principal, float]] = field(default_factory=dict)

    def limits(self) -> Limits:
        from service.requests import Limits

        return Limits(
            self.settings.max_running_requests_per_analyst,
            self.settings.max_open_sessions_per_analyst,
            frozenset(self.settings.inline_mechanisms),
        )

    def drain(self) -> None:
        """Stop accepting and starting work; the grace period starts now."""
        if not self.draining.is_set():
            self.drain_started = time.monotonic()
            self.draining.set()
            self.executor.drain()
            log.info("draining: no new work is accepted", grace_seconds=self.settings.shutdown_grace_seconds)

    def install_signal_handlers(self) -> None:
        """Chain SIGTERM/SIGINT to :meth:`drain` (before uvicorn's own handler stops the server), so the
        grace period starts at the signal. Only possible in the main thread (``expost serve``)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)

            def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
                self.drain()
                if callable(previous):
                    previous(signum, frame)

            signal.signal(sig, handler)

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
        from service.requests import SHUTDOWN_REASON, run_next, stop_runs
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
                lambda on_claim: run_next(
                    sessions, tables, settings.lease_seconds, settings.heartbeat_seconds,
                    on_claim=on_claim, queue=settings.queue_name,
                ),
                lambda claimed: stop_runs(sessions, claimed, SHUTDOWN_REASON),
                settings.worker_threads,
                settings.poll_seconds,
            )
        return cls(settings, engine, sessions, tables, executor, WriteBatcher(sessions))

    def start_reaper(self) -> threading.Thread:
        from service.requests import reap_expired
        from service.sessions import expire_sessions

        def loop() -> None:
            while not self.stop.is_set():
                try:
                    reap_expired(self.sessions, self.settings.max_queue_seconds)
                    expire_sessions(self.sessions)
                except Exception as exc:
                    log.error("reaper pass failed", **failure_fields(exc))
                self.stop.wait(self.settings.reaper_interval_seconds)

        thread = threading.Thread(target=loop, name="expost-reaper", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Stop: runs in flight may finish within the grace period (counted from the signal), then they
        are stopped and charged their worst case; queued requests stay queued for other workers."""
        self.drain()
        self.stop.set()
        started = self.drain_started if self.drain_started is not None else time.monotonic()
        self.executor.shutdown(started + self.settings.shutdown_grace_seconds)
        self.writer.stop()
        self.engine.dispose()
