"""Confidence intervals of grouped measures (``measures.*``): post-processing of public quantities only.

Every block b (``mechanisms.queries.measures``) is released as γ_b·(u_b + Z_b) per cell, u_b the block's
exact grid units and Z_b discrete Laplace or Gaussian noise of a public law. Its level-ℓ interval is
released ± γ_b·(k_b(ℓ) + r_b), k_b(ℓ) the smallest k with P(|Z_b| ≤ k) ≥ ℓ
(``intervals.discrete_laplace_quantile`` / ``discrete_gaussian_quantile``) and r_b = 0 for an integer block
on an exact grid, else 1 (the total was rounded to the grid first); a public block (released exactly) has
the point interval. So it covers the block's exact total per cell with probability ≥ ℓ
(docs/mechanisms/analytics.md#measure-intervals).

* ``count``, ``sum``, ``count_distinct``: their own block's interval at the requested level L.
* ``mean``, ``variance``, ``std`` are derived from m noisy blocks (count unless the size is public, csum,
  csumsq): each block's interval is taken at level 1 − (1 − L)/m, so all m hold together with probability
  ≥ L (union bound: **conservative**, the release lists these measures under ``union_bound``). On that
  event the true value lies between the derived bounds: the ratios S/N and Q/N are monotone in each
  argument for N > 0, so their extremes over the box are at its corners (N cut below at 1: a cell with a
  mean is not empty); variance = Q/N − (S/N)² is bounded by the smallest Q/N minus the largest (S/N)² and
  the reverse; std = √variance is monotone. Every bound is then clamped to the measure's range as the
  release clamps its value ([min, max] for a mean, [0, H²] for a variance), and widened outward by a
  relative 2^-40 for the float arithmetic. An empty cell has no true mean: nothing is claimed there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mechanisms.noise import Grid
from mechanisms.queries.intervals import NoiseQuantile, union_level

QuantileFn = Callable[[float], NoiseQuantile]
"""A block's noise quantile at a level (public law); None for a block released exactly."""

_SLACK = 2.0**-40
"""Relative outward widening of a derived bound: a handful of float operations, each ≤ 2^-53 relative."""


@dataclass(frozen=True)
class BlockLaw:
    """What a block's interval needs: its grid, whether its answer is exact on it, and its noise law."""

    grid: Grid
    exact: bool
    quantile: QuantileFn | None


def block_interval(law: BlockLaw, noisy_units: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) per cell of one block at ``level``: noisy ± γ·(k + r)."""
    if law.quantile is None:
        values = law.grid.from_units(noisy_units).astype(np.float64)
        return values, values
    steps = law.quantile(level).units + (0 if law.exact else 1)
    units = np.asarray(noisy_units).astype(object)
    lower = law.grid.from_units(units - steps).astype(np.float64)
    upper = law.grid.from_units(units + steps).astype(np.float64)
    return lower, upper


@dataclass(frozen=True)
class MeasureSpec:
    """One measure's derivation: its kind, the labels of the blocks it reads and, for derived measures,
    the column's center c, half-range H and declared [min, max]."""

    label: str
    kind: str
    blocks: tuple[str, ...]
    count_block: str | None = None
    public_size: int | None = None
    center: float = 0.0
    half_range: float = 0.0
    low: float = 0.0
    high: float = 0.0


Bounds = tuple[np.ndarray, np.ndarray]


def measure_intervals(
    specs: Sequence[MeasureSpec],
    laws: Mapping[str, BlockLaw],
    noisy: Mapping[str, np.ndarray],
    level: float,
    n_cells: int,
) -> tuple[dict[str, Bounds], list[str]]:
    """Per measure, (lower, upper) per cell; and the labels whose interval is a union bound."""
    out: dict[str, Bounds] = {}
    union: list[str] = []
    for spec in specs:
        moving = [b for b in spec.blocks if laws[b].quantile is not None]
        at = union_level(level, len(moving))
        parts = {b: block_interval(laws[b], noisy[b], at) for b in spec.blocks}
        if len(moving) > 1:
            union.append(spec.label)
        if spec.kind in ("count", "sum", "count_distinct"):
            out[spec.label] = parts[spec.blocks[0]]
            continue
        out[spec.label] = _derived(spec, parts, n_cells)
    return out, union


def _derived(spec: MeasureSpec, parts: Mapping[str, Bounds], n_cells: int) -> Bounds:
    if spec.count_block is None:
        size = float(spec.public_size or 1)
        n_low, n_high = np.full(n_cells, size), np.full(n_cells, size)
    else:
        n_low, n_high = parts[spec.count_block]
    empty = n_high < 1.0  # on the coverage event the cell is empty: no true value to cover
    n_low, n_high = np.maximum(n_low, 1.0), np.maximum(n_high, 1.0)
    h = spec.half_range
    s_low, s_high = parts[next(b for b in spec.blocks if b.startswith("csum("))]
    m_low, m_high = _ratio(s_low, s_high, n_low, n_high)
    m_low, m_high = np.clip(m_low, -h, h), np.clip(m_high, -h, h)
    if spec.kind == "mean":
        lower = np.clip(_down(spec.center + m_low), spec.low, spec.high)
        upper = np.clip(_up(spec.center + m_high), spec.low, spec.high)
        return np.where(empty, spec.low, lower), np.where(empty, spec.high, upper)
    q_low, q_high = parts[next(b for b in spec.blocks if b.startswith("csumsq("))]
    second_low, second_high = _ratio(q_low, q_high, n_low, n_high)
    square_high = np.maximum(m_low * m_low, m_high * m_high)
    square_low = np.where((m_low <= 0.0) & (m_high >= 0.0), 0.0, np.minimum(m_low * m_low, m_high * m_high))
    top = h * h
    var_low = np.clip(_down(second_low - square_high, second_low, square_high), 0.0, top)
    var_high = np.clip(_up(second_high - square_low, second_high, square_low), 0.0, top)
    var_low, var_high = np.where(empty, 0.0, var_low), np.where(empty, top, var_high)
    if spec.kind == "variance":
        return var_low, var_high
    return _down(np.sqrt(var_low)).clip(0.0, h), _up(np.sqrt(var_high)).clip(0.0, h)


def _ratio(a_low: np.ndarray, a_high: np.ndarray, n_low: np.ndarray, n_high: np.ndarray) -> Bounds:
    """The extremes of a/n over a ∈ [a_low, a_high], n ∈ [n_low, n_high] ⊂ [1, ∞) (at the corners)."""
    corners = np.stack([a_low / n_low, a_low / n_high, a_high / n_low, a_high / n_high])
    return _down(corners.min(axis=0)), _up(corners.max(axis=0))


def _down(value: np.ndarray, *terms: np.ndarray) -> np.ndarray:
    """``value`` lowered by the float error of the few operations that produced it (relative to the
    magnitudes of its terms)."""
    scale = np.abs(value) + sum((np.abs(t) for t in terms), np.zeros_like(value))
    result: np.ndarray = value - _SLACK * scale - np.finfo(np.float64).tiny
    return result


def _up(value: np.ndarray, *terms: np.ndarray) -> np.ndarray:
    scale = np.abs(value) + sum((np.abs(t) for t in terms), np.zeros_like(value))
    result: np.ndarray = value + _SLACK * scale + np.finfo(np.float64).tiny
    return result
