"""The exact noise home (mechanisms/noise) as used by the query mechanisms: charges against exact Rényi
divergences, grid rounding sensitivity, scale rounding, seeded reproducibility and the system source.

* Discrete Gaussian N_Z(μ, σ²) vs N_Z(ν, σ²) at an integer shift: the exact Rényi divergence is summed over
  the integer support in 60-digit arithmetic (mpmath) and compared, at every order of the default grid,
  with the charge ``RdpCurve.gaussian(Δ, σ)`` (Canonne, Kamath, Steinke 2020, Prop. 5: α·Δ²/(2σ²)) and
  with dp-accounting's Gaussian event: charge ≥ exact everywhere.
* Discrete Laplace at an integer shift m: the exact divergence (closed-form geometric sums) against
  ``RdpCurve.pure_product`` (randomized response, Bun & Steinke 2016 Prop. 3.3) — charge ≥ exact, equal at
  m = 1 — and against Mironov's continuous-Laplace formula, which is **below** the exact discrete value at
  large orders: the reason discrete Laplace noise must be charged with ``pure_product``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve
from mechanisms.accounting.curve import laplace_rdp_upper
from mechanisms.noise import (
    Grid,
    Noise,
    dyadic_scale_up,
    gaussian_grid,
    grid_l1_sensitivity,
    grid_l2_sensitivity,
    laplace_grid,
)
from mechanisms.queries.language import FLOAT_SLACK, unit_shift

mpmath.mp.dps = 60


# ----- exact Rényi divergences ------------------------------------------------------------------------
def theta(centre: mpmath.mpf, var: mpmath.mpf) -> mpmath.mpf:
    """S(c) = Σ_{z∈Z} exp(−(z − c)²/(2v)), to 60 digits: the direct sum for v < 1 (terms beyond |z − c| > 60
    are < e^{−1800}), else Poisson summation √(2πv)·(1 + 2Σ_{k≥1} e^{−2π²vk²}·cos 2πkc) with k ≤ 12
    (the rest < e^{−2800})."""
    if var < 1:
        base = int(mpmath.floor(centre))
        return mpmath.fsum(mpmath.exp(-((z - centre) ** 2) / (2 * var)) for z in range(base - 60, base + 61))
    series = mpmath.fsum(
        mpmath.exp(-2 * mpmath.pi**2 * var * k * k) * mpmath.cos(2 * mpmath.pi * k * centre)
        for k in range(1, 13)
    )
    return mpmath.sqrt(2 * mpmath.pi * var) * (1 + 2 * series)


def discrete_gaussian_renyi(shift: int, variance: Fraction, alpha: float) -> mpmath.mpf:
    """D_α(N_Z(0, σ²) ‖ N_Z(shift, σ²)), exactly: both laws have the normaliser S(0) at an integer shift, and
    αz² + (1−α)(z−μ)² = (z − c)² + α(1−α)μ² with c = (1−α)μ, so
    D_α = αμ²/(2σ²) + log(S(c)/S(0))/(α − 1) (≤ αμ²/(2σ²) since S(c) ≤ S(0); equal when c is an integer)."""
    var = mpmath.mpf(variance.numerator) / variance.denominator
    a = mpmath.mpf(alpha)
    centre = (1 - a) * shift
    return a * shift**2 / (2 * var) + mpmath.log(theta(centre, var) / theta(mpmath.mpf(0), var)) / (a - 1)


def discrete_gaussian_renyi_by_summation(shift: int, variance: Fraction, alpha: float) -> mpmath.mpf:
    """The same divergence by plain summation over the integer support (small σ only: a cross-check)."""
    var = mpmath.mpf(variance.numerator) / variance.denominator
    a = mpmath.mpf(alpha)
    reach = int(40 * math.sqrt(float(variance))) + 30
    centre = int((1 - alpha) * shift)
    tilted = mpmath.fsum(
        mpmath.exp(-(a * z * z + (1 - a) * (z - shift) ** 2) / (2 * var))
        for z in range(centre - reach, centre + reach + 1)
    )
    normaliser = mpmath.fsum(mpmath.exp(-mpmath.mpf(z * z) / (2 * var)) for z in range(-reach, reach + 1))
    return mpmath.log(tilted / normaliser) / (a - 1)


def discrete_laplace_renyi(shift: int, scale: Fraction, alpha: float) -> mpmath.mpf:
    """D_α(DLap(0, t) ‖ DLap(m, t)), P(z) = (1−q)/(1+q)·q^{|z|}, q = e^{−1/t}: closed-form geometric sums
    over z ≤ 0, 0 < z < m and z ≥ m of q^{α|z| + (1−α)|z−m|}."""
    q = mpmath.exp(-mpmath.mpf(scale.denominator) / scale.numerator)
    a = mpmath.mpf(alpha)
    m = shift
    total = q ** ((1 - a) * m) / (1 - q) + q ** (a * m) / (1 - q)
    total += mpmath.fsum(q ** ((1 - a) * m + (2 * a - 1) * z) for z in range(1, m))
    return mpmath.log((1 - q) / (1 + q) * total) / (a - 1)


def _dp_accounting_gaussian(noise_multiplier: float) -> list[float]:
    dp_accounting = pytest.importorskip("dp_accounting")
    accountant = dp_accounting.rdp.RdpAccountant(list(DEFAULT_ORDERS))
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier))
    return [float(v) for v in accountant._rdp]


@pytest.mark.parametrize(
    ("shift", "sigma_units"),
    [(1, 0.5), (1, 1.0), (1, 3.0), (2, 2.5), (1025, 2048.0), (1281, 1024.0 * 1.7)],
)
def test_discrete_gaussian_charge_is_at_least_the_exact_divergence(shift: int, sigma_units: float) -> None:
    """The Gaussian mechanism's charge (requested σ in grid units, integer Δ₂_grid) at every default order
    ≥ the exact divergence of the noise it actually draws (s² = (σ/γ)² rounded up, the sampler's law)."""
    variance = dyadic_scale_up(Fraction(sigma_units) ** 2, bits=12)
    assert variance >= Fraction(sigma_units) ** 2
    charge = RdpCurve.gaussian(float(shift), sigma_units, DEFAULT_ORDERS)
    closed = [alpha * shift**2 / (2 * sigma_units**2) for alpha in DEFAULT_ORDERS]
    reference = _dp_accounting_gaussian(sigma_units / shift)
    for alpha, ours, formula, theirs in zip(DEFAULT_ORDERS, charge.values, closed, reference, strict=True):
        exact = discrete_gaussian_renyi(shift, variance, alpha)
        assert ours >= exact, (alpha, ours, exact)
        assert ours >= formula
        assert ours == pytest.approx(theirs, rel=1e-12)
        assert ours >= theirs
    # at the requested σ exactly (no rounding) and integer α the discrete bound is attained: no slack to spend
    exact_at_two = discrete_gaussian_renyi(shift, Fraction(sigma_units) ** 2, 2.0)
    assert float(exact_at_two) == pytest.approx(2.0 * shift**2 / (2 * sigma_units**2), rel=1e-12)
    if sigma_units <= 3.0:  # the closed form through S(c) agrees with a plain sum over the support
        for alpha in (1.25, 2.0, 5.5, 64.0):
            direct = discrete_gaussian_renyi_by_summation(shift, variance, alpha)
            assert abs(direct - discrete_gaussian_renyi(shift, variance, alpha)) < mpmath.mpf(10) ** -30


@pytest.mark.parametrize(
    ("shift", "scale"),
    [(1, Fraction(2)), (1, Fraction(1, 3)), (3, Fraction(3202)), (1025, Fraction(2050)), (2, Fraction(7, 2))],
)
def test_discrete_laplace_pure_product_is_at_least_the_exact_divergence(shift: int, scale: Fraction) -> None:
    epsilon = float(Fraction(shift) / scale)
    charge = RdpCurve.pure_product([math.nextafter(epsilon, math.inf)], DEFAULT_ORDERS)
    for alpha, ours in zip(DEFAULT_ORDERS, charge.values, strict=True):
        exact = discrete_laplace_renyi(shift, scale, alpha)
        assert ours >= exact, (alpha, ours, exact)
    assert charge.pure >= epsilon


def test_one_step_discrete_laplace_attains_randomized_response() -> None:
    """At a one-unit shift the exact discrete divergence *is* the randomized-response bound."""
    for scale in (Fraction(2), Fraction(1, 2), Fraction(10)):
        epsilon = 1 / scale
        for alpha in DEFAULT_ORDERS:
            exact = discrete_laplace_renyi(1, scale, alpha)
            e = mpmath.mpf(epsilon.numerator) / epsilon.denominator
            a = mpmath.mpf(alpha)
            rr = mpmath.log((mpmath.exp(a * e) + mpmath.exp((1 - a) * e)) / (1 + mpmath.exp(e))) / (a - 1)
            assert abs(exact - rr) < mpmath.mpf(10) ** -40


def test_mironov_continuous_formula_under_charges_the_discrete_laplace() -> None:
    """Pins why ``pure_product`` is needed: Mironov 2017 Prop. 6 (continuous Laplace, as charged before the
    grid) is below the exact discrete-Laplace divergence at large orders (ε = 1, shift 1, α = 256)."""
    scale = Fraction(1)
    alphas = np.asarray(DEFAULT_ORDERS, dtype=float)
    mironov = laplace_rdp_upper(alphas, np.full(alphas.shape, 1.0))
    exact = np.array([float(discrete_laplace_renyi(1, scale, a)) for a in DEFAULT_ORDERS])
    below = mironov < exact - 1e-6
    assert below[-1]  # α = 256
    assert exact[-1] - mironov[-1] > 1e-3  # 0.99877 vs 0.99729
    assert RdpCurve.laplace((1.0,), 1.0, DEFAULT_ORDERS).values[-1] < exact[-1]  # the old charge
    assert RdpCurve.pure_product((1.0,), DEFAULT_ORDERS).values[-1] >= exact[-1]


# ----- grid rounding ----------------------------------------------------------------------------------
finite = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False, allow_infinity=False)


