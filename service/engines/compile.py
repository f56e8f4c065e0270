"""One compiler from an :class:`~mechanisms.data.plan.Aggregation` to SQL, rendered for DuckDB and for Spark.

The plan is compiled **once** (cached per plan and column types) into a neutral sqlglot expression tree
built with ``sqlglot.exp`` builders; :meth:`CompiledPlan.sql` renders it with sqlglot's generator for each
dialect. The tree reads from a table called :data:`SOURCE` (the DuckDB rendering reads
``read_parquet($path)`` instead, the Spark engine names a temp view so) and joins one small table per bucket
key whose corrections can matter (:class:`CandidateTable`; Spark registers it as a broadcast DataFrame; the
DuckDB rendering replaces the join by ``list_extract`` on list parameters, a faster lookup of the same
doubles).

Why every engine returns exactly :func:`~mechanisms.data.plan.evaluate_numpy`'s integers (the exactness
argument, step by step; each step names the NumPy operation it mirrors):

* **No decimal literal ever reaches an engine.** A double is written ``CAST('<repr(x)>' AS DOUBLE)``:
  ``repr`` is the shortest string that round-trips, and both engines parse it correctly rounded (DuckDB's
  fast_float, Java's ``Double.parseDouble``), so the constant is the very double NumPy uses. A bare ``0.5``
  would be a DECIMAL in DuckDB. Integers are integer literals (|v| ≤ 2^63).
* **Clip** (``np.clip``, i.e. min(max(x, low), high)): ``CASE WHEN x < low THEN low WHEN x > high THEN
  high ELSE x END``, equal to ``LEAST(GREATEST(x, low), high)`` for every non-NaN x when low ≤ high (and
  the constant ``high`` when low > high, as NumPy gives), but about twice as fast in DuckDB; it returns one
  of its inputs (no rounding). Int columns are clipped in BIGINT with ``int(low)``, ``int(high)`` as NumPy
  does. Values are never NaN (the snapshot rejects them); a ±0.0 sign difference after clipping changes no
  comparison and no integer below.
* **Comparisons** follow NumPy's type promotion (``np.asarray(values)``, NEP 50): all-integer values
  against an integer column compare as integers; otherwise both sides are doubles, an integer column going
  through ``CAST(x AS DOUBLE)`` (round-to-nearest-even in C, Java and DuckDB alike).
* **Grid units** (``round_half_up(np.ldexp(y, -e))``): ``y = x − center``, ``y·y`` when squared, then one
  multiplication by the double ``2^-e``. An IEEE product is the correctly rounded exact product, which is
  what ``ldexp`` returns, including in the subnormal range (``2^-e`` is a double for −1023 ≤ e ≤ 1074). For
  e < −1023 the factor is split into exact powers of two (scaling up is exact until overflow, and an
  intermediate overflows only if the result does); for e > 1074 every |s| < 2^-51 rounds to 0, so the
  factor 0.0 gives the same units. Then ``FLOOR(s)`` (DOUBLE in DuckDB, BIGINT in Spark: integral either
  way and exact for |s| < 2^63), ``s − FLOOR(s) ≥ 0.5`` in doubles (exact for |s| < 2^52, the plan's
  invariant), and ``CAST(FLOOR(s) AS BIGINT)`` of an integral double — never a rounding cast.
* **Buckets** (:func:`~mechanisms.data.plan.bucket_of`): ``t = (x − low)·inverse`` in doubles; NumPy's
  ``clip(ceil(t), 0, K)`` is ``CASE WHEN t <= 0 THEN 0 WHEN t >= K THEN K ELSE CAST(CEIL(t) AS BIGINT)
  END`` (ceil is monotone and 0, K are integers; Spark's BIGINT ``CEIL`` never sees ±inf). The two
  corrections read ``c[j0 − 1]`` and ``c[j0]`` from a candidates table (j, c_prev, c_at) with −inf/+inf at
  the ends (exactly NumPy's padded arrays) by an equi-join on j = j0, which matches exactly one row.
  **Which corrections can matter** is decided from public parameters only (:func:`bucket_corrections`):
  ``t`` is monotone in x for inverse > 0 (IEEE rounding, subtraction of a constant and multiplication by a
  positive constant are monotone), so is j0, and on the clipped domain [lo, hi] the lower correction can
  fire at j0 = j only if j ≤ j0(min(c[j−1], hi)), the upper one only if j ≥ j0(max(next(c[j]), lo)); a
  correction that can fire nowhere is left out. One that can is guarded: a row with j0 = j whose lower
  correction fires has x ≤ min(c[j−1], hi), hence fl(t(x) − (j − 1)) ≤ fl(t(min(c[j−1], hi)) − (j − 1)) ≤
  δ_L (the maximum over such j; fl(· − m) is monotone too), so rows with a larger fl(t − (j0 − 1)) skip
  the lookup (and symmetrically fl(j0 − t) ≤ δ_U). A guard only decides where the exact comparison is
  evaluated, never its result.
* **Cells** are BIGINT ``Σ index_i·Π_{j>i} size_j`` as in ``_cells``.
* **Per-unit contributions** (``compile_plan(…, by_unit=True)``, NumPy's ``evaluate_units_numpy``): the same
  layers, with the bounding's ``unit_id`` (the clipped BIGINT id it partitions by) carried to the aggregate,
  which groups by (unit_id, cell) — by unit_id alone without keys (cell 0) — with the same exact sums below.
  The result is fetched as Arrow (sums as decimal128 when the engine's type is HUGEINT/DECIMAL) and
  converted exactly (:func:`exact_int_array`), ordered by (unit, cell) (ORDER BY; re-sorted if not).
* **Sums** are exact integers: ``COUNT(*)`` (BIGINT), DuckDB ``SUM(BIGINT)`` → HUGEINT (128-bit, raises on
  overflow), Spark ``SUM(CAST(v AS DECIMAL(38, 0)))`` under ANSI mode (raises on overflow, never wraps).
  sqlglot would render ``SUM`` unchanged for Spark, where ``SUM(BIGINT)`` is a 64-bit sum that can
  overflow (an error under ANSI, but not an answer): that one piece is rewritten per dialect
  (:func:`_exact_sums_spark`).

A plan whose floats are NaN (or, outside candidates, infinite) is refused with ``ValueError``: NumPy and the
engines order NaN differently, so no exact agreement is possible for it, and ``normalise`` never builds one.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from sqlglot import exp

from mechanisms.data.plan import (
    ORDER_COLUMN,
    Aggregation,
    Answer,
    Bucket,
    Key,
    Predicate,
    Sum,
    UnitAnswer,
    UnitBound,
    unit_plan,
)

Dialect = Literal["duckdb", "spark"]
ColumnKind = Literal["float", "int"]
"""How an engine stores a column: ``float`` (float64) or ``int`` (int64 values, int32 categorical codes)."""

SOURCE = "expost_source"
"""The table the compiled query reads (the engine maps it to the snapshot)."""

_COMPARE: dict[str, type[exp.Binary]] = {
    "eq": exp.EQ,
    "ne": exp.NEQ,
    "lt": exp.LT,
    "le": exp.LTE,
    "gt": exp.GT,
    "ge": exp.GTE,
}
_DOUBLE = exp.DataType.build("DOUBLE")
_BIGINT = exp.DataType.build("BIGINT")
_DECIMAL = exp.DataType.build("DECIMAL(38, 0)")


# ----- column types ---------------------------------------------------------------------------------------
def column_kinds(schema: pa.Schema) -> dict[str, ColumnKind]:
    """The :data:`ColumnKind` of every column of a snapshot's Arrow schema (float64/int64/int32 only)."""
    kinds: dict[str, ColumnKind] = {}
    for field in schema:
        if pa.types.is_floating(field.type):
            kinds[field.name] = "float"
        elif pa.types.is_integer(field.type):
            kinds[field.name] = "int"
        else:
            raise ValueError(f"column {field.name!r} has an unsupported type {field.type}")
    return kinds


