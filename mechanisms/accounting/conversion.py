"""RDP → (ε, δ) conversions and the filter's capacity per order.

* ``epsilon_at_delta``: Mironov 2017 Prop. 3 / Ghazi et al. Lemma 7(ii): ε = ε(α) + log(1/δ)/(α−1),
  minimised over the grid. The only conversion proven for ex-post quantities.
* ``epsilon_at_delta_tight``: Balle et al. 2020 Thm. 21 (as in Google's dp-accounting):
  ε = ε(α) + log((α−1)/α) − (log δ + log α)/(α−1). Valid for **ex-ante** RDP only.
* ``capacity_units``: the filter's per-slot capacity B(α) = ε − log(|A|/δ)/(α−1)
  (docs/privacy/filter.md#filter), rounded down, with the pure slot (α = ∞) at capacity ε. ``None`` marks an
  unusable slot (B(α) ≤ 0, or every finite order when δ = 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction

import numpy as np

from mechanisms.accounting.curve import RdpCurve, pad_up
from mechanisms.accounting.fixed_point import UNITS_PER_EPSILON, UnitsVector, units_down
from mechanisms.accounting.orders import validate_orders


def _check_delta(delta: float, allow_zero: bool) -> float:
    if not (math.isfinite(delta) and (0.0 <= delta < 1.0)) or (delta == 0.0 and not allow_zero):
        raise ValueError(f"delta must be in {'[0, 1)' if allow_zero else '(0, 1)'}, got {delta!r}")
    return float(delta)


def epsilon_at_delta(curve: RdpCurve, delta: float) -> float:
    """Smallest ε over the grid by Lemma 7(ii) (Mironov's conversion); the pure bound at δ = 0.

    Minimising over α after the fact is valid for ex-ante curves; for ex-post charges the filter uses
    δ/|A| per order instead (``filter_epsilon``): Lemma 7 of Ghazi et al. 2024 holds at an α fixed in
    advance, so the filter union-bounds over the grid (docs/privacy/filter.md#proof-of-dp).
    """
    _check_delta(delta, allow_zero=True)
    if delta == 0.0:
        return curve.pure
    alphas = np.asarray(curve.orders)
    eps = np.asarray(curve.values) + math.log(1.0 / delta) / (alphas - 1.0)
    return pad_up(min(float(np.min(eps)), curve.pure))


def epsilon_at_delta_tight(curve: RdpCurve, delta: float) -> float:
    """Balle et al. 2020 Thm. 21; for ex-ante curves only (never for ex-post charges)."""
    _check_delta(delta, allow_zero=False)
    alphas = np.asarray(curve.orders)
    eps = (
        np.asarray(curve.values)
        + np.log((alphas - 1.0) / alphas)
        - (math.log(delta) + np.log(alphas)) / (alphas - 1.0)
    )
    return pad_up(max(0.0, min(float(np.min(eps)), curve.pure)))


def union_bound_term(orders: Sequence[float], delta: float, alpha: float) -> float:
    """log(|A|/δ)/(α−1), padded up."""
    return pad_up(math.log(len(orders) / delta) / (alpha - 1.0))


def capacity_units(epsilon: float, delta: float, orders: Sequence[float]) -> tuple[int | None, ...]:
    """Per-slot capacity in units: B(α) for each order (rounded down), then the pure slot at ε."""
    if not (math.isfinite(epsilon) and epsilon >= 0.0):
        raise ValueError(f"epsilon must be finite and ≥ 0, got {epsilon!r}")
    _check_delta(delta, allow_zero=True)
    orders = validate_orders(orders)
    exact_epsilon = Fraction(Decimal(repr(float(epsilon))))
    slots: list[int | None] = []
    for alpha in orders:
        term = union_bound_term(orders, delta, alpha) if delta > 0.0 else math.inf
        if not math.isfinite(term):  # δ = 0, or δ so small that log(|A|/δ) overflows: unusable
            slots.append(None)
            continue
        # Exact rational arithmetic: a 28-digit Decimal context could round B(α) up.
        bound = exact_epsilon - Fraction(Decimal(repr(term)))
        units = math.floor(bound * UNITS_PER_EPSILON)
        slots.append(units if units > 0 else None)
    slots.append(units_down(epsilon))
    return tuple(slots)


def filter_epsilon(total: UnitsVector, delta: float, orders: Sequence[float]) -> float:
    """The ε the filter currently guarantees at δ for a total: min over usable slots, rounded up.

    Computed exactly (units are integers, the union-bound term is already padded up), then rounded up.
    """
    candidates = [
        math.inf if total.is_infinite(len(orders)) else Fraction(total.finite[-1], UNITS_PER_EPSILON)
    ]
    if delta > 0.0:
        for j, alpha in enumerate(orders):
            term_float = union_bound_term(orders, delta, alpha)
            if not total.is_infinite(j) and math.isfinite(term_float):
                term = Fraction(Decimal(repr(term_float)))
                candidates.append(Fraction(total.finite[j], UNITS_PER_EPSILON) + term)
    best = min(candidates)
    return math.inf if best == math.inf else _float_up(Fraction(best))


def _float_up(value: Fraction) -> float:
    """The nearest float whose shortest decimal (how floats are read as amounts here) is ≥ ``value``."""
    result = float(value)
    while Fraction(Decimal(repr(result))) < value:
        result = math.nextafter(result, math.inf)
    return result
