"""Quantiles and medians by report-noisy-max over a public candidate grid (pure ε; the exponential
mechanism's guarantee and accuracy bound, with data-independent work).

Construction (docs/mechanisms/analytics.md, docs/privacy/analytics.md#quantile):

* **Candidates** (public): for an int column every integer of [min, max] when there are at most
  ``candidates`` of them, else ``candidates`` evenly spaced integers; for a float column ``candidates``
  evenly spaced points of [min, max] (each the float nearest to min + j·(max − min)/(K − 1), duplicates
  removed). They depend on the schema and the parameters only, so every released value is one of them
  (no floating-point noise is ever added: nothing in the low-order bits).
* **Score** of candidate c for quantile q: s(c) = |#{selected x ≤ c} − q·n|, n the number of selected rows,
  in exact rational arithmetic (q read as its exact binary value). Between neighbours (replace-one: one row
  changes its value and/or leaves/enters the selection; add-remove: one selected row more or less) the count
  moves by at most 1 and q·n by at most max(q, 1 − q) in a way that never adds to it, so |Δs(c)| ≤ 1 for
  every c (proof in docs/privacy/analytics.md#theorem-q2).
* **Selection** (report noisy max with one-sided geometric noise; the discrete counterpart of
  permute-and-flip / report-noisy-max with exponential noise): every candidate c gets an independent
  G_c ≥ 0 with P(G_c ≥ m) = e^{−r·m} exactly (``mechanisms.noise.reduction.geometric_rates``),
  r = ⌊(ε_q/2)·2^48⌋/2^48 ≤ ε_q/2, and the release is argmax_c (G_c − s(c)), ties to the lowest index,
  compared exactly (the scores share one fractional part: ``selection_keys``). The noise is drawn
  independently of the data, always K draws per quantile: the selection's work does not depend on the data
  (a rejection sampler's round count would depend on the scores).

Privacy (docs/privacy/analytics.md#theorem-q2, Lemma Q2′): fix c and every other G_j. c wins iff G_c ≥ a(D),
an integer threshold built from max_{j≠c}(G_j − s_j) + s_c; with |Δs| ≤ 1 per candidate a(D′) ≤ a(D) + 2, and
P(G ≥ a + 2) ≥ e^{−2r}·P(G ≥ a) for the one-sided geometric law, so
P_D′(c) ≥ e^{−2r}·P_D(c) ≥ e^{−ε_q}·P_D(c).
Several quantiles split ε equally (ε_q = ε/k, rational), and their independent selections compose to
Σ ε_q = ε (basic composition of pure DP). Charge: ``RdpCurve.pure_product`` of the per-quantile ε_q, capped at
ε; ex-post = worst case (every outcome).

Accuracy: the winner's score exceeds the best one by at most max_c G_c < ln(K/β)/r with probability ≥ 1 − β
(``rank_error_bound``), the exponential mechanism's bound 2·ln(K/β)/ε_q.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache
from typing import Annotated, ClassVar, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, model_validator

from mechanisms.accounting import RdpCurve
from mechanisms.base import ParamsChecked, ParamsError, PublicContext, Release, Table
from mechanisms.data.plan import Aggregation, Bucket, Key, aggregate, clip_bounds
from mechanisms.data.schema import CategoricalColumn, FloatColumn, IntColumn
from mechanisms.noise import Noise, float_up
from mechanisms.noise.reduction import RATE_DENOMINATOR, geometric_rates
from mechanisms.queries.language import Where, charged_fraction, check_where, unit_bound, where_plan

MAX_CANDIDATES = 1 << 16
MAX_QUANTILES = 32

Probability = Annotated[float, Field(strict=True, ge=0.0, le=1.0, allow_inf_nan=False)]


class QuantileParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    column: str = Field(min_length=1, description="a float or int column")
    quantiles: tuple[Probability, ...] = Field(
        min_length=1, max_length=MAX_QUANTILES, description="levels in [0, 1]; 0.5 is the median"
    )
    epsilon: StrictFloat = Field(
        gt=0, le=100, allow_inf_nan=False, description="pure-DP ε of the whole request (split equally)"
    )
    candidates: StrictInt = Field(
        default=1024, ge=2, le=MAX_CANDIDATES, description="size of the public candidate grid"
    )
    where: Where = ()

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        if len(set(self.quantiles)) != len(self.quantiles):
            raise ValueError("quantiles must be distinct")
        return self


@lru_cache(maxsize=256)
def candidate_grid(column: FloatColumn | IntColumn, size: int) -> np.ndarray:
    """The public candidates: sorted, distinct, within [min, max] (int64 or float64; read-only, cached)."""
    grid = _candidate_grid(column, size)
    grid.flags.writeable = False
    return grid


def _candidate_grid(column: FloatColumn | IntColumn, size: int) -> np.ndarray:
    if isinstance(column, IntColumn):
        span = column.max - column.min
        if span + 1 <= size:
            return np.arange(column.min, column.max + 1, dtype=np.int64)
        steps = [column.min + round(Fraction(span * j, size - 1)) for j in range(size)]
        return np.unique(np.asarray(steps, dtype=np.int64))
    low, high = Fraction(column.min), Fraction(column.max)
    points = [float(low + (high - low) * Fraction(j, size - 1)) for j in range(size)]
    return np.unique(np.clip(np.asarray(points, dtype=np.float64), column.min, column.max))


def _numeric_column(p: QuantileParams, ctx: PublicContext) -> FloatColumn | IntColumn:
    column = ctx.schema.column(p.column)
    if column is None:
        raise ParamsError("column", f"unknown column {p.column!r}")
    if isinstance(column, CategoricalColumn):
        raise ParamsError("column", f"a quantile needs a float or int column, {column.name!r} is categorical")
    return column


def per_quantile_epsilon(p: QuantileParams) -> Fraction:
    """ε_q = ε/k as an exact rational, ε read as ``charged_fraction`` (what the ledger charges)."""
    return charged_fraction(p.epsilon) / len(p.quantiles)


def quantile_curve(p: QuantileParams, orders: tuple[float, ...]) -> RdpCurve:
    """``pure_product`` of the k per-quantile ε_q (each rounded up), pure slot ε (Σ ε_q = ε exactly)."""
    each = float_up(per_quantile_epsilon(p))
    curve = RdpCurve.pure_product([each] * len(p.quantiles), orders)
    return RdpCurve(curve.orders, tuple(min(v, p.epsilon) for v in curve.values), p.epsilon)


def rank_counts(values: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """#{x ≤ c} for every candidate c (exact comparisons of int64 or float64 values)."""
    return np.searchsorted(np.sort(values), candidates, side="right").astype(np.int64)