def snapshot_schema(path: Path) -> pa.Schema:
    """The Arrow schema of the snapshot at ``path`` (its Parquet footer; cached per file version)."""
    stat = os.stat(path)
    return _schema(str(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=1024)
def _schema(path: str, mtime_ns: int, size: int) -> pa.Schema:
    return pq.read_schema(path)


def snapshot_kinds(path: Path) -> dict[str, ColumnKind]:
    """The :data:`ColumnKind` of every column of the snapshot at ``path``."""
    return column_kinds(snapshot_schema(path))


# ----- literals -------------------------------------------------------------------------------------------
def double(value: float) -> exp.Expression:
    """The double ``value`` as ``CAST('<repr>' AS DOUBLE)``: exact in both engines (module docstring)."""
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"a plan constant is not finite: {value!r}")
    return exp.cast(exp.Literal.string(repr(value)), _DOUBLE)


def integer(value: int) -> exp.Expression:
    if not -(2**63) < value < 2**63:
        raise ValueError(f"an integer constant is outside BIGINT: {value}")
    return exp.Literal.number(int(value))


def _bucket_j0(t: exp.Expression, n: int) -> exp.Expression:
    """np.clip(np.ceil(t), 0, n) as BIGINT (module docstring)."""
    case: exp.Expression = (
        exp.Case()
        .when(exp.LTE(this=t.copy(), expression=double(0.0)), integer(0))
        .when(exp.GTE(this=t.copy(), expression=double(float(n))), integer(n))
        .else_(exp.cast(exp.Ceil(this=t.copy()), _BIGINT))
    )
    return case


def _clip_case(
    value: exp.Expression, low: exp.Expression | None, high: exp.Expression | None, constant: bool
) -> exp.Expression:
    """min(max(value, low), high) for low ≤ high as one CASE (``None``: that side is open); ``constant``
    (low > high): ``high`` for every row, as np.clip gives."""
    if constant:
        assert high is not None
        return high
    case = exp.Case()
    if low is not None:
        case = case.when(exp.LT(this=value.copy(), expression=low), low.copy())
    if high is not None:
        case = case.when(exp.GT(this=value.copy(), expression=high), high.copy())
    if low is None and high is None:
        return value
    clipped: exp.Expression = case.else_(value.copy())
    return clipped


