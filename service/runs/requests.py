"""The request lifecycle seen from the API: submit (validate → admit + reserve → run or queue → wait),
cancel, and the public views of a request (phase, progress, ETA).

States (stored): running → committed | failed_charged | aborted. A ``running`` request is **queued** while
no worker has claimed it (``lease_owner`` NULL: nothing has read the data) and **running** once a worker
claimed it. A cancel aborts a queued request without charge and charges a claimed one its worst case (its
run then stops at its next heartbeat).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any, Generic, TypeVar, cast

import anyio.to_thread
import structlog
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import RdpCurve
from mechanisms.base import Mechanism, has_public_progress, is_long_running
from mechanisms.catalog import MECHANISMS
from service import metrics
from service.auth import Principal, Role
from service.datasets import TableCache, cached_visible_dataset
from service.errors import (
    BudgetExhausted,
    Conflict,
    Forbidden,
    InvalidInput,
    NoBudget,
    NotCancellable,
    NotFound,
    ServiceUnavailable,
)
from service.filter.batch import FilterRow
from service.filter.refusals import record_refusal
from service.runs.admission import (
    RequestBatch,
    Validated,
    accounting_description,
    admission_check,
    unit_description,
    validate,
    validated_for,
)
from service.runs.runtime import Runtime
from service.runs.settlement import (
    RequestRef,
    abort,
    notify_settled,
    release_batched,
    settle_batched,
    transition,
    wait_settled,
)
from service.runs.worker import execute
from service.runs.writer import ONE_TRANSACTION, RunFn
from service.store.models import AnalysisRequest, RequestState
from service.store.repositories import RequestRepository
from service.store.repositories.base import HistoryFilter

log = structlog.get_logger("expost.requests")

MAX_ASYNC_WAITERS = 256
"""One-transaction requests awaiting the writer at once; beyond, requests take the thread-pool path, whose
40 threads make further clients wait for a thread (the back-pressure every other request has)."""


@dataclass(frozen=True)
class Submission:
    """One analysis request as submitted: who, on which dataset, which mechanism with which parameters,
    its Idempotency-Key and how long the caller waits for the release (None: the server's window)."""

    principal: Principal
    dataset_id: str
    mechanism: str
    params: Any
    key: str | None = None
    wait_seconds: float | None = None


async def submit_async(runtime: Runtime, s: Submission) -> AnalysisRequest:
    """The submission plan of every HTTP front (the route, the direct route, the SQL front): the cheapest
    requests on the event loop (:func:`submit_one_transaction`), the rest in a worker thread
    (:func:`submit`). A refusal is recorded (best-effort, after the admission transaction) and raised."""
    try:
        request = await submit_one_transaction(runtime, s)
        if request is None:
            request = await anyio.to_thread.run_sync(submit, runtime, s)
    except BudgetExhausted as refused:
        kind, mechanism, params = "request", s.mechanism, s.params
        record = partial(record_refusal, runtime.sessions, s.principal, s.dataset_id, kind, mechanism, params)
        await anyio.to_thread.run_sync(record, refused)
        raise
    return request


def submit(runtime: Runtime, s: Submission) -> AnalysisRequest:
    """Validate (read-only), admit + reserve (one durable transaction), run, settle, respond.

    Cheap mechanisms (``settings.inline_mechanisms``) run in the request's thread; others (and every
    long-running mechanism) go to the executor and the response waits up to the wait window (else 202).
    """
    principal, dataset_id, mechanism, params, key = s.principal, s.dataset_id, s.mechanism, s.params, s.key
    started = time.monotonic()
    if runtime.draining.is_set():
        raise ServiceUnavailable("the service is shutting down; retry on another instance or later")
    with runtime.sessions() as session:
        v = _placed(runtime, validate(session, principal, dataset_id, mechanism, params))
    runtime.tables.check_fits(v.dataset, v.mechanism.name)  # a learner's row limit, before any reservation
    runtime.tables.check_available(v.dataset)  # a store that is down refuses before anything is reserved
    try:
        if v.inline:
            # One transaction: admit + reserve, run here (microseconds), commit the realized charge and
            # store the release (docs/privacy/workers.md#workers); a replay returns the stored request.
            request, created = runtime.writer.admit_and_run(
                principal, v, key, runtime.settings.lease_seconds, _inline_run(runtime, v)
            )
        else:
            request, created = runtime.writer.admit(principal, v, key, runtime.settings.lease_seconds)
    except (BudgetExhausted, NoBudget) as exc:
        _refused(mechanism, exc)
        raise
    _admitted(request, created, principal, dataset_id, mechanism)
    if created and v.inline:
        if request.state != RequestState.RUNNING:
            return request
    elif created:
        try:
            runtime.executor.submit(request.id)  # a wake-up: the request is queued in the database already
        except RuntimeError:  # the executor is shutting down or the broker is unreachable
            with runtime.sessions() as session:
                aborted = abort(
                    session,
                    RequestRef.of(request),
                    "the request could not be queued; nothing was charged",
                    unclaimed_only=True,
                )
            if aborted:
                notify_settled()
                raise ServiceUnavailable("the service cannot run requests now; retry later") from None
            # a worker got it after all: wait for its release
    remaining = _wait_left(runtime, s.wait_seconds, started)
    return wait_settled(runtime.sessions, request.id, remaining, runtime.draining)


def _wait_left(runtime: Runtime, wait_seconds: float | None, started: float) -> float:
    """What is left of the response's wait window (the server's, or the caller's if shorter)."""
    window = min(runtime.settings.wait_seconds, wait_seconds if wait_seconds is not None else math.inf)
    return max(0.0, window - (time.monotonic() - started))


async def submit_one_transaction(runtime: Runtime, s: Submission) -> AnalysisRequest | None:
    """:func:`submit` on the event loop for the cheapest requests, or None (nothing done) if it does not
    apply. It applies to an inline Laplace or Gaussian query (``writer.ONE_TRANSACTION``) on a dataset
    whose row and grant this process has cached: validation needs no database read, and the request is
    one writer job (admit + reserve, run, commit with its release) whose commit is awaited, not waited
    for in a thread. Everything else (a cache miss, a queued mechanism, shutdown) is for :func:`submit`.
    """
    if runtime.writer.async_waiters >= MAX_ASYNC_WAITERS:  # back-pressure: the thread pool's limit
        return None
    principal, dataset_id, mechanism, key = s.principal, s.dataset_id, s.mechanism, s.key
    started = time.monotonic()
    v = _cached_validation(runtime, principal, dataset_id, mechanism, s.params)
    if v is None or not v.inline or not runtime.tables.loaded(v.dataset):  # loading is for a worker thread
        return None
    try:
        request, created = await runtime.writer.admit_and_run_async(
            principal, v, key, runtime.settings.lease_seconds, _inline_run(runtime, v)
        )
    except (BudgetExhausted, NoBudget) as exc:
        _refused(mechanism, exc)
        raise
    _admitted(request, created, principal, dataset_id, mechanism)
    if request.state == RequestState.RUNNING:  # a replay of one admitted on the two-phase path
        remaining = _wait_left(runtime, s.wait_seconds, started)
        draining = runtime.draining
        return await anyio.to_thread.run_sync(wait_settled, runtime.sessions, request.id, remaining, draining)
    return request


def _cached_validation(
    runtime: Runtime, principal: Principal, dataset_id: str, mechanism: str, params: Any
) -> Validated | None:
    """The validated one-transaction request, from this process's caches only; None where that needs a
    database read or the request is not one-transaction."""
    if (
        runtime.draining.is_set()
        or mechanism not in ONE_TRANSACTION
        or mechanism not in runtime.settings.inline_mechanisms
    ):
        return None
    dataset = cached_visible_dataset(principal, dataset_id)
    if dataset is None:
        return None
    # The standard library's JSON, not orjson's: orjson writes NaN and ±∞ as null, so two different
    # parameter values would share a key.
    try:
        key = (dataset.id, mechanism, json.dumps(params, sort_keys=True))
    except (TypeError, ValueError, RecursionError):  # nested too deep to encode: validated, not remembered
        return _placed(runtime, validated_for(dataset, MECHANISMS[mechanism], params))
    validated = _VALIDATED.get(key)
    if validated is None or validated.dataset is not dataset:  # a dataset re-read since: validate again
        validated = validated_for(dataset, MECHANISMS[mechanism], params)  # raises for bad parameters
        if len(_VALIDATED) >= _VALIDATED_CAPACITY:
            _VALIDATED.clear()
        _VALIDATED[key] = validated
    return _placed(runtime, validated)


#: One-transaction requests validated by this process, by (dataset id, mechanism, parameters as sorted
#: JSON): a dashboard or a client repeating one query is validated once. Sound because validation reads
#: public information only, datasets are immutable (``public_context`` caches them the same way) and the
#: parameter models are frozen; a dataset's access is still checked per request (cached_visible_dataset)
#: and again under the filter locks.
_VALIDATED: dict[tuple[str, str, str], Validated] = {}
_VALIDATED_CAPACITY = 1024


def _placed(runtime: Runtime, validated: Validated) -> Validated:
    """Where a validated request runs: inline in this process (the operator's cheap mechanisms, never a
    long-running one) or on the executor; with the execution limits and queue of this process."""
    inline = (
        validated.mechanism.name in runtime.settings.inline_mechanisms
        and not is_long_running(validated.mechanism)
        and runtime.tables.in_memory(validated.dataset)  # a scan never runs on the writer thread
        and validated.context.schema.privacy_unit is None  # nor a unit bounding (a sort per release)
    )
    return replace(validated, inline=inline, limits=runtime.limits(), queue=runtime.settings.queue_name)


def _inline_run(runtime: Runtime, v: Validated) -> RunFn:
    """The run of an inline request: reads the data, draws the noise (``worker.execute``). Requests name
    only one-shot mechanisms (sessions are a separate endpoint); the cast spares a runtime Protocol check,
    which costs more than the rest of this function."""
    mechanism = cast(Mechanism[Any], v.mechanism)

    def run() -> tuple[RdpCurve | None, dict[str, Any] | None, str | None]:
        return execute(v.dataset, mechanism, v.params, v.context, runtime.tables, v.worst_case)

    return run


def _refused(mechanism: str, exc: BudgetExhausted | NoBudget) -> None:
    metrics.REQUESTS.labels(mechanism, "refused").inc()
    metrics.refused(exc, "request")


def _admitted(
    request: AnalysisRequest, created: bool, principal: Principal, dataset_id: str, mechanism: str
) -> None:
    metrics.REQUESTS.labels(mechanism, "admitted" if created else "replayed").inc()
    log.info(
        "admitted" if created else "replayed",
        request_id=request.id,
        dataset_id=dataset_id,
        mechanism=mechanism,
        analyst=principal.name,
    )


def dry_run(
    session: Session,
    principal: Principal,
    dataset_id: str,
    mechanism: str,
    params: Any,
    tables: TableCache | None = None,
) -> dict[str, Any]:
    """Would the request be admitted now? Validates, refuses what ``tables.check_fits`` refuses on a real
    submission (a learner's row limit, a mechanism without a unit analysis), checks the filters; takes no
    lock, writes nothing. On a privacy-unit dataset the result says what a unit is and the bound in force;
    on every dataset, how it is accounted (``accounting``, and what individual accounting means)."""
    v = validate(session, principal, dataset_id, mechanism, params)
    if tables is not None:
        tables.check_fits(v.dataset, v.mechanism.name)
    result = admission_check(session, principal, v)
    unit = v.context.schema.privacy_unit
    if unit is not None:
        result["privacy_unit"] = unit_description(unit.column, unit.max_rows)
    return result | accounting_description(v.context.schema)


def cancel(sessions: sessionmaker[Session], principal: Principal, request_id: str) -> AnalysisRequest:
    """Cancel a request (its owner or an admin). Queued (no worker claimed it: the data was never read):
    aborted, the reservation released without charge. Running (claimed: the data may have been read):
    charged its worst case now, its output never released; the run stops at its next heartbeat.
    Cancelling a request already cancelled returns it unchanged; any other finished one is a 409."""
    with sessions() as session:
        request = get_visible(session, principal, request_id)
        if principal.role.value not in ("admin", "analyst"):
            raise Forbidden("only the owner or an admin can cancel a request")
        if request.kind != "request":
            raise Conflict("this is a session's reservation; close the session instead")
        ref = RequestRef.of(request)

    def change(batch: RequestBatch, filters: list[FilterRow], row: AnalysisRequest) -> bool:
        if row.lease_owner is None:
            reason = "cancelled before a worker started it; nothing was charged"
            release_batched(batch, filters, row, reason, {"reason": reason, "outcome": "cancelled"})
        else:
            reason = "cancelled while running; its worst case was charged (the data had been read)"
            settle_batched(batch, filters, row, None, None, reason)
        batch.settled(row, {"cancelled_by": principal.name})
        return True

    with sessions() as session:
        cancelled = transition(session, ref, change)
    if cancelled is None:
        with sessions() as session:
            final = RequestRepository(session).get(ref.id)
        assert final is not None
        if final.cancelled_by is None:
            raise NotCancellable(f"request {ref.id} has already finished ({final.state})", state=final.state)
        return final
    row = cancelled
    notify_settled()
    log.info("cancelled", request_id=ref.id, by=principal.name, outcome=row.state)
    return row


def get_visible(session: Session, principal: Principal, request_id: str) -> AnalysisRequest:
    if principal.role.value == "viewer":
        raise Forbidden("viewers cannot read releases")
    request = RequestRepository(session).get(request_id)
    if request is None or (principal.role.value == "analyst" and request.analyst != principal.name):
        raise NotFound(f"no request {request_id!r}")
    return request


T = TypeVar("T")


@dataclass(frozen=True)
class HistoryPage(Generic[T]):
    """One page of a history listing, newest first; ``next_after`` is the id of its last item when more
    follow (the ``after`` of the next page), else None."""

    items: Sequence[T]
    next_after: str | None


@dataclass(frozen=True)
class HistoryQuery:
    """A history listing's filters (each None: any) and its page: ``after`` is the id of the previous
    page's last item, ``limit`` the page size."""

    analyst: str | None = None
    dataset_id: str | None = None
    state: str | None = None
    after: str | None = None
    limit: int = 100


def history_owner(principal: Principal, analyst: str | None) -> str | None:
    """Whose requests and sessions ``principal`` may list: analysts their own (asking for another analyst's
    is a 403), admins everyone's or ``analyst``'s; viewers none (they cannot read releases or answers).
    Returns the analyst to filter on, None for everyone."""
    if principal.role is Role.viewer:
        raise Forbidden("viewers cannot read releases or session answers")
    if principal.role is Role.analyst:
        if analyst is not None and analyst != principal.name:
            raise Forbidden("analysts can list only their own requests and sessions")
        return principal.name
    return analyst


def _may_see(principal: Principal, analyst: str) -> bool:
    return principal.role is Role.admin or analyst == principal.name


def history_page(rows: Sequence[T], limit: int, key: Callable[[T], str]) -> HistoryPage[T]:
    """The first ``limit`` of ``rows`` (fetched ``limit + 1``, so a full last page has no cursor)."""
    items = rows[:limit]
    return HistoryPage(items, key(items[-1]) if len(rows) > limit else None)


def history(session: Session, principal: Principal, query: HistoryQuery) -> HistoryPage[AnalysisRequest]:
    """The caller's requests (admins: everyone's, or ``analyst``'s), newest first, optionally of one dataset
    or in one state; ``after`` is the id of the previous page's last item. Sessions' reservations are
    listed as sessions, not here."""
    owner = history_owner(principal, query.analyst)
    repository = RequestRepository(session)
    before = None
    if query.after is not None:
        cursor = repository.get(query.after)
        if cursor is None or cursor.kind != "request" or not _may_see(principal, cursor.analyst):
            raise InvalidInput("query.after", f"no request {query.after!r} in this listing to continue after")
        before = (cursor.created_at, cursor.id)
    rows = repository.history(HistoryFilter(owner, query.dataset_id, query.state, before, query.limit + 1))
    return history_page(rows, query.limit, lambda row: row.id)


def public_progress(request: AnalysisRequest) -> float | None:
    """The progress shown for a request: only for mechanisms whose amount of work is public."""
    if not has_public_progress(MECHANISMS.get(request.mechanism)):
        return None
    return 1.0 if request.state == RequestState.COMMITTED else request.progress


def phase(request: AnalysisRequest) -> str | None:
    """``queued`` (reserved, waiting for a worker: cancelling it costs nothing), ``running`` (a worker
    claimed it), or None once settled."""
    if request.state != RequestState.RUNNING:
        return None
    return "queued" if request.lease_owner is None else "running"


def eta_seconds(request: AnalysisRequest, now: datetime | None = None) -> float | None:
    """Seconds left of a running request, from public quantities only: the time since its worker started
    it and its public fraction done (steps done of steps admitted). None when either is unknown."""
    fraction = public_progress(request)
    running = request.state == RequestState.RUNNING
    if not running or request.started_at is None or fraction is None or fraction <= 0:
        return None
    elapsed = ((now or datetime.now(UTC)) - request.started_at).total_seconds()
    return round(max(0.0, elapsed * (1.0 - fraction) / fraction), 1)
