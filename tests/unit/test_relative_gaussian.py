"""The Relative Gaussian Mechanism: bounds, the derived exact curve, ridge relative sensitivity, sampler.

Everything the module claims is checked against oracles written here, independently of the module:

* ``renyi_matrix``: the Rényi divergence of two multivariate Gaussians with full covariance matrices
  (D_α = (α/2)ΔᵀΣ_α⁻¹Δ − log(det Σ_α / (det Σ₁^{1−α} det Σ₂^α))/(2(α−1)), Σ_α = αΣ₂ + (1−α)Σ₁ ≻ 0, else ∞),
  itself checked against 1-D ``scipy.integrate.quad`` of ∫p^α q^{1−α} and a table of Hendrikx et al. 2024,
  Lemma 2;
* ``renyi_decimal``: the same closed form in 60-digit decimal arithmetic, used to verify the final
  candidates of every adversarial search without floating-point doubt;
* ``renyi_stable``: a cancellation-free float form used inside the searches;
* ``exact_decimal`` / ``theorem1_decimal``: the formulas for ε_ex
  (docs/privacy/gradient_descent.md#lemma-exact) and ε_T1 (Hendrikx et al. 2024, Theorem 1) in 60-digit
  decimals.

Numbers are test vectors computed independently from those formulas.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from decimal import Decimal, localcontext

import numpy as np
import pytest
from scipy import integrate, optimize, stats

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve
from mechanisms.learners.relative_gaussian import (
    Bound,
    RelativeSensitivity,
    alpha_lo,
    alpha_max,
    clip_rows,
    exact_epsilon,
    grid_noise_units,
    grid_rgm_bound,
    rgm_grid,
    rgm_rdp_curve,
    rgm_release_grid,
    ridge_gradient,
    ridge_relative_sensitivity,
    sigma2_lemma1_threshold,
    sigma2_required,
    theorem1_epsilon,
)
from mechanisms.noise import Noise
from tests.unit.conftest import pair_quantities, random_batch, sup_ratio_over_theta

PREC = 60


# ----- independent oracles ----------------------------------------------------------------------------------
def renyi_matrix(alpha: float, mu1: np.ndarray, mu2: np.ndarray, cov1: np.ndarray, cov2: np.ndarray) -> float:
    """D_α(N(μ₁, Σ₁) ‖ N(μ₂, Σ₂)) for full covariance matrices (Gil, Alajaji, Linder 2013, Table 2)."""
    cov_a = alpha * cov2 + (1.0 - alpha) * cov1
    if np.any(np.linalg.eigvalsh(cov_a) <= 0.0):
        return math.inf
    delta = np.asarray(mu1, dtype=float) - np.asarray(mu2, dtype=float)
    quadratic = float(delta @ np.linalg.solve(cov_a, delta))
    _, logdet_a = np.linalg.slogdet(cov_a)
    _, logdet_1 = np.linalg.slogdet(cov1)
    _, logdet_2 = np.linalg.slogdet(cov2)
    log_ratio = logdet_a - (1.0 - alpha) * logdet_1 - alpha * logdet_2
    return float(alpha / 2.0 * quadratic - log_ratio / (2.0 * (alpha - 1.0)))


def renyi_quad(alpha: float, m1: float, m2: float, v1: float, v2: float) -> float:
    """1-D D_α by quadrature of ∫ p^α q^{1−α} (integrand shifted by its peak to avoid underflow)."""
    precision = alpha / v1 + (1.0 - alpha) / v2
    if precision <= 0.0:
        return math.inf
    centre = (alpha * m1 / v1 + (1.0 - alpha) * m2 / v2) / precision
    width = 1.0 / math.sqrt(precision)

    def log_integrand(x: float) -> float:
        return float(
            alpha * stats.norm.logpdf(x, m1, math.sqrt(v1))
            + (1.0 - alpha) * stats.norm.logpdf(x, m2, math.sqrt(v2))
        )

    peak = log_integrand(centre)
    value, _ = integrate.quad(
        lambda x: math.exp(log_integrand(x) - peak),
        centre - 60 * width,
        centre + 60 * width,
        points=[centre],
        epsabs=0.0,
        epsrel=1e-13,
        limit=400,
    )
    return (math.log(value) + peak) / (alpha - 1.0)


def renyi_decimal(
    alpha: float,
    p: float | Decimal,
    q: float | Decimal,
    delta: float | Decimal,
    gamma: float,
    sigma2: float,
    d: int,
) -> Decimal:
    """Lemma 2 for the RGM pair (‖R(x)‖ = p, ‖R(y)‖ = q, ‖R(x) − R(y)‖ = Δ), exactly from the float inputs."""
    with localcontext() as ctx:
        ctx.prec = PREC
        a, pp, qq, dd, g, s2 = (Decimal(v) for v in (alpha, p, q, delta, gamma, sigma2))
        v1 = g * pp * pp + s2
        v2 = g * qq * qq + s2
        s = a * v2 + (1 - a) * v1
        if s <= 0:
            return Decimal("Infinity")
        log_term = ((1 - a) / 2 * v1.ln() + a / 2 * v2.ln() - s.ln() / 2) * d / (a - 1)
        return +(a * dd * dd / (2 * s) + log_term)


def renyi_stable(
    alpha: float, p: np.ndarray, q: np.ndarray, delta: np.ndarray, gamma: float, sigma2: float, d: int
) -> np.ndarray:
    """Lemma 2 for RGM pairs in float without cancellation between huge logs: u = v₂/v₁ − 1."""
    v1 = gamma * p * p + sigma2
    u = gamma * (q - p) * (q + p) / v1
    one_plus_au = 1.0 + alpha * u
    with np.errstate(invalid="ignore", divide="ignore"):
        log_term = (alpha / 2 * np.log1p(u) - 0.5 * np.log1p(alpha * u)) * d / (alpha - 1.0)
        value = alpha * delta * delta / (2.0 * v1 * one_plus_au) + log_term
    result: np.ndarray = np.where(one_plus_au > 0.0, value, np.inf)
    return result


def _ex_t1_decimal(alpha: float, eta: float, gamma: float, d: int) -> tuple[Decimal, Decimal]:
    with localcontext() as ctx:
        ctx.prec = PREC
        a, e, g = Decimal(alpha), Decimal(eta), Decimal(gamma)
        w = e * (2 + e)
        rho = 1 - (a - 1) * w
        if rho <= 0:
            return Decimal("Infinity"), Decimal("Infinity")
        mean = a * e * e / (2 * g * rho)
        t1 = mean + a * d * e * e * (2 + e) ** 2 * (1 + e) ** 2 / (2 * rho)
        if a == 1:
            log_term = Decimal(d) / 2 * (w - (1 + w).ln())
        else:
            log_term = Decimal(d) / (a - 1) * (-a * (1 + e).ln() - (1 - a * w / (1 + w)).ln() / 2)
        return +(mean + log_term), +t1


def exact_decimal(alpha: float, eta: float, gamma: float, d: int) -> Decimal:
    """Note §2.6 as printed: αη²/(2γρ_α) + (d/(α−1))[−α log(1+η) − ½ log(1 − αη(2+η)/(1+η)²)]."""
    return _ex_t1_decimal(alpha, eta, gamma, d)[0]


def theorem1_decimal(alpha: float, eta: float, gamma: float, d: int) -> Decimal:
    """Theorem 1, eq. (5), as printed."""
    return _ex_t1_decimal(alpha, eta, gamma, d)[1]


def g_decimal(alpha: float, u: Decimal) -> Decimal:
    """g(u) = (α/2) log(1+u) − ½ log(1+αu) (paper eq. 39)."""
    with localcontext() as ctx:
        ctx.prec = PREC
        a = Decimal(alpha)
        return +(a / 2 * (1 + u).ln() - (1 + a * u).ln() / 2)


# ----- the oracles themselves -------------------------------------------------------------------------------
LEMMA2_TABLE = [  # Hendrikx et al. 2024, Lemma 2: α, ‖Δμ‖, σ₁², σ₂², D_α
    (2.0, 1.0, 1.0, 1.0, 1.0),
    (2.0, 0.5, 1.2, 1.0, 0.3329109973),
    (3.0, 1.0, 0.8, 1.0, 1.098882288),
    (1.5, 1.0, 2.0, 1.5, 0.6384805206),
    (10.0, 0.3, 1.0, 1.05, 0.3045798074),
]


@pytest.mark.parametrize(("alpha", "shift", "v1", "v2", "expected"), LEMMA2_TABLE)
def test_oracles_reproduce_lemma2_table(
    alpha: float, shift: float, v1: float, v2: float, expected: float
) -> None:
    one = np.eye(1)
    matrix = renyi_matrix(alpha, np.array([shift]), np.zeros(1), v1 * one, v2 * one)
    quad = renyi_quad(alpha, shift, 0.0, v1, v2)
    assert matrix == pytest.approx(expected, rel=2e-9)
    assert quad == pytest.approx(matrix, rel=1e-12, abs=1e-12)
    assert float(renyi_decimal(alpha, shift, 0.0, shift, 1.0, 0.0, 1)) != 0  # smoke: decimal path runs


@pytest.mark.slow
def test_oracles_agree_on_random_gaussians() -> None:
    """Matrix form = Σ over coordinates of 1-D quadrature (product measures) = stable form = decimal form."""
    rng = np.random.default_rng(11)
    for _ in range(40):
        d = int(rng.integers(1, 4))
        alpha = float(rng.choice([1.1, 1.5, 2.0, 3.0, 7.0]))
        v1 = float(rng.uniform(0.3, 3.0))
        v2 = v1 * float(rng.uniform(max(0.4, 1.0 - 1.0 / alpha + 0.05), 2.0))
        mu1 = rng.normal(size=d)
        mu2 = rng.normal(size=d)
        matrix = renyi_matrix(alpha, mu1, mu2, v1 * np.eye(d), v2 * np.eye(d))
        # Each 1-D quadrature carries the whole log-variance term once, so compare per coordinate.
        quads = sum(renyi_quad(alpha, float(a), float(b), v1, v2) for a, b in zip(mu1, mu2, strict=True))
        assert quads == pytest.approx(matrix, rel=1e-11, abs=1e-12)
        # The RGM parametrisation: v = γp² + σ² with γ = 1, σ² chosen to match, Δ = ‖μ₁ − μ₂‖.
        p = math.sqrt(v1 / 2)
        q = math.sqrt(v2 - v1 / 2)
        shift = float(np.linalg.norm(mu1 - mu2))
        stable = float(renyi_stable(alpha, np.array(p), np.array(q), np.array(shift), 1.0, v1 / 2, d))
        exact = float(renyi_decimal(alpha, p, q, shift, 1.0, v1 / 2, d))
        assert stable == pytest.approx(matrix, rel=1e-10)
        assert exact == pytest.approx(matrix, rel=1e-10)


def test_oracles_infinite_when_s_not_positive() -> None:
    # s = ασ₂² + (1 − α)σ₁² ≤ 0: the integral diverges.
    assert renyi_matrix(3.0, np.zeros(2), np.ones(2), 1.0 * np.eye(2), 0.6 * np.eye(2)) == math.inf
    assert renyi_quad(3.0, 0.0, 1.0, 1.0, 0.6) == math.inf
    assert renyi_decimal(3.0, 1.0, math.sqrt(0.6), 0.1, 1.0, 0.0, 2) == Decimal("Infinity")


# ----- Theorem 1 and the exact curve: test vectors ---------------------------------------------------------
VECTORS = [  # α, η, γ, d, α_max, ε_T1, ε_ex
    (2.0, 0.01, 1e-3, 10, 50.75124378, 0.1062570732, 0.1040716879),
    (2.0, 0.1, 1e-2, 1, 5.761904762, 1.333368354, 1.288373772),
    (1.5, 0.1, 1e-2, 5, 5.761904762, 1.061568436, 0.9160957313),
    (10.0, 1e-3, 1e-4, 22, 500.7501249, 0.05136637854, 0.0511395665),
    (4.0, 0.05, 1e-2, 2, 10.75609756, 0.7889278881, 0.7469236793),
    (5.5, 0.1, 1e-2, 5, 5.761904762, 63.34025, 51.13479471),
]


@pytest.mark.parametrize(("alpha", "eta", "gamma", "d", "a_max", "t1", "ex"), VECTORS)
def test_note_vectors(
    alpha: float, eta: float, gamma: float, d: int, a_max: float, t1: float, ex: float
) -> None:
    assert alpha_max(eta) == pytest.approx(a_max, rel=1e-9)
    assert theorem1_epsilon(alpha, eta, gamma, d) == pytest.approx(t1, rel=1e-9)
    assert exact_epsilon(alpha, eta, gamma, d) == pytest.approx(ex, rel=1e-9)
    # and they are upper bounds on the printed formulas evaluated in 60 digits
    assert Decimal(theorem1_epsilon(alpha, eta, gamma, d)) >= theorem1_decimal(alpha, eta, gamma, d)
    assert Decimal(exact_epsilon(alpha, eta, gamma, d)) >= exact_decimal(alpha, eta, gamma, d)


def test_kl_limit_and_other_vectors() -> None:
    assert theorem1_epsilon(1.0, 0.01, 1e-3, 10) == pytest.approx(0.052060653005, rel=1e-10)
    assert exact_epsilon(1.0, 0.01, 1e-3, 10) == pytest.approx(0.050996691468, rel=1e-10)
    # KL is the α → 1 limit of both.
    for fn in (theorem1_epsilon, exact_epsilon):
        assert fn(1.0 + 1e-9, 0.01, 1e-3, 10) == pytest.approx(fn(1.0, 0.01, 1e-3, 10), rel=1e-7)
    # eq. 6 consistency: γ = αη²/(2ε⋆) with ε⋆ = 0.1, α = 2, η = 0.01 gives γ = 1e-3 and ε_T1 = 0.1062570732.
    assert theorem1_epsilon(2.0, 0.01, 2 * 0.01**2 / (2 * 0.1), 10) == pytest.approx(0.1062570732, rel=1e-9)
    assert theorem1_epsilon(2.0, 0.01, 2 * 0.01**2 / (2 * 1.0), 22) == pytest.approx(1.029765153, rel=1e-9)
    assert theorem1_epsilon(2.0, 1e-3, 2 * 1e-3**2 / (2 * 0.1), 22) == pytest.approx(0.1002889425, rel=1e-9)
    # d = 22, η = 1e-3, γ = 1e-5, σ² = 10 (R = 1): (α, ε_T1, ε_ex) and the GM value α/20.
    for alpha, t1, ex in [(2.0, 0.10028894, 0.10024455), (10.0, 0.50961905, 0.50939224)]:
        curve_t1 = rgm_rdp_curve([alpha], eta=1e-3, gamma=1e-5, sigma=math.sqrt(10), r_rel=1.0, d=22)
        curve_ex = rgm_rdp_curve(
            [alpha], eta=1e-3, gamma=1e-5, sigma=math.sqrt(10), r_rel=1.0, d=22, bound="exact"
        )
        assert curve_t1.values[0] == pytest.approx(t1, rel=1e-7)
        assert curve_ex.values[0] == pytest.approx(ex, rel=1e-7)
        assert curve_ex.values[0] > RdpCurve.gaussian(1.0, math.sqrt(10), [alpha]).values[0]


def test_numerics_are_upper_bounds_and_accurate() -> None:
    """Random sweep incl. tiny η, α − 1 down to 1e-12 and orders next to the ceiling: never below the
    60-digit value of the printed formulas, and within 1e-11 relative unless ρ_α < 1e-3."""
    rng = np.random.default_rng(5)
    for _ in range(600):
        eta = float(10 ** rng.uniform(-8, 0.6))
        gamma = float(10 ** rng.uniform(-8, 2))
        d = int(rng.integers(1, 1000))
        span = alpha_max(eta) - 1.0
        alpha = float(
            rng.choice(
                [1.0, 1.0 + 10 ** rng.uniform(-12, 0) * span, 1.0 + span * (1 - 10 ** rng.uniform(-14, -1))]
            )
        )
        rho = 1.0 - (alpha - 1.0) * eta * (2.0 + eta)
        for ours, theirs in [
            (exact_epsilon(alpha, eta, gamma, d), exact_decimal(alpha, eta, gamma, d)),
            (theorem1_epsilon(alpha, eta, gamma, d), theorem1_decimal(alpha, eta, gamma, d)),
        ]:
            if ours == math.inf:
                assert rho < 1e-12
                continue
            assert Decimal(ours) >= theirs
            if rho > 1e-3:
                assert float((Decimal(ours) - theirs) / theirs) < 1e-11
    # A cancellation example: α = 1 + 1e-6, u_lo ≈ −2e-6.
    eta = 1e-6
    ours = exact_epsilon(1.0 + 1e-6, eta, 1.0, 1000)
    theirs = exact_decimal(1.0 + 1e-6, eta, 1.0, 1000)
    assert Decimal(ours) >= theirs
    assert float((Decimal(ours) - theirs) / theirs) < 1e-13


# ----- α domain, monotonicity, ordering of the bounds -------------------------------------------------------
def test_ceiling() -> None:
    assert alpha_max(0.1) == pytest.approx(5.761904762, rel=1e-9)
    assert alpha_max(0.01) == pytest.approx(50.75124378, rel=1e-9)
    assert alpha_max(1e-3) == pytest.approx(500.7501249, rel=1e-9)
    assert alpha_max(0.0) == math.inf
    for fn in (theorem1_epsilon, exact_epsilon):
        assert fn(5.8119, 0.1, 1e-2, 5) == math.inf
        assert fn(alpha_max(0.1), 0.1, 1e-2, 5) == math.inf
        assert fn(1e6, 0.1, 1e-2, 5) == math.inf
        assert math.isfinite(fn(math.nextafter(alpha_max(0.1), 0) - 1e-9, 0.1, 1e-2, 5))
    for bound in ("theorem1", "exact"):
        curve = rgm_rdp_curve(DEFAULT_ORDERS, eta=0.1, gamma=1e-2, sigma=1.0, r_rel=1.0, d=5, bound=bound)
        assert curve.pure == math.inf
        for order, value in zip(curve.orders, curve.values, strict=True):
            assert math.isfinite(value) == (order < alpha_max(0.1)), (order, value)


def test_ceiling_is_real_divergence_is_infinite_beyond_it() -> None:
    """Just above α_max the admissible pair R(y) = R(x)/(1+η) has s < 0 (D = ∞); just below it is finite."""
    eta, gamma = 0.1, 1e-2
    p = 1e4
    q = p / (1 + eta)
    top = alpha_max(eta)
    assert renyi_decimal(top * (1 + 1e-6), p, q, p - q, gamma, 0.0, 1) == Decimal("Infinity")
    assert renyi_decimal(top * (1 - 1e-6), p, q, p - q, gamma, 0.0, 1) < Decimal("Infinity")


@pytest.mark.parametrize("eta", [1e-4, 0.01, 0.1, 0.5, 3.0])
@pytest.mark.parametrize("d", [1, 22])
def test_monotone_and_convex_in_alpha(eta: float, d: int) -> None:
    top = alpha_max(eta)
    alphas = 1.0 + (top - 1.0) * np.linspace(0.0, 0.98, 300)[1:]
    for fn in (theorem1_epsilon, exact_epsilon):
        values = np.array([fn(float(a), eta, 1e-2, d) for a in alphas])
        assert np.all(np.diff(values) >= 0.0)
        scaled = (alphas - 1.0) * values  # (α − 1)·ε is convex (log-MGF; a sup of convex functions)
        second = scaled[2:] - 2 * scaled[1:-1] + scaled[:-2]
        assert np.all(second >= -1e-12 * np.abs(scaled[1:-1]))
    grid = tuple(float(a) for a in np.concatenate([alphas[::7], [top * 1.001, top * 2]]))
    for bound in ("theorem1", "exact"):
        curve = rgm_rdp_curve(grid, eta=eta, gamma=1e-2, sigma=1.0, r_rel=0.0, d=d, bound=bound)
        values = np.array(curve.values)
        assert np.all(values[:-1] <= values[1:])
        assert np.all(np.isinf(values[-2:]))


def test_exact_is_below_theorem1_and_above_its_floor() -> None:
    cases = 0
    for eta in np.geomspace(1e-4, 3.0, 12):
        top = alpha_max(float(eta))
        for frac in (0.0, 1e-6, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999999):
            alpha = 1.0 + frac * (top - 1.0)
            for gamma in (1e-4, 1e-2, 1.0):
                for d in (1, 10, 1000):
                    ex = exact_epsilon(alpha, float(eta), gamma, d)
                    t1 = theorem1_epsilon(alpha, float(eta), gamma, d)
                    assert 0.0 < ex <= t1
                    assert t1 >= 2 * alpha * d * eta**2  # the floor ε ≥ 2αdη² (any γ)
                    cases += 1
    assert cases == 12 * 8 * 3 * 3


def test_theorem1_decreasing_in_gamma_to_its_floor_and_affine_in_d() -> None:
    alpha, eta, d = 2.0, 0.01, 10
    values = [theorem1_epsilon(alpha, eta, g, d) for g in np.geomspace(1e-6, 1e6, 50)]
    assert all(b <= a for a, b in itertools.pairwise(values))
    rho = 1 - eta * (alpha - 1) * (2 + eta)
    floor = alpha * d * eta**2 * (2 + eta) ** 2 * (1 + eta) ** 2 / (2 * rho)
    assert values[-1] >= floor
    assert values[-1] == pytest.approx(floor, rel=1e-5)
    e1, e2, e3 = (theorem1_epsilon(alpha, eta, 1e-3, k) for k in (1, 2, 3))
    assert e3 - e2 == pytest.approx(e2 - e1, rel=1e-12)


def test_log_term_is_maximal_at_the_small_ratio_end() -> None:
    """The step of the exact curve (docs/privacy/gradient_descent.md#lemma-exact):
    g(u_lo) ≥ g(u_hi), u_lo = −η(2+η)/(1+η)², u_hi = η(2+η), for α ∈ (1, α_max)."""
    for eta in (1e-5, 1e-3, 0.05, 0.3, 1.0, 3.0):
        top = alpha_max(eta)
        with localcontext() as ctx:
            ctx.prec = PREC
            w = Decimal(eta) * (2 + Decimal(eta))
            u_lo, u_hi = -w / (1 + w), w
        for frac in (1e-6, 1e-3, 0.1, 0.5, 0.9, 0.999):
            alpha = 1.0 + frac * (top - 1.0)
            assert g_decimal(alpha, u_lo) >= g_decimal(alpha, u_hi), (eta, alpha)


# ----- reduction to the Gaussian mechanism ------------------------------------------------------------------
def test_reduction_to_gaussian_mechanism() -> None:
    """σ² = γR²/η², γ = η²σ²/R², η → 0: both curves tend to RdpCurve.gaussian(R, σ) from above."""
    sigma, r_rel, d = math.sqrt(10.0), 1.0, 10
    table = {1e-2: 0.10625707, 1e-3: 0.10024070, 1e-4: 0.10002041, 1e-6: 0.10000020}  # α = 2
    for eta, expected in table.items():
        gamma = eta**2 * sigma**2 / r_rel**2
        curve = rgm_rdp_curve([2.0], eta=eta, gamma=gamma, sigma=sigma, r_rel=r_rel, d=d)
        assert curve.values[0] == pytest.approx(expected, rel=2e-7)
    orders = tuple(a for a in DEFAULT_ORDERS if a <= 64)
    gm = np.array(RdpCurve.gaussian(r_rel, sigma, orders).values)
    previous = np.full(len(orders), np.inf)
    for eta in (1e-3, 1e-4, 1e-5, 1e-6, 1e-7):
        gamma = eta**2 * sigma**2 / r_rel**2
        for bound in ("theorem1", "exact"):
            values = np.array(
                rgm_rdp_curve(orders, eta=eta, gamma=gamma, sigma=sigma, r_rel=r_rel, d=d, bound=bound).values
            )
            assert np.all(values >= gm)
            if bound == "theorem1":
                assert np.all(values <= previous)
                previous = values
        assert np.max(values / gm - 1.0) < 200 * eta  # the gap is O(η) (α ≤ 64, d = 10)
    np.testing.assert_allclose(previous, gm, rtol=1e-4)


def test_eta_zero_is_the_gaussian_mechanism() -> None:
    curve = rgm_rdp_curve(DEFAULT_ORDERS, eta=0.0, gamma=0.0, sigma=2.0, r_rel=0.7, d=3)
    assert curve == RdpCurve.gaussian(0.7, 2.0, DEFAULT_ORDERS)
    with pytest.raises(ValueError, match="gamma must be 0"):
        rgm_rdp_curve(DEFAULT_ORDERS, eta=0.0, gamma=1e-3, sigma=2.0, r_rel=0.7, d=3)


# ----- the exact curve against the true divergence ----------------------------------------------------------
def test_worst_case_path_attains_the_exact_curve() -> None:
    """R(x) = p·e, R(y) = R(x)/(1+η), p → ∞ approaches ε_ex from below (p = 1e5 gives 51.13 for the
    α = 5.5 row)."""
    alpha, eta, gamma, d = 5.5, 0.1, 1e-2, 5
    sigma2 = gamma / eta**2  # R = 1
    p = 1e5
    q = p / (1 + eta)
    value = renyi_decimal(alpha, p, q, p - q, gamma, sigma2, d)
    assert float(value) == pytest.approx(51.13, abs=0.01)
    for alpha, eta, gamma, d, *_ in VECTORS:
        ours = Decimal(exact_epsilon(alpha, eta, gamma, d))
        ex = exact_decimal(alpha, eta, gamma, d)
        sigma2 = gamma / eta**2
        gaps = []
        for p in (1e2, 1e4, 1e6, 1e9, 1e12):
            value = renyi_decimal(alpha, *_admissible_decimal(p, p / (1 + eta), eta, 0.0), gamma, sigma2, d)
            assert value <= ex <= ours
            gaps.append(float((ex - value) / ex))
        assert gaps == sorted(gaps, reverse=True)
        assert gaps[-1] < 1e-12


Config = tuple[float, float, float, int, float, float]  # α, η, γ, d, R_rel, σ²


def _random_configs(rng: np.random.Generator, count: int) -> list[Config]:
    configs: list[Config] = []
    for i in range(count):
        eta = float(10 ** rng.uniform(-3, 0.3))
        gamma = float(10 ** rng.uniform(-4, 0))
        d = int(rng.choice([1, 2, 5, 22, 100]))
        alpha = 1.0 + float(rng.uniform(0.02, 0.97)) * (alpha_max(eta) - 1.0)
        r_rel = float(rng.choice([0.0, 0.1, 1.0, 10.0]))
        # alternate: the smallest σ² Theorem 1 allows at α (rounded up), and the "all orders" default γR²/η²
        required = sigma2_required(alpha, eta, gamma, r_rel)
        sigma2 = math.nextafter(required * (1 + 1e-12), math.inf) if i % 2 else gamma * r_rel**2 / eta**2
        configs.append((alpha, eta, gamma, d, r_rel, sigma2))
    return configs


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-float(np.clip(x, -50.0, 50.0))))


def _pair(z: np.ndarray, eta: float, r_rel: float) -> tuple[float, float, float]:
    """An admissible (p, q, Δ) from unconstrained z = (log p, position of q, position of Δ).

    Def. 2 (min form) allows q ∈ [q_lo, q_hi] with q_hi = p + √(η²p² + R²) and q_lo the root of
    p − q = √(η²q² + R²), i.e. (p² − R²)/(p + √(η²(p² − R²) + R²)) (0 if p ≤ R); then
    Δ ∈ [|p − q|, min(p + q, √(η² min(p, q)² + R²))].
    """
    p = math.exp(float(np.clip(z[0], -10.0, 40.0)))
    q_hi = p + math.sqrt(eta**2 * p**2 + r_rel**2)
    q_lo = 0.0 if p <= r_rel else (p * p - r_rel**2) / (p + math.sqrt(eta**2 * (p * p - r_rel**2) + r_rel**2))
    q = q_lo + _sigmoid(z[1]) * (q_hi - q_lo)
    low = abs(p - q)
    high = max(low, min(p + q, math.sqrt(eta**2 * min(p, q) ** 2 + r_rel**2)))
    return p, q, low + _sigmoid(z[2]) * (high - low)


def _admissible_decimal(p: float, q: float, eta: float, r_rel: float) -> tuple[Decimal, Decimal, Decimal]:
    """The nearest exactly admissible pair (60 digits): q moved into [q_lo, q_hi] if rounding put it outside,
    and Δ at its largest admissible value (the mean term increases with Δ)."""
    with localcontext() as ctx:
        ctx.prec = PREC
        pp, qq, e, r = Decimal(p), Decimal(q), Decimal(eta), Decimal(r_rel)
        shrink = 1 - Decimal(10) ** (10 - PREC)  # rounds every square root down

        def root(x: Decimal) -> Decimal:
            return x.sqrt() * shrink

        if qq < pp:
            qq = max(qq, pp / (1 + e) / shrink) if pp - qq > root(e * e * qq * qq + r * r) else qq
        else:
            qq = min(qq, pp + root(e * e * pp * pp + r * r))
        delta = min(pp + qq, root(e * e * min(pp, qq) ** 2 + r * r))
        assert abs(pp - qq) <= delta
        assert delta * delta <= e * e * min(pp, qq) ** 2 + r * r
        return pp, qq, delta


def _adversarial_sup(
    config: Config, rng: np.random.Generator, starts: int = 6
) -> tuple[float, tuple[float, ...]]:
    """Maximise Lemma 2 over admissible (‖R(x)‖, ‖R(y)‖, ‖R(x) − R(y)‖): Nelder–Mead from random starts."""
    alpha, eta, gamma, d, r_rel, sigma2 = config

    def loss(z: np.ndarray) -> float:
        p, q, delta = _pair(z, eta, r_rel)
        value = float(renyi_stable(alpha, np.array(p), np.array(q), np.array(delta), gamma, sigma2, d))
        return -value if math.isfinite(value) else -1e300  # an ∞ would itself be a violation: keep it

    best, best_pair = -math.inf, (0.0, 0.0, 0.0)
    for _ in range(starts):
        z = rng.uniform([-5.0, -4.0, -4.0], [40.0, 4.0, 4.0])
        for _ in range(2):  # one restart from the first optimum
            result = optimize.minimize(
                loss, z, method="Nelder-Mead", options={"xatol": 1e-10, "fatol": 1e-15}
            )
            z = result.x
        if -result.fun > best:
            best, best_pair = -float(result.fun), _pair(result.x, eta, r_rel)
    return best, best_pair


@pytest.mark.slow
def test_adversarial_search_never_exceeds_the_exact_curve() -> None:
    """Optimised neighbouring outputs: the verified (60-digit) divergence of the best pair is ≤ ε_ex ≤ ε_T1,
    and the search gets within 1e-3 of ε_ex: the curve is a tight upper bound, not a vacuous one."""
    rng = np.random.default_rng(2024)
    ratios = []
    for config in _random_configs(rng, 24):
        alpha, eta, gamma, d, r_rel, sigma2 = config
        assert sigma2 >= sigma2_required(alpha, eta, gamma, r_rel)
        ex = exact_epsilon(alpha, eta, gamma, d)
        curve = rgm_rdp_curve(
            [alpha], eta=eta, gamma=gamma, sigma=math.sqrt(sigma2), r_rel=r_rel, d=d, bound="exact"
        )
        assert curve.values[0] >= ex  # α ≥ α_lo here (σ² meets the condition at α, up to rounding of √)
        best, (p, q, _) = _adversarial_sup(config, rng)
        verified = renyi_decimal(alpha, *_admissible_decimal(p, q, eta, r_rel), gamma, sigma2, d)
        assert verified <= Decimal(ex), config
        assert ex <= theorem1_epsilon(alpha, eta, gamma, d)
        assert float(verified) == pytest.approx(best, rel=1e-8)
        ratios.append(best / ex)
    assert min(ratios) > 0.999, ratios


def test_random_admissible_pairs_stay_below_the_exact_curve() -> None:
    """Vectorised: 20,000 random admissible (p, q, Δ) per configuration, across all scales."""
    rng = np.random.default_rng(7)
    for config in _random_configs(rng, 30):
        alpha, eta, gamma, d, r_rel, sigma2 = config
        n = 20_000
        p = np.exp(rng.uniform(-8, 30, n))
        ratio = np.exp(rng.uniform(-1.2, 1.2, n) * math.log1p(eta))  # q/p, incl. infeasible ones
        q = p * ratio
        low = np.abs(p - q)
        high = np.minimum(p + q, np.sqrt(eta**2 * np.minimum(p, q) ** 2 + r_rel**2))
        keep = low <= high
        delta = low + rng.uniform(0, 1, n) * (high - low)
        values = renyi_stable(alpha, p[keep], q[keep], delta[keep], gamma, sigma2, d)
        assert keep.sum() > n // 10
        assert np.all(np.isfinite(values))
        assert np.max(values) <= exact_epsilon(alpha, eta, gamma, d) * (1 + 1e-9)


def test_sigma_condition_is_needed_and_the_curve_handles_it() -> None:
    """σ² between Lemma 1's threshold and Theorem 1's requirement at α: the worst case exceeds ε_ex(α) (so the
    raw formula must not be charged), but stays below the curve's ε(α_lo) (monotonicity in α)."""
    rng = np.random.default_rng(99)
    alpha, eta, gamma, d, r_rel = 2.0, 0.01, 1e-3, 10, 1.0
    required = sigma2_required(alpha, eta, gamma, r_rel)  # 9.9
    lemma1 = sigma2_lemma1_threshold(eta, gamma, r_rel)  # 5.025
    assert required == pytest.approx(9.9)
    assert lemma1 == pytest.approx(5.0248756, rel=1e-7)
    for sigma2 in (0.5 * (required + lemma1), 1.0001 * lemma1):
        config = (alpha, eta, gamma, d, r_rel, sigma2)
        _, (p, q, _) = _adversarial_sup(config, rng)
        verified = renyi_decimal(alpha, *_admissible_decimal(p, q, eta, r_rel), gamma, sigma2, d)
        assert float(verified) > 1.2 * exact_epsilon(alpha, eta, gamma, d)
        assert float(verified) > theorem1_epsilon(alpha, eta, gamma, d)
        for bound in ("theorem1", "exact"):
            charged = rgm_rdp_curve(
                [alpha], eta=eta, gamma=gamma, sigma=math.sqrt(sigma2), r_rel=r_rel, d=d, bound=bound
            ).values[0]
            assert verified <= Decimal(charged)


def test_lemma1_variance_ratio() -> None:
    rng = np.random.default_rng(3)
    for eta in (1e-3, 0.05, 0.5, 2.0):
        gamma, r_rel = 0.3, 2.0
        sigma2 = sigma2_lemma1_threshold(eta, gamma, r_rel) * (1 + 1e-12)
        n = 50_000
        p = np.exp(rng.uniform(-6, 12, n))
        q = p * np.exp(rng.uniform(-1.5, 1.5, n) * math.log1p(eta))
        # any direction: ‖R(x) − R(y)‖ is free in [|p − q|, p + q]; Def. 2 must allow at least |p − q|
        admissible = np.abs(p - q) ** 2 <= eta**2 * np.minimum(p, q) ** 2 + r_rel**2
        # also the Δ = 0 extreme is irrelevant: Lemma 1 only involves the norms
        ratio = (gamma * p**2 + sigma2) / (gamma * q**2 + sigma2)
        assert admissible.sum() > 1000
        assert np.all(ratio[admissible] <= (1 + eta) ** 2 * (1 + 1e-12))
        assert np.all(ratio[admissible] >= (1 + eta) ** -2 * (1 - 1e-12))


# ----- the σ² condition and validation ----------------------------------------------------------------------
def test_sigma_condition_and_alpha_lo() -> None:
    # R = 1, η = 0.01, γ = 1e-3
    assert alpha_lo(0.01, 1e-3, math.sqrt(9.9), 1.0) == pytest.approx(2.0, rel=1e-12)
    assert alpha_lo(0.01, 1e-3, math.sqrt(9.99), 1.0) == pytest.approx(1.1, rel=1e-12)
    assert alpha_lo(0.01, 1e-3, math.sqrt(10.0), 1.0) == 1.0
    assert alpha_lo(0.01, 1e-3, 0.0, 0.0) == 1.0  # R_rel = 0: any σ² ≥ 0 (salary example)
    assert alpha_lo(0.01, 1e-3, math.sqrt(9.9), 1.0) >= 2.0  # rounded up, never down
    assert sigma2_required(2.0, 0.01, 1e-3, 1.0) == pytest.approx(9.9)
    with pytest.raises(ValueError, match="Lemma 1"):
        alpha_lo(0.01, 1e-3, math.sqrt(5.0), 1.0)
    with pytest.raises(ValueError, match="Lemma 1"):
        rgm_rdp_curve(DEFAULT_ORDERS, eta=0.01, gamma=1e-3, sigma=math.sqrt(5.0), r_rel=1.0, d=3)
    # below α_lo the curve is flat at ε(α_lo); from α_lo on it is ε(α)
    orders = (1.25, 1.5, 2.0, 3.0, 8.0)
    pairs: tuple[tuple[Bound, Callable[[float, float, float, int], float]], ...] = (
        ("theorem1", theorem1_epsilon),
        ("exact", exact_epsilon),
    )
    for bound, fn in pairs:
        curve = rgm_rdp_curve(orders, eta=0.01, gamma=1e-3, sigma=math.sqrt(9.9), r_rel=1.0, d=3, bound=bound)
        lowest = alpha_lo(0.01, 1e-3, math.sqrt(9.9), 1.0)
        assert curve.values[0] == curve.values[1] == fn(lowest, 0.01, 1e-3, 3)
        assert curve.values[1] >= fn(2.0, 0.01, 1e-3, 3)
        assert curve.values[3:] == tuple(fn(a, 0.01, 1e-3, 3) for a in orders[3:])
        full = rgm_rdp_curve(orders, eta=0.01, gamma=1e-3, sigma=math.sqrt(10.0), r_rel=1.0, d=3, bound=bound)
        assert full.values == tuple(fn(a, 0.01, 1e-3, 3) for a in orders)


def test_sigma_at_lemma1_threshold_gives_infinite_curve() -> None:
    sigma = math.sqrt(sigma2_lemma1_threshold(0.1, 1e-2, 1.0))
    curve = rgm_rdp_curve(DEFAULT_ORDERS, eta=0.1, gamma=1e-2, sigma=sigma * (1 + 1e-15), r_rel=1.0, d=2)
    assert all(math.isinf(v) or v > 1e6 for v in curve.values)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eta": -0.1}, "eta"),
        ({"eta": math.nan}, "eta"),
        ({"gamma": 0.0}, "gamma must be > 0"),
        ({"gamma": -1.0}, "gamma"),
        ({"sigma": math.inf}, "sigma"),
        ({"r_rel": -1.0}, "r_rel"),
        ({"d": 0}, "dimension"),
        ({"d": 2.5}, "dimension"),
        ({"bound": "tight"}, "bound"),
    ],
)
def test_curve_rejects_bad_parameters(kwargs: dict[str, object], message: str) -> None:
    params: dict[str, object] = {"eta": 0.01, "gamma": 1e-3, "sigma": 10.0, "r_rel": 1.0, "d": 3}
    params.update(kwargs)
    with pytest.raises(ValueError, match=message):
        rgm_rdp_curve(DEFAULT_ORDERS, **params)  # type: ignore[arg-type]