def _flag(condition: exp.Expression) -> exp.Expression:
    """1 when ``condition`` holds, else 0."""
    case: exp.Expression = exp.Case().when(condition, exp.Literal.number(1)).else_(exp.Literal.number(0))
    return case


def _col(name: str, table: str | None = None) -> exp.Column:
    return exp.column(name, table=table, quoted=True)


def _scale_factors(exponent: int) -> list[float]:
    """Doubles whose successive products with y give ``ldexp(y, -exponent)`` exactly (module docstring)."""
    if exponent > 1074:
        return [0.0]
    factors = []
    shift = -exponent
    while shift > 1023:
        factors.append(math.ldexp(1.0, 1023))
        shift -= 1023
    factors.append(math.ldexp(1.0, shift))
    return factors


def _truncate(value: exp.Expression) -> exp.Expression:
    """NumPy's float → int64 conversion (toward zero) as an exact integral double, then BIGINT: a cast alone
    rounds half-even in DuckDB and truncates in Spark."""
    whole: exp.Expression = (
        exp.Case()
        .when(exp.GTE(this=value, expression=double(0.0)), exp.Floor(this=value.copy()))
        .else_(exp.Ceil(this=value.copy()))
    )
    return exp.cast(whole, _BIGINT)


# ----- the compiled plan ----------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class CandidateTable:
    """The lookup table of one bucket key: rows (j, c_prev = c[j − 1], c_at = c[j]) for j = 0..K, with
    c[−1] = −inf and c[K] = +inf (NumPy's padded arrays in ``bucket_of``)."""

    name: str
    table: pa.Table
    index: str
    """The column of the ``selected`` subquery holding the row's j0 (the join key)."""

    @property
    def prev_parameter(self) -> str:
        return f"{self.name}_prev"

    @property
    def at_parameter(self) -> str:
        return f"{self.name}_at"


@dataclass(frozen=True, eq=False)
class CompiledPlan:
    """A plan's neutral query tree and what an engine must register to run it."""

    plan: Aggregation
    query: exp.Select
    candidates: tuple[CandidateTable, ...]
    columns: tuple[str, ...]
    """The snapshot columns read (the projection)."""
    by_unit: bool = False
    """Grouped by (``unit_id``, cell) instead of cell: the per-unit contributions (:meth:`unit_answer`)."""

    @cached_property
    def _duckdb_tree(self) -> exp.Expression:
        source = exp.Table(this=exp.ReadParquet(expressions=[exp.Placeholder(this="path")]))
        return _list_lookups(_with_source(self.query, source), self.candidates)

    @cached_property
    def duckdb_sql(self) -> str:
        """The query for DuckDB: reads ``read_parquet($path)``, looks candidates up with ``list_extract`` on
        list parameters (:meth:`duckdb_parameters`) instead of joining tables."""
        return self._duckdb_tree.sql(dialect="duckdb")

    @cached_property
    def duckdb_join_sql(self) -> str:
        """The query for DuckDB with the candidate joins kept (the tables must be registered); an
        alternative measured by benchmarks/engine_scale.py."""
        source = exp.Table(this=exp.ReadParquet(expressions=[exp.Placeholder(this="path")]))
        return _with_source(self.query, source).sql(dialect="duckdb")

    @cached_property
    def _duckdb_lists(self) -> dict[str, list[float]]:
        lists: dict[str, list[float]] = {}
        used = {placeholder.name for placeholder in self._duckdb_tree.find_all(exp.Placeholder)}
        for candidates in self.candidates:
            for parameter, column in (
                (candidates.prev_parameter, "c_prev"),
                (candidates.at_parameter, "c_at"),
            ):
                if parameter in used:
                    lists[parameter] = candidates.table.column(column).to_pylist()
        return lists

    def duckdb_parameters(self, path: Path) -> dict[str, object]:
        """The named parameters of :attr:`duckdb_sql`: the snapshot's path and the candidate lists."""
        return {"path": str(path), **self._duckdb_lists}

    @cached_property
    def spark_sql(self) -> str:
        """The query for Spark, reading the temp view :data:`SOURCE`."""
        return _exact_sums_spark(self.query.copy()).sql(dialect="spark")

    def sql(self, dialect: Dialect) -> str:
        """The query for ``dialect``, rendered once per plan."""
        return self.duckdb_sql if dialect == "duckdb" else self.spark_sql

    def answer(self, rows: Iterable[Sequence[object]]) -> Answer:
        """The dense :data:`Answer` from the engine's result rows ((cell,)? then one value per sum)."""
        if self.by_unit:
            raise ValueError("a per-unit plan's result is a UnitAnswer (unit_answer)")
        return dense_answer(self.plan, rows)

    def unit_answer(self, result: pa.Table) -> UnitAnswer:
        """The :class:`~mechanisms.data.plan.UnitAnswer` from a per-unit query's Arrow result (columns
        ``unit_id``, ``cell`` when the plan has keys, ``s0``, ``s1``, …), in (unit, cell) order."""
        if not self.by_unit:
            raise ValueError("the plan was not compiled per unit")
        return unit_answer(self.plan, result)


