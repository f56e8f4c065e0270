"""Group commit for the filter: one writer thread per process applies queued admissions and settlements.

Every admission and settlement of a request must run under the row locks of its filters. Done one by
one, each request holds the dataset's lock for about a dozen database round trips, and concurrent
requests on a dataset queue behind it. The writer drains whatever is queued (up to ``max_batch``), locks
each dataset's filters once (datasets in id order, filters in id order: the global lock order), applies
the jobs **in arrival order** with exactly the single-request code (``admission.admit_locked``,
``settlement.settle_locked``), and commits once. Outcomes are identical to running the jobs one by one in that
order: each admission sees every reservation and commit before it. A reservation is durable before its
caller may read the data, as before. A refusal or error of one job writes nothing and does not affect
the others; if the batch transaction itself fails, every job is retried alone.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import structlog
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import RdpCurve
from service import metrics
from service.auth import Principal
from service.errors import NotFound, ServiceError, ServiceUnavailable
from service.filter.admission import Refused
from service.logs import failure_fields
from service.runs import admission, settlement
from service.store.models import DATASET_SCOPE, AnalysisRequest, PrivacyFilter, RequestState
from service.store.repositories import FilterRepository, RequestRepository

log = structlog.get_logger("expost.writer")

Locked = dict[tuple[str, str], PrivacyFilter]


@dataclass
class Job:
    dataset_id: str
    analyst: str
    apply: Callable[[Session, list[PrivacyFilter], dict[str, AnalysisRequest]], Any]
    alone: Callable[[], Any]
    settles: str | None = None  # the request id, for settlements
    future: Future[Any] = field(default_factory=Future)


class WriteBatcher:
    def __init__(self, sessions: sessionmaker[Session], max_batch: int = 64, timeout: float = 60.0) -> None:
        self.sessions, self.max_batch, self.timeout = sessions, max_batch, timeout
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self.batches = 0
        self._thread = threading.Thread(target=self._loop, name="expost-writer", daemon=True)
        self._thread.start()

    # ----- the two operations (block until committed) ----------------------------------------------
    def admit(
        self, principal: Principal, v: admission.Validated, key: str | None, lease: float
    ) -> tuple[AnalysisRequest, bool]:
        def apply(session: Session, filters: list[PrivacyFilter], _: dict[str, AnalysisRequest]) -> Any:
            return admission.admit_locked(session, filters, principal, v, key, lease)

        def alone() -> Any:
            return admission.admit_or_replay(
                self.sessions, principal, v, key, lambda s: admission.admit(s, principal, v, key, lease)
            )

        try:
            result: tuple[AnalysisRequest, bool] = self._run(Job(v.dataset.id, principal.name, apply, alone))
        except Refused as refused:
            raise admission.refusal(v, refused) from None
        return result

    def settle(
        self,
        ref: settlement.RequestRef,
        realized: RdpCurve | None,
        release: dict[str, Any] | None,
        error: str | None,
    ) -> AnalysisRequest | None:
        def apply(session: Session, filters: list[PrivacyFilter], fresh: dict[str, AnalysisRequest]) -> Any:
            request = fresh.get(ref.id)
            if request is None or request.state != RequestState.RUNNING:
                return None  # already settled (e.g. reaped): never charge twice
            settlement.settle_locked(session, filters, request, realized, release, error)
            return request

        def alone() -> Any:
            with self.sessions() as session:
                return settlement.settle(session, ref, realized, release, error)

        result: AnalysisRequest | None = self._run(Job(ref.dataset_id, ref.analyst, apply, alone, ref.id))
        return result

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    # ----- the writer thread --------------------------------------------------------------------------
    def _run(self, job: Job) -> Any:
        if not self._thread.is_alive():
            raise ServiceUnavailable("the writer has stopped; retry later")
        metrics.WRITER_QUEUE.inc()
        self._queue.put(job)
        try:
            return job.future.result(timeout=self.timeout)
        except FutureTimeout:
            # Withdraw the job if the writer has not taken it yet. If it is being applied, an admission
            # nobody will run is aborted once it commits: its data was never read (docs/privacy.md §6 rule 2).
            if not job.future.cancel() and job.settles is None:
                job.future.add_done_callback(self._abort_abandoned)
            raise ServiceUnavailable("the database is busy; retry with the same Idempotency-Key") from None

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
                self._process(live)

    def _process(self, batch: list[Job]) -> None:
        metrics.WRITER_BATCH.observe(len(batch))
        self.batches += 1
        try:
            outcomes = self._apply(batch)
        except Exception as exc:
            log.error(
                "batch transaction failed; retrying its jobs one by one",
                size=len(batch),
                **failure_fields(exc),
            )
            for job in batch:
                _settle_future(job.future, job.alone)
            return
        for job, (result, error) in zip(batch, outcomes, strict=True):
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)

    def _apply(self, batch: list[Job]) -> list[tuple[Any, BaseException | None]]:
        outcomes: list[tuple[Any, BaseException | None]] = []
        with self.sessions() as session, session.begin():
            locked = _lock_all(session, batch)
            fresh = _fresh_requests(session, [job.settles for job in batch if job.settles])
            for job in batch:
                head, own = (
                    locked.get((job.dataset_id, DATASET_SCOPE)),
                    locked.get((job.dataset_id, job.analyst)),
                )
                try:
                    if head is None or own is None:
                        raise NotFound(f"no dataset {job.dataset_id!r}")
                    outcomes.append((job.apply(session, [head, own], fresh), None))
                except (ServiceError, Refused) as exc:  # raised before the job wrote anything
                    outcomes.append((None, exc))
        return outcomes


def _lock_all(session: Session, batch: list[Job]) -> Locked:
    scopes: dict[str, set[str]] = defaultdict(set)
    for job in batch:
        scopes[job.dataset_id] |= {DATASET_SCOPE, job.analyst}
    locked: Locked = {}
    filters = FilterRepository(session)
    for dataset_id in sorted(scopes):
        for flt in filters.lock_scopes(dataset_id, sorted(scopes[dataset_id])):
            locked[(dataset_id, flt.scope)] = flt
    return locked


def _fresh_requests(session: Session, ids: list[str]) -> dict[str, AnalysisRequest]:
    return {row.id: row for row in RequestRepository(session).fresh_many(ids)} if ids else {}


def _settle_future(future: Future[Any], alone: Callable[[], Any]) -> None:
    try:
        future.set_result(alone())
    except BaseException as exc:
        future.set_exception(exc)