def scores(counts: np.ndarray, n: int, q: float) -> tuple[list[Fraction], np.ndarray]:
    """The distinct exact scores |k − q·n| over the candidates' counts k, and each candidate's index."""
    distinct, index = np.unique(counts, return_inverse=True)
    target = Fraction(q) * n
    top, bottom = target.numerator, target.denominator
    return [Fraction(abs(k * bottom - top), bottom) for k in distinct.tolist()], index.astype(np.int64)


def noise_rate(p: QuantileParams, unit_rows: int = 1) -> Fraction:
    """r = ⌊(ε_q/(2k))·2^48⌋/2^48 ≤ ε_q/(2k): the geometric noise's rate per score unit (0 when too small).

    k = ``unit_rows`` is how many rows one neighbour step may change (a privacy unit's ``max_rows``; 1 when a
    row is a unit): every rank count, and q·n, then moves by at most k, so |Δs| ≤ k and Lemma Q2′ needs
    2·r·k ≤ ε_q (docs/privacy/units.md#units)."""
    return Fraction(
        math.floor(per_quantile_epsilon(p) / (2 * unit_rows) * RATE_DENOMINATOR), RATE_DENOMINATOR
    )


def selection_keys(counts: np.ndarray, n: int, q: float, noise_draws: np.ndarray) -> np.ndarray:
    """int64 keys ordered exactly as the values G_j − s_j, s_j = |counts[j] − q·n| (equal iff equal).

    With q·n = I + f (I an integer, 0 ≤ f < 1) every score is d_j − f (counts > I, "up") or d_j + f
    (counts ≤ I), d_j = |counts[j] − I| an integer, so every value is m_j ± f with m_j = G_j − d_j. The key
    2·m_j + b_j is strictly increasing in the value, and equal exactly for equal values, with b = 0 for
    f = 0, b = [up] for 0 < f < ½, b = ±1 for f = ½ and b = 3·[up] for f > ½."""
    target = Fraction(q) * n
    whole = target.numerator // target.denominator
    frac = target - whole
    up = counts > whole
    d = np.where(up, counts - whole, whole - counts).astype(np.int64)
    if frac == 0:
        bonus = np.zeros(counts.size, dtype=np.int64)
    elif frac < Fraction(1, 2):
        bonus = up.astype(np.int64)
    elif frac == Fraction(1, 2):
        bonus = np.where(up, 1, -1).astype(np.int64)
    else:
        bonus = np.where(up, 3, 0).astype(np.int64)
    keys: np.ndarray = 2 * (np.asarray(noise_draws, dtype=np.int64) - d) + bonus
    return keys


