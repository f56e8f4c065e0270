"""Admission of requests and sessions: validate from public information, then admit + reserve.

``validate`` checks the parameters against the dataset's public schema and computes the worst case,
without reading any data. ``admit_batched`` then, in a batch holding the dataset's filter locks (the
writer's, or a batch of one: :func:`transact`): replay by Idempotency-Key, the analyst's execution
limits, the filter rule (``service.filter.batch``), the request row and the reservation. A refusal writes
nothing; its public body says requested vs spent, reserved and capacity per order, and the largest
affordable value of the mechanism's cost parameter."""

from __future__ import annotations

import hashlib
import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

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
    cost_knob,
)
from mechanisms.catalog import MECHANISMS
from mechanisms.data.schema import DatasetSchema
from mechanisms.ptr.protocol import ApproximateMechanism, is_approximate
from service.auth import Principal, Role, check_key_active
from service.datasets import check_admissible, check_individual, public_context, visible_dataset
from service.errors import (
    BudgetExhausted,
    IdempotencyKeyReused,
    InvalidInput,
    LimitExceeded,
    NoBudget,
    NotAdmissible,
    NotFound,
)
from service.filter import budget
from service.filter.batch import FilterBatch, FilterRow, Refused, admits
from service.filter.ledger import Entry, canonical_json
from service.filter.state import snapshot
from service.runs.leases import worker_id
from service.store import unit
from service.store.models import (
    DATASET_SCOPE,
    AnalysisRequest,
    Dataset,
    RequestState,
    detached_request,
)
from service.store.repositories import (
    DatasetRepository,
    FilterRepository,
    LimitRepository,
    RequestRepository,
)

T = TypeVar("T")


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
    fingerprint: str  # of (dataset, mechanism, params): an Idempotency-Key's replay must match it
    kind: str = "request"
    inline: bool = False  # runs in the admitting thread: admitted already claimed by this process
    limits: Limits | None = None  # checked at admission (under the filter locks) when given
    queue: str | None = None  # whose workers may claim it (EXPOST_QUEUE_NAME); None: only claimed by id
    # δ units on the δ-ledger (approximate-DP mechanisms only, docs/privacy/approximate.md#approximate-dp)
    delta: int = 0
    # individual datasets: the most one unit pays before its filter can leave it out, when less than the
    # worst case (``SteppedIndividually``: one step of dp_gd); the dataset filter's admission test
    unit_charge: UnitsVector | None = None


@runtime_checkable
class SteppedIndividually(Protocol):
    """A mechanism whose units' filters are checked step by step within one run (``dp_gd``): a unit stops
    taking part once it cannot afford a step, so the run may have more steps than one unit can pay for.
    ``individual_worst_case`` is the most one unit pays at a step
    (docs/privacy/individual.md#individual-dp-gd)."""

    def individual_worst_case(self, params: Any, ctx: PublicContext) -> RdpCurve: ...


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
    check_individual(context, mechanism.name, kind)
    delta = 0
    try:
        mechanism.check(params, context)
        # (ε, δ): its curve, and δ on the δ-ledger (docs/privacy/approximate.md#approximate-dp)
        if is_approximate(mechanism):
            approximate = cast(ApproximateMechanism[Any], mechanism).approximate_charge(params, context)
            worst, delta = approximate.curve, approximate.delta_units
        else:
            worst = mechanism.worst_case(params, context)
        step = None
        if context.schema.individual and isinstance(mechanism, SteppedIndividually):
            step = mechanism.individual_worst_case(params, context)
    except ParamsError as exc:
        raise InvalidInput(f"params.{exc.field}", exc.reason) from None
    except ValueError as exc:
        raise InvalidInput("params", str(exc)) from None
    except ArithmeticError:  # an extreme but schema-valid value overflowed a public computation
        reason = "the parameters are numerically out of range (a computation overflowed); use milder values"
        raise InvalidInput("params", reason) from None
    charge, fp = UnitsVector.charge(worst), fingerprint(dataset.id, mechanism.name, params)
    unit_charge = None if step is None else UnitsVector.charge(step)
    return Validated(
        dataset, mechanism, params, context, worst, charge, fp, kind, delta=delta, unit_charge=unit_charge
    )


