"""A mean without a public selection size: a noisy sum divided by a noisy count (docs/mechanisms/laplace.md).

Under add/remove neighbours (or with a ``where``) the number of rows a mean divides by is private, so the
mean is released as two releases of the same mechanism, each on its own public grid with its own noise:
the sum of the column over the selection and the count of the selection, then ŝ/ĉ, clamped to the
column's declared [min, max] (a mean of clipped values lies there). Division and clamping are
post-processing of the two releases. The charge is the sum of the two charges (basic composition):

* Laplace: each part gets ε/2, so the pair is ε-DP (pure), as requested.
* Gaussian: the count gets the requested σ and the sum σ·Δ_sum/Δ_count, so both parts cost the same and
  the pair costs what one Gaussian count at σ/√2 would: α·Δ_count²/σ².

The interval: each part's interval at level 1 − (1 − level)/2, so both hold together with probability ≥
level (union bound); on that event the true mean lies between the extreme corner ratios of the two
intervals (count interval cut below at 1: a selection with a mean is not empty), clamped to [min, max]. When
the count's interval reaches 0 the interval is [min, max].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

from mechanisms.base import ParamsError, PublicContext
from mechanisms.queries.language import (
    CountQuery,
    MeanQuery,
    SumQuery,
    charged_fraction,
    has_public_size,
    numeric_column,
    shifts,
)

ParamsT = TypeVar("ParamsT")

PART_NAMES = ("sum", "count")


def needs_ratio(query: object, ctx: PublicContext) -> bool:
    """A mean whose selection size is private: released as a ratio of two releases."""
    return isinstance(query, MeanQuery) and not has_public_size(query, ctx)


def ratio_parts(query: MeanQuery) -> tuple[SumQuery, CountQuery]:
    return (
        SumQuery(kind="sum", column=query.column, where=query.where),
        CountQuery(kind="count", where=query.where),
    )


def part_level(level: float) -> float:
    """Each part's interval level: both hold together with probability ≥ ``level``."""
    return 1.0 - (1.0 - level) / 2.0


def sigma_ratio(query: MeanQuery, ctx: PublicContext) -> float:
    """Δ_sum/Δ_count: the Gaussian sum's noise is σ times this (both parts then cost the same)."""
    total, count = ratio_parts(query)
    (sum_shift,), (count_shift,) = shifts(total, ctx), shifts(count, ctx)
    return sum_shift / count_shift


def combine(
    query: MeanQuery, ctx: PublicContext, total: dict[str, Any], count: dict[str, Any], level: float
) -> dict[str, Any]:
    """The mean's output from the two parts' outputs (post-processing only)."""
    column = numeric_column(query, ctx)
    low, high = float(column.min), float(column.max)
    s, c = float(total["value"]), float(count["value"])
    output: dict[str, Any] = {
        "value": _clamp(s / c, low, high) if c > 0 else None,
        "noise": {"sum": total["noise"], "count": count["noise"]},
        "parts": {"sum": s, "count": c},
    }
    if c <= 0:
        output["warnings"] = ["the noisy count is ≤ 0: no mean is released (raise ε, or widen the selection)"]
    if "interval" in total and "interval" in count:
        lower, upper = _ratio_interval(total["interval"], count["interval"], low, high)
        output["interval"] = {"level": level, "lower": lower, "upper": upper}
    return output


def _ratio_interval(
    total: dict[str, Any], count: dict[str, Any], low: float, high: float
) -> tuple[float, float]:
    c_low, c_high = max(float(count["lower"]), 1.0), float(count["upper"])
    if c_high < 1.0:
        return low, high
    s_low, s_high = float(total["lower"]), float(total["upper"])
    corners = [s / c for s in (s_low, s_high) for c in (c_low, c_high)]
    # a ratio rounded to the nearest double may fall short of the exact one by half an ulp: widen by one
    lower = math.nextafter(min(corners), -math.inf)
    upper = math.nextafter(max(corners), math.inf)
    return _clamp(lower, low, high), _clamp(upper, low, high)


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def half_epsilon(epsilon: float) -> float:
    """The largest double h ≤ ε/2 whose two parts' exact losses, 2·charged(h), stay ≤ charged(ε): the pair
    is then covered by a charge of ε read as the ledger reads it (``charged_fraction``)."""
    half = epsilon / 2
    while 2 * charged_fraction(half) > charged_fraction(epsilon):
        half = math.nextafter(half, 0.0)
    return half


def validated_parts(
    validate: Callable[[dict[str, Any]], ParamsT],
    query: MeanQuery,
    level: float,
    sum_cost: dict[str, float],
    count_cost: dict[str, float],
) -> tuple[ParamsT, ParamsT]:
    """The two parts' parameter models (``validate`` is the mechanism's model), or a ParamsError naming
    the cost parameter when a part's value falls outside the model's range."""
    total, count = ratio_parts(query)
    confidence = part_level(level)
    try:
        first = validate({"query": total.model_dump(), "confidence": confidence, **sum_cost})
        second = validate({"query": count.model_dump(), "confidence": confidence, **count_cost})
    except ValueError as exc:
        raise ParamsError(
            next(iter(count_cost)), f"the mean's sum or count part is out of range: {exc}"
        ) from None
    return first, second
