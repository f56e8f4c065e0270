"""The RGM sampler's distribution, and a Monte Carlo privacy audit of one RGM step (Hendrikx et al. 2024).

Distribution: the noise of ``rgm_release_grid`` (release − value), divided by √(γ‖value‖² + σ²) computed from
Def. 3 of the paper, must be N(0, 1) per coordinate: Kolmogorov–Smirnov at a false-alarm rate of 1e-6 with a
fixed seed. The same test must reject a variance 30% off in either direction (power check) and the two
std/variance misreadings (std = γ‖v‖² + σ²; the authors' code std = √γ‖v‖ + σ).

Audit: one RGM step on the neighbouring pair R(x) = p·e₁, R(y) = R(x)/(1+η) (the worst-case direction of
docs/privacy/gradient_descent.md#gradient-descent, admissible under Def. 2). Releases are drawn from the
sampler under test on x and the privacy
loss L(o) = log f_x(o) − log f_y(o) is evaluated with the density of what that sampler draws (isotropic
Gaussian). Then D_α = log E_x[e^{(α−1)L}]/(α−1). The mean of e^{(α−1)L} gets a lower confidence bound from
the empirical Bernstein inequality (Maurer & Pontil 2009, Thm 4) applied to e^{(α−1)L} truncated at
c = e^{(α−1)(2·claim + 1)} (truncation only lowers the mean, so the bound stays valid). Bonferroni over the
orders gives a false-alarm probability ≤ 1e-6 per audit. E_x[e^{−L}] = 1 is checked too: it ties the
density used for L to the sampler actually run.

A correct mechanism must have every lower bound ≤ its claimed curve; two known-broken variants must be caught
(a lower bound above the claim) on the same pair, orders, sample size and seed:
* std/variance confusion: the sampler draws with standard deviation γ‖v‖² + σ² (v < 1 here) while the
  accounting claims Theorem 1's curve;
* dropping the norm-leak term: the correct sampler, but the claim keeps only αη²/(2γρ_α), as the paper's
  experiments do ("the d-term is considered negligible", Hendrikx et al. 2024, §6).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from scipy import stats

from mechanisms.accounting import RdpCurve
from mechanisms.learners.relative_gaussian import (
    exact_epsilon,
    rgm_grid,
    rgm_rdp_curve,
    rgm_release_grid,
    theorem1_epsilon,
)
from mechanisms.noise import Noise

pytestmark = pytest.mark.statistical

FALSE_ALARM = 1e-6
SEED = 20240804


# ----- distribution of rgm_release --------------------------------------------------------------------------
GAMMA, SIGMA = 0.05, 0.7
VALUES = [
    np.zeros(5),
    np.array([0.3, -0.4, 0.0, 0.0, 0.0]),  # norm 0.5
    np.array([1.0, 2.0, -2.0, 0.0, 0.0]),  # norm 3
    np.array([12.0, 0.0, -16.0, 0.0, 0.0]),  # norm 20: variance 20.49
]
DRAWS = 5_000


def _variance(value: np.ndarray) -> float:
    """Def. 3: per-coordinate variance γ‖R(x)‖² + σ² (computed here, not by the module)."""
    return GAMMA * float(np.sum(value**2)) + SIGMA**2


def _noise() -> list[np.ndarray]:
    noise = Noise.seeded(SEED)
    releases = [rgm_release_grid(value, GAMMA, SIGMA, noise, draws=DRAWS) for value in VALUES]
    for value, release in zip(VALUES, releases, strict=True):  # exact support: multiples of the public grid
        units = release / rgm_grid(SIGMA, value.size).granularity
        assert np.array_equal(units, np.rint(units))
    return [release - value for value, release in zip(VALUES, releases, strict=True)]


def _ks_pvalue(scale: Callable[[np.ndarray], float]) -> float:
    """KS p-value of the pooled noise, each value's noise divided by ``scale(value)``, against N(0, 1)."""
    pooled = np.concatenate([(noise / scale(v)).ravel() for v, noise in zip(VALUES, _noise(), strict=True)])
    return float(stats.kstest(pooled, "norm").pvalue)


def test_noise_is_gaussian_with_the_declared_variance() -> None:
    assert _ks_pvalue(lambda v: math.sqrt(_variance(v))) > FALSE_ALARM


@pytest.mark.parametrize("factor", [1.3, 0.7])
def test_power_a_variance_30_percent_off_is_rejected(factor: float) -> None:
    assert _ks_pvalue(lambda v: math.sqrt(factor * _variance(v))) < FALSE_ALARM


