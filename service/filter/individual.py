"""The per-unit filters of individually accounted datasets, as stored (docs/privacy/individual.md#unit-state).

A release on such a dataset is computed under the dataset's **unit lock** (one per dataset and process:
each release's exclusions depend on every earlier release's charges), from the state version the run
read; the settling batch stores the new state only if that version is still the stored one (it holds the
dataset's filter lock), else the release is discarded and settled as a failure (charged its worst case at
the dataset level, nothing to any unit: nothing left the service). So the stored state always equals the
replay of the committed releases in ledger order, and a release never leaves before its units' debit is
durable: the state is written in the transaction that stores the release.

Storage: ``unit_filters`` holds the version; ``unit_filter_blocks`` one block per version: the release's
charges, or every ``BASE_EVERY``-th version the whole state (older blocks are then deleted). A block is Arrow
IPC with zstd (three int64 columns: unit, pure, slope), read back exactly.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import pyarrow as pa
from sqlalchemy.orm import Session

from mechanisms.accounting.individual import UnitCharges, UnitFilter, UnitLedger
from service.store.models import DATASET_SCOPE
from service.store.repositories import FilterRepository, UnitFilterRepository

_COLUMNS = ("unit", "pure", "slope")
BASE_EVERY = 32
"""Every 32nd version stores the whole state (a base block); the others store only the release's charges,
so a release that charges few units writes little. Loading reads the last base and at most 31 deltas."""


def encode(charges: UnitCharges) -> bytes:
    """Arrow IPC (zstd) of (unit, pure, slope): a release's charges or a whole state."""
    table = pa.table(
        [pa.array(charges.units), pa.array(charges.pure), pa.array(charges.slope)], names=_COLUMNS
    )
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def decode(data: bytes) -> UnitCharges:
    table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    if tuple(table.column_names) != _COLUMNS:
        raise ValueError("stored unit filters have unexpected columns")
    units, pure, slope = (table.column(name).to_numpy() for name in _COLUMNS)
    return UnitCharges(units, pure, slope)


def base_version(version: int) -> int:
    """The version of the base block a state of ``version`` starts from (0: the empty state)."""
    return version - version % BASE_EVERY


def read_state(session: Session, dataset_id: str) -> tuple[int, UnitLedger]:
    """(stored version, the units' spent budgets): the last base block plus the deltas after it."""
    units = UnitFilterRepository(session)
    version = units.version(dataset_id)
    start = base_version(version)
    blocks = units.blocks(dataset_id, start - 1 if start else 0, version)
    ledger = UnitLedger.empty()
    expected = start if start else 1
    for number, base, data in blocks:
        if number != expected or base != (number == start and start > 0):
            raise ValueError(f"the unit filters of {dataset_id} are missing version {expected}")
        charges = decode(data)
        ledger = UnitLedger(charges) if base else ledger.charged(charges)
        expected += 1
    if expected != version + 1 and version > 0:
        raise ValueError(f"the unit filters of {dataset_id} end at version {expected - 1}, not {version}")
    return version, ledger


@dataclass(frozen=True)
class UnitUpdate:
    """What a run hands to its settlement: the block of version ``expected + 1`` (the release's charges, or
    the whole new state when that version is a base), valid only on top of ``expected``."""

    dataset_id: str
    expected: int
    block: bytes
    ledger: UnitLedger
    """The new state (this process caches it once the settlement stored it)."""

    @property
    def base(self) -> bool:
        return base_version(self.expected + 1) == self.expected + 1

    @classmethod
    def of(cls, dataset_id: str, expected: int, before: UnitLedger, charges: UnitCharges) -> UnitUpdate:
        after = before.charged(charges)
        base = base_version(expected + 1) == expected + 1
        return cls(dataset_id, expected, encode(after.spent if base else charges), after)


class UnitFilters:
    """Per process: the unit locks and the last state of each dataset (the stored version says whether the
    cached one is current)."""

    def __init__(self, capacity: int = 4) -> None:
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._cache: OrderedDict[str, tuple[int, UnitLedger]] = OrderedDict()
        self.capacity = capacity

    def lock(self, dataset_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(dataset_id, threading.Lock())

    def load(self, session: Session, dataset_id: str, orders: tuple[float, ...]) -> tuple[int, UnitFilter]:
        """(stored version, the dataset's unit filters) read in the caller's transaction: the capacity is
        the dataset filter's (every unit has the dataset's budget)."""
        version = UnitFilterRepository(session).version(dataset_id)
        with self._guard:
            cached = self._cache.get(dataset_id)
        if cached is not None and cached[0] == version:
            ledger = cached[1]
        else:
            version, ledger = read_state(session, dataset_id)
            self.remember(dataset_id, version, ledger)
        head = FilterRepository(session).get(dataset_id, DATASET_SCOPE)
        capacity = tuple(head.capacity) if head is not None and head.capacity is not None else None
        if capacity is None:
            capacity = (None,) * (len(orders) + 1)
        return version, UnitFilter(orders, capacity, ledger)

    def remember(self, dataset_id: str, version: int, ledger: UnitLedger) -> None:
        with self._guard:
            self._cache[dataset_id] = (version, ledger)
            self._cache.move_to_end(dataset_id)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)


UNIT_FILTERS = UnitFilters()
"""This process's unit locks and state cache."""