def _with_source(query: exp.Select, source: exp.Expression) -> exp.Expression:
    def swap(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Table) and node.name == SOURCE:
            return source.copy()
        return node

    swapped: exp.Expression = query.copy().transform(swap)
    return swapped


def _list_lookups(query: exp.Expression, candidates: Sequence[CandidateTable]) -> exp.Expression:
    """DuckDB only, for speed (not exactness): ``cand.c_prev`` → ``LIST_EXTRACT($cand_prev, j0 + 1)`` (lists
    are 1-based) and the joins dropped. The looked-up doubles are the same; inside a guarded ``CASE WHEN
    guard AND …`` DuckDB evaluates the lookup only on the rows that pass the guard."""
    by_name = {c.name: c for c in candidates}

    def rewrite(node: exp.Expression) -> exp.Expression | None:
        if isinstance(node, exp.Join) and node.this.name in by_name:
            return None
        if isinstance(node, exp.Column) and node.table in by_name:
            table = by_name[node.table]
            parameter = table.prev_parameter if node.name == "c_prev" else table.at_parameter
            index = exp.Add(this=_col(table.index, "selected"), expression=exp.Literal.number(1))
            return exp.Anonymous(this="LIST_EXTRACT", expressions=[exp.Placeholder(this=parameter), index])
        return node

    rewritten: exp.Expression = query.transform(rewrite)
    return rewritten


def _exact_sums_spark(query: exp.Expression) -> exp.Expression:
    """sqlglot keeps ``SUM(v)`` as is, but Spark's ``SUM(BIGINT)`` is a 64-bit sum (DuckDB's is a 128-bit
    HUGEINT): sum Spark's BIGINT row values as DECIMAL(38, 0) instead (exact below 10^38, an error above
    under ANSI mode)."""

    def rewrite(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Sum):
            return exp.Sum(this=exp.cast(node.this, _DECIMAL))
        return node

    rewritten: exp.Expression = query.transform(rewrite)
    return rewritten


def compile_plan(plan: Aggregation, kinds: Mapping[str, ColumnKind], by_unit: bool = False) -> CompiledPlan:
    """Compile ``plan`` for a snapshot whose columns have ``kinds`` (cached per plan, kinds and ``by_unit``).

    ``by_unit``: group by (unit id, cell) instead of cell, for per-unit contributions (the plan must have a
    privacy unit: :func:`~mechanisms.data.plan.unit_plan`)."""
    needed = plan.columns()
    missing = [name for name in needed if name not in kinds]
    if missing:
        raise ValueError(f"the snapshot has no column {missing[0]!r}")
    if plan.unit is not None and not UNIT_BOUNDING:  # never run a unit dataset's plan unbounded
        raise NotImplementedError("this engine does not bound privacy units yet")
    if by_unit:
        unit_plan(plan)
    return _compile(plan, tuple((name, kinds[name]) for name in needed), by_unit)


UNIT_BOUNDING = True
"""Whether the compiled SQL applies ``Aggregation.unit`` (the per-unit row bound)."""


@lru_cache(maxsize=256)
def _compile(plan: Aggregation, kinds: tuple[tuple[str, ColumnKind], ...], by_unit: bool) -> CompiledPlan:
    return _Compiler(plan, dict(kinds), by_unit).build()


