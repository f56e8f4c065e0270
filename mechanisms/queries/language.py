"""The query language of the noise-adding mechanisms: count, sum, mean and histogram, with a ``where`` filter.

A query's output is a vector of reals (one coordinate, or one per histogram bin). ``shifts`` gives the
worst-case change of that vector between neighbouring datasets, derived **only** from the declared bounds
and the neighbour relation (never from the data, docs/privacy/rules.md#rule-public-charges). The data is
clipped to the declared bounds on load, so the bounds hold for every table a query can see. ``where``
conditions are combined with AND and evaluated on the clipped data; categorical conditions compare codes.

Sensitivities are rounded **up** to the next float whenever their exact value is not a float, so rounding
can only add noise.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Annotated, Any, Literal, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from mechanisms.base import ParamsError, PublicContext, Table
from mechanisms.data.plan import (
    Aggregation,
    Bucket,
    Key,
    Predicate,
    Sum,
    UnitBound,
    aggregate,
    clip_bounds,
    grid_bits,
    normalise,
)
from mechanisms.data.schema import CategoricalColumn, FloatColumn, IntColumn
from mechanisms.noise import Grid, dyadic_scale_up, float_up, laplace_grid

MAX_CONDITIONS = 20
MAX_IN_VALUES = 10_000
MAX_INT_BINS = 10_000

FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
# Numeric where-values are compared as float64: they must convert to a finite float.
Scalar = Annotated[StrictInt, Field(ge=-(10**300), le=10**300)] | FiniteFloat | StrictStr
AnyColumn = FloatColumn | IntColumn | CategoricalColumn


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Condition(_Frozen):
    """``column op value``; ``in`` takes a non-empty list, every other operator a scalar."""

    column: str = Field(min_length=1)
    op: Literal["eq", "ne", "lt", "le", "gt", "ge", "in"]
    value: Scalar | tuple[Scalar, ...] = Field(union_mode="left_to_right")

    @model_validator(mode="after")
    def _value_matches_op(self) -> Self:
        if self.op == "in":
            if not isinstance(self.value, tuple) or not self.value:
                raise ValueError("'in' needs a non-empty list of values")
            if len(self.value) > MAX_IN_VALUES:
                raise ValueError(f"'in' takes at most {MAX_IN_VALUES} values")
        elif isinstance(self.value, tuple):
            raise ValueError(f"{self.op!r} needs a single value, not a list")
        return self

    @property
    def values(self) -> tuple[int | float | str, ...]:
        """The value(s) as a tuple (one element unless ``op`` is ``in``)."""
        return self.value if isinstance(self.value, tuple) else (self.value,)


Where = Annotated[tuple[Condition, ...], Field(max_length=MAX_CONDITIONS)]


class CountQuery(_Frozen):
    """Number of selected rows."""

    kind: Literal["count"]
    where: Where = ()


class SumQuery(_Frozen):
    """Sum of a numeric column over the selected rows."""

    kind: Literal["sum"]
    column: str = Field(min_length=1)
    where: Where = ()


class MeanQuery(_Frozen):
    """Mean of a numeric column over all rows (only when the row count is public: replace_one, no where)."""

    kind: Literal["mean"]
    column: str = Field(min_length=1)
    where: Where = ()


class HistogramQuery(_Frozen):
    """Count of selected rows per category (categorical column), per integer value (int column), or per bin
    of a float column: ``bins`` equal-width bins over the declared [min, max], [min, e₁], (e₁, e₂], …,
    (e_{B−1}, max] (public edges, so binning is a function of the row alone)."""

    kind: Literal["histogram"]
    column: str = Field(min_length=1)
    where: Where = ()
    bins: int | None = Field(
        default=None, ge=2, le=MAX_INT_BINS, strict=True, description="float columns: the number of bins"
    )


AnyQuery = CountQuery | SumQuery | MeanQuery | HistogramQuery
Query = Annotated[AnyQuery, Field(discriminator="kind")]

MEAN_REFUSAL = (
    "mean needs a public selection size (replace_one dataset, no where); release sum and count separately"
)


# ----- validation against the schema -------------------------------------------------------------------
def _column(ctx: PublicContext, name: str, field: str) -> AnyColumn:
    column = ctx.schema.column(name)
    if column is None:
        raise ParamsError(field, f"unknown column {name!r}")
    return column


def _check_condition(condition: Condition, ctx: PublicContext, field: str) -> None:
    column = _column(ctx, condition.column, f"{field}.column")
    if isinstance(column, CategoricalColumn):
        if condition.op not in ("eq", "ne", "in"):
            reason = f"{condition.op!r} needs a numeric column, {column.name!r} is categorical"
            raise ParamsError(f"{field}.op", reason)
        unknown = [v for v in condition.values if not isinstance(v, str) or v not in column.values]
        if unknown:
            raise ParamsError(f"{field}.value", f"{unknown[0]!r} is not a declared value of {column.name!r}")
    elif any(isinstance(v, str) for v in condition.values):
        raise ParamsError(f"{field}.value", f"column {column.name!r} is numeric: compare it with numbers")


def _check_target(query: SumQuery | MeanQuery | HistogramQuery, ctx: PublicContext) -> None:
    column = _column(ctx, query.column, "query.column")
    if isinstance(query, HistogramQuery):
        if isinstance(column, FloatColumn) and query.bins is None:
            reason = f"a histogram of the float column {column.name!r} needs bins (the number of equal bins)"
            raise ParamsError("query.bins", reason)
        if not isinstance(column, FloatColumn) and query.bins is not None:
            raise ParamsError("query.bins", f"bins is for float columns; {column.name!r} has its own values")
        if isinstance(column, FloatColumn) and column.min == column.max:
            raise ParamsError("query.bins", f"{column.name!r} has a single value (min = max): nothing to bin")
        if isinstance(column, IntColumn) and column.max - column.min + 1 > MAX_INT_BINS:
            raise ParamsError("query.column", f"{column.name!r} spans more than {MAX_INT_BINS} integer bins")
    elif isinstance(column, CategoricalColumn):
        reason = f"{query.kind} needs a float or int column, {column.name!r} is categorical"
        raise ParamsError("query.column", reason)


def has_public_size(query: MeanQuery, ctx: PublicContext) -> bool:
    replace_one = ctx.schema.neighboring == "replace_one"
    return replace_one and ctx.n_rows is not None and ctx.n_rows > 0 and not query.where


def check_query(query: AnyQuery, ctx: PublicContext) -> None:
    """Raise ``ParamsError`` (field relative to params) unless ``query`` can run on this schema."""
    unit = ctx.schema.privacy_unit
    if unit is not None and not isinstance(query, CountQuery) and query.column == unit.column:
        raise ParamsError("query.column", f"{unit.column!r} identifies the privacy unit; it is not a measure")
    for index, condition in enumerate(query.where):
        _check_condition(condition, ctx, f"query.where.{index}")
    if not isinstance(query, CountQuery):
        _check_target(query, ctx)
    if isinstance(query, MeanQuery) and not has_public_size(query, ctx):
        raise ParamsError("query.kind", MEAN_REFUSAL)
    if not all(math.isfinite(s) for s in shifts(query, ctx)):
        raise ParamsError("query.column", "the declared bounds are too wide: the sensitivity overflows")


def check_where(where: tuple[Condition, ...], ctx: PublicContext) -> None:
    """Raise ``ParamsError`` (field ``where.<i>…``) unless every condition of a top-level where can run."""
    for index, condition in enumerate(where):
        _check_condition(condition, ctx, f"where.{index}")


# ----- sensitivity -------------------------------------------------------------------------------------
def numeric_column(query: SumQuery | MeanQuery, ctx: PublicContext) -> FloatColumn | IntColumn:
    column = _column(ctx, query.column, "query.column")
    if isinstance(column, CategoricalColumn):
        raise ParamsError("query.column", f"{column.name!r} is categorical")
    return column


def _sum_shift(query: SumQuery, ctx: PublicContext) -> float:
    """One row's worst-case effect on a clipped sum; a filtered-out row contributes 0.

    add_remove: the added/removed row contributes a value in [min, max], so max(|min|, |max|).
    replace_one without where: one contribution moves within [min, max], so max − min.
    replace_one with where: a contribution moves within [min, max] ∪ {0} (the row may enter or leave the
    selection), so max(max, 0) − min(min, 0), which is max − min when min ≤ 0 ≤ max.
    """
    column = numeric_column(query, ctx)
    low, high = Fraction(column.min), Fraction(column.max)
    if ctx.schema.neighboring == "add_remove":
        return float_up(max(abs(low), abs(high)))
    if query.where:
        return float_up(max(high, Fraction(0)) - min(low, Fraction(0)))
    return float_up(high - low)


def _mean_shift(query: MeanQuery, ctx: PublicContext) -> float:
    """Mean over all n rows (n public under replace_one): one value moves in [min, max], so (max − min)/n."""
    if not has_public_size(query, ctx) or ctx.n_rows is None:
        raise ParamsError("query.kind", MEAN_REFUSAL)
    column = numeric_column(query, ctx)
    return float_up((Fraction(column.max) - Fraction(column.min)) / ctx.n_rows)


def _histogram_shifts(ctx: PublicContext) -> tuple[float, ...]:
    """Bins that move and by how much.

    add_remove: the row's own bin moves by 1 (one coordinate).
    replace_one: the old bin loses one and the new bin gains one (two coordinates, 1 each); a row leaving
    or entering the selection moves a single bin, which is dominated.
    """
    return (1.0,) if ctx.schema.neighboring == "add_remove" else (1.0, 1.0)


def shifts(query: AnyQuery, ctx: PublicContext) -> tuple[float, ...]:
    """Worst-case |change| of each coordinate that can move between neighbours (public information only).

    count: one row enters or leaves the selection (or the dataset), so one coordinate moves by 1 under both
    relations. sum, mean, histogram: see ``_sum_shift``, ``_mean_shift``, ``_histogram_shifts``.
    """
    if ctx.schema.privacy_unit is not None:
        return _unit_shifts(query, ctx, ctx.schema.privacy_unit.max_rows)
    if isinstance(query, CountQuery):
        return (1.0,)
    if isinstance(query, SumQuery):
        return (_sum_shift(query, ctx),)
    if isinstance(query, MeanQuery):
        return (_mean_shift(query, ctx),)
    return _histogram_shifts(ctx)


def _unit_shifts(query: AnyQuery, ctx: PublicContext, k: int) -> tuple[float, ...]:
    """Shifts when neighbours differ by one privacy unit, of which every query keeps at most k selected rows
    (``mechanisms.data.plan.UnitBound``; docs/privacy/units.md#lemma-unit, Lemma UNIT).

    count: the unit's kept rows, 0..k on each side: k. sum: the sum of ≤ k values in [min, max] lies in
    [k·min(min, 0), k·max(max, 0)], so add/remove moves it by ≤ k·max(|min|, |max|) and replacing the unit's
    rows by ≤ k·(max(max, 0) − min(min, 0)). histogram: add/remove moves bins by a total of ≤ k (ℓ2 ≤ k,
    all in one bin); replacing removes ≤ k and adds ≤ k counts: ℓ1 ≤ 2k and, both parts non-negative,
    ℓ2² ≤ k² + k² (two coordinates of k). mean: refused (the row count is not public; ``check_query``).
    """
    if isinstance(query, CountQuery):
        return (float(k),)
    if isinstance(query, HistogramQuery):
        return (float(k),) if ctx.schema.neighboring == "add_remove" else (float(k), float(k))
    if isinstance(query, MeanQuery):
        raise ParamsError("query.kind", MEAN_REFUSAL)
    column = numeric_column(query, ctx)
    low, high = Fraction(column.min), Fraction(column.max)
    if ctx.schema.neighboring == "add_remove":
        return (float_up(k * max(abs(low), abs(high))),)
    return (float_up(k * (max(high, Fraction(0)) - min(low, Fraction(0)))),)


def l1(shift_values: Iterable[float]) -> float:
    """ℓ1 sensitivity: the sum of the shifts, rounded up."""
    return float_up(sum((Fraction(s) for s in shift_values), Fraction(0)))


def l2(shift_values: Iterable[float]) -> float:
    """ℓ2 sensitivity: sqrt of the sum of squared shifts, rounded up."""
    squares = sum((Fraction(s) ** 2 for s in shift_values), Fraction(0))
    root = math.sqrt(float_up(squares))
    return root if Fraction(root) ** 2 >= squares else math.nextafter(root, math.inf)


# ----- evaluation: one aggregation plan per query (mechanisms.data.plan) ------------------------------------
def where_plan(where: tuple[Condition, ...], ctx: PublicContext) -> tuple[Predicate, ...]:
    """The plan's predicates of a ``where`` (exact comparisons on the clipped columns)."""
    return tuple(normalise(_column(ctx, c.column, "query.where"), c.op, c.values) for c in where)


def _histogram_key(query: HistogramQuery, ctx: PublicContext) -> tuple[Key, list[str]]:
    column = _column(ctx, query.column, "query.column")
    if isinstance(column, CategoricalColumn):
        return Key(column.name, len(column.values)), list(column.values)
    if isinstance(column, FloatColumn):
        if query.bins is None:
            raise ParamsError("query.bins", f"a histogram of the float column {column.name!r} needs bins")
        return float_bins(column, query.bins)
    size = column.max - column.min + 1
    return Key(column.name, size, offset=column.min), [str(v) for v in range(column.min, column.max + 1)]


def float_bins(column: FloatColumn, bins: int) -> tuple[Key, list[str]]:
    """The key of ``bins`` equal-width bins over [min, max]: a bucket over the interior edges
    e_j = fl(min + j·(max − min)/bins), j = 1 … bins − 1 (``Bucket``: the number of edges strictly below the
    value, so bin j is (e_j, e_{j+1}], the first closed at min), with the approximate index
    ⌈(x − e₁)·bins/(max − min)⌉ that the exact corrections fix. Labels name the bins' edges."""
    low, high = Fraction(column.min), Fraction(column.max)
    edges = [float(low + (high - low) * Fraction(j, bins)) for j in range(bins + 1)]
    inverse = float(Fraction(bins) / (high - low))
    bucket = Bucket(edges[1], inverse, tuple(edges[1:-1]))
    labels = [f"({a!r}, {b!r}]" for a, b in itertools.pairwise(edges)]
    labels[0] = f"[{edges[0]!r}, {edges[1]!r}]"
    return Key(column.name, bins, bucket=bucket), labels


def center(column: FloatColumn | IntColumn) -> tuple[float, Fraction]:
    """The float midpoint c of [min, max] and H ≥ |fl(x − c)| for every x in [min, max] (IEEE rounding is
    monotone, so fl(x − c) lies between fl(min − c) and fl(max − c))."""
    c = float((Fraction(column.min) + Fraction(column.max)) / 2)
    h = max(abs(Fraction(column.min) - Fraction(c)), abs(Fraction(column.max) - Fraction(c)))
    return c, Fraction(float_up(h))


def real_sum_terms(column: FloatColumn | IntColumn, unit: Fraction, square: bool = False) -> tuple[Sum, ...]:
    """The plan's sums whose exact combination is a real sum over a float column, with row units fine
    enough for ``unit`` (the release grid divided by any later divisor): Σ x = c·count + 2^e·Σ u(x − c),
    or, with ``square``, Σ (x − c)² ≈ 2^e·Σ u(fl(x − c)²) (``real_sum_value``)."""
    c, h = center(column)
    magnitude = Fraction(float_up(h * h)) if square else h
    exponent = grid_bits(magnitude, unit)
    terms = (Sum("grid_sum", column.name, center=c, square=square, exponent=exponent),)
    return terms if square else (Sum("count"), *terms)


def real_sum_value(terms: tuple[Sum, ...], values: tuple[int, ...]) -> Fraction:
    """The exact rational a real sum's plan terms stand for: 2^e·Σ u(y), plus c·count when the terms
    begin with the count (``real_sum_terms`` of a float sum; a centred block has no count term)."""
    count = values[0] if terms[0].kind == "count" else 0
    total = Fraction(0)
    for term, value in zip(terms, values, strict=True):
        if term.kind == "grid_sum":
            total += Fraction(value) * Fraction(2) ** term.exponent + Fraction(term.center) * count
    return total


def unit_bound(ctx: PublicContext) -> UnitBound | None:
    """The plan's contribution bounding of a dataset with a privacy unit (None: a row is a unit)."""
    unit = ctx.schema.privacy_unit
    return None if unit is None else UnitBound(unit.column, unit.max_rows)


def query_plan(query: AnyQuery, ctx: PublicContext, grid: Grid) -> tuple[Aggregation, list[str] | None]:
    """The aggregation plan of ``query`` for a release on ``grid`` (public parameters only), and the
    histogram labels. On a dataset with a privacy unit every plan bounds each unit to its ``max_rows``
    selected rows, and real sums use row units k times finer (one neighbour step changes up to k rows)."""
    where = where_plan(query.where, ctx)
    bounded = unit_bound(ctx)
    if isinstance(query, CountQuery):
        return Aggregation(where=where, unit=bounded), None
    if isinstance(query, HistogramQuery):
        key, labels = _histogram_key(query, ctx)
        bounds = clip_bounds(ctx.schema, [c.column for c in query.where] + [key.column])
        return Aggregation(where=where, keys=(key,), bounds=bounds, unit=bounded), labels
    column = numeric_column(query, ctx)
    bounds = clip_bounds(ctx.schema, [c.column for c in query.where] + [column.name])
    if isinstance(column, IntColumn):
        sums: tuple[Sum, ...] = (Sum("int_sum", column.name),)
        if isinstance(query, MeanQuery):  # the count checks the table has the public row count
            sums = (Sum("count"), *sums)
        return Aggregation(where=where, sums=sums, bounds=bounds, unit=bounded), None
    unit = Fraction(grid.granularity) / ctx.schema.unit_rows
    if isinstance(query, MeanQuery):
        unit = unit * _public_rows(ctx)
    return Aggregation(where=where, sums=real_sum_terms(column, unit), bounds=bounds, unit=bounded), None


def _public_rows(ctx: PublicContext) -> int:
    if ctx.n_rows is None or ctx.n_rows <= 0:
        raise ParamsError("query.kind", MEAN_REFUSAL)
    return ctx.n_rows


def true_answer(
    query: AnyQuery, ctx: PublicContext, table: Table, grid: Grid
) -> tuple[list[Fraction], list[str] | None]:
    """The exact answer of ``query`` per coordinate (rationals), computed by the table's engine with
    the row units of ``grid`` (``query_plan``), and the histogram labels."""
    plan, labels = query_plan(query, ctx, grid)
    answer = aggregate(table, plan)
    if isinstance(query, CountQuery | HistogramQuery):
        return [Fraction(v) for v in answer[0]], labels
    firsts = tuple(values[0] for values in answer)
    if plan.sums[-1].kind == "int_sum":
        total = Fraction(firsts[-1])
    else:
        total = real_sum_value(plan.sums, firsts)
    if isinstance(query, MeanQuery):
        if firsts[0] != _public_rows(ctx):
            raise ValueError("the table does not have the public row count")
        total = total / _public_rows(ctx)
    return [total], None


def evaluate(query: AnyQuery, ctx: PublicContext, table: Table) -> tuple[np.ndarray, list[str] | None]:
    """The true (noise-free) output vector as floats, for post-processing and tests (row units 2^-40
    times the sensitivity: the released mechanisms use ``evaluate_units`` on their own grid)."""
    delta = l1(shifts(query, ctx))
    grid = _grid_below_or_unit(delta)
    values, labels = true_answer(query, ctx, table, grid)
    return np.array([float(v) for v in values], dtype=np.float64), labels


def _grid_below_or_unit(delta: float) -> Grid:
    if not (delta > 0.0 and math.isfinite(delta)):
        return Grid(0)
    return Grid(math.frexp(delta)[1] - 41)


def release_output(
    noisy: np.ndarray,
    labels: list[str] | None,
    noise: dict[str, Any],
    interval: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """JSON output of a noisy query: ``{"value": x}`` or ``{"values": {label: x}}``, plus the noise spec and,
    when given, the confidence interval (``mechanisms.queries.intervals.release_interval``)."""
    if labels is None:
        output: dict[str, Any] = {"value": float(noisy[0]), "noise": noise}
    else:
        output = {"values": dict(zip(labels, map(float, noisy), strict=True)), "noise": noise}
    if interval is not None:
        output["interval"] = interval
    return output


# ----- releases on a public grid (docs/privacy/finite_precision.md#finite-precision, finite precision) ------
RANGE_BITS = 44
"""A release's true answer is clamped to ±2^44 grid units before noise (a public, 1-Lipschitz map): with
noise scales ≤ 2^40 units the release stays below 2^53 units, so it is an exact float multiple of γ."""
MAX_SCALE_BITS = 40
"""Noise scales (Laplace t, Gaussian σ) are kept ≤ 2^40 grid units by coarsening the grid if needed."""
MIN_GRID_EXPONENT = -1000
"""γ ≥ 2^-1000 keeps every multiple u·γ (|u| < 2^53) a normal, exactly representable float."""
FLOAT_SLACK = Fraction(1, 64)
"""Bound on how far a computed real answer's change between two neighbours may exceed the exact change of
the answer, in grid units. A real answer is c·count + 2^e·Σ u(x − c) with row units 2^e ≤ γ·2^-7
(``real_sum_terms``): each row's rounding is within ½ row unit, so a neighbour's change moves by at most
one row unit, 2^-7 grid units, plus the double rounding of fl(x − c) (≤ 2^-53 relative) — below 1/64
(docs/privacy/engines.md#lemma-engine)."""


def is_integer_valued(query: AnyQuery, ctx: PublicContext) -> bool:
    """True iff the answer is an integer on every dataset, from the public schema alone: counts,
    histograms, and sums over int columns. Means (a quotient) and sums over float columns are real."""
    if isinstance(query, CountQuery | HistogramQuery):
        return True
    if isinstance(query, SumQuery):
        return isinstance(ctx.schema.column(query.column), IntColumn)
    return False


def magnitude_bound(query: AnyQuery, ctx: PublicContext) -> float | None:
    """A public bound on every coordinate |f(D)| (None when it depends on the private row count)."""
    if isinstance(query, MeanQuery):
        column = numeric_column(query, ctx)
        return max(abs(float(column.min)), abs(float(column.max)))
    if ctx.n_rows is None:
        return None
    if isinstance(query, SumQuery):
        column = numeric_column(query, ctx)
        return float_up(ctx.n_rows * max(abs(Fraction(column.min)), abs(Fraction(column.max))))
    return float(ctx.n_rows)


def _grid_at_least(size: float) -> Grid:
    """The smallest power-of-two grid ≥ ``size`` (> 0)."""
    mantissa, exponent = math.frexp(size)  # size = mantissa·2^exponent, mantissa ∈ [0.5, 1)
    return Grid(exponent - 1 if mantissa == 0.5 else exponent)


@dataclass(frozen=True)
class GridPlan:
    """How a query is released on a public grid: the grid, whether the answer is used unrounded (integer
    answers on γ = 1), and per moving coordinate an integer bound on |round(f/γ) − round(f′/γ)|."""

    grid: Grid
    exact: bool
    unit_shifts: tuple[int, ...]

    @property
    def l1_units(self) -> int:
        return sum(self.unit_shifts)

    @property
    def l2_units(self) -> float:
        return l2(float(m) for m in self.unit_shifts)


def unit_shift(shift: float, grid: Grid, exact: bool) -> int:
    """An integer bound on a coordinate's change in grid units, for a coordinate moving by ≤ ``shift``.

    exact (integer answer, γ dividing 1): the change is an integer multiple of 1/γ, at most shift/γ.
    Otherwise: |round(a) − round(b)| ≤ |a − b| + 1 (rounding errors in [−½, ½]) with |a − b| ≤ shift/γ +
    FLOAT_SLACK, and it is an integer: ⌊shift/γ + slack⌋ + 1. A coordinate that cannot move (shift 0, so
    every neighbour has the same rows in it) has the same computed value on both: 0.
    """
    if shift == 0.0:
        return 0
    ratio = Fraction(shift) / Fraction(grid.granularity)
    if exact:
        return math.ceil(ratio)
    return math.floor(ratio + FLOAT_SLACK) + 1


def plan_grid(query: AnyQuery, ctx: PublicContext, coarsest_unit: float) -> GridPlan:
    """The public grid of one release of ``query``.

    Start from ``laplace_grid``/``gaussian_grid``'s rule (γ = 1 for integer answers, else the largest
    2^k ≤ 2^-10·Δ/d), then coarsen so that (a) |f| ≤ 2^44·γ when a public bound on |f| exists and (b) the
    noise scale is ≤ 2^40 units (``coarsest_unit`` = the noise scale in value units / 2^40). Integer answers
    stay unrounded while γ = 1 (every 2^k ≤ 1 divides them too: then the change is exact as well).
    """
    query_shifts = shifts(query, ctx)
    integer = is_integer_valued(query, ctx)
    delta = l1(query_shifts)
    dim = len(query_shifts)
    if delta == 0.0:
        grid = Grid(0)
    elif integer and float(delta).is_integer():
        grid = laplace_grid(delta, dim, integer_valued=True)
    else:
        grid = laplace_grid(delta, dim, integer_valued=False)
    floors = [coarsest_unit]
    bound = magnitude_bound(query, ctx)
    if bound is not None and bound > 0.0:
        floors.append(math.ldexp(bound, -RANGE_BITS))
    for floor in floors:
        if floor > grid.granularity and math.isfinite(floor):
            grid = _grid_at_least(floor)
    if grid.exponent < MIN_GRID_EXPONENT:
        raise ParamsError("query", "the sensitivity is too small for an exact release grid (γ < 2^-1000)")
    exact = integer and grid.exponent <= 0
    check_unit_grid(query, ctx, exact)
    return GridPlan(grid, exact, tuple(unit_shift(s, grid, exact) for s in query_shifts))


def check_unit_grid(query: AnyQuery, ctx: PublicContext, exact: bool) -> None:
    """Refuse a histogram on a privacy-unit dataset released on a coarse grid (γ > 1): one unit's k rows
    may move k different bins, each rounded to the grid, which the per-coordinate ``unit_shift`` of the
    histogram's (k,) shift would not cover. On γ = 1 the counts are exact and ℓ1 ≤ k holds as stated
    (docs/privacy/units.md#lemma-unit). γ > 1 only happens at a very small ε or noise-reduction level."""
    if ctx.schema.privacy_unit is not None and isinstance(query, HistogramQuery) and not exact:
        raise ParamsError(
            "query",
            "a histogram on a privacy-unit dataset must be released on the unit grid (γ = 1): the requested "
            "noise is so large that its grid is coarser; raise ε (or the smallest noise-reduction level)",
        )


def evaluate_units(
    query: AnyQuery, ctx: PublicContext, table: Table, plan: GridPlan
) -> tuple[np.ndarray, list[str] | None]:
    """round(f(D)/γ) per coordinate (int64, half up), clamped to ±2^44 units, and the histogram labels.

    The answer comes from the table's engine as exact integers (``query_plan``): counts, histograms and int
    sums exactly; a real answer as c·count + 2^e·Σ u(x − c) with row units 2^e ≤ γ·2^-7, whose rounding
    moves a neighbour's change by at most 2^-7 < ``FLOAT_SLACK`` units
    (docs/privacy/engines.md#lemma-engine)."""
    values, labels = true_answer(query, ctx, table, plan.grid)
    return answer_units(values, plan.grid), labels


def answer_units(values: list[Fraction], grid: Grid) -> np.ndarray:
    """⌊v/γ + ½⌋ of exact answers, clamped to ±2^44 units, as int64."""
    return np.array([clamped_units(v, grid) for v in values], dtype=np.int64)


def clamped_units(value: Fraction, grid: Grid, limit: int = 1 << RANGE_BITS) -> int:
    """⌊clamp(value/γ, ±limit) + ½⌋ (round half up on the exact rational)."""
    scaled = value / Fraction(grid.granularity)
    clamped = min(max(scaled, Fraction(-limit)), Fraction(limit))
    return math.floor(clamped + Fraction(1, 2))


def charged_fraction(epsilon: float) -> Fraction:
    """The exact ε a pure charge of ``epsilon`` stands for: the ledger reads a float as its shortest
    decimal (``mechanisms.accounting.fixed_point``), which may be below the float's binary value (0.1)."""
    return min(Fraction(epsilon), Fraction(repr(float(epsilon))))


@lru_cache(maxsize=4096)
def laplace_plan(query: AnyQuery, ctx: PublicContext, epsilon: float) -> tuple[GridPlan, Fraction]:
    """The grid and the discrete Laplace scale t (grid units) of a pure-ε release of ``query``.

    t = ``dyadic_scale_up``(M/ε) with M = Σ_j m_j the ℓ1 sensitivity in grid units, so the release is
    (M/t ≤ ε)-DP. The grid is coarsened (rarely) so that t ≤ 2^40. A function of public parameters only
    (cached).
    """
    eps = charged_fraction(epsilon)
    too_small = ParamsError("epsilon", "too small: the Laplace noise would not fit the release grid")
    if eps < Fraction(1, 1 << (MAX_SCALE_BITS - 1)):
        raise too_small  # even one grid unit of sensitivity would need a scale beyond 2^40 units
    try:  # the continuous scale Δ₁/ε in value units, over 2^38: the finest grid keeping t ≤ 2^40
        coarsest = math.ldexp(float(Fraction(l1(shifts(query, ctx))) / eps), 2 - MAX_SCALE_BITS)
    except OverflowError:
        raise too_small from None
    plan = plan_grid(query, ctx, coarsest)
    scale = dyadic_scale_up(Fraction(max(plan.l1_units, 1)) / eps)
    if scale > 1 << MAX_SCALE_BITS:
        raise too_small
    return plan, scale