def fingerprint(dataset_id: str, mechanism: str, params: BaseModel) -> str:
    canonical = canonical_json(
        {"dataset": dataset_id, "mechanism": mechanism, "params": params.model_dump(mode="json")}
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def curve_record(curve: RdpCurve, delta: int = 0, charge: UnitsVector | None = None) -> dict[str, Any]:
    """A stored charge: the curve, its fixed-point units (``charge``, when the caller has them already:
    ``UnitsVector.charge(curve)``) and, for an approximate request, its δ units."""
    units = UnitsVector.charge(curve) if charge is None else charge
    record = {"curve": curve.as_dict(), "units": units.to_json()}
    return record | {"delta_units": delta} if delta else record


def unit_description(column: str, max_rows: int) -> dict[str, Any]:
    """What a privacy unit is and the bound in force, as estimates and refusals show it."""
    return {
        "column": column,
        "max_rows": max_rows,
        "meaning": f"ε protects each {column!r} with all its rows: neighbouring datasets differ by one "
        f"{column} (all its rows added, removed or replaced); every release uses at most {max_rows} rows "
        "of a unit, chosen by a secret keyed hash",
    }


def accounting_description(schema: DatasetSchema) -> dict[str, Any]:
    """How a dataset is accounted, as its views, estimates and refusals show it: ``accounting``
    ("dataset" or "individual") and ``accounting_meaning`` (null under dataset accounting). Public: the
    declaration only, never a unit's state."""
    unit = schema.privacy_unit
    if not schema.individual or unit is None:
        return {"accounting": schema.accounting, "accounting_meaning": None}
    column = unit.column
    meaning = (
        f"individual accounting: each {column} has its own privacy budget, the dataset's (ε, δ), spent only "
        f"by the releases it takes part in; a release leaves out every {column} that cannot afford it; the "
        "dataset's spent and remaining totals are a public record of worst cases, not a budget"
    )
    return {"accounting": "individual", "accounting_meaning": meaning}


def refusal(v: Validated, refused: Refused) -> BudgetExhausted:
    """The 409 body: requested vs spent, reserved and capacity per order, what is affordable, and on a
    dataset with a privacy unit, what ε protects there."""
    individual = v.context.schema.individual and refused.blocked.scope == DATASET_SCOPE
    details = budget.refusal_details(refused.blocked, v.dataset.orders, v.charge, v.delta, individual)
    details["requested"] = v.worst_case.as_dict()
    unit = v.context.schema.privacy_unit
    if unit is not None:
        details["privacy_unit"] = unit_description(unit.column, unit.max_rows)
    if v.context.schema.individual:
        details |= accounting_description(v.context.schema)
    searchable = isinstance(v.mechanism, Mechanism) and not v.delta  # the search prices curves only
    details["affordable"] = affordable(v, refused) if searchable else None
    found = details["affordable"]
    hint = "" if found is None else f"; {_affordable_text(found)}"
    if not budget.ever_admissible(refused.blocked, v.charge, v.delta):
        reason = (
            "an approximate-DP mechanism needs a δ share (PUT the budget with delta_share) larger than its δ"
            if v.delta and budget.ever_admissible(refused.blocked, v.charge)
            else _never_reason(refused, v)
        )
        return NotAdmissible(
            f"the {details['filter']} filter can never admit this request, even unspent ({reason}){hint}",
            **details,
        )
    if details["binding"] == "delta":
        view = details["delta"]
        return BudgetExhausted(
            f"the {details['filter']} filter's δ share cannot afford this request: it needs δ = "
            f"{view['requested']:g} and {view['delta_remaining'] or 0:g} is left of the share "
            f"{view['delta_share'] or 0:g} (its ε fits){hint}",
            **details,
        )
    short = details["shortfall"]
    binds = "" if short is None else f": ε binds at order {details['binding_alpha']} (short by {short:.3g})"
    return BudgetExhausted(
        f"the {details['filter']} filter cannot afford this request{binds}{hint}", **details
    )


def _never_reason(refused: Refused, v: Validated) -> str:
    """Why an unspent filter still refuses: a pure budget meeting a curve without a pure bound, or a worst
    case above the whole capacity at every order (the closest order named)."""
    capacity = refused.blocked.capacity or []
    rdp_slots = any(c is not None for c in capacity[:-1])
    if not rdp_slots and not math.isfinite(v.worst_case.pure):
        return (
            "the budget is pure (δ = 0), which admits only mechanisms with a pure-DP bound, and this one has "
            "none; give the budget a δ > 0 to use Rényi accounting"
        )
    return "its worst case exceeds the whole budget at every order; see shortfall and binding_alpha"


def _affordable_text(found: dict[str, Any]) -> str:
    text = f"largest affordable {found['parameter']}: {found['value']:g}"
    for other in found.get("alternatives", []):
        text += f"; or {other['parameter']}: {other['value']:g}"
    return text


def affordable(v: Validated, refused: Refused) -> dict[str, Any] | None:
    """The nearest admissible setting every filter still admits: the most expensive value of the mechanism's
    cost knob (``mechanisms.base.cost_knob``: for a learner given a target, the largest target_epsilon), and,
    for a mechanism with a ``steps`` count whose charge grows with it, the most steps that fit (fewest cut)
    as an alternative. Each value, resubmitted alone, is admitted while the budget is unchanged."""
    assert isinstance(v.mechanism, Mechanism)

    individual = v.context.schema.individual
    priced = _StepPriced(v.mechanism) if individual and isinstance(v.mechanism, SteppedIndividually) else None

    def admissible(curve: RdpCurve) -> bool:
        unit = None if priced is None else priced.step_charge(v.context)  # the candidate's one step
        charge = UnitsVector.charge(curve)
        return all(admits(f, charge, individual=individual, unit_charge=unit) for f in refused.filters)

    name, _ = cost_knob(v.mechanism, v.params)
    searched = v.mechanism if priced is None else cast(Mechanism[Any], priced)
    value = best_affordable_cost(searched, v.params, v.context, admissible, iterations=32)
    # on an individual dataset a stepped run's length does not decide admission (one step does): no steps hint
    steps = _affordable_steps(v, admissible) if name != "target_epsilon" and priced is None else None
    if value is None and steps is None:
        return None
    found: dict[str, Any] = (
        {"parameter": name, "value": value} if value is not None else {"parameter": "steps", "value": steps}
    )
    if value is not None and steps is not None:
        found["alternatives"] = [{"parameter": "steps", "value": steps}]
    return found


class _StepPriced:
    """A stepped mechanism (``SteppedIndividually``) seen by the affordable search on an individual dataset:
    it remembers the candidate whose worst case was asked last, so that the dataset filter is asked about
    that candidate's one step (what admission asks) while analyst filters see the whole run."""

    def __init__(self, mechanism: Any) -> None:
        self.mechanism = mechanism
        self.last: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.mechanism, name)

    def worst_case(self, params: Any, ctx: PublicContext) -> RdpCurve:
        self.last = params
        curve: RdpCurve = self.mechanism.worst_case(params, ctx)
        return curve

    def step_charge(self, ctx: PublicContext) -> UnitsVector:
        return UnitsVector.charge(self.mechanism.individual_worst_case(self.last, ctx))


