"""Monte Carlo privacy audit of objective perturbation on a 1-D logistic neighbouring pair (Redberg 2023,
Thm 4.3.2; docs/privacy/objective_perturbation.md#objective-perturbation).

Pair: D = 10×(1, +1) ∪ 3×(−1, −1), D′ = D ∪ {(1, −1)} — the added record is badly fit (|f'| ≈ 1), so the
true divergence is close to the Gaussian part of the bound. λ = 1, σ = 1, L = 1, β = 1/4.

* The production solver's outputs follow the exact ObjPert law: P(θ ≤ t) = Φ(J'(t)/σ) (θ is increasing in
  −b), KS test; a 30%-wrong σ is rejected.
* D_α(M(D)‖M(D′)) and the reverse are estimated by Monte Carlo, E_{θ~M(D)}[(p_D/p_D′)^{α−1}] with θ drawn
  by running the mechanism (vectorised bisection on J′(θ) = −b) and the densities by change of variables;
  at α = 2 and α = 3 the estimate must not exceed the Thm 4.3.2 bound (one-sided, false alarm 1e-3 by the
  CLT), and it must agree with quadrature. Power: a mechanism whose noise is 0.6σ while claiming σ (a
  mis-scaled sampler) is caught at α = 2.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from mechanisms.learners.objective_perturbation import (
    logistic_d1,
    logistic_d2,
    objpert_rdp,
    solve_to_tolerance,
)

pytestmark = pytest.mark.statistical

FALSE_ALARM = 1e-3
K_ONE_SIDED = float(stats.norm.isf(FALSE_ALARM))
K_TWO_SIDED = float(stats.norm.isf(FALSE_ALARM / 2))
LAM, SIGMA = 1.0, 1.0
D_X = np.array([1.0] * 10 + [-1.0] * 3)
D_Y = np.array([1.0] * 10 + [-1.0] * 3)
DP_X, DP_Y = np.append(D_X, 1.0), np.append(D_Y, -1.0)


def _grad(theta: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    u = np.outer(theta, xs)
    result: np.ndarray = (logistic_d1(u, ys) * xs).sum(axis=1) + LAM * theta
    return result


def _log_density(theta: np.ndarray, xs: np.ndarray, ys: np.ndarray, sigma: float) -> np.ndarray:
    curv = (logistic_d2(np.outer(theta, xs)) * xs**2).sum(axis=1) + LAM
    result: np.ndarray = stats.norm.logpdf(_grad(theta, xs, ys), scale=sigma) + np.log(curv)
    return result


def _sample(xs: np.ndarray, ys: np.ndarray, sigma: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n runs of exact 1-D ObjPert: θ solves J'(θ) = −b, b ~ N(0, σ²), by bisection (J' increasing)."""
    b = rng.normal(0.0, sigma, n)
    width = (np.abs(b) + np.sum(np.abs(xs))) / LAM + 1.0
    lo, hi = -width, width
    for _ in range(80):
        mid = (lo + hi) / 2
        above = _grad(mid, xs, ys) + b > 0
        hi = np.where(above, mid, hi)
        lo = np.where(above, lo, mid)
    result: np.ndarray = (lo + hi) / 2
    return result


def _quadrature(
    p: tuple[np.ndarray, np.ndarray], q: tuple[np.ndarray, np.ndarray], alpha: float, sigma: float
) -> float:
    grid = np.linspace(-40, 40, 200001)
    log_f = alpha * _log_density(grid, *p, sigma) + (1 - alpha) * _log_density(grid, *q, sigma)
    top = float(np.max(log_f))
    return (math.log(integrate.trapezoid(np.exp(log_f - top), grid)) + top) / (alpha - 1)


def _estimate(
    p: tuple[np.ndarray, np.ndarray],
    q: tuple[np.ndarray, np.ndarray],
    alpha: float,
    sigma: float,
    n: int,
    seed: int,
) -> tuple[float, float]:
    """(mean, standard error) of (p/q)^{α−1} under θ ~ M_σ(p-dataset)."""
    theta = _sample(*p, sigma, n, np.random.default_rng(seed))
    ratio = np.exp((alpha - 1) * (_log_density(theta, *p, sigma) - _log_density(theta, *q, sigma)))
    return float(np.mean(ratio)), float(np.std(ratio, ddof=1) / math.sqrt(n))


def test_production_solver_follows_the_objpert_law() -> None:
    rng = np.random.default_rng(11)
    x, y = D_X[:, None], D_Y
    runs = np.array([solve_to_tolerance(x, y, LAM, rng.normal(0, SIGMA, 1), 1e-10)[0] for _ in range(1500)])

    def cdf(t: np.ndarray) -> np.ndarray:
        result: np.ndarray = stats.norm.cdf(_grad(np.atleast_1d(t), D_X, D_Y) / SIGMA)
        return result

    assert stats.kstest(runs, cdf).pvalue > FALSE_ALARM
    wrong = np.array(
        [solve_to_tolerance(x, y, LAM, rng.normal(0, 1.3 * SIGMA, 1), 1e-10)[0] for _ in range(1500)]
    )
    assert stats.kstest(wrong, cdf).pvalue < FALSE_ALARM


@pytest.mark.parametrize("alpha", [2.0, 3.0])
@pytest.mark.parametrize("direction", ["add", "remove"])
def test_estimated_divergence_is_below_the_bound(alpha: float, direction: str) -> None:
    pair = ((D_X, D_Y), (DP_X, DP_Y)) if direction == "add" else ((DP_X, DP_Y), (D_X, D_Y))
    bound = float(objpert_rdp([alpha], SIGMA, 0.25, LAM, 1.0)[0])
    mean, se = _estimate(*pair, alpha, SIGMA, 200_000, seed=int(alpha * 10) + len(direction))
    assert mean - K_ONE_SIDED * se <= math.exp((alpha - 1) * bound)
    exact = _quadrature(*pair, alpha, SIGMA)
    assert abs(mean - math.exp((alpha - 1) * exact)) <= K_TWO_SIDED * se  # the estimator is unbiased
    assert alpha / (2 * SIGMA**2) * 0.5 < exact < bound  # the pair is a hard one, and the bound holds


def test_audit_catches_a_mis_scaled_noise() -> None:
    """Power: noise 0.6σ while claiming σ; the α = 2 estimate exceeds the claimed bound significantly."""
    alpha = 2.0
    claimed = float(objpert_rdp([alpha], SIGMA, 0.25, LAM, 1.0)[0])
    mean, se = _estimate((D_X, D_Y), (DP_X, DP_Y), alpha, 0.6 * SIGMA, 200_000, seed=5)
    assert mean - K_ONE_SIDED * se > math.exp((alpha - 1) * claimed)
