"""One small aggregation plan, built from public parameters only, that every engine executes exactly.

A mechanism never reads rows: it asks for an :class:`Aggregation` — a filter (``where``), a dense cell grid
(``keys``) and a few per-cell **integer** sums (``sums``) — and gets back, per sum, one Python integer per
cell. The plan is a function of the request's public parameters and the public schema, so building it reads
no data; the engines (``evaluate_numpy`` below, the reference; DuckDB and Spark in ``service.engines``) must
return **identical integers**, which is what lets the grid argument of docs/privacy/engines.md#lemma-engine
(Lemma ENGINE) hold for every engine at once.

Per-row semantics (each is a deterministic function of one row, so between neighbouring datasets only the
differing row's contribution changes — the stability the sensitivity proofs need):

* Every numeric value is first clipped to its column's declared ``[low, high]`` (snapshots are already
  clipped; clipping again in the plan is free and keeps a bad snapshot from widening a bound). Values are
  never NaN (snapshots reject them).
* ``count``: 1 per selected row. ``int_sum``: the clipped int64 value, summed exactly (unbounded integers).
  ``distinct_units``: per cell, the number of distinct values of ``column`` (the privacy unit) among the
  selected (and bounded) rows of that cell; a unit adds 1 to each cell its rows reach, a function of that
  unit's rows alone (docs/privacy/units_learners.md#count-distinct-unit).
* ``grid_sum``: the row unit ``u(x) = round_half_up(fl(y)·2^-exponent)`` of ``y = x − center`` (or
  ``(x − center)²`` when ``square``), every step an IEEE-754 double operation (subtraction, product,
  multiplication by a power of two) that NumPy, DuckDB and Spark perform identically, then summed exactly.
  round_half_up(s) = ⌊s⌋ + [s − ⌊s⌋ ≥ ½], exact in doubles for |s| < 2^52 (``grid_bits`` guarantees it).
* Predicates compare clipped values with exact rational semantics, normalised by :func:`normalise` so that
  every engine compares a double with a double (or an integer with an integer).
* Keys: ``code`` (a categorical code or an int value minus ``offset``, in ``[0, size)``) or ``bucket``
  (:class:`Bucket`: the number of public candidates strictly below the value, computed from an approximate
  index and one exact correction on each side).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from mechanisms.data.schema import ORDER_COLUMN as ORDER_COLUMN
from mechanisms.data.schema import CategoricalColumn, DatasetSchema, FloatColumn, IntColumn

MAX_ROW_UNITS_BITS = 52
"""|row units| < 2^52: the round-half-up of a double below 2^52 is exact (x − ⌊x⌋ is exact there)."""
MIN_FINE_BITS = 7
"""A grid sum's row units are at least 2^7 times finer than the release grid: the rounding of rows adds at
most 2^-7 < 1/64 release units to a neighbour's change (docs/privacy/engines.md#lemma-engine)."""
MAX_FINE_BITS = 20

Op = Literal["eq", "ne", "lt", "le", "gt", "ge", "in", "true", "false"]


@dataclass(frozen=True)
class Predicate:
    """``column op values`` on the clipped column; ``values`` are codes (categorical), ints (int columns)
    or doubles (float columns), already normalised (:func:`normalise`); ``true``/``false`` are constants."""

    column: str
    op: Op
    values: tuple[int | float, ...] = ()


@dataclass(frozen=True)
class Bucket:
    """Bucket of a numeric value among sorted public ``candidates`` (length K ≥ 1): an integer in [0, K].

    j0 = min(max(⌈fl(fl(x − low)·inverse)⌉, 0), K) (double operations), then
    b = j0 − [j0 ≥ 1 and x ≤ c[j0 − 1]] + [j0 ≤ K − 1 and c[j0] < x].
    b equals #{j : c_j < x} whenever the approximate index j0 is within one of it (always, for candidates
    evenly spaced well above the double resolution; docs/mechanisms/analytics.md). Either way it is a
    function of the row alone, which is all the quantile's sensitivity argument needs.
    """

    low: float
    inverse: float
    candidates: tuple[float, ...]

    @property
    def size(self) -> int:
        return len(self.candidates) + 1