def _affordable_steps(v: Validated, admissible: Callable[[RdpCurve], bool]) -> int | None:
    """The largest steps < the requested count whose worst case ``admissible`` accepts (bisection; the
    charge of the gradient learners grows with the steps), or None (no such field, or even 1 step fails)."""
    assert isinstance(v.mechanism, Mechanism)
    asked = getattr(v.params, "steps", None)
    if not isinstance(asked, int) or isinstance(asked, bool) or asked <= 1:
        return None
    mechanism = v.mechanism

    def ok(steps: int) -> bool:
        try:
            candidate = type(v.params).model_validate({**v.params.model_dump(), "steps": steps})
            mechanism.check(candidate, v.context)
            return admissible(mechanism.worst_case(candidate, v.context))
        except (ValueError, ArithmeticError):
            return False

    if not ok(1):
        return None
    lo, hi = 1, asked  # ok(lo), and asked itself was refused
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def admission_check(session: Session, principal: Principal, v: Validated) -> dict[str, Any]:
    """Dry run: would the request be admitted now? Takes no lock and writes nothing."""
    filters = FilterRepository(session)
    checked = [f for f in (filters.get(v.dataset.id), filters.get(v.dataset.id, principal.name)) if f]
    try:
        individual = v.context.schema.individual
        blocked = next(
            (f for f in checked if not admits(f, v.charge, v.delta, individual, v.unit_charge)), None
        )
    except NoBudget as exc:
        return {"admitted": False, "reason": exc.detail, "worst_case": v.worst_case.as_dict()}
    result: dict[str, Any] = {"admitted": blocked is None, "worst_case": v.worst_case.as_dict()}
    if blocked is not None:
        snapshots = [snapshot(f) for f in checked]
        result["refusal"] = refusal(v, Refused(snapshot(blocked), snapshots)).problem()
    return result