def noisy_max_select(
    noise: Noise, counts: np.ndarray, n: int, q: float, rate: Fraction, size: int = 1
) -> np.ndarray:
    """``size`` independent draws of argmax_j (G_j − s_j), G_j ≥ 0 i.i.d. with P(G ≥ m) = e^{−rate·m}
    (``rate`` a positive multiple of 2^-48), ties to the lowest index: always size·K noise draws."""
    rate_units = rate * RATE_DENOMINATOR
    if rate <= 0 or rate_units.denominator != 1:
        raise ValueError("the rate must be a positive multiple of 2^-48")
    k = int(counts.size)
    draws = geometric_rates(noise, np.full(size * k, int(rate_units), dtype=np.int64)).reshape(size, k)
    chosen: np.ndarray = np.argmax(selection_keys(counts, n, q, draws), axis=-1).astype(np.int64)
    return chosen


def candidate_bucket(column: FloatColumn | IntColumn, candidates: np.ndarray) -> Bucket:
    """The plan's bucket key over the candidates (``mechanisms.data.plan.Bucket``): the approximate index
    ⌈(x − min)·(K − 1)/(max − min)⌉ of evenly spaced candidates, corrected exactly by one step each side."""
    k = int(candidates.size)
    span = Fraction(column.max) - Fraction(column.min)
    if k == 1 or span == 0:  # one candidate: x − min is 0 for every clipped x, any finite inverse serves
        return Bucket(float(column.min), 1.0, tuple(float(c) for c in candidates.tolist()))
    try:
        inverse = float(Fraction(k - 1) / span)
    except OverflowError:
        raise ParamsError(
            "candidates", "the column's range is too narrow for this many candidates: use fewer"
        ) from None
    return Bucket(float(column.min), inverse, tuple(float(c) for c in candidates.tolist()))


def selected_rank_counts(
    p: QuantileParams, ctx: PublicContext, table: Table
) -> tuple[np.ndarray, np.ndarray, int]:
    """The candidates, #{selected x ≤ c} per candidate c, and the number of selected rows, from one
    aggregation (a histogram over the candidate buckets, summed cumulatively)."""
    column = _numeric_column(p, ctx)
    candidates = candidate_grid(column, p.candidates)
    bucket = candidate_bucket(column, candidates)
    bounds = clip_bounds(ctx.schema, [c.column for c in p.where] + [column.name])
    key = Key(column.name, bucket.size, bucket=bucket)
    plan = Aggregation(where=where_plan(p.where, ctx), keys=(key,), bounds=bounds, unit=unit_bound(ctx))
    histogram = np.asarray(aggregate(table, plan)[0], dtype=np.int64)
    cumulative = np.cumsum(histogram)
    return candidates, cumulative[:-1], int(cumulative[-1])


