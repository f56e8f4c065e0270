"""Statistical audit of the accuracy guarantee of accuracy-first ERM
(docs/privacy/accuracy_first_erm.md#accuracy-first-erm-calibration), with a power
check.

Claim (Ligett et al. 2017, Theorem 3.2 / 3.4 with Theorem A.1; reference calibration:
docs/privacy/accuracy_first_erm.md#accuracy-first-erm-calibration):
the released model's excess
empirical risk exceeds α with probability ≤ γ. We run the real walk (``accuracy_first``) RUNS times on a
fixed logistic data set and count the runs with excess > α. Under the claim the count is stochastically
below Binomial(RUNS, γ); we reject when the count reaches the smallest k with P[Bin(RUNS, γ) ≥ k] ≤
FALSE_ALARM (fixed seeds, so the test is deterministic; FALSE_ALARM is its false-alarm rate over seeds).

Power: a deliberately broken variant whose test threshold is −2α instead of the calibrated one (it accepts
models with excess up to about 2α) must be rejected by the same test at the same size.

The privacy of the building blocks is audited in their own parts (noise reduction, InteractiveAboveThreshold);
the sensitivities this module adds are property-tested in tests/unit/test_accuracy_first_erm.py.

Finite precision (docs/privacy/finite_precision.md#finite-precision): the exact-bound calibration is certified
for the grid IAT that runs (discrete Laplace, rounded comparisons); its failure bound is checked against a
Monte Carlo of that grid test, and the exact-support attack (is a release reachable from the neighbour?) finds
nothing on neighbouring data sets, while the old float construction is caught on every release.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from mechanisms.noise import Noise
from mechanisms.reduction import accuracy_first_erm as af
from mechanisms.reduction import erm_calibration as afc
from mechanisms.threshold.above_threshold import ThresholdGrid
from mechanisms.threshold.interactive import IatCalibration, iat_reference_calibration

pytestmark = pytest.mark.statistical

FALSE_ALARM = 1e-3
RUNS = 120
GAMMA = 0.1
ALPHA = 0.01
N, P, LAM, LEVELS = 3000, 3, 0.02, 60


def _data() -> af.LogisticData:
    rng = np.random.default_rng(20261122)
    x = rng.standard_normal((N, P))
    x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
    y = np.where(x @ np.array([3.0, -2.0, 1.0]) + rng.logistic(size=N) > 0, 1.0, -1.0)
    return af.LogisticData(x, y)


def _critical_count() -> int:
    """Smallest k with P[Bin(RUNS, γ) ≥ k] ≤ FALSE_ALARM."""
    k = int(stats.binom.isf(FALSE_ALARM, RUNS, GAMMA)) + 1
    assert stats.binom.sf(k - 1, RUNS, GAMMA) <= FALSE_ALARM
    return k


def _failures(calibration: af.Calibration) -> tuple[int, int]:
    """(runs whose released model has excess > α, runs that reached the target)."""
    data = _data()
    problem = af.Problem("logistic", N, P, LAM, ALPHA, GAMMA, calibration)
    grid = af.geometric_grid(1.0 / N, 4.0 * af.theory_epsilon("logistic", N, P, LAM, ALPHA), LEVELS)
    noise = Noise.seeded(7)
    results = [af.accuracy_first(problem, data, grid, noise) for _ in range(RUNS)]
    reached = sum(r.reached for r in results)
    return sum(r.excess > ALPHA for r in results), reached


@pytest.mark.parametrize("calibration", ["paper_theorem", "reference_code", "exact_bound"])
def test_excess_risk_above_alpha_at_most_gamma(calibration: af.Calibration) -> None:
    failures, reached = _failures(calibration)
    assert reached >= RUNS // 2  # the setting exercises accepted models, not only the ⊥ outcome
    assert failures < _critical_count()


def test_power_broken_threshold_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(
        calibration: af.Calibration, delta_q: float, alpha: float, gamma: float, levels: int
    ) -> IatCalibration:
        right = iat_reference_calibration(delta_q, alpha, gamma, levels, target=-alpha)
        return IatCalibration(right.epsilon_a, -2.0 * alpha, "broken")

    monkeypatch.setattr(af, "iat_calibration", broken)
    failures, _ = _failures("reference_code")
    assert failures >= _critical_count()


def test_exact_failure_bound_matches_monte_carlo() -> None:
    """The exact-bound calibration's failure formula P[max_{t≤T} ν_t − ρ > c] against simulation.

    Two-sided binomial test at false-alarm FALSE_ALARM; power: the same test rejects the formula evaluated
    with a 30% wrong noise scale (ε_A × 1.3).
    """
    rng = np.random.default_rng(11)
    runs, levels, delta, eps, margin = 200_000, 20, 1.0, 1.0, 12.0
    rho = rng.laplace(0.0, 2.0 * delta / eps, runs)
    nu_max = rng.laplace(0.0, 4.0 * delta / eps, (runs, levels)).max(axis=1)
    count = int(np.sum(nu_max - rho > margin))

    def consistent(p: float) -> bool:
        return bool(stats.binomtest(count, runs, p).pvalue > FALSE_ALARM)

    assert consistent(afc.iat_failure_probability(eps, delta, margin, levels))
    assert not consistent(afc.iat_failure_probability(1.3 * eps, delta, margin, levels))


def test_discrete_failure_bound_matches_monte_carlo_of_the_grid_test() -> None:
    """The certified bound of the grid IAT (``iat_discrete_failure_probability``) against a simulation of
    exactly the comparison the IAT makes: R(f) + ν_t ≥ R(W) + ρ with every level at excess just above α
    (f = −α − γ/4, the worst case), discrete Laplace noise at the ThresholdGrid scales. Two-sided binomial
    test at FALSE_ALARM; power: the bound at ε_A × 1.3 is rejected."""
    noise = Noise.seeded(12)
    runs, levels, delta, eps, alpha = 100_000, 20, 1.0, 1.0, 24.0
    grid = ThresholdGrid.build(delta, eps)
    gamma = grid.grid.granularity
    rho = noise.discrete_laplace(grid.threshold_scale, runs)
    nu_max = noise.discrete_laplace(grid.query_scale, runs * levels).reshape(runs, levels).max(axis=1)
    value_units = grid.value_units(-alpha - gamma / 4)
    count = int(np.sum(value_units + nu_max >= grid.threshold_units(-alpha / 2) + rho))

    def consistent(p: float) -> bool:
        return bool(stats.binomtest(count, runs, p).pvalue > FALSE_ALARM)

    assert consistent(afc.iat_discrete_failure_probability(eps, delta, -alpha / 2, alpha, levels))
    assert not consistent(afc.iat_discrete_failure_probability(1.3 * eps, delta, -alpha / 2, alpha, levels))


SUPPORT_RUNS = 150


def _on_grid(values: np.ndarray, granularity: float) -> bool:
    scaled = np.ldexp(np.asarray(values, dtype=np.float64), -(math.frexp(granularity)[1] - 1))
    return bool(np.all(scaled == np.trunc(scaled)))


@pytest.mark.parametrize("task", ["logistic", "ridge"])
def test_exact_support_attack_finds_nothing(task: af.Task) -> None:
    """For a release of D, is it reachable from the neighbour D′? The noisy statistic of D′ is
    γ_S·(U′ + η) with η of full support on Z^d (discrete Laplace noise reduction), so its support is all of
    γ_S·Z^d, the same for D and D′ (γ_S is public); coefficients and level are post-processing of it. So a
    release rules D′ out iff it leaves the published grid: count those over SUPPORT_RUNS runs on each side
    (0 expected), and check the published grids agree. Power: the old float construction (θ* + continuous
    Laplace, as before the grid) leaves the grid on every release."""
    n, p, lam = 1500, 3, 0.05
    rng = np.random.default_rng(20261125)
    x = rng.standard_normal((n, p))
    x /= np.abs(x).sum(axis=1, keepdims=True) if task == "ridge" else np.linalg.norm(x, axis=1, keepdims=True)
    y = rng.uniform(-1, 1, n) if task == "ridge" else np.where(x[:, 0] + rng.logistic(size=n) > 0, 1.0, -1.0)
    x2, y2 = x.copy(), y.copy()
    x2[0], y2[0] = -x[0], -y[0]
    problem = af.Problem(task, n, p, lam, 0.05, GAMMA, "reference_code")
    grid = af.geometric_grid(1.0 / n, 4.0 * af.theory_epsilon(task, n, p, lam, 0.05), 30)
    noise = Noise.seeded(13)
    published: set[tuple[float, float]] = set()
    off_grid = 0
    for xs, ys in ((x, y), (x2, y2)):
        data = af.make_data(task, xs, ys)
        for _ in range(SUPPORT_RUNS):
            result = af.accuracy_first(problem, data, grid, noise)
            assert result.statistic is not None
            published.add((result.granularity, result.statistic_granularity))
            on = _on_grid(result.theta, result.granularity) and _on_grid(
                result.statistic, result.statistic_granularity
            )
            off_grid += not on
    assert off_grid == 0
    assert len(published) == 1  # the grids are public: the same on both sides
    # power: the float construction's releases are never on a grid of this size
    float_rng = np.random.default_rng(14)
    data = af.make_data(task, x, y)
    statistic = problem.statistic(data, data.minimizer(lam))
    _granularity, statistic_granularity = published.pop()
    caught = sum(
        not _on_grid(
            statistic + float_rng.laplace(0.0, problem.delta_s / 0.5, statistic.shape), statistic_granularity
        )
        for _ in range(SUPPORT_RUNS)
    )
    assert caught == SUPPORT_RUNS