@dataclass(frozen=True)
class Key:
    """One group-by dimension: ``code`` (value − offset ∈ [0, size)) or ``bucket``."""

    column: str
    size: int
    offset: int = 0
    bucket: Bucket | None = None


@dataclass(frozen=True)
class Sum:
    """One per-cell integer aggregate (module docstring)."""

    kind: Literal["count", "int_sum", "grid_sum", "distinct_units"]
    column: str | None = None
    center: float = 0.0
    square: bool = False
    exponent: int = 0


@dataclass(frozen=True)
class UnitBound:
    """Contribution bounding: after ``where``, each privacy unit (rows sharing ``column``) keeps its first
    ``max_rows`` rows in the order of ``ORDER_COLUMN``, ties broken by the plan's other columns (rows equal
    in all of them are interchangeable: every aggregate is the same whichever is kept). Which rows a unit
    keeps depends on that unit's rows alone (and the secret), so bounding is a stable transformation: one
    unit added or removed changes at most ``max_rows`` rows of the bounded table, all of that unit
    (docs/privacy/units.md#units)."""

    column: str
    max_rows: int


@dataclass(frozen=True)
class Aggregation:
    """where → (unit bounding) → cells (the product of the keys, row-major) → per-cell integer sums."""

    where: tuple[Predicate, ...] = ()
    keys: tuple[Key, ...] = ()
    sums: tuple[Sum, ...] = (Sum("count"),)
    bounds: tuple[tuple[str, float, float], ...] = field(default=())
    """(column, low, high) of every numeric column the plan reads: clipped to these in the plan."""
    unit: UnitBound | None = None

    @property
    def n_cells(self) -> int:
        return math.prod(key.size for key in self.keys)

    def columns(self) -> tuple[str, ...]:
        """The columns the plan reads (projection)."""
        names = [p.column for p in self.where if p.op not in ("true", "false")]
        names += [k.column for k in self.keys] + [s.column for s in self.sums if s.column is not None]
        if self.unit is not None:
            names += [self.unit.column, ORDER_COLUMN]
        return tuple(dict.fromkeys(names))

    def tie_columns(self) -> tuple[str, ...]:
        """The columns that break ties of ``ORDER_COLUMN`` within a unit: the plan's other columns."""
        skip = (ORDER_COLUMN,) if self.unit is None else (ORDER_COLUMN, self.unit.column)
        return tuple(c for c in self.columns() if c not in skip)

    def bound(self, column: str) -> tuple[float, float] | None:
        return next(((low, high) for name, low, high in self.bounds if name == column), None)


Answer = tuple[tuple[int, ...], ...]
"""Per sum of the plan, one exact integer per cell."""


@runtime_checkable
class Scanner(Protocol):
    """A table that an engine scans: ``aggregate`` runs a plan where the data is."""

    def aggregate(self, plan: Aggregation) -> Answer: ...


# ----- building plans from the public schema --------------------------------------------------------------
def clip_bounds(schema: DatasetSchema, names: Sequence[str]) -> tuple[tuple[str, float, float], ...]:
    """(column, low, high) for the numeric columns among ``names``."""
    out = []
    for name in dict.fromkeys(names):
        column = schema.column(name)
        if isinstance(column, FloatColumn | IntColumn):
            out.append((name, float(column.min), float(column.max)))
    return tuple(out)


