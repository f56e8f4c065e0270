"""Group commit for the filter: one writer thread per process applies queued admissions and settlements.

Every admission and settlement of a request must run under the row locks of its filters. Done one by
one, each request holds the dataset's lock for about a dozen database round trips, and concurrent
requests on a dataset queue behind it. The writer drains whatever is queued (up to ``max_batch``), locks
every filter of the batch in one statement (datasets in id order, filters in id order: the global lock
order), applies the jobs **in arrival order** on plain rows (``admission.admit_batched``,
``settlement.settle_batched``: the same steps as every batch of one, the filter rule of
``service.filter.state``), writes everything with a few set-based statements and commits once, the
writes and the ``COMMIT`` in one round trip (``unit.commit``, ``FilterBatch.flush``). Outcomes
are identical to running the jobs one by one in that order: each admission sees every reservation and
commit before it. A reservation is durable before its caller may read the data, as before. A refusal or
error of one job writes nothing and does not affect the others; if the batch transaction itself fails,
every job is retried alone (a batch of one: ``admission.transact``).

A cheap inline request can be one job (:meth:`WriteBatcher.admit_and_run`): admit + reserve, run the
mechanism, commit its realized charge with the release, all in the batch's transaction: one commit instead
of two, and the release still leaves only after its charge is durable (docs/privacy/workers.md#workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread
import structlog
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import RdpCurve
from service import metrics
from service.auth import Principal, Role
from service.errors import ServiceError, ServiceUnavailable
from service.filter.batch import FilterRow, Refused
from service.filter.individual import UnitUpdate
from service.logs import failure_fields
from service.runs import admission, settlement
from service.runs.admission import RequestBatch
from service.store.models import DATASET_SCOPE, AnalysisRequest, RequestState

log = structlog.get_logger("expost.writer")

# The inline mechanisms that may run inside the writer's transaction (admit_and_run): vectorized
# arithmetic on a table in memory, microseconds, realized = worst case, no native code that could end the
# process (docs/privacy/workers.md#workers). Any other mechanism an operator lists in EXPOST_INLINE_MECHANISMS
# runs inline on the two-phase path (reserve committed, run, settle committed): a slow run must not hold the
# writer (every dataset of the process) and a crash after its read must leave a reservation to charge.
ONE_TRANSACTION = frozenset({"laplace", "gaussian"})
BUSY = "the database is busy; retry with the same Idempotency-Key"

Apply = Callable[[RequestBatch, list[FilterRow]], Any]
RunFn = Callable[[], tuple[RdpCurve | None, dict[str, Any] | None, str | None]]


@dataclass
class Job:
    dataset_id: str
    analyst: str
    apply: Apply
    alone: Callable[[], Any]
    settles: str | None = None  # the request id, for settlements
    key: str | None = None  # the Idempotency-Key, for admissions
    grant: bool = False  # an analyst's admission: the batch reads whether the grant still holds
    settled: bool = False  # one transaction: committed with its charge, nothing to abort if abandoned
    waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]] | None = None  # an awaiting caller
    future: Future[Any] = field(default_factory=Future)


class WriteBatcher:
    def __init__(self, sessions: sessionmaker[Session], max_batch: int = 64, timeout: float = 60.0) -> None:
        self.sessions, self.max_batch, self.timeout = sessions, max_batch, timeout
        self._connection: Connection | None = None  # the writer's own, kept between batches (no pool ping)
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self.batches = 0
        self.async_waiters = 0  # callers awaiting admit_and_run_async (on the event loop)
        self._thread = threading.Thread(target=self._loop, name="expost-writer", daemon=True)
        self._thread.start()

    # ----- the operations (block until committed) --------------------------------------------------
    def admit(
        self, principal: Principal, v: admission.Validated, key: str | None, lease: float
    ) -> tuple[AnalysisRequest, bool]:
        def apply(batch: RequestBatch, filters: list[FilterRow]) -> Any:
            return admission.admit_batched(batch, filters, principal, v, key, lease)

        def alone() -> Any:
            return admission.admit_or_replay(
                self.sessions, principal, v, key, lambda s: admission.admit(s, principal, v, key, lease)
            )

        return self._admission(_admission_job(principal, v, key, apply, alone), v)

    def admit_and_run(
        self, principal: Principal, v: admission.Validated, key: str | None, lease: float, run: RunFn
    ) -> tuple[AnalysisRequest, bool]:
        """One transaction for a cheap inline request: admit + reserve, ``run`` (reads the data, draws the
        noise: microseconds), commit the realized charge and store the release. Returns the settled
        request (or the stored one on a replay). Only for mechanisms that run in microseconds: the run
        holds the writer (and the batch's filter locks) while it runs.

        If the batch transaction fails, nothing of it is durable and its output is dropped unseen (its
        release is checked storable first, so that failure does not depend on the output); the request is
        then retried alone on the two-phase path (admit, run afresh, settle)."""

        if v.mechanism.name not in ONE_TRANSACTION:
            return self._admit_then_run(principal, v, key, lease, run)
        return self._admission(self._one_transaction(principal, v, key, lease, run), v)

    async def admit_and_run_async(
        self, principal: Principal, v: admission.Validated, key: str | None, lease: float, run: RunFn
    ) -> tuple[AnalysisRequest, bool]:
        """:meth:`admit_and_run` for the event loop, for :data:`ONE_TRANSACTION` mechanisms only: the
        caller awaits the batch's commit instead of holding a thread while it waits."""
        if v.mechanism.name not in ONE_TRANSACTION:
            raise ValueError(f"{v.mechanism.name} does not run in the writer's transaction")
        job = self._one_transaction(principal, v, key, lease, run)
        self.async_waiters += 1
        try:
            result: tuple[AnalysisRequest, bool] = await self._run_async(job)
        except Refused as refused:  # the refusal's body searches the affordable value: milliseconds
            raise await anyio.to_thread.run_sync(admission.refusal, v, refused) from None
        finally:
            self.async_waiters -= 1
        return result

    def _one_transaction(
        self, principal: Principal, v: admission.Validated, key: str | None, lease: float, run: RunFn
    ) -> Job:
        def apply(batch: RequestBatch, filters: list[FilterRow]) -> Any:
            request, created = admission.admit_batched(batch, filters, principal, v, key, lease)
            if created:  # settle_batched checks the release storable (settlement.settlement_of)
                settlement.settle_batched(batch, filters, request, *_guarded(run))
            return request, created

        def alone() -> Any:
            request, created = admission.admit_or_replay(
                self.sessions, principal, v, key, lambda s: admission.admit(s, principal, v, key, lease)
            )
            if not created:
                return request, False
            realized, output, error = _guarded(run)
            ref = settlement.RequestRef.of(request)
            with self.sessions() as session:
                settled = settlement.settle(session, ref, realized, output, error)
            return (request if settled is None else settled), True

        return _admission_job(principal, v, key, apply, alone, settled=True)

    def _admit_then_run(
        self, principal: Principal, v: admission.Validated, key: str | None, lease: float, run: RunFn
    ) -> tuple[AnalysisRequest, bool]:
        """The two-phase inline path (for inline mechanisms outside :data:`ONE_TRANSACTION`): admit +
        reserve (committed), run in the caller's thread, settle (committed) before the release leaves."""
        request, created = self.admit(principal, v, key, lease)
        if not created:
            return request, False
        settled = self.settle(settlement.RequestRef.of(request), *_guarded(run))
        return (request if settled is None else settled), True

    def _admission(self, job: Job, v: admission.Validated) -> tuple[AnalysisRequest, bool]:
        try:
            result: tuple[AnalysisRequest, bool] = self._run(job)
        except Refused as refused:
            raise admission.refusal(v, refused) from None
        return result

    def settle(
        self,
        ref: settlement.RequestRef,
        realized: RdpCurve | None,
        release: dict[str, Any] | None,
        error: str | None,
        units: UnitUpdate | None = None,
    ) -> AnalysisRequest | None:
        def apply(batch: RequestBatch, filters: list[FilterRow]) -> Any:
            request = batch.fresh.get(ref.id)
            if request is None or request.state != RequestState.RUNNING:
                return None  # already settled (e.g. reaped): never charge twice
            settlement.settle_batched(batch, filters, request, realized, release, error, units)
            return request

        def alone() -> Any:
            with self.sessions() as session:
                return settlement.settle(session, ref, realized, release, error, units)

        result: AnalysisRequest | None = self._run(Job(ref.dataset_id, ref.analyst, apply, alone, ref.id))
        return result

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    # ----- the writer thread --------------------------------------------------------------------------
    def _enqueue(self, job: Job) -> None:
        if not self._thread.is_alive():
            raise ServiceUnavailable("the writer has stopped; retry later")
        metrics.WRITER_QUEUE.inc()
        self._queue.put(job)

    def _withdraw(self, job: Job) -> None:
        """The caller stopped waiting (timeout, or its task was cancelled): withdraw the job if the writer
        has not taken it yet. If it is being applied, an admission nobody will run is aborted once it
        commits: its data was never read (docs/privacy/rules.md#rule-reserve-before-read). A one-transaction
        job commits its charge with its release, so nothing is lost: a replay with the same Idempotency-Key
        returns it."""
        if not job.future.cancel() and job.settles is None and not job.settled:
            job.future.add_done_callback(self._abort_abandoned)

    def _run(self, job: Job) -> Any:
        self._enqueue(job)
        try:
            return job.future.result(timeout=self.timeout)
        except FutureTimeout:
            self._withdraw(job)
            raise ServiceUnavailable(BUSY) from None

    async def _run_async(self, job: Job) -> Any:
        """Enqueue ``job`` and await its outcome, handed over by :func:`_wake_waiters` after its batch."""
        loop = asyncio.get_running_loop()
        job.waiter = (loop, loop.create_future())
        self._enqueue(job)
        try:
            async with asyncio.timeout(self.timeout):
                return await job.waiter[1]
        except TimeoutError:
            self._withdraw(job)
            raise ServiceUnavailable(BUSY) from None
        except asyncio.CancelledError:
            self._withdraw(job)
            raise

    def _abort_abandoned(self, future: Future[Any]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        request, created = future.result()
        if created:
            ref, reason = settlement.RequestRef.of(request), "abandoned before it started"
            with self.sessions() as session:
                if request.lease_owner is not None:  # inline: held by the admitting thread, never run
                    settlement.abort(session, ref, reason, owner=request.lease_owner)
                else:  # queued: a worker may have claimed it from the database meanwhile; then it runs
                    settlement.abort(session, ref, reason, unclaimed_only=True)

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                self._drop_connection()
                return
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._queue.put(None)
                    break
                batch.append(job)
            metrics.WRITER_QUEUE.dec(len(batch))
            live = [job for job in batch if job.future.set_running_or_notify_cancel()]
            if live:
                try:
                    self._process(live)
                except BaseException as exc:  # a bug: the jobs still get an answer, the writer lives on
                    log.error("writer batch failed unexpectedly", size=len(live), **failure_fields(exc))
                    for job in live:
                        if not job.future.done():
                            job.future.set_exception(ServiceUnavailable("the writer failed; retry later"))
                    _wake_waiters(live)

    def _session(self) -> Session:
        """A session on the writer's own connection: checked out once, not pinged before every batch;
        dropped after a failed batch (a database restart), so the next batch reconnects."""
        if self._connection is None:
            bind = self.sessions.kw["bind"]
            assert isinstance(bind, Engine)
            self._connection = bind.connect()
        return Session(bind=self._connection, expire_on_commit=False)

    def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.invalidate()
                connection.close()

    def _process(self, batch: list[Job]) -> None:
        metrics.WRITER_BATCH.observe(len(batch))
        self.batches += 1
        try:
            outcomes = self._apply(batch)
        except BaseException as exc:  # not only Exception: the writer thread must outlive any batch
            self._drop_connection()
            log.error(
                "batch transaction failed; retrying its jobs one by one",
                size=len(batch),
                **failure_fields(exc),
            )
            for job in batch:  # each caller is answered as soon as its own retry is done
                _settle_future(job.future, job.alone)
                _wake_waiters([job])
            return
        for job, (result, error) in zip(batch, outcomes, strict=True):
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)
        _wake_waiters(batch)

    def _apply(self, batch: list[Job]) -> list[tuple[Any, BaseException | None]]:
        with self._session() as session:
            return admission.transact(session, _reads(batch), lambda rows: _outcomes(rows, batch), True)


def _outcomes(rows: RequestBatch, batch: list[Job]) -> list[tuple[Any, BaseException | None]]:
    """Each job applied in arrival order: its result, or the refusal or error it raised (before it wrote
    anything)."""
    outcomes: list[tuple[Any, BaseException | None]] = []
    for job in batch:
        try:
            outcomes.append((job.apply(rows, admission.filters_of(rows, job.dataset_id, job.analyst)), None))
        except (ServiceError, Refused) as exc:
            outcomes.append((None, exc))
    return outcomes


def _reads(batch: list[Job]) -> admission.BatchReads:
    """Every filter of the batch and what its jobs need under the locks (a few statements)."""
    scopes: dict[str, set[str]] = defaultdict(set)
    for job in batch:
        scopes[job.dataset_id] |= {DATASET_SCOPE, job.analyst}
    return admission.BatchReads(
        {dataset_id: sorted(names) for dataset_id, names in scopes.items()},
        sorted({(job.analyst, job.key) for job in batch if job.key is not None}),
        sorted({job.settles for job in batch if job.settles is not None}),
        sorted({(job.dataset_id, job.analyst) for job in batch if job.grant}),
    )


def _admission_job(
    principal: Principal,
    v: admission.Validated,
    key: str | None,
    apply: Apply,
    alone: Callable[[], Any],
    settled: bool = False,
) -> Job:
    """An admission's job: the batch reads its Idempotency-Key's stored request and, for an analyst,
    whether the grant still holds."""
    return Job(
        v.dataset.id,
        principal.name,
        apply,
        alone,
        key=key,
        grant=principal.role is Role.analyst,
        settled=settled,
    )


def _wake_waiters(jobs: list[Job]) -> None:
    """Hand the outcomes of a processed batch to the callers awaiting them on event loops: one wake-up
    per loop per batch, not one per job (each wake-up is a write to the loop's self-pipe and a GIL
    hand-over between the writer and the loop)."""
    waiting: dict[asyncio.AbstractEventLoop, list[Job]] = defaultdict(list)
    for job in jobs:
        if job.waiter is not None:
            waiting[job.waiter[0]].append(job)
    for loop, handed in waiting.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits these any more
            loop.call_soon_threadsafe(_hand_over, handed)


def _hand_over(jobs: list[Job]) -> None:
    """On the waiters' loop: each job's outcome (already set on its ``future``) to its waiter, unless the
    caller stopped waiting (the waiter was cancelled: :meth:`WriteBatcher._withdraw` ran)."""
    for job in jobs:
        assert job.waiter is not None
        waiter = job.waiter[1]
        if waiter.done() or not job.future.done():
            continue
        error = job.future.exception()
        try:
            if error is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(job.future.result())
        except Exception as exc:  # an outcome asyncio refuses (e.g. StopIteration): still answer this one
            log.error("could not hand over a writer outcome", **failure_fields(exc))
            waiter.set_exception(ServiceUnavailable("the writer failed; retry later"))


def _guarded(run: RunFn) -> tuple[RdpCurve | None, dict[str, Any] | None, str | None]:
    """``run()``, with anything it raises (even a ``BaseException`` such as ``SystemExit``, which
    ``worker.execute`` does not catch) settled as a mechanism failure charged its worst case: the data
    may have been read, and an escaping exception would skip the settlement (and, inside a batch, fail
    every job of the batch and kill no less than the writer thread)."""
    try:
        return run()
    except BaseException as exc:
        log.error("inline run raised; charging the worst case", **failure_fields(exc))
        return None, None, settlement.UNSTORABLE


def _settle_future(future: Future[Any], alone: Callable[[], Any]) -> None:
    try:
        future.set_result(alone())
    except BaseException as exc:
        future.set_exception(exc)
