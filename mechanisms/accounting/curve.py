"""The immutable Rényi-DP curve: the privacy loss of one release or of a whole transcript.

A curve holds ε(α) for every order α of a fixed grid, plus ``pure``: a pure-DP bound ε_∞ that holds for the
same release (``inf`` when the mechanism has none). The filter treats the pure bound as the order α = ∞.

Values are **not** clamped to the pure bound. For ex-ante curves min(ε(α), ε_∞) would be valid, but for
ex-post charges the pointwise minimum of two valid ex-post functions ε̃_α(o), ε̃_∞(o) is not an ex-post
RDP function in general (Def. 6 of Ghazi et al. can fail; tests/unit/test_accounting.py has a
counterexample). Each slot of the filter therefore sums its own valid function.

Curves computed with floating point are padded upwards by a few ulps (``pad_up``) so that rounding can
only over-charge. Pure values given by the caller are kept exactly as given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from mechanisms.accounting.orders import validate_orders

_RELATIVE_PAD = 16 * np.finfo(float).eps


def pad_up(value: float) -> float:
    """An upper bound on the exact value of ``value``, computed with a handful of correctly rounded float
    operations: ``value`` times (1 + 16 machine epsilons), then one ulp up. 0 and ±∞ are returned as is.

    Every charge a mechanism computes in floating point passes through this (or an exact rational rounding
    such as ``sum_up``), so the float error can only over-charge; the ledger then rounds the padded float up
    to its fixed-point units (``fixed_point.units_up``, docs/privacy/ledger.md#ledger-arithmetic)."""
    if value == 0.0 or not math.isfinite(value):
        return value
    return math.nextafter(value * (1.0 + _RELATIVE_PAD), math.inf)


def laplace_rdp_upper(alphas: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """Upper bound on the Rényi divergence of Laplace(0, b) vs Laplace(ε·b, b) at order α.

    min of three upper bounds: ε (pure DP, Lemma 7(i)); αε²/2 (ε-DP ⇒ ε²/2-zCDP, Bun & Steinke 2016
    Prop. 1.4; tight as ε → 0); and Mironov 2017 Prop. 6,
    log(α/(2α−1)·e^{(α−1)ε} + (α−1)/(2α−1)·e^{−αε})/(α−1), evaluated with logaddexp plus a margin for
    its float error (a few ulps of the operands, which cancel for small ε).
    """
    a = np.log(alphas / (2 * alphas - 1)) + (alphas - 1) * eps
    b = np.log((alphas - 1) / (2 * alphas - 1)) - alphas * eps
    margin = 32 * np.finfo(float).eps * (1.0 + np.abs(a) + np.abs(b)) / (alphas - 1)
    mironov = np.logaddexp(a, b) / (alphas - 1) + margin
    bound = np.minimum(np.minimum(eps, alphas * eps * eps / 2), mironov)
    result: np.ndarray = np.maximum(bound, 0.0)
    return result


def pure_dp_rdp_upper(alphas: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """Upper bound on the Rényi divergence of order α of **any** ε-DP mechanism (discrete Laplace included).

    The largest D_α over pairs with e^{−ε} ≤ P/Q ≤ e^{ε} is randomized response's (Lemma RR,
    docs/privacy/finite_precision.md#lemma-rr): log((e^{αε} + e^{(1−α)ε})/(1 + e^{ε}))/(α−1). The discrete
    Laplace at a one-step shift attains it, so this, not Mironov's continuous Laplace formula, bounds grid
    releases. min with ε and αε²/2 as in ``laplace_rdp_upper``; float error covered by a margin.
    """
    a = alphas * eps
    b = (1 - alphas) * eps
    c = np.logaddexp(0.0, eps)
    margin = 32 * np.finfo(float).eps * (1.0 + np.abs(a) + np.abs(b) + c) / (alphas - 1)
    randomized_response = (np.logaddexp(a, b) - c) / (alphas - 1) + margin
    bound = np.minimum(np.minimum(eps, alphas * eps * eps / 2), randomized_response)
    result: np.ndarray = np.maximum(bound, 0.0)
    return result


def sum_up(values: Iterable[float]) -> float:
    """A float ≥ the exact sum of ``values`` (exact rational sum, rounded up if inexact)."""
    exact = sum((Fraction(v) for v in values), Fraction(0))
    result = float(exact)
    return math.nextafter(result, math.inf) if Fraction(result) < exact else result


def laplace_scale(l1_sensitivity: float, epsilon: float) -> float:
    """Laplace scale b with Δ₁/b ≤ ε, where ε is read as its shortest decimal (the charged value).

    fl(Δ₁/ε) is within half an ulp of Δ₁/ε and repr(ε) within half an ulp of ε; four ulps up cover both.
    """
    if not (epsilon > 0.0 and math.isfinite(epsilon)):
        raise ValueError("epsilon must be finite and > 0")
    if not (l1_sensitivity >= 0.0 and math.isfinite(l1_sensitivity)):
        raise ValueError("the l1 sensitivity must be finite and ≥ 0")
    scale = l1_sensitivity / epsilon
    for _ in range(4):
        scale = math.nextafter(scale, math.inf)
    if not math.isfinite(scale):
        raise ValueError("epsilon is too small: the Laplace scale Δ₁/ε overflows")
    return scale


def _positive_if(values: np.ndarray, positive: bool) -> np.ndarray:
    """A positive loss must never be charged 0 (underflow): raise such values to the smallest float."""
    result: np.ndarray = np.maximum(values, np.nextafter(0.0, 1.0)) if positive else values
    return result


def _check_loss(value: float, what: str) -> float:
    value = float(value)
    if math.isnan(value) or value < 0.0:
        raise ValueError(f"{what} must be ≥ 0 or +inf, got {value!r}")
    return value


@dataclass(frozen=True)
class RdpCurve:
    """ε(α) on a finite order grid, with an optional pure-DP bound. Values are ≥ 0 or +∞."""

    orders: tuple[float, ...]
    values: tuple[float, ...]
    pure: float = math.inf

    def __post_init__(self) -> None:
        orders = validate_orders(self.orders)
        if len(self.values) != len(orders):
            raise ValueError(f"{len(self.values)} values for {len(orders)} orders")
        pure = _check_loss(self.pure, "the pure bound")
        values = tuple(_check_loss(v, "an RDP value") for v in self.values)
        object.__setattr__(self, "orders", orders)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "pure", pure)

    # ----- constructors -------------------------------------------------------------------------
    @classmethod
    def zero(cls, orders: Sequence[float]) -> RdpCurve:
        return cls(tuple(orders), (0.0,) * len(orders), 0.0)

    @classmethod
    def from_pure(cls, epsilon: float, orders: Sequence[float]) -> RdpCurve:
        """A pure (ex-post or ex-ante) ε is the constant curve ε (Lemma 7(i), Ghazi et al.)."""
        eps = _check_loss(epsilon, "epsilon")
        return cls(tuple(orders), (eps,) * len(orders), eps)

    @classmethod
    def gaussian(cls, l2_sensitivity: float, sigma: float, orders: Sequence[float]) -> RdpCurve:
        """Gaussian mechanism: ε(α) = α·Δ₂²/(2σ²) (Mironov 2017, Prop. 7). No pure bound."""
        if not (sigma > 0.0 and math.isfinite(sigma)):
            raise ValueError("sigma must be finite and > 0")
        if not (l2_sensitivity >= 0.0 and math.isfinite(l2_sensitivity)):
            raise ValueError("the l2 sensitivity must be finite and ≥ 0")
        alphas = np.asarray(orders, dtype=float)
        if l2_sensitivity == 0.0:  # nothing moves: no loss, whatever σ
            values = np.zeros_like(alphas)
        else:
            with np.errstate(divide="ignore", over="ignore"):  # σ² underflowing to 0 (or Δ² overflowing)
                values = alphas * l2_sensitivity**2 / (2.0 * sigma**2)  # gives +∞: still an upper bound
        values = _positive_if(values, l2_sensitivity > 0.0)
        return cls(tuple(orders), tuple(pad_up(float(v)) for v in values))

    @classmethod
    def laplace(cls, shifts: Iterable[float], epsilon: float, orders: Sequence[float]) -> RdpCurve:
        """Laplace noise of scale ``laplace_scale(Σ shifts, ε)`` on coordinates moving by ≤ ``shifts``.

        Per coordinate with ε_j = shift_j/scale (Mironov 2017, Prop. 6):
        ε_j(α) = log(α/(2α−1)·e^{(α−1)ε_j} + (α−1)/(2α−1)·e^{−αε_j}) / (α−1).
        Independent coordinates add. The pure bound is Δ₁/scale ≤ ε, kept exactly as the given ε.
        """
        shift_array = np.asarray([_check_loss(s, "a shift") for s in shifts], dtype=float)
        scale = laplace_scale(sum_up(shift_array), epsilon)
        eps = np.nextafter(shift_array / scale, np.inf)  # ≥ the exact shift/scale
        per_coordinate = laplace_rdp_upper(np.asarray(orders, dtype=float)[:, None], eps[None, :])
        values = _positive_if(per_coordinate.sum(axis=1), bool(np.any(shift_array > 0.0)))
        return cls(tuple(orders), tuple(pad_up(float(v)) for v in values), float(epsilon))

    @classmethod
    def pure_product(cls, epsilons: Iterable[float], orders: Sequence[float]) -> RdpCurve:
        """Independent coordinates, coordinate j ε_j-DP (e.g. discrete Laplace noise on a grid).

        Rényi divergences of product distributions add, so Σ_j bound(ε_j) holds; the whole release is also
        (Σε_j)-DP, so bound(Σε_j) holds too: the smaller of the two is charged, with bound =
        ``pure_dp_rdp_upper``. The pure slot is Σε_j (rounded up).
        """
        eps = np.asarray([_check_loss(e, "a pure epsilon") for e in epsilons], dtype=float)
        total = sum_up(eps.tolist())
        alphas = np.asarray(orders, dtype=float)
        summed = pure_dp_rdp_upper(alphas[:, None], eps[None, :]).sum(axis=1)
        joint = pure_dp_rdp_upper(alphas, np.full(alphas.shape, total))
        values = _positive_if(np.minimum(summed, joint), total > 0.0)
        return cls(tuple(orders), tuple(pad_up(float(v)) for v in values), total)

    # ----- algebra -------------------------------------------------------------------------------
    def _same_grid(self, other: RdpCurve) -> None:
        if self.orders != other.orders:
            raise ValueError("curves are on different order grids")

    def __add__(self, other: RdpCurve) -> RdpCurve:
        """Adaptive composition: RDP values add order by order, pure bounds add."""
        self._same_grid(other)
        values = tuple(pad_up(a + b) for a, b in zip(self.values, other.values, strict=True))
        return RdpCurve(self.orders, values, pad_up(self.pure + other.pure))

    def maximum(self, other: RdpCurve) -> RdpCurve:
        """Pointwise maximum: a bound valid for either release."""
        self._same_grid(other)
        values = tuple(max(a, b) for a, b in zip(self.values, other.values, strict=True))
        return RdpCurve(self.orders, values, max(self.pure, other.pure))

    def __le__(self, other: RdpCurve) -> bool:
        """Pointwise ≤ at every order and for the pure bound."""
        self._same_grid(other)
        return self.pure <= other.pure and all(a <= b for a, b in zip(self.values, other.values, strict=True))

    def __ge__(self, other: RdpCurve) -> bool:
        return other <= self

    @property
    def is_pure(self) -> bool:
        return math.isfinite(self.pure)

    def at(self, alpha: float) -> float:
        return self.values[self.orders.index(alpha)]

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly form; +∞ becomes the string "inf"."""
        return {
            "orders": list(self.orders),
            "values": [json_loss(v) for v in self.values],
            "pure": json_loss(self.pure),
        }


JsonLoss = float | str
"""A loss in ε units as JSON: a number, or the string "inf" (JSON has no infinity)."""


def json_loss(value: float) -> JsonLoss:
    """A loss (≥ 0 or +∞) for a JSON body: +∞ becomes the string "inf", anything else is kept."""
    return "inf" if math.isinf(value) else value
