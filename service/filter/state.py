"""The filter's semantics, pure: one frozen state and its three transitions. No SQL, no HTTP.

A filter holds, per slot (the dataset's orders α, then the pure slot α = ∞), a capacity B (fixed-point
units, rounded down; an unusable slot's is None; the whole is None while no budget is set), the realized charges ``spent`` and the worst cases
``reserved`` of requests still running. docs/privacy.md §2–§3 prove the rule:

    admits(w)  ⇔  ∃ usable slot j:  spent[j] + reserved[j] + w[j] ≤ B[j]
    reserve(w):   reserved += w                      (admission, before the data is read)
    settle(w, r): reserved −= w;  spent += r  (r ≤ w)  (commit; r = None releases w: an abort)

Nothing else ever lowers a charge. The database path (``service.filter.budget``) and the ledger's
replay (``service.filter.ledger.verify``) both apply exactly these functions, so the cached totals on a
filter row and the totals rebuilt from the ledger cannot follow different rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from mechanisms.accounting import UnitsVector


@dataclass(frozen=True)
class FilterState:
    """One filter's totals. ``capacity`` None means no budget is set (admission then depends on the
    filter's role: see :func:`service.filter.admission.admits`)."""

    capacity: tuple[int | None, ...] | None
    spent: UnitsVector
    reserved: UnitsVector

    def __post_init__(self) -> None:
        if len(self.spent) != len(self.reserved):
            raise ValueError("spent and reserved differ in their number of slots")
        if self.capacity is not None and len(self.capacity) != len(self.spent):
            raise ValueError("capacity and totals differ in their number of slots")

    @classmethod
    def empty(cls, slots: int) -> FilterState:
        return cls(None, UnitsVector.zeros(slots), UnitsVector.zeros(slots))

    @classmethod
    def of(
        cls, capacity: Sequence[int | None] | None, spent: UnitsVector, reserved: UnitsVector
    ) -> FilterState:
        return cls(None if capacity is None else _slots(capacity), spent, reserved)

    @property
    def has_budget(self) -> bool:
        return self.capacity is not None

    def fitting_slots(self, charge: UnitsVector) -> list[bool]:
        """Per slot: would spent + reserved + charge stay within capacity?"""
        if self.capacity is None:
            return [False] * len(charge)
        return (self.spent + self.reserved + charge).fits(self.capacity)

    def admits(self, charge: UnitsVector) -> bool:
        """The admission rule with a budget set (some slot fits)."""
        return any(self.fitting_slots(charge))

    def ever_admits(self, charge: UnitsVector) -> bool:
        """Would this filter admit the charge if nothing were spent or reserved?"""
        return self.capacity is not None and any(charge.fits(self.capacity))

    def reserve(self, charge: UnitsVector) -> FilterState:
        return replace(self, reserved=self.reserved + charge)

    def settle(self, reservation: UnitsVector, realized: UnitsVector | None) -> FilterState:
        """Replace ``reservation`` by ``realized`` (commit), or drop it when ``realized`` is None (abort)."""
        reserved = self.reserved - reservation
        spent = self.spent if realized is None else self.spent + realized
        return replace(self, spent=spent, reserved=reserved)

    def with_capacity(self, capacity: Sequence[int | None]) -> FilterState:
        return replace(self, capacity=_slots(capacity))


def _slots(capacity: Sequence[int | None]) -> tuple[int | None, ...]:
    """Strict: a capacity entry is an int (units) or None (an unusable slot), never a float."""
    if not all(c is None or type(c) is int for c in capacity):
        raise ValueError("capacity entries must be integer units or null")
    return tuple(capacity)


class FilterLike(Protocol):
    """What the filter rule reads of a stored filter: a database row, or a snapshot taken under its lock."""

    @property
    def scope(self) -> str: ...
    @property
    def capacity(self) -> list[Any] | None: ...
    @property
    def spent(self) -> dict[str, Any]: ...
    @property
    def reserved(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class FilterSnapshot:
    """A copy of a stored filter, taken under its lock (refusals are explained after the lock is gone)."""

    scope: str
    capacity: list[Any] | None
    spent: dict[str, Any]
    reserved: dict[str, Any]


def snapshot(flt: FilterLike) -> FilterSnapshot:
    return FilterSnapshot(flt.scope, flt.capacity, dict(flt.spent), dict(flt.reserved))


def read(flt: FilterLike) -> FilterState:
    """The pure state of a stored filter (its cached totals, strictly parsed)."""
    return FilterState.of(flt.capacity, UnitsVector.from_json(flt.spent), UnitsVector.from_json(flt.reserved))