def test_scalar_bounds_reject_bad_parameters() -> None:
    for fn in (theorem1_epsilon, exact_epsilon):
        with pytest.raises(ValueError, match="order"):
            fn(0.5, 0.1, 1.0, 1)
        with pytest.raises(ValueError, match="eta must be > 0"):
            fn(2.0, 0.0, 1.0, 1)
        with pytest.raises(ValueError, match="gamma must be > 0"):
            fn(2.0, 0.1, 0.0, 1)
        with pytest.raises(ValueError, match="dimension"):
            fn(2.0, 0.1, 1.0, True)
    with pytest.raises(ValueError, match="orders"):
        rgm_rdp_curve([2.0, 1.5], eta=0.1, gamma=1.0, sigma=1.0, r_rel=0.0, d=1)


# ----- relative sensitivity of the ridge gradient -----------------------------------------------------------
def test_ridge_gradient_and_decomposition() -> None:
    rng = np.random.default_rng(1)
    features, labels, new_row, new_label = random_batch(rng, 64, 9, 4, 1.5, 2.0)
    reg = 0.3
    theta = rng.normal(size=(64, 4)) * 5
    # gradient against a finite-difference check of f on one dataset
    x, y, th = features[0], labels[0], theta[0]

    def f(t: np.ndarray) -> float:
        return float(np.mean(0.5 * (x @ t - y) ** 2) + reg / 2 * t @ t)

    numeric = optimize.approx_fprime(th, f, 1e-7)
    np.testing.assert_allclose(ridge_gradient(th, x, y, reg), numeric, rtol=1e-5, atol=1e-5)
    # the identity ∇f − ∇f′ = M∇f + c the bound rests on (docs/privacy/gradient_descent.md#lemma-ridge-split)
    neighbour_x = features.copy()
    neighbour_x[:, 0] = new_row
    neighbour_y = labels.copy()
    neighbour_y[:, 0] = new_label
    g = ridge_gradient(theta, features, labels, reg)
    g_new = ridge_gradient(theta, neighbour_x, neighbour_y, reg)
    _, m, c = pair_quantities(features, labels, new_row, new_label, reg)
    np.testing.assert_allclose(g - g_new, np.einsum("bij,bj->bi", m, g) + c, rtol=1e-9, atol=1e-12)


