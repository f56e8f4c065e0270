"""The filter's transactions for a whole batch, in plain SQL: lock once, apply in memory, write once.

The group-commit writer (``service.runs.writer``) applies many admissions and settlements in one database
transaction. Done through ORM objects, each of them costs an object per filter, request and ledger entry
and the unit of work's bookkeeping at flush. This module keeps the same transitions with plain rows:

* **lock**: one ``SELECT … FOR UPDATE`` of every filter row the batch touches, ordered by (dataset id, id),
  the global lock order of every locking path (:meth:`FilterRepository.lock_many`);
* **apply**: each job's check, reserve and settle on the locked rows' :class:`FilterState`, in arrival order,
  with exactly the functions of the one-by-one path (``admits_state``, ``FilterState.reserve`` and
  ``settle``) and the ledger entry built by :func:`service.filter.ledger.entry_values`: the hash chain is
  extended in memory, entry after entry, from the head read under the lock;
* **flush**: one executemany UPDATE of the changed filter rows (totals and chain head) and one executemany
  INSERT of the new ledger entries, in the caller's transaction (which commits them with the request rows).

A job's transition is computed completely before anything is changed in memory, so a refusal or an error
of one job leaves the batch as if the job had not been there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from mechanisms.accounting import UnitsVector
from service.filter.admission import Refused, admits_state, delta_field
from service.filter.ledger import LedgerEvent, entry_values
from service.filter.state import FilterSnapshot, FilterState, read
from service.store.models import DATASET_SCOPE
from service.store.repositories import FilterRepository, LedgerRepository


@dataclass
class FilterRow:
    """A filter row locked by the batch, its state kept parsed (a :class:`FilterLike` for refusals)."""

    id: int
    dataset_id: str
    scope: str
    capacity: list[Any] | None
    delta_capacity: str | None
    state: FilterState
    last_seq: int
    last_hash: str
    dirty: bool = False

    @property
    def spent(self) -> dict[str, Any]:
        return self.state.spent.to_json()

    @property
    def reserved(self) -> dict[str, Any]:
        return self.state.reserved.to_json()

    @property
    def delta_spent(self) -> str:
        return str(self.state.delta_spent)

    @property
    def delta_reserved(self) -> str:
        return str(self.state.delta_reserved)

    def snapshot(self) -> FilterSnapshot:
        return FilterSnapshot(
            self.scope,
            self.capacity,
            self.spent,
            self.reserved,
            self.delta_capacity,
            self.delta_spent,
            self.delta_reserved,
        )


@dataclass
class FilterBatch:
    """The filters one writer batch holds locked, with its pending ledger entries."""

    session: Session
    rows: dict[tuple[str, str], FilterRow] = field(default_factory=dict)
    entries: list[dict[str, Any]] = field(default_factory=list)

    def lock(self, scopes: dict[str, Sequence[str]]) -> None:
        """Lock (and read) the filters of ``scopes`` (dataset id → scopes) in one statement."""
        for row in FilterRepository(self.session).lock_many(scopes):
            self.rows[(row["dataset_id"], row["scope"])] = FilterRow(
                row["id"],
                row["dataset_id"],
                row["scope"],
                row["capacity"],
                row["delta_capacity"],
                read(_Stored(row)),
                row["last_seq"],
                row["last_hash"],
            )

    def filters(self, dataset_id: str, analyst: str) -> list[FilterRow] | None:
        """[dataset filter, analyst filter], or None if either does not exist."""
        head, own = self.rows.get((dataset_id, DATASET_SCOPE)), self.rows.get((dataset_id, analyst))
        return None if head is None or own is None else [head, own]

    # ----- the transitions (same functions as service.filter.admission) ---------------------------------

    def check(self, filters: list[FilterRow], charge: UnitsVector, delta: int = 0) -> None:
        """Raise :class:`Refused` unless every filter admits the charge (``check_admission``)."""
        blocked = next((f for f in filters if not admits_state(f.scope, f.state, charge, delta)), None)
        if blocked is not None:
            raise Refused(blocked.snapshot(), [f.snapshot() for f in filters])

    def reserve(
        self,
        filters: list[FilterRow],
        charge: UnitsVector,
        actor: str,
        details: dict[str, Any],
        request_id: str,
        delta: int = 0,
        now: datetime | None = None,
    ) -> None:
        """``admission.reserve``: add the charge to every filter's reservations, append ``reserve``."""
        states = [f.state.reserve(charge, delta) for f in filters]
        payload = {**details, "worst_case": charge.to_json(), **delta_field(delta)}
        self._commit(filters, states, LedgerEvent.RESERVE, actor, payload, request_id, now)

    def settle(
        self,
        filters: list[FilterRow],
        scopes: list[str],
        reservation: UnitsVector,
        realized: UnitsVector | None,
        actor: str,
        details: dict[str, Any],
        request_id: str,
        delta: int = 0,
        now: datetime | None = None,
    ) -> None:
        """``admission.settle_reservation``: replace the reservation by ``realized`` (None: abort)."""
        states = [
            f.state.settle(reservation, realized, delta) if f.scope in scopes else f.state for f in filters
        ]
        event = LedgerEvent.ABORT if realized is None else LedgerEvent.COMMIT
        payload = {"scopes": scopes, "worst_case": reservation.to_json(), **delta_field(delta), **details}
        self._commit(filters, states, event, actor, payload, request_id, now)

    def _commit(
        self,
        filters: list[FilterRow],
        states: list[FilterState],
        event: LedgerEvent,
        actor: str,
        payload: dict[str, Any],
        request_id: str,
        now: datetime | None,
    ) -> None:
        head = filters[0]
        entry = entry_values(
            head.dataset_id, head.last_seq, head.last_hash, event, actor, payload, request_id, now
        )
        for flt, state in zip(filters, states, strict=True):  # nothing above raised: apply it all
            if state is not flt.state:
                flt.state, flt.dirty = state, True
        head.last_seq, head.last_hash, head.dirty = entry["seq"], entry["hash"], True
        self.entries.append(entry)

    # ----- write ---------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Write the changed filter rows and the new ledger entries (two executemany statements)."""
        now = datetime.now(UTC)
        changed = [
            {
                "_id": f.id,
                "spent": f.state.spent.to_json(),
                "reserved": f.state.reserved.to_json(),
                "delta_spent": str(f.state.delta_spent),
                "delta_reserved": str(f.state.delta_reserved),
                "last_seq": f.last_seq,
                "last_hash": f.last_hash,
                "updated_at": now,
            }
            for f in self.rows.values()
            if f.dirty
        ]
        FilterRepository(self.session).write_totals(changed)
        LedgerRepository(self.session).insert_many(self.entries)
        for f in self.rows.values():
            f.dirty = False
        self.entries = []


@dataclass(frozen=True)
class _Stored:
    """A locked row read as a :class:`FilterLike` (for ``state.read``, the strict parser)."""

    row: Any

    @property
    def scope(self) -> str:
        return str(self.row["scope"])

    @property
    def capacity(self) -> list[Any] | None:
        value: list[Any] | None = self.row["capacity"]
        return value

    @property
    def spent(self) -> dict[str, Any]:
        value: dict[str, Any] = self.row["spent"]
        return value

    @property
    def reserved(self) -> dict[str, Any]:
        value: dict[str, Any] = self.row["reserved"]
        return value

    @property
    def delta_capacity(self) -> str | None:
        value: str | None = self.row["delta_capacity"]
        return value

    @property
    def delta_spent(self) -> str:
        return str(self.row["delta_spent"])

    @property
    def delta_reserved(self) -> str:
        return str(self.row["delta_reserved"])
