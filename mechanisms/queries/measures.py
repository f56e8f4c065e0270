"""Several measures in one request, optionally grouped by categorical columns (contingency tables).

Measures: ``count``, ``sum(col)``, ``mean(col)``, ``variance(col)``, ``std(col)``. They are post-processing of
a few **blocks**, each the per-cell sum of one per-row value y over the selected rows
(docs/privacy/analytics.md#grouped-measures,
docs/mechanisms/analytics.md):

* ``count``: y = 1 (bounds [1, 1]), an integer.
* ``sum(col)``: y = x (bounds [min, max]), an integer for int columns.
* ``csum(col)``: y = fl(x − c), c the float midpoint of [min, max], |y| ≤ H = float_up(max(|min − c|,
  |max − c|)) (rounding is monotone, so the bound holds for the computed value): mean and variance.
* ``csumsq(col)``: y = fl(fl(x − c)²) ∈ [0, float_up(H²)]: variance.

mean = c + csum/N, variance = csumsq/N − (csum/N)², std = √variance (clamped to their ranges), with N the
public row count when the row count is public and there is neither ``where`` nor ``group_by`` (replace-one),
else the noisy count of the cell (at least 1). Cells are the product of the group-by columns' **declared**
values (public domain): every cell is released, empty or not, and no key comes from the data.

Sensitivity of a block with per-row bounds [lo, hi], M = max(|lo|, |hi|), R = hi − lo, over G cells: the
moving coordinates of one neighbour step are one of the cases
  add-remove: one cell by ≤ M;
  replace-one: one cell by ≤ R (same cell), one cell by ≤ M (the row leaves/enters the selection: only with
  ``where``), two cells by ≤ M each (the row moves between cells: only with G > 1).
ℓ1 and ℓ2 of a block are the maxima over its cases. On the grid (``language.unit_shift``) each moving
coordinate becomes an integer m ≤ ⌊shift/γ + 1/64⌋ + 1 (exactly shift on γ = 1 for integer blocks).

Laplace (``measures.laplace``): ε split equally over the B noisy blocks, block b gets discrete Laplace of
scale t_b = dyadic_scale_up(L1_b/ε_b) grid units (L1_b the grid ℓ1), so it is (L1_b/t_b ≤ ε_b)-DP; the blocks
compose to ε. Gaussian (``measures.gaussian``): block b gets discrete Gaussian with σ_b = z·L2_b grid units
(s² rounded up), RDP α·L2_b²/(2σ_b²) = α/(2z²) per block, summed. A block that cannot move (the count of a
replace-one table without where or group-by: the public n) is released exactly and charged nothing.
Ex-post = worst case for every outcome.

Intervals (``confidence``, default 0.95; ``mechanisms.queries.measure_intervals``,
docs/mechanisms/analytics.md#measure-intervals): per cell and measure, from each block's public noise law and
grid; means, variances and std by a union bound over their blocks (listed in ``union_bound``). Free.

Individual accounting (``accounting: individual``; docs/privacy/individual.md#individual-measures-proof):
every block is a per-cell sum of per-row values, so one unit moves each block's cells by its own
per-(unit, cell) sums only; each unit is charged Σ_b ‖m_{u,b}‖₁/t_b (Laplace) or α·Σ_b ‖m_{u,b}‖²/(2σ_b²)
(Gaussian) from its own cells, the units that cannot afford it are left out before the blocks are computed,
and the measures (means, variances included) are post-processing of the released blocks as before.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any, ClassVar, Literal, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, model_validator

from mechanisms.accounting import UNITS_PER_EPSILON, RdpCurve, units_up
from mechanisms.accounting.individual import UnitCharges, pure_units, slope_units
from mechanisms.base import ParamsChecked, ParamsError, PublicContext, Release, Table
from mechanisms.data.plan import (
    Aggregation,
    Answer,
    Key,
    Sum,
    UnitAnswer,
    aggregate,
    aggregate_units,
    clip_bounds,
    grid_bits,
)
from mechanisms.data.schema import CategoricalColumn, FloatColumn, IntColumn
from mechanisms.noise import Grid, Noise, dyadic_scale_up, float_up, laplace_grid
from mechanisms.queries.individual import (
    IndividualTable,
    individual_table,
    integer_unit_shifts,
    real_unit_shifts,
)
from mechanisms.queries.intervals import (
    ConfidenceLevel,
    discrete_gaussian_quantile,
    discrete_laplace_quantile,
    union_level,
)
from mechanisms.queries.language import (
    FLOAT_SLACK,
    MAX_SCALE_BITS,
    MIN_GRID_EXPONENT,
    RANGE_BITS,
    Where,
    center,
    charged_fraction,
    check_where,
    clamped_units,
    l2,
    real_sum_terms,
    real_sum_value,
    unit_bound,
    unit_shift,
    where_plan,
)
from mechanisms.queries.measure_intervals import BlockLaw, MeasureSpec, measure_intervals

MAX_MEASURES = 16
MAX_GROUP_COLUMNS = 4
MAX_CELLS = 10_000
VARIANCE_BITS = 12

BlockKind = Literal["count", "units", "sum", "csum", "csumsq"]
BLOCK_ORDER: tuple[BlockKind, ...] = ("count", "units", "sum", "csum", "csumsq")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Measure(_Frozen):
    """One aggregate: ``count`` (no column), ``sum``/``mean``/``variance``/``std`` of a numeric column, or
    ``count_distinct`` of the privacy unit's column (the number of distinct units, SQL ``COUNT(DISTINCT
    unit)``; docs/privacy/units_learners.md#count-distinct-unit)."""

    kind: Literal["count", "sum", "mean", "variance", "std", "count_distinct"]
    column: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _column_matches_kind(self) -> Self:
        if (self.kind == "count") != (self.column is None):
            raise ValueError("count takes no column; sum, mean, variance and std need one")
        return self

    @property
    def label(self) -> str:
        return "count" if self.column is None else f"{self.kind}({self.column})"