@settings(max_examples=400, deadline=None)
@given(
    a=finite,
    fraction=st.floats(min_value=-1.0, max_value=1.0),
    delta=st.floats(min_value=1e-6, max_value=1e6),
)
def test_rounding_moves_at_most_the_grid_sensitivity(a: float, fraction: float, delta: float) -> None:
    """Neighbours a, b with |a − b| ≤ Δ: |round(a/γ) − round(b/γ)| ≤ Δ/γ + 1 (``grid_l1_sensitivity``,
    ``grid_l2_sensitivity`` for d = 1) and ≤ ``unit_shift``(Δ) = ⌊Δ/γ + slack⌋ + 1."""
    b = a + fraction * delta
    if abs(Fraction(b) - Fraction(a)) > Fraction(delta):
        b = math.nextafter(b, a)
    for grid in (laplace_grid(delta, 1, integer_valued=False), gaussian_grid(delta, 1, integer_valued=False)):
        if abs(a) / grid.granularity >= 2**51 or abs(b) / grid.granularity >= 2**51:
            continue
        ua, ub = (int(grid.to_units(np.array([v]))[0]) for v in (a, b))
        moved = abs(ua - ub)
        assert moved <= grid_l1_sensitivity(delta, 1, grid, integer_valued=False)
        assert moved <= grid_l2_sensitivity(delta, 1, grid, integer_valued=False)
        assert moved <= unit_shift(delta, grid, exact=False)
        assert grid.granularity <= delta * 2**-10


