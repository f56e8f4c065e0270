"""Prometheus metrics (served at ``/metrics``): domain events and service health, never data.

Every label value comes from a bounded, public set: mechanism names (the catalog), outcomes, problem
types, filter kinds (``dataset`` / ``analyst``, never an analyst's name), dataset ids (created by
admins, public to every role that can see the dataset), route templates, HTTP methods and status
classes. No metric carries secret state, raw data, a released value, an API key or a request body. The
charge counters are totals of charges, which the budget endpoints already publish; every one of them is
a function of public parameters and of differentially private releases.

Two kinds of metrics:

* **Process metrics** (counters, histograms and the queue gauges below): each process counts its own
  events. With several server processes (``expost serve --workers N``) set ``PROMETHEUS_MULTIPROC_DIR``
  to an empty directory shared by them: the values are then kept in files there and ``/metrics`` of any
  process reports the sum over all of them (``prometheus_client`` multiprocess mode; docs/operations.md).
* **Database gauges** (reservations held, open sessions): read from the database when ``/metrics`` is
  scraped, so they are the same whichever process answers, and survive restarts.

Charge counters move only when the transaction that commits the charge commits (see :func:`ended`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import anyio
import structlog
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, make_asgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import UnitsVector, units_to_epsilon
from service.errors import BudgetExhausted, NoBudget
from service.store.models import AnalysisRequest, RequestState

log = structlog.get_logger("expost.metrics")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# ----- requests, refusals and charges ----------------------------------------------------------------

REQUESTS = Counter(
    "expost_requests_total",
    "Analysis requests and interactive sessions opened, by mechanism and outcome (admitted|refused|replayed)",
    ["mechanism", "outcome"],
)
REFUSALS = Counter(
    "expost_refusals_total",
    "Requests and sessions refused by a filter (409), by problem type "
    "(budget-exhausted|not-admissible|no-budget), the refusing filter (dataset|analyst) and kind",
    ["reason", "filter", "kind"],
)
COMMITS = Counter(
    "expost_commits_total",
    "Reservations replaced by a committed charge, by dataset, kind (request|session) and outcome "
    "(released|failed: a failure after reading the data commits the worst case)",
    ["dataset", "kind", "outcome"],
)
CHARGED_EPSILON = Counter(
    "expost_charged_epsilon_total",
    "Sum of committed charges at the pure slot (α = ∞), in ε, over commits whose pure charge is finite "
    "(Gaussian releases have none: see expost_commits_total). Monitoring only; the ledger is exact.",
    ["dataset"],
)
ABORTS = Counter(
    "expost_aborts_total",
    "Reservations released without charge (the data was provably never read)",
    ["dataset", "kind"],
)
SESSIONS_CLOSED = Counter(
    "expost_sessions_closed_total",
    "Interactive sessions closed, by mechanism and reason (halted|max_queries|closed|expired|failed)",
    ["mechanism", "reason"],
)

# ----- HTTP --------------------------------------------------------------------------------------------

DIRECT_SUBMIT_DECLINED = Counter(
    "expost_direct_submit_declined_total",
    "Submissions (POST …/requests) the direct route handed to the FastAPI route, by reason "
    "(headers|body: input the FastAPI route answers with a 400 or 422)",
    ["reason"],
)
HTTP_LATENCY = Histogram(
    "expost_http_request_duration_seconds",
    "HTTP request latency by route template, method and status class (2xx, 4xx, …)",
    ["route", "method", "status"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)

# ----- the group-commit writer and the executor ------------------------------------------------------

WRITER_BATCH = Histogram(
    "expost_writer_batch_size",
    "Jobs (admissions and settlements) committed together by the group-commit writer",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
WRITER_QUEUE = Gauge(
    "expost_writer_queue_depth",
    "Admissions and settlements waiting for the group-commit writer (summed over live processes)",
    multiprocess_mode="livesum",
)
EXECUTOR_QUEUED = Gauge(
    "expost_executor_queued_jobs",
    "Wake-ups not yet taken by an idle worker thread (summed over live processes); the queued requests "
    "themselves are in the database (expost_reservations_held counts reservations held)",
    multiprocess_mode="livesum",
)
EXECUTOR_RUNNING = Gauge(
    "expost_executor_running_jobs",
    "Requests running on executor threads (summed over live processes)",
    multiprocess_mode="livesum",
)


def refused(exc: Exception, kind: str) -> None:
    """Count a refusal (``BudgetExhausted``, ``NotAdmissible`` or ``NoBudget``) by problem type and filter."""
    if isinstance(exc, BudgetExhausted):
        flt = "analyst" if str(exc.extensions.get("filter", "")).startswith("analyst") else "dataset"
    elif isinstance(exc, NoBudget):
        flt = "dataset"  # only the dataset filter must have a budget
    else:
        return
    REFUSALS.labels(exc.type_slug, flt, kind).inc()


# Charges are counted when their transaction commits: ``ended`` queues them on the SQLAlchemy session,
# the listeners below publish them after COMMIT and drop them on ROLLBACK (e.g. a failed writer batch
# whose jobs are then retried one by one), so a charge is never counted twice nor before it is durable.
_PENDING = "expost.metrics.pending"


def after_commit(session: Session, publish: Callable[[], None]) -> None:
    """Run ``publish`` (a metric update) once the session's current transaction commits; never if not."""
    session.info.setdefault(_PENDING, []).append(publish)