class _MeasuresBase(_Frozen):
    measures: tuple[Measure, ...] = Field(min_length=1, max_length=MAX_MEASURES)
    group_by: tuple[str, ...] = Field(default=(), max_length=MAX_GROUP_COLUMNS)
    where: Where = ()
    confidence: ConfidenceLevel = 0.95

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        labels = [m.label for m in self.measures]
        if len(set(labels)) != len(labels):
            raise ValueError("measures must be distinct")
        if len(set(self.group_by)) != len(self.group_by):
            raise ValueError("group_by columns must be distinct")
        return self


class MeasuresLaplaceParams(_MeasuresBase):
    epsilon: StrictFloat = Field(
        gt=0, le=100, allow_inf_nan=False, description="pure-DP ε of the whole request (split over blocks)"
    )


class MeasuresGaussianParams(_MeasuresBase):
    noise_multiplier: StrictFloat = Field(
        gt=0, le=1e6, allow_inf_nan=False, description="σ/ℓ2-sensitivity per block: α/(2z²) per block"
    )


AnyMeasuresParams = MeasuresLaplaceParams | MeasuresGaussianParams


# ----- blocks and their sensitivity (public information only) ----------------------------------------------
@dataclass(frozen=True)
class Block:
    """A per-cell sum of y over the selected rows, with public per-row bounds [lo, hi] on y."""

    kind: BlockKind
    column: str | None
    lo: Fraction
    hi: Fraction
    integer: bool
    center: float = 0.0

    @property
    def label(self) -> str:
        return self.kind if self.column is None else f"{self.kind}({self.column})"


def numeric_column(ctx: PublicContext, name: str, field: str) -> FloatColumn | IntColumn:
    column = ctx.schema.column(name)
    if column is None:
        raise ParamsError(field, f"unknown column {name!r}")
    if isinstance(column, CategoricalColumn):
        raise ParamsError(field, f"needs a float or int column, {name!r} is categorical")
    return column


def public_size(p: _MeasuresBase, ctx: PublicContext) -> int | None:
    """The public N of mean/variance: n under replace-one without where and group-by, else None."""
    if ctx.schema.neighboring == "replace_one" and not p.where and not p.group_by and ctx.n_rows:
        return ctx.n_rows
    return None


def blocks(p: _MeasuresBase, ctx: PublicContext) -> tuple[Block, ...]:
    """The distinct blocks the measures need, in a fixed order (count first when needed)."""
    needed: dict[str, Block] = {}
    denominator = public_size(p, ctx) is None

    def add(block: Block) -> None:
        needed.setdefault(block.label, block)

    for index, measure in enumerate(p.measures):
        if measure.column is None:
            add(Block("count", None, Fraction(1), Fraction(1), True))
            continue
        if measure.kind == "count_distinct":
            add(_units_block(ctx, measure.column, f"measures.{index}.column"))
            continue
        column = numeric_column(ctx, measure.column, f"measures.{index}.column")
        unit = ctx.schema.privacy_unit
        if unit is not None and column.name == unit.column:
            reason = f"{unit.column!r} identifies the privacy unit; it is not a measure"
            raise ParamsError(f"measures.{index}.column", reason)
        integer = isinstance(column, IntColumn)
        if measure.kind == "sum":
            add(Block("sum", column.name, Fraction(column.min), Fraction(column.max), integer))
            continue
        if denominator:
            add(Block("count", None, Fraction(1), Fraction(1), True))
        c, h = center(column)
        add(Block("csum", column.name, -h, h, False, c))
        if measure.kind in ("variance", "std"):
            add(Block("csumsq", column.name, Fraction(0), Fraction(float_up(h * h)), False, c))
    return tuple(sorted(needed.values(), key=lambda b: BLOCK_ORDER.index(b.kind)))


def _units_block(ctx: PublicContext, name: str, field: str) -> Block:
    """The block of ``count_distinct(name)``: only of the privacy unit's column (the one column whose
    distinct count has a proven sensitivity)."""
    unit = ctx.schema.privacy_unit
    if unit is None:
        raise ParamsError(field, "count_distinct counts privacy units; this dataset declares none")
    if name != unit.column:
        raise ParamsError(field, f"count_distinct is only of the privacy unit's column {unit.column!r}")
    return Block("units", name, Fraction(1), Fraction(1), True)


