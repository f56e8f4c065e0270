"""Confidence intervals of noise-reduction releases, valid at every level of the grid at once.

Accuracy-first walks (``accuracy_first.*``) and sessions (``noise_reduction.*``) release one chain of
levels 0, 1, …, K − 1, and which level is released (or how many) depends on released values. An interval
taken at a level ℓ for the level that happened to be released can under-cover (the stopping rule selects
levels whose noise happened to look small). So each level t gets its interval at level 1 − (1 − ℓ)/K
(``intervals.union_level``): with probability ≥ ℓ every level's interval covers the exact answer at once,
so the one released (or every step of a session) is covered whatever the stopping rule
(docs/mechanisms/noise_reduction.md#nr-intervals). Half-widths are functions of public parameters only.

* Laplace: level t's noise is exactly discrete Laplace of scale D/n_t grid units (the chain's marginal,
  ``mechanisms.noise.reduction``): k_t its exact quantile (``discrete_laplace_quantile``).
* Brownian: with e_t = Y_t − V the error in grid units (V the rounded answer), e_0 = Z_0 and
  e_t = r_t·e_{t−1} + ρ_t + Z_t, |ρ_t| ≤ ½ (rounding of the bridge mean), Z_t independent N_Z(0, σ_t²). So
  e_t = Σ_j w_{t,j}(Z_j + ρ_j), w_{t,j} = Π_{j<i≤t} r_i; each discrete Gaussian is σ²-sub-Gaussian
  (Canonne–Kamath–Steinke 2020: E e^{λZ} ≤ e^{λ²σ²/2}, the continuous Gaussian's bound), so
  P(|e_t| > R_t + x) ≤ 2·exp(−x²/(2W_t)), W_t = Σ_j w_{t,j}²σ_j², R_t = ½·Σ_{j≥1} w_{t,j}:
  k_t = ⌈R_t + √(2W_t·ln(2/β_t))⌉ (computed with an upward margin). Conservative (sub-Gaussian bound).

Either way the half-width is γ·(k_t + r), r = 0 for an integer answer on an exact grid, else 1 (the answer
was rounded to γ first, as ``intervals.release_interval``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from mechanisms.noise import Grid
from mechanisms.noise.reduction import RATE_DENOMINATOR
from mechanisms.queries.intervals import discrete_laplace_quantile, union_level
from mechanisms.reduction.noise_reduction import brownian_step_variances, laplace_nr_rates

_MARGIN = 1e-9
"""Relative upward margin on the Brownian bound's float arithmetic (a few dozen operations)."""


def laplace_level_units(
    grid_sensitivity: float, epsilons: Sequence[float], level: float, parts: int
) -> list[int]:
    """Per grid level t, k_t with P(|η_t| ≤ k_t) ≥ 1 − (1 − level)/parts (η_t discrete Laplace of scale
    D/n_t): ``parts`` is K, or 1 for a level fixed by public parameters."""
    each = union_level(level, parts)
    rates = laplace_nr_rates(grid_sensitivity, epsilons)
    return [discrete_laplace_quantile(Fraction(RATE_DENOMINATOR, n), each).units for n in rates]


def brownian_level_units(variances: Sequence[float], grid: Grid, level: float, parts: int) -> list[int]:
    """Per grid level t, k_t with P(|e_t| ≤ k_t) ≥ 1 − (1 − level)/parts (the sub-Gaussian bound above)."""
    each = union_level(level, parts)
    log_term = math.log(2.0) - math.log1p(-each)  # ln(2/β_t)
    exact = [Fraction(float(v)) for v in variances]
    ratios = [0.0] + [float(exact[j] / exact[j - 1]) for j in range(1, len(exact))]
    steps = [float(s) for s in brownian_step_variances(variances, grid)]
    result = []
    spread, rounding = 0.0, 0.0
    for t, (r, s2) in enumerate(zip(ratios, steps, strict=True)):
        spread = r * r * spread + s2  # W_t = r_t²·W_{t−1} + σ_t²
        rounding = r * rounding + (0.5 if t > 0 else 0.0)  # R_t = r_t·R_{t−1} + ½
        bound = (rounding + math.sqrt(2.0 * spread * log_term)) * (1.0 + _MARGIN)
        result.append(math.ceil(bound))
    return result


def level_interval(
    values: np.ndarray,
    grid: Grid,
    exact: bool,
    units: int,
    level: float,
    levels: int,
    labels: list[str] | None,
) -> dict[str, Any]:
    """``{"level", "half_width", "lower", "upper", "union_over_levels"}`` around one level's release
    (``levels``: how many levels the union bound spans, 1 for a level fixed by public parameters)."""
    steps = units + (0 if exact else 1)
    half_width = math.ldexp(float(steps), grid.exponent)
    flat = np.asarray(values, dtype=np.float64).ravel()
    lower, upper = flat - half_width, flat + half_width  # exact: multiples of γ below 2^53 units
    base: dict[str, Any] = {"level": level, "half_width": half_width, "union_over_levels": levels}
    if labels is None:
        return {**base, "lower": float(lower[0]), "upper": float(upper[0])}
    return {
        **base,
        "lower": dict(zip(labels, map(float, lower), strict=True)),
        "upper": dict(zip(labels, map(float, upper), strict=True)),
    }
