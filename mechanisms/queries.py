"""The query language of the noise-adding mechanisms: count, sum, mean and histogram, with a ``where`` filter.

A query's output is a vector of reals (one coordinate, or one per histogram bin). ``shifts`` gives the
worst-case change of that vector between neighbouring datasets, derived **only** from the declared bounds
and the neighbour relation (never from the data, DESIGN §4 rule 1). The data is clipped to the declared
bounds on load, so the bounds hold for every table a query can see. ``where`` conditions are combined
with AND and evaluated on the clipped data; categorical conditions compare codes.

Sensitivities are rounded **up** to the next float whenever their exact value is not a float, so rounding
can only add noise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Annotated, Any, Literal, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from mechanisms.base import ParamsError, PublicContext
from mechanisms.schema import CategoricalColumn, FloatColumn, IntColumn

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
    """Count of selected rows per category (categorical column) or per integer value (int column)."""

    kind: Literal["histogram"]
    column: str = Field(min_length=1)
    where: Where = ()


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
        if isinstance(column, FloatColumn):
            reason = f"a histogram needs a categorical or int column, {column.name!r} is float"
            raise ParamsError("query.column", reason)
        if isinstance(column, IntColumn) and column.max - column.min + 1 > MAX_INT_BINS:
            raise ParamsError("query.column", f"{column.name!r} spans more than {MAX_INT_BINS} integer bins")
    elif isinstance(column, CategoricalColumn):
        reason = f"{query.kind} needs a float or int column, {column.name!r} is categorical"
        raise ParamsError("query.column", reason)


def _has_public_size(query: MeanQuery, ctx: PublicContext) -> bool:
    replace_one = ctx.schema.neighboring == "replace_one"
    return replace_one and ctx.n_rows is not None and ctx.n_rows > 0 and not query.where


def check_query(query: AnyQuery, ctx: PublicContext) -> None:
    """Raise ``ParamsError`` (field relative to params) unless ``query`` can run on this schema."""
    for index, condition in enumerate(query.where):
        _check_condition(condition, ctx, f"query.where.{index}")
    if not isinstance(query, CountQuery):
        _check_target(query, ctx)
    if isinstance(query, MeanQuery) and not _has_public_size(query, ctx):
        raise ParamsError("query.kind", MEAN_REFUSAL)
    if not all(math.isfinite(s) for s in shifts(query, ctx)):
        raise ParamsError("query.column", "the declared bounds are too wide: the sensitivity overflows")


# ----- sensitivity -------------------------------------------------------------------------------------
def _ceil_float(exact: Fraction) -> float:
    """The smallest float ≥ ``exact`` (+inf beyond the float range)."""
    try:
        rounded = float(exact)
    except OverflowError:
        return math.inf
    return rounded if Fraction(rounded) >= exact else math.nextafter(rounded, math.inf)


def _numeric(query: SumQuery | MeanQuery, ctx: PublicContext) -> FloatColumn | IntColumn:
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
    column = _numeric(query, ctx)
    low, high = Fraction(column.min), Fraction(column.max)
    if ctx.schema.neighboring == "add_remove":
        return _ceil_float(max(abs(low), abs(high)))
    if query.where:
        return _ceil_float(max(high, Fraction(0)) - min(low, Fraction(0)))
    return _ceil_float(high - low)


def _mean_shift(query: MeanQuery, ctx: PublicContext) -> float:
    """Mean over all n rows (n public under replace_one): one value moves in [min, max], so (max − min)/n."""
    if not _has_public_size(query, ctx) or ctx.n_rows is None:
        raise ParamsError("query.kind", MEAN_REFUSAL)
    column = _numeric(query, ctx)
    return _ceil_float((Fraction(column.max) - Fraction(column.min)) / ctx.n_rows)


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
    if isinstance(query, CountQuery):
        return (1.0,)
    if isinstance(query, SumQuery):
        return (_sum_shift(query, ctx),)
    if isinstance(query, MeanQuery):
        return (_mean_shift(query, ctx),)
    return _histogram_shifts(ctx)


def l1(shift_values: Iterable[float]) -> float:
    """ℓ1 sensitivity: the sum of the shifts, rounded up."""
    return _ceil_float(sum((Fraction(s) for s in shift_values), Fraction(0)))


def l2(shift_values: Iterable[float]) -> float:
    """ℓ2 sensitivity: sqrt of the sum of squared shifts, rounded up."""
    squares = sum((Fraction(s) ** 2 for s in shift_values), Fraction(0))
    root = math.sqrt(_ceil_float(squares))
    return root if Fraction(root) ** 2 >= squares else math.nextafter(root, math.inf)


# ----- evaluation --------------------------------------------------------------------------------------
_COMPARISONS = {
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
}


def _condition_mask(condition: Condition, column: AnyColumn, data: np.ndarray) -> np.ndarray:
    targets: list[int | float | str] = list(condition.values)
    if isinstance(column, CategoricalColumn):
        targets = [column.values.index(str(v)) for v in targets]
    if condition.op == "in":
        return np.isin(data, np.asarray(targets))
    return np.asarray(_COMPARISONS[condition.op](data, targets[0]), dtype=bool)


def selection(query: AnyQuery, ctx: PublicContext, table: Mapping[str, np.ndarray]) -> np.ndarray:
    """Boolean mask of the rows selected by ``query.where`` (all rows when there is no condition)."""
    n_rows = len(next(iter(table.values())))
    mask = np.ones(n_rows, dtype=bool)
    for condition in query.where:
        column = _column(ctx, condition.column, "query.where")
        mask &= _condition_mask(condition, column, table[condition.column])
    return mask


def _histogram(
    query: HistogramQuery, ctx: PublicContext, table: Mapping[str, np.ndarray], mask: np.ndarray
) -> tuple[np.ndarray, list[str]]:
    column = _column(ctx, query.column, "query.column")
    if isinstance(column, CategoricalColumn):
        counts = np.bincount(table[column.name][mask], minlength=len(column.values))
        return counts.astype(np.float64), list(column.values)
    if isinstance(column, FloatColumn):
        raise ParamsError("query.column", f"{column.name!r} is float")
    offsets = table[column.name][mask] - column.min
    counts = np.bincount(offsets, minlength=column.max - column.min + 1)
    return counts.astype(np.float64), [str(v) for v in range(column.min, column.max + 1)]


def evaluate(
    query: AnyQuery, ctx: PublicContext, table: Mapping[str, np.ndarray]
) -> tuple[np.ndarray, list[str] | None]:
    """The true (noise-free) output vector and, for histograms, the bin labels."""
    mask = selection(query, ctx, table)
    if isinstance(query, CountQuery):
        return np.array([float(np.count_nonzero(mask))]), None
    if isinstance(query, HistogramQuery):
        return _histogram(query, ctx, table, mask)
    total = float(np.sum(table[_numeric(query, ctx).name][mask], dtype=np.float64))
    if isinstance(query, SumQuery):
        return np.array([total]), None
    if ctx.n_rows is None or ctx.n_rows != mask.size:
        raise ValueError("the table does not have the public row count")
    return np.array([total / ctx.n_rows]), None


def release_output(noisy: np.ndarray, labels: list[str] | None, noise: dict[str, Any]) -> dict[str, Any]:
    """JSON output of a noisy query: ``{"value": x}`` or ``{"values": {label: x}}``, plus the noise spec."""
    if labels is None:
        return {"value": float(noisy[0]), "noise": noise}
    return {"values": dict(zip(labels, map(float, noisy), strict=True)), "noise": noise}