def test_std_variance_misreadings_are_rejected() -> None:
    assert _ks_pvalue(_variance) < FALSE_ALARM  # "std = γ‖v‖² + σ²"
    assert (
        _ks_pvalue(lambda v: math.sqrt(GAMMA) * float(np.linalg.norm(v)) + SIGMA) < FALSE_ALARM
    )  # authors' code


def test_per_value_variance_mean_and_isotropy() -> None:
    """Per value: χ² test of the sample variance against γ‖v‖² + σ² (two-sided, 1e-6 Bonferroni over values),
    mean 0 and uncorrelated coordinates (|sample correlation| ≤ 6/√n)."""
    level = FALSE_ALARM / len(VALUES)
    for value, noise in zip(VALUES, _noise(), strict=True):
        flat = noise.ravel()
        k = flat.size
        statistic = float(np.sum(flat**2)) / _variance(value)  # mean known (0): χ²_k
        p = 2 * min(stats.chi2.cdf(statistic, k), stats.chi2.sf(statistic, k))
        assert p > level, (np.linalg.norm(value), statistic / k)
        assert abs(float(np.mean(flat))) < 6 * math.sqrt(_variance(value) / k)
        corr = np.corrcoef(noise, rowvar=False)
        assert np.max(np.abs(corr - np.eye(value.size))) < 6 / math.sqrt(DRAWS)


# ----- the audit --------------------------------------------------------------------------------------------
ETA, AUDIT_GAMMA, D, R_REL, P = 0.05, 0.01, 20, 0.01, 3.0
AUDIT_SIGMA = math.sqrt(AUDIT_GAMMA * R_REL**2 / ETA**2)  # σ² = γR²/η²: Theorem 1's condition at every α
ORDERS = (2.0, 3.0)
RUNS = 1_000_000
X = np.zeros(D)
X[0] = P
Y = X / (1 + ETA)


@dataclass(frozen=True)
class Variant:
    name: str
    sample: Callable[[np.ndarray, np.random.Generator, int], np.ndarray]  # value, rng, runs -> (runs, d)
    variance: Callable[[np.ndarray], float]  # per-coordinate variance of what ``sample`` draws
    claim: RdpCurve


@dataclass(frozen=True)
class AuditResult:
    estimate: np.ndarray  # plug-in estimate of D_α per order
    lower: np.ndarray  # lower confidence bound on D_α per order
    claims: np.ndarray
    normaliser: float  # estimate of E_x[e^{−L}] (must be 1)
    normaliser_se: float

    @property
    def excess(self) -> float:
        """max over orders of (lower bound − claim): > 0 means a proven violation."""
        return float(np.max(self.lower - self.claims))


def rgm_variance(value: np.ndarray) -> float:
    return AUDIT_GAMMA * float(np.sum(value**2)) + AUDIT_SIGMA**2


def log_density(o: np.ndarray, mean: np.ndarray, variance: float) -> np.ndarray:
    result: np.ndarray = -np.sum((o - mean) ** 2, axis=1) / (2 * variance) - o.shape[1] / 2 * math.log(
        2 * math.pi * variance
    )
    return result


def empirical_bernstein_lower(z: np.ndarray, level: float) -> float:
    """Maurer & Pontil 2009, Thm 4: for i.i.d. z ∈ [0, 1], with probability ≥ 1 − δ,
    E z ≥ mean − √(2V ln(2/δ)/n) − 7 ln(2/δ)/(3(n−1)), V the unbiased sample variance."""
    n = z.size
    log_term = math.log(2 / level)
    return float(np.mean(z) - math.sqrt(2 * np.var(z, ddof=1) * log_term / n) - 7 * log_term / (3 * (n - 1)))


@functools.lru_cache(maxsize=2)
def _releases(sample: Callable[[np.ndarray, np.random.Generator, int], np.ndarray]) -> np.ndarray:
    """``RUNS`` releases of ``sample`` on X from the audit's seed, drawn once per sampler: three variants
    audit the same exact sampler (its 2·10⁷ discrete Gaussian draws took a minute each time)."""
    releases = sample(X, np.random.default_rng(SEED), RUNS)
    releases.setflags(write=False)
    return releases


@pytest.fixture(autouse=True, scope="module")
def _drop_cached_releases() -> Iterator[None]:
    """The cached releases (160 MB each) are freed when this file is done, not kept for the worker's life."""
    yield
    _releases.cache_clear()