def normalise(
    column: FloatColumn | IntColumn | CategoricalColumn, op: str, values: Sequence[int | float | str]
) -> Predicate:
    """The predicate with exact semantics on the clipped column, in a form every engine evaluates alike.

    Categorical: codes. Int columns (values within ±2^53): x op v with v rational becomes an integer
    comparison (x < v ⟺ x < ⌈v⌉, x ≤ v ⟺ x ≤ ⌊v⌋, …; = and ∈ keep integral values only). Float columns: v
    is a double already (the query model admits finite floats and ints; an int beyond the column's range
    is replaced by a constant outcome, one inside it is an exact double since |bounds| ≤ 1e15)."""
    if isinstance(column, CategoricalColumn):
        codes = tuple(column.values.index(str(v)) for v in values)
        return Predicate(column.name, "in" if op == "in" else op, codes)  # type: ignore[arg-type]
    low, high = Fraction(column.min), Fraction(column.max)
    exact = [Fraction(v) for v in values if not isinstance(v, str)]
    integral = isinstance(column, IntColumn)
    if op in ("eq", "in", "ne"):
        kept = [v for v in exact if low <= v <= high and (not integral or v.denominator == 1)]
        if not kept:
            return Predicate(column.name, "true" if op == "ne" else "false")
        converted = tuple(_as_value(column, v) for v in kept)
        return Predicate(column.name, "ne" if op == "ne" else ("eq" if op == "eq" else "in"), converted)
    v = exact[0]
    if integral:
        if op in ("lt", "ge"):
            v = Fraction(math.ceil(v))
        else:
            v = Fraction(math.floor(v))
    always = _constant_outcome(op, v, low, high)
    if always is not None:
        return Predicate(column.name, "true" if always else "false")
    return Predicate(column.name, op, (_as_value(column, v),))  # type: ignore[arg-type]


def _as_value(column: FloatColumn | IntColumn, v: Fraction) -> int | float:
    if isinstance(column, IntColumn):
        return int(v)
    as_float = float(v)
    if Fraction(as_float) != v:  # the query model only admits doubles and ints ≤ 2^53 in range
        raise ValueError("a comparison value is not an exact double")
    return as_float


def _constant_outcome(op: str, v: Fraction, low: Fraction, high: Fraction) -> bool | None:
    """The outcome of ``x op v`` for every x in [low, high] when it is the same for all, else None."""
    outcomes = {
        "lt": (low < v, high < v),
        "le": (low <= v, high <= v),
        "gt": (low > v, high > v),
        "ge": (low >= v, high >= v),
    }[op]
    return outcomes[0] if outcomes[0] == outcomes[1] else None


def floor_log2(value: Fraction) -> int:
    """⌊log2(value)⌋ of a positive rational, exactly."""
    exponent = value.numerator.bit_length() - value.denominator.bit_length()
    if Fraction(2) ** exponent > value:
        exponent -= 1
    return exponent


def grid_bits(magnitude: Fraction, unit: Fraction) -> int:
    """The row-unit exponent e of a grid sum: 2^e ≤ unit·2^-7 (``MIN_FINE_BITS``), as fine as
    ``MAX_FINE_BITS`` allows while |y|/2^e < 2^52 for every |y| ≤ magnitude.

    ``unit`` is the release grid's size divided by what the sum is later divided by (the public n of a
    mean), so the rounding of the rows moves a released coordinate by at most 2^-7 release units (Lemma
    ENGINE). Raises ValueError when no such exponent exists (a bound too wide for its grid)."""
    coarsest = floor_log2(unit) - MIN_FINE_BITS
    exponent = coarsest - (MAX_FINE_BITS - MIN_FINE_BITS)
    while magnitude >= Fraction(2) ** (exponent + MAX_ROW_UNITS_BITS):
        exponent += 1
    if exponent > coarsest:
        raise ValueError("the declared bound is too wide for the release grid")
    return exponent


# ----- the reference engine: NumPy on columns in memory ---------------------------------------------------
def round_half_up(scaled: np.ndarray) -> np.ndarray:
    """⌊s⌋ + [s − ⌊s⌋ ≥ ½] as int64 (exact for |s| < 2^52)."""
    whole = np.floor(scaled)
    result: np.ndarray = whole.astype(np.int64) + ((scaled - whole) >= 0.5)
    return result


