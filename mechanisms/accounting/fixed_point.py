"""Exact ledger arithmetic in fixed-point units of 1e-12 ε.

Charges are rounded **up** and capacities **down**, so rounding can only refuse, never over-admit.
Conversion goes through the shortest decimal that round-trips the float (``repr``): the pure ε = 0.1 an
analyst types is exactly 10¹¹ units, and ten of them are exactly one ε (no OpenDP #2131 drift). Every
float value is then treated as that decimal; mechanisms calibrate their noise so that their true loss is
at most the decimal they are charged (see ``mechanisms.queries.laplace``), and computed curves are padded up
by a few ulps before conversion (``curve.pad_up``).

+∞ has its own representation: a total is a pair (finite units, number of infinite charges), which is
exact under addition and subtraction, so releasing an infinite reservation restores the previous total.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from functools import lru_cache

from mechanisms.accounting.curve import RdpCurve

UNITS_PER_EPSILON = 10**12


def _to_units(value: float, rounding: str) -> int:
    scaled = Decimal(repr(float(value))).scaleb(12)
    return int(scaled.to_integral_value(rounding=rounding))


def units_up(value: float) -> int | None:
    """Charge in units, rounded up; ``None`` for +∞."""
    if math.isnan(value) or value < 0:
        raise ValueError(f"a charge must be ≥ 0, got {value!r}")
    return None if math.isinf(value) else _to_units(value, ROUND_CEILING)


def units_down(value: float) -> int:
    """Capacity in units, rounded down (may be negative: such an order is unusable)."""
    if not math.isfinite(value):
        raise ValueError(f"a capacity must be finite, got {value!r}")
    return _to_units(value, ROUND_FLOOR)


def units_to_epsilon(units: int) -> float:
    return units / UNITS_PER_EPSILON


@lru_cache(maxsize=4096)
def _charge_units(values: tuple[float, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    units = [units_up(v) for v in values]
    return tuple(u or 0 for u in units), tuple(int(u is None) for u in units)


@dataclass(frozen=True)
class UnitsVector:
    """Per-slot totals: ``finite[j]`` units plus ``infinite[j]`` charges of +∞ (value is ∞ iff > 0).

    Slots are the orders of the grid followed by the pure slot (α = ∞).
    """

    finite: tuple[int, ...]
    infinite: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.finite) != len(self.infinite):
            raise ValueError("finite and infinite parts differ in length")
        if min(self.infinite, default=0) < 0:
            raise ValueError("negative count of infinite charges")

    @classmethod
    def zeros(cls, slots: int) -> UnitsVector:
        return cls((0,) * slots, (0,) * slots)

    @classmethod
    def charge(cls, curve: RdpCurve) -> UnitsVector:
        """The fixed-point charge of ``curve``: every order, then the pure bound, each rounded up."""
        return cls(*_charge_units((*curve.values, curve.pure)))

    def __len__(self) -> int:
        return len(self.finite)

    def __add__(self, other: UnitsVector) -> UnitsVector:
        self._same_slots(other)
        return UnitsVector(
            tuple(map(operator.add, self.finite, other.finite)),
            tuple(map(operator.add, self.infinite, other.infinite)),
        )

    def __sub__(self, other: UnitsVector) -> UnitsVector:
        """Exact inverse of ``+``: used only to release a reservation that was added before."""
        self._same_slots(other)
        result = UnitsVector(
            tuple(map(operator.sub, self.finite, other.finite)),
            tuple(map(operator.sub, self.infinite, other.infinite)),
        )
        if min(result.finite, default=0) < 0:
            raise ValueError("subtracting more than the total")
        return result

    def _same_slots(self, other: UnitsVector) -> None:
        if len(self.finite) != len(other.finite):  # each vector's two parts have one length
            raise ValueError(f"slot counts differ: {len(self.finite)} and {len(other.finite)}")

    def is_infinite(self, slot: int) -> bool:
        return self.infinite[slot] > 0

    def epsilon(self, slot: int) -> float:
        return math.inf if self.is_infinite(slot) else units_to_epsilon(self.finite[slot])

    def fits(self, capacity: Sequence[int | None]) -> list[bool]:
        """Per slot: is this total ≤ the capacity (``None`` = unusable slot)?"""
        return [
            cap is not None and not self.is_infinite(j) and self.finite[j] <= cap
            for j, cap in enumerate(capacity)
        ]

    def to_json(self) -> dict[str, list[int]]:
        return {"finite": list(self.finite), "infinite": list(self.infinite)}

    def __le__(self, other: UnitsVector) -> bool:
        """Slot by slot: an infinite value is ≤ only another infinite one."""
        self._same_slots(other)
        if not any(self.infinite) and not any(other.infinite):  # the common case: all finite
            return all(map(operator.le, self.finite, other.finite))
        return all(
            (b_inf > 0) or (a_inf == 0 and a <= b)
            for a, a_inf, b, b_inf in zip(
                self.finite, self.infinite, other.finite, other.infinite, strict=True
            )
        )

    @classmethod
    def from_json(cls, data: dict[str, list[int]]) -> UnitsVector:
        """Strict: every entry must be an int (never a float that ``int()`` would truncate)."""
        finite, infinite = data["finite"], data["infinite"]
        if not all(type(x) is int for x in (*finite, *infinite)):
            raise ValueError("units must be integers")
        return cls(tuple(finite), tuple(infinite))
