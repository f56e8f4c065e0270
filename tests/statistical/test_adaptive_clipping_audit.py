"""Monte Carlo audit of DP-GD with private adaptive clipping (Theorem DPGD-ADAPT,
docs/privacy/gradient_descent.md#theorem-dpgd-adapt).

Setting: squared loss, d = 1, n = 2 records, replace-one, λ = 0, τ = 1, T = 2 steps, initial clip C₀ = 0.5,
noise multiplier z = 1.5 split half and half (count_share φ = 0.5: gradient multiplier z/√0.5, count std
z/√0.5), target quantile 0.5, clip learning rate 1 (so C₁ really moves with the released count).
D = {(1, 0.5), (1, 0.5)}; D′ replaces record 0 by (1, −1). At θ₀ = 0 this is the worst pair for both parts
of step 0: record 0's clipped gradient goes from −0.5 to +0.5 (the full replace-one sensitivity 2C₀) and its
indicator ‖∇ℓ‖ ≤ C₀ from 1 to 0 (the count's sensitivity 1).

Each transcript o = (S̃₀, b̃₀, S̃₁, b̃₁) is drawn by ``adaptive_dp_gd_train`` on D (S̃_t recovered from the
released iterates, b̃_t and C_t released). Both noises are discrete Gaussians with the same normaliser under
D and D′, so the privacy loss is, written out independently of the implementation,
L(o) = Σ_t [((S̃_t − μ′_t)² − (S̃_t − μ_t)²)/(2s_t²) + ((b̃_t − c′_t)² − (b̃_t − c_t)²)/(2t_b²)],
μ_t, μ′_t the clipped sums and c_t, c′_t the counts at (θ_t, C_t) on D, D′, s_t and t_b the released
standard deviations. The RDP charge ε(α) must satisfy E_D[exp((α−1)(L − ε(α)))] ≤ 1; a lower confidence bound
(empirical Bernstein, Maurer & Pontil 2009 Thm 4, on the variable truncated at e^{α−1}, which only lowers the
mean) above 1 would prove an under-charge; false alarm ≤ 1e-6 per audit (Bonferroni over orders 2 and 4).
E_D[e^{−L}] = 1 ties the densities to the sampler.

Power: the same audit (same pair, runs and seed) must catch a count released with standard deviation 1 instead
of t_b (a count-noise fault injected into the module's ``count_noise_units``). A gradient noise left unsplit,
an under-charge by the factor 1 + φ = 1.5 here, is not caught by this audit at this number of runs (the second
step's loss is far below its charge, so the audit is loose by about that factor); the split test below
(``test_each_part_gets_the_noise_the_charge_needs``) checks each part's realised noise against the std the
charge requires, written out from z and φ, and catches that fault at the default φ = 0.05.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from scipy import stats

from mechanisms.learners import dp_gd
from mechanisms.learners.dp_gd import (
    AdaptiveClip,
    DpGdConfig,
    Neighboring,
    adaptive_dp_gd_train,
    clip_count,
    clipped_sum_units,
    count_noise_units,
    dp_gd_curve,
    gradient_multiplier,
    grid_records,
    released_noise_std,
)
from mechanisms.noise import Noise

pytestmark = pytest.mark.statistical

FALSE_ALARM = 1e-6
SEED = 19_2021
ORDERS = (2.0, 4.0)
RUNS = 6_000
Z, SHARE, C0, STEPS = 1.5, 0.5, 0.5, 2
RADIUS = 1e4
X_D = np.array([[1.0], [1.0]])
Y_D = np.array([0.5, 0.5])
X_N = np.array([[1.0], [1.0]])
Y_N = np.array([-1.0, 0.5])
ADAPT = AdaptiveClip(target_quantile=0.5, learning_rate=1.0, count_share=SHARE)
CONFIG = DpGdConfig("squared", 0.0, STEPS, 1.0, C0, Z, "replace_one", RADIUS, ADAPT)
CHARGE = dict(zip(ORDERS, dp_gd_curve(CONFIG, "replace_one", ORDERS).values, strict=True))
COUNT_STD = count_noise_units(Z, SHARE)


@dataclass(frozen=True)
class Audit:
    lower: dict[float, float]
    estimate: dict[float, float]
    normaliser: float
    normaliser_se: float
    clip_moved: float


def _means(theta: np.ndarray, clip: float, x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    records = grid_records(x, y, clip, noise_multiplier=gradient_multiplier(CONFIG))
    total = float(clipped_sum_units(theta, records, "squared")[0]) * records.unit
    return total, clip_count(theta, records, "squared", clip)


def _bernstein_lower(z: np.ndarray, level: float) -> float:
    """Maurer & Pontil 2009 Thm 4 for i.i.d. z ∈ [0, 1]: E z ≥ mean − √(2V ln(2/δ)/n) − 7 ln(2/δ)/(3(n−1))."""
    n = z.size
    log_term = math.log(2 / level)
    return float(np.mean(z) - math.sqrt(2 * np.var(z, ddof=1) * log_term / n) - 7 * log_term / (3 * (n - 1)))


def _audit(sample_config: DpGdConfig, count_std: int = COUNT_STD) -> Audit:
    """L with the densities of what ``sample_config`` really draws (count noise std ``count_std``)."""
    noise = Noise.seeded(SEED)
    loss = np.empty(RUNS)
    moved = 0
    for i in range(RUNS):
        path, clips, counts = adaptive_dp_gd_train(sample_config, X_D, Y_D, 2.0, noise)
        thetas = np.vstack([np.zeros((1, 1)), path])
        assert float(np.max(np.abs(thetas))) < 0.5 * RADIUS  # projection never active
        moved += int(clips[1] != clips[0])
        total = 0.0
        for t in range(STEPS):
            theta, clip = thetas[t], float(clips[t])
            noisy_sum = 2.0 * float(thetas[t, 0] - thetas[t + 1, 0])  # θ_{t+1} = θ_t − S̃_t/n, n = 2, τ = 1
            s = released_noise_std(sample_config, clip)
            mu, c = _means(theta, clip, X_D, Y_D)
            mu_n, c_n = _means(theta, clip, X_N, Y_N)
            b = float(counts[t])
            total += ((noisy_sum - mu_n) ** 2 - (noisy_sum - mu) ** 2) / (2 * s * s)
            total += ((b - c_n) ** 2 - (b - c) ** 2) / (2 * count_std**2)
        loss[i] = total
    lower, estimate = {}, {}
    for alpha in ORDERS:
        z = np.exp((alpha - 1) * (loss - CHARGE[alpha]))
        cap = math.exp(alpha - 1)
        estimate[alpha] = float(np.mean(z))
        lower[alpha] = cap * _bernstein_lower(np.minimum(z, cap) / cap, FALSE_ALARM / len(ORDERS))
    inverse = np.exp(-loss)
    return Audit(
        lower, estimate, float(np.mean(inverse)), float(np.std(inverse) / math.sqrt(RUNS)), moved / RUNS
    )


def test_setting_is_as_documented() -> None:
    zero = np.zeros(1)
    mu, c = _means(zero, C0, X_D, Y_D)
    mu_n, c_n = _means(zero, C0, X_N, Y_N)
    assert abs(mu - mu_n) == pytest.approx(2 * C0, rel=1e-3)  # the full replace-one sensitivity 2C
    assert (c, c_n) == (2, 1)  # the count's sensitivity 1
    # the charge is the plain DP-GD charge T·α/(2z²), split between gradient and count
    for alpha in ORDERS:
        assert CHARGE[alpha] == pytest.approx(STEPS * alpha / (2 * Z * Z), rel=1e-9)


def test_audit_adaptive_clipping_respects_the_charge() -> None:
    result = _audit(CONFIG)
    assert result.clip_moved > 0.8  # the clip really adapts between the steps
    assert abs(result.normaliser - 1.0) < 6 * result.normaliser_se + 1e-3
    for alpha in ORDERS:
        assert result.lower[alpha] <= 1.0, (alpha, result.lower[alpha], result.estimate[alpha])


def test_audit_catches_count_noise_too_small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp_gd, "count_noise_units", lambda *_: 1)  # fault injection: std 1, charged as t_b
    result = _audit(CONFIG, count_std=1)
    assert max(result.lower.values()) > 1.0, result


# ----- the noise each part really gets, against what the charge needs ------------------------------------
# The audit above is loose by about 1 + φ for a gradient noise left unsplit (its second step is far below the
# charge), so the split is checked directly. The charge T·α/(2z²) (tests/unit/test_dp_gd_adaptive.py: equal to
# the closed form) is valid only if every step's gradient noise has std ≥ z/√(1 − φ)·Δ(C_t) and the count's
# std ≥ z/√φ: these required values are written out here from z, φ and the released C_t alone, not taken from
# the module. A dataset whose clipped sum is exactly 0 and whose count is exactly N0 at every θ and C (N0 zero
# rows, counted with norm 0 ≤ C_t; PAIRS pairs of one row with labels ±1e6, clipped to opposite terms that
# cancel on the grid and never counted) makes each released sum pure noise: with λ = τ = 1,
# θ_{t+1} = θ_t − (S̃_t/n + θ_t) = −S̃_t/n. One-sided test per part: Q = Σ(draw/required std)² is ≥ χ²_N in
# distribution when the std is at least the required one; Q below the χ²_N FALSE_ALARM quantile (1e-6) is an
# under-noise. γ = N0/n makes log C_t a random walk (C_t over several decades, the clamp included).
# Power (same seed): the gradient noise left unsplit (z instead of z/√(1 − φ): variance ratio 0.95 at the
# default φ = 0.05, the threshold is ≈ 0.98) and the count noise left unsplit (std ⌈z⌉) are both caught.
N0, PAIRS, DIM, SPLIT_STEPS = 20, 10, 64, 2_000
SPLIT_CASES: list[tuple[Neighboring, float]] = [("replace_one", 0.05), ("add_remove", 0.5)]


def _split_draws(neighboring: Neighboring, share: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gradient draws / required std, shape (T, d); count draws / required std, shape (T,); C₀…C_{T−1})."""
    n = N0 + 2 * PAIRS
    x = np.zeros((n, DIM))
    x[N0:, 0] = 1.0
    y = np.zeros(n)
    y[N0:] = np.tile([1e6, -1e6], PAIRS)
    adapt = AdaptiveClip(target_quantile=N0 / n, learning_rate=1.0, count_share=share)
    config = DpGdConfig("squared", 1.0, SPLIT_STEPS, 1.0, 1.0, Z, neighboring, 1e12, adapt)
    path, clips, counts = adaptive_dp_gd_train(config, x, y, float(n), Noise.seeded(SEED + 1))
    sums = -float(n) * path  # S̃_t = −n·θ_{t+1}
    delta = (2.0 if neighboring == "replace_one" else 1.0) * clips
    gradient = sums / (Z / math.sqrt(1.0 - share) * delta)[:, None]
    count = (counts - N0) / (Z / math.sqrt(share))
    return gradient, count, clips