class _Compiler:
    """Builds the query in four nested selects (DuckDB and Spark merge the projections):

    1. ``clipped``: the plan's columns from :data:`SOURCE`, clipped, as c0, c1, …
    2. ``selected``: the ``where`` filter; per key its code index, or the bucket's x and t (and j0 when a
       correction needs a lookup: it is the join key); per sum its pre-scale double ``y`` (grid) or BIGINT
       value (int_sum);
    3. ``cells``: joins the candidate tables; the cell index (j0 and the guarded corrections); the scaled
       doubles ``s``;
    4. the aggregate: ``COUNT(*)`` / ``SUM(unit)`` per cell (grouped by cell when there are keys), or,
       ``by_unit``, per (``unit_id``, cell) (``unit_id`` computed in layer 2 by the bounding, carried
       through layer 3).
    """

    def __init__(self, plan: Aggregation, kinds: Mapping[str, ColumnKind], by_unit: bool = False) -> None:
        self.plan = plan
        self.kinds = kinds
        self.by_unit = by_unit
        self.names = {name: f"c{i}" for i, name in enumerate(plan.columns())}

    # layer 1
    def _clip(self, name: str) -> exp.Expression:
        """np.clip(x, low, high) = min(max(x, low), high) (module docstring)."""
        bound = self.plan.bound(name)
        if self.kinds[name] == "int":
            value: exp.Expression = exp.cast(_col(name), _BIGINT)
            if bound is None:
                return value
            low, high = (int(_finite(b)) for b in bound)
            return _clip_case(value, integer(low) if low <= high else None, integer(high), low > high)
        if bound is None:
            return _col(name)
        low_f, high_f = bound
        if math.isnan(low_f) or math.isnan(high_f) or low_f == math.inf or high_f == -math.inf:
            raise ValueError(f"the bounds of {name!r} are not a range: {bound}")
        lower = double(low_f) if low_f != -math.inf else None  # clipping to ±inf is the identity
        upper = double(high_f) if high_f != math.inf else None
        return _clip_case(_col(name), lower, upper, low_f > high_f)

    def _domain(self, name: str) -> tuple[float, float]:
        """An interval of doubles holding every clipped value of ``name`` as a double (bucket analysis)."""
        bound = self.plan.bound(name)
        if bound is None:
            return -math.inf, math.inf
        if self.kinds[name] == "int":
            low, high = (int(b) for b in bound)
            low = min(low, high)  # low > high: every value is high
            return float(low), float(high)  # float() is monotone: fl(n) lies between fl(low) and fl(high)
        return (min(bound[0], bound[1]), bound[1])

    def _ref(self, name: str) -> exp.Column:
        return _col(self.names[name])

    def _as_double(self, name: str) -> exp.Expression:
        ref = self._ref(name)
        return exp.cast(ref, _DOUBLE) if self.kinds[name] == "int" else ref

    def _as_bigint(self, name: str) -> exp.Expression:
        """NumPy's ``astype(np.int64)`` of the clipped column."""
        ref = self._ref(name)
        return ref if self.kinds[name] == "int" else _truncate(ref)

    # layer 2
    def _predicate(self, predicate: Predicate) -> exp.Expression | None:
        """The predicate as NumPy's ``_mask`` evaluates it (None: always true)."""
        if predicate.op == "true":
            return None
        if predicate.op == "false":
            return exp.false()
        if predicate.op not in _COMPARE and predicate.op != "in":
            raise ValueError(f"unknown predicate op {predicate.op!r}")
        values = np.asarray(predicate.values)
        if predicate.op == "in" and values.size == 0:
            return exp.false()
        if values.size == 0:
            raise ValueError(f"predicate {predicate.op!r} on {predicate.column!r} has no value")
        if values.dtype.kind == "i" and self.kinds[predicate.column] == "int":
            left: exp.Expression = self._ref(predicate.column)
            literals = [integer(int(v)) for v in values.tolist()]
        elif values.dtype.kind in "if":  # NEP 50: the comparison happens in float64
            left = self._as_double(predicate.column)
            literals = [double(float(np.float64(v))) for v in values.tolist()]
        else:
            raise ValueError(f"predicate values of {predicate.column!r} are not ints or floats")
        if predicate.op == "in":
            return exp.In(this=left, expressions=literals)
        return _COMPARE[predicate.op](this=left, expression=literals[0])

    def build(self) -> CompiledPlan:
        plan = self.plan
        clipped = exp.select(*(self._clip(name).as_(alias) for name, alias in self.names.items()))
        if not self.names:
            clipped = exp.select(exp.Literal.number(0).as_("unused"))
        clipped = clipped.from_(exp.to_table(SOURCE))

        selected: list[exp.Expression] = []
        cells_select: list[exp.Expression] = []
        candidates: list[CandidateTable] = []
        joins: list[tuple[str, exp.Expression]] = []
        cell: exp.Expression | None = None
        for k, key in enumerate(plan.keys):
            index = self._key(k, key, selected, candidates, joins)
            if cell is not None:
                index = exp.Add(
                    this=exp.Mul(this=exp.paren(cell), expression=integer(key.size)), expression=index
                )
            cell = index
        if cell is not None:
            cells_select.append(cell.as_("cell"))

        aggregates: list[exp.Expression] = []
        groups: list[exp.Expression] = []
        if self.by_unit:  # unit_id: the bounding's partition key (layer 2), the clipped BIGINT id
            assert plan.unit is not None
            if self.kinds[plan.unit.column] != "int":
                raise ValueError("a privacy unit column must be an int or categorical column")
            cells_select.append(_col("unit_id", "selected").as_("unit_id"))
            groups.append(_col("unit_id"))
        if cell is not None:
            groups.append(_col("cell"))
        aggregates.extend(group.copy() for group in groups)
        for i, s in enumerate(plan.sums):
            aggregates.append(self._sum(i, s, selected, cells_select).as_(f"s{i}"))

        conditions = [c for c in map(self._predicate, plan.where) if c is not None]
        if not selected:
            selected.append(exp.Literal.number(0).as_("unused"))
        rows = exp.select(*selected).from_(exp.alias_(exp.paren(clipped), "clipped"))
        if conditions:
            rows = rows.where(exp.and_(*conditions))
        if plan.unit is not None:
            rows = self._bounded(rows, plan.unit)
        if not cells_select:
            cells_select.append(exp.Literal.number(0).as_("unused"))
        cells = exp.select(*cells_select).from_(exp.alias_(exp.paren(rows), "selected"))
        for table, on in joins:
            cells = cells.join(exp.to_table(table), on=on, join_type="inner")
        query = exp.select(*aggregates).from_(exp.alias_(exp.paren(cells), "cells"))
        if groups:
            query = query.group_by(*groups)
        if self.by_unit:  # the engine sorts (cheaper than a sort after the fetch, which stays a fallback)
            query = query.order_by(*(group.copy() for group in groups))
        return CompiledPlan(plan, query, tuple(candidates), tuple(self.names), self.by_unit)

    def _bounded(self, rows: exp.Select, unit: UnitBound) -> exp.Select:
        """Each unit's first ``max_rows`` selected rows (``mechanisms.data.plan.UnitBound``): ROW_NUMBER over
        the unit, ordered by ``ORDER_COLUMN`` then the plan's other columns, as NumPy's ``_bounded``."""
        rows = rows.select(self._ref(unit.column).as_("unit_id"), self._ref(ORDER_COLUMN).as_("unit_order"))
        ties = [self._ref(name).as_(f"tie{i}") for i, name in enumerate(self.plan.tie_columns())]
        if ties:
            rows = rows.select(*ties)
        order = [exp.Ordered(this=_col("unit_order"))] + [
            exp.Ordered(this=_col(f"tie{i}")) for i in range(len(ties))
        ]
        window = exp.Window(
            this=exp.RowNumber(), partition_by=[_col("unit_id")], order=exp.Order(expressions=order)
        )
        numbered = exp.select(exp.Star(), window.as_("unit_rank")).from_(
            exp.alias_(exp.paren(rows), "ranked")
        )
        bound = exp.LTE(this=_col("unit_rank"), expression=integer(unit.max_rows))
        return exp.select(exp.Star()).from_(exp.alias_(exp.paren(numbered), "bounded")).where(bound)

    def _key(
        self,
        k: int,
        key: Key,
        selected: list[exp.Expression],
        candidates: list[CandidateTable],
        joins: list[tuple[str, exp.Expression]],
    ) -> exp.Expression:
        """The key's index expression in layer 3 (adding what it needs to layer 2 and the joins)."""
        if key.size < 1:
            raise ValueError(f"key {key.column!r} has size {key.size}")
        if key.bucket is None:
            index = self._as_bigint(key.column)
            if key.offset:
                index = exp.Sub(this=index, expression=integer(key.offset))
            selected.append(index.as_(f"k{k}"))
            return _col(f"k{k}", "selected")
        bucket = key.bucket
        n = len(bucket.candidates)
        _check_bucket(bucket)
        x = self._as_double(key.column)
        t = exp.Mul(
            this=exp.paren(exp.Sub(this=x, expression=double(bucket.low))),
            expression=double(bucket.inverse),
        )
        selected.append(x.copy().as_(f"x{k}"))
        selected.append(t.as_(f"t{k}"))
        t_ref = _col(f"t{k}", "selected")
        corrections = bucket_corrections(bucket, *self._domain(key.column))
        if not (corrections.lower or corrections.upper):
            return exp.paren(_bucket_j0(t_ref, n))  # b = j0: computed in layer 3 from t
        # the join key j0 must be a column of layer 2 (t is repeated: both engines eliminate the common
        # subexpression)
        index_name = f"j{k}"
        selected.append(_bucket_j0(t.copy(), n).as_(index_name))
        j0: exp.Expression = _col(index_name, "selected")
        table = candidate_table(f"expost_candidates_{k}", bucket, index_name)
        candidates.append(table)
        joins.append((table.name, exp.EQ(this=_col("j", table.name), expression=j0.copy())))
        x_ref = _col(f"x{k}", "selected")
        bucket_index: exp.Expression = j0.copy()
        if corrections.lower:
            fires: exp.Expression = exp.LTE(this=x_ref.copy(), expression=_col("c_prev", table.name))
            if corrections.lower_guard is not None:
                previous = exp.cast(exp.Sub(this=j0.copy(), expression=integer(1)), _DOUBLE)
                guard = exp.LTE(
                    this=exp.Sub(this=t_ref.copy(), expression=previous),
                    expression=double(corrections.lower_guard),
                )
                fires = exp.and_(guard, fires)
            bucket_index = exp.Sub(this=bucket_index, expression=_flag(fires))
        if corrections.upper:
            fires = exp.LT(this=_col("c_at", table.name), expression=x_ref.copy())
            if corrections.upper_guard is not None:
                guard = exp.LTE(
                    this=exp.Sub(this=exp.cast(j0.copy(), _DOUBLE), expression=t_ref.copy()),
                    expression=double(corrections.upper_guard),
                )
                fires = exp.and_(guard, fires)
            bucket_index = exp.Add(this=bucket_index, expression=_flag(fires))
        return exp.paren(bucket_index)

    def _sum(
        self, i: int, s: Sum, selected: list[exp.Expression], cells_select: list[exp.Expression]
    ) -> exp.Expression:
        if s.kind == "count":
            return exp.Count(this=exp.Star())
        if s.column is None:
            raise ValueError(f"a {s.kind} needs a column")
        if s.kind == "int_sum":
            selected.append(self._as_bigint(s.column).as_(f"v{i}"))
            cells_select.append(_col(f"v{i}", "selected").as_(f"v{i}"))
            return exp.Sum(this=_col(f"v{i}"))
        if s.kind == "distinct_units":  # NumPy's ``_distinct_per_cell``: distinct clipped ids per cell
            selected.append(self._as_bigint(s.column).as_(f"v{i}"))
            cells_select.append(_col(f"v{i}", "selected").as_(f"v{i}"))
            return exp.Count(this=exp.Distinct(expressions=[_col(f"v{i}")]))
        if s.kind != "grid_sum":
            raise ValueError(f"unknown sum kind {s.kind!r}")
        y = exp.Sub(this=self._as_double(s.column), expression=double(s.center))
        selected.append(y.as_(f"y{i}"))
        scaled: exp.Expression = _col(f"y{i}", "selected")
        if s.square:
            scaled = exp.Mul(this=scaled, expression=_col(f"y{i}", "selected"))
        for factor in _scale_factors(s.exponent):
            scaled = exp.Mul(this=exp.paren(scaled), expression=double(factor))
        cells_select.append(scaled.as_(f"s{i}"))
        unit = exp.Add(
            this=exp.cast(exp.Floor(this=_col(f"s{i}")), _BIGINT),
            expression=_flag(
                exp.GTE(
                    this=exp.Sub(this=_col(f"s{i}"), expression=exp.Floor(this=_col(f"s{i}"))),
                    expression=double(0.5),
                )
            ),
        )
        return exp.Sum(this=unit)


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"a plan bound is not finite: {value!r}")
    return value


