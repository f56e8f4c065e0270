"""The distributed executor: ``expost worker`` processes woken through a Dramatiq task queue on Redis.

Budget decisions and the order of work never travel through the queue. The database is the queue: the
API's admission transaction reserves the budget and leaves the request queued (``running`` with no
``lease_owner``); the API then sends a **wake-up** message (it carries the request id, for the logs
only). A worker process consumes wake-ups and hands each to its :class:`service.runs.executor.FairRunner`,
whose threads:

1. **claim** the next request in the fair order (``requests.claim_next``: the analyst with the fewest
   running requests, ties to the least recently served, then FIFO per analyst) with one conditional
   ``UPDATE … SET lease_owner = me WHERE state = 'running' AND lease_owner IS NULL``: of two workers
   racing for one request exactly one gets a row count of 1. The lease starts here;
2. run it, renewing the lease through the heartbeat of long-running mechanisms;
3. settle once (the settlement is a no-op when the request is no longer running, e.g. reaped or
   cancelled).

Why not per-analyst queues in Redis: fairness needs "who is running what now" across all workers, which
only the database knows; and with the order in the database a lost or duplicated message cannot lose,
duplicate or reorder work (a duplicate wake-up finds nothing or runs the next fair request; an idle
thread also polls the database every ``poll_seconds``, so work whose wake-up was lost, e.g. when the API
died right after admission, still runs).

A worker killed mid-run leaves its request claimed with a lease nobody renews: the reaper (every API
process and every worker runs one) commits its worst case once the lease expires. A queued request is
never charged by the reaper (no data was read); it is aborted without charge only if no worker claimed it
within ``max_queue_seconds``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import dramatiq
import structlog
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Retries, ShutdownNotifications, TimeLimit
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import RdpCurve
from service.config import Settings
from service.datasets import build_tables
from service.filter.individual import UnitUpdate
from service.logs import failure_fields
from service.runs import settlement
from service.runs.executor import FairRunner
from service.runs.settlement import RequestRef, SettleFn
from service.runs.worker import SHUTDOWN_REASON, run_next, stop_runs
from service.store.engine import make_engine, make_sessionmaker

log = structlog.get_logger("expost.queue")

ACTOR_NAME = "expost_run_request"
# Leases, not the queue, bound a run: the time limit only stops a run that outlives any sane lease.
TIME_LIMIT_MS = 24 * 3600 * 1000


def make_broker(url: str) -> RedisBroker:
    middleware = [
        TimeLimit(time_limit=TIME_LIMIT_MS),
        ShutdownNotifications(),
        Retries(max_retries=5, min_backoff=500, max_backoff=10_000),
    ]
    broker: RedisBroker = RedisBroker(  # type: ignore[no-untyped-call]
        url=url, middleware=middleware, namespace="expost-tasks"
    )
    return broker


def declare_actor(
    broker: RedisBroker, queue_name: str, body: Callable[[str], None]
) -> dramatiq.Actor[[str], None]:
    decorate = dramatiq.actor(broker=broker, actor_name=ACTOR_NAME, queue_name=queue_name, max_retries=5)
    return decorate(body)


def _never(request_id: str) -> None:  # the API side only sends
    raise RuntimeError("the API process does not consume tasks")


class QueueExecutor:
    """Sends wake-ups to the queue; the request itself is already queued in the database."""

    def __init__(self, settings: Settings) -> None:
        self.broker = make_broker(settings.broker_url)
        self.actor = declare_actor(self.broker, settings.queue_name, _never)
        self._draining = False

    def submit(self, request_id: str) -> None:
        if self._draining:
            raise RuntimeError("the API is shutting down")
        try:
            self.actor.send(request_id)
        except Exception as exc:  # broker unreachable: the caller aborts the unclaimed request
            log.error("could not enqueue a request", request_id=request_id, **failure_fields(exc))
            raise RuntimeError("the task queue is unreachable") from exc

    def drain(self) -> None:
        self._draining = True

    def shutdown(self, deadline: float | None = None) -> None:
        self._draining = True
        self.broker.close()

    def in_flight(self) -> int:
        return 0  # the API process only sends wake-ups: its workers run elsewhere


def settle_with_retry(sessions: sessionmaker[Session], patience: float = 30.0) -> SettleFn:
    """A settlement that survives a short database outage (restart, failover): retried with backoff for
    up to ``patience`` seconds. Settling is idempotent (a no-op once the request is no longer running),
    so a retry after a commit whose acknowledgement was lost charges nothing twice."""

    def settle(
        ref: RequestRef,
        realized: RdpCurve | None,
        release: dict[str, Any] | None,
        error: str | None,
        units: UnitUpdate | None,
    ) -> object:
        deadline, pause = time.monotonic() + patience, 0.2
        while True:
            try:
                with sessions() as session:
                    return settlement.settle(session, ref, realized, release, error, units)
            except SQLAlchemyError as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("settlement failed; retrying", request_id=ref.id, **failure_fields(exc))
                time.sleep(pause)
                pause = min(2.0, pause * 2)

    return settle


class QueueWorker:
    """A Dramatiq consumer of wake-ups and a :class:`FairRunner` of ``threads`` worker threads."""

    def __init__(self, settings: Settings, threads: int) -> None:
        self.settings = settings
        self.engine = make_engine(settings.database_url, max(2, threads + 2))
        self.sessions = make_sessionmaker(self.engine)
        self.tables = build_tables(settings)
        settle = settle_with_retry(self.sessions)
        sessions, tables = self.sessions, self.tables
        self.runner = FairRunner(
            lambda on_claim: run_next(
                sessions,
                tables,
                settings.lease_seconds,
                settings.heartbeat_seconds,
                settle,
                on_claim,
                settings.queue_name,
                settings.max_claimed_per_analyst,
            ),
            lambda claimed: stop_runs(sessions, claimed, SHUTDOWN_REASON),
            threads,
            settings.poll_seconds,
            "expost-queue-worker",
        )

        def body(request_id: str) -> None:
            # Hand the wake-up to an idle thread; while every thread is busy, hold it for up to a poll
            # interval so that an idle worker process can take the next wake-up instead.
            if not self.runner.draining:
                self.runner.wake(wait_idle=settings.poll_seconds)

        self.broker = make_broker(settings.broker_url)
        dramatiq.set_broker(self.broker)
        declare_actor(self.broker, settings.queue_name, body)
        # worker_timeout bounds the consumer's idle back-off (Dramatiq's default, 1 s, would add up to a
        # second of latency to a wake-up); polling Redis every 50 ms at most is cheap. One consumer thread
        # and no prefetch: wake-ups this process cannot serve soon stay in Redis for other workers.
        self.worker = dramatiq.Worker(
            self.broker, queues={settings.queue_name}, worker_threads=1, worker_timeout=50
        )
        self.worker.queue_prefetch = 1

    @property
    def outcomes(self) -> dict[str, int]:
        return self.runner.outcomes

    def start(self) -> None:
        self.runner.start()
        self.worker.start()

    def stop(self, deadline: float | None = None) -> None:
        """Stop consuming, let runs finish until ``deadline`` (default: the grace period from now), then
        stop those still running (worst case charged); queued requests stay for other workers."""
        if deadline is None:
            deadline = time.monotonic() + self.settings.shutdown_grace_seconds
        self.runner.drain()
        self.worker.stop(timeout=2_000)
        self.runner.shutdown(deadline)
        self.broker.close()
        self.engine.dispose()