def cells(p: _MeasuresBase, ctx: PublicContext) -> list[CategoricalColumn]:
    columns = []
    for index, name in enumerate(p.group_by):
        column = ctx.schema.column(name)
        if column is None:
            raise ParamsError(f"group_by.{index}", f"unknown column {name!r}")
        if not isinstance(column, CategoricalColumn):
            raise ParamsError(f"group_by.{index}", f"group by needs a categorical column, {name!r} is not")
        columns.append(column)
    if math.prod(len(c.values) for c in columns) > MAX_CELLS:
        raise ParamsError("group_by", f"more than {MAX_CELLS} cells (the product of the declared domains)")
    return columns


def block_cases(
    block: Block, ctx: PublicContext, has_where: bool, n_cells: int
) -> tuple[tuple[float, ...], ...]:
    """The moving coordinates of one neighbour step (module docstring), as value shifts."""
    m = float_up(max(abs(block.lo), abs(block.hi)))
    r = float_up(block.hi - block.lo)
    unit = ctx.schema.privacy_unit
    if block.kind == "units":  # cells move by 0 or 1 (docs/privacy/units_learners.md#count-distinct-unit)
        assert unit is not None
        rows = unit.max_rows if ctx.schema.neighboring == "add_remove" else 2 * unit.max_rows
        return ((1.0,) * min(rows, n_cells),)
    # a unit's ≤ k kept rows, in any cells (docs/privacy/units.md#lemma-unit, Lemma UNIT)
    if unit is not None:
        k = unit.max_rows
        km = float_up(k * max(abs(block.lo), abs(block.hi)))
        if ctx.schema.neighboring == "add_remove":
            return ((km,),)  # ℓ1 and ℓ2 ≤ k·M: the most when all in one cell
        same_sign = block.lo >= 0 or block.hi <= 0  # per-cell sums of each side share a sign: ℓ2² ≤ 2(kM)²
        return ((km, km),) if same_sign else ((float_up(2 * k * max(abs(block.lo), abs(block.hi))),),)
    if ctx.schema.neighboring == "add_remove":
        return ((m,),)
    cases: list[tuple[float, ...]] = [(r,)]
    if has_where:
        cases.append((m,))
    if n_cells > 1:
        cases.append((m, m))
    return tuple(cases)


@dataclass(frozen=True)
class BlockPlan:
    block: Block
    grid: Grid
    exact: bool
    unit_cases: tuple[tuple[int, ...], ...]
    spread: tuple[int, float] | None = None
    """(ℓ1, ℓ2) in grid units of a real block on a dataset with a privacy unit, whose change may spread over
    several cells, each rounded (``plan_block``); None: the cases' own sums."""

    @property
    def l1_units(self) -> int:
        if self.spread is not None:
            return self.spread[0]
        return max(sum(case) for case in self.unit_cases)

    @property
    def l2_units(self) -> float:
        if self.spread is not None:
            return self.spread[1]
        return max(l2(float(m) for m in case) for case in self.unit_cases)

    @property
    def moves(self) -> bool:
        return self.l1_units > 0


def _grid_at_least(size: float) -> Grid:
    mantissa, exponent = math.frexp(size)
    return Grid(exponent - 1 if mantissa == 0.5 else exponent)


def plan_block(block: Block, ctx: PublicContext, has_where: bool, n_cells: int, coarsest: float) -> BlockPlan:
    """The public grid of a block (``language.plan_grid``'s rule, over the block's cases)."""
    cases = block_cases(block, ctx, has_where, n_cells)
    l1_value = max(float_up(sum((Fraction(s) for s in case), Fraction(0))) for case in cases)
    dim = max(len(case) for case in cases)
    integer_shifts = all(float(s).is_integer() for case in cases for s in case)
    if l1_value == 0.0:
        grid = Grid(0)
    else:
        grid = laplace_grid(l1_value, dim, integer_valued=block.integer and integer_shifts)
    floors = [coarsest]
    if ctx.n_rows is not None:
        bound = float_up(ctx.n_rows * max(abs(block.lo), abs(block.hi)))
        if bound > 0.0:
            floors.append(math.ldexp(bound, -RANGE_BITS))
    for floor in floors:
        if floor > grid.granularity and math.isfinite(floor):
            grid = _grid_at_least(floor)
    if grid.exponent < MIN_GRID_EXPONENT:
        raise ParamsError("measures", "the sensitivity is too small for an exact release grid (γ < 2^-1000)")
    exact = block.integer and grid.exponent <= 0
    units = tuple(tuple(unit_shift(s, grid, exact) for s in case) for case in cases)
    spread = None
    if ctx.schema.privacy_unit is not None and not exact and l1_value > 0.0:
        spread = unit_spread(cases, grid, ctx.schema.privacy_unit.max_rows, ctx.schema.neighboring, n_cells)
    return BlockPlan(block, grid, exact, units, spread)