def audit(variant: Variant) -> AuditResult:
    releases = _releases(variant.sample)
    loss = log_density(releases, X, variant.variance(X)) - log_density(releases, Y, variant.variance(Y))
    estimates, lowers, claims = [], [], []
    for alpha in ORDERS:
        claim = variant.claim.at(alpha)
        moments = np.exp((alpha - 1) * loss)
        cap = math.exp((alpha - 1) * (2 * claim + 1))
        lower_mean = cap * empirical_bernstein_lower(
            np.minimum(moments, cap) / cap, FALSE_ALARM / len(ORDERS)
        )
        estimates.append(math.log(float(np.mean(moments))) / (alpha - 1))
        lowers.append(math.log(lower_mean) / (alpha - 1) if lower_mean > 0 else -math.inf)
        claims.append(claim)
    inverse = np.exp(-loss)
    return AuditResult(
        np.array(estimates),
        np.array(lowers),
        np.array(claims),
        float(np.mean(inverse)),
        float(np.std(inverse) / math.sqrt(RUNS)),
    )


def true_divergence(alpha: float, variance: Callable[[np.ndarray], float]) -> float:
    """Lemma 2 for the audit pair (closed form; the unit tests check it against quadrature)."""
    v1, v2 = variance(X), variance(Y)
    s = alpha * v2 + (1 - alpha) * v1
    shift = float(np.sum((X - Y) ** 2))
    return alpha * shift / (2 * s) + D / (alpha - 1) * (
        (1 - alpha) / 2 * math.log(v1) + alpha / 2 * math.log(v2) - math.log(s) / 2
    )


def _rgm_sample(value: np.ndarray, rng: np.random.Generator, runs: int) -> np.ndarray:
    """The module's grid sampler (exact discrete Gaussian); ``rng`` only seeds its deterministic stream."""
    noise = Noise.seeded(int(rng.integers(0, 2**62)))
    return rgm_release_grid(value, AUDIT_GAMMA, AUDIT_SIGMA, noise, draws=runs)


def _std_confused_sample(value: np.ndarray, rng: np.random.Generator, runs: int) -> np.ndarray:
    result: np.ndarray = value + rgm_variance(value) * rng.standard_normal((runs, value.size))
    return result


def _curve(bound: str) -> RdpCurve:
    return rgm_rdp_curve(ORDERS, eta=ETA, gamma=AUDIT_GAMMA, sigma=AUDIT_SIGMA, r_rel=R_REL, d=D, bound=bound)  # type: ignore[arg-type]


def _mean_term_only() -> RdpCurve:
    w = ETA * (2 + ETA)
    return RdpCurve(ORDERS, tuple(a * ETA**2 / (2 * AUDIT_GAMMA * (1 - (a - 1) * w)) for a in ORDERS))


RGM_THEOREM1 = Variant("rgm, Theorem 1", _rgm_sample, rgm_variance, _curve("theorem1"))
RGM_EXACT = Variant("rgm, exact curve", _rgm_sample, rgm_variance, _curve("exact"))
STD_CONFUSED = Variant(
    "std = variance", _std_confused_sample, lambda v: rgm_variance(v) ** 2, _curve("theorem1")
)
NO_NORM_LEAK = Variant("claim without the d-term", _rgm_sample, rgm_variance, _mean_term_only())


def test_audit_pair_is_admissible_and_near_worst_case() -> None:
    gap = float(np.sum((X - Y) ** 2))
    assert gap <= ETA**2 * min(float(np.sum(X**2)), float(np.sum(Y**2))) + R_REL**2
    assert rgm_variance(X) < 1  # so that std = variance really is less noise
    for alpha in ORDERS:
        # the pair sits within 1% of the exact worst case: the audit has little slack to hide in
        assert true_divergence(alpha, rgm_variance) >= 0.99 * exact_epsilon(alpha, ETA, AUDIT_GAMMA, D)
        assert exact_epsilon(alpha, ETA, AUDIT_GAMMA, D) <= theorem1_epsilon(alpha, ETA, AUDIT_GAMMA, D)


@pytest.mark.parametrize("variant", [RGM_EXACT, RGM_THEOREM1], ids=lambda v: v.name)
def test_rgm_passes_the_audit(variant: Variant) -> None:
    result = audit(variant)
    assert abs(result.normaliser - 1) < 6 * result.normaliser_se
    assert result.excess <= 0.0, (result.lower, result.claims)
    for alpha, estimate, lower in zip(ORDERS, result.estimate, result.lower, strict=True):
        truth = true_divergence(alpha, rgm_variance)
        assert estimate == pytest.approx(truth, rel=0.03)
        # the bound is informative: it would catch a claim 10% below the exact curve
        assert lower >= 0.9 * exact_epsilon(alpha, ETA, AUDIT_GAMMA, D)


@pytest.mark.parametrize("variant", [STD_CONFUSED, NO_NORM_LEAK], ids=lambda v: v.name)
def test_known_broken_variants_are_caught(variant: Variant) -> None:
    result = audit(variant)
    assert abs(result.normaliser - 1) < 6 * result.normaliser_se  # the audited density is the sampler's
    assert np.all(result.lower > result.claims), (result.lower, result.claims)