@dataclass(frozen=True)
class Corrections:
    """Which of a bucket's two corrections can be non-zero on a domain, and their guards (None: every row
    must be checked). See the module docstring for the argument."""

    lower: bool
    lower_guard: float | None
    upper: bool
    upper_guard: float | None


def bucket_corrections(bucket: Bucket, lo: float, hi: float) -> Corrections:
    """:class:`Corrections` of ``bucket`` for values x in [lo, hi] (public parameters only).

    With inverse > 0, t(x) = fl(fl(x − low)·inverse) and j0(x) are monotone in x (the same NumPy operations
    as :func:`~mechanisms.data.plan.bucket_of`). The lower correction at j0 = j (1 ≤ j ≤ K) fires for x ≤
    c[j−1]; such an x of the domain is ≤ top_j = min(c[j−1], hi), so it needs c[j−1] ≥ lo and
    j ≤ j0(top_j), and it has fl(t(x) − (j−1)) ≤ fl(t(top_j) − (j−1)). The upper one at j (0 ≤ j < K) fires
    for x > c[j], i.e. x ≥ bottom_j = max(nextafter(c[j], +inf), lo), so it needs bottom_j ≤ hi and
    j ≥ j0(bottom_j), and it has fl(j − t(x)) ≤ fl(j − t(bottom_j)). Without that monotonicity (inverse <
    0) both corrections are kept, unguarded."""
    c = np.asarray(bucket.candidates, dtype=np.float64)
    k = c.size
    if not bucket.inverse > 0 or k == 0:
        return Corrections(True, None, True, None)

    def t(x: np.ndarray) -> np.ndarray:
        result: np.ndarray = (x - bucket.low) * bucket.inverse
        return result

    def j0(x: np.ndarray) -> np.ndarray:
        result: np.ndarray = np.clip(np.ceil(t(x)), 0, k)
        return result

    with np.errstate(all="ignore"):
        j_lower = np.arange(1, k + 1, dtype=np.float64)
        top = np.minimum(c, hi)
        lower = (c >= lo) & (j_lower <= j0(top))
        j_upper = np.arange(0, k, dtype=np.float64)
        bottom = np.maximum(np.nextafter(c, np.inf), lo)
        upper = (c < np.inf) & (bottom <= hi) & (j_upper >= j0(bottom))
        lower_slack = (t(top) - (j_lower - 1))[lower]
        upper_slack = (j_upper - t(bottom))[upper]
    if np.isnan(lower_slack).any() or np.isnan(upper_slack).any():  # not reachable with finite parameters
        return Corrections(True, None, True, None)
    return Corrections(
        bool(lower.any()),
        _guard(lower_slack),
        bool(upper.any()),
        _guard(upper_slack),
    )