def unit_spread(
    cases: tuple[tuple[float, ...], ...], grid: Grid, k: int, neighboring: str, n_cells: int
) -> tuple[int, float]:
    """(ℓ1, ℓ2) in grid units of a real block when one unit's ≤ k rows (2k when replaced) may sit in c =
    min(rows, cells) cells: each moved cell's computed value moves by its exact change plus the rows'
    rounding (≤ 2^-7 in all, the row units being k times finer, ``query_plan``), and its rounding to the
    grid adds < 1, so ℓ1 ≤ ⌊S₁/γ + 1/64⌋ + c and ℓ2 ≤ S₂/γ + 1/64 + √c, with S₁, S₂ the cases' ℓ1 and ℓ2
    (docs/privacy/units.md#lemma-unit, Lemma UNIT)."""
    rows = k if neighboring == "add_remove" else 2 * k
    moved = min(rows, n_cells)
    gamma = Fraction(grid.granularity)
    s1 = max(sum((Fraction(x) for x in case), Fraction(0)) for case in cases)
    s2 = max(Fraction(l2(case)) for case in cases)
    l1_units = math.floor(s1 / gamma + FLOAT_SLACK) + moved
    l2_units = float_up(s2 / gamma + FLOAT_SLACK + Fraction(math.sqrt(moved)) * (1 + Fraction(1, 2**50)))
    return l1_units, l2_units


def _check(p: _MeasuresBase, ctx: PublicContext) -> tuple[tuple[Block, ...], list[CategoricalColumn]]:
    check_where(p.where, ctx)
    return blocks(p, ctx), cells(p, ctx)


@lru_cache(maxsize=1024)
def laplace_plans(
    p: MeasuresLaplaceParams, ctx: PublicContext
) -> tuple[tuple[BlockPlan, Fraction | None], ...]:
    """Per block: its plan and discrete Laplace scale t_b (None: the block cannot move, released exactly)."""
    block_list, columns = _check(p, ctx)
    n_cells = math.prod(len(c.values) for c in columns)
    probe = [plan_block(b, ctx, bool(p.where), n_cells, 0.0) for b in block_list]
    noisy = sum(1 for plan in probe if plan.moves)
    eps_each = charged_fraction(p.epsilon) / max(noisy, 1)
    too_small = ParamsError("epsilon", "too small: the Laplace noise would not fit the release grid")
    if eps_each < Fraction(1, 1 << (MAX_SCALE_BITS - 1)):
        raise too_small
    result: list[tuple[BlockPlan, Fraction | None]] = []
    for block, first in zip(block_list, probe, strict=True):
        if not first.moves:
            result.append((first, None))
            continue
        l1_value = max(sum(case) for case in block_cases(block, ctx, bool(p.where), n_cells))
        try:
            coarsest = math.ldexp(float(Fraction(l1_value) / eps_each), 2 - MAX_SCALE_BITS)
        except OverflowError:
            raise too_small from None
        plan = plan_block(block, ctx, bool(p.where), n_cells, coarsest)
        scale = dyadic_scale_up(Fraction(plan.l1_units) / eps_each)
        if scale > 1 << MAX_SCALE_BITS:
            raise too_small
        result.append((plan, scale))
    return tuple(result)


def laplace_measures_curve(p: MeasuresLaplaceParams, ctx: PublicContext) -> RdpCurve:
    """``pure_product`` of the blocks' L1_b/t_b (each ≤ ε_b, Σ ≤ ε), capped at ε."""
    epsilons = [float_up(Fraction(plan.l1_units) / t) for plan, t in laplace_plans(p, ctx) if t is not None]
    curve = RdpCurve.pure_product(epsilons or [0.0], ctx.orders)
    return RdpCurve(curve.orders, tuple(min(v, p.epsilon) for v in curve.values), p.epsilon)


@lru_cache(maxsize=1024)
def gaussian_plans(
    p: MeasuresGaussianParams, ctx: PublicContext
) -> tuple[tuple[BlockPlan, float, Fraction] | tuple[BlockPlan, None, None], ...]:
    """Per block: plan, σ in grid units (z·L2_b) and s² (rounded up); (plan, None, None) for a fixed block."""
    block_list, columns = _check(p, ctx)
    n_cells = math.prod(len(c.values) for c in columns)
    result: list[tuple[BlockPlan, float, Fraction] | tuple[BlockPlan, None, None]] = []
    for block in block_list:
        cases = block_cases(block, ctx, bool(p.where), n_cells)
        l2_value = max(l2(case) for case in cases)
        if l2_value == 0.0:
            result.append((plan_block(block, ctx, bool(p.where), n_cells, 0.0), None, None))
            continue
        coarsest = math.ldexp(p.noise_multiplier * l2_value * 2.0, -MAX_SCALE_BITS)
        plan = plan_block(block, ctx, bool(p.where), n_cells, coarsest)
        sigma_units = math.nextafter(p.noise_multiplier * plan.l2_units, math.inf)
        if not sigma_units <= float(1 << (MAX_SCALE_BITS + 1)):
            raise ParamsError("noise_multiplier", "too large: the noise would not fit the release grid")
        variance = dyadic_scale_up(Fraction(sigma_units) ** 2, bits=VARIANCE_BITS)
        result.append((plan, sigma_units, variance))
    return tuple(result)


def gaussian_measures_curve(p: MeasuresGaussianParams, ctx: PublicContext) -> RdpCurve:
    """Σ_b RdpCurve.gaussian(L2_b, σ_b) over the noisy blocks (composition)."""
    total = RdpCurve.zero(ctx.orders)
    for plan, sigma, _ in gaussian_plans(p, ctx):
        if sigma is not None:
            total = total + RdpCurve.gaussian(plan.l2_units, sigma, ctx.orders)
    return total