@settings(max_examples=300, deadline=None)
@given(a=st.integers(-(2**40), 2**40), step=st.integers(-5, 5))
def test_integer_answers_on_gamma_one_are_not_rounded(a: int, step: int) -> None:
    grid = laplace_grid(5.0, 1, integer_valued=True)
    assert grid == Grid(0)
    ua, ub = (int(grid.to_units(np.array([float(v)]))[0]) for v in (a, a + step))
    assert (ua, ub) == (a, a + step)
    assert abs(ua - ub) <= grid_l1_sensitivity(5.0, 1, grid, integer_valued=True) == 5.0
    assert unit_shift(5.0, grid, exact=True) == 5


def test_unit_shift_slack_covers_the_float_error_of_computed_answers() -> None:
    """FLOAT_SLACK = 2^-6 units: two computed values within 2^-51 relative of the truth, clamped to ±2^44
    units, are within 2^-7 units each."""
    assert FLOAT_SLACK == Fraction(1, 64)
    assert Fraction(2) ** -51 * 2**44 * 2 <= FLOAT_SLACK
    grid = Grid(-10)
    assert unit_shift(1.0, grid, exact=False) == 1025  # Δ/γ an integer: the +1 of rounding only
    assert unit_shift(1.0 - 2**-5, grid, exact=False) == 993  # ⌊992 + 1/64⌋ + 1
    assert unit_shift(1.0 - 2**-20, grid, exact=False) == 1025  # within the slack of 1024: counted up
    assert unit_shift(1.0, grid, exact=True) == 1024
    assert unit_shift(0.0, grid, exact=False) == 0


