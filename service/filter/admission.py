"""The filter's transactions: lock, admit, reserve, settle — each one change of the filters and one ledger
entry, in the caller's transaction.

Every transition of a request or a session holds the row locks of its filters (the dataset's, then the
analyst's: :func:`lock_filters`), so admissions on one dataset are serialized (docs/privacy.md §4,
concurrency) and each dataset's ledger chain is linear. The runs layer (``service.runs``) decides *when*
a transition happens; this module is the only code that changes ``spent`` and ``reserved``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from mechanisms.accounting import UnitsVector
from service.errors import NoBudget, NotFound
from service.filter import ledger
from service.filter.ledger import LedgerEvent
from service.filter.state import FilterLike, FilterSnapshot, FilterState, read, snapshot
from service.store.models import DATASET_SCOPE, PrivacyFilter
from service.store.repositories import FilterRepository


class Refused(Exception):
    """Raised under the filter locks, before anything is written, with snapshots of the filters; the
    public refusal is built outside the lock (the affordable value takes ~60 worst-case evaluations)."""

    def __init__(self, blocked: FilterSnapshot, filters: list[FilterSnapshot]) -> None:
        super().__init__("refused")
        self.blocked, self.filters = blocked, filters


def lock_filters(session: Session, dataset_id: str, analyst: str) -> list[PrivacyFilter]:
    """[dataset filter, analyst filter], locked together in id order (the dataset's is created first),
    so two transactions never deadlock."""
    locked = {f.scope: f for f in FilterRepository(session).lock_scopes(dataset_id, [DATASET_SCOPE, analyst])}
    if DATASET_SCOPE not in locked or analyst not in locked:
        raise NotFound(f"no dataset {dataset_id!r}")
    return [locked[DATASET_SCOPE], locked[analyst]]


def admits(flt: FilterLike, charge: UnitsVector, delta: int = 0) -> bool:
    """Dataset filters need a budget; an analyst filter without a sub-budget only tracks spending (its
    δ-ledger too: without a sub-budget there is no sub-share to exhaust)."""
    return admits_state(flt.scope, read(flt), charge, delta)


def admits_state(scope: str, state: FilterState, charge: UnitsVector, delta: int = 0) -> bool:
    """:func:`admits` on a state already read (the batch path keeps its filters' states in memory)."""
    if not state.has_budget:
        if scope == DATASET_SCOPE:
            raise NoBudget("this dataset has no privacy budget yet; an admin must PUT one first")
        return True
    return state.admits(charge, delta)


def check_admission(filters: Sequence[FilterLike], charge: UnitsVector, delta: int = 0) -> None:
    """Raise :class:`Refused` unless every filter admits ``charge`` and δ units ``delta`` (writes nothing)."""
    blocked = next((f for f in filters if not admits(f, charge, delta)), None)
    if blocked is not None:
        raise Refused(snapshot(blocked), [snapshot(f) for f in filters])


def _store(flt: PrivacyFilter, state: FilterState) -> None:
    flt.spent, flt.reserved = state.spent.to_json(), state.reserved.to_json()
    flt.delta_spent, flt.delta_reserved = str(state.delta_spent), str(state.delta_reserved)
    flt.updated_at = datetime.now(UTC)


def reserve(
    session: Session,
    filters: list[PrivacyFilter],
    charge: UnitsVector,
    actor: str,
    details: dict[str, Any],
    request_id: str,
    delta: int = 0,
) -> None:
    """Add ``charge`` (and δ units ``delta``) to every filter's reservations and append the ``reserve``
    entry (after :func:`check_admission`, under the locks of :func:`lock_filters`)."""
    for flt in filters:
        _store(flt, read(flt).reserve(charge, delta))
    payload = {**details, "worst_case": charge.to_json(), **delta_field(delta)}
    ledger.append(session, filters[0], LedgerEvent.RESERVE, actor, payload, request_id=request_id)


def settle_reservation(
    session: Session,
    filters: list[PrivacyFilter],
    scopes: list[str],
    reservation: UnitsVector,
    realized: UnitsVector | None,
    actor: str,
    details: dict[str, Any],
    request_id: str,
    delta: int = 0,
) -> None:
    """Replace ``reservation`` by ``realized`` in the filters of ``scopes`` (``commit``: the reserved δ
    units ``delta`` are spent), or release both when ``realized`` is None (``abort``), and append the
    entry."""
    for flt in filters:
        if flt.scope in scopes:
            _store(flt, read(flt).settle(reservation, realized, delta))
    event = LedgerEvent.ABORT if realized is None else LedgerEvent.COMMIT
    payload = {"scopes": scopes, "worst_case": reservation.to_json(), **delta_field(delta), **details}
    ledger.append(session, filters[0], event, actor, payload, request_id=request_id)


def delta_field(delta: int) -> dict[str, int]:
    """The ledger names δ only for approximate requests, so every earlier entry replays unchanged."""
    return {"delta": delta} if delta else {}
