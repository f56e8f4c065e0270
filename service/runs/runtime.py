"""What the run functions of one process share: settings, database sessions, the table cache, the
executor, the group-commit writer, and the shutdown state. Built by the composition root
(``service.app``); passed down explicitly, never imported back up.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import structlog
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings
from service.datasets import TableCache
from service.runs.admission import Limits
from service.runs.executor import Executor
from service.runs.writer import WriteBatcher

log = structlog.get_logger("expost")


@dataclass
class Runtime:
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
    reaper: threading.Thread | None = None

    def limits(self) -> Limits:
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

    def grace_deadline(self) -> float:
        """When runs in flight must be stopped (``time.monotonic()``): the grace period after the drain
        began, or from now if it has not."""
        started = self.drain_started if self.drain_started is not None else time.monotonic()
        return started + self.settings.shutdown_grace_seconds

    def close(self) -> None:
        """Stop: runs in flight may finish within the grace period (counted from the signal), then they
        are stopped and charged their worst case; queued requests stay queued for other workers."""
        self.drain()
        self.stop.set()
        self.executor.shutdown(self.grace_deadline())
        if self.reaper is not None:
            self.reaper.join(10)
        self.writer.stop()
        self.tables.close()  # the data engine's native resources, now, not when a thread drops the last ref
        self.engine.dispose()