# ----- evaluation: one aggregation plan for every block (mechanisms.data.plan) ---------------------------
def block_terms(plan: BlockPlan, ctx: PublicContext) -> tuple[Sum, ...]:
    """The plan's sums whose exact combination is the block's per-cell total (``block_total``)."""
    block = plan.block
    if block.kind == "count":
        return (Sum("count"),)
    if block.kind == "units":
        return (Sum("distinct_units", block.column),)
    column = numeric_column(ctx, str(block.column), "measures")
    unit = Fraction(plan.grid.granularity) / ctx.schema.unit_rows  # k rows may change: k times finer
    if block.kind == "sum":
        if isinstance(column, IntColumn):
            return (Sum("int_sum", column.name),)
        return real_sum_terms(column, unit)
    magnitude = block.hi if block.kind == "csumsq" else max(abs(block.lo), abs(block.hi))
    exponent = grid_bits(magnitude, unit)
    return (Sum("grid_sum", column.name, block.center, block.kind == "csumsq", exponent),)


def block_total(terms: tuple[Sum, ...], values: tuple[int, ...]) -> Fraction:
    """The exact per-cell total a block's terms stand for: the count or int sum itself, else
    c·count + 2^e·Σ u(x − c) (a float sum) or 2^e·Σ u(y) (csum, csumsq)."""
    if len(terms) == 1 and terms[0].kind != "grid_sum":
        return Fraction(values[0])
    return real_sum_value(terms, values)


def measures_plan(
    p: _MeasuresBase, ctx: PublicContext, plans: list[BlockPlan]
) -> tuple[Aggregation, list[tuple[int, ...]], list[CategoricalColumn]]:
    """One aggregation for every block (each distinct term once), the positions of each block's terms
    among the plan's sums, and the group-by columns."""
    columns = cells(p, ctx)
    sums: list[Sum] = []
    positions = []
    for plan in plans:
        terms = block_terms(plan, ctx)
        for term in terms:
            if term not in sums:
                sums.append(term)
        positions.append(tuple(sums.index(term) for term in terms))
    keys = tuple(Key(c.name, len(c.values)) for c in columns)
    read = [c.column for c in p.where] + [str(s.column) for s in sums if s.column is not None]
    bounds = clip_bounds(ctx.schema, read)
    aggregation = Aggregation(where_plan(p.where, ctx), keys, tuple(sums), bounds, unit_bound(ctx))
    return aggregation, positions, columns


def evaluate_blocks(
    p: _MeasuresBase, ctx: PublicContext, table: Table, plans: list[BlockPlan]
) -> tuple[list[np.ndarray], list[CategoricalColumn]]:
    """The exact (noise-free) grid units of every block, per cell: ⌊clamp(total/γ, ±2^44) + ½⌋."""
    aggregation, positions, columns = measures_plan(p, ctx, plans)
    return _block_units(plans, positions, aggregation, aggregate(table, aggregation)), columns


def _block_units(
    plans: list[BlockPlan], positions: list[tuple[int, ...]], aggregation: Aggregation, answer: Answer
) -> list[np.ndarray]:
    """Per block, ⌊clamp(total/γ, ±2^44) + ½⌋ of each cell's exact total (``block_total``)."""
    units = []
    for plan, where in zip(plans, positions, strict=True):
        terms = tuple(aggregation.sums[i] for i in where)
        per_cell = zip(*(answer[i] for i in where), strict=True)
        totals = [block_total(terms, values) for values in per_cell]
        units.append(np.array([clamped_units(t, plan.grid) for t in totals], dtype=np.int64))
    return units


