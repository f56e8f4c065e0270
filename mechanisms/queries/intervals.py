"""Confidence intervals of grid releases: exact quantiles of the integer noise, from public parameters only.

A query release is γ·(round(f/γ) + Z) with Z discrete Laplace (P(z) ∝ e^{−|z|/t}) or discrete Gaussian
(P(z) ∝ e^{−z²/(2s²)}) on the integers (``mechanisms.queries.laplace``, ``mechanisms.queries.gaussian``). The
half-width of a level-L interval is γ·k with k the **smallest** integer such that P(|Z| ≤ k) ≥ L: a function
of (t or s², L, γ) only, so publishing it (and release ± half-width) is post-processing and costs nothing.

How k is computed (docs/mechanisms/laplace.md and gaussian.md, "Confidence interval"):

* discrete Laplace, closed form: with p = e^{−1/t}, P(|Z| > k) = 2p^{k+1}/(1 + p) (geometric tails).
* discrete Gaussian, s ≤ 2^12: the pmf summed numerically over |z| ≤ 12s + 2 (the rest, ≤ e^{−72} of the
  mass, is added to the error bound); s > 2^12: Euler–Maclaurin with its remainder bounded rigorously,
  Σ_{z>k} f(z) = ∫_k^∞ f − f(k)/2 + k·f(k)/(12s²) + R, |R| ≤ 2ζ(3)/(2π)³·∫_0^∞|f'''| ≤ 0.02/s², and the
  normaliser Σ_z f(z) = s√(2π)·θ with θ = Σ_j e^{−2π²s²j²} ≥ 1 (Poisson summation).

Every computed tail comes with a lower and an upper bound (the float error is covered by a relative margin:
10^-8 for the term-by-term sums, 10^-11 for the closed forms, each far above its worst-case rounding).
k is the smallest integer whose **upper** bound is ≤ 1 − L, so P(|Z| ≤ k) ≥ L always holds; k is the exact
quantile unless the true P(|Z| ≤ k − 1) lies within that margin of 1 − L (then k may be conservative by the
few steps the margin spans: none in practice below scales of ~10^6 grid units; ``NoiseQuantile.exact``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Annotated, Any

import numpy as np
from pydantic import Field

from mechanisms.params import OpenUnit
from mechanisms.queries.language import GridPlan

ConfidenceLevel = Annotated[
    OpenUnit,
    Field(description="level of the confidence interval published with the release (post-processing, free)"),
]
"""The ``confidence`` parameter of a one-shot release (its interval is post-processing)."""

MARGIN = 1e-8
"""Relative error margin on a tail summed term by term (≤ 12s + 3 ≤ 50 000 float additions: ≤ 6·10^-12)."""
CLOSED_FORM_MARGIN = 1e-11
"""Relative error margin on a closed-form tail (a few correctly rounded exp/log/erfc steps: ≤ 10^-13)."""
DIRECT_LIMIT = 4096.0
"""Discrete Gaussian parameters s ≤ this are summed term by term; above, Euler–Maclaurin."""
_EM_REMAINDER = 0.02
"""|R| ≤ 2ζ(3)/(2π)³·∫_0^∞|f'''| = 0.00969·1.893/s² ≤ 0.02/s² (f(x) = e^{−x²/(2s²)})."""
_MAX_STEPS = 100_000


@dataclass(frozen=True)
class NoiseQuantile:
    """k (grid units) with P(|Z| ≤ k) ≥ level; ``exact`` when P(|Z| ≤ k − 1) < level is certain too."""

    units: int
    exact: bool


TailBounds = Callable[[int], tuple[float, float]]


def _smallest(bounds: TailBounds, level: float, start: int) -> NoiseQuantile:
    """The smallest k ≥ 0 whose tail upper bound is ≤ 1 − level, walking from ``start``."""
    budget = 1.0 - level  # exact in floats for level ∈ [0.5, 1); otherwise rounded: checked below
    if Fraction(budget) > 1 - Fraction(level):
        budget = math.nextafter(budget, 0.0)
    k = max(start, 0)
    for _ in range(_MAX_STEPS):
        if bounds(k)[1] <= budget:
            break
        k += 1
    else:
        raise ArithmeticError("the noise quantile search did not converge")
    for _ in range(_MAX_STEPS):
        if k == 0 or bounds(k - 1)[1] > budget:
            break
        k -= 1
    exact = k == 0 or bounds(k - 1)[0] > budget
    return NoiseQuantile(k, exact)


def discrete_laplace_tail(scale: Fraction, k: int) -> tuple[float, float]:
    """Bounds on P(|Z| > k) for P(z) ∝ e^{−|z|/t}: 2p^{k+1}/(1 + p), p = e^{−1/t}."""
    inv = 1.0 / float(scale)
    log_tail = math.log(2.0) - (k + 1) * inv - math.log1p(math.exp(-inv))
    value = math.exp(log_tail)
    return value * (1 - CLOSED_FORM_MARGIN), value * (1 + CLOSED_FORM_MARGIN)


@lru_cache(maxsize=1024)
def discrete_laplace_quantile(scale: Fraction, level: float) -> NoiseQuantile:
    """The ``level`` quantile of |Z|, Z discrete Laplace of scale t (grid units)."""
    _check_level(level)
    inv = 1.0 / float(scale)
    guess = math.ceil((math.log(2.0) - math.log1p(math.exp(-inv)) - math.log1p(-level)) / inv) - 1
    return _smallest(lambda k: discrete_laplace_tail(scale, k), level, guess)


def _gaussian_direct(variance: float) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) bounds on P(|Z| > k) for k = 0..M, the pmf summed term by term."""
    s = math.sqrt(variance)
    top = math.ceil(12.0 * s) + 2
    z = np.arange(top + 1, dtype=np.float64)
    terms = np.exp(-(z * z) / (2.0 * variance))
    rest = variance / top * math.exp(-top * top / (2.0 * variance))  # ≥ Σ_{z>M} f(z) (integral bound)
    at_least = np.cumsum(terms[::-1])[::-1]  # Σ_{k≤z≤M} f(z), smallest terms first
    tails = np.append(at_least[1:], 0.0)  # Σ_{k<z≤M} f(z)
    total = terms[0] + 2.0 * float(np.sum(terms[1:]))
    upper = 2.0 * (tails + rest) / total * (1 + MARGIN)
    lower = 2.0 * tails / (total + 2.0 * rest) * (1 - MARGIN)
    return lower, upper


def _gaussian_em_tail(variance: float, k: int) -> tuple[float, float]:
    """Bounds on P(|Z| > k) by Euler–Maclaurin (s > 2^12)."""
    s = math.sqrt(variance)
    f_k = math.exp(-k * k / (2.0 * variance))
    integral = s * math.sqrt(math.pi / 2.0) * math.erfc(k / (s * math.sqrt(2.0)))
    tail = integral - f_k / 2.0 + k * f_k / (12.0 * variance)
    slack = _EM_REMAINDER / variance
    norm = s * math.sqrt(2.0 * math.pi)  # θ − 1 ≤ 3e^{−2π²s²} = 0 in floats for s > 1
    low, high = 2.0 * (tail - slack) / norm, 2.0 * (tail + slack) / norm
    return max(0.0, low * (1 - CLOSED_FORM_MARGIN)), high * (1 + CLOSED_FORM_MARGIN)


@lru_cache(maxsize=1024)
def discrete_gaussian_quantile(variance: Fraction, level: float) -> NoiseQuantile:
    """The ``level`` quantile of |Z|, Z discrete Gaussian of parameter s² = ``variance`` (grid units)."""
    _check_level(level)
    var = float(variance)
    s = math.sqrt(var)
    if s <= DIRECT_LIMIT:
        lower, upper = _gaussian_direct(var)

        def bounds(k: int) -> tuple[float, float]:
            if k >= upper.size:
                return 0.0, float(upper[-1])
            return float(lower[k]), float(upper[k])

        start = int(np.argmax(upper <= 1.0 - level)) if bool(np.any(upper <= 1.0 - level)) else upper.size
        return _smallest(bounds, level, start)
    guess = math.floor(s * statistics.NormalDist().inv_cdf(1.0 - (1.0 - level) / 2.0))
    return _smallest(lambda k: _gaussian_em_tail(var, k), level, guess)


def union_level(level: float, m: int) -> float:
    """The level 1 − (1 − level)/m of each of m intervals that must hold together with probability ≥ level
    (union bound), rounded up so that the m misses sum to ≤ 1 − level exactly. ValueError when that level
    rounds to 1 (``level`` too close to 1 for m parts)."""
    if m <= 1:
        return level
    target = 1 - (1 - Fraction(level)) / m
    value = float(target)
    if Fraction(value) < target:
        value = math.nextafter(value, 2.0)
    if not value < 1.0:
        raise ValueError(f"the confidence level is too close to 1 for a union bound over {m} parts")
    return value


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError("a confidence level must be in (0, 1)")


def release_interval(
    noisy_units: np.ndarray, plan: GridPlan, quantile: NoiseQuantile, level: float, labels: list[str] | None
) -> dict[str, Any]:
    """``{"level", "half_width", "lower", "upper"}`` around a release (per bin for a histogram).

    Integer answers released unrounded (``plan.exact``): half-width γ·k covers the exact answer. Otherwise
    the answer was rounded to the grid first (error ≤ γ/2 plus float error ≤ 2^-7·γ,
    docs/privacy/finite_precision.md#finite-precision),
    so the half-width is γ·(k + 1), which covers the exact answer on the clipped data as well.
    """
    steps = quantile.units + (0 if plan.exact else 1)
    units = np.asarray(noisy_units).astype(object).ravel()
    ends = plan.grid.from_units(np.concatenate([units - steps, units + steps, [steps]]))  # one conversion
    lower, upper, half_width = ends[: units.size], ends[units.size : 2 * units.size], float(ends[-1])
    if labels is None:
        return {"level": level, "half_width": half_width, "lower": float(lower[0]), "upper": float(upper[0])}
    return {
        "level": level,
        "half_width": half_width,
        "lower": dict(zip(labels, map(float, lower), strict=True)),
        "upper": dict(zip(labels, map(float, upper), strict=True)),
    }