def _guard(slack: np.ndarray) -> float | None:
    if slack.size == 0:
        return None
    largest = float(np.max(slack))
    return largest if math.isfinite(largest) else None


def _check_bucket(bucket: Bucket) -> None:
    """Refuse what has no exact meaning in every engine: NaN candidates (ordered differently), a NaN or
    infinite low or inverse, inverse 0 (t would be NaN where x − low overflows)."""
    values = np.asarray(bucket.candidates, dtype=np.float64)
    if values.size == 0 or np.isnan(values).any():
        raise ValueError("a bucket needs at least one candidate, and no NaN")
    _finite(bucket.low), _finite(bucket.inverse)
    if bucket.inverse == 0:
        raise ValueError("a bucket's inverse width must not be 0")


def candidate_table(name: str, bucket: Bucket, index: str) -> CandidateTable:
    """The (j, c_prev, c_at) table of ``bucket``."""
    _check_bucket(bucket)
    values = np.asarray(bucket.candidates, dtype=np.float64)
    prev = np.concatenate([[-np.inf], values])
    at = np.concatenate([values, [np.inf]])
    table = pa.table(
        {
            "j": pa.array(np.arange(values.size + 1, dtype=np.int64)),
            "c_prev": pa.array(prev),
            "c_at": pa.array(at),
        }
    )
    return CandidateTable(name, table, index)