# ----- individual accounting (docs/privacy/individual.md#individual-measures-proof) ---------------------
BlockCharge = Callable[[int, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
"""(block index, per-unit ℓ1, per-unit ℓ2² of that block's shift in grid units) → the block's (pure, slope)
charge per unit, in ledger units."""


@dataclass(frozen=True)
class MeasuresUnitStep:
    """One release's per-unit outcome: every block's grid units per cell over the admitted units, the
    group-by columns, the admitted units' charges and how many units were left out (secret)."""

    blocks: list[np.ndarray]
    columns: list[CategoricalColumn]
    charges: UnitCharges
    excluded: int


def block_unit_shifts(plan: BlockPlan, terms: tuple[Sum, ...], values: tuple[np.ndarray, ...]) -> np.ndarray:
    """Per (unit, cell) row an integer bound m on how far removing the unit moves the cell's grid units.

    Integer blocks (count, distinct units, int sum): Δ is the unit's integer sum; m = ⌈|Δ|/γ⌉, which is
    |Δ|/γ (the exact change) on an exact grid (γ ≤ 1) and bounds ⌊a + ½⌋ − ⌊b + ½⌋ on a coarser one. Real
    blocks: Δ = c·n + 2^e·U computed in doubles with an absolute error ≤ 2^-50·(|c·n| + |2^e·U|),
    m = ⌊(|Δ| + error)/γ⌋ + 1 (rounding to the grid moves by at most one unit more; clamping at ±2^44 units
    only shrinks changes). Capped at the block's public ℓ1 bound, which bounds every cell's change too."""
    if len(terms) == 1 and terms[0].kind != "grid_sum":
        return integer_unit_shifts(values[0], plan.grid.exponent, plan.l1_units)
    counts = values[0] if terms[0].kind == "count" else 0.0
    return real_unit_shifts(counts, values[-1], terms[-1], plan.grid.exponent, plan.l1_units)


def measures_unit_step(
    p: _MeasuresBase,
    ctx: PublicContext,
    table: IndividualTable,
    plans: list[BlockPlan],
    block_charge: BlockCharge,
    ceiling: int,
) -> MeasuresUnitStep:
    """Every unit's own shift per block (``aggregate_units``: its kept rows per cell), its charge summed over
    the blocks (pure capped at ``ceiling``, the request's ε), the Feldman–Zrnic exclusion, then the blocks
    over the admitted units' rows only: the release on the data without the excluded units."""
    aggregation, positions, columns = measures_plan(p, ctx, plans)
    answer = aggregate_units(table.table, aggregation)
    units, first = np.unique(answer.units, return_index=True)
    pure = np.zeros(units.size, dtype=np.int64)
    slope = np.zeros(units.size, dtype=np.int64)
    for index, (plan, where) in enumerate(zip(plans, positions, strict=True)):
        if units.size == 0:
            break
        terms = tuple(aggregation.sums[i] for i in where)
        rows = block_unit_shifts(plan, terms, tuple(answer.sums[i] for i in where))
        l1 = np.minimum(np.add.reduceat(rows, first), plan.l1_units)
        squares = np.minimum(np.add.reduceat(rows.astype(np.float64) ** 2, first), float(plan.l2_units) ** 2)
        block_pure, block_slope = block_charge(index, l1, squares)
        pure, slope = pure + block_pure, slope + block_slope
    step = UnitCharges(units, np.minimum(pure, ceiling), slope)
    admitted = table.filter.admits(step)
    keep = np.repeat(admitted, np.diff(np.append(first, answer.units.size)))
    kept = UnitAnswer(answer.units[keep], answer.cells[keep], tuple(values[keep] for values in answer.sums))
    n_cells = math.prod(len(c.values) for c in columns)
    blocks_units = _block_units(plans, positions, aggregation, kept.cell_totals(n_cells))
    excluded = int(units.size - int(admitted.sum()))
    return MeasuresUnitStep(blocks_units, columns, step.subset(admitted), excluded)


def laplace_block_charge(planned: tuple[tuple[BlockPlan, Fraction | None], ...]) -> BlockCharge:
    """Block b: pure ‖m_{u,b}‖₁/t_b (discrete Laplace at integer shifts, every outcome), at most the block's
    own L1_b/t_b; a block released exactly (None) costs nothing."""

    def charge(index: int, l1: np.ndarray, squares: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        plan, scale = planned[index]
        zeros = np.zeros(l1.size, dtype=np.int64)
        if scale is None:
            return zeros, zeros
        per_shift = float_up(Fraction(UNITS_PER_EPSILON) / scale)
        cap = units_up(float_up(Fraction(plan.l1_units) / scale)) or 0
        return np.minimum(pure_units(l1, per_shift), cap), zeros

    return charge


def gaussian_block_charge(
    planned: tuple[tuple[BlockPlan, float, Fraction] | tuple[BlockPlan, None, None], ...],
) -> BlockCharge:
    """Block b: α·‖m_{u,b}‖²/(2σ_b²) (CKS 2020 at the unit's own integer shift; the noise's s² ≥ σ_b²), kept
    as its slope, at most the block's own L2_b²/(2σ_b²)."""

    def charge(index: int, l1: np.ndarray, squares: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        plan, sigma, _ = planned[index]
        zeros = np.zeros(l1.size, dtype=np.int64)
        if sigma is None:
            return zeros, zeros
        two_s2 = 2 * Fraction(sigma) ** 2
        per_square = float_up(Fraction(UNITS_PER_EPSILON) / two_s2)
        cap = units_up(float_up(Fraction(plan.l2_units) ** 2 / two_s2)) or 0
        return zeros, np.minimum(slope_units(squares, per_square), cap)

    return charge


UnitStepFn = Callable[[IndividualTable], MeasuresUnitStep]


def _evaluate(
    p: _MeasuresBase, ctx: PublicContext, table: Table, plans: list[BlockPlan], unit_step: UnitStepFn
) -> tuple[list[np.ndarray], list[CategoricalColumn], UnitCharges | None]:
    """The blocks' exact grid units (over the admitted units on an individual dataset, with their charges)."""
    individual = individual_table(ctx, table)
    if individual is None:
        units, columns = evaluate_blocks(p, ctx, table, plans)
        return units, columns, None
    step = unit_step(individual)
    return step.blocks, step.columns, step.charges


def _derive(
    p: _MeasuresBase, ctx: PublicContext, released: dict[str, np.ndarray], n_cells: int
) -> dict[str, np.ndarray]:
    """The measures from the released blocks (post-processing)."""
    size = public_size(p, ctx)
    out: dict[str, np.ndarray] = {}
    for measure in p.measures:
        if measure.column is None:
            out[measure.label] = released["count"]
            continue
        if measure.kind == "count_distinct":
            out[measure.label] = released[f"units({measure.column})"]
            continue
        if measure.kind == "sum":
            out[measure.label] = released[f"sum({measure.column})"]
            continue
        column = numeric_column(ctx, measure.column, "measures")
        c, h = center(column)
        n = np.full(n_cells, float(size)) if size is not None else np.maximum(released["count"], 1.0)
        centered_mean = np.clip(released[f"csum({measure.column})"] / n, -float(h), float(h))
        if measure.kind == "mean":
            out[measure.label] = np.clip(c + centered_mean, float(column.min), float(column.max))
            continue
        second = released[f"csumsq({measure.column})"] / n
        variance = np.clip(second - centered_mean**2, 0.0, float(h) ** 2)
        out[measure.label] = variance if measure.kind == "variance" else np.sqrt(variance)
    return out


def _output(
    p: _MeasuresBase,
    ctx: PublicContext,
    plans: list[BlockPlan],
    noisy_units: list[np.ndarray],
    columns: list[CategoricalColumn],
    specs: list[dict[str, Any]],
    laws: list[BlockLaw],
) -> dict[str, Any]:
    n_cells = math.prod(len(c.values) for c in columns)
    released = {
        plan.block.label: plan.grid.from_units(units).astype(np.float64)
        for plan, units in zip(plans, noisy_units, strict=True)
    }
    measures = _derive(p, ctx, released, n_cells)
    blocks_out = [
        {"block": plan.block.label, **spec, **plan.grid.describe()}
        for plan, spec in zip(plans, specs, strict=True)
    ]
    noisy = {plan.block.label: units for plan, units in zip(plans, noisy_units, strict=True)}
    by_label = {plan.block.label: law for plan, law in zip(plans, laws, strict=True)}
    bounds, union = measure_intervals(measure_specs(p, ctx), by_label, noisy, p.confidence, n_cells)
    interval = {"level": p.confidence, "union_bound": union}

    def cell_interval(g: int) -> dict[str, dict[str, float]]:
        return {
            "lower": {k: float(lo[g]) for k, (lo, _) in bounds.items()},
            "upper": {k: float(hi[g]) for k, (_, hi) in bounds.items()},
        }

    if not columns:
        values = {k: float(v[0]) for k, v in measures.items()}
        return {"values": values, "interval": {**interval, **cell_interval(0)}, "blocks": blocks_out}
    keys = itertools.product(*(c.values for c in columns))
    groups = [
        {
            "key": dict(zip(p.group_by, key, strict=True)),
            **{k: float(v[g]) for k, v in measures.items()},
            "interval": cell_interval(g),
        }
        for g, key in enumerate(keys)
    ]
    return {"groups": groups, "interval": interval, "blocks": blocks_out}


def measure_specs(p: _MeasuresBase, ctx: PublicContext) -> list[MeasureSpec]:
    """How each measure's interval is derived from the blocks' (``measure_intervals``)."""
    size = public_size(p, ctx)
    specs = []
    for measure in p.measures:
        if measure.column is None:
            specs.append(MeasureSpec(measure.label, "count", ("count",)))
            continue
        if measure.kind == "count_distinct":
            specs.append(MeasureSpec(measure.label, "count_distinct", (f"units({measure.column})",)))
            continue
        if measure.kind == "sum":
            specs.append(MeasureSpec(measure.label, "sum", (f"sum({measure.column})",)))
            continue
        column = numeric_column(ctx, measure.column, "measures")
        c, h = center(column)
        count = None if size is not None else "count"
        parts = [f"csum({measure.column})"]
        if measure.kind in ("variance", "std"):
            parts.append(f"csumsq({measure.column})")
        blocks_read = tuple(([count] if count is not None else []) + parts)
        spec = MeasureSpec(
            measure.label,
            measure.kind,
            blocks_read,
            count,
            size,
            c,
            float(h),
            float(column.min),
            float(column.max),
        )
        specs.append(spec)
    return specs


def check_confidence(p: _MeasuresBase, ctx: PublicContext, laws: list[BlockLaw]) -> None:
    """Every block level the intervals need is computable (a level too close to 1 is refused here)."""
    moving = sum(1 for law in laws if law.quantile is not None)
    for m in range(1, min(moving, 3) + 1):
        try:
            level = union_level(p.confidence, m)
        except ValueError as exc:
            raise ParamsError("confidence", str(exc)) from None
        for law in laws:
            if law.quantile is not None:
                law.quantile(level)


BlockNoise = Callable[[int], tuple[np.ndarray, dict[str, Any]]]
"""Draws the noise of one block (given its size, in grid units) and describes it for the release."""


def _release(
    p: _MeasuresBase,
    ctx: PublicContext,
    table: Table,
    plans: list[BlockPlan],
    block_noise: list[BlockNoise | None],
    worst: RdpCurve,
    unit_step: UnitStepFn,
    laws: list[BlockLaw],
) -> Release:
    """Evaluate the blocks, add each block's noise in block order (None: a public block, released exactly)."""
    units, columns, charges = _evaluate(p, ctx, table, plans, unit_step)
    noisy: list[np.ndarray] = []
    specs: list[dict[str, Any]] = []
    for draw, exact in zip(block_noise, units, strict=True):
        if draw is None:
            noisy.append(exact)
            specs.append({"distribution": "none (public: cannot change between neighbours)"})
            continue
        draws, spec = draw(exact.size)
        noisy.append(exact.astype(object) + draws)
        specs.append(spec)
    output = _output(p, ctx, plans, noisy, columns, specs, laws)
    return Release(output=output, realized=worst, units=charges)


def _laplace_noise(noise: Noise, plan: BlockPlan, scale: Fraction) -> BlockNoise:
    spec = {"distribution": "discrete_laplace", "scale": float(scale * Fraction(plan.grid.granularity))}
    return lambda size: (noise.discrete_laplace(scale, size), spec)


def _gaussian_noise(noise: Noise, plan: BlockPlan, sigma: float, variance: Fraction) -> BlockNoise:
    spec = {"distribution": "discrete_gaussian", "sigma": sigma * plan.grid.granularity}
    return lambda size: (noise.discrete_gaussian(variance, size), spec)


def laplace_laws(planned: tuple[tuple[BlockPlan, Fraction | None], ...]) -> list[BlockLaw]:
    """Each block's interval law: its grid and the quantiles of its discrete Laplace (public)."""
    return [
        BlockLaw(
            plan.grid, plan.exact, None if t is None else functools.partial(discrete_laplace_quantile, t)
        )
        for plan, t in planned
    ]


def gaussian_laws(
    planned: tuple[tuple[BlockPlan, float, Fraction] | tuple[BlockPlan, None, None], ...],
) -> list[BlockLaw]:
    """Each block's interval law: its grid and the quantiles of its discrete Gaussian (public s²)."""
    return [
        BlockLaw(
            plan.grid, plan.exact, None if s2 is None else functools.partial(discrete_gaussian_quantile, s2)
        )
        for plan, _, s2 in planned
    ]


class MeasuresLaplace(ParamsChecked):
    """Several measures (count, sum, mean, variance, std), optionally grouped; discrete Laplace, pure ε."""

    name: ClassVar[str] = "measures.laplace"
    summary: ClassVar[str] = "Several measures (count/sum/mean/variance/std), grouped or not, Laplace (ε)."
    params_model: ClassVar[type[BaseModel]] = MeasuresLaplaceParams
    cost_parameter: ClassVar[str] = "epsilon"
    cost_increases_with_parameter: ClassVar[bool] = True

    def check(self, p: MeasuresLaplaceParams, ctx: PublicContext) -> None:
        check_confidence(p, ctx, laplace_laws(laplace_plans(p, ctx)))

    def worst_case(self, p: MeasuresLaplaceParams, ctx: PublicContext) -> RdpCurve:
        return laplace_measures_curve(p, ctx)

    def run(self, p: MeasuresLaplaceParams, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        planned = laplace_plans(p, ctx)
        worst = laplace_measures_curve(p, ctx)
        block_noise = [
            None if scale is None else _laplace_noise(noise, plan, scale) for plan, scale in planned
        ]
        unit_step = functools.partial(self.unit_step, p, ctx)
        plans = [plan for plan, _ in planned]
        return _release(p, ctx, table, plans, block_noise, worst, unit_step, laplace_laws(planned))

    def unit_step(
        self, p: MeasuresLaplaceParams, ctx: PublicContext, table: IndividualTable
    ) -> MeasuresUnitStep:
        """The blocks over the units that can afford their own charge, and those charges (deterministic: no
        noise; ``expost ledger verify`` replays it)."""
        planned = laplace_plans(p, ctx)
        plans = [plan for plan, _ in planned]
        ceiling = units_up(p.epsilon) or 0
        return measures_unit_step(p, ctx, table, plans, laplace_block_charge(planned), ceiling)


class MeasuresGaussian(ParamsChecked):
    """Several measures, optionally grouped; discrete Gaussian, α·B/(2z²) for B noisy blocks."""

    name: ClassVar[str] = "measures.gaussian"
    summary: ClassVar[str] = "Several measures (count/sum/mean/variance/std), grouped or not, Gaussian (RDP)."
    params_model: ClassVar[type[BaseModel]] = MeasuresGaussianParams
    cost_parameter: ClassVar[str] = "noise_multiplier"
    cost_increases_with_parameter: ClassVar[bool] = False

    def check(self, p: MeasuresGaussianParams, ctx: PublicContext) -> None:
        check_confidence(p, ctx, gaussian_laws(gaussian_plans(p, ctx)))

    def worst_case(self, p: MeasuresGaussianParams, ctx: PublicContext) -> RdpCurve:
        return gaussian_measures_curve(p, ctx)

    def run(self, p: MeasuresGaussianParams, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        planned = gaussian_plans(p, ctx)
        worst = gaussian_measures_curve(p, ctx)
        block_noise = [
            None if sigma is None or variance is None else _gaussian_noise(noise, plan, sigma, variance)
            for plan, sigma, variance in planned
        ]
        unit_step = functools.partial(self.unit_step, p, ctx)
        plans = [entry[0] for entry in planned]
        return _release(p, ctx, table, plans, block_noise, worst, unit_step, gaussian_laws(planned))

    def unit_step(
        self, p: MeasuresGaussianParams, ctx: PublicContext, table: IndividualTable
    ) -> MeasuresUnitStep:
        """The blocks over the units that can afford their own charge, and those charges (deterministic: no
        noise; ``expost ledger verify`` replays it)."""
        planned = gaussian_plans(p, ctx)
        plans = [entry[0] for entry in planned]
        return measures_unit_step(p, ctx, table, plans, gaussian_block_charge(planned), 2**60)