def _under_noised(draws: np.ndarray) -> bool:
    q = float(np.sum(draws.astype(np.float64) ** 2))
    return q < float(stats.chi2.ppf(FALSE_ALARM, draws.size))


@pytest.mark.parametrize(("neighboring", "share"), SPLIT_CASES)
def test_each_part_gets_the_noise_the_charge_needs(neighboring: Neighboring, share: float) -> None:
    gradient, count, clips = _split_draws(neighboring, share)
    assert np.ptp(np.log10(clips)) > 2.0  # the clip really moves over decades (each C_t has its own grid)
    assert not _under_noised(gradient), np.mean(gradient**2)
    assert not _under_noised(count), np.mean(count**2)
    assert abs(float(np.mean(gradient))) < 6 / math.sqrt(gradient.size)  # centred: the sum is 0 + noise


def test_split_check_catches_unsplit_gradient_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    def unsplit(z: float, share: float) -> tuple[float, float]:  # fault: gradient keeps the whole z
        return z * (1.0 + 1e-12), z / math.sqrt(share) * (1.0 + 1e-12)

    monkeypatch.setattr(dp_gd, "adaptive_split", unsplit)
    gradient, count, _ = _split_draws("replace_one", 0.05)
    assert _under_noised(gradient), np.mean(gradient**2)
    assert not _under_noised(count)


def test_split_check_catches_unsplit_count_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp_gd, "count_noise_units", lambda z, _share: max(1, math.ceil(z)))  # fault
    gradient, count, _ = _split_draws("replace_one", 0.05)
    assert _under_noised(count), np.mean(count**2)
    assert not _under_noised(gradient)
