"""THE FILTER's transactions: the only code that locks filter rows, admits, reserves, settles and chains
the ledger. Lock once, apply in memory, write once, in plain SQL.

Every admission and settlement of a request or a session runs in a batch: the group-commit writer
(``service.runs.writer``) applies many in one database transaction, and every other caller (sessions,
cancel, the reaper, a retried job) submits a batch of one (``service.runs.admission.transact``). A batch

* **locks** with one ``SELECT … FOR UPDATE`` every filter row it touches, ordered by (dataset id, id),
  the global lock order (:meth:`FilterRepository.lock_many`), so admissions on one dataset are serialized
  (docs/privacy/rules.md#rule-serialized-admission, concurrency) and each dataset's ledger chain is linear;
* **applies** each job's check, reserve and settle on the locked rows' :class:`FilterState` (the rule of
  ``service.filter.state``), in arrival order, with the ledger entry built by
  :func:`service.filter.ledger.entry_values`: the hash chain is extended in memory, entry after entry,
  from the head read under the lock;
* **flushes** with one executemany UPDATE of the changed filter rows (totals and chain head) and one
  executemany INSERT of the new ledger entries, in the caller's transaction (which commits them with the
  request rows).

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
from service.errors import NoBudget
from service.filter.individual import UnitUpdate
from service.filter.ledger import Entry, LedgerEvent, entry_values
from service.filter.state import FilterLike, FilterSnapshot, FilterState, read
from service.store.models import DATASET_SCOPE
from service.store.repositories import FilterRepository, LedgerRepository, UnitFilterRepository


class Refused(Exception):
    """Raised under the filter locks, before anything is written, with snapshots of the filters; the
    public refusal is built outside the lock (the affordable value takes ~60 worst-case evaluations)."""

    def __init__(self, blocked: FilterSnapshot, filters: list[FilterSnapshot]) -> None:
        super().__init__("refused")
        self.blocked, self.filters = blocked, filters


def admits(
    flt: FilterLike,
    charge: UnitsVector,
    delta: int = 0,
    individual: bool = False,
    unit_charge: UnitsVector | None = None,
) -> bool:
    """Dataset filters need a budget; an analyst filter without a sub-budget only tracks spending (its
    δ-ledger too: without a sub-budget there is no sub-share to exhaust)."""
    return admits_state(flt.scope, read(flt), charge, delta, individual, unit_charge)


def admits_state(
    scope: str,
    state: FilterState,
    charge: UnitsVector,
    delta: int = 0,
    individual: bool = False,
    unit_charge: UnitsVector | None = None,
) -> bool:
    """:func:`admits` on a state already read (a batch keeps its filters' states in memory). On an
    ``individual`` dataset the dataset filter only asks whether a unit with nothing spent could afford the
    request — or ``unit_charge`` when given: the most one unit pays before its filter can leave it out
    (one step of ``dp_gd``, docs/privacy/individual.md#individual-dp-gd): its totals are a public record
    there, and each unit's own filter decides whether the unit takes part
    (docs/privacy/individual.md#theorem-individual)."""
    if not state.has_budget:
        if scope == DATASET_SCOPE:
            raise NoBudget("this dataset has no privacy budget yet; an admin must PUT one first")
        return True
    if individual and scope == DATASET_SCOPE:
        return state.ever_admits(charge if unit_charge is None else unit_charge, delta)
    return state.admits(charge, delta)


def delta_field(delta: int) -> dict[str, int]:
    """The ledger names δ only for approximate requests, so every earlier entry replays unchanged."""
    return {"delta": delta} if delta else {}


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

    # ----- the transitions ---------------------------------------------------------------------------------

    def check(
        self,
        filters: list[FilterRow],
        charge: UnitsVector,
        delta: int = 0,
        individual: bool = False,
        unit_charge: UnitsVector | None = None,
    ) -> None:
        """Raise :class:`Refused` unless every filter admits ``charge`` and δ units ``delta`` (writes
        nothing; ``individual``, ``unit_charge``: :func:`admits_state`)."""

        def admitted(f: FilterRow) -> bool:
            return admits_state(f.scope, f.state, charge, delta, individual, unit_charge)

        blocked = next((f for f in filters if not admitted(f)), None)
        if blocked is not None:
            raise Refused(blocked.snapshot(), [f.snapshot() for f in filters])

    def units_current(self, update: UnitUpdate) -> bool:
        """Whether the unit state a release was computed on is still the stored one (the caller holds the
        dataset's filter lock, so it stays so until :meth:`write_units`)."""
        return UnitFilterRepository(self.session).version(update.dataset_id) == update.expected

    def write_units(self, update: UnitUpdate) -> None:
        """Store a release's new unit filters (after :meth:`units_current`), in the batch's transaction."""
        UnitFilterRepository(self.session).append(
            update.dataset_id, update.expected, update.base, update.block, datetime.now(UTC)
        )

    def reserve(self, filters: list[FilterRow], charge: UnitsVector, delta: int, entry: Entry) -> None:
        """Add ``charge`` (and δ units ``delta``) to every filter's reservations and append the ``reserve``
        entry (after :meth:`check`)."""
        states = [f.state.reserve(charge, delta) for f in filters]
        payload = {**entry.details, "worst_case": charge.to_json(), **delta_field(delta)}
        self._commit(filters, states, LedgerEvent.RESERVE, payload, entry)

    def settle(
        self,
        filters: list[FilterRow],
        scopes: list[str],
        reservation: UnitsVector,
        realized: UnitsVector | None,
        delta: int,
        entry: Entry,
    ) -> None:
        """Replace ``reservation`` by ``realized`` in the filters of ``scopes`` (``commit``: the reserved δ
        units ``delta`` are spent), or release both when ``realized`` is None (``abort``), and append the
        entry."""
        states = [
            f.state.settle(reservation, realized, delta) if f.scope in scopes else f.state for f in filters
        ]
        event = LedgerEvent.ABORT if realized is None else LedgerEvent.COMMIT
        worst_case = reservation.to_json()
        payload = {"scopes": scopes, "worst_case": worst_case, **delta_field(delta), **entry.details}
        self._commit(filters, states, event, payload, entry)

    def _commit(
        self,
        filters: list[FilterRow],
        states: list[FilterState],
        event: LedgerEvent,
        payload: dict[str, Any],
        about: Entry,
    ) -> None:
        head = filters[0]
        entry = entry_values(head, event, payload, about)
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
