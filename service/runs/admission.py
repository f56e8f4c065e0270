"""Admission of requests and sessions: validate from public information, then admit + reserve.

``validate`` checks the parameters against the dataset's public schema and computes the worst case,
without reading any data. ``admit`` then runs one transaction under the dataset's filter locks: replay by
Idempotency-Key, the analyst's execution limits, the filter rule (``service.filter.admission``), the
request row and the reservation. A refusal writes nothing; its public body says requested vs spent,
reserved and capacity per order, and the largest affordable value of the mechanism's cost parameter.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import RdpCurve, UnitsVector
from mechanisms.base import (
    InteractiveMechanism,
    Mechanism,
    ParamsError,
    PublicContext,
    best_affordable_cost,
)
from mechanisms.catalog import MECHANISMS
from mechanisms.ptr.protocol import ApproximateMechanism, is_approximate
from service.auth import Principal
from service.datasets import check_admissible, public_context, visible_dataset
from service.errors import (
    BudgetExhausted,
    IdempotencyKeyReused,
    InvalidInput,
    LimitExceeded,
    NoBudget,
    NotAdmissible,
)
from service.filter import admission as filter_admission
from service.filter import budget
from service.filter.admission import Refused, check_admission, lock_filters, reserve
from service.filter.ledger import canonical_json
from service.filter.state import snapshot
from service.runs.leases import worker_id
from service.store.models import DATASET_SCOPE, AnalysisRequest, Dataset, PrivacyFilter, RequestState
from service.store.repositories import FilterRepository, LimitRepository, RequestRepository


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
    mechanism: Mechanism[Any] | InteractiveMechanism[Any, Any]
    params: BaseModel
    context: PublicContext
    worst_case: RdpCurve
    charge: UnitsVector
    kind: str = "request"
    inline: bool = False  # runs in the admitting thread: admitted already claimed by this process
    limits: Limits | None = None  # checked at admission (under the filter locks) when given
    queue: str | None = None  # whose workers may claim it (EXPOST_QUEUE_NAME); None: only claimed by id
    delta: int = 0  # δ units on the δ-ledger (approximate-DP mechanisms only, docs/privacy.md §11)

def validate(session: Session, principal: Principal, dataset_id: str, name: str, raw: Any) -> Validated:
    dataset = visible_dataset(session, principal, dataset_id)
    mechanism = MECHANISMS.get(name)
    if mechanism is None:
        raise InvalidInput("mechanism", f"unknown mechanism {name!r}; see GET /v1/mechanisms")
    return validated_for(dataset, mechanism, raw)

def validated_for(
    dataset: Dataset,
    mechanism: Mechanism[Any] | InteractiveMechanism[Any, Any],
    raw: Any,
    kind: str = "request",
) -> Validated:
    """Parameters checked against public information only; the worst case computed. No data is read."""
    try:
        params = mechanism.params_model.model_validate(raw)
    except ValidationError as exc:
        raise InvalidInput.from_validation("params", exc) from None
    context = public_context(dataset)
    delta = 0
    try:
        mechanism.check(params, context)
        if is_approximate(mechanism):  # (ε, δ): its curve, and δ on the δ-ledger (docs/privacy.md §11)
            approximate = cast(ApproximateMechanism[Any], mechanism).approximate_charge(params, context)
            worst, delta = approximate.curve, approximate.delta_units
        else:
            worst = mechanism.worst_case(params, context)
    except ParamsError as exc:
        raise InvalidInput(f"params.{exc.field}", exc.reason) from None
    except ValueError as exc:
        raise InvalidInput("params", str(exc)) from None
    except ArithmeticError:  # an extreme but schema-valid value overflowed a public computation
        reason = "the parameters are numerically out of range (a computation overflowed); use milder values"
        raise InvalidInput("params", reason) from None
    return Validated(dataset, mechanism, params, context, worst, UnitsVector.charge(worst), kind, delta=delta)

def fingerprint(dataset_id: str, mechanism: str, params: BaseModel) -> str:
    canonical = canonical_json(
        {"dataset": dataset_id, "mechanism": mechanism, "params": params.model_dump(mode="json")}
    )
    return hashlib.sha256(canonical.encode()).hexdigest()

def curve_record(curve: RdpCurve, delta: int = 0) -> dict[str, Any]:
    """A stored charge: the curve, its fixed-point units and, for an approximate request, its δ units."""
    record = {"curve": curve.as_dict(), "units": UnitsVector.charge(curve).to_json()}
    return record | {"delta_units": delta} if delta else record

def refusal(v: Validated, refused: Refused) -> BudgetExhausted:
    """The 409 body: requested vs spent, reserved and capacity per order, and what is affordable."""
    details = budget.refusal_details(refused.blocked, v.dataset.orders, v.charge, v.delta)
    details["requested"] = v.worst_case.as_dict()
    searchable = isinstance(v.mechanism, Mechanism) and not v.delta  # the search prices curves only
    details["affordable"] = affordable(v, refused) if searchable else None
    found = details["affordable"]
    hint = "" if found is None else f"; largest affordable {found['parameter']}: {found['value']:g}"
    if not budget.ever_admissible(refused.blocked, v.charge, v.delta):
        reason = (
            "an approximate-DP mechanism needs a δ share (PUT the budget with delta_share) larger than its δ"
            if v.delta and budget.ever_admissible(refused.blocked, v.charge)
            else "e.g. a pure budget admits only mechanisms with a pure-DP bound"
        )
        return NotAdmissible(
            f"the {details['filter']} filter can never admit this request, even unspent ({reason}){hint}",
            **details,
        )
    return BudgetExhausted(f"the {details['filter']} filter cannot afford this request{hint}", **details)

def affordable(v: Validated, refused: Refused) -> dict[str, Any] | None:
    """The most expensive value of the mechanism's cost parameter every filter still admits."""
    assert isinstance(v.mechanism, Mechanism)

    def admissible(curve: RdpCurve) -> bool:
        return all(filter_admission.admits(f, UnitsVector.charge(curve)) for f in refused.filters)

    value = best_affordable_cost(v.mechanism, v.params, v.context, admissible)
    return None if value is None else {"parameter": v.mechanism.cost_parameter, "value": value}

