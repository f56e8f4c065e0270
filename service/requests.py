"""The request lifecycle (DESIGN §5): validate → worst case → admit + reserve → run → commit → respond.

States: running → committed | failed_charged (and aborted when refused before start, never stored).
Reservation and commit are separate transactions, each holding the dataset filter's row lock; the
release is stored in the same transaction that commits the realized charge, so a release never leaves
before its debit is durable. A request whose worker dies is reaped: its worst case is committed.

Workers (in-process threads or distributed queue workers, ``service.queue``) get only a request id. A
worker first **claims** the request: one conditional UPDATE sets ``lease_owner`` where it is NULL, so of
two deliveries or two workers exactly one runs it; the other returns without reading the data. The
claimed lease is renewed by the heartbeat of long-running mechanisms (their ``progress`` callback); the
settlement commits once (it is a no-op when the request is no longer running), and the reaper commits the
worst case of any request whose lease expired, claimed or not.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import RdpCurve, UnitsVector
from mechanisms.base import (
    InteractiveMechanism,
    Mechanism,
    ParamsError,
    ProgressFn,
    PublicContext,
    best_affordable_cost,
    has_public_progress,
    is_long_running,
)
from mechanisms.catalog import MECHANISMS
from mechanisms.noise import Noise
from service import budget, ledger, metrics
from service.auth import Principal
from service.datasets import TableCache, dataset_by_id, public_context, visible_dataset
from service.db.models import DATASET_SCOPE, AnalysisRequest, Dataset, PrivacyFilter
from service.db.repositories import FilterRepository, RequestRepository
from service.errors import (
    BudgetExhausted,
    Forbidden,
    IdempotencyKeyReused,
    InvalidInput,
    NoBudget,
    NotAdmissible,
    NotFound,
    ServiceUnavailable,
)
from service.ledger import canonical_json
from service.logs import failure_fields

if TYPE_CHECKING:
    from service.context import AppContext

log = structlog.get_logger("expost.requests")


@dataclass(frozen=True)
class Validated:
    """A request checked against public information only: nothing has read the data yet."""

    dataset: Dataset
    mechanism: Mechanism | InteractiveMechanism
    params: BaseModel
    context: PublicContext
    worst_case: RdpCurve
    charge: UnitsVector
    kind: str = "request"
    inline: bool = False  # runs in the admitting thread: admitted already claimed by this process


def validate(session: Session, principal: Principal, dataset_id: str, name: str, raw: Any) -> Validated:
    dataset = visible_dataset(session, principal, dataset_id)
    mechanism = MECHANISMS.get(name)
    if mechanism is None:
        raise InvalidInput("mechanism", f"unknown mechanism {name!r}; see GET /v1/mechanisms")
    return validated_for(dataset, mechanism, raw)


def validated_for(
    dataset: Dataset, mechanism: Mechanism | InteractiveMechanism, raw: Any, kind: str = "request"
) -> Validated:
    """Parameters checked against public information only; the worst case computed. No data is read."""
    try:
        params = mechanism.params_model.model_validate(raw)
    except ValidationError as exc:
        raise InvalidInput.from_validation("params", exc) from None
    context = public_context(dataset)
    try:
        mechanism.check(params, context)
        worst = mechanism.worst_case(params, context)
    except ParamsError as exc:
        raise InvalidInput(f"params.{exc.field}", exc.reason) from None
    except ValueError as exc:
        raise InvalidInput("params", str(exc)) from None
    except ArithmeticError:  # an extreme but schema-valid value overflowed a public computation
        reason = "the parameters are numerically out of range (a computation overflowed); use milder values"
        raise InvalidInput("params", reason) from None
    return Validated(dataset, mechanism, params, context, worst, UnitsVector.charge(worst), kind)


def fingerprint(dataset_id: str, mechanism: str, params: BaseModel) -> str:
    canonical = canonical_json(
        {"dataset": dataset_id, "mechanism": mechanism, "params": params.model_dump(mode="json")}
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def curve_record(curve: RdpCurve) -> dict[str, Any]:
    return {"curve": curve.as_dict(), "units": UnitsVector.charge(curve).to_json()}


def _lock_filters(session: Session, dataset_id: str, analyst: str) -> list[PrivacyFilter]:
    """[dataset filter, analyst filter], locked together in id order (the dataset's is created first),
    so two transactions never deadlock. Every state transition of a request holds these locks."""
    locked = {f.scope: f for f in FilterRepository(session).lock_scopes(dataset_id, [DATASET_SCOPE, analyst])}
    if DATASET_SCOPE not in locked or analyst not in locked:
        raise NotFound(f"no dataset {dataset_id!r}")
    return [locked[DATASET_SCOPE], locked[analyst]]


class Refused(Exception):
    """Raised under the filter locks with snapshots of the filters; the public refusal is built outside
    the lock (the affordable ε takes ~60 worst-case evaluations)."""

    def __init__(self, blocked: budget.FilterSnapshot, filters: list[budget.FilterSnapshot]) -> None:
        super().__init__("refused")
        self.blocked, self.filters = blocked, filters


def refusal(v: Validated, refused: Refused) -> BudgetExhausted:
    """The 409 body: requested vs spent, reserved and capacity per order, and what is affordable."""
    details = budget.refusal_details(refused.blocked, v.dataset.orders, v.charge)
    details["requested"] = v.worst_case.as_dict()
    details["affordable"] = affordable(v, refused) if isinstance(v.mechanism, Mechanism) else None
    found = details["affordable"]
    hint = "" if found is None else f"; largest affordable {found['parameter']}: {found['value']:g}"
    if not budget.ever_admissible(refused.blocked, v.charge):
        return NotAdmissible(
            f"the {details['filter']} filter can never admit this request, even unspent "
            f"(e.g. a pure budget admits only mechanisms with a pure-DP bound){hint}",
            **details,
        )
    return BudgetExhausted(f"the {details['filter']} filter cannot afford this request{hint}", **details)


def affordable(v: Validated, refused: Refused) -> dict[str, Any] | None:
    """The most expensive value of the mechanism's cost parameter every filter still admits."""
    assert isinstance(v.mechanism, Mechanism)

    def admissible(curve: RdpCurve) -> bool:
        return all(budget.admits(f, UnitsVector.charge(curve)) for f in refused.filters)

    value = best_affordable_cost(v.mechanism, v.params, v.context, admissible)
    return None if value is None else {"parameter": v.mechanism.cost_parameter, "value": value}


def admission_check(session: Session, principal: Principal, v: Validated) -> dict[str, Any]:
    """Dry run: would the request be admitted now? Takes no lock and writes nothing."""
    filters = FilterRepository(session)
    checked = [f for f in (filters.get(v.dataset.id), filters.get(v.dataset.id, principal.name)) if f]
    try:
        blocked = next((f for f in checked if not budget.admits(f, v.charge)), None)
    except NoBudget as exc:
        return {"admitted": False, "reason": exc.detail, "worst_case": v.worst_case.as_dict()}
    result: dict[str, Any] = {"admitted": blocked is None, "worst_case": v.worst_case.as_dict()}
    if blocked is not None:
        snapshots = [budget.snapshot(f) for f in checked]
        result["refusal"] = refusal(v, Refused(budget.snapshot(blocked), snapshots)).problem()
    return result


def _reserve_locked(
    session: Session,
    filters: list[PrivacyFilter],
    principal: Principal,
    v: Validated,
    key: str | None,
    lease: float,
) -> tuple[AnalysisRequest, bool]:
    """Inside a transaction holding ``filters``' locks: replay by Idempotency-Key, or admit + reserve."""
    fp = fingerprint(v.dataset.id, v.mechanism.name, v.params)
    if key is not None:
        existing = RequestRepository(session).by_idempotency_key(principal.name, key)
        if existing is not None:
            if existing.fingerprint != fp:
                raise IdempotencyKeyReused(
                    "this Idempotency-Key was used for a different request", idempotency_key=key
                )
            return existing, False
    blocked = next((f for f in filters if not budget.admits(f, v.charge)), None)
    if blocked is not None:
        raise Refused(budget.snapshot(blocked), [budget.snapshot(f) for f in filters])
    now = datetime.now(UTC)
    request = AnalysisRequest(
        id="rq_" + uuid.uuid4().hex[:20],
        kind=v.kind,
        dataset_id=v.dataset.id,
        analyst=principal.name,
        mechanism=v.mechanism.name,
        params=v.params.model_dump(mode="json"),
        fingerprint=fp,
        idempotency_key=key,
        state="running",
        scopes=[DATASET_SCOPE, principal.name],
        worst_case=curve_record(v.worst_case),
        created_at=now,
        updated_at=now,
        lease_expires_at=now + timedelta(seconds=lease),
        lease_owner=worker_id() if v.inline else None,
        started_at=now if v.inline else None,
    )
    RequestRepository(session).add(request)
    for flt in filters:
        budget.reserve(flt, v.charge)
    ledger.append(
        session,
        filters[0],
        "reserve",
        principal.name,
        {
            "scopes": request.scopes,
            "mechanism": request.mechanism,
            "params": request.params,
            "worst_case": v.charge.to_json(),
        },
        request_id=request.id,
    )
    return request, True


def admit(
    session: Session, principal: Principal, v: Validated, key: str | None, lease: float
) -> tuple[AnalysisRequest, bool]:
    """Admit and reserve in one transaction; returns (request, created). Raises a refusal otherwise."""
    try:
        with session.begin():
            filters = _lock_filters(session, v.dataset.id, principal.name)
            return _reserve_locked(session, filters, principal, v, key, lease)
    except Refused as refused:
        raise refusal(v, refused) from None


def admit_or_replay(
    sessions: sessionmaker[Session],
    principal: Principal,
    v: Validated,
    key: str | None,
    admit_fn: Callable[[Session], tuple[AnalysisRequest, bool]],
) -> tuple[AnalysisRequest, bool]:
    try:
        with sessions() as session:
            return admit_fn(session)
    except IntegrityError:
        # A concurrent request with the same Idempotency-Key (on another dataset) won the race.
        with sessions() as session:
            existing = RequestRepository(session).by_idempotency_key(principal.name, key or "")
            if existing is None:
                raise
            if existing.fingerprint != fingerprint(v.dataset.id, v.mechanism.name, v.params):
                raise IdempotencyKeyReused("this Idempotency-Key was used for a different request") from None
            return existing, False


# ----- running and settling ------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestRef:
    """Which request, and so which filters guard its transitions."""

    id: str
    dataset_id: str
    analyst: str

    @classmethod
    def of(cls, request: AnalysisRequest) -> RequestRef:
        return cls(request.id, request.dataset_id, request.analyst)


def _lock_running(session: Session, ref: RequestRef) -> tuple[list[PrivacyFilter], AnalysisRequest] | None:
    """Lock the request's filters, then re-read it; None unless it is still running."""
    filters = _lock_filters(session, ref.dataset_id, ref.analyst)
    request = RequestRepository(session).fresh(ref.id)
    return None if request is None or request.state != "running" else (filters, request)


def _settle_locked(
    session: Session,
    filters: list[PrivacyFilter],
    request: AnalysisRequest,
    realized: RdpCurve | None,
    release: dict[str, Any] | None,
    error: str | None,
) -> None:
    """Replace the reservation by the realized charge (or the worst case on error); store the release."""
    reservation = UnitsVector.from_json(request.worst_case["units"])
    record = request.worst_case if realized is None else curve_record(realized)
    charge = UnitsVector.from_json(record["units"])
    if not charge <= reservation:  # a mechanism bug: never commit more than was admitted
        log.error("realized charge above the reservation; committing the worst case", request_id=request.id)
        record, charge, release, error = request.worst_case, reservation, None, "internal accounting error"
    outcome = {"realized": charge.to_json(), "outcome": "released" if error is None else "failed"}
    _end_reservation(session, filters, request, charge, "commit", outcome)
    request.state = "committed" if error is None else "failed_charged"
    request.realized, request.release, request.error = record, release, error


def _end_reservation(
    session: Session,
    filters: list[PrivacyFilter],
    request: AnalysisRequest,
    charge: UnitsVector | None,
    event: str,
    details: dict[str, Any],
) -> None:
    """Replace the request's reservation by ``charge`` (None: release it) in its filters and the ledger."""
    reservation = UnitsVector.from_json(request.worst_case["units"])
    for flt in filters:
        if flt.scope in request.scopes:
            budget.settle(flt, reservation, charge)
    payload = {"scopes": request.scopes, "worst_case": reservation.to_json(), **details}
    ledger.append(session, filters[0], event, request.analyst, payload, request_id=request.id)
    metrics.ended(session, request.dataset_id, request.kind, str(details.get("outcome", event)), charge)
    request.updated_at, request.lease_expires_at = datetime.now(UTC), None


def settle(
    session: Session,
    ref: RequestRef,
    realized: RdpCurve | None,
    release: dict[str, Any] | None,
    error: str | None,
) -> AnalysisRequest | None:
    """Commit the realized charge and store the release, or commit the worst case with an error.

    Returns the settled request, or None if it was no longer running (never charge twice).
    """
    with session.begin():
        locked = _lock_running(session, ref)
        if locked is None:
            return None
        _settle_locked(session, *locked, realized, release, error)
    return locked[1]


def abort(session: Session, ref: RequestRef, reason: str, unclaimed_only: bool = False) -> bool:
    """Release a reservation without charge. Only for requests whose data was provably never read.

    ``unclaimed_only``: only if no worker has claimed it (a task that may have reached a queue): a
    worker's claim needs the request running, so after this abort no worker can start it.
    """
    with session.begin():
        locked = _lock_running(session, ref)
        if locked is None or (unclaimed_only and locked[1].lease_owner is not None):
            return False
        filters, request = locked
        _end_reservation(session, filters, request, None, "abort", {"reason": reason})
        request.state, request.error = "aborted", reason
        # Nothing was read, so a retry with the same key must be admitted afresh (not replay the abort).
        request.idempotency_key = None
    return True


_PROCESS_ID = f"{socket.gethostname()[:30]}:{os.getpid()}"


def worker_id() -> str:
    """Names the claimant of a lease: host, process and a random part (unique per claim)."""
    return f"{_PROCESS_ID}:{uuid.uuid4().hex[:12]}"[:64]


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
            with self.sessions() as session, session.begin():
                renewed = RequestRepository(session).renew(self.request_id, self.owner, until, progress)
        except SQLAlchemyError as exc:  # a database restart or an exhausted pool: the next beat tries again
            log.warning("heartbeat failed", request_id=self.request_id, **failure_fields(exc))
            return
        self.beats += 1
        if not renewed:
            raise LeaseLost(self.request_id)


def execute(
    dataset: Dataset,
    mechanism: Mechanism,
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
    try:
        worst = worst or mechanism.worst_case(params, context)
        table = tables.get(dataset, context.schema)
        noise = Noise.system()
        if is_long_running(mechanism) and progress is not None:
            result = mechanism.run(params, context, table, noise, progress=progress)  # type: ignore[call-arg]
        else:
            result = mechanism.run(params, context, table, noise)
        if not result.realized <= worst:
            raise AssertionError("realized charge exceeds the worst case")
    except LeaseLost:
        log.warning("lease lost during the run; its settlement is discarded", dataset_id=dataset.id)
        return None, None, "the worker lost its lease; its worst case was charged"
    except Exception as exc:
        log.error(
            "mechanism failed after reading data; charging the worst case",
            dataset_id=dataset.id,
            **failure_fields(exc),
        )
        return None, None, "the mechanism failed; its worst case was charged"
    return result.realized, result.output, None


SettleFn = Callable[["RequestRef", RdpCurve | None, dict[str, Any] | None, str | None], object]


def claim(sessions: sessionmaker[Session], request_id: str, owner: str, lease_seconds: float) -> bool:
    """Take the request for ``owner`` (atomic conditional update); False if anyone else has it, it is
    settled, or its lease already expired (the reaper will charge it)."""
    now = datetime.now(UTC)
    with sessions() as session, session.begin():
        until = now + timedelta(seconds=lease_seconds)
        return RequestRepository(session).claim(request_id, owner, now, until)


def run_request(
    sessions: sessionmaker[Session],
    tables: TableCache,
    request_id: str,
    lease_seconds: float = 300.0,
    heartbeat_seconds: float = 1.0,
    settle_fn: SettleFn | None = None,
) -> str:
    """Worker body: claim, run (with a heartbeat for long-running mechanisms), settle once.

    Returns what happened: ``"settled"``, ``"duplicate"`` (someone else claimed it or it is no longer
    running: nothing was read, nothing charged), ``"lost"`` (settled by someone else, e.g. the reaper,
    while this run went on: its output is discarded), ``"unrunnable"`` (this worker does not know the
    mechanism or its parameters: aborted without charge if nobody claimed it) or ``"missing"``.
    """
    with sessions() as session:
        request = RequestRepository(session).get(request_id)
        if request is None:
            return "missing"
        if request.state != "running":
            return "duplicate"
        dataset = dataset_by_id(session, request.dataset_id)
        assert dataset is not None
    mechanism = MECHANISMS.get(request.mechanism)
    try:
        if mechanism is None:
            raise LookupError(f"unknown mechanism {request.mechanism!r}")
        params = mechanism.params_model.model_validate(request.params)
    except (LookupError, ValidationError) as exc:  # e.g. a worker of another version: nothing read yet
        log.error("this worker cannot run the request", request_id=request_id, **failure_fields(exc))
        with sessions() as session:
            abort(session, RequestRef.of(request), "no worker could run this request; nothing was charged",
                  unclaimed_only=True)
        return "unrunnable"
    owner = worker_id()
    if not claim(sessions, request_id, owner, lease_seconds):
        log.info("request already claimed or settled; not running it", request_id=request_id)
        return "duplicate"
    heartbeat = None
    if is_long_running(mechanism):
        public = has_public_progress(mechanism)
        heartbeat = Heartbeat(sessions, request_id, lease_seconds, owner, public, heartbeat_seconds)
    realized, output, error = execute(
        dataset, mechanism, params, public_context(dataset), tables, progress=heartbeat
    )
    ref = RequestRef.of(request)
    if settle_fn is not None:
        settled = settle_fn(ref, realized, output, error)
    else:
        with sessions() as session:
            settled = settle(session, ref, realized, output, error)
    return "lost" if settled is None else "settled"


def _lock_expired(
    session: Session, ref: RequestRef, now: datetime
) -> tuple[list[PrivacyFilter], AnalysisRequest] | None:
    """Like ``_lock_running`` but also re-checks, under the locks, that the lease is still expired (a
    heartbeat may have renewed it since the reaper listed it)."""
    locked = _lock_running(session, ref)
    if locked is None:
        return None
    expires = locked[1].lease_expires_at
    return locked if expires is not None and expires < now else None


def reap_expired(sessions: sessionmaker[Session]) -> int:
    """Commit the worst case of running requests whose lease expired (a crashed worker)."""
    now = datetime.now(UTC)
    with sessions() as session:
        running = RequestRepository(session).expired_running(now, kind="request")
        expired = [RequestRef.of(r) for r in running]
    reaped = 0
    for ref in expired:
        with sessions() as session, session.begin():
            locked = _lock_expired(session, ref, now)
            if locked is None:
                continue
            _settle_locked(session, *locked, None, None, "the worker was lost; its worst case was charged")
            reaped += 1
    if reaped:
        log.warning("reaped expired requests", count=reaped)
    return reaped


def wait_settled(sessions: sessionmaker[Session], request_id: str, timeout: float) -> AnalysisRequest:
    """Poll until the request leaves ``running`` or the timeout passes (for idempotent replays)."""
    deadline = time.monotonic() + timeout
    while True:
        with sessions() as session:
            request = RequestRepository(session).get(request_id)
            assert request is not None
        if request.state != "running" or time.monotonic() >= deadline:
            return request
        time.sleep(0.05)


def public_progress(request: AnalysisRequest) -> float | None:
    """The progress shown for a request: only for mechanisms whose amount of work is public."""
    if not has_public_progress(MECHANISMS.get(request.mechanism)):
        return None
    return 1.0 if request.state == "committed" else request.progress


def get_visible(session: Session, principal: Principal, request_id: str) -> AnalysisRequest:
    if principal.role.value == "viewer":
        raise Forbidden("viewers cannot read releases")
    request = RequestRepository(session).get(request_id)
    if request is None or (principal.role.value == "analyst" and request.analyst != principal.name):
        raise NotFound(f"no request {request_id!r}")
    return request


def submit(
    ctx: AppContext, principal: Principal, dataset_id: str, mechanism: str, params: Any, key: str | None
) -> AnalysisRequest:
    """Validate (read-only), admit + reserve (one durable transaction), run, settle, respond.

    Cheap mechanisms (``settings.inline_mechanisms``) run in the request's thread; others (and every
    long-running mechanism) go to the executor and the response waits up to the wait window (else 202).
    """
    started = time.monotonic()
    with ctx.sessions() as session:
        validated = validate(session, principal, dataset_id, mechanism, params)
    inline = mechanism in ctx.settings.inline_mechanisms and not is_long_running(validated.mechanism)
    try:
        request, created = ctx.writer.admit(
            principal, replace(validated, inline=inline), key, ctx.settings.lease_seconds
        )
    except (BudgetExhausted, NoBudget) as exc:
        metrics.REQUESTS.labels(mechanism, "refused").inc()
        metrics.refused(exc, "request")
        raise
    metrics.REQUESTS.labels(mechanism, "admitted" if created else "replayed").inc()
    log.info(
        "admitted" if created else "replayed",
        request_id=request.id,
        dataset_id=dataset_id,
        mechanism=mechanism,
        analyst=principal.name,
    )
    if created and inline:
        # The reservation is durable and this process holds the lease; run here, then settle.
        v = validated
        assert isinstance(v.mechanism, Mechanism)
        realized, output, error = execute(
            v.dataset, v.mechanism, v.params, v.context, ctx.tables, v.worst_case
        )
        settled = ctx.writer.settle(RequestRef.of(request), realized, output, error)
        if settled is not None:
            return settled
    elif created:
        try:
            future: Future[None] | None = ctx.executor.submit(request.id)
        except RuntimeError:  # the executor is shutting down or the broker is unreachable
            with ctx.sessions() as session:
                aborted = abort(
                    session, RequestRef.of(request), "the request could not be queued; nothing was charged",
                    unclaimed_only=True,
                )
            if aborted:
                raise ServiceUnavailable("the service cannot run requests now; retry later") from None
            future = None  # a worker got it after all: wait for its release
        if future is not None:
            wait([future], timeout=ctx.settings.wait_seconds)
    remaining = max(0.0, ctx.settings.wait_seconds - (time.monotonic() - started))
    return wait_settled(ctx.sessions, request.id, remaining)