def check_admissible_now(session: Session, principal: Principal, dataset_id: str) -> None:
    """Under the dataset's filter locks, before admitting: the principal's API key is not revoked (401), the
    dataset is not archived (409) and an analyst is still granted (404), all read from the database now, not
    from a process cache. A revocation holds the key's filters while it sets the mark (``service.runs.
    sessions.revoke_key``), so each admission of a key commits before its revocation or is refused."""
    check_key_active(session, principal.name)
    check_admissible(session, principal, dataset_id)


def new_request(principal: Principal, v: Validated, fp: str, key: str | None, lease: float) -> dict[str, Any]:
    """The columns of an admitted request's row (state ``running``, its worst case reserved)."""
    now = datetime.now(UTC)
    # A queued request has no lease: its lease starts when a worker claims it. An inline run is claimed
    # by this thread at admission; a session's "lease" is its expiry.
    queued = v.kind == "request" and not v.inline
    return {
        "id": "rq_" + uuid.uuid4().hex[:20],
        "kind": v.kind,
        "dataset_id": v.dataset.id,
        "analyst": principal.name,
        "mechanism": v.mechanism.name,
        "params": v.params.model_dump(mode="json"),
        "fingerprint": fp,
        "idempotency_key": key,
        "state": RequestState.RUNNING.value,
        "scopes": [DATASET_SCOPE, principal.name],
        "worst_case": curve_record(v.worst_case, v.delta, v.charge),
        "realized": None,
        "release": None,
        "error": None,
        "created_at": now,
        "updated_at": now,
        "lease_expires_at": None if queued else now + timedelta(seconds=lease),
        "lease_owner": worker_id() if v.inline else None,
        "started_at": now if v.inline else None,
        "progress": None,
        "cancelled_by": None,
        "queue": v.queue if queued else None,
    }


# ----- the batch: every admission and settlement, in plain rows and set-based statements ---------------


