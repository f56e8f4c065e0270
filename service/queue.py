"""The distributed executor: a Dramatiq task queue on Redis, served by ``expost worker`` processes.

Budget decisions never travel through the queue. A task carries only the request id; the budget was
reserved by the API's admission transaction before the task was sent. A worker (on any machine that
reaches the database and the broker):

1. **claims** the request: one conditional ``UPDATE … SET lease_owner = me WHERE state = 'running' AND
   lease_owner IS NULL AND lease_expires_at > now``. Of two deliveries of one task, or two workers racing
   for one request, exactly one gets a row count of 1; the others return without reading the data;
2. runs it, renewing the lease through the heartbeat of long-running mechanisms;
3. settles once (the settlement is a no-op when the request is no longer running, e.g. reaped).

A worker killed mid-run leaves its request ``running`` with a lease nobody renews: the reaper (every API
process and every worker runs one) commits its worst case once the lease expires. Dramatiq may deliver
the task again (Redis broker: after its heartbeat timeout); that delivery finds the request claimed or
settled and does nothing. Retries (on exceptions such as a database restart) are therefore harmless too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import dramatiq
import structlog
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Retries, ShutdownNotifications, TimeLimit
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import RdpCurve
from service.config import Settings
from service.datasets import TableCache
from service.logs import failure_fields

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
    """Sends request ids to the queue. The returned future is done once the task is enqueued; the API
    then waits for the settlement in the database (``requests.wait_settled``)."""

    def __init__(self, settings: Settings) -> None:
        self.broker = make_broker(settings.broker_url)
        self.actor = declare_actor(self.broker, settings.queue_name, _never)

    def submit(self, request_id: str) -> Future[None]:
        try:
            self.actor.send(request_id)
        except Exception as exc:  # broker unreachable: the caller aborts the unclaimed request
            log.error("could not enqueue a request", request_id=request_id, **failure_fields(exc))
            raise RuntimeError("the task queue is unreachable") from exc
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def shutdown(self) -> None:
        self.broker.close()


def settle_with_retry(
    sessions: sessionmaker[Session], patience: float = 30.0
) -> Any:
    """A settlement that survives a short database outage (restart, failover): retried with backoff for
    up to ``patience`` seconds. Settling is idempotent (a no-op once the request is no longer running),
    so a retry after a commit whose acknowledgement was lost charges nothing twice."""
    from service import requests as lifecycle

    def settle(
        ref: lifecycle.RequestRef,
        realized: RdpCurve | None,
        release: dict[str, Any] | None,
        error: str | None,
    ) -> object:
        deadline, pause = time.monotonic() + patience, 0.2
        while True:
            try:
                with sessions() as session:
                    return lifecycle.settle(session, ref, realized, release, error)
            except SQLAlchemyError as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("settlement failed; retrying", request_id=ref.id, **failure_fields(exc))
                time.sleep(pause)
                pause = min(2.0, pause * 2)

    return settle


class QueueWorker:
    """A Dramatiq worker consuming request ids, plus this process's reaper."""

    def __init__(self, settings: Settings, threads: int) -> None:
        from service.db.session import make_engine, make_sessionmaker
        from service.requests import run_request

        self.settings = settings
        self.engine = make_engine(settings.database_url, max(2, threads + 1))
        self.sessions = make_sessionmaker(self.engine)
        self.tables = TableCache(settings.data_dir)
        self.outcomes: dict[str, int] = {}
        self._lock = threading.Lock()
        settle = settle_with_retry(self.sessions)

        def body(request_id: str) -> None:
            outcome = run_request(
                self.sessions,
                self.tables,
                request_id,
                settings.lease_seconds,
                settings.heartbeat_seconds,
                settle_fn=settle,
            )
            with self._lock:
                self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            log.info("task done", request_id=request_id, outcome=outcome)

        self.broker = make_broker(settings.broker_url)
        dramatiq.set_broker(self.broker)
        declare_actor(self.broker, settings.queue_name, body)
        # worker_timeout bounds the consumer's idle back-off (Dramatiq's default, 1 s, would add up to a
        # second of latency to a task arriving at an idle or just-freed worker); polling Redis every
        # 50 ms at most is cheap.
        self.worker = dramatiq.Worker(
            self.broker, queues={settings.queue_name}, worker_threads=threads, worker_timeout=50
        )
        self.worker.queue_prefetch = threads  # no task waits behind a busy thread while another idles

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop(timeout=30_000)
        self.broker.close()
        self.engine.dispose()
