"""Releases on a public grid γ = 2^k (docs/privacy/finite_precision.md#fp-construction).

A real answer f is released as γ·(round(f/γ) + Z) with Z integer noise from ``mechanisms.noise.exact``.
The grid is chosen from public quantities only (sensitivity, dimension, noise scale), so the set of possible
releases is the same for every dataset: an exact multiple of γ with |units| < 2^52, computed exactly in
floating point (multiplying an integer below 2^53 by a power of two is exact).

Rounding enlarges the sensitivity: coordinate-wise |round(a) − round(b)| ≤ ⌈|a − b|⌉ ≤ |a − b| + 1, so in
grid units ‖Δ‖₁ ≤ Δ₁/γ + d and ‖Δ‖₂ ≤ Δ₂/γ + √d (triangle inequality on the rounding errors, each in
(−1, 1)). Integer-valued answers on γ = 1 are not rounded at all and keep their sensitivity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from mechanisms.noise.exact import Noise

_MAX_UNITS = float(1 << 52)
_SHORT = 16  # to_units works on Python floats up to this length (NumPy calls cost ~1 µs each)
DEFAULT_RELATIVE_PENALTY = 2.0**-10
"""Default bound on the rounding's relative increase of the sensitivity (0.1 %)."""


@dataclass(frozen=True)
class Grid:
    """The public grid γ = 2^exponent on which a release lies."""

    exponent: int

    @property
    def granularity(self) -> float:
        return math.ldexp(1.0, self.exponent)

    def to_units(self, values: np.ndarray) -> np.ndarray:
        """⌊values/γ + ½⌋ as int64: the division by a power of two, ⌊x⌋ and x − ⌊x⌋ are exact below 2^52.
        Round-half-up, not half-even: Lemma GRID's ⌈|a − b|⌉ needs a rounding that commutes with integer
        shifts (half-even maps 0.5 → 0 and 1.5 → 2, two steps apart for inputs one apart). Short vectors
        (a model's coordinates) take the same steps on Python floats (IEEE doubles): the same result."""
        array = np.asarray(values, dtype=np.float64)
        if array.size <= _SHORT:
            short = np.array([self._unit(v) for v in array.ravel().tolist()], dtype=np.int64)
            return short.reshape(array.shape)
        scaled = np.ldexp(array, -self.exponent)
        if not np.abs(scaled).max(initial=0.0) < _MAX_UNITS:  # also false for NaN and ±inf
            raise ValueError("a value is too large for its grid (|value/γ| ≥ 2^52)")
        whole = np.floor(scaled)
        units: np.ndarray = (whole + (scaled - whole >= 0.5)).astype(np.int64)  # both steps exact
        return units

    def _unit(self, value: float) -> int:
        """``to_units`` of one float."""
        scaled = math.ldexp(value, -self.exponent)
        if not abs(scaled) < _MAX_UNITS:
            raise ValueError("a value is too large for its grid (|value/γ| ≥ 2^52)")
        whole = math.floor(scaled)
        return whole + (scaled - whole >= 0.5)

    def from_units(self, units: np.ndarray) -> np.ndarray:
        """γ·units as float64, exact while |units| < 2^53 (checked)."""
        array = np.asarray(units)
        if array.dtype == object:
            if any(abs(int(u)) >= 1 << 53 for u in array.ravel()):
                raise OverflowError("a released value left the exactly representable range")
            array = array.astype(np.int64)
        if np.abs(array).max(initial=0) >= 1 << 53:
            raise OverflowError("a released value left the exactly representable range")
        result: np.ndarray = np.ldexp(array.astype(np.float64), self.exponent)
        return result

    def describe(self) -> dict[str, float | int]:
        """What a release says about its grid: every released number is a multiple of ``granularity``."""
        return {"granularity": self.granularity, "grid_exponent": self.exponent}


def _grid_below(size: float) -> Grid:
    """The largest power-of-two grid ≤ ``size`` (> 0)."""
    if not (size > 0.0 and math.isfinite(size)):
        raise ValueError("a grid needs a finite positive size")
    _mantissa, exponent = math.frexp(size)  # size = mantissa·2^exponent, mantissa ∈ [0.5, 1)
    return Grid(exponent - 1)