@dataclass
class RequestBatch:
    """What the admissions and settlements of one batch share: the locked filters (:class:`FilterBatch`),
    what admission reads under the locks (read once for the whole batch), and the request rows to write.
    Requests are plain (transient) ``AnalysisRequest`` objects, never added to the ORM session:
    :meth:`write` stores them with one executemany INSERT and executemany UPDATEs.

    A writer batch (``pipeline``) sends its writes and its COMMIT in one round trip on PostgreSQL; a batch
    of one (:func:`transact`) sends them plainly, so a unique-key race surfaces as SQLAlchemy's
    ``IntegrityError`` (its callers replay the winner)."""

    session: Session
    filters: FilterBatch
    pipeline: bool = True
    keyed: dict[tuple[str, str], AnalysisRequest] = field(default_factory=dict)
    fresh: dict[str, AnalysisRequest] = field(default_factory=dict)
    archived: set[str] = field(default_factory=set)
    granted: set[tuple[str, str]] = field(default_factory=set)
    inserts: dict[str, dict[str, Any]] = field(default_factory=dict)
    updates: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def locked(cls, session: Session, reads: BatchReads, pipeline: bool = True) -> RequestBatch:
        """Lock the filters of ``reads.scopes``, then read (under the locks) the requests stored under
        its keys (analyst, Idempotency-Key), the running requests to settle, which datasets are archived
        and which (dataset, analyst) hold a grant with an API key not revoked: a few statements for the
        whole batch. A batch of one (not ``pipeline``) also locks the rows of the requests it settles: a
        worker's claim or heartbeat, which take only that row, cannot slip between its check and its
        transition (the writer settles only the runs of its own process)."""
        filters = FilterBatch(session)
        filters.lock(reads.scopes)
        requests = RequestRepository(session)
        batch = cls(session, filters, pipeline)
        for row in requests.by_keys(reads.keys):
            batch.keyed[(row["analyst"], row["idempotency_key"])] = detached_request(row)
        rows = requests.rows(reads.settles, lock=not pipeline)
        batch.fresh = {row["id"]: detached_request(row) for row in rows}
        batch.archived, batch.granted = DatasetRepository(session).admissible_many(
            sorted(reads.scopes), sorted({a for _, a in reads.grants})
        )
        return batch

    def check_admissible(self, principal: Principal, dataset_id: str) -> None:
        """:func:`check_admissible_now` from what was read under the locks (an analyst's grant is read
        only with an active key); when it finds a problem, or for a principal that is not an analyst (no
        grant to read), the original re-reads and raises its exact error (and drops a stale grant from the
        process cache)."""
        granted = principal.role is Role.analyst and (dataset_id, principal.name) in self.granted
        if dataset_id in self.archived or not granted:
            check_admissible_now(self.session, principal, dataset_id)

    def request(self, request_id: str) -> AnalysisRequest | None:
        """A request read (and locked) under the batch's filter locks: one of those it settles, else read
        now (a session opened since the batch's caller listed them)."""
        if request_id not in self.fresh:
            for row in RequestRepository(self.session).rows([request_id], lock=True):
                self.fresh[request_id] = detached_request(row)
        return self.fresh.get(request_id)

    def add(self, values: dict[str, Any]) -> AnalysisRequest:
        request = detached_request(values)
        self.inserts[request.id] = values
        if request.idempotency_key is not None:
            self.keyed[(request.analyst, request.idempotency_key)] = request
        return request

    def settled(self, request: AnalysisRequest, columns: dict[str, Any]) -> None:
        """Set ``columns`` of ``request`` and record them (a new row of this batch is inserted with them).
        The batch's request objects are detached (``detached_request``): set at once, without the ORM's
        attribute events."""
        request.__dict__.update(columns)
        if request.id in self.inserts:
            self.inserts[request.id].update(columns)
        else:
            self.updates.setdefault(request.id, {"_id": request.id}).update(columns)

    def write(self) -> None:
        """The batch's writes so far, now (in one round trip on PostgreSQL for a writer batch)."""
        if not self.pipeline:
            self.send()
            return
        with unit.pipelined(self.session):
            self.send()

    def send(self) -> None:
        """Execute the batch's pending writes: request rows (INSERT, UPDATE), filter totals and ledger
        entries."""
        requests = RequestRepository(self.session)
        requests.insert_many(list(self.inserts.values()))
        by_columns: dict[frozenset[str], list[dict[str, Any]]] = {}
        for row in self.updates.values():  # one executemany per set of columns
            by_columns.setdefault(frozenset(row), []).append(row)
        for rows in by_columns.values():
            requests.update_many(rows)
        self.filters.flush()
        self.inserts, self.updates = {}, {}


@dataclass(frozen=True)
class BatchReads:
    """What a batch locks and reads under the locks: ``scopes`` (dataset id → filter scopes to lock),
    ``keys`` (analyst, Idempotency-Key) of admissions, the requests it ``settles`` and the (dataset,
    analyst) ``grants`` its analysts' admissions need."""

    scopes: dict[str, Sequence[str]]
    keys: Sequence[tuple[str, str]] = ()
    settles: Sequence[str] = ()
    grants: Sequence[tuple[str, str]] = ()

    @classmethod
    def of(cls, dataset_ids: Sequence[str], analyst: str, **reads: Any) -> BatchReads:
        """The filters of ``analyst`` (and the datasets') on ``dataset_ids``."""
        return cls({d: sorted({DATASET_SCOPE, analyst}) for d in dataset_ids}, **reads)


