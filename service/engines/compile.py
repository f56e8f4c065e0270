"""One compiler from an :class:`~mechanisms.data.plan.Aggregation` to SQL, rendered for DuckDB and for Spark.

The plan is compiled **once** (cached per plan and column types) into a neutral sqlglot expression tree
built with ``sqlglot.exp`` builders; :meth:`CompiledPlan.sql` renders it with sqlglot's generator for each
dialect. The tree reads from a table called :data:`SOURCE` (the DuckDB engine swaps in
``read_parquet(?)``, the Spark engine names a temp view so) and joins one small table per bucket key
(:class:`CandidateTable`, registered by the engine).

Why every engine returns exactly :func:`~mechanisms.data.plan.evaluate_numpy`'s integers (the exactness
argument, step by step; each step names the NumPy operation it mirrors):

* **No decimal literal ever reaches an engine.** A double is written ``CAST('<repr(x)>' AS DOUBLE)``:
  ``repr`` is the shortest string that round-trips, and both engines parse it correctly rounded (DuckDB's
  fast_float, Java's ``Double.parseDouble``), so the constant is the very double NumPy uses. A bare ``0.5``
  would be a DECIMAL in DuckDB. Integers are integer literals (|v| ≤ 2^63).
* **Clip** (``np.clip``): ``LEAST(GREATEST(x, low), high)`` returns one of its inputs (no rounding); int
  columns are clipped in BIGINT with ``int(low)``, ``int(high)`` as NumPy does. Values are never NaN (the
  snapshot rejects them); a ±0.0 sign difference after clipping changes no comparison and no integer below.
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
  ``clip(ceil(t), 0, K)`` equals ``ceil(clip(t, 0, K))`` because the clip bounds are integers and ceil is
  monotone, and clipping first keeps Spark's BIGINT ``CEIL`` from ever seeing ±inf. The two corrections
  read ``c[j0 − 1]`` and ``c[j0]`` from a candidates table (j, c_prev, c_at) with −inf/+inf at the ends
  (exactly NumPy's padded arrays) by an equi-join on j = j0, which matches exactly one row.
* **Cells** are BIGINT ``Σ index_i·Π_{j>i} size_j`` as in ``_cells``.
* **Sums** are exact integers: ``COUNT(*)`` (BIGINT), DuckDB ``SUM(BIGINT)`` → HUGEINT (128-bit, raises on
  overflow), Spark ``SUM(CAST(v AS DECIMAL(38, 0)))`` under ANSI mode (raises on overflow, never wraps).
  sqlglot would render ``SUM`` unchanged for Spark, where ``SUM(BIGINT)`` is a 64-bit sum that can
  overflow (an error under ANSI, but not an answer): that one piece is rewritten per dialect
  (:func:`_exact_sums`).

A plan whose floats are NaN (or, outside candidates, infinite) is refused with ``ValueError``: NumPy and the
engines order NaN differently, so no exact agreement is possible for it, and ``normalise`` never builds one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from sqlglot import exp

from mechanisms.data.plan import Aggregation, Answer, Bucket, Key, Predicate, Sum

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


@dataclass(frozen=True, eq=False)
class CompiledPlan:
    """A plan's neutral query tree and what an engine must register to run it."""

    plan: Aggregation
    query: exp.Select
    candidates: tuple[CandidateTable, ...]
    columns: tuple[str, ...]
    """The snapshot columns read (the projection)."""

    @property
    def grouped(self) -> bool:
        return bool(self.plan.keys)

    @cached_property
    def duckdb_sql(self) -> str:
        """The query for DuckDB, reading ``read_parquet(?)`` (the snapshot's path is the one parameter)."""
        source = exp.Table(this=exp.ReadParquet(expressions=[exp.Placeholder()]))
        return _with_source(self.query, source).sql(dialect="duckdb")

    @cached_property
    def spark_sql(self) -> str:
        """The query for Spark, reading the temp view :data:`SOURCE`."""
        return _exact_sums_spark(self.query.copy()).sql(dialect="spark")

    def sql(self, dialect: Dialect) -> str:
        """The query for ``dialect``, rendered once per plan."""
        return self.duckdb_sql if dialect == "duckdb" else self.spark_sql

    def answer(self, rows: Iterable[Sequence[object]]) -> Answer:
        """The dense :data:`Answer` from the engine's result rows ((cell,)? then one value per sum)."""
        return dense_answer(self.plan, rows)


def _with_source(query: exp.Select, source: exp.Expression) -> exp.Expression:
    def swap(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Table) and node.name == SOURCE:
            return source.copy()
        return node

    swapped: exp.Expression = query.copy().transform(swap)
    return swapped


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


def compile_plan(plan: Aggregation, kinds: Mapping[str, ColumnKind]) -> CompiledPlan:
    """Compile ``plan`` for a snapshot whose columns have ``kinds`` (cached per plan and kinds)."""
    needed = plan.columns()
    missing = [name for name in needed if name not in kinds]
    if missing:
        raise ValueError(f"the snapshot has no column {missing[0]!r}")
    return _compile(plan, tuple((name, kinds[name]) for name in needed))


