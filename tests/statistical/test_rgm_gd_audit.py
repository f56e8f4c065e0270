"""Monte Carlo audit of RGM-GD with early stopping: the ex-post charge T_run·ε_step on a neighbouring pair.

Setting: ridge least squares, n = 2 records, d = 1 feature, λ = 25, X = Y = 1, with the bound rgm.gd uses
(η = 2X²/(λn) = 0.04, α_max = 13.25).
D = {(1, 1), (1, 1)}; D′ replaces record 0 by (0, −1) (the largest per-step divergence among the corner
records at θ = 50, found by the closed form of Lemma 2). γ is calibrated to ε_step(2) = 1 (Theorem 1).
The run starts at the public θ₀ = 50, far from the optimum, where the relative term γ‖∇f‖² dominates the
noise; at most T = 2 steps; the rule stops after step 1 when the released noisy gradient norm is below
1300 (about half of the runs).

For a transcript o = (θ₁, …, θ_{T_run}) drawn by ``rgm_gd_train`` on D, the privacy loss is
L(o) = Σ_t [log p_t(θ_{t+1} | θ_t) − log q_t(θ_{t+1} | θ_t)] with the Gaussian step densities of what the
sampler draws (mean θ_t − τ∇f(θ_t), variance τ²v(θ_t)); the stopping time is a function of o, so it is the
same under both datasets. The ex-post RDP inequality (docs/privacy/index.md#definition-ex-post-rdp) says
E_D[exp((α−1)(L − T_run·ε_step(α)))] ≤ 1. A lower confidence bound on that mean (empirical Bernstein,
Maurer & Pontil 2009 Thm 4, on the variable truncated at e^{α−1}, which only lowers the mean) above 1
would prove a violation; false-alarm probability ≤ 1e-6 per audit (Bonferroni over the two orders 2 and 4).
E_D[e^{−L}] = 1 is checked too: it ties the densities used for L to the sampler actually run.

Projection: rgm.gd projects every iterate onto a public ball (post-processing;
docs/privacy/gradient_descent.md#rgm-gd-projection). The default radius here (ridge_theta_bound(25, 1, 1) =
1/26) would project θ₀ = 50 to 0.038 and make the step laws non-Gaussian, so the audit passes the public
radius RADIUS = 1e4 explicitly (any public radius is private) and asserts that no transcript reaches it: the
sampler is then exactly the unprojected one whose Gaussian densities are written out below.

Power: the same audit (same pair, orders, runs, seed) must catch two broken variants:
* noise without the relative term (variance σ² only) charged as the RGM;
* a stopping rule that peeks at the data (stops at step 1 on D, never on D′) charged T_run·ε_step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from mechanisms.learners.relative_gaussian import theorem1_epsilon
from mechanisms.learners.rgm_calibration import (
    baseline_sigma,
    gamma_for_step,
    relative_sensitivity,
)
from mechanisms.learners.rgm_gd import (
    RgmGdConfig,
    StopRule,
    full_gradient,
    rgm_gd_train,
)
from mechanisms.noise import Noise

pytestmark = pytest.mark.statistical

FALSE_ALARM = 1e-6
SEED = 5_2024
ORDERS = (2.0, 4.0)
RUNS = 20_000
REG, TAU, THETA0, STEPS, TOLERANCE = 25.0, 0.02, 50.0, 2, 1300.0
RADIUS = 1e4  # public projection radius, far outside every transcript (asserted)
X_D = np.array([[1.0], [1.0]])
Y_D = np.array([1.0, 1.0])
X_N = np.array([[0.0], [1.0]])
Y_N = np.array([-1.0, 1.0])
SENS = relative_sensitivity("ridge", 2, REG, 1.0)  # what rgm.gd uses
GAMMA = gamma_for_step(1.0, 2.0, SENS.eta, 1)
SIGMA = baseline_sigma(GAMMA, SENS)
EPS_STEP = {alpha: theorem1_epsilon(alpha, SENS.eta, GAMMA, 1) for alpha in ORDERS}


@dataclass(frozen=True)
class Variant:
    gamma: float  # the γ the sampler really uses (the charge is always EPS_STEP)
    peek: bool  # stopping rule that reads the data


def _sample(variant: Variant) -> list[np.ndarray]:
    """RUNS transcripts θ₀ … θ_{T_run} on D from the module's sampler."""
    noise = Noise.seeded(SEED)
    stop = None if variant.peek else StopRule(TOLERANCE)
    steps = 1 if variant.peek else STEPS  # the peeking rule: "first record has x = 1" ⇒ stop after 1 step
    config = RgmGdConfig("ridge", REG, steps, TAU, variant.gamma, SIGMA, stop, radius=RADIUS)
    start = np.array([THETA0])
    paths = [
        np.vstack([start, rgm_gd_train(config, X_D, Y_D, noise, theta0=start).iterates]) for _ in range(RUNS)
    ]
    assert max(float(np.max(np.abs(path))) for path in paths) < 0.5 * RADIUS  # projection never active
    return paths