def ended(session: Session, dataset_id: str, kind: str, outcome: str, charge: UnitsVector | None) -> None:
    """A reservation ends in this transaction: committed with ``charge`` (outcome released|failed) or
    aborted (``charge`` None)."""

    def publish() -> None:
        if charge is None:
            ABORTS.labels(dataset_id, kind).inc()
            return
        COMMITS.labels(dataset_id, kind, outcome).inc()
        pure = len(charge) - 1
        if not charge.is_infinite(pure):
            CHARGED_EPSILON.labels(dataset_id).inc(units_to_epsilon(charge.finite[pure]))

    after_commit(session, publish)


def session_closed(session: Session, mechanism: str, reason: str) -> None:
    """A session closes in this transaction (halted, max_queries, closed, expired or failed)."""
    after_commit(session, lambda: SESSIONS_CLOSED.labels(mechanism, reason).inc())


@event.listens_for(Session, "after_commit")
def _publish(session: Session) -> None:
    for publish in session.info.pop(_PENDING, ()):
        publish()


@event.listens_for(Session, "after_transaction_end")
def _discard(session: Session, transaction: Any) -> None:
    """Whatever is still pending when the outermost transaction ends did not commit."""
    if transaction.parent is None:
        session.info.pop(_PENDING, None)


# ----- gauges read from the database at scrape time --------------------------------------------------


class DatabaseGauges:
    """Reservations held (running requests and open sessions) per dataset, and open sessions per
    mechanism, from the ``requests`` table. ``refresh`` runs in a worker thread before each scrape."""

    def __init__(self, sessions: Callable[[], sessionmaker[Session] | None]) -> None:
        self._sessions = sessions
        self._lock = threading.Lock()
        self._rows: list[tuple[str, str, str, int]] | None = None

    def refresh(self) -> None:
        sessions = self._sessions()
        if sessions is None:
            return
        query = (
            select(AnalysisRequest.dataset_id, AnalysisRequest.kind, AnalysisRequest.mechanism, func.count())
            .where(AnalysisRequest.state == RequestState.RUNNING)
            .group_by(AnalysisRequest.dataset_id, AnalysisRequest.kind, AnalysisRequest.mechanism)
        )
        try:
            with sessions() as session:
                rows = [(str(d), str(k), str(m), int(n)) for d, k, m, n in session.execute(query)]
        except Exception:
            log.warning("metrics: could not read reservations from the database", exc_info=True)
            rows = None
        with self._lock:
            self._rows = rows

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            rows = self._rows
        if rows is None:
            return []
        held = GaugeMetricFamily(
            "expost_reservations_held",
            "Reservations currently held (running requests and open sessions), by dataset and kind",
            labels=["dataset", "kind"],
        )
        sessions = GaugeMetricFamily(
            "expost_sessions_open", "Interactive sessions currently open, by mechanism", labels=["mechanism"]
        )
        by_scope: dict[tuple[str, str], int] = {}
        by_mechanism: dict[str, int] = {}
        for dataset, kind, mechanism, count in rows:
            by_scope[(dataset, kind)] = by_scope.get((dataset, kind), 0) + count
            if kind == "session":
                by_mechanism[mechanism] = by_mechanism.get(mechanism, 0) + count
        for (dataset, kind), count in sorted(by_scope.items()):
            held.add_metric([dataset, kind], count)
        for mechanism, count in sorted(by_mechanism.items()):
            sessions.add_metric([mechanism], count)
        return [held, sessions]


class _Forward:
    """Serve the process-wide default registry from a per-app registry."""

    def collect(self) -> Iterable[Metric]:
        return REGISTRY.collect()


def multiprocess_dir() -> str | None:
    """The multiprocess directory, or None. Like prometheus_client, the variable's presence (either
    spelling) switches the mode; a value that is not a directory is an error when ``/metrics`` is built."""
    for name in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir"):
        if name in os.environ:
            return os.environ[name]
    return None


def process_exited() -> None:
    """Multiprocess mode: drop this process's live gauges (its queues are gone with it)."""
    path = multiprocess_dir()
    if path is not None:
        mark_process_dead(os.getpid(), path)  # type: ignore[no-untyped-call]


def asgi_app(app: Any) -> ASGIApp:
    """The ``/metrics`` endpoint of ``app``: the process registry (or, with PROMETHEUS_MULTIPROC_DIR,
    every process's files) plus the database gauges read through ``app.state.runtime``'s sessions."""
    registry = CollectorRegistry()
    path = multiprocess_dir()
    if path is not None:
        MultiProcessCollector(registry, path)  # type: ignore[no-untyped-call]
    else:
        registry.register(_Forward())
    database = DatabaseGauges(lambda: getattr(getattr(app.state, "runtime", None), "sessions", None))
    registry.register(database)
    exposition: ASGIApp = make_asgi_app(registry)

    async def metrics_app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await anyio.to_thread.run_sync(database.refresh)
        await exposition(scope, receive, send)

    return metrics_app
