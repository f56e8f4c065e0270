"""The request lifecycle (DESIGN §5): validate → worst case → admit + reserve → queue → run → commit.

States (stored): running → committed | failed_charged | aborted. A ``running`` request is **queued** while
no worker has claimed it (``lease_owner`` NULL: nothing has read the data) and **running** once a worker
claimed it. Reservation and commit are separate transactions, each holding the dataset filter's row
lock; the release is stored in the same transaction that commits the realized charge, so a release never
leaves before its debit is durable.

The database is the queue. Workers (the API's in-process threads, or ``expost worker`` processes woken by
the Dramatiq queue, ``service.queue``) **claim** the next request in a fair order (:func:`claim_next`:
the analyst with the fewest requests running now, ties to the analyst served least recently, then that
analyst's oldest request), with one conditional UPDATE that sets ``lease_owner`` where it is NULL, so of
two workers exactly one runs it. The lease starts at the claim and is renewed by the heartbeat of
long-running mechanisms (their ``progress`` callback). The reaper tells the cases apart from the
database: a *claimed* request whose lease expired is charged its worst case (its worker was lost after
it may have read the data); a *queued* one is never charged and is aborted without charge only when no
worker claimed it within ``max_queue_seconds``. A cancel aborts a queued request without charge and
charges a claimed one its worst case (its run then stops at its next heartbeat).
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
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
from service.db.repositories import FilterRepository, LimitRepository, RequestRepository
from service.errors import (
    BudgetExhausted,
    Conflict,
    Forbidden,
    IdempotencyKeyReused,
    InvalidInput,
    LimitExceeded,
    NoBudget,
    NotAdmissible,
    NotCancellable,
    NotFound,
    ServiceUnavailable,
)
from service.ledger import canonical_json
from service.logs import failure_fields

if TYPE_CHECKING:
    from service.context import AppContext

log = structlog.get_logger("expost.requests")


@dataclass(frozen=True)
class Limits:
    """The per-analyst execution limits' defaults, and the mechanisms the API runs inline (which never
    wait for a worker and so do not count as running on workers)."""

    running_requests: int
    open_sessions: int
    inline: frozenset[str] = frozenset()


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
    limits: Limits | None = None  # checked at admission (under the filter locks) when given
    queue: str | None = None  # whose workers may claim it (EXPOST_QUEUE_NAME); None: only claimed by id


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
    if v.limits is not None:
        check_limits(session, principal.name, v)
    blocked = next((f for f in filters if not budget.admits(f, v.charge)), None)
    if blocked is not None:
        raise Refused(budget.snapshot(blocked), [budget.snapshot(f) for f in filters])
    now = datetime.now(UTC)
    # A queued request has no lease: its lease starts when a worker claims it. An inline run is claimed
    # by this thread at admission; a session's "lease" is its expiry.
    queued = v.kind == "request" and not v.inline
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
        lease_expires_at=None if queued else now + timedelta(seconds=lease),
        lease_owner=worker_id() if v.inline else None,
        started_at=now if v.inline else None,
        queue=v.queue if queued else None,
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


def effective_limits(session: Session, analyst: str, defaults: Limits) -> tuple[int, int]:
    """(max requests queued or running on workers, max open sessions) for ``analyst``."""
    row = LimitRepository(session).get(analyst)
    requests = row.max_running_requests if row and row.max_running_requests else defaults.running_requests
    sessions = row.max_open_sessions if row and row.max_open_sessions else defaults.open_sessions
    return requests, sessions


def check_limits(session: Session, analyst: str, v: Validated) -> None:
    """Raise 429 when admitting ``v`` would exceed the analyst's limit. Runs under the dataset's filter
    locks, so concurrent admissions on one dataset cannot both pass the last free slot."""
    assert v.limits is not None
    if v.kind == "request" and v.inline:
        return
    max_requests, max_sessions = effective_limits(session, analyst, v.limits)
    active, open_sessions = RequestRepository(session).active_counts(analyst, sorted(v.limits.inline))
    if v.kind == "session" and open_sessions >= max_sessions:
        raise LimitExceeded(
            f"you have {open_sessions} open sessions, the limit is {max_sessions}; close one first",
            limit="max_open_sessions", max=max_sessions, current=open_sessions,
        )
    if v.kind == "request" and active >= max_requests:
        raise LimitExceeded(
            f"you have {active} requests queued or running, the limit is {max_requests}; "
            "wait for one to finish or cancel one",
            limit="max_running_requests", max=max_requests, current=active,
        )


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


def abort(
    session: Session,
    ref: RequestRef,
    reason: str,
    unclaimed_only: bool = False,
    owner: str | None = None,
) -> bool:
    """Release a reservation without charge. Only for requests whose data was provably never read.

    ``unclaimed_only``: only if no worker has claimed it (queued): a worker's claim needs the request
    running and unclaimed, and this holds the row lock, so after this abort no worker can start it.
    ``owner``: only if that worker holds it (a worker that claimed it but found it cannot run it, before
    reading anything).
    """
    with session.begin():
        locked = _lock_running(session, ref)
        if locked is None or (unclaimed_only and locked[1].lease_owner is not None):
            return False
        if owner is not None and locked[1].lease_owner != owner:
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

_SETTLED = threading.Condition()


def notify_settled() -> None:
    """Wake the threads of this process waiting in :func:`wait_settled` (a local settlement)."""
    with _SETTLED:
        _SETTLED.notify_all()


def claim(sessions: sessionmaker[Session], request_id: str, owner: str, lease_seconds: float) -> bool:
    """Take this queued request for ``owner`` (atomic conditional update); False if anyone else has it or
    it is settled. The lease starts now."""
    now = datetime.now(UTC)
    with sessions() as session, session.begin():
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
) -> str | None:
    """Claim the next queued request in the fair order, or None when nothing is queued.

    Order: the analyst with the fewest requests running on workers now; ties go to the analyst whose
    latest run started longest ago (round-robin); then that analyst's oldest request (FIFO per
    analyst). The claim itself is one conditional UPDATE; losing a race to another worker retries.
    Only requests of ``queue`` (the deployment's ``EXPOST_QUEUE_NAME``) are considered.
    """
    known = runnable_mechanisms() if mechanisms is None else mechanisms
    for _ in range(10):
        with sessions() as session, session.begin():
            repository = RequestRepository(session)
            oldest = repository.queued_analysts(known, queue)
            if not oldest:
                return None
            load = repository.analyst_load(list(oldest))
            chosen = min(
                oldest, key=lambda a: (load[a][0], _utc(load[a][1] or _NEVER), _utc(oldest[a]), a)
            )
            request_id = repository.oldest_queued(chosen, known, queue)
            if request_id is None:
                continue
            now = datetime.now(UTC)
            if repository.claim(request_id, owner, now, now + timedelta(seconds=lease_seconds)):
                return request_id
    return None


def _run_claimed(
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
        if request.state != "running" or request.lease_owner != owner:
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
    realized, output, error = execute(
        dataset, mechanism, params, public_context(dataset), tables, progress=heartbeat
    )
    if settle_fn is not None:
        settled = settle_fn(ref, realized, output, error)
    else:
        with sessions() as session:
            settled = settle(session, ref, realized, output, error)
    notify_settled()
    return "lost" if settled is None else "settled"


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
        if request.state != "running":
            return "duplicate"
    mechanism = MECHANISMS.get(request.mechanism)
    try:
        if mechanism is None:
            raise LookupError(f"unknown mechanism {request.mechanism!r}")
        mechanism.params_model.model_validate(request.params)
    except (LookupError, ValidationError) as exc:  # e.g. a worker of another version: nothing read yet
        log.error("this worker cannot run the request", request_id=request_id, **failure_fields(exc))
        with sessions() as session:
            abort(session, RequestRef.of(request), "no worker could run this request; nothing was charged",
                  unclaimed_only=True)
        notify_settled()
        return "unrunnable"
    owner = worker_id()
    if not claim(sessions, request_id, owner, lease_seconds):
        log.info("request already claimed or settled; not running it", request_id=request_id)
        return "duplicate"
    return _run_claimed(sessions, tables, request_id, owner, lease_seconds, heartbeat_seconds, settle_fn)


def run_next(
    sessions: sessionmaker[Session],
    tables: TableCache,
    lease_seconds: float = 300.0,
    heartbeat_seconds: float = 1.0,
    settle_fn: SettleFn | None = None,
    on_claim: Callable[[str, str], None] | None = None,
    queue: str | None = None,
) -> tuple[str, str] | None:
    """Worker body: claim the next request in the fair order and run it: (request id, outcome as for
    :func:`run_request`), or None when nothing is queued. ``on_claim(request_id, owner)`` is called right
    after the claim (so a shutdown can find and stop the runs of this process)."""
    owner = worker_id()
    request_id = claim_next(sessions, owner, lease_seconds, queue=queue)
    if request_id is None:
        return None
    if on_claim is not None:
        on_claim(request_id, owner)
    outcome = _run_claimed(sessions, tables, request_id, owner, lease_seconds, heartbeat_seconds, settle_fn)
    return request_id, outcome


SHUTDOWN_REASON = "stopped at shutdown after its grace period; its worst case was charged (the data was read)"


def stop_runs(sessions: sessionmaker[Session], claimed: list[tuple[str, str]], reason: str) -> int:
    """Settle the runs ``claimed`` [(request id, owner)] of this process with their worst case (a shutdown
    past its grace period: their data was read). Their heartbeats then fail and the runs stop."""
    stopped = 0
    for request_id, owner in claimed:
        with sessions() as session, session.begin():
            request = RequestRepository(session).get(request_id)
            if request is None:
                continue
            locked = _lock_running(session, RequestRef.of(request))
            if locked is None or locked[1].lease_owner != owner:
                continue
            _settle_locked(session, *locked, None, None, reason)
            stopped += 1
    if stopped:
        log.warning("stopped runs at shutdown; their worst case was charged", count=stopped)
        notify_settled()
    return stopped


def _lock_expired(
    session: Session, ref: RequestRef, now: datetime
) -> tuple[list[PrivacyFilter], AnalysisRequest] | None:
    """Like ``_lock_running`` but also re-checks, under the locks, that the request is claimed and its
    lease still expired (a heartbeat may have renewed it since the reaper listed it)."""
    locked = _lock_running(session, ref)
    if locked is None or locked[1].lease_owner is None:
        return None
    expires = locked[1].lease_expires_at
    return locked if expires is not None and expires < now else None


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
        with sessions() as session, session.begin():
            locked = _lock_expired(session, ref, now)
            if locked is None:
                continue
            _settle_locked(session, *locked, None, None, "the worker was lost; its worst case was charged")
            reaped += 1
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
    with sessions() as session, session.begin():
        locked = _lock_running(session, ref)
        if locked is None:
            final = RequestRepository(session).fresh(ref.id)
            assert final is not None
            if final.cancelled_by is None:
                raise NotCancellable(
                    f"request {ref.id} has already finished ({final.state})", state=final.state
                )
            return final
        filters, row = locked
        if row.lease_owner is None:
            reason = "cancelled before a worker started it; nothing was charged"
            _end_reservation(session, filters, row, None, "abort", {"reason": reason, "outcome": "cancelled"})
            row.state, row.error = "aborted", reason
            row.idempotency_key = None  # nothing was read: a retry with the same key is a new request
        else:
            reason = "cancelled while running; its worst case was charged (the data had been read)"
            _settle_locked(session, filters, row, None, None, reason)
        row.cancelled_by = principal.name
    notify_settled()
    log.info("cancelled", request_id=ref.id, by=principal.name, outcome=row.state)
    return row


def wait_settled(
    sessions: sessionmaker[Session],
    request_id: str,
    timeout: float,
    stop: threading.Event | None = None,
) -> AnalysisRequest:
    """Wait until the request leaves ``running``, the timeout passes or ``stop`` is set (a draining
    server answers 202 at once). Woken at once by settlements in this process, else polls every 50 ms."""
    deadline = time.monotonic() + timeout
    while True:
        with sessions() as session:
            request = RequestRepository(session).get(request_id)
            assert request is not None
        left = deadline - time.monotonic()
        if request.state != "running" or left <= 0 or (stop is not None and stop.is_set()):
            return request
        with _SETTLED:
            _SETTLED.wait(min(0.05, left))


def public_progress(request: AnalysisRequest) -> float | None:
    """The progress shown for a request: only for mechanisms whose amount of work is public."""
    if not has_public_progress(MECHANISMS.get(request.mechanism)):
        return None
    return 1.0 if request.state == "committed" else request.progress


def phase(request: AnalysisRequest) -> str | None:
    """``queued`` (reserved, waiting for a worker: cancelling it costs nothing), ``running`` (a worker
    claimed it), or None once settled."""
    if request.state != "running":
        return None
    return "queued" if request.lease_owner is None else "running"


def eta_seconds(request: AnalysisRequest, now: datetime | None = None) -> float | None:
    """Seconds left of a running request, from public quantities only: the time since its worker started
    it and its public fraction done (steps done of steps admitted). None when either is unknown."""
    fraction = public_progress(request)
    if request.state != "running" or request.started_at is None or fraction is None or fraction <= 0:
        return None
    elapsed = ((now or datetime.now(UTC)) - request.started_at).total_seconds()
    return round(max(0.0, elapsed * (1.0 - fraction) / fraction), 1)


def get_visible(session: Session, principal: Principal, request_id: str) -> AnalysisRequest:
    if principal.role.value == "viewer":
        raise Forbidden("viewers cannot read releases")
    request = RequestRepository(session).get(request_id)
    if request is None or (principal.role.value == "analyst" and request.analyst != principal.name):
        raise NotFound(f"no request {request_id!r}")
    return request


def submit(
    ctx: AppContext,
    principal: Principal,
    dataset_id: str,
    mechanism: str,
    params: Any,
    key: str | None,
    wait_seconds: float | None = None,
) -> AnalysisRequest:
    """Validate (read-only), admit + reserve (one durable transaction), run, settle, respond.

    Cheap mechanisms (``settings.inline_mechanisms``) run in the request's thread; others (and every
    long-running mechanism) go to the executor and the response waits up to the wait window (else 202).
    """
    started = time.monotonic()
    if ctx.draining.is_set():
        raise ServiceUnavailable("the service is shutting down; retry on another instance or later")
    with ctx.sessions() as session:
        validated = validate(session, principal, dataset_id, mechanism, params)
    inline = mechanism in ctx.settings.inline_mechanisms and not is_long_running(validated.mechanism)
    try:
        request, created = ctx.writer.admit(
            principal,
            replace(validated, inline=inline, limits=ctx.limits(), queue=ctx.settings.queue_name),
            key,
            ctx.settings.lease_seconds,
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
            ctx.executor.submit(request.id)  # a wake-up: the request is queued in the database already
        except RuntimeError:  # the executor is shutting down or the broker is unreachable
            with ctx.sessions() as session:
                aborted = abort(
                    session, RequestRef.of(request), "the request could not be queued; nothing was charged",
                    unclaimed_only=True,
                )
            if aborted:
                notify_settled()
                raise ServiceUnavailable("the service cannot run requests now; retry later") from None
            # a worker got it after all: wait for its release
    window = ctx.settings.wait_seconds
    if wait_seconds is not None:
        window = min(window, wait_seconds)
    remaining = max(0.0, window - (time.monotonic() - started))
    return wait_settled(ctx.sessions, request.id, remaining, ctx.draining)