def _log_density(path: np.ndarray, x: np.ndarray, y: np.ndarray, gamma: float) -> float:
    """log of Π_t N(θ_{t+1}; θ_t − τ∇f(θ_t), τ²(γ‖∇f(θ_t)‖² + σ²)) (d = 1), written out independently."""
    total = 0.0
    for t in range(path.shape[0] - 1):
        theta = path[t]
        gradient = float(np.mean(x[:, 0] * (x[:, 0] * theta[0] - y)) + REG * theta[0])
        variance = TAU**2 * (gamma * gradient**2 + SIGMA**2)
        mean = theta[0] - TAU * gradient
        total += -((path[t + 1, 0] - mean) ** 2) / (2 * variance) - 0.5 * math.log(2 * math.pi * variance)
    return total


def _stops_on(x: np.ndarray, path: np.ndarray, peek: bool) -> bool:
    """Whether the run on dataset ``x`` could have produced a transcript of this length."""
    if peek:
        return bool(x[0, 0] == 1.0) == (path.shape[0] == 2)
    return True  # the correct rule is a function of the transcript: same decision on both datasets


def _bernstein_lower(z: np.ndarray, level: float) -> float:
    """Maurer & Pontil 2009 Thm 4 for i.i.d. z ∈ [0, 1]: E z ≥ mean − √(2V ln(2/δ)/n) − 7 ln(2/δ)/(3(n−1))."""
    n = z.size
    log_term = math.log(2 / level)
    return float(np.mean(z) - math.sqrt(2 * np.var(z, ddof=1) * log_term / n) - 7 * log_term / (3 * (n - 1)))


@dataclass(frozen=True)
class Audit:
    lower: dict[float, float]  # lower confidence bound on E[exp((α−1)(L − T_run ε))] per order
    estimate: dict[float, float]  # plug-in estimate of the same mean (reported, not asserted)
    normaliser: float
    normaliser_se: float
    stopped_fraction: float


def _audit(variant: Variant) -> Audit:
    paths = _sample(variant)
    loss = np.empty(RUNS)
    runs_steps = np.empty(RUNS)
    for i, path in enumerate(paths):
        runs_steps[i] = path.shape[0] - 1
        if not _stops_on(X_N, path, variant.peek):
            loss[i] = math.inf
            continue
        log_q = _log_density(path, X_N, Y_N, variant.gamma)
        loss[i] = _log_density(path, X_D, Y_D, variant.gamma) - log_q
    lower, estimate = {}, {}
    for alpha in ORDERS:
        with np.errstate(over="ignore"):
            z = np.exp((alpha - 1) * (loss - runs_steps * EPS_STEP[alpha]))
        cap = math.exp(alpha - 1)
        estimate[alpha] = float(np.mean(z))
        lower[alpha] = cap * _bernstein_lower(np.minimum(z, cap) / cap, FALSE_ALARM / len(ORDERS))
    inverse = np.exp(-loss)
    return Audit(
        lower,
        estimate,
        float(np.mean(inverse)),
        float(np.std(inverse) / math.sqrt(RUNS)),
        float(np.mean(runs_steps < STEPS)),
    )


def test_setting_is_as_documented() -> None:
    assert SENS.eta == pytest.approx(0.04)
    assert 13.2 < 1 + 1 / (SENS.eta * (2 + SENS.eta)) < 13.3
    assert EPS_STEP[2.0] <= 1.0
    assert EPS_STEP[2.0] > 0.999
    g = full_gradient(np.array([THETA0]), X_D, Y_D, "ridge", REG)
    assert GAMMA * float(g @ g) > 100 * SIGMA**2  # the relative term dominates the noise at θ₀


def test_audit_correct_mechanism_respects_the_ex_post_charge() -> None:
    result = _audit(Variant(GAMMA, peek=False))
    assert 0.2 < result.stopped_fraction < 0.8  # early stopping is really exercised
    assert abs(result.normaliser - 1.0) < 6 * result.normaliser_se + 1e-3
    for alpha in ORDERS:
        assert result.lower[alpha] <= 1.0, (alpha, result.lower[alpha])


@pytest.mark.parametrize(
    ("variant", "what"),
    [(Variant(1e-300, peek=False), "no relative term"), (Variant(GAMMA, peek=True), "data-peeking stop")],
)
def test_audit_catches_broken_variants(variant: Variant, what: str) -> None:
    result = _audit(variant)
    assert max(result.lower.values()) > 1.0, what
