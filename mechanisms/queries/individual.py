"""Queries under individual accounting: each unit's own shift, the Feldman–Zrnic exclusion, the answer over
the units that may take part (docs/privacy/individual.md#individual-queries).

On a dataset with ``accounting: individual`` the table a mechanism receives is an
:class:`IndividualTable`: the data (its engine) plus the dataset's secret :class:`UnitFilter`. A count,
sum or histogram then

1. asks the engine for every unit's bounded contribution per cell (``aggregate_units``: the same plan as
   the dataset-level release, grouped by unit too);
2. turns each (unit, cell) contribution Δ into an integer bound m on how far the unit moves that
   coordinate of round(f/γ): |Δ|/γ on an exact grid (integer answers), ⌊|Δ|/γ⌋ + 1 otherwise (rounding moves
   by at most one unit more), never above the public per-coordinate bound of Lemma UNIT;
3. charges the unit from its m alone (the mechanism's ``charge``: Laplace Σm/t pure, Gaussian
   ‖m‖²/(2s²) per α), excludes the units whose filter cannot afford it, and sums the rest exactly.

The released answer is the query on the dataset without the excluded units; nothing else about them
leaves (docs/privacy/individual.md#what-is-published).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mechanisms.accounting.individual import UnitCharges, UnitFilter
from mechanisms.base import ParamsError, PublicContext, Table
from mechanisms.data.plan import Aggregation, Sum, UnitAnswer, aggregate_units
from mechanisms.queries.language import (
    AnyQuery,
    CountQuery,
    GridPlan,
    HistogramQuery,
    MeanQuery,
    answer_units,
    evaluate_units,
    query_plan,
    real_sum_value,
)

ChargeFn = Callable[[np.ndarray, np.ndarray, np.ndarray], UnitCharges]
"""(units, per-unit ℓ1 shift, per-unit ℓ2² shift; both in grid units) → the step's charge per unit."""


class IndividualTable(Mapping[str, np.ndarray]):
    """A dataset's table with its secret individual filters: what a run sees on an individual dataset.
    Reading columns goes to ``table``; ``filter`` never leaves the service."""

    def __init__(self, table: Table, unit_filter: UnitFilter) -> None:
        self.table, self.filter = table, unit_filter

    def __getitem__(self, name: str) -> np.ndarray:
        return self.table[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)


def individual_table(ctx: PublicContext, table: Table) -> IndividualTable | None:
    """The table with its units' filters on an individual dataset (None on a dataset-level one). A run on
    an individual dataset without them is a service bug: refused, never computed per dataset."""
    if not ctx.schema.individual:
        return None
    if not isinstance(table, IndividualTable):
        raise RuntimeError("an individual dataset must be run with its individual filters")
    return table


def check_individual_query(query: AnyQuery) -> None:
    """Means are refused on individual datasets (they need a public row count; add/remove has none)."""
    if isinstance(query, MeanQuery):
        raise ParamsError("query.kind", "a mean has no individual analysis yet: release a sum and a count")


@dataclass(frozen=True)
class UnitStep:
    """One release's per-unit outcome: the answer in grid units over the admitted units, the charges of
    the admitted units (what the service adds to their filters) and how many were excluded (secret)."""

    answer_units: np.ndarray
    labels: list[str] | None
    charges: UnitCharges
    excluded: int


class UnitOutcome(Protocol):
    """What a release's per-unit part leaves for the units' filters: the admitted units' charges."""

    @property
    def charges(self) -> UnitCharges: ...


@runtime_checkable
class IndividualMechanism(Protocol):
    """A mechanism with an individual analysis: its release's per-unit part, deterministic (no noise), so
    that the service runs it inside ``run`` and ``expost ledger verify`` replays it to rebuild the units'
    filters from the ledger (docs/privacy/individual.md#unit-state)."""

    def unit_step(self, p: Any, ctx: PublicContext, table: IndividualTable) -> UnitOutcome: ...


@runtime_checkable
class ReleaseDependentUnits(Protocol):
    """An individual mechanism whose units' charges also depend on what it released (noise reduction: the
    level it stopped at, a public part of its output): the replay gives it the stored release."""

    def released_unit_step(
        self, p: Any, ctx: PublicContext, table: IndividualTable, output: Mapping[str, Any]
    ) -> UnitOutcome: ...


def unit_step(
    query: AnyQuery, ctx: PublicContext, table: IndividualTable, plan: GridPlan, charge: ChargeFn
) -> UnitStep:
    """Steps 1–3 of the module docstring for one release of ``query`` on ``plan``'s grid."""
    aggregation, labels = query_plan(query, ctx, plan.grid)
    answer = aggregate_units(table.table, aggregation)
    shifts = _row_shifts(query, aggregation, answer, plan)
    first = np.flatnonzero(np.diff(answer.units, prepend=answer.units[:1] - 1))  # rows sorted by unit
    units = answer.units[first]
    l1 = np.minimum(np.add.reduceat(shifts, first) if shifts.size else shifts, plan.l1_units)
    squares = np.add.reduceat(shifts.astype(np.float64) ** 2, first) if shifts.size else np.zeros(0)
    squares = np.minimum(squares, float(plan.l2_units) ** 2)
    step = charge(units, l1, squares)
    admitted = table.filter.admits(step)
    rows = np.repeat(admitted, np.diff(np.append(first, answer.units.size)))
    values = _coordinates(query, aggregation, answer, rows, len(labels) if labels is not None else 1)
    excluded = int(units.size - int(admitted.sum()))
    return UnitStep(answer_units(values, plan.grid), labels, step.subset(admitted), excluded)


