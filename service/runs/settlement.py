"""Settlement: a running request's reservation replaced by its realized charge (commit), or released
without charge (abort, only when its data was provably never read), in a batch (``service.filter.batch``):
the writer's, or a batch of one (:func:`transition`). Never twice: each transition re-reads the request
under its filters' locks and does nothing unless it is still running.

The release is stored in the same transaction that commits the realized charge, so a release never leaves
before its debit is durable.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import RdpCurve, UnitsVector
from service import metrics
from service.datasets import dataset_by_id, public_context
from service.filter.batch import FilterRow
from service.filter.individual import UnitUpdate
from service.filter.ledger import Entry
from service.runs.admission import BatchReads, RequestBatch, curve_record, filters_of, transact
from service.store.models import AnalysisRequest, RequestState
from service.store.repositories import RequestRepository

log = structlog.get_logger("expost.requests")


@dataclass(frozen=True)
class RequestRef:
    """Which request, and so which filters guard its transitions."""

    id: str
    dataset_id: str
    analyst: str

    @classmethod
    def of(cls, request: AnalysisRequest) -> RequestRef:
        return cls(request.id, request.dataset_id, request.analyst)


def transition(
    session: Session,
    ref: RequestRef,
    change: Callable[[RequestBatch, list[FilterRow], AnalysisRequest], bool],
) -> AnalysisRequest | None:
    """A batch of one on ``session``: lock the request's filters, re-read (and lock) its row and, if it is
    still running, apply ``change`` (which returns False to leave it as it is). Returns the request after
    the change, or None (no longer running, or left): never charge twice."""

    def apply(batch: RequestBatch) -> AnalysisRequest | None:
        request = batch.fresh.get(ref.id)
        if request is None or request.state != RequestState.RUNNING:
            return None
        filters = filters_of(batch, ref.dataset_id, ref.analyst)
        return request if change(batch, filters, request) else None

    return transact(session, BatchReads.of([ref.dataset_id], ref.analyst, settles=[ref.id]), apply)


def settlement_of(
    request: AnalysisRequest,
    realized: RdpCurve | None,
    release: dict[str, Any] | None,
    error: str | None,
) -> tuple[dict[str, Any], UnitsVector, UnitsVector, dict[str, Any] | None, str | None]:
    """(stored charge record, charge, reservation, release, error) of a settlement: the realized charge, or
    the worst case on error or when the realized charge is not below the reservation (then nothing is
    released)."""
    reservation = UnitsVector.from_json(request.worst_case["units"])
    delta = reserved_delta(request)  # an approximate request's δ is always spent once it ran
    if error is None and not storable(release):
        # Not strict JSON (NaN, ±inf, a non-JSON type): PostgreSQL would refuse the row, the settlement
        # would fail and the request would hang until the reaper. Settled here, on every path, as a
        # mechanism failure charged its worst case: the failure is a function of the output only.
        log.error("release is not storable JSON; charging the worst case", request_id=request.id)
        realized, release, error = None, None, UNSTORABLE
    if realized is None:
        record, charge = request.worst_case, reservation
    else:
        charge = UnitsVector.charge(realized)
        record = curve_record(realized, delta, charge)
    if not charge <= reservation:  # a mechanism bug: never commit more than was admitted
        log.error("realized charge above the reservation; committing the worst case", request_id=request.id)
        record, charge, release, error = request.worst_case, reservation, None, "internal accounting error"
    return record, charge, reservation, release, error


def settle_batched(
    batch: RequestBatch,
    filters: list[FilterRow],
    request: AnalysisRequest,
    realized: RdpCurve | None,
    release: dict[str, Any] | None,
    error: str | None,
    units: UnitUpdate | None = None,
) -> None:
    """Replace the reservation by the realized charge (or the worst case on error) and store the release,
    in ``batch`` (the request's row is written with the batch). ``units``: the release's new unit filters
    (individual datasets), stored with it, or the release is discarded when they were computed on a state
    that is no longer the stored one (``service.filter.individual``)."""
    if units is not None and error is None and not batch.filters.units_current(units):
        log.warning("unit filters changed during the run; the release is discarded", request_id=request.id)
        realized, release, error = None, None, UNIT_CONFLICT
    if units is None and error is None and _individual(batch, request):  # never a release its units skip
        log.error("an individual dataset's release came without its units' charges", request_id=request.id)
        realized, release, error = None, None, "internal accounting error"
    record, charge, _, release, error = settlement_of(request, realized, release, error)
    outcome: dict[str, Any] = {
        "realized": charge.to_json(),
        "outcome": "released" if error is None else "failed",
    }
    if units is not None and error is None:
        outcome["unit_filters_version"] = units.expected + 1
    state = RequestState.COMMITTED if error is None else RequestState.FAILED_CHARGED
    columns = {"state": state, "realized": record, "release": release, "error": error}
    end_batched(batch, filters, request, charge, outcome, columns)
    if units is not None and error is None:
        batch.filters.write_units(units)


def _individual(batch: RequestBatch, request: AnalysisRequest) -> bool:
    """Whether the request's dataset keeps individual filters (its immutable row is cached)."""
    dataset = dataset_by_id(batch.session, request.dataset_id)
    return dataset is not None and public_context(dataset).schema.individual


UNIT_CONFLICT = (
    "another release changed the units' filters while this one ran; it was discarded (nothing reached any "
    "unit's filter) and its worst case was charged to the dataset's record"
)


def end_batched(
    batch: RequestBatch,
    filters: list[FilterRow],
    request: AnalysisRequest,
    charge: UnitsVector | None,
    details: dict[str, Any],
    columns: dict[str, Any],
) -> None:
    """End the request's reservation in ``batch``: replaced by ``charge`` (None: released, its δ too) in
    its filters, with the ledger entry of ``details``; the request's row gets ``columns``."""
    now = datetime.now(UTC)
    reservation = UnitsVector.from_json(request.worst_case["units"])
    entry = Entry(request.id, request.analyst, details, now)
    batch.filters.settle(filters, request.scopes, reservation, charge, reserved_delta(request), entry)
    label = str(details.get("outcome", "abort"))
    metrics.ended(batch.session, request.dataset_id, request.kind, label, charge)
    batch.settled(request, {**columns, "updated_at": now, "lease_expires_at": None})


UNSTORABLE = "the mechanism failed; its worst case was charged"


def storable(release: dict[str, Any] | None) -> bool:
    """Can the release be stored whatever its values (strict JSON: no NaN or infinity)? Checked by every
    settlement (:func:`settlement_of`) before it writes the release, so no settlement transaction can fail
    because of the released values (the one-transaction path relies on this,
    docs/privacy/workers.md#workers)."""
    try:
        json.dumps(release, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def release_batched(
    batch: RequestBatch,
    filters: list[FilterRow],
    request: AnalysisRequest,
    reason: str,
    details: dict[str, Any] | None = None,
) -> None:
    """Release the request's reservation without charge (its δ too): an ``abort`` entry, the request
    ``aborted`` with ``reason``. Only for requests whose data was provably never read; nothing was read,
    so a retry with the same Idempotency-Key is admitted afresh (the key is cleared)."""
    columns = {"state": RequestState.ABORTED, "error": reason, "idempotency_key": None}
    end_batched(batch, filters, request, None, details or {"reason": reason}, columns)


def reserved_delta(request: AnalysisRequest) -> int:
    """The δ units an approximate request reserved (0 for every other request)."""
    delta = request.worst_case.get("delta_units", 0)
    if type(delta) is not int or delta < 0:
        raise ValueError(f"request {request.id}: stored δ units must be a non-negative integer")
    return delta


def settle(
    session: Session,
    ref: RequestRef,
    realized: RdpCurve | None,
    release: dict[str, Any] | None,
    error: str | None,
    units: UnitUpdate | None = None,
) -> AnalysisRequest | None:
    """Commit the realized charge and store the release, or commit the worst case with an error.

    Returns the settled request, or None if it was no longer running (never charge twice).
    """

    def change(batch: RequestBatch, filters: list[FilterRow], request: AnalysisRequest) -> bool:
        settle_batched(batch, filters, request, realized, release, error, units)
        return True

    return transition(session, ref, change)


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

    def change(batch: RequestBatch, filters: list[FilterRow], request: AnalysisRequest) -> bool:
        if unclaimed_only and request.lease_owner is not None:
            return False
        if owner is not None and request.lease_owner != owner:
            return False
        release_batched(batch, filters, request, reason)
        return True

    return transition(session, ref, change) is not None


SettleFn = Callable[
    ["RequestRef", RdpCurve | None, dict[str, Any] | None, str | None, UnitUpdate | None], object
]

_SETTLED = threading.Condition()


def notify_settled() -> None:
    """Wake the threads of this process waiting in :func:`wait_settled` (a local settlement)."""
    with _SETTLED:
        _SETTLED.notify_all()


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
        if request.state != RequestState.RUNNING or left <= 0 or (stop is not None and stop.is_set()):
            return request
        with _SETTLED:
            _SETTLED.wait(min(0.05, left))
