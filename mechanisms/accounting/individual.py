"""Individual Rényi filters (Feldman & Zrnic 2021): every privacy unit carries its own filter.

The proof is docs/privacy/individual.md#theorem-individual (Theorem INDIVIDUAL); this module is its
arithmetic. Everything here is **secret**: a unit's spent budget is a function of its data.

A unit's spent curve is kept in two exact integers of ledger units (1e-12 ε, rounded up on every charge):

    spent_u(α) = pure_u + α · slope_u          at every order α of the dataset's grid,
    spent_u(∞) = pure_u if slope_u = 0 else +∞ (the pure slot).

Every charge the supported families make per unit has this shape: a pure ε (Laplace, noise reduction:
D_α ≤ D_∞ ≤ ε at every α) adds to ``pure``, a Gaussian α·‖c‖²/(2σ²) adds ‖c‖²/(2σ²) to ``slope``. The sum
of such curves has the same shape, so two numbers per unit are the whole per-order state, exactly.

**The Feldman–Zrnic rule** (:meth:`UnitFilter.admits`): a step runs on unit u only if some usable slot j
of the dataset's capacity B has spent_u(α_j) + charge_u(α_j) ≤ B_j, where charge_u is u's own charge for
this step (a function of u's rows and public parameters). Units that fail are **excluded before the
computation**: the step is computed as if they were absent, and they are charged nothing. The pure slot is
compared exactly in integers; the orders in doubles padded **up** (the charge side) and **down** (the
capacity side) by 2^-48 relative, so rounding can only exclude, never admit an over-budget unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PAD = 2.0**-48
"""Relative padding of the double comparison (each double operation errs by ≤ 2^-53 relative)."""
MAX_UNITS_CHARGE = 2**60
"""Per-unit totals are clamped here (far above any capacity): an over-large charge only excludes."""


def _int64(values: np.ndarray | Sequence[int]) -> np.ndarray:
    array = np.asarray(values, dtype=np.int64)
    if array.ndim != 1 or (array.size and int(array.min()) < 0):
        raise ValueError("per-unit amounts are non-negative integer ledger units")
    return array


@dataclass(frozen=True)
class UnitCharges:
    """One step's charge per unit: ``units`` sorted and unique, ``pure`` and ``slope`` in ledger units."""

    units: np.ndarray
    pure: np.ndarray
    slope: np.ndarray

    def __post_init__(self) -> None:
        units = np.asarray(self.units, dtype=np.int64)
        object.__setattr__(self, "units", units)
        object.__setattr__(self, "pure", _int64(self.pure))
        object.__setattr__(self, "slope", _int64(self.slope))
        if not (units.size == self.pure.size == self.slope.size):
            raise ValueError("units, pure and slope differ in length")
        if units.size > 1 and not bool(np.all(units[1:] > units[:-1])):
            raise ValueError("units must be sorted and unique")

    @classmethod
    def empty(cls) -> UnitCharges:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))

    def __len__(self) -> int:
        return int(self.units.size)

    def subset(self, mask: np.ndarray) -> UnitCharges:
        return UnitCharges(self.units[mask], self.pure[mask], self.slope[mask])


