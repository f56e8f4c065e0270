"""Statistical audit of the accuracy guarantee of accuracy-first ERM (note T16), with a power check.

Claim (Theorem 3.2 / 3.4 with Theorem A.1; reference calibration: note T11): the released model's excess
empirical risk exceeds α with probability ≤ γ. We run the real walk (``accuracy_first``) RUNS times on a
fixed logistic data set and count the runs with excess > α. Under the claim the count is stochastically
below Binomial(RUNS, γ); we reject when the count reaches the smallest k with P[Bin(RUNS, γ) ≥ k] ≤
FALSE_ALARM (fixed seeds, so the test is deterministic; FALSE_ALARM is its false-alarm rate over seeds).

Power: a deliberately broken variant whose test threshold is −2α instead of the calibrated one (it accepts
models with excess up to about 2α) must be rejected by the same test at the same size.

The privacy of the building blocks is audited in their own parts (noise reduction, InteractiveAboveThreshold);
the sensitivities this module adds are property-tested in tests/unit/test_accuracy_first_erm.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from mechanisms import accuracy_first_erm as af
from mechanisms.above_threshold import IatCalibration, iat_reference_calibration

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
    rng = np.random.default_rng(7)
    results = [af.accuracy_first(problem, data, grid, rng) for _ in range(RUNS)]
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

    assert consistent(af.iat_failure_probability(eps, delta, margin, levels))
    assert not consistent(af.iat_failure_probability(1.3 * eps, delta, margin, levels))