def _clipped(plan: Aggregation, table: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    data = np.asarray(table[name])
    bound = plan.bound(name)
    if bound is None:
        return data
    low, high = bound
    if data.dtype.kind in "iu":
        return np.clip(data.astype(np.int64), int(low), int(high))
    return np.clip(data.astype(np.float64), low, high)


def _mask(plan: Aggregation, table: Mapping[str, np.ndarray], n_rows: int) -> np.ndarray:
    mask = np.ones(n_rows, dtype=bool)
    for predicate in plan.where:
        if predicate.op == "true":
            continue
        if predicate.op == "false":
            return np.zeros(n_rows, dtype=bool)
        data = _clipped(plan, table, predicate.column)
        values = np.asarray(predicate.values)
        if predicate.op == "in":
            mask &= np.isin(data, values)
        else:
            compare = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
                       "gt": np.greater, "ge": np.greater_equal}[predicate.op]  # fmt: skip
            mask &= compare(data, values[0])
    return mask


def bucket_of(bucket: Bucket, values: np.ndarray) -> np.ndarray:
    """:class:`Bucket`'s index of every value (int64), with the double operations the engines use."""
    x = np.asarray(values, dtype=np.float64)
    k = len(bucket.candidates)
    candidates = np.asarray(bucket.candidates, dtype=np.float64)
    j0 = np.clip(np.ceil((x - bucket.low) * bucket.inverse), 0, k).astype(np.int64)
    below = np.concatenate([[-np.inf], candidates])[j0]  # c[j0 − 1], −∞ for j0 = 0
    at = np.concatenate([candidates, [np.inf]])[j0]  # c[j0], +∞ for j0 = K
    result: np.ndarray = j0 - (x <= below) + (at < x)
    return result


def _cells(plan: Aggregation, table: Mapping[str, np.ndarray], n_rows: int) -> np.ndarray:
    cell = np.zeros(n_rows, dtype=np.int64)
    for key in plan.keys:
        data = _clipped(plan, table, key.column)
        index = bucket_of(key.bucket, data) if key.bucket is not None else data.astype(np.int64) - key.offset
        cell = cell * key.size + index
    return cell


def _row_values(s: Sum, plan: Aggregation, table: Mapping[str, np.ndarray], n_rows: int) -> np.ndarray:
    if s.kind == "count":
        return np.ones(n_rows, dtype=np.int64)
    data = _clipped(plan, table, str(s.column))
    if s.kind == "int_sum":
        return data.astype(np.int64)
    y = data.astype(np.float64) - s.center
    if s.square:
        y = y * y
    return round_half_up(np.ldexp(y, -s.exponent))


def _exact_sums(values: np.ndarray, cell: np.ndarray, n_cells: int) -> tuple[int, ...]:
    """Σ values per cell, exact: each int64 value is split into 32-bit halves, whose per-cell int64 sums
    cannot overflow for fewer than 2^31 rows (the in-memory engine only serves small tables)."""
    if values.size >= 1 << 31:
        raise ValueError("too many rows for the in-memory engine")
    low = values & 0xFFFFFFFF  # in [0, 2^32)
    high = values >> 32  # values = high·2^32 + low (arithmetic shift), |high| < 2^31
    sums_low = np.zeros(n_cells, dtype=np.int64)
    sums_high = np.zeros(n_cells, dtype=np.int64)
    np.add.at(sums_low, cell, low)
    np.add.at(sums_high, cell, high)
    return tuple(int(a) + (int(b) << 32) for a, b in zip(sums_low.tolist(), sums_high.tolist(), strict=True))


def unit_starts(units_sorted: np.ndarray) -> np.ndarray:
    """Index of the first row of each unit in an array of unit ids sorted by unit (empty for no rows)."""
    if units_sorted.size == 0:
        return np.zeros(0, dtype=np.int64)
    result: np.ndarray = np.flatnonzero(np.concatenate([[True], units_sorted[1:] != units_sorted[:-1]]))
    return result


