"""The filter's semantics, pure: one frozen state and its three transitions. No SQL, no HTTP.

A filter holds, per slot (the dataset's orders α, then the pure slot α = ∞), a capacity B (fixed-point
units, rounded down; None for an unusable slot, and the whole is None while no budget is set), the
realized charges ``spent`` and the worst cases ``reserved`` of requests still running.
docs/privacy/filter.md#filter and docs/privacy/filter.md#proof-of-dp prove the rule:

    admits(w)  ⇔  ∃ usable slot j:  spent[j] + reserved[j] + w[j] ≤ B[j]
    reserve(w):   reserved += w                      (admission, before the data is read)
    settle(w, r): reserved −= w;  spent += r  (r ≤ w)  (commit; r = None releases w: an abort)

An approximate-DP request (docs/privacy/approximate.md#approximate-dp) also carries δ_k on the δ-ledger (exact
units of 10⁻³⁰):
it is admitted only if, in addition, δ_spent + δ_reserved + δ_k ≤ δ_A (the share set aside), and its
commit always spends the δ_k it reserved (no realized δ: the bad event is not observable).

Nothing else ever lowers a charge. The database path (``service.filter.batch``) and the ledger's
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
    filter's role: see :func:`service.filter.batch.admits`)."""

    capacity: tuple[int | None, ...] | None
    spent: UnitsVector
    reserved: UnitsVector
    delta_capacity: int | None = None  # δ_A in units of 10⁻³⁰; None: no approximate-DP requests
    delta_spent: int = 0
    delta_reserved: int = 0

    def __post_init__(self) -> None:
        if len(self.spent) != len(self.reserved):
            raise ValueError("spent and reserved differ in their number of slots")
        if self.capacity is not None and len(self.capacity) != len(self.spent):
            raise ValueError("capacity and totals differ in their number of slots")
        deltas = (
            self.delta_spent,
            self.delta_reserved,
            0 if self.delta_capacity is None else self.delta_capacity,
        )
        if not all(type(d) is int and d >= 0 for d in deltas):
            raise ValueError("δ amounts are non-negative integer units")

    @classmethod
    def empty(cls, slots: int) -> FilterState:
        return cls(None, UnitsVector.zeros(slots), UnitsVector.zeros(slots))

    @property
    def has_budget(self) -> bool:
        return self.capacity is not None

    def fitting_slots(self, charge: UnitsVector) -> list[bool]:
        """Per slot: would spent + reserved + charge stay within capacity?"""
        if self.capacity is None:
            return [False] * len(charge)
        return (self.spent + self.reserved + charge).fits(self.capacity)

    def delta_fits(self, delta: int) -> bool:
        """The δ-ledger half of admission: δ_spent + δ_reserved + δ ≤ δ_A (always true for δ = 0)."""
        if delta == 0:
            return True
        return (
            self.delta_capacity is not None
            and self.delta_spent + self.delta_reserved + delta <= self.delta_capacity
        )

    def admits(self, charge: UnitsVector, delta: int = 0) -> bool:
        """The admission rule with a budget set: some slot fits, and the δ-ledger fits δ."""
        return any(self.fitting_slots(charge)) and self.delta_fits(delta)

    def ever_admits(self, charge: UnitsVector, delta: int = 0) -> bool:
        """Would this filter admit the charge if nothing were spent or reserved?"""
        if self.capacity is None or not any(charge.fits(self.capacity)):
            return False
        return delta == 0 or (self.delta_capacity is not None and delta <= self.delta_capacity)

    def reserve(self, charge: UnitsVector, delta: int = 0) -> FilterState:
        return self._with(self.spent, self.reserved + charge, self.delta_spent, self.delta_reserved + delta)

    def settle(self, reservation: UnitsVector, realized: UnitsVector | None, delta: int = 0) -> FilterState:
        """Replace ``reservation`` by ``realized`` (commit), or drop it when ``realized`` is None (abort).
        ``delta`` (the request's reserved δ) moves to spent on a commit and is released on an abort."""
        if not 0 <= delta <= self.delta_reserved:
            raise ValueError("settling more δ than is reserved")
        reserved = self.reserved - reservation
        if realized is None:
            return self._with(self.spent, reserved, self.delta_spent, self.delta_reserved - delta)
        return self._with(
            self.spent + realized, reserved, self.delta_spent + delta, self.delta_reserved - delta
        )

    def _with(
        self, spent: UnitsVector, reserved: UnitsVector, delta_spent: int, delta_reserved: int
    ) -> FilterState:
        """This filter with new totals (``dataclasses.replace`` without its per-field introspection: the
        batch path applies two of these per filter and request)."""
        return FilterState(self.capacity, spent, reserved, self.delta_capacity, delta_spent, delta_reserved)

    def with_capacity(self, capacity: Sequence[int | None], delta_capacity: int | None = None) -> FilterState:
        return replace(self, capacity=_slots(capacity), delta_capacity=delta_capacity)


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
    @property
    def delta_capacity(self) -> str | None: ...
    @property
    def delta_spent(self) -> str: ...
    @property
    def delta_reserved(self) -> str: ...


@dataclass(frozen=True)
class FilterSnapshot:
    """A copy of a stored filter, taken under its lock (refusals are explained after the lock is gone)."""

    scope: str
    capacity: list[Any] | None
    spent: dict[str, Any]
    reserved: dict[str, Any]
    delta_capacity: str | None = None
    delta_spent: str = "0"
    delta_reserved: str = "0"


def snapshot(flt: FilterLike) -> FilterSnapshot:
    return FilterSnapshot(
        flt.scope,
        flt.capacity,
        dict(flt.spent),
        dict(flt.reserved),
        flt.delta_capacity,
        flt.delta_spent,
        flt.delta_reserved,
    )


def delta_units(text: str | None) -> int | None:
    """A stored δ amount (decimal digits) as exact units; strict: no sign, no fraction, no exponent."""
    if text is None:
        return None
    if not (isinstance(text, str) and text.isascii() and text.isdigit()):
        raise ValueError(f"a stored δ amount must be decimal digits, got {text!r}")
    return int(text)


def read(flt: FilterLike) -> FilterState:
    """The pure state of a stored filter (its cached totals, strictly parsed)."""
    return FilterState(
        None if flt.capacity is None else _slots(flt.capacity),
        UnitsVector.from_json(flt.spent),
        UnitsVector.from_json(flt.reserved),
        delta_units(flt.delta_capacity),
        delta_units(flt.delta_spent) or 0,
        delta_units(flt.delta_reserved) or 0,
    )
