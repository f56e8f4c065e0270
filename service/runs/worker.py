"""The worker body: claim the next queued request in the fair order, run it with a heartbeat, settle
once; and the reaper that charges the runs whose worker was lost.

The database is the queue. Workers (the API's in-process threads, or ``expost worker`` processes woken by
the Dramatiq queue, ``service.runs.queue``) **claim** the next request in a fair order (:func:`claim_next`:
the analyst with the fewest requests running now, ties to the analyst served least recently, then that
analyst's oldest request), with one conditional UPDATE that sets ``lease_owner`` where it is NULL, so of
two workers exactly one runs it. The lease starts at the claim and is renewed by the heartbeat of
long-running mechanisms (their ``progress`` callback). The reaper tells the cases apart from the
database: a *claimed* request whose lease expired is charged its worst case (its worker was lost after
it may have read the data); a *queued* one is never charged and is aborted without charge only when no
worker claimed it within ``max_queue_seconds``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import structlog
from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import RdpCurve
from mechanisms.accounting.individual import UnitFilter
from mechanisms.base import (
    Mechanism,
    ProgressFn,
    PublicContext,
    Release,
    Table,
    has_public_progress,
    is_long_running,
)
from mechanisms.catalog import MECHANISMS
from mechanisms.noise import Noise
from mechanisms.queries.individual import IndividualTable
from service.datasets import TableCache, dataset_by_id, public_context
from service.filter.batch import FilterRow
from service.filter.individual import UNIT_FILTERS, UnitUpdate
from service.logs import failure_fields
from service.runs.admission import RequestBatch
from service.runs.leases import worker_id
from service.runs.settlement import (
    RequestRef,
    SettleFn,
    abort,
    notify_settled,
    settle,
    settle_batched,
    transition,
)
from service.store import unit
from service.store.models import AnalysisRequest, Dataset, RequestState
from service.store.repositories import RequestRepository

log = structlog.get_logger("expost.requests")


class LeaseLost(Exception):
    """Raised from a heartbeat when the request was settled (e.g. reaped) meanwhile: stop the run."""


class Heartbeat:
    """The ``progress`` callback of a long-running run: at most every ``interval`` seconds it renews the
    request's lease (so a live run is never reaped) and stores the fraction when ``public``.

    Raises :class:`LeaseLost` when the request is no longer running under this lease; the run is then
    abandoned (its charge was already committed by whoever settled it).
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        request_id: str,
        lease_seconds: float,
        owner: str | None,
        public: bool,
        interval: float = 1.0,
    ) -> None:
        self.sessions, self.request_id, self.lease_seconds = sessions, request_id, lease_seconds
        self.owner, self.public, self.interval = owner, public, interval
        self.beats = 0
        self._last = -float("inf")
        self._lock = threading.Lock()

    def __call__(self, fraction: float) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval:
                return
            self._last = now
        self.beat(fraction)

    def beat(self, fraction: float | None = None) -> None:
        progress = None
        if self.public and fraction is not None and np.isfinite(fraction):
            progress = float(min(1.0, max(0.0, fraction)))
        until = datetime.now(UTC) + timedelta(seconds=self.lease_seconds)
        try:
            with unit.transaction(self.sessions) as session:
                renewed = RequestRepository(session).renew(self.request_id, self.owner, until, progress)
        except SQLAlchemyError as exc:  # a database restart or an exhausted pool: the next beat tries again
            log.warning("heartbeat failed", request_id=self.request_id, **failure_fields(exc))
            return
        self.beats += 1
        if not renewed:
            raise LeaseLost(self.request_id)


def execute(
    dataset: Dataset,
    mechanism: Mechanism[Any],
    params: BaseModel,
    context: PublicContext,
    tables: TableCache,
    worst: RdpCurve | None = None,
    progress: ProgressFn | None = None,
) -> tuple[RdpCurve | None, dict[str, Any] | None, str | None]:
    """Read the data and run with fresh noise from the OS CSPRNG: (realized, output, error).

    A long-running mechanism (``mechanisms.base.LongRunningMechanism``) gets ``progress``, normally a
    :class:`Heartbeat`. Any failure after this point is charged the worst case: the data may have been read.
    """
    release, error = run_release(dataset, mechanism, params, context, tables, worst, progress)
    return (None, None, error) if release is None else (release.realized, release.output, None)