def test_ridge_bound_formula() -> None:
    sens = ridge_relative_sensitivity(1000, 0.1, 2.0, 3.0)
    assert sens.eta == pytest.approx(math.sqrt(6) * 4 / (0.1 * 1000), rel=1e-12)
    theta_bound = 3.0 * min(2.0 / 0.1, 1 / math.sqrt(0.1))
    assert sens.r_rel == pytest.approx(math.sqrt(12) * 2.0 * (2.0 * theta_bound + 3.0) / 1000, rel=1e-12)
    assert ridge_relative_sensitivity(10, 1.0, 0.0, 1.0) == RelativeSensitivity(0.0, 0.0)
    for bad, field in [
        ((0, 1.0, 1.0, 1.0), "n_rows"),
        ((10, 0.0, 1.0, 1.0), "reg"),
        ((10, 1.0, -1.0, 1.0), "feature_bound"),
        ((10, 1.0, 1.0, math.nan), "label_bound"),
    ]:
        with pytest.raises(ValueError, match=field):
            ridge_relative_sensitivity(*bad)


@pytest.mark.parametrize(
    ("n", "d", "reg", "x_max", "y_max"),
    [
        (20, 3, 0.1, 1.0, 1.0),
        (50, 5, 0.01, 2.0, 1.0),
        (10, 2, 1.0, 1.0, 3.0),
        (200, 10, 1e-3, 1.0, 1.0),
        (3, 2, 10.0, 0.5, 4.0),
    ],
)
def test_ridge_relative_sensitivity_on_random_datasets(
    n: int, d: int, reg: float, x_max: float, y_max: float
) -> None:
    """Random clipped datasets and neighbours (vectorised over 2,000 pairs): the inequality at random θ of
    every scale, in both directions, and its exact supremum over θ."""
    rng = np.random.default_rng(n * d)
    sens = ridge_relative_sensitivity(n, reg, x_max, y_max)
    batch = 2000
    features, labels, new_row, new_label = random_batch(rng, batch, n, d, x_max, y_max)
    neighbour_x = features.copy()
    neighbour_x[:, 0] = new_row
    neighbour_y = labels.copy()
    neighbour_y[:, 0] = new_label
    _, m, c = pair_quantities(features, labels, new_row, new_label, reg)
    assert np.max(sup_ratio_over_theta(m, c, sens)) <= 1.0
    for scale in (1e-3, 1.0, 1e3, 1e6):
        theta = rng.normal(size=(batch, d)) * scale
        g = ridge_gradient(theta, features, labels, reg)
        g_new = ridge_gradient(theta, neighbour_x, neighbour_y, reg)
        lhs = np.sum((g - g_new) ** 2, axis=1)
        assert np.all(lhs <= sens.eta**2 * np.sum(g**2, axis=1) + sens.r_rel**2)
        assert np.all(lhs <= sens.eta**2 * np.sum(g_new**2, axis=1) + sens.r_rel**2)