def _unit_order(units: np.ndarray, order_key: np.ndarray, ties: Sequence[np.ndarray]) -> np.ndarray:
    """The permutation sorting rows by (unit, ``order_key``, ``ties``…), stable: ``np.lexsort`` on (unit,
    order key), then only the rows tied on both (duplicate rows, in practice) re-sorted by the tie keys
    within their group — the same permutation as one lexsort over every key, without sorting all rows by
    all columns."""
    order: np.ndarray = np.lexsort([order_key, units])  # the last key is the primary one
    if not ties or order.size < 2:
        return order
    same = (units[order][1:] == units[order][:-1]) & (order_key[order][1:] == order_key[order][:-1])
    if not same.any():
        return order
    tied = np.zeros(order.size, dtype=bool)
    tied[1:] |= same
    tied[:-1] |= same
    positions = np.flatnonzero(tied)
    group = np.cumsum(np.concatenate([[True], ~same]))[positions]  # one id per run of tied rows
    members = order[positions]
    refined = np.lexsort([*(np.asarray(t)[members] for t in reversed(list(ties))), group])
    order[positions] = members[refined]
    return order


def kept_rows(
    units: np.ndarray, order_key: np.ndarray, ties: Sequence[np.ndarray], max_rows: int
) -> np.ndarray:
    """The positions of the rows each unit keeps under :class:`UnitBound`: rows sorted by unit, then by
    ``order_key`` (``ORDER_COLUMN``), then by ``ties`` (in priority order), and each unit's first
    ``max_rows`` of them, returned in that sorted order (a unit's kept rows are contiguous). The rank of a
    row within its unit depends on that unit's rows only. Shared by the reference engine and the learners
    (``mechanisms.learners.dp_gd``), so both keep the rows the same order chooses."""
    order = _unit_order(units, order_key, ties)
    units_sorted = units[order]
    starts = unit_starts(units_sorted)
    sizes = np.diff(np.concatenate([starts, [units_sorted.size]]))
    rank = np.arange(units_sorted.size) - np.repeat(starts, sizes)
    result: np.ndarray = order[rank < max_rows]
    return result


def _bounded(
    plan: Aggregation, unit: UnitBound, table: Mapping[str, np.ndarray], mask: np.ndarray
) -> np.ndarray:
    """``mask`` restricted to each unit's first ``max_rows`` selected rows (``UnitBound``'s order)."""
    selected = np.flatnonzero(mask)
    ties = [np.asarray(table[c])[selected] for c in plan.tie_columns()]
    order_key = np.asarray(table[ORDER_COLUMN])[selected]
    units = np.asarray(table[unit.column])[selected]
    kept = np.zeros(mask.size, dtype=bool)
    kept[selected[kept_rows(units, order_key, ties, unit.max_rows)]] = True
    return kept


def _distinct_per_cell(units: np.ndarray, cell: np.ndarray, n_cells: int) -> tuple[int, ...]:
    """The number of distinct ``units`` per cell (``COUNT(DISTINCT unit) … GROUP BY cell``)."""
    order = np.lexsort([units, cell])
    cells, ids = cell[order], units[order]
    first = np.concatenate([[True], (cells[1:] != cells[:-1]) | (ids[1:] != ids[:-1])])[: cells.size]
    return tuple(int(c) for c in np.bincount(cells[first], minlength=n_cells))


def evaluate_numpy(plan: Aggregation, table: Mapping[str, np.ndarray]) -> Answer:
    """The reference engine: the plan on columns in memory (vectorised; loops only over cells)."""
    n_rows = len(next(iter(table.values()))) if table else 0
    mask = _mask(plan, table, n_rows)
    if plan.unit is not None:
        mask = _bounded(plan, plan.unit, table, mask)
    cell = _cells(plan, table, n_rows)[mask]
    n_cells = plan.n_cells
    answers = []
    for s in plan.sums:
        if s.kind == "count":
            counts = np.bincount(cell, minlength=n_cells) if n_cells > 1 else np.array([cell.size])
            answers.append(tuple(int(c) for c in counts))
            continue
        if s.kind == "distinct_units":
            answers.append(_distinct_per_cell(_clipped(plan, table, str(s.column))[mask], cell, n_cells))
            continue
        answers.append(_exact_sums(_row_values(s, plan, table, n_rows)[mask], cell, n_cells))
    return tuple(answers)


def aggregate(table: Mapping[str, np.ndarray], plan: Aggregation) -> Answer:
    """Run ``plan`` where the table is: its engine when it has one (``Scanner``), else NumPy in memory."""
    if isinstance(table, Scanner):
        return table.aggregate(plan)
    return evaluate_numpy(plan, table)


