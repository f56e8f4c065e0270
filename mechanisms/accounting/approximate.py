"""The charge of an approximate-DP request: an RDP curve plus a δ on the filter's δ-ledger.

An (ε, δ)-DP request (generalized propose-test-release, OPS-PTR) is admitted through the approximate-DP path
of docs/privacy/approximate.md#approximate-dp (route (a)): it is charged RR_α(ε) at every order α (the largest
Rényi divergence of any ε-indistinguishable pair, Lemma RR, docs/privacy/finite_precision.md#lemma-rr), ε at
the pure slot, and δ on a separate δ-ledger whose capacity is the share δ_A of the dataset's δ set aside at
creation. The RDP slots' capacity then uses the remainder δ_R = δ − δ_A. Theorem APPROX-FILTER
(docs/privacy/approximate.md#theorem-approx-filter) proves that the whole transcript stays (ε, δ)-DP under
full adaptivity.

δ values are kept in exact integer units of 10⁻³⁰ (``DELTA_UNITS``): charges round **up**, capacities
**down**, like the ε units of ``fixed_point``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

from mechanisms.accounting.curve import RdpCurve

DELTA_UNITS = 10**30
"""Units of δ per 1: δ = 10⁻³⁰ is one unit (Liu–Talwar per-call δ's reach 10⁻²²)."""


def _exact(value: float) -> Fraction:
    """A float as the shortest decimal that round-trips (what the ledger reads)."""
    return Fraction(Decimal(repr(float(value))))


def delta_units_up(delta: float) -> int:
    """⌈δ·10³⁰⌉ from the larger of the float and its shortest decimal (a charge never rounds down)."""
    if not (math.isfinite(delta) and 0.0 <= delta < 1.0):
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")
    return math.ceil(max(Fraction(delta), _exact(delta)) * DELTA_UNITS)


def delta_units_down(delta: float) -> int:
    """⌊δ·10³⁰⌋ from the smaller of the float and its shortest decimal (a capacity never rounds up)."""
    if not (math.isfinite(delta) and 0.0 <= delta <= 1.0):
        raise ValueError(f"delta must be in [0, 1], got {delta!r}")
    return math.floor(min(Fraction(delta), _exact(delta)) * DELTA_UNITS)


def remainder_delta(delta: float, delta_share: float) -> float:
    """δ_R = δ − δ_A, rounded down to a float, for ``capacity_units``: the RDP slots' union bound uses it."""
    if not (0.0 < delta_share < delta < 1.0):
        raise ValueError("need 0 < delta_share < delta < 1")
    exact = min(Fraction(delta), _exact(delta)) - max(Fraction(delta_share), _exact(delta_share))
    if exact <= 0:
        raise ValueError("the δ share must be smaller than δ")
    result = float(exact)
    return result if Fraction(result) <= exact else math.nextafter(result, 0.0)


@dataclass(frozen=True)
class ApproximateCharge:
    """What an approximate request reserves and commits: ``curve`` on the RDP and pure slots, ``delta`` on
    the δ-ledger. Validated: finite pure slot (the declared ε), 0 < δ < 1, curve values ≤ the pure ε."""

    curve: RdpCurve
    delta: float

    def __post_init__(self) -> None:
        delta = float(self.delta)
        if not (math.isfinite(delta) and 0.0 < delta < 1.0):
            raise ValueError(f"an approximate charge needs 0 < delta < 1, got {delta!r}")
        if not self.curve.is_pure:
            raise ValueError("an approximate charge declares its ε: the pure slot must be finite")
        floor = RdpCurve.pure_product([self.curve.pure], self.curve.orders).values
        if any(v < min(f, self.curve.pure) for v, f in zip(self.curve.values, floor, strict=True)):
            raise ValueError(
                "an approximate charge's curve must be ≥ RR_α(ε) at every order "
                "(docs/privacy/approximate.md#theorem-approx-filter Step 3)"
            )
        object.__setattr__(self, "delta", delta)

    @classmethod
    def from_epsilon_delta(cls, epsilon: float, delta: float, orders: Sequence[float]) -> ApproximateCharge:
        """An (ε, δ)-DP request: RR_α(ε) at every order (docs/privacy/approximate.md#theorem-approx-filter
        Step 3), ε at the pure slot."""
        if not (math.isfinite(epsilon) and epsilon > 0.0):
            raise ValueError(f"epsilon must be finite and > 0, got {epsilon!r}")
        product = RdpCurve.pure_product([epsilon], orders)
        values = tuple(min(v, epsilon) for v in product.values)  # RR_α(ε) ≤ ε; both valid, keep the smaller
        return cls(RdpCurve(product.orders, values, float(epsilon)), delta)

    @property
    def epsilon(self) -> float:
        return self.curve.pure

    @property
    def delta_units(self) -> int:
        return delta_units_up(self.delta)

    def as_dict(self) -> dict[str, object]:
        return {"curve": self.curve.as_dict(), "epsilon": self.epsilon, "delta": self.delta}


def fits_delta(spent_units: int, reserved_units: int, charge: ApproximateCharge, share: float) -> bool:
    """The δ-ledger half of admission (docs/privacy/approximate.md#theorem-approx-filter): spent + reserved +
    δ_k ≤ δ_A, in units."""
    return spent_units + reserved_units + charge.delta_units <= delta_units_down(share)