def release_answer(
    query: AnyQuery,
    ctx: PublicContext,
    table: Table,
    plan: GridPlan,
    step: Callable[[IndividualTable], UnitStep],
) -> tuple[np.ndarray, list[str] | None, UnitCharges | None]:
    """A query release's answer in grid units, its labels and, on an individual dataset, the admitted units'
    charges (``step``: the mechanism's ``unit_step`` on the individual table); on any other dataset the
    dataset-level answer and no charges."""
    individual = individual_table(ctx, table)
    if individual is None:
        units, labels = evaluate_units(query, ctx, table, plan)
        return units, labels, None
    result = step(individual)
    return result.answer_units, result.labels, result.charges


def _row_shifts(query: AnyQuery, aggregation: Aggregation, answer: UnitAnswer, plan: GridPlan) -> np.ndarray:
    """m per (unit, cell) row (int64): a bound on how far removing the unit moves that coordinate of
    round(f/γ), capped at the public per-coordinate bound (Lemma UNIT), which also bounds the true change
    (docs/privacy/individual.md#lemma-shift)."""
    bound = max(plan.unit_shifts, default=0)
    if answer.units.size == 0:
        return np.zeros(0, dtype=np.int64)
    if isinstance(query, CountQuery | HistogramQuery) or aggregation.sums[-1].kind == "int_sum":
        return integer_unit_shifts(answer.sums[-1], plan.grid.exponent, bound)
    term = aggregation.sums[-1]
    return real_unit_shifts(answer.sums[0], answer.sums[-1], term, plan.grid.exponent, bound)


def integer_unit_shifts(values: np.ndarray, grid_exponent: int, bound: int) -> np.ndarray:
    """min(⌈|Δ|/γ⌉, bound) per row for integer contributions Δ and γ = 2^grid_exponent: on an exact grid
    (γ ≤ 1) |Δ|/γ is the exact change of round(f/γ); on a coarser one round-half-up moves by at most
    ⌈|Δ|/γ⌉. In doubles while every |Δ| < 2^52 (exact there, γ a power of two), else in exact integers."""
    magnitude = np.abs(np.asarray(values, dtype=np.float64))
    if magnitude.size == 0 or magnitude.max() < 2.0**52:
        return np.minimum(np.ceil(np.ldexp(magnitude, -grid_exponent)), float(bound)).astype(np.int64)
    exact = [_ceil_shift(abs(int(d)), grid_exponent) for d in np.asarray(values).tolist()]
    return np.asarray([min(m, bound) for m in exact], dtype=np.int64)


def real_unit_shifts(
    counts: np.ndarray | float, grid_units: np.ndarray, term: Sum, grid_exponent: int, bound: int
) -> np.ndarray:
    """min(⌊(|Δ| + error)/γ⌋ + 1, bound) per row for a real sum's contribution Δ = c·n + 2^e·U (the unit's
    count n — 0 for a centred block without one — and grid units U): Δ in doubles errs by at most
    2^-50·(|c·n| + |2^e·U|), so the numerator is ≥ |Δ|, and rounding to the grid adds at most one unit."""
    centred = term.center * np.asarray(counts, dtype=np.float64)
    scaled = np.ldexp(np.asarray(grid_units, dtype=np.float64), term.exponent)
    error = (np.abs(centred) + np.abs(scaled)) * 2.0**-50
    steps = np.floor(np.ldexp(np.abs(centred + scaled) + error, -grid_exponent)) + 1.0
    return np.minimum(steps, float(bound)).astype(np.int64)


def _ceil_shift(value: int, exponent: int) -> int:
    """⌈value/2^exponent⌉ for a non-negative integer, exactly."""
    if exponent <= 0:
        return value << -exponent
    return -((-value) >> exponent)


def _coordinates(
    query: AnyQuery, aggregation: Aggregation, answer: UnitAnswer, rows: np.ndarray, n_cells: int
) -> list[Fraction]:
    """The exact answer per coordinate over the admitted rows (the query on the data without the excluded
    units): per-cell sums of the plan's per-(unit, cell) integers, combined as ``true_answer`` does."""
    totals = [_cell_totals(np.asarray(values)[rows], answer.cells[rows], n_cells) for values in answer.sums]
    if isinstance(query, CountQuery | HistogramQuery):
        return [Fraction(v) for v in totals[0]]
    if aggregation.sums[-1].kind == "int_sum":
        return [Fraction(totals[-1][0])]
    return [real_sum_value(aggregation.sums, tuple(t[0] for t in totals))]


def _cell_totals(values: np.ndarray, cells: np.ndarray, n_cells: int) -> list[int]:
    """Exact per-cell sums of integers: in doubles when every partial sum stays below 2^53 (counts), else
    in Python ints (no overflow, no rounding)."""
    if values.dtype == np.int64 and values.size:
        largest = float(np.abs(values.astype(np.float64)).max())  # no int64 overflow at −2^63
        if largest * values.size < 2.0**53:
            weights = values.astype(np.float64)
            return [int(t) for t in np.bincount(cells.astype(np.int64), weights, minlength=n_cells)]
    if values.size == 0:
        return [0] * n_cells
    totals = np.zeros(n_cells, dtype=object)
    totals[:] = 0
    np.add.at(totals, cells.astype(np.int64), values.astype(object))
    return [int(t) for t in totals]