def laplace_grid(
    l1_sensitivity: float, dim: int, integer_valued: bool, penalty: float = DEFAULT_RELATIVE_PENALTY
) -> Grid:
    """γ = 1 for integer answers with integer sensitivity ≥ 1; else the largest 2^k ≤ penalty·Δ₁/d, so the
    rounding adds at most ``penalty``·Δ₁ to the ℓ1 sensitivity."""
    if integer_valued and l1_sensitivity >= 1.0 and float(l1_sensitivity).is_integer():
        return Grid(0)
    return _grid_below(penalty * l1_sensitivity / max(dim, 1))


def gaussian_grid(
    l2_sensitivity: float, dim: int, integer_valued: bool, penalty: float = DEFAULT_RELATIVE_PENALTY
) -> Grid:
    """γ = 1 for integer answers with integer-valued shifts; else the largest 2^k ≤ penalty·Δ₂/√d."""
    if integer_valued and l2_sensitivity >= 1.0:
        return Grid(0)
    return _grid_below(penalty * l2_sensitivity / math.sqrt(max(dim, 1)))


def grid_l1_sensitivity(l1_sensitivity: float, dim: int, grid: Grid, integer_valued: bool) -> float:
    """An upper bound on ‖round(f/γ) − round(f′/γ)‖₁ over neighbours (grid units)."""
    if integer_valued and grid.exponent == 0:
        return float(l1_sensitivity)
    return float_up(Fraction(l1_sensitivity) / Fraction(grid.granularity) + dim)


def grid_l2_sensitivity(l2_sensitivity: float, dim: int, grid: Grid, integer_valued: bool) -> float:
    """An upper bound on ‖round(f/γ) − round(f′/γ)‖₂ over neighbours (grid units)."""
    if integer_valued and grid.exponent == 0:
        return float(l2_sensitivity)
    units = float_up(Fraction(l2_sensitivity) / Fraction(grid.granularity))
    return math.nextafter(units + math.sqrt(dim) * (1 + 2**-50), math.inf)


def float_up(value: Fraction) -> float:
    """The smallest float ≥ ``value`` (+inf beyond the float range): how exact rationals become charges."""
    try:
        result = float(value)
    except OverflowError:
        return math.inf
    return result if Fraction(result) >= value else math.nextafter(result, math.inf)


def dyadic_scale_up(value: float | Fraction, bits: int = 40) -> Fraction:
    """The smallest a/2^m ≥ value with a < 2^bits (m ≥ 0 chosen so a keeps ``bits`` significant bits):
    a noise scale rounded **up** to a rational the exact samplers take cheaply (more noise, never less)."""
    x = Fraction(value)
    if x <= 0:
        raise ValueError("a scale must be > 0")
    shift = max(0, bits - (math.floor(x) + 1).bit_length())
    numerator = math.ceil(x * (1 << shift))
    return Fraction(numerator, 1 << shift)


def laplace_on_grid(noise: Noise, values: np.ndarray, grid: Grid, scale_units: Fraction) -> np.ndarray:
    """γ·(round(values/γ) + Z), Z ~ discrete Laplace of scale ``scale_units`` (grid units) per coordinate."""
    array = np.asarray(values, dtype=np.float64)
    units = grid.to_units(array.ravel())
    released = units + noise.discrete_laplace(scale_units, units.size)
    return grid.from_units(released).reshape(array.shape)


def gaussian_on_grid(noise: Noise, values: np.ndarray, grid: Grid, variance_units: Fraction) -> np.ndarray:
    """γ·(round(values/γ) + Z), Z ~ discrete Gaussian of variance ``variance_units`` (grid units)."""
    array = np.asarray(values, dtype=np.float64)
    units = grid.to_units(array.ravel())
    released = units + noise.discrete_gaussian(variance_units, units.size)
    return grid.from_units(released).reshape(array.shape)