def admission_check(session: Session, principal: Principal, v: Validated) -> dict[str, Any]:
    """Dry run: would the request be admitted now? Takes no lock and writes nothing."""
    filters = FilterRepository(session)
    checked = [f for f in (filters.get(v.dataset.id), filters.get(v.dataset.id, principal.name)) if f]
    try:
        blocked = next((f for f in checked if not filter_admission.admits(f, v.charge, v.delta)), None)
    except NoBudget as exc:
        return {"admitted": False, "reason": exc.detail, "worst_case": v.worst_case.as_dict()}
    result: dict[str, Any] = {"admitted": blocked is None, "worst_case": v.worst_case.as_dict()}
    if blocked is not None:
        snapshots = [snapshot(f) for f in checked]
        result["refusal"] = refusal(v, Refused(snapshot(blocked), snapshots)).problem()
    return result


def admit_locked(
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
    check_admissible(session, principal, v.dataset.id)  # not archived, still granted (read now)
    if v.limits is not None:
        check_limits(session, principal.name, v)
    check_admission(filters, v.charge, v.delta)
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
        state=RequestState.RUNNING,
        scopes=[DATASET_SCOPE, principal.name],
        worst_case=curve_record(v.worst_case, v.delta),
        created_at=now,
        updated_at=now,
        lease_expires_at=None if queued else now + timedelta(seconds=lease),
        lease_owner=worker_id() if v.inline else None,
        started_at=now if v.inline else None,
        queue=v.queue if queued else None,
    )
    RequestRepository(session).add(request)
    details = {"scopes": request.scopes, "mechanism": request.mechanism, "params": request.params}
    reserve(session, filters, v.charge, principal.name, details, request.id, v.delta)
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
            filters = lock_filters(session, v.dataset.id, principal.name)
            return admit_locked(session, filters, principal, v, key, lease)
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
