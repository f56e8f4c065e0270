"""Monte Carlo audit of user-level DP-GD (docs/privacy/units_learners.md#theorem-dpgd-unit).

Pair (add/remove one unit): D = 60 rows of 15 units (d = 2, logistic, rows of norm ≤ 1), D′ = D plus one
**heavy** unit of 40 rows (10× ``max_rows`` = 4), all x = (1, 0) with label +1, so at θ = 0 each of its kept
rows has gradient −½·x and the unit's sum −2·x is clipped to norm C: the worst case, ‖S(D) − S(D′)‖ = C/ω
(to 1e-11). One step (T = 1), C = 1, z = 2, charged α/(2z²) = α/8.

A step's release is the integer vector S + Z, Z ~ N_Z(0, t²)^2 (t = ``noise_units``; the service run is
exactly this: ``test_the_run_is_the_user_level_sum_plus_the_noise_and_the_engine_path_agrees`` in
tests/unit/test_dp_gd_units.py).
Both laws are discrete Gaussians with the same normaliser, so the privacy loss of an output is, written out
independently of the implementation, L = (‖Z + δ‖² − ‖Z‖²)/(2t²) = (2Z·δ + ‖δ‖²)/(2t²), δ = S(D) − S(D′),
with Z drawn under D. The charge ε(α) must satisfy E_D[exp((α−1)(L − ε(α)))] ≤ 1 (the ex-post inequality);
a lower confidence bound above 1 (empirical Bernstein, Maurer & Pontil 2009 Thm 4, on the variable truncated
at e^{α−1}, which only lowers the mean) would prove an under-charge. False alarm ≤ 1e-6 per audit
(Bonferroni over the orders 2 and 4). E_D[e^{−L}] = 1 ties the density to the sampler.

Power: the same audit, same runs, on the variant that clips rows but not units (``clip_unit_sums`` replaced
by the identity: the heavy unit's 4 kept rows add up to 2C) must find a lower bound above 1.
Measured (seeds below): E ≈ 1.0003 / 0.998 (lower 0.987 / 0.926) at α = 2 / 4; broken 2.11 / 82.6 (lower
1.45 / 5.13). Runtime ≈ 3 s.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mechanisms.learners import dp_gd
from mechanisms.learners.dp_gd import (
    DpGdConfig,
    bound_units,
    dp_gd_curve,
    grid_records,
    noise_units,
    unit_clipped_sum_units,
)
from mechanisms.noise import Noise
from mechanisms.noise.learners import discrete_gaussian_std

pytestmark = pytest.mark.statistical

FALSE_ALARM = 1e-6
ORDERS = (2.0, 4.0)
RUNS = 200_000
K, C, Z = 4, 1.0, 2.0
CONFIG = DpGdConfig("logistic", 0.0, 1, 1.0, C, Z, "add_remove", 1e6)
CHARGE = dict(zip(ORDERS, dp_gd_curve(CONFIG, "add_remove", ORDERS).values, strict=True))
T = noise_units(CONFIG)

Rows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _pair() -> tuple[Rows, Rows]:
    rng = np.random.default_rng(20261208)
    n = 60
    x = rng.normal(size=(n, 2))
    x /= np.maximum(1.0, np.linalg.norm(x, axis=1))[:, None]
    base: Rows = (x, rng.choice([-1.0, 1.0], n), rng.integers(0, 15, n), rng.integers(-(2**62), 2**62, n))
    heavy = 10 * K
    x_h = np.tile([1.0, 0.0], (heavy, 1))
    extra: Rows = (x_h, np.ones(heavy), np.full(heavy, 999), rng.integers(-(2**62), 2**62, heavy))
    x2, y2, u2, o2 = (np.concatenate(pair) for pair in zip(base, extra, strict=True))
    return base, (x2, y2, u2, o2)


def _noiseless(rows: Rows) -> tuple[list[int], float]:
    """S at θ₀ = 0 in term units (exact integers) and ω."""
    x, y, units, order = rows
    records = grid_records(x, y, C, noise_multiplier=Z)
    total = unit_clipped_sum_units(np.zeros(2), bound_units(records, units, order, K, C), "logistic")
    return [int(v) for v in total], records.unit


def _delta() -> tuple[np.ndarray, float]:
    d, d_prime = _pair()
    (a, unit), (b, _) = _noiseless(d), _noiseless(d_prime)
    return np.array([float(u - v) for u, v in zip(a, b, strict=True)]), unit


def _bernstein_lower(z: np.ndarray, level: float) -> float:
    """Maurer & Pontil 2009 Thm 4 for i.i.d. z ∈ [0, 1]: E z ≥ mean − √(2V ln(2/δ)/n) − 7 ln(2/δ)/(3(n−1))."""
    n = z.size
    log_term = math.log(2 / level)
    return float(np.mean(z) - math.sqrt(2 * np.var(z, ddof=1) * log_term / n) - 7 * log_term / (3 * (n - 1)))


def _audit(delta: np.ndarray, seed: int) -> tuple[dict[float, float], float]:
    """Per order the lower confidence bound on E_D[exp((α−1)(L − ε(α)))], and the mean of e^{−L}."""
    draws = discrete_gaussian_std(Noise.seeded(seed), T, RUNS * 2).reshape(RUNS, 2).astype(np.float64)
    loss = (2.0 * draws @ delta + float(delta @ delta)) / (2.0 * float(T) * float(T))
    lower = {}
    for alpha in ORDERS:
        z = np.exp((alpha - 1) * (loss - CHARGE[alpha]))
        cap = math.exp(alpha - 1)
        lower[alpha] = cap * _bernstein_lower(np.minimum(z, cap) / cap, FALSE_ALARM / len(ORDERS))
    return lower, float(np.mean(np.exp(-loss)))


def test_the_pair_reaches_the_unit_sensitivity() -> None:
    delta, unit = _delta()
    assert float(np.linalg.norm(delta)) * unit / C == pytest.approx(1.0, abs=1e-9)
    assert float(T) * unit >= Z * C  # the noise std is at least zΔ
    for alpha in ORDERS:
        assert CHARGE[alpha] == pytest.approx(alpha / (2 * Z * Z), rel=1e-9)


def test_audit_user_level_dp_gd_respects_the_charge() -> None:
    delta, _ = _delta()
    lower, normaliser = _audit(delta, 1)
    assert abs(normaliser - 1.0) < 0.01
    for alpha in ORDERS:
        assert lower[alpha] <= 1.0, (alpha, lower)


def test_audit_catches_row_clipping_charged_per_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp_gd, "clip_unit_sums", lambda sums, budget: sums)  # rows clipped, units not
    delta, unit = _delta()
    assert float(np.linalg.norm(delta)) * unit / C == pytest.approx(2.0, abs=1e-6)
    lower, _ = _audit(delta, 2)
    assert max(lower.values()) > 1.0, lower