def rank_error_bound(p: QuantileParams, size: int, beta: float = 0.05, unit_rows: int = 1) -> float:
    """With probability ≥ 1 − β, the released candidate's score is within ln(K/β)/r of the best candidate's
    (≈ 2·ln(K/β)/ε_q: max_c G_c < ln(K/β)/r, and the winner's G − s beats the best's): public, in rows."""
    return math.log(size / beta) / float(noise_rate(p, unit_rows))


USEFUL_RANK_FRACTION = 0.25
"""A release warns when its 95 % rank-error bound exceeds this fraction of the (public) row count."""


def accuracy_warnings(p: QuantileParams, rank_error: float, ctx: PublicContext) -> list[str]:
    """Advice computed from public values only (the parameters, the public row count, the bound): when the
    95 % rank error exceeds a quarter of the rows, the released values are close to random candidates
    (e.g. ε = 8.5e-6: a bound of millions of rows on 1 000). Without a public row count (add-remove
    neighbours) there is nothing to compare with, and no warning."""
    n = ctx.n_rows
    if n is None or n == 0 or rank_error <= USEFUL_RANK_FRACTION * n:
        return []
    useful = p.epsilon * rank_error / (USEFUL_RANK_FRACTION * n)  # the bound is ∝ 1/ε
    return [
        f"rank_error_95 = {rank_error:.3g} rows exceeds a quarter of the dataset's {n} rows: the released "
        f"values are close to random candidates (not monotone in the level, for instance); an epsilon of "
        f"at least {useful:.3g} brings the bound within a quarter of the rows"
    ]


class Quantile(ParamsChecked):
    """Quantiles of a numeric column by report-noisy-max over a public candidate grid (pure ε)."""

    name: ClassVar[str] = "quantile"
    summary: ClassVar[str] = "Quantiles/medians by the exponential mechanism over the public domain (pure ε)."
    params_model: ClassVar[type[BaseModel]] = QuantileParams
    cost_parameter: ClassVar[str] = "epsilon"
    cost_increases_with_parameter: ClassVar[bool] = True

    def check(self, p: QuantileParams, ctx: PublicContext) -> None:
        column = _numeric_column(p, ctx)
        check_where(p.where, ctx)
        unit = ctx.schema.privacy_unit
        if unit is not None and p.column == unit.column:
            raise ParamsError("column", f"{unit.column!r} identifies the privacy unit; it is not a measure")
        candidate_bucket(column, candidate_grid(column, p.candidates))  # refuses a range too narrow
        if noise_rate(p, ctx.schema.unit_rows) <= 0:
            raise ParamsError("epsilon", "too small: ε per quantile must be at least 2^-47")

    def worst_case(self, p: QuantileParams, ctx: PublicContext) -> RdpCurve:
        return quantile_curve(p, ctx.orders)

    def run(self, p: QuantileParams, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        self.check(p, ctx)
        worst = quantile_curve(p, ctx.orders)
        candidates, counts, selected = selected_rank_counts(p, ctx, table)
        rate = noise_rate(p, ctx.schema.unit_rows)
        chosen = {q: int(noisy_max_select(noise, counts, selected, q, rate)[0]) for q in p.quantiles}
        # Monotone in the level: the selections sorted (candidates ascend), a post-processing of them
        # (docs/mechanisms/analytics.md): a higher level never gets a smaller value.
        ordered = sorted(chosen.values())
        released = {
            repr(q): candidates[index].item() for q, index in zip(sorted(chosen), ordered, strict=True)
        }
        released = {repr(q): released[repr(q)] for q in p.quantiles}
        rank_error = rank_error_bound(p, int(candidates.size), unit_rows=ctx.schema.unit_rows)
        output: dict[str, object] = {
            "values": released,
            "mechanism": {
                "name": "noisy_max_geometric",
                "noise_rate": float(rate),
                "candidates": int(candidates.size),
                "epsilon_each": float(per_quantile_epsilon(p)),
                "rank_error_95": rank_error,
            },
        }
        warnings = accuracy_warnings(p, rank_error, ctx)
        if warnings:
            output["warnings"] = warnings
        return Release(output=output, realized=worst)