@settings(max_examples=500, deadline=None)
@given(
    value=st.one_of(
        st.fractions(min_value=Fraction(1, 10**12), max_value=Fraction(10**15)),
        st.floats(min_value=1e-300, max_value=1e300).map(Fraction),
    ),
    bits=st.integers(4, 52),
)
def test_dyadic_scale_up_never_rounds_down(value: Fraction, bits: int) -> None:
    rounded = dyadic_scale_up(value, bits=bits)
    assert rounded >= value
    assert rounded.denominator & (rounded.denominator - 1) == 0  # a power of two
    assert rounded <= value * (1 + Fraction(2, 2 ** (bits - 1))) + 1  # close: a few significant bits


def test_short_and_long_rounding_agree() -> None:
    """``Grid.to_units`` on short vectors (Python floats) and long ones (NumPy) give the same integers,
    halves included, and refuse the same values."""
    rng = np.random.default_rng(5)  # test data
    for exponent in (-30, -3, 0, 4):
        grid = Grid(exponent)
        for _ in range(300):
            values = rng.normal(size=int(rng.integers(1, 16))) * 10.0 ** float(rng.integers(-6, 6))
            values[0] = math.ldexp(float(rng.integers(-1000, 1000)) + 0.5, exponent)  # an exact half
            padded = np.concatenate([values, np.zeros(40)])
            try:
                short = grid.to_units(values)
            except ValueError:
                with pytest.raises(ValueError, match="too large"):
                    grid.to_units(padded)
                continue
            assert np.array_equal(short, grid.to_units(padded)[: values.size])
        for bad in (math.nan, math.inf, math.ldexp(1.0, 52 + exponent)):
            for array in (np.array([bad]), np.concatenate([[bad], np.zeros(40)])):
                with pytest.raises(ValueError, match="too large"):
                    grid.to_units(array)


# ----- the sources ------------------------------------------------------------------------------------
def test_seeded_streams_reproduce_and_differ() -> None:
    draws = [Noise.seeded(7).discrete_laplace(Fraction(3), 50).tolist() for _ in range(2)]
    assert draws[0] == draws[1]
    assert Noise.seeded(8).discrete_laplace(Fraction(3), 50).tolist() != draws[0]
    gauss = [Noise.seeded(9).discrete_gaussian(Fraction(25, 4), 50).tolist() for _ in range(2)]
    assert gauss[0] == gauss[1]
    with pytest.raises(ValueError, match="seed"):
        Noise.seeded(-1)


def test_system_source_draws_from_the_os() -> None:
    noise = Noise.system()
    laplace = noise.discrete_laplace(Fraction(2), 1000)
    gauss = noise.discrete_gaussian(Fraction(9), 1000)
    assert laplace.dtype == np.int64
    assert gauss.dtype == np.int64
    assert len(set(laplace.tolist())) > 5
    assert abs(float(np.mean(gauss))) < 1.0  # sd 3/√1000 ≈ 0.095: a 10-sd band
    assert 0 <= int(noise.uniform_below(10, 1)[0]) < 10
    other = Noise.system().discrete_laplace(Fraction(2), 1000)
    assert other.tolist() != laplace.tolist()