def run_release(
    dataset: Dataset,
    mechanism: Mechanism[Any],
    params: BaseModel,
    context: PublicContext,
    tables: TableCache,
    worst: RdpCurve | None = None,
    progress: ProgressFn | None = None,
    unit_filter: UnitFilter | None = None,
) -> tuple[Release | None, str | None]:
    """:func:`execute` returning the whole :class:`Release` (with its units' charges when ``unit_filter``,
    an individual dataset's filters, is given): (release, None) or (None, error)."""
    try:
        worst = worst or mechanism.worst_case(params, context)
        table: Table = tables.get(dataset, context.schema)
        if unit_filter is not None:
            table = IndividualTable(table, unit_filter)
        noise = Noise.system()
        if is_long_running(mechanism) and progress is not None:
            result = mechanism.run(params, context, table, noise, progress=progress)  # type: ignore[call-arg]
        else:
            result = mechanism.run(params, context, table, noise)
        if not result.realized <= worst:
            raise AssertionError("realized charge exceeds the worst case")
        if (unit_filter is None) != (result.units is None):
            raise AssertionError("an individual dataset's release must carry its units' charges")
    except LeaseLost:
        log.warning("lease lost during the run; its settlement is discarded", dataset_id=dataset.id)
        return None, "the worker lost its lease; its worst case was charged"
    except Exception as exc:
        log.error(
            "mechanism failed after reading data; charging the worst case",
            dataset_id=dataset.id,
            **failure_fields(exc),
        )
        return None, "the mechanism failed; its worst case was charged"
    return result, None


def load_unit_filters(
    sessions: sessionmaker[Session], dataset: Dataset, attempts: int = 3
) -> tuple[int, UnitFilter]:
    """(stored version, the dataset's unit filters); retried when another process replaced the base block
    between two reads (``read_state`` then finds the chain broken)."""
    orders = public_context(dataset).orders
    for attempt in range(attempts):
        try:
            with sessions() as session:
                return UNIT_FILTERS.load(session, dataset.id, orders)
        except ValueError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def run_individual(
    dataset: Dataset,
    mechanism: Mechanism[Any],
    params: BaseModel,
    tables: TableCache,
    progress: ProgressFn | None,
    version: int,
    unit_filter: UnitFilter,
) -> tuple[RdpCurve | None, dict[str, Any] | None, str | None, UnitUpdate | None]:
    """Run a release on an individual dataset on its unit filters at ``version`` (under the caller's unit
    lock): (realized, output, error, the units' new state for the settlement)."""
    context = public_context(dataset)
    release, error = run_release(
        dataset, mechanism, params, context, tables, progress=progress, unit_filter=unit_filter
    )
    if release is None or release.units is None:
        return None, None, error, None
    update = UnitUpdate.of(dataset.id, version, unit_filter.ledger, release.units)
    return release.realized, release.output, None, update


def claim(sessions: sessionmaker[Session], request_id: str, owner: str, lease_seconds: float) -> bool:
    """Take this queued request for ``owner`` (atomic conditional update); False if anyone else has it or
    it is settled. The lease starts now."""
    now = datetime.now(UTC)
    with unit.transaction(sessions) as session:
        until = now + timedelta(seconds=lease_seconds)
        return RequestRepository(session).claim(request_id, owner, now, until)


_NEVER = datetime.min.replace(tzinfo=UTC)


