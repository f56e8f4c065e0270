"""Quantiles and medians by the exponential mechanism over a public candidate grid (pure ε).

Construction (docs/mechanisms/analytics.md, docs/privacy.md "Analytics"):

* **Candidates** (public): for an int column every integer of [min, max] when there are at most
  ``candidates`` of them, else ``candidates`` evenly spaced integers; for a float column ``candidates``
  evenly spaced points of [min, max] (each the float nearest to min + j·(max − min)/(K − 1), duplicates
  removed). They depend on the schema and the parameters only, so every released value is one of them
  (no floating-point noise is ever added: nothing in the low-order bits).
* **Score** of candidate c for quantile q: s(c) = |#{selected x ≤ c} − q·n|, n the number of selected rows,
  in exact rational arithmetic (q read as its exact binary value). Between neighbours (replace-one: one row
  changes its value and/or leaves/enters the selection; add-remove: one selected row more or less) the count
  moves by at most 1 and q·n by at most max(q, 1 − q) in a way that never adds to it, so |Δs(c)| ≤ 1 for
  every c (proof in docs/privacy.md).
* **Selection**: P(c) ∝ exp(−ε_q·s(c)/2) (McSherry and Talwar 2007), sampled **exactly** by rejection:
  propose a uniform candidate (``Noise.uniform_below``) and accept it with probability exp(−ε_q·(s(c) −
  min s)/2), decided by an exact lazy comparison of a uniform real with an integer enclosure of the
  exponential (``mechanisms.noise.tuning.bernoulli_exp_neg_table``). The first accepted proposal has exactly
  the exponential mechanism's law; no floating-point weight or Gumbel variate is ever used.

Privacy: with |Δs| ≤ 1 the selection is ε_q-DP. Several quantiles split ε equally (ε_q = ε/k, rational), and
their independent selections compose to Σ ε_q = ε (basic composition of pure DP). Charge:
``RdpCurve.pure_product`` of the per-quantile ε_q, capped at ε; ex-post = worst case (every outcome).

Timing: the number of rejection rounds depends on the scores (as every exact sampler's run time depends on
its secret draw); docs/mechanisms/analytics.md states this limit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from functools import lru_cache
from typing import Annotated, ClassVar, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, model_validator

from mechanisms.accounting import RdpCurve
from mechanisms.base import ParamsChecked, ParamsError, PublicContext, Release, Table
from mechanisms.data.schema import CategoricalColumn, FloatColumn, IntColumn
from mechanisms.noise import Noise, float_up
from mechanisms.noise.tuning import bernoulli_exp_neg_table
from mechanisms.queries.language import CountQuery, Where, charged_fraction, check_where, selection

MAX_CANDIDATES = 1 << 16
MAX_QUANTILES = 32
_PROPOSALS = 1 << 16
"""Proposals drawn per rejection round (over all pending draws): the acceptance rate is ≥ 1/K."""

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


def exponential_select(
    noise: Noise, values: list[Fraction], index: np.ndarray, weight: Fraction, size: int = 1
) -> np.ndarray:
    """``size`` independent draws of P(j) ∝ exp(−weight·values[index[j]]) over the candidates j.

    Exact rejection: each proposal is a uniform j, accepted with probability exp(−weight·(v_j − min v))
    (exact lazy comparison); a draw is the first accepted proposal of its row. The acceptance rate is
    ≥ 1/K (the best candidate is always accepted), each round proposes up to 2^16 candidates over the
    pending draws."""
    k = int(index.size)
    common = math.lcm(*(v.denominator for v in values))  # integer arithmetic: one gcd per value
    numerators = [v.numerator * (common // v.denominator) for v in values]
    low = min(numerators)
    exponents = [Fraction(weight.numerator * (a - low), weight.denominator * common) for a in numerators]
    out = np.full(size, -1, dtype=np.int64)
    pending = np.arange(size)
    while pending.size:
        width = max(1, min(k, _PROPOSALS // pending.size))
        proposals = noise.uniform_below(k, pending.size * width).reshape(pending.size, width)
        accepted = bernoulli_exp_neg_table(noise, exponents, index[proposals])
        hit = accepted.any(axis=1)
        first = np.argmax(accepted, axis=1)
        out[pending[hit]] = proposals[hit, first[hit]]
        pending = pending[~hit]
    return out


def _candidates_and_values(
    p: QuantileParams, ctx: PublicContext, table: Mapping[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    column = _numeric_column(p, ctx)
    mask = selection(CountQuery(kind="count", where=p.where), ctx, table)
    return candidate_grid(column, p.candidates), np.asarray(table[column.name])[mask]


def rank_error_bound(p: QuantileParams, size: int, beta: float = 0.05) -> float:
    """With probability ≥ 1 − β, the released candidate's score is within 2·ln(K/β)/ε_q of the best
    candidate's (McSherry–Talwar utility theorem): a public accuracy statement, in rows."""
    return 2.0 * math.log(size / beta) / float(per_quantile_epsilon(p))


class Quantile(ParamsChecked):
    """Quantiles of a numeric column by the exponential mechanism over a public candidate grid (pure ε)."""

    name: ClassVar[str] = "quantile"
    summary: ClassVar[str] = "Quantiles/medians by the exponential mechanism over the public domain (pure ε)."
    params_model: ClassVar[type[BaseModel]] = QuantileParams
    cost_parameter: ClassVar[str] = "epsilon"
    cost_increases_with_parameter: ClassVar[bool] = True

    def check(self, p: QuantileParams, ctx: PublicContext) -> None:
        _numeric_column(p, ctx)
        check_where(p.where, ctx)
        if per_quantile_epsilon(p) <= 0:
            raise ParamsError("epsilon", "too small")

    def worst_case(self, p: QuantileParams, ctx: PublicContext) -> RdpCurve:
        return quantile_curve(p, ctx.orders)

    def run(self, p: QuantileParams, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        self.check(p, ctx)
        worst = quantile_curve(p, ctx.orders)
        candidates, data = _candidates_and_values(p, ctx, table)
        counts = rank_counts(data, candidates)
        weight = per_quantile_epsilon(p) / 2
        released: dict[str, float | int] = {}
        for q in p.quantiles:
            values, index = scores(counts, int(data.size), q)
            chosen = int(exponential_select(noise, values, index, weight)[0])
            released[repr(q)] = candidates[chosen].item()
        output = {
            "values": released,
            "mechanism": {
                "name": "exponential",
                "candidates": int(candidates.size),
                "epsilon_each": float(per_quantile_epsilon(p)),
                "rank_error_95": rank_error_bound(p, int(candidates.size)),
            },
        }
        return Release(output=output, realized=worst)