@dataclass(frozen=True)
class UnitLedger:
    """The spent budgets of every unit charged so far (units never charged have spent 0)."""

    spent: UnitCharges

    @classmethod
    def empty(cls) -> UnitLedger:
        return cls(UnitCharges.empty())

    def __len__(self) -> int:
        return len(self.spent)

    def of(self, units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(pure, slope) spent by each of ``units`` (sorted, unique; 0 for a unit never charged)."""
        position, hit = _positions(self.spent.units, units)
        if hit.all():
            return self.spent.pure[position], self.spent.slope[position]
        pure = np.zeros(units.size, dtype=np.int64)
        slope = np.zeros(units.size, dtype=np.int64)
        pure[hit] = self.spent.pure[position[hit]]
        slope[hit] = self.spent.slope[position[hit]]
        return pure, slope

    def charged(self, step: UnitCharges) -> UnitLedger:
        """This ledger plus ``step`` (exact integer addition, clamped at ``MAX_UNITS_CHARGE``). Both unit
        lists are sorted: units new to the ledger are merged in with one stable (radix) sort."""
        if len(step) == 0:
            return self
        position, hit = _positions(self.spent.units, step.units)
        if hit.all():  # every unit charged before: add in place on copies
            pure, slope = self.spent.pure.copy(), self.spent.slope.copy()
            pure[position] = np.minimum(pure[position] + step.pure, MAX_UNITS_CHARGE)
            slope[position] = np.minimum(slope[position] + step.slope, MAX_UNITS_CHARGE)
            return UnitLedger(UnitCharges(self.spent.units, pure, slope))
        units = np.sort(np.concatenate([self.spent.units, step.units[~hit]]), kind="stable")
        pure = np.zeros(units.size, dtype=np.int64)
        slope = np.zeros(units.size, dtype=np.int64)
        for part in (self.spent, step):
            where = np.searchsorted(units, part.units)
            pure[where] = np.minimum(pure[where] + part.pure, MAX_UNITS_CHARGE)
            slope[where] = np.minimum(slope[where] + part.slope, MAX_UNITS_CHARGE)
        return UnitLedger(UnitCharges(units, pure, slope))


def _positions(known: np.ndarray, units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of ``units`` sits in ``known`` (both sorted, unique) and whether it is there at all; the
    same list (a query over every unit charged before) is recognised without a search."""
    if units.size == known.size and np.array_equal(units, known):
        return np.arange(units.size), np.ones(units.size, dtype=bool)
    position = np.searchsorted(known, units)
    inside = position < known.size
    hit = np.zeros(units.size, dtype=bool)
    hit[inside] = known[position[inside]] == units[inside]
    return position, hit


@dataclass(frozen=True)
class UnitFilter:
    """A dataset's individual filters: the public grid (``orders`` and per-slot ``capacity``, the
    dataset's budget: orders then the pure slot; None for an unusable slot) and the secret ``ledger``."""

    orders: tuple[float, ...]
    capacity: tuple[int | None, ...]
    ledger: UnitLedger

    def __post_init__(self) -> None:
        if len(self.capacity) != len(self.orders) + 1:
            raise ValueError("capacity has one slot per order plus the pure slot")

    def admits(self, step: UnitCharges) -> np.ndarray:
        """Per unit of ``step``: may it take part (the Feldman–Zrnic rule, module docstring)?

        A unit whose total has no slope (only pure charges) has the same spent value at every slot, so it
        fits some slot iff its pure total is ≤ the largest usable capacity: one exact integer comparison.
        The others are compared order by order in padded doubles."""
        pure, slope = self.ledger.of(step.units)
        total_pure = pure + step.pure
        total_slope = slope + step.slope
        flat = total_slope == 0
        usable = [c for c in self.capacity if c is not None and c >= 0]
        fits: np.ndarray = flat & (total_pure <= max(usable, default=-1))
        curved = np.flatnonzero(~flat)
        if curved.size == 0:
            return fits
        curved_pure = total_pure[curved].astype(np.float64)
        curved_slope = total_slope[curved].astype(np.float64)
        curved_fits = np.zeros(curved.size, dtype=bool)
        for alpha, cap in zip(self.orders, self.capacity[:-1], strict=True):
            if cap is None or cap < 0:
                continue
            need = (curved_pure + alpha * curved_slope) * (1.0 + PAD)
            curved_fits |= need <= float(cap) * (1.0 - PAD)
        fits[curved] = curved_fits
        return fits

    def after(self, step: UnitCharges) -> UnitFilter:
        return UnitFilter(self.orders, self.capacity, self.ledger.charged(step))


def pure_units(shift_units: np.ndarray, units_per_shift: float) -> np.ndarray:
    """⌈shift · units_per_shift⌉ padded up (a per-unit pure ε in ledger units), for integer ``shift_units``
    (grid units) and ``units_per_shift`` ≥ the exact ledger units per grid unit (1e12/t, rounded up)."""
    scaled = np.asarray(shift_units, dtype=np.float64) * units_per_shift * (1.0 + PAD)
    return np.minimum(np.ceil(scaled), float(MAX_UNITS_CHARGE)).astype(np.int64)


def slope_units(square_units: np.ndarray, units_per_square: float) -> np.ndarray:
    """⌈‖c‖² · units_per_square⌉ padded up: a Gaussian step's α-slope per unit in ledger units, with
    ``units_per_square`` ≥ 1e12/(2σ²) (σ in the same units as c)."""
    scaled = np.asarray(square_units, dtype=np.float64) * units_per_square * (1.0 + PAD)
    return np.minimum(np.ceil(scaled), float(MAX_UNITS_CHARGE)).astype(np.int64)