# ----- results --------------------------------------------------------------------------------------------
def dense_answer(plan: Aggregation, rows: Iterable[Sequence[object]]) -> Answer:
    """Per sum, one exact integer per cell (zeros for cells no selected row reached), from result rows
    ``(cell, s0, s1, …)`` (keys) or one row ``(s0, s1, …)`` (no keys; NULL sums of an empty selection are
    0). Loops over cells, never rows of data."""
    n_cells = plan.n_cells
    n_sums = len(plan.sums)
    dense = [[0] * n_cells for _ in range(n_sums)]
    for row in rows:
        if plan.keys:
            cell = _exact_int(row[0])
            if not 0 <= cell < n_cells:
                raise ValueError(f"a row fell outside the plan's cells (cell {cell} of {n_cells})")
            values = row[1:]
        else:
            cell, values = 0, row
        for i, value in enumerate(values):
            if value is not None:
                dense[i][cell] += _exact_int(value)
    return tuple(tuple(sums) for sums in dense)


def _exact_int(value: object) -> int:
    """An engine's integer (int, or an integral Decimal from Spark's DECIMAL(38, 0)) as a Python int."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, Decimal) and value == value.to_integral_value():
        return int(value)
    raise TypeError(f"an engine returned a non-integer sum: {value!r}")


def unit_answer(plan: Aggregation, result: pa.Table) -> UnitAnswer:
    """A per-unit query's Arrow result as a :class:`~mechanisms.data.plan.UnitAnswer`: ``unit_id``, ``cell``
    (absent without keys: every cell is 0) and ``s0``, ``s1``, … converted exactly and without a loop over
    rows (:func:`exact_int_array`), in the query's (unit, cell) order (sorted here with ``np.lexsort`` if an
    engine did not keep it)."""
    units = exact_int_array(result.column("unit_id"))
    cells = exact_int_array(result.column("cell")) if plan.keys else np.zeros(units.size, dtype=np.int64)
    if units.dtype != np.int64 or cells.dtype != np.int64:
        raise ValueError("an engine returned a unit id or cell outside BIGINT")
    if cells.size and not (0 <= int(cells.min()) and int(cells.max()) < plan.n_cells):
        raise ValueError("a row fell outside the plan's cells")
    sums = [exact_int_array(result.column(f"s{i}")) for i in range(len(plan.sums))]
    if _sorted(units, cells):
        return UnitAnswer(units, cells, tuple(sums))
    order = np.lexsort([cells, units])
    return UnitAnswer(units[order], cells[order], tuple(values[order] for values in sums))


def _sorted(units: np.ndarray, cells: np.ndarray) -> bool:
    """Whether (unit, cell) rows are in ascending order already (the query's ORDER BY)."""
    same = units[1:] == units[:-1]
    return bool(((units[1:] > units[:-1]) | (same & (cells[1:] >= cells[:-1]))).all())


def exact_int_array(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """An engine's integer column (int8…int64, or decimal128 with scale 0: DuckDB's HUGEINT, Spark's
    DECIMAL(38, 0)) as int64 when every value fits, else as an object array of Python ints. A decimal128
    value is 16 bytes of little-endian two's complement, read as (high: int64, low: uint64) pairs straight
    from the Arrow buffer; it fits in int64 exactly when ``high`` is the sign extension of ``low``. Nulls
    are refused (a per-unit group always has a row, so no sum is NULL)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if array.null_count:
        raise ValueError("an engine returned a NULL per-unit value")
    if pa.types.is_integer(array.type):
        values: np.ndarray = array.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        if pa.types.is_unsigned_integer(array.type) and array.type.bit_width == 64:
            raise ValueError("an engine returned an unsigned 64-bit column")
        return values
    if not (pa.types.is_decimal128(array.type) and array.type.scale == 0):
        raise TypeError(f"an engine returned a non-integer column: {array.type}")
    if sys.byteorder != "little":  # the (low, high) word order below is Arrow's on little-endian hosts
        return np.array([int(value) for value in array.to_pylist()], dtype=object)
    words = np.frombuffer(array.buffers()[1], dtype=np.int64)[
        2 * array.offset : 2 * (array.offset + len(array))
    ]
    low, high = words[0::2], words[1::2]
    if (high == (low >> 63)).all():
        return low.copy()
    exact: np.ndarray = high.astype(object) * (1 << 64) + low.view(np.uint64).astype(object)
    return exact