def _utc(value: datetime) -> datetime:
    """Aggregates bypass the column type: SQLite returns naive (UTC) datetimes, or even strings."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def runnable_mechanisms() -> list[str]:
    """What this process can run (a worker never claims a request of a mechanism it does not know)."""
    return sorted(MECHANISMS)


def claim_next(
    sessions: sessionmaker[Session],
    owner: str,
    lease_seconds: float,
    mechanisms: list[str] | None = None,
    queue: str | None = None,
    max_claimed_per_analyst: int = 0,
) -> str | None:
    """Claim the next queued request in the fair order, or None when nothing is queued.

    Order: the analyst with the fewest requests running on workers now; ties go to the analyst whose
    latest run started longest ago (round-robin); then that analyst's oldest request (FIFO per
    analyst). An analyst with ``max_claimed_per_analyst`` requests running already (when > 0) waits, so
    a flood from one analyst leaves workers free for the others (two workers claiming at the same moment
    may each take one more). The claim itself is one conditional UPDATE; losing a race to another worker
    retries. Only requests of ``queue`` (the deployment's ``EXPOST_QUEUE_NAME``) are considered.
    """
    known = runnable_mechanisms() if mechanisms is None else mechanisms
    for _ in range(10):
        with unit.transaction(sessions) as session:
            repository = RequestRepository(session)
            oldest = repository.queued_analysts(known, queue)
            load = repository.analyst_load(list(oldest)) if oldest else {}
            if max_claimed_per_analyst > 0:
                oldest = {a: t for a, t in oldest.items() if load[a][0] < max_claimed_per_analyst}
            if not oldest:
                return None
            chosen = min(oldest, key=lambda a: (load[a][0], _utc(load[a][1] or _NEVER), _utc(oldest[a]), a))
            request_id = repository.oldest_queued(chosen, known, queue)
            if request_id is None:
                continue
            now = datetime.now(UTC)
            if repository.claim(request_id, owner, now, now + timedelta(seconds=lease_seconds)):
                return request_id
    return None


def run_claimed(
    sessions: sessionmaker[Session],
    tables: TableCache,
    request_id: str,
    owner: str,
    lease_seconds: float,
    heartbeat_seconds: float,
    settle_fn: SettleFn | None,
) -> str:
    """Run a request this worker has claimed (with a heartbeat for long-running mechanisms), settle once."""
    with sessions() as session:
        request = RequestRepository(session).get(request_id)
        if request is None:
            return "missing"
        if request.state != RequestState.RUNNING or request.lease_owner != owner:
            return "lost"  # cancelled (worst case charged) right after the claim: do not start it
        dataset = dataset_by_id(session, request.dataset_id)
        assert dataset is not None
    ref = RequestRef.of(request)
    mechanism = MECHANISMS.get(request.mechanism)
    try:
        if mechanism is None:
            raise LookupError(f"unknown mechanism {request.mechanism!r}")
        params = mechanism.params_model.model_validate(request.params)
    except (LookupError, ValidationError) as exc:  # e.g. a worker of another version: nothing read yet
        log.error("this worker cannot run the request", request_id=request_id, **failure_fields(exc))
        with sessions() as session:
            abort(session, ref, "no worker could run this request; nothing was charged", owner=owner)
        notify_settled()
        return "unrunnable"
    heartbeat = None
    if is_long_running(mechanism):
        public = has_public_progress(mechanism)
        heartbeat = Heartbeat(sessions, request_id, lease_seconds, owner, public, heartbeat_seconds)
    if public_context(dataset).schema.individual:
        waiting = heartbeat or Heartbeat(sessions, request_id, lease_seconds, owner, False, heartbeat_seconds)
        lock = UNIT_FILTERS.lock(dataset.id)  # each release's exclusions depend on the previous charges
        try:
            while not lock.acquire(timeout=heartbeat_seconds):
                waiting.beat()  # renew the lease while another release of the dataset runs
        except LeaseLost:  # cancelled or reaped while waiting (its worst case charged): nothing read
            return "lost"
        try:
            try:
                version, unit_filter = load_unit_filters(sessions, dataset)
            except (ValueError, SQLAlchemyError) as exc:  # nothing of the data was read: no charge
                log.error("unit filters could not be read", request_id=request_id, **failure_fields(exc))
                with sessions() as session:
                    abort(
                        session, ref, "the units' filters could not be read; nothing was charged", owner=owner
                    )
                notify_settled()
                return "unrunnable"
            realized, output, error, units = run_individual(
                dataset, mechanism, params, tables, heartbeat, version, unit_filter
            )
            settled = _settle(sessions, settle_fn, ref, realized, output, error, units)
            if units is not None and getattr(settled, "state", None) == RequestState.COMMITTED:
                UNIT_FILTERS.remember(dataset.id, units.expected + 1, units.ledger)  # stored: current now
        finally:
            lock.release()
    else:
        realized, output, error = execute(
            dataset, mechanism, params, public_context(dataset), tables, progress=heartbeat
        )
        settled = _settle(sessions, settle_fn, ref, realized, output, error, None)
    notify_settled()
    return "lost" if settled is None else "settled"


def _settle(
    sessions: sessionmaker[Session],
    settle_fn: SettleFn | None,
    ref: RequestRef,
    realized: RdpCurve | None,
    output: dict[str, Any] | None,
    error: str | None,
    units: UnitUpdate | None,
) -> object:
    if settle_fn is not None:
        return settle_fn(ref, realized, output, error, units)
    with sessions() as session:
        return settle(session, ref, realized, output, error, units)


def run_request(
    sessions: sessionmaker[Session],
    tables: TableCache,
    request_id: str,
    lease_seconds: float = 300.0,
    heartbeat_seconds: float = 1.0,
    settle_fn: SettleFn | None = None,
) -> str:
    """Claim this request (if still queued), run it, settle once.

    Returns what happened: ``"settled"``, ``"duplicate"`` (someone else claimed it or it is no longer
    running: nothing was read, nothing charged), ``"lost"`` (settled by someone else, e.g. the reaper
    or a cancel, while this run went on: its output is discarded), ``"unrunnable"`` (this worker does not
    know the mechanism or its parameters: aborted without charge if nobody claimed it) or ``"missing"``.
    """
    with sessions() as session:
        request = RequestRepository(session).get(request_id)
        if request is None:
            return "missing"
        if request.state != RequestState.RUNNING:
            return "duplicate"
    mechanism = MECHANISMS.get(request.mechanism)
    try:
        if mechanism is None:
            raise LookupError(f"unknown mechanism {request.mechanism!r}")
        mechanism.params_model.model_validate(request.params)
    except (LookupError, ValidationError) as exc:  # e.g. a worker of another version: nothing read yet
        log.error("this worker cannot run the request", request_id=request_id, **failure_fields(exc))
        with sessions() as session:
            abort(
                session,
                RequestRef.of(request),
                "no worker could run this request; nothing was charged",
                unclaimed_only=True,
            )
        notify_settled()
        return "unrunnable"
    owner = worker_id()
    if not claim(sessions, request_id, owner, lease_seconds):
        log.info("request already claimed or settled; not running it", request_id=request_id)
        return "duplicate"
    return run_claimed(sessions, tables, request_id, owner, lease_seconds, heartbeat_seconds, settle_fn)


def run_next(
    sessions: sessionmaker[Session],
    tables: TableCache,
    lease_seconds: float = 300.0,
    heartbeat_seconds: float = 1.0,
    settle_fn: SettleFn | None = None,
    on_claim: Callable[[str, str], None] | None = None,
    queue: str | None = None,
    max_claimed_per_analyst: int = 0,
) -> tuple[str, str] | None:
    """Worker body: claim the next request in the fair order and run it: (request id, outcome as for
    :func:`run_request`), or None when nothing is queued. ``on_claim(request_id, owner)`` is called right
    after the claim (so a shutdown can find and stop the runs of this process)."""
    owner = worker_id()
    request_id = claim_next(
        sessions, owner, lease_seconds, queue=queue, max_claimed_per_analyst=max_claimed_per_analyst
    )
    if request_id is None:
        return None
    if on_claim is not None:
        on_claim(request_id, owner)
    outcome = run_claimed(sessions, tables, request_id, owner, lease_seconds, heartbeat_seconds, settle_fn)
    return request_id, outcome


SHUTDOWN_REASON = "stopped at shutdown after its grace period; its worst case was charged (the data was read)"


def stop_runs(sessions: sessionmaker[Session], claimed: list[tuple[str, str]], reason: str) -> int:
    """Settle the runs ``claimed`` [(request id, owner)] of this process with their worst case (a shutdown
    past its grace period: their data was read). Their heartbeats then fail and the runs stop."""
    stopped = 0
    for request_id, owner in claimed:
        with sessions() as session:
            request = RequestRepository(session).get(request_id)
            if request is None:
                continue
            ref = RequestRef.of(request)

        def change(
            batch: RequestBatch, filters: list[FilterRow], row: AnalysisRequest, owner: str = owner
        ) -> bool:
            if row.lease_owner != owner:
                return False
            settle_batched(batch, filters, row, None, None, reason)
            return True

        with sessions() as session:
            stopped += transition(session, ref, change) is not None
    if stopped:
        log.warning("stopped runs at shutdown; their worst case was charged", count=stopped)
        notify_settled()
    return stopped


def _reap(batch: RequestBatch, filters: list[FilterRow], request: AnalysisRequest, now: datetime) -> bool:
    """Charge the worst case of a claimed request whose lease is still expired, re-checked under the
    locks (a heartbeat may have renewed it since the reaper listed it)."""
    expires = request.lease_expires_at
    if request.lease_owner is None or expires is None or not expires < now:
        return False
    settle_batched(batch, filters, request, None, None, "the worker was lost; its worst case was charged")
    return True


def reap_expired(sessions: sessionmaker[Session], max_queue_seconds: float | None = None) -> int:
    """Commit the worst case of claimed requests whose lease expired (a lost worker: it may have read
    the data); returns how many. Queued requests are never charged here: with ``max_queue_seconds``, those
    no worker claimed within that time are aborted without charge (their data was never read)."""
    now = datetime.now(UTC)
    with sessions() as session:
        repository = RequestRepository(session)
        expired = [RequestRef.of(r) for r in repository.expired_claimed(now)]
        overdue = []
        if max_queue_seconds is not None:
            before = now - timedelta(seconds=max_queue_seconds)
            overdue = [RequestRef.of(r) for r in repository.overdue_queued(before)]
    reaped = 0
    for ref in expired:
        with sessions() as session:
            reaped += transition(session, ref, lambda b, f, r: _reap(b, f, r, now)) is not None
    aborted = 0
    for ref in overdue:
        reason = f"no worker started it within {max_queue_seconds:g} s; nothing was charged"
        with sessions() as session:
            aborted += abort(session, ref, reason, unclaimed_only=True)
    if reaped:
        log.warning("reaped expired requests", count=reaped)
    if aborted:
        log.warning("aborted requests no worker started", count=aborted)
    if reaped or aborted:
        notify_settled()
    return reaped