@pytest.mark.slow
@pytest.mark.parametrize(("n", "d", "reg"), [(3, 2, 0.01), (4, 2, 0.1), (6, 3, 1.0), (5, 2, 10.0)])
def test_ridge_relative_sensitivity_adversarial(n: int, d: int, reg: float) -> None:
    """Nelder–Mead over every record, label and the replacement (then clipped), maximising the exact sup over
    θ; plus the structured worst case (other records 0, x₀ ⟂ x₀′ at full norm, labels ±Y)."""
    rng = np.random.default_rng(n + 10 * d)
    x_max, y_max = 1.0, 1.0
    sens = ridge_relative_sensitivity(n, reg, x_max, y_max)

    def unpack(z: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        z = z.reshape(batch, -1)
        features = clip_rows(z[:, : n * d].reshape(batch, n, d), x_max)
        labels = np.clip(z[:, n * d : n * d + n], -y_max, y_max)
        new_row = clip_rows(z[:, n * d + n : n * d + n + d], x_max)
        new_label = np.clip(z[:, -1], -y_max, y_max)
        return features, labels, new_row, new_label

    def ratio(z: np.ndarray, batch: int = 1) -> np.ndarray:
        features, labels, new_row, new_label = unpack(z, batch)
        _, m, c = pair_quantities(features, labels, new_row, new_label, reg)
        return sup_ratio_over_theta(m, c, sens)

    size = n * d + n + d + 1
    starts = rng.normal(size=(400, size)) * 2
    first = ratio(starts.ravel(), 400)
    best = float(np.max(first))
    for z0 in starts[np.argsort(first)[-8:]]:
        result = optimize.minimize(
            lambda z: -float(ratio(z)[0]), z0, method="Nelder-Mead", options={"maxiter": 4000}
        )
        best = max(best, -float(result.fun))
    structured = np.zeros(size)
    structured[0] = x_max  # x₀ = e₁, y₀ = Y; replacement x₀′ = e₂, y₀′ = −Y; other records 0
    structured[n * d] = y_max
    structured[n * d + n + 1] = x_max
    structured[-1] = -y_max
    best = max(best, float(ratio(structured)[0]))
    assert 0.05 < best <= 1.0


# ----- the sampler (deterministic checks; its distribution is tested in tests/statistical) ------------------
def test_release_uses_the_variance_convention_on_the_grid() -> None:
    """The grid release is γ_g·(round(value/γ_g) + Z), Z ~ N_Z(0, t²), t = ⌈√((γ‖v‖² + σ²)/γ_g²)·(1+2^-30)⌉:
    a variance (not a std), every number an exact multiple of γ_g."""
    value = np.array([3.0, -4.0, 12.0])  # ‖value‖² = 169
    gamma, sigma = 0.02, 0.5
    variance = gamma * 169 + 0.25  # 3.63
    grid = rgm_grid(sigma, 3)
    assert grid.granularity <= sigma * 2.0**-24 / math.sqrt(3)
    t = grid_noise_units(value, gamma, sigma, grid)
    assert (t - 1) ** 2 * grid.granularity**2 < variance <= t**2 * grid.granularity**2
    many = rgm_release_grid(value, gamma, sigma, Noise.seeded(42), draws=4000)
    assert many.shape == (4000, 3)
    units = many / grid.granularity
    np.testing.assert_array_equal(units, np.rint(units))  # exact support
    noise = many - value
    assert float(np.var(noise)) == pytest.approx(variance, rel=0.06)
    assert not float(np.var(noise)) == pytest.approx(variance**2, rel=0.3)  # the std = variance confusion
    one = rgm_release_grid(value, gamma, sigma, Noise.seeded(42))
    assert one.shape == (3,)


def test_release_gamma_zero_is_gaussian_and_input_untouched() -> None:
    value = np.array([1.0, 2.0])
    before = value.copy()
    out = rgm_release_grid(value, 0.0, 2.0, Noise.seeded(3), draws=4000)
    assert float(np.var(out - value)) == pytest.approx(4.0, rel=0.06)
    np.testing.assert_array_equal(value, before)
    assert out.dtype == np.float64
    with pytest.raises(ValueError, match="sigma"):
        rgm_release_grid(np.zeros(2), 1.0, 0.0, Noise.seeded(0))  # the grid needs σ > 0


@pytest.mark.slow
@pytest.mark.parametrize("sigma_units", [6.0, 12.0, 30.0])
def test_grid_bound_by_exact_summation(sigma_units: float) -> None:
    """Theorem RGM-GRID checked by exact summation over the integer support (d = 1): random admissible
    neighbours (relative sensitivity in the min form, σ² ≥ γR²/η²), means rounded, integer stds ⌈√v⌉;
    the discrete Rényi divergence never exceeds ``grid_rgm_bound`` at any order (grid effects visible at
    small σ_u); and Lemma THETA's correction is checked against exact sums for equal means."""
    from scipy.special import logsumexp

    def logpmf(z: np.ndarray, mu: float, s: float) -> np.ndarray:
        k = np.arange(math.floor(mu - 40 * s), math.ceil(mu + 40 * s) + 1)
        result: np.ndarray = -((z - mu) ** 2) / (2 * s * s) - logsumexp(-((k - mu) ** 2) / (2 * s * s))
        return result

    def divergence(alpha: float, mu1: float, s1: float, mu2: float, s2: float) -> float:
        lo = math.floor(min(mu1 - 40 * s1, mu2 - 40 * s2))
        hi = math.ceil(max(mu1 + 40 * s1, mu2 + 40 * s2))
        z = np.arange(lo, hi + 1).astype(float)
        return float(logsumexp(alpha * logpmf(z, mu1, s1) + (1 - alpha) * logpmf(z, mu2, s2)) / (alpha - 1))

    rng = np.random.default_rng(int(sigma_units * 10))
    checked = 0
    for _ in range(60):
        eta = float(10 ** rng.uniform(-2, -1))
        gamma = float(10 ** rng.uniform(-2, 0))
        r_rel = sigma_units * eta / math.sqrt(gamma)
        sigma = sigma_units
        ratio = (1 + 1 / sigma) ** 2 * (1 + 1e-12)
        b = float(10 ** rng.uniform(-1, 1.5) * r_rel / eta) * rng.choice([-1.0, 1.0])
        a = b + math.sqrt(eta * eta * b * b + r_rel * r_rel) * rng.uniform(0.5, 1.0) * rng.choice([-1.0, 1.0])
        if (a - b) ** 2 > eta * eta * min(a * a, b * b) + r_rel * r_rel:
            continue
        s_a = math.ceil(math.sqrt(gamma * a * a + sigma * sigma))
        s_b = math.ceil(math.sqrt(gamma * b * b + sigma * sigma))
        for alpha in (1.25, 1.5, 2.0, 4.0):
            bound = grid_rgm_bound(alpha, eta, gamma, 1, units=sigma, ratio=ratio)
            if math.isfinite(bound):
                assert divergence(alpha, round(a), s_a, round(b), s_b) <= bound
                assert divergence(alpha, round(b), s_b, round(a), s_a) <= bound
                checked += 1
    assert checked > 40


@pytest.mark.parametrize(
    ("value", "gamma", "sigma", "draws", "message"),
    [
        (np.zeros((2, 2)), 1.0, 1.0, None, "1-D"),
        (np.zeros(0), 1.0, 1.0, None, "1-D"),
        (np.array([1.0, math.nan]), 1.0, 1.0, None, "finite"),
        (np.ones(2), -1.0, 1.0, None, "gamma"),
        (np.ones(2), 1.0, math.inf, None, "sigma"),
        (np.ones(2), 1.0, 1.0, 0, "draws"),
        (np.ones(2), 1.0, 1.0, 2.5, "draws"),
        (np.array([1e200, 1e200]), 1.0, 1.0, None, "overflows"),
    ],
)
def test_release_rejects_bad_input(
    value: np.ndarray, gamma: float, sigma: float, draws: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        rgm_release_grid(value, gamma, sigma, Noise.seeded(0), draws=draws)  # type: ignore[arg-type]


def test_clip_rows() -> None:
    rows = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    clipped = clip_rows(rows, 1.0)
    np.testing.assert_allclose(clipped, [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]])
    assert np.all(
        np.linalg.norm(clip_rows(np.random.default_rng(0).normal(size=(5, 7, 3)) * 9, 2.0), axis=-1)
        <= 2.0 + 1e-12
    )