# ----- per-unit contributions (individual accounting) -----------------------------------------------------
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True, eq=False)
class UnitAnswer:
    """A plan's sums per (privacy unit, cell) after unit bounding, for individual accounting: one row per
    (unit id, cell) that at least one kept selected row reaches, sorted by (unit, cell) with no repeats.

    ``units`` are the clipped unit ids (``_clipped(...).astype(np.int64)``), ``cells`` the row-major cell
    indices (0 when the plan has no keys), both int64. ``sums[i]`` is the plan's ``i``-th sum over that
    unit's kept rows in that cell: int64 when every value fits in int64, else an object array of exact
    Python ints (counts and int sums of bounded units fit in practice; a grid sum — row units up to 2^52
    times up to ``max_rows`` rows — can exceed it). A ``distinct_units`` sum is 1 on every row. Summing the
    rows of a cell gives :func:`evaluate_numpy`'s answer for that cell exactly (:meth:`cell_totals`).
    Two answers are equal when their ids, cells, sum dtypes and values are."""

    units: np.ndarray
    cells: np.ndarray
    sums: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        for name in ("units", "cells"):
            array = getattr(self, name)
            if not isinstance(array, np.ndarray) or array.dtype != np.int64 or array.ndim != 1:
                raise ValueError(f"UnitAnswer.{name} must be a one-dimensional int64 array")
        if self.cells.size != self.units.size:
            raise ValueError("UnitAnswer.units and cells differ in length")
        object.__setattr__(self, "sums", tuple(_canonical_sum(values) for values in self.sums))
        if any(values.size != self.units.size for values in self.sums):
            raise ValueError("a UnitAnswer sum is not aligned with its units")
        units, cells = self.units, self.cells
        ascending = (units[1:] > units[:-1]) | ((units[1:] == units[:-1]) & (cells[1:] > cells[:-1]))
        if not ascending.all():
            raise ValueError("UnitAnswer rows must be sorted by (unit, cell) without repeats")

    def __len__(self) -> int:
        return int(self.units.size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, UnitAnswer):
            return NotImplemented
        return (
            np.array_equal(self.units, other.units)
            and np.array_equal(self.cells, other.cells)
            and len(self.sums) == len(other.sums)
            and all(
                a.dtype == b.dtype and np.array_equal(a, b)
                for a, b in zip(self.sums, other.sums, strict=True)
            )
        )

    __hash__ = None  # type: ignore[assignment]

    def cell_totals(self, n_cells: int) -> Answer:
        """Per sum, the exact total of each of ``n_cells`` cells (zeros where no unit reaches a cell): for a
        plan with a unit, :func:`evaluate_numpy`'s answer (the rows partition the kept rows)."""
        if self.cells.size and not (0 <= int(self.cells.min()) and int(self.cells.max()) < n_cells):
            raise ValueError("a UnitAnswer cell is outside the plan's cells")
        totals = []
        for values in self.sums:
            if values.dtype == np.int64:
                totals.append(_exact_sums(values, self.cells, n_cells))
                continue
            dense = np.zeros(n_cells, dtype=object)
            np.add.at(dense, self.cells, values)
            totals.append(tuple(int(v) for v in dense))
        return tuple(totals)