def transact(
    session: Session, reads: BatchReads, apply: Callable[[RequestBatch], T], pipeline: bool = False
) -> T:
    """One batch on ``session`` (which has no transaction yet): lock and read ``reads``, ``apply`` the
    transitions, write and commit. An exception rolls all of it back. The writer's batches are
    ``pipeline``; every other caller submits a batch of one, whose ORM objects (a session's transcript, its
    secret state) commit in the same transaction."""
    unit.begin(session)
    try:
        batch = RequestBatch.locked(session, reads, pipeline)
        result = apply(batch)
        # The writes and the COMMIT (one round trip for a writer batch on PostgreSQL): any failed
        # statement fails the COMMIT, so nothing of the batch is durable and the caller retries its jobs.
        unit.commit(session, batch.send, pipeline)
    except BaseException:
        unit.rollback(session)
        raise
    return result


def filters_of(batch: RequestBatch, dataset_id: str, analyst: str) -> list[FilterRow]:
    """[dataset filter, analyst filter] of a locked batch; a missing one is a 404."""
    filters = batch.filters.filters(dataset_id, analyst)
    if filters is None:
        raise NotFound(f"no dataset {dataset_id!r}")
    return filters


def admit_batched(
    batch: RequestBatch,
    filters: list[FilterRow],
    principal: Principal,
    v: Validated,
    key: str | None,
    lease: float,
) -> tuple[AnalysisRequest, bool]:
    """Under ``filters``' locks: replay by Idempotency-Key, or admit + reserve (admissible, limits, the
    filter rule, the row, the reservation)."""
    fp = v.fingerprint
    if key is not None:
        existing = batch.keyed.get((principal.name, key))
        if existing is not None:
            if existing.fingerprint != fp:
                raise IdempotencyKeyReused(
                    "this Idempotency-Key was used for a different request", idempotency_key=key
                )
            return existing, False
    batch.check_admissible(principal, v.dataset.id)
    if v.limits is not None and not (v.kind == "request" and v.inline):
        batch.write()  # the counts below must see the rows admitted earlier in this batch
        check_limits(batch.session, principal.name, v)
    individual = v.context.schema.individual
    batch.filters.check(filters, v.charge, v.delta, individual, v.unit_charge)
    request = batch.add(new_request(principal, v, fp, key, lease))
    details = {"scopes": request.scopes, "mechanism": request.mechanism, "params": request.params}
    entry = Entry(request.id, principal.name, details, request.created_at)
    batch.filters.reserve(filters, v.charge, v.delta, entry)
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
            limit="max_open_sessions",
            max=max_sessions,
            current=open_sessions,
        )
    if v.kind == "request" and active >= max_requests:
        raise LimitExceeded(
            f"you have {active} requests queued or running, the limit is {max_requests}; "
            "wait for one to finish or cancel one",
            limit="max_running_requests",
            max=max_requests,
            current=active,
        )


def admit(
    session: Session, principal: Principal, v: Validated, key: str | None, lease: float
) -> tuple[AnalysisRequest, bool]:
    """Admit and reserve in a batch of one; returns (request, created). Raises a refusal otherwise."""
    reads = admission_reads(principal, v, key)

    def apply(batch: RequestBatch) -> tuple[AnalysisRequest, bool]:
        filters = filters_of(batch, v.dataset.id, principal.name)
        return admit_batched(batch, filters, principal, v, key, lease)

    try:
        return transact(session, reads, apply)
    except Refused as refused:
        raise refusal(v, refused) from None


def admission_reads(principal: Principal, v: Validated, key: str | None) -> BatchReads:
    """What an admission reads under its filter locks: its Idempotency-Key's stored request and, for an
    analyst, whether the grant still holds."""
    keys = [] if key is None else [(principal.name, key)]
    grants = [(v.dataset.id, principal.name)] if principal.role is Role.analyst else []
    return BatchReads.of([v.dataset.id], principal.name, keys=keys, grants=grants)


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
            if existing.fingerprint != v.fingerprint:
                raise IdempotencyKeyReused("this Idempotency-Key was used for a different request") from None
            return existing, False
