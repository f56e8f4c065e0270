"""Closed-form tests of the accounting core (``mechanisms.accounting``), with odd constants.

Independent references used here (never the code under test):
* exact rational arithmetic (``fractions.Fraction``) for the Gaussian curve and the Laplace scale;
* 60-digit ``decimal`` evaluation of Mironov 2017 Prop. 6 and of log(|A|/δ)/(α−1);
* scipy quadrature of the Rényi integral ∫ p^α q^{1−α} between Laplace(0, b) and Laplace(μ, b).

Tests under "regression" headings pin bugs found in ``mechanisms/accounting`` while this suite was written
(small-ε Laplace cancellation, clamping ex-post values to the pure bound, 28-digit Decimal capacities, no
grid validation in ``capacity_units``); each failed on the code before its fix.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Callable
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from fractions import Fraction

import pytest
from scipy import integrate

from mechanisms.accounting import (
    DEFAULT_ORDERS,
    UNITS_PER_EPSILON,
    RdpCurve,
    UnitsVector,
    capacity_units,
    epsilon_at_delta,
    epsilon_at_delta_tight,
    filter_epsilon,
    laplace_scale,
    union_bound_term,
    units_down,
    units_to_epsilon,
    units_up,
    validate_orders,
)

ORDERS = DEFAULT_ORDERS
ODD_ORDERS = (1.3, 1.7, 2.0, 3.5, 7.25, 19.0, 77.0, 300.0)
PRECISION = 60


# ----- independent references ------------------------------------------------------------------------
def dec(x: float | Fraction) -> Decimal:
    """Exact decimal of a float (or a high-precision decimal of a fraction)."""
    if isinstance(x, Fraction):
        with localcontext() as ctx:
            ctx.prec = PRECISION
            return Decimal(x.numerator) / Decimal(x.denominator)
    return Decimal(x)  # exact binary value, NOT repr


def laplace_rdp_exact(eps: Fraction, alpha: float) -> Decimal:
    """Mironov 2017 Prop. 6, evaluated in 60-digit decimal arithmetic."""
    with localcontext() as ctx:
        ctx.prec = PRECISION
        a, e = Decimal(alpha), dec(eps)
        inner = (a / (2 * a - 1)) * ((a - 1) * e).exp() + ((a - 1) / (2 * a - 1)) * (-a * e).exp()
        return inner.ln() / (a - 1)


def laplace_rdp_quadrature(mu: float, b: float, alpha: float) -> float:
    """D_α(Lap(0, b) ‖ Lap(μ, b)) by numerical integration of ∫ p^α q^{1−α}.

    The integrand is divided by its maximum e^{(α−1)μ/b} (reached at x = 0) to avoid overflow; the log of
    that constant is added back.
    """
    shift = (alpha - 1.0) * mu / b

    def integrand(x: float) -> float:
        return math.exp(-(alpha * abs(x) + (1.0 - alpha) * abs(x - mu)) / b - shift) / (2.0 * b)

    pieces = [(-math.inf, 0.0), (0.0, mu), (mu, math.inf)]
    total = math.fsum(
        integrate.quad(integrand, lo, hi, epsabs=0.0, epsrel=1e-13, limit=200)[0] for lo, hi in pieces
    )
    return (shift + math.log(total)) / (alpha - 1.0)


def union_term_exact(n_orders: int, delta: float, alpha: float) -> Decimal:
    with localcontext() as ctx:
        ctx.prec = PRECISION
        return (Decimal(n_orders) / Decimal(delta)).ln() / (Decimal(alpha) - 1)


def exact_sub(a: Decimal, b: Decimal) -> Decimal:
    """a − b without the 28-digit rounding of the default decimal context."""
    with localcontext() as ctx:
        ctx.prec = PRECISION
        return a - b


def finite_units(x: float) -> int:
    """The ledger charge of a finite value."""
    units = units_up(x)
    assert units is not None
    return units


def ceil_units(x: Decimal) -> int:
    with localcontext() as ctx:
        ctx.prec = PRECISION
        return int((x * UNITS_PER_EPSILON).to_integral_value(rounding=ROUND_CEILING))


def floor_units(x: Decimal) -> int:
    with localcontext() as ctx:
        ctx.prec = PRECISION
        return int((x * UNITS_PER_EPSILON).to_integral_value(rounding=ROUND_FLOOR))


# ----- orders -------------------------------------------------------------------------------------------
def test_default_grid_is_valid() -> None:
    assert validate_orders(ORDERS) == ORDERS
    assert len(ORDERS) == 20
    assert ORDERS[0] == 1.25
    assert ORDERS[-1] == 256.0


@pytest.mark.parametrize(
    "orders",
    [(), (1.0, 2.0), (0.5,), (2.0, 2.0), (3.0, 2.0), (2.0, math.inf), (math.nan,), (-3.0, 2.0)],
)
def test_invalid_orders_raise(orders: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="order"):
        validate_orders(orders)
    with pytest.raises(ValueError, match="order"):
        RdpCurve(orders, (0.0,) * len(orders))


# ----- Gaussian -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("l2", "sigma"), [(0.7, 1.3), (1.0, 0.37), (2.6, 11.1), (0.013, 0.0071), (5.5, 3.0)])
def test_gaussian_closed_form(l2: float, sigma: float) -> None:
    curve = RdpCurve.gaussian(l2, sigma, ODD_ORDERS)
    assert curve.pure == math.inf
    assert not curve.is_pure
    for alpha, value in zip(ODD_ORDERS, curve.values, strict=True):
        exact = Fraction(alpha) * Fraction(l2) ** 2 / (2 * Fraction(sigma) ** 2)
        assert Fraction(value) >= exact  # never under the exact real value of the float inputs
        assert value == pytest.approx(float(exact), rel=1e-14)
        # and the ledger charge is at least the exact value in units
        assert finite_units(value) >= ceil_units(dec(exact))


def test_gaussian_zero_sensitivity_is_free() -> None:
    assert RdpCurve.gaussian(0.0, 2.3, ORDERS) == RdpCurve(ORDERS, (0.0,) * len(ORDERS))


@pytest.mark.parametrize(
    ("l2", "sigma"), [(-1.0, 1.0), (math.nan, 1.0), (1.0, 0.0), (1.0, -2.0), (1.0, math.inf)]
)
def test_gaussian_invalid(l2: float, sigma: float) -> None:
    with pytest.raises(ValueError, match=r"sigma|sensitivity"):
        RdpCurve.gaussian(l2, sigma, ORDERS)


# ----- Laplace ------------------------------------------------------------------------------------------
MODERATE_LAPLACE = [(1.7, 0.37), (1.7, 1.3), (0.45, 2.9), (1.0, 7.7), (13.0, 0.61), (0.2, 0.93)]


@pytest.mark.parametrize(("l1", "epsilon"), MODERATE_LAPLACE)
def test_laplace_matches_quadrature(l1: float, epsilon: float) -> None:
    curve = RdpCurve.laplace([l1], epsilon, ODD_ORDERS)
    scale = laplace_scale(l1, epsilon)
    for alpha, value in zip(ODD_ORDERS, curve.values, strict=True):
        assert value == pytest.approx(laplace_rdp_quadrature(l1, scale, alpha), rel=1e-10)


@pytest.mark.parametrize(("l1", "epsilon"), MODERATE_LAPLACE)
def test_laplace_never_below_exact_prop6(l1: float, epsilon: float) -> None:
    curve = RdpCurve.laplace([l1], epsilon, ODD_ORDERS)
    eps_true = Fraction(l1) / Fraction(laplace_scale(l1, epsilon))
    for alpha, value in zip(ODD_ORDERS, curve.values, strict=True):
        exact = laplace_rdp_exact(eps_true, alpha)
        assert dec(value) >= exact
        assert value == pytest.approx(float(exact), rel=1e-13)
        assert finite_units(value) >= ceil_units(exact)
    assert curve.pure == epsilon
    assert max(curve.values) <= epsilon


def test_laplace_large_order_tends_to_pure() -> None:
    orders = (2.0, 10.0, 1e3, 1e6)
    curve = RdpCurve.laplace([1.0], 0.83, orders)
    assert list(curve.values) == sorted(curve.values)
    assert curve.values[-1] == pytest.approx(0.83, rel=1e-5)
    assert curve.values[-1] <= 0.83


def test_laplace_coordinates_add() -> None:
    shifts = (0.3, 1.1, 0.6)
    epsilon = 0.77
    curve = RdpCurve.laplace(shifts, epsilon, ODD_ORDERS)
    scale = laplace_scale(math.fsum(shifts), epsilon)
    for alpha, value in zip(ODD_ORDERS, curve.values, strict=True):
        exact = sum(laplace_rdp_exact(Fraction(s) / Fraction(scale), alpha) for s in shifts)
        assert dec(value) >= exact
        assert value == pytest.approx(float(exact), rel=1e-13)
    single = RdpCurve.laplace([2.0], epsilon, ODD_ORDERS)
    assert curve <= single  # spreading the same ℓ1 shift over coordinates never costs more
    assert curve.pure == single.pure == epsilon


# Regression (small ε): Prop. 6 evaluated as logaddexp(log(α/(2α−1)) + (α−1)ε, log((α−1)/(2α−1)) − αε)/(α−1)
# cancels catastrophically (both arguments O(1), result ≈ αε²/2): the relative error exceeded the 16-eps pad
# for ε ≲ 0.1 and the value underflowed to 0.0 for ε ≲ 1e-8 (ε = 1e-9 was free at α ≤ 10).
@pytest.mark.parametrize("epsilon", [1e-12, 1e-9, 1e-6, 1e-3, 0.01, 0.1])
def test_laplace_small_epsilon_never_below_exact(epsilon: float) -> None:
    curve = RdpCurve.laplace([1.0], epsilon, ORDERS)
    eps_true = Fraction(1) / Fraction(laplace_scale(1.0, epsilon))
    below = [
        (alpha, value)
        for alpha, value in zip(ORDERS, curve.values, strict=True)
        if dec(value) < laplace_rdp_exact(eps_true, alpha)
    ]
    assert below == []
    # and not absurdly loose
    for alpha, value in zip(ORDERS, curve.values, strict=True):
        assert value == pytest.approx(float(laplace_rdp_exact(eps_true, alpha)), rel=1e-6)


def test_laplace_tiny_epsilon_is_not_free() -> None:
    # ε = 1e-9 (accepted by LaplaceParams: gt=0) is charged 0.0 at α ∈ {1.25, …, 10}: the slot never fills.
    curve = RdpCurve.laplace([1.0], 1e-9, ORDERS)
    assert all(finite_units(v) >= 1 for v in curve.values)


def test_laplace_ledger_charge_never_below_exact_units() -> None:
    # Found by bisection on ε so that the exact RDP lies just above a unit boundary.
    epsilon, alpha = 0.012259096142433935, 2.0
    curve = RdpCurve.laplace([1.0], epsilon, (alpha,))
    exact = laplace_rdp_exact(Fraction(1) / Fraction(laplace_scale(1.0, epsilon)), alpha)
    assert finite_units(curve.values[0]) >= ceil_units(exact)  # was 149665740 < 149665741


def test_laplace_random_values_never_below_exact() -> None:
    rng = random.Random(31337)
    for _ in range(300):
        shifts = [
            float(f"{10 ** rng.uniform(-3, 2):.{rng.randint(1, 17)}g}") for _ in range(rng.randint(1, 3))
        ]
        epsilon = float(f"{10 ** rng.uniform(-12, 1.7):.{rng.randint(1, 17)}g}")
        orders = tuple(sorted({1.0 + 10 ** rng.uniform(-3, 3) for _ in range(3)}))
        curve = RdpCurve.laplace(shifts, epsilon, orders)
        scale = laplace_scale(math.fsum(shifts), epsilon)
        for alpha, value in zip(orders, curve.values, strict=True):
            exact = sum(laplace_rdp_exact(Fraction(s) / Fraction(scale), alpha) for s in shifts)
            assert dec(value) >= exact, (shifts, epsilon, alpha)


@pytest.mark.parametrize(
    ("l1", "epsilon"), [(1.0, 0.0), (1.0, -1.0), (1.0, math.inf), (-1.0, 1.0), (math.nan, 1.0)]
)
def test_laplace_invalid(l1: float, epsilon: float) -> None:
    with pytest.raises(ValueError, match=r"epsilon|sensitivity|shift"):
        RdpCurve.laplace([l1], epsilon, ORDERS)


# ----- Laplace scale calibration ------------------------------------------------------------------------
ODD_EPSILONS = [0.1, 0.3, 0.7, 1.1, 1 / 3, 2 / 3, 0.01, 1e-7, 3.3, 99.9, 0.123456789, 1e-300]


@pytest.mark.parametrize("epsilon", ODD_EPSILONS)
@pytest.mark.parametrize("l1", [1.0, 0.1, 2.0, 7.3, 1e-3, 123.456])
def test_laplace_scale_is_calibrated_to_the_charged_decimal(l1: float, epsilon: float) -> None:
    scale = laplace_scale(l1, epsilon)
    charged = Fraction(Decimal(repr(epsilon)))
    assert Fraction(l1) / Fraction(scale) <= charged
    # and not wastefully large: within 8 ulps of Δ₁/ε
    assert scale <= (l1 / epsilon) + 8 * math.ulp(l1 / epsilon)


def test_laplace_scale_random_values() -> None:
    rng = random.Random(20240217)
    for _ in range(20_000):
        l1 = float(f"{10 ** rng.uniform(-6, 6):.{rng.randint(1, 17)}g}")
        epsilon = float(f"{10 ** rng.uniform(-9, 2):.{rng.randint(1, 17)}g}")
        scale = laplace_scale(l1, epsilon)
        assert Fraction(l1) / Fraction(scale) <= Fraction(Decimal(repr(epsilon)))


def test_laplace_scale_invalid() -> None:
    with pytest.raises(ValueError, match="epsilon"):
        laplace_scale(1.0, 0.0)
    with pytest.raises(ValueError, match="sensitivity"):
        laplace_scale(-1.0, 1.0)


# ----- pure curves and clamping ------------------------------------------------------------------------
def test_pure_curve_is_constant() -> None:
    curve = RdpCurve.from_pure(0.37, ORDERS)
    assert curve.values == (0.37,) * len(ORDERS)
    assert curve.pure == 0.37
    assert curve.is_pure
    assert curve.at(16.0) == 0.37
    assert RdpCurve.from_pure(math.inf, ORDERS).values == (math.inf,) * len(ORDERS)


def test_zero_curve() -> None:
    zero = RdpCurve.zero(ORDERS)
    assert zero.values == (0.0,) * len(ORDERS)
    assert zero.pure == 0.0
    assert UnitsVector.charge(zero) == UnitsVector.zeros(len(ORDERS) + 1)


def test_values_are_not_clamped_to_pure() -> None:
    # Each slot keeps its own valid function; see the coin-mechanism regression below for why.
    curve = RdpCurve((1.5, 2.0, 9.0), (0.2, 5.0, math.inf), 0.9)
    assert curve.values == (0.2, 5.0, math.inf)
    assert curve.pure == 0.9
    charge = UnitsVector.charge(curve)
    assert charge.finite == (2 * 10**11, 5 * 10**12, 0, 9 * 10**11)
    assert charge.infinite == (0, 0, 1, 0)


def test_as_dict_serialises_infinity() -> None:
    curve = RdpCurve((2.0, 3.0), (0.5, math.inf))
    assert curve.as_dict() == {"orders": [2.0, 3.0], "values": [0.5, "inf"], "pure": "inf"}


@pytest.mark.parametrize(
    ("values", "pure"),
    [((math.nan, 0.1), math.inf), ((-0.1, 0.1), math.inf), ((0.1, 0.2), math.nan), ((0.1, 0.2), -1.0)],
)
def test_invalid_losses_raise(values: tuple[float, float], pure: float) -> None:
    with pytest.raises(ValueError, match="≥ 0"):
        RdpCurve((2.0, 4.0), values, pure)


def test_wrong_number_of_values_raises() -> None:
    with pytest.raises(ValueError, match="values for"):
        RdpCurve((2.0, 4.0), (0.1,))


# ----- composition and maximum -------------------------------------------------------------------------
def test_composition_adds_orders_and_pure_bounds() -> None:
    a = RdpCurve.from_pure(0.37, ODD_ORDERS)
    b = RdpCurve.gaussian(1.0, 2.9, ODD_ORDERS)
    c = RdpCurve.laplace([0.5], 1.3, ODD_ORDERS)
    total = a + b + c
    for j in range(len(ODD_ORDERS)):
        exact = Fraction(a.values[j]) + Fraction(b.values[j]) + Fraction(c.values[j])
        assert Fraction(total.values[j]) >= exact
        assert total.values[j] == pytest.approx(float(exact), rel=1e-14)
    assert total.pure == math.inf  # the Gaussian has no pure bound
    pure_total = a + c
    assert Fraction(pure_total.pure) >= Fraction(0.37) + Fraction(1.3)
    assert pure_total.pure == pytest.approx(1.67, rel=1e-14)
    assert a + b == b + a


def test_maximum_is_pointwise() -> None:
    a = RdpCurve((2.0, 8.0, 32.0), (0.1, 0.9, 4.0), 3.0)
    b = RdpCurve((2.0, 8.0, 32.0), (0.5, 0.2, math.inf))
    m = a.maximum(b)
    assert m.values == (0.5, 0.9, math.inf)
    assert m.pure == math.inf
    assert a <= m
    assert b <= m
    assert m >= a


def test_order_is_pointwise_including_pure() -> None:
    a = RdpCurve((2.0, 8.0), (0.1, 0.2), 0.3)
    b = RdpCurve((2.0, 8.0), (0.1, 0.2))
    assert a <= b
    assert not b <= a


def test_mismatched_grids_raise() -> None:
    a = RdpCurve.from_pure(0.1, (2.0, 3.0))
    b = RdpCurve.from_pure(0.1, (2.0, 4.0))
    with pytest.raises(ValueError, match="different order grids"):
        _ = a + b
    with pytest.raises(ValueError, match="different order grids"):
        a.maximum(b)
    with pytest.raises(ValueError, match="different order grids"):
        _ = a <= b


# ----- fixed-point units --------------------------------------------------------------------------------
def test_decimal_convention() -> None:
    assert units_up(0.1) == 10**11
    assert units_down(0.1) == 10**11
    assert units_up(1.0) == UNITS_PER_EPSILON
    assert units_up(0.30000000000000004) == 300_000_000_001  # repr keeps the trailing 4 → rounds up
    assert units_down(0.30000000000000004) == 300_000_000_000
    assert units_up(1e-13) == 1
    assert units_down(1e-13) == 0
    assert units_up(5e-324) == 1
    assert units_up(0.0) == 0
    assert units_up(-0.0) == 0
    assert units_up(math.inf) is None
    assert units_to_epsilon(10**11) == 0.1


def test_ten_tenths_make_exactly_one() -> None:
    tenth = UnitsVector.charge(RdpCurve.from_pure(0.1, ORDERS))
    total = UnitsVector.zeros(len(ORDERS) + 1)
    for _ in range(10):
        total = total + tenth
    assert total.finite == (UNITS_PER_EPSILON,) * (len(ORDERS) + 1)
    assert total.fits(capacity_units(1.0, 0.0, ORDERS))[-1]  # OpenDP #2131 cannot happen here
    assert not (total + UnitsVector.charge(RdpCurve.from_pure(1e-12, ORDERS))).fits(
        capacity_units(1.0, 0.0, ORDERS)
    )[-1]


@pytest.mark.parametrize(
    "x", [0.1, 0.2, 0.3, 1 / 3, 2 / 3, math.pi, math.e, 1e-12, 1.5e-12, 123456.789, 1e15 + 0.3, 7e-300]
)
def test_units_rounding_direction(x: float) -> None:
    up, down = units_up(x), units_down(x)
    assert up is not None
    assert Decimal(up) / UNITS_PER_EPSILON >= Decimal(repr(x))
    assert Decimal(down) / UNITS_PER_EPSILON <= Decimal(repr(x))
    assert 0 <= up - down <= 1


@pytest.mark.parametrize("x", [-1e-300, -1.0, math.nan])
def test_units_up_rejects_invalid(x: float) -> None:
    with pytest.raises(ValueError, match="≥ 0"):
        units_up(x)


@pytest.mark.parametrize("x", [math.inf, -math.inf, math.nan])
def test_units_down_rejects_non_finite(x: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        units_down(x)


def test_units_down_may_be_negative() -> None:
    assert units_down(-0.25) == -250_000_000_000


# ----- UnitsVector --------------------------------------------------------------------------------------
def test_units_vector_round_trip_with_infinite_parts() -> None:
    orders = (2.0, 4.0, 8.0)
    base = UnitsVector.charge(RdpCurve(orders, (0.1, 0.2, math.inf), math.inf))
    assert base.finite == (10**11, 2 * 10**11, 0, 0)
    assert base.infinite == (0, 0, 1, 1)
    other = UnitsVector.charge(RdpCurve(orders, (math.inf, 0.7, 0.3)))
    total = base + other
    assert total.infinite == (1, 0, 1, 2)
    assert total.is_infinite(0)
    assert total.epsilon(0) == math.inf
    assert total.epsilon(1) == pytest.approx(0.9)
    assert total - other == base
    assert total - base == other
    assert (total - other - base) == UnitsVector.zeros(4)


def test_units_vector_subtraction_guards() -> None:
    a = UnitsVector((1, 2), (0, 0))
    b = UnitsVector((2, 0), (0, 0))
    with pytest.raises(ValueError, match="more than the total"):
        _ = a - b
    with pytest.raises(ValueError, match="negative count"):
        _ = a - UnitsVector((0, 0), (1, 0))
    with pytest.raises(ValueError, match="differ in length"):
        UnitsVector((1, 2), (0,))
    with pytest.raises(ValueError, match="slot counts differ"):
        _ = a + UnitsVector((1,), (0,))
    with pytest.raises(ValueError, match="slot counts differ"):
        _ = a - UnitsVector((1,), (0,))


def test_units_vector_fits() -> None:
    total = UnitsVector((5, 5, 5, 5), (0, 1, 0, 0))
    assert total.fits((5, 10, None, 4)) == [True, False, False, False]
    assert len(total) == 4


def test_units_vector_json_round_trip() -> None:
    v = UnitsVector((10**30, 0, 7), (0, 3, 0))
    assert UnitsVector.from_json(v.to_json()) == v


# ----- capacity -----------------------------------------------------------------------------------------
def test_capacity_pure_filter() -> None:
    caps = capacity_units(0.37, 0.0, ORDERS)
    assert len(caps) == len(ORDERS) + 1
    assert caps[:-1] == (None,) * len(ORDERS)
    assert caps[-1] == 370_000_000_000


@pytest.mark.parametrize(("epsilon", "delta"), [(1.0, 1e-5), (3.7, 1e-7), (0.9, 0.013), (11.3, 1e-9)])
def test_capacity_rdp_filter(epsilon: float, delta: float) -> None:
    caps = capacity_units(epsilon, delta, ORDERS)
    assert caps[-1] == units_down(epsilon)
    for alpha, cap in zip(ORDERS, caps, strict=False):
        exact = exact_sub(Decimal(repr(epsilon)), union_term_exact(len(ORDERS), delta, alpha))
        if exact <= 0:
            assert cap is None, alpha
            continue
        if cap is None:  # allowed only when B(α) < 1 unit after rounding down
            assert floor_units(exact) <= 0
            continue
        assert cap <= floor_units(exact)  # rounded down, never above B(α)
        assert floor_units(exact) - cap <= 10


def test_capacity_unusable_orders() -> None:
    caps = capacity_units(1.0, 1e-5, ORDERS)
    # log(20/1e-5)/(α−1) = 14.5/(α−1) ≥ 1 for α ≤ 15.5
    assert all(cap is None for alpha, cap in zip(ORDERS, caps, strict=False) if alpha <= 15.5)
    assert all(cap is not None for alpha, cap in zip(ORDERS, caps, strict=False) if alpha >= 16.0)
    assert capacity_units(0.0, 0.5, ORDERS)[:-1] == (None,) * len(ORDERS)
    assert capacity_units(0.0, 0.5, ORDERS)[-1] == 0


def test_union_bound_term_is_an_upper_bound() -> None:
    for delta in (1e-5, 1e-9, 0.3):
        for alpha in ODD_ORDERS:
            assert Decimal(repr(union_bound_term(ODD_ORDERS, delta, alpha))) >= union_term_exact(
                len(ODD_ORDERS), delta, alpha
            )


@pytest.mark.parametrize(
    ("epsilon", "delta"),
    [(-1.0, 1e-5), (math.inf, 1e-5), (math.nan, 1e-5), (1.0, -1e-5), (1.0, 1.0), (1.0, math.nan)],
)
def test_capacity_invalid(epsilon: float, delta: float) -> None:
    with pytest.raises(ValueError, match=r"epsilon|delta"):
        capacity_units(epsilon, delta, ORDERS)


def test_capacity_is_rounded_down_for_huge_orders() -> None:
    # Regression: B(α) was computed in the default 28-digit Decimal context, which rounded 1 − 1.4e-30 to 1.
    orders = (2.0, 1e30)
    caps = capacity_units(1.0, 0.5, orders)
    exact = exact_sub(Decimal(1), union_term_exact(len(orders), 0.5, 1e30))
    assert caps[1] is not None
    assert caps[1] <= floor_units(exact)  # was 10**12 > 10**12 − 1


@pytest.mark.parametrize("orders", [(0.5,), (1.0,), (3.0, 2.0), (2.0, 2.0), ()])
def test_capacity_rejects_invalid_orders(orders: tuple[float, ...]) -> None:
    # Regression: (0.5,) used to give a capacity of 24 ε (log(|A|/δ)/(α−1) < 0 for α < 1).
    with pytest.raises(ValueError, match="order"):
        capacity_units(1.0, 1e-5, orders)


# ----- conversions and the filter's ε ------------------------------------------------------------------
def test_epsilon_at_delta_gaussian_closed_form() -> None:
    sigma, delta = 3.1, 1e-6
    curve = RdpCurve.gaussian(1.0, sigma, ODD_ORDERS)
    with localcontext() as ctx:
        ctx.prec = PRECISION
        exact = min(
            Decimal(a) / (2 * Decimal(sigma) ** 2) + (1 / Decimal(delta)).ln() / (Decimal(a) - 1)
            for a in ODD_ORDERS
        )
    got = epsilon_at_delta(curve, delta)
    assert dec(got) >= exact
    assert got == pytest.approx(float(exact), rel=1e-13)
    assert epsilon_at_delta(curve, 0.0) == math.inf
    assert epsilon_at_delta(RdpCurve.from_pure(0.37, ORDERS), 0.0) == 0.37
    # a pure curve never converts to more than its pure bound
    assert epsilon_at_delta(RdpCurve.from_pure(0.37, ORDERS), 1e-5) <= 0.37 * (1 + 1e-14)


def test_epsilon_at_delta_tight_closed_form() -> None:
    sigma, delta = 2.3, 1e-5
    curve = RdpCurve.gaussian(1.0, sigma, ODD_ORDERS)
    with localcontext() as ctx:
        ctx.prec = PRECISION
        d = Decimal(delta)
        exact = min(
            Decimal(a) / (2 * Decimal(sigma) ** 2)
            + ((Decimal(a) - 1) / Decimal(a)).ln()
            - (d.ln() + Decimal(a).ln()) / (Decimal(a) - 1)
            for a in ODD_ORDERS
        )
    got = epsilon_at_delta_tight(curve, delta)
    assert dec(got) >= exact
    assert got == pytest.approx(float(exact), rel=1e-13)
    assert got <= epsilon_at_delta(curve, delta)


@pytest.mark.parametrize("delta", [-0.1, 1.0, 1.5, math.nan, math.inf])
def test_conversions_reject_invalid_delta(delta: float) -> None:
    curve = RdpCurve.gaussian(1.0, 2.0, ORDERS)
    with pytest.raises(ValueError, match="delta"):
        epsilon_at_delta(curve, delta)
    with pytest.raises(ValueError, match="delta"):
        epsilon_at_delta_tight(curve, delta)
    with pytest.raises(ValueError, match="delta"):
        epsilon_at_delta_tight(curve, 0.0)


def test_filter_epsilon() -> None:
    n = len(ORDERS)
    zero = UnitsVector.zeros(n + 1)
    assert filter_epsilon(zero, 1e-5, ORDERS) == 0.0  # the pure slot
    gauss = UnitsVector.charge(RdpCurve.gaussian(1.0, 9.0, ORDERS))
    assert gauss.is_infinite(n)
    eps = filter_epsilon(gauss, 1e-5, ORDERS)
    expected = min(
        units_to_epsilon(gauss.finite[j]) + union_bound_term(ORDERS, 1e-5, a) for j, a in enumerate(ORDERS)
    )
    assert expected <= eps <= math.nextafter(math.nextafter(expected, math.inf), math.inf)  # rounded up
    assert eps >= epsilon_at_delta(RdpCurve.gaussian(1.0, 9.0, ORDERS), 1e-5)  # the union bound costs
    assert filter_epsilon(gauss, 0.0, ORDERS) == math.inf  # δ = 0: only the pure slot counts
    pure = UnitsVector.charge(RdpCurve.from_pure(0.25, ORDERS))
    assert filter_epsilon(pure + pure, 0.0, ORDERS) == 0.5
    assert filter_epsilon(pure + pure, 1e-5, ORDERS) == 0.5
    with_inf = UnitsVector((0,) * n + (7,), (1,) * n + (0,))
    assert filter_epsilon(with_inf, 1e-5, ORDERS) == 7e-12


def test_filter_epsilon_at_capacity_is_at_most_epsilon() -> None:
    for epsilon, delta in [(1.0, 1e-5), (3.7, 1e-7), (0.9, 0.013)]:
        caps = capacity_units(epsilon, delta, ORDERS)
        for j, cap in enumerate(caps):
            if cap is None:
                continue
            finite = [0] * len(caps)
            finite[j] = cap
            infinite = [1] * len(caps)
            infinite[j] = 0
            total = UnitsVector(tuple(finite), tuple(infinite))
            assert filter_epsilon(total, delta, ORDERS) <= epsilon * (1 + 1e-15)


# ----- regression: no clamping of ex-post values to the pure bound -------------------------------------
# A legitimate mechanism: a public fair coin c ∈ {1, 2} picks randomized response with ε_c (ε₁ = 0.05,
# ε₂ = 3). Two valid ex-post statements hold for every output (c, y):
#   * ex-post pure DP with ε̃(c, y) = ε_c (P(o) ≤ e^{ε_c} Q(o), both directions), and
#   * ex-post RDP with the constant function c_α = D_α(M(D) ‖ M(D′)) (Def. 6 with a constant is ex-ante RDP).
# ``RdpCurve(orders, c_α, pure=ε_c)`` used to clamp c_α to ε₁ on coin-1 outputs. The pointwise minimum of two
# valid ex-post functions is not a valid ex-post function: the clamped charge violated Def. 6 (sum 1.427) and
# a (50, 1e-3) filter fed these curves had true δ ≥ 0.405.
COIN_EPS = (0.05, 3.0)


def _rr(eps: float) -> tuple[float, float]:
    p = math.exp(eps) / (1.0 + math.exp(eps))
    return p, 1.0 - p


def _mixture_rdp(alpha: float) -> float:
    def rr_rdp(eps: float) -> float:
        p, q = _rr(eps)
        return math.log(p**alpha * q ** (1 - alpha) + q**alpha * p ** (1 - alpha)) / (alpha - 1)

    mix = sum(0.5 * math.exp((alpha - 1) * rr_rdp(e)) for e in COIN_EPS)
    return math.log(mix) / (alpha - 1)


def _coin_curve(orders: tuple[float, ...], coin: int) -> RdpCurve:
    return RdpCurve(orders, tuple(_mixture_rdp(a) for a in orders), COIN_EPS[coin])


def _clamped_coin_curve(orders: tuple[float, ...], coin: int) -> RdpCurve:
    """What the old clamp produced: min(c_α, ε_c) at every order."""
    return RdpCurve(orders, tuple(min(_mixture_rdp(a), COIN_EPS[coin]) for a in orders), COIN_EPS[coin])


def _def6_sum(alpha: float, charge_of_coin: Callable[[int], float]) -> float:
    total = 0.0
    for coin, eps in enumerate(COIN_EPS):
        p, q = _rr(eps)
        for pp, qq in ((p, q), (q, p)):
            total += (0.5 * pp) ** alpha / (math.exp(charge_of_coin(coin)) * 0.5 * qq) ** (alpha - 1)
    return total


@pytest.mark.parametrize("alpha", [1.5, 2.0, 8.0])
def test_coin_mechanism_statements_are_valid_separately(alpha: float) -> None:
    c_alpha = _mixture_rdp(alpha)
    assert _def6_sum(alpha, lambda coin: c_alpha) <= 1.0 + 1e-12
    assert _def6_sum(alpha, lambda coin: COIN_EPS[coin]) <= 1.0 + 1e-12
    # ... but their pointwise minimum is not an ex-post RDP function
    assert _def6_sum(alpha, lambda coin: min(c_alpha, COIN_EPS[coin])) > 1.1


@pytest.mark.parametrize("alpha", [1.5, 2.0, 8.0])
def test_curve_charge_satisfies_def6(alpha: float) -> None:
    assert _def6_sum(alpha, lambda coin: _coin_curve((alpha,), coin).values[0]) <= 1.0 + 1e-12


def _filter_delta_for_coin_mechanism(
    make_curve: Callable[[tuple[float, ...], int], RdpCurve],
) -> tuple[float, float]:
    """Run the filter (ε = 50, δ = 1e-3, A = {2}) on repeated coin-mechanism requests; exact computation.

    Charges only depend on the public coin, so admission depends on (n₁, n₂), the numbers of each coin; the
    privacy loss is L = ε₁(2X₁ − n₁) + ε₂(2X₂ − n₂) with X_c ~ Bin(n_c, p_c) under D (1 − p_c under D′).
    Returns (P_D(L > ε), P_D(L > ε) − e^ε P_D′(L > ε)); the second number is a lower bound on the true δ.
    """
    from scipy.stats import binom

    orders, epsilon, delta = (2.0,), 50.0, 1e-3
    caps = capacity_units(epsilon, delta, orders)
    worst = UnitsVector.charge(make_curve(orders, 1))
    charges = [UnitsVector.charge(make_curve(orders, c)) for c in (0, 1)]
    final: dict[tuple[int, int], float] = defaultdict(float)
    frontier: dict[tuple[int, int], float] = {(0, 0): 1.0}
    while frontier:
        nxt: dict[tuple[int, int], float] = defaultdict(float)
        for (n1, n2), prob in frontier.items():
            spent = UnitsVector(
                tuple(n1 * a + n2 * b for a, b in zip(charges[0].finite, charges[1].finite, strict=True)),
                (0,) * len(caps),
            )
            if any((spent + worst).fits(caps)):
                nxt[(n1 + 1, n2)] += prob / 2
                nxt[(n1, n2 + 1)] += prob / 2
            else:
                final[(n1, n2)] += prob
        frontier = nxt
    (p1, _), (p2, _) = _rr(COIN_EPS[0]), _rr(COIN_EPS[1])
    p_d = p_d_prime = 0.0
    for (n1, n2), prob in final.items():
        for x1 in range(n1 + 1):
            for x2 in range(n2 + 1):
                if COIN_EPS[0] * (2 * x1 - n1) + COIN_EPS[1] * (2 * x2 - n2) > epsilon:
                    p_d += prob * binom.pmf(x1, n1, p1) * binom.pmf(x2, n2, p2)
                    p_d_prime += prob * binom.pmf(x1, n1, 1 - p1) * binom.pmf(x2, n2, 1 - p2)
    return p_d, p_d - math.exp(epsilon) * p_d_prime


@pytest.mark.slow
def test_filter_with_coin_mechanism_keeps_delta() -> None:
    p_tail, delta_true = _filter_delta_for_coin_mechanism(_coin_curve)
    assert p_tail <= 1e-3
    assert delta_true <= 1e-3


@pytest.mark.slow
def test_clamping_would_break_the_filter() -> None:
    # Documents the size of the old bug: same filter, clamped curves.
    p_tail, delta_true = _filter_delta_for_coin_mechanism(_clamped_coin_curve)
    assert p_tail > 0.4
    assert delta_true > 0.4


# ----- regressions: positive losses are never free; the displayed ε is an upper bound ------------
@pytest.mark.parametrize("kind", ["gaussian", "laplace"])
def test_positive_loss_is_never_free(kind: str) -> None:
    orders = (2.0, 16.0)
    if kind == "gaussian":
        curve = RdpCurve.gaussian(1e-170, 1.0, orders)
    else:
        curve = RdpCurve.laplace([1.0], 1e-170, orders)
    assert all(finite_units(v) >= 1 for v in curve.values)


def test_filter_epsilon_is_an_upper_bound() -> None:
    orders, delta = (2.0, 16.0), 1e-5
    total = UnitsVector((8549180827234, 6298469024260, 10**15), (0, 0, 0))
    with localcontext() as ctx:
        ctx.prec = PRECISION
        exact = min(
            [Decimal(total.finite[-1]) / UNITS_PER_EPSILON]
            + [
                Decimal(total.finite[j]) / UNITS_PER_EPSILON
                + Decimal(repr(union_bound_term(orders, delta, a)))
                for j, a in enumerate(orders)
            ]
        )
    assert Decimal(repr(filter_epsilon(total, delta, orders))) >= exact  # 7.112207200628681 < …6813


def test_units_vector_arithmetic_matches_its_slotwise_definition() -> None:
    """``+``, ``-`` and ``<=`` (written with ``map`` for speed) against the slot-by-slot definitions, on
    random vectors with and without infinite slots (a failure shows the vectors)."""
    rng = random.Random(20261126)
    for _ in range(3000):
        slots = rng.randint(1, 6)

        def vector(slots: int) -> UnitsVector:
            finite = tuple(rng.choice([0, 1, 2, 10**12, 2**70]) for _ in range(slots))
            infinite = tuple(rng.choice([0, 0, 0, 1, 2]) for _ in range(slots))
            return UnitsVector(finite, infinite)

        a, b = vector(slots), vector(slots)
        total = a + b
        assert total.finite == tuple(x + y for x, y in zip(a.finite, b.finite, strict=True)), (a, b)
        assert total.infinite == tuple(x + y for x, y in zip(a.infinite, b.infinite, strict=True)), (a, b)
        assert total - b == a, (a, b)
        expected_le = all(
            bi > 0 or (ai == 0 and af <= bf)
            for af, ai, bf, bi in zip(a.finite, a.infinite, b.finite, b.infinite, strict=True)
        )
        assert (a <= b) is expected_le, (a, b)
        assert a <= total, (a, b)