def _canonical_sum(values: np.ndarray) -> np.ndarray:
    """``values`` as int64 when every value fits, else as an object array of Python ints."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError("a UnitAnswer sum must be one-dimensional")
    if array.dtype.kind == "i" or (array.dtype.kind == "u" and array.dtype.itemsize < 8):
        return array.astype(np.int64, copy=False)
    if array.dtype.kind == "u":
        array = array.astype(object)
    if array.dtype != object or not all(isinstance(v, int) and not isinstance(v, bool) for v in array):
        raise ValueError(f"a UnitAnswer sum must hold integers, not {array.dtype}")
    if array.size == 0 or (INT64_MIN <= min(array) and max(array) <= INT64_MAX):
        return array.astype(np.int64)
    return array


@runtime_checkable
class UnitScanner(Protocol):
    """A table whose engine computes per-(unit, cell) contributions where the data is."""

    def aggregate_units(self, plan: Aggregation) -> UnitAnswer: ...


def unit_plan(plan: Aggregation) -> UnitBound:
    """The plan's :class:`UnitBound`, checking that per-unit sums are defined for it: a plan with a privacy
    unit, whose ``distinct_units`` sums count the unit column itself (1 per unit and cell, so cell totals
    add up; distinct values of another column are not additive over units). Raises ValueError otherwise."""
    if plan.unit is None:
        raise ValueError("per-unit contributions need a plan with a privacy unit (plan.unit is None)")
    for s in plan.sums:
        if s.kind == "distinct_units" and s.column != plan.unit.column:
            raise ValueError("a per-unit distinct_units sum must count the privacy unit column")
    return plan.unit


def group_sums(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Exact Σ of int64 ``values`` over the runs beginning at ``starts`` (increasing, ``starts[0] == 0``),
    as int64 when every total fits, else as Python ints (object). Each value is split into 32-bit halves
    (as :func:`_exact_sums`), whose run sums fit in int64 for fewer than 2^31 values, and the carry of the
    low half is moved into the high one, so ``total = high·2^32 + low`` with 0 ≤ low < 2^32: it fits in
    int64 exactly when −2^31 ≤ high < 2^31."""
    if values.size >= 1 << 31:
        raise ValueError("too many rows for the in-memory engine")
    if starts.size == 0:
        return np.zeros(0, dtype=np.int64)
    low = np.add.reduceat(values & 0xFFFFFFFF, starts)
    high = np.add.reduceat(values >> 32, starts) + (low >> 32)
    low &= 0xFFFFFFFF
    if ((high >= -(1 << 31)) & (high < 1 << 31)).all():
        result: np.ndarray = (high << 32) | low
        return result
    exact: np.ndarray = high.astype(object) * (1 << 32) + low.astype(object)
    return exact


def evaluate_units_numpy(plan: Aggregation, table: Mapping[str, np.ndarray]) -> UnitAnswer:
    """The reference engine's per-(unit, cell) sums (:class:`UnitAnswer`): the rows :func:`evaluate_numpy`
    keeps, grouped by (clipped unit id, cell) with one sort, each sum reduced per group exactly
    (:func:`group_sums`). Vectorised; raises ValueError for a plan without a unit (:func:`unit_plan`)."""
    unit = unit_plan(plan)
    n_rows = len(next(iter(table.values()))) if table else 0
    if table and np.asarray(table[unit.column]).dtype.kind not in "iu":
        raise ValueError("a privacy unit column must be an int or categorical column")
    kept = _bounded(plan, unit, table, _mask(plan, table, n_rows))
    units = _clipped(plan, table, unit.column).astype(np.int64)[kept]
    cells = _cells(plan, table, n_rows)[kept]
    order = np.lexsort([cells, units])
    units, cells = units[order], cells[order]
    new = np.ones(units.size, dtype=bool)
    new[1:] = (units[1:] != units[:-1]) | (cells[1:] != cells[:-1])
    starts = np.flatnonzero(new)
    sizes = np.diff(np.append(starts, units.size))
    sums = []
    for s in plan.sums:
        if s.kind == "count":
            sums.append(sizes.astype(np.int64))
        elif s.kind == "distinct_units":
            sums.append(np.ones(starts.size, dtype=np.int64))
        else:
            sums.append(group_sums(_row_values(s, plan, table, n_rows)[kept][order], starts))
    return UnitAnswer(units[starts], cells[starts], tuple(sums))


def aggregate_units(table: Mapping[str, np.ndarray], plan: Aggregation) -> UnitAnswer:
    """Per-(unit, cell) sums of ``plan`` where the table is: its engine when it has one
    (:class:`UnitScanner`), else NumPy in memory. Raises ValueError for a plan without a unit."""
    unit_plan(plan)
    if isinstance(table, UnitScanner):
        return table.aggregate_units(plan)
    return evaluate_units_numpy(plan, table)