@lru_cache(maxsize=256)
def _compile(plan: Aggregation, kinds: tuple[tuple[str, ColumnKind], ...]) -> CompiledPlan:
    return _Compiler(plan, dict(kinds)).build()


class _Compiler:
    """Builds the query in four nested selects (DuckDB and Spark merge the projections):

    1. ``clipped``: the plan's columns from :data:`SOURCE`, clipped, as c0, c1, …
    2. ``selected``: the ``where`` filter; per key its code index or the bucket's (x, j0); per sum its
       pre-scale double ``y`` (grid) or BIGINT value (int_sum);
    3. ``cells``: joins the candidate tables; the cell index; the scaled doubles ``s``;
    4. the aggregate: ``COUNT(*)`` / ``SUM(unit)`` per cell (grouped by cell when there are keys).
    """

    def __init__(self, plan: Aggregation, kinds: Mapping[str, ColumnKind]) -> None:
        self.plan = plan
        self.kinds = kinds
        self.names = {name: f"c{i}" for i, name in enumerate(plan.columns())}

    # layer 1
    def _clip(self, name: str) -> exp.Expression:
        source = _col(name)
        bound = self.plan.bound(name)
        if self.kinds[name] == "int":
            value: exp.Expression = exp.cast(source, _BIGINT)
            if bound is not None:
                int_low, int_high = (integer(int(_finite(b))) for b in bound)
                value = exp.func("LEAST", exp.func("GREATEST", value, int_low), int_high)
            return value
        if bound is None:
            return source
        low, high = bound
        clipped: exp.Expression = source
        if low != -math.inf:  # clipping to −inf (+inf) is the identity on finite values
            clipped = exp.func("GREATEST", clipped, double(low))
        if high != math.inf:
            clipped = exp.func("LEAST", clipped, double(high))
        return clipped

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
        if cell is not None:
            aggregates.append(_col("cell"))
        for i, s in enumerate(plan.sums):
            aggregates.append(self._sum(i, s, selected, cells_select).as_(f"s{i}"))

        conditions = [c for c in map(self._predicate, plan.where) if c is not None]
        if not selected:
            selected.append(exp.Literal.number(0).as_("unused"))
        rows = exp.select(*selected).from_(exp.alias_(exp.paren(clipped), "clipped"))
        if conditions:
            rows = rows.where(exp.and_(*conditions))
        if not cells_select:
            cells_select.append(exp.Literal.number(0).as_("unused"))
        cells = exp.select(*cells_select).from_(exp.alias_(exp.paren(rows), "selected"))
        for table, on in joins:
            cells = cells.join(exp.to_table(table), on=on, join_type="inner")
        query = exp.select(*aggregates).from_(exp.alias_(exp.paren(cells), "cells"))
        if cell is not None:
            query = query.group_by(_col("cell"))
        return CompiledPlan(plan, query, tuple(candidates), tuple(self.names))

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
        table = candidate_table(f"expost_candidates_{k}", bucket)
        candidates.append(table)
        n = len(bucket.candidates)
        x = self._as_double(key.column)
        t = exp.Mul(
            this=exp.paren(exp.Sub(this=x, expression=double(bucket.low))),
            expression=double(bucket.inverse),
        )
        clipped_t = exp.func("LEAST", exp.func("GREATEST", t, double(0.0)), double(float(n)))
        selected.append(x.copy().as_(f"x{k}"))
        selected.append(exp.cast(exp.Ceil(this=clipped_t), _BIGINT).as_(f"j{k}"))
        j0 = _col(f"j{k}", "selected")
        joins.append((table.name, exp.EQ(this=_col("j", table.name), expression=j0)))
        x_ref = _col(f"x{k}", "selected")
        below = _flag(exp.LTE(this=x_ref, expression=_col("c_prev", table.name)))
        above = _flag(exp.LT(this=_col("c_at", table.name), expression=x_ref.copy()))
        return exp.paren(exp.Add(this=exp.Sub(this=j0.copy(), expression=below), expression=above))

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


def candidate_table(name: str, bucket: Bucket) -> CandidateTable:
    """The (j, c_prev, c_at) table of ``bucket`` (NaN candidates are refused: module docstring)."""
    values = np.asarray(bucket.candidates, dtype=np.float64)
    if values.size == 0 or np.isnan(values).any():
        raise ValueError("a bucket needs at least one candidate, and no NaN")
    _finite(bucket.low), _finite(bucket.inverse)
    prev = np.concatenate([[-np.inf], values])
    at = np.concatenate([values, [np.inf]])
    table = pa.table(
        {
            "j": pa.array(np.arange(values.size + 1, dtype=np.int64)),
            "c_prev": pa.array(prev),
            "c_at": pa.array(at),
        }
    )
    return CandidateTable(name, table)


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
    from decimal import Decimal

    if isinstance(value, Decimal) and value == value.to_integral_value():
        return int(value)
    raise TypeError(f"an engine returned a non-integer sum: {value!r}")
