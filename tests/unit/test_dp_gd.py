"""Clipped Gaussian DP-GD (mechanisms/learners/dp_gd.py): curve, clipping bound, noise scale, convergence."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import optimize, stats

from mechanisms.accounting import DEFAULT_ORDERS, epsilon_at_delta
from mechanisms.learners.dp_gd import (
    DpGdConfig,
    Loss,
    Neighboring,
    clipped_gradient_sum,
    default_radius,
    dp_gd_curve,
    dp_gd_train,
    finiteness_problem,
    noise_multiplier_for,
    noise_std,
    objective,
    safe_row_norms,
)
from mechanisms.noise import Noise

FALSE_ALARM = 1e-3  # per KS test


def _data(n: int, d: int, seed: int, loss: Loss) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
    if loss == "logistic":
        y = np.where(x @ rng.normal(size=d) + 0.3 * rng.normal(size=n) > 0, 1.0, -1.0)
    else:
        y = np.clip(x @ rng.normal(size=d) * 0.5 + 0.1 * rng.normal(size=n), -1.0, 1.0)
    return x, y


def _per_example(theta: np.ndarray, x: np.ndarray, y: np.ndarray, loss: Loss) -> np.ndarray:
    """Independent per-example gradients as an (n, d) matrix."""
    m = x @ theta
    if loss == "logistic":
        return (-y / (1.0 + np.exp(y * m)))[:, None] * x
    return (m - y)[:, None] * x


# ----- the curve -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("neighboring", ["replace_one", "add_remove"])
def test_curve_is_steps_times_gaussian(neighboring: Neighboring) -> None:
    config = DpGdConfig("logistic", 0.01, 40, 0.5, 1.0, 3.0, neighboring)
    curve = dp_gd_curve(config, neighboring, DEFAULT_ORDERS)
    for alpha, value in zip(curve.orders, curve.values, strict=True):
        exact = 40 * alpha / (2 * 9.0)
        assert exact <= value <= exact * (1 + 1e-12)
    assert math.isinf(curve.pure)


def test_curve_mismatch_never_undercharges() -> None:
    # noise calibrated for add_remove (Δ = C) but charged under replace_one (Δ = 2C): 4× the matched value.
    config = DpGdConfig("squared", 0.0, 5, 0.1, 2.0, 1.5, "add_remove")
    mismatched = dp_gd_curve(config, "replace_one", (2.0,))
    assert mismatched.values[0] == pytest.approx(4 * 5 * 2.0 / (2 * 1.5**2), rel=1e-12)
    # replace_one noise charged under add_remove: a quarter (still a valid bound, noise is larger).
    config_r = DpGdConfig("squared", 0.0, 5, 0.1, 2.0, 1.5, "replace_one")
    assert dp_gd_curve(config_r, "add_remove", (2.0,)).values[0] == pytest.approx(5 * 2.0 / (2 * 1.5**2) / 4)
    assert noise_std(config) == 3.0
    assert noise_std(config_r) == 6.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss": "hinge"},
        {"steps": 0},
        {"steps": 2.5},
        {"step_size": 0.0},
        {"clip": -1.0},
        {"noise_multiplier": math.inf},
        {"reg": -0.1},
        {"neighboring": "swap"},
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {
        "loss": "logistic",
        "reg": 0.0,
        "steps": 3,
        "step_size": 0.1,
        "clip": 1.0,
        "noise_multiplier": 1.0,
    }
    with pytest.raises(ValueError, match="must be"):
        DpGdConfig(**{**base, **kwargs})


# ----- calibration ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("eps", "delta", "steps"), [(1.0, 1e-6, 100), (0.5, 1e-5, 10), (8.0, 1e-9, 1000)])
def test_noise_multiplier_for_meets_target_tightly(eps: float, delta: float, steps: int) -> None:
    z = noise_multiplier_for(eps, delta, steps, DEFAULT_ORDERS)
    config = DpGdConfig("logistic", 0.0, steps, 0.1, 1.0, z)
    reached = epsilon_at_delta(dp_gd_curve(config, "replace_one", DEFAULT_ORDERS), delta)
    assert reached <= eps
    # and it is the smallest such z on the grid, up to 1e-6
    smaller = DpGdConfig("logistic", 0.0, steps, 0.1, 1.0, z * (1 - 1e-6))
    assert epsilon_at_delta(dp_gd_curve(smaller, "replace_one", DEFAULT_ORDERS), delta) > eps


def test_noise_multiplier_for_infeasible() -> None:
    with pytest.raises(ValueError, match="no order"):
        noise_multiplier_for(0.01, 1e-6, 10, (1.25, 2.0))  # log(1e6)/(α−1) > ε at every order
    with pytest.raises(ValueError, match="delta"):
        noise_multiplier_for(1.0, 0.0, 10, DEFAULT_ORDERS)


# ----- clipping and the sensitivity ----------------------------------------------------------------------
@pytest.mark.parametrize("loss", ["logistic", "squared"])
def test_clipped_sum_matches_explicit_per_example_clipping(loss: Loss) -> None:
    x, y = _data(300, 6, 1, loss)
    theta = np.random.default_rng(2).normal(size=6) * 3
    grads = _per_example(theta, x, y, loss)
    norms = np.linalg.norm(grads, axis=1)
    clip = float(np.median(norms))
    explicit = (grads * np.minimum(1.0, clip / norms)[:, None]).sum(axis=0)
    # rows are quantised to 2^-14 relative, θ to ~2^-30, each term to C·2^-23: a small, bounded difference
    computed = clipped_gradient_sum(theta, x, y, loss, clip)
    np.testing.assert_allclose(computed, explicit, rtol=1e-3, atol=2e-3 * clip)
    # a clip above every norm leaves the sum unclipped
    big = float(norms.max()) * 2
    np.testing.assert_allclose(
        clipped_gradient_sum(theta, x, y, loss, big), grads.sum(axis=0), rtol=1e-3, atol=2e-3 * big
    )


@pytest.mark.parametrize("loss", ["logistic", "squared"])
def test_clipped_sum_sensitivity_on_adversarial_neighbours(loss: Loss) -> None:
    """‖S(D) − S(D')‖ ≤ 2C (replace one) and ≤ C (add/remove), with huge adversarial rows and labels."""
    rng = np.random.default_rng(3)
    clip = 0.7
    worst_replace, worst_add = 0.0, 0.0
    for trial in range(200):
        x, y = _data(50, 4, 100 + trial, loss)
        theta = rng.normal(size=4) * rng.choice([0.1, 10.0, 1e3])
        big = rng.normal(size=4) * rng.choice([1.0, 1e3])
        label = rng.choice([-1.0, 1.0]) * (1.0 if loss == "logistic" else rng.choice([1.0, 1e3]))
        x2, y2 = x.copy(), y.copy()
        x2[0], y2[0] = big, label
        s = clipped_gradient_sum(theta, x, y, loss, clip)
        worst_replace = max(
            worst_replace, float(np.linalg.norm(s - clipped_gradient_sum(theta, x2, y2, loss, clip)))
        )
        worst_add = max(
            worst_add, float(np.linalg.norm(s - clipped_gradient_sum(theta, x[1:], y[1:], loss, clip)))
        )
    assert worst_replace <= 2 * clip * (1 + 1e-12)
    assert worst_add <= clip * (1 + 1e-12)
    assert worst_replace > 1.5 * clip  # the search really is adversarial (the bound is nearly attained)


# ----- gradients and the objective -----------------------------------------------------------------------
@pytest.mark.parametrize("loss", ["logistic", "squared"])
def test_gradient_matches_finite_differences_of_objective(loss: Loss) -> None:
    x, y = _data(200, 5, 4, loss)
    theta = np.random.default_rng(5).normal(size=5)
    norms = np.linalg.norm(_per_example(theta, x, y, loss), axis=1)
    grad = clipped_gradient_sum(theta, x, y, loss, 2.0 * float(norms.max())) / 200 + 0.05 * theta
    numeric = optimize.approx_fprime(theta, lambda t: objective(t, x, y, loss, 0.05), 1e-7)
    np.testing.assert_allclose(grad, numeric, atol=2e-4)  # rows quantised to 2^-14 relative


def test_objective_values() -> None:
    x = np.array([[1.0, 0.0], [0.0, 1.0]])
    theta = np.array([2.0, -1.0])
    assert objective(theta, x, np.array([1.0, 1.0]), "squared", 0.5) == pytest.approx(
        0.5 * (0.5 * 1 + 0.5 * 4) + 0.25 * 5
    )
    assert objective(theta, x, np.array([1.0, 1.0]), "logistic", 0.0) == pytest.approx(
        0.5 * (math.log1p(math.exp(-2)) + math.log1p(math.exp(1)))
    )


# ----- convergence without noise -------------------------------------------------------------------------
def test_converges_to_ridge_solution_without_noise() -> None:
    x, y = _data(400, 5, 6, "squared")
    reg = 0.05
    a = x.T @ x / 400 + reg * np.eye(5)
    exact = np.linalg.solve(a, x.T @ y / 400)
    config = DpGdConfig("squared", reg, 500, 1.0 / float(np.linalg.eigvalsh(a).max()), 20.0, 1e-300)
    theta = dp_gd_train(config, x, y, 400, Noise.seeded(0))
    np.testing.assert_allclose(theta, exact, atol=1e-3)  # the noise is one unit ω ≈ 20·2^-38; rows quantised


def test_converges_to_logistic_optimum_without_noise() -> None:
    x, y = _data(400, 4, 7, "logistic")
    reg = 0.01
    best = optimize.minimize(
        lambda t: objective(t, x, y, "logistic", reg), np.zeros(4), method="BFGS", tol=1e-12
    )
    config = DpGdConfig("logistic", reg, 3000, 2.0, 20.0, 1e-300)
    theta = dp_gd_train(config, x, y, 400, Noise.seeded(0))
    assert objective(theta, x, y, "logistic", reg) - best.fun < 1e-6


def test_progress_called_each_step_and_iterates() -> None:
    x, y = _data(30, 3, 8, "logistic")
    seen: list[float] = []
    config = DpGdConfig("logistic", 0.1, 7, 0.5, 1.0, 2.0)
    path = dp_gd_train(config, x, y, 30, Noise.seeded(1), seen.append, return_iterates=True)
    assert path.shape == (7, 3)
    assert seen == pytest.approx([(t + 1) / 7 for t in range(7)])
    final = dp_gd_train(config, x, y, 30, Noise.seeded(1))
    np.testing.assert_array_equal(final, path[-1])  # same seed, same draws


# ----- the noise scale (distribution test) ---------------------------------------------------------------
@pytest.mark.statistical
@pytest.mark.parametrize("neighboring", ["replace_one", "add_remove"])
def test_noise_scale_ks(neighboring: Neighboring) -> None:
    """With all-zero features every clipped gradient is 0, so θ₁ = −τ·N(0, (zΔ)²I)/n exactly.

    KS test of θ₁·n/(τ·z·Δ) against N(0, 1) at false-alarm rate 1e-3 (fixed seed); power check: the same
    sample read with a 30% wrong scale is rejected.
    """
    d, n, tau, clip, z = 20000, 10, 0.3, 0.8, 1.7
    delta = 2 * clip if neighboring == "replace_one" else clip
    config = DpGdConfig("logistic", 0.5, 1, tau, clip, z, neighboring)
    theta = dp_gd_train(config, np.zeros((n, d)), np.ones(n), n, Noise.seeded(11))
    standardized = -theta * n / (tau * z * delta)
    assert stats.kstest(standardized, "norm").pvalue > FALSE_ALARM
    assert stats.kstest(standardized / 1.3, "norm").pvalue < FALSE_ALARM
    assert stats.kstest(standardized * 1.3, "norm").pvalue < FALSE_ALARM


# ----- floating point: every term a per-record function with exact norm ≤ C, for every θ -------------------
def _exact_norm_squared(vector: np.ndarray) -> Fraction:
    return sum((Fraction(float(v)) ** 2 for v in vector), Fraction(0))


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["logistic", "squared"])
def test_summed_vector_has_exact_norm_at_most_clip(loss: Loss) -> None:
    """The vector actually summed (c_i·x_i in floats), not only |s_i|·‖x_i‖, has exact
    norm ≤ C. One record per call, so the sum is that vector; exact rational arithmetic on its entries."""
    rng = np.random.default_rng(21)
    clipped = 0
    for _ in range(3000):
        d = int(rng.integers(1, 60))
        x = rng.normal(size=(1, d)) * 10 ** rng.uniform(-150, 150)
        y = rng.choice([-1.0, 1.0], 1)
        if loss == "squared":
            y = rng.normal(size=1) * 10 ** rng.uniform(-3, 200)
        theta = rng.normal(size=d) * 10 ** rng.uniform(-3, 150)
        clip = float(10 ** rng.uniform(-3, 3))
        term = clipped_gradient_sum(theta, x, y, loss, clip)
        assert np.all(np.isfinite(term))
        norm2 = _exact_norm_squared(term)
        assert norm2 <= Fraction(clip) ** 2
        clipped += norm2 > Fraction(clip) ** 2 * Fraction(999, 1000)
    assert clipped > 500  # the clipping branch is exercised


@pytest.mark.parametrize("loss", ["logistic", "squared"])
def test_clipped_sum_finite_and_bounded_for_every_theta_and_record(loss: Loss) -> None:
    """Huge, infinite and NaN public θ; huge, tiny, zero and non-finite rows; huge and non-finite labels:
    the sum is finite, and neighbours (replace-one / remove-one) differ by ≤ 2C / ≤ C."""
    rng = np.random.default_rng(22)
    clip = 0.9
    specials = [
        np.array([1.3e308, 1.3e308, 0.0]),
        np.array([1e308, -1e308, 1e308]),
        np.array([math.inf, 0.0, 1.0]),
        np.array([math.nan, 1.0, 1.0]),
        np.array([-math.inf, math.inf, 0.0]),
    ]
    rows = [
        lambda: rng.normal(size=3) * 10 ** rng.uniform(-200, 307),
        lambda: np.array([1e308, 1e308, 1e308]),  # norm above the float range
        lambda: np.array([1e-170, -1e-170, 0.0]),  # squares underflow
        lambda: np.zeros(3),
        lambda: np.array([math.inf, 0.0, 0.0]),
        lambda: np.array([math.nan, 1.0, 0.0]),
    ]
    labels = [1.0, -1.0, 1e308, -1e200, math.inf, math.nan]
    for trial in range(600):
        theta = rng.normal(size=3) * 10 ** rng.uniform(0, 308)
        if trial % 3:
            theta = specials[trial % len(specials)]
        n = int(rng.integers(2, 5))
        x = np.array([rows[int(rng.integers(len(rows)))]() for _ in range(n)])
        y = np.array([labels[int(rng.integers(len(labels)))] for _ in range(n)])
        if loss == "logistic":
            y = np.where(np.arange(n) % 2 == 0, 1.0, -1.0) if trial % 2 else y
        with np.errstate(all="ignore"):  # the test's own reference arithmetic
            s = clipped_gradient_sum(theta, x, y, loss, clip)
            x2, y2 = x.copy(), y.copy()
            x2[0], y2[0] = rows[int(rng.integers(len(rows)))](), labels[int(rng.integers(len(labels)))]
            s2 = clipped_gradient_sum(theta, x2, y2, loss, clip)
            s3 = clipped_gradient_sum(theta, x[1:], y[1:], loss, clip)
        for total in (s, s2, s3):
            assert np.all(np.isfinite(total))
        assert float(np.linalg.norm(s - s2)) <= 2 * clip * (1 + 1e-12)
        assert float(np.linalg.norm(s - s3)) <= clip * (1 + 1e-12)


def test_safe_row_norms() -> None:
    x = np.array([[3.0, 4.0], [1e300, 1e300], [1e-170, 1e-170], [0.0, 0.0], [1.5e308, 1.5e308]])
    norms = safe_row_norms(x)
    np.testing.assert_allclose(norms[:3], [5.0, 1e300 * 2**0.5, 1e-170 * 2**0.5], rtol=1e-15)
    assert norms[3] == 0.0
    assert math.isinf(norms[4])


# ----- projection onto the public ball ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("loss", ["logistic", "squared"])
def test_default_radius_contains_both_optima(loss: Loss) -> None:
    """r ≥ ‖θ*‖ (unclipped optimum) and r ≥ ‖θ_c‖ (fixed point of clipped GD, n_norm = n) on extreme data:
    rows at full norm along e₁, labels pushing the same way, C large and small."""
    assert default_radius(loss, 0.0, 1.0, 1.0) is None
    for reg in (0.01, 0.3, 4.0):
        for clip in (0.05, 1.0, 100.0):
            radius = default_radius(loss, reg, 1.0, clip)
            assert radius is not None
            n = 20
            x = np.zeros((n, 2))
            x[:, 0] = 1.0
            y = np.ones(n)
            tau = 1.0 / (1.0 + reg)
            for c in (clip, 1e9):  # clipped fixed point, then the unclipped optimum
                config = DpGdConfig(loss, reg, 4000, tau, c, 1e-300)
                theta = dp_gd_train(config, x, y, n, Noise.seeded(0))
                assert float(np.linalg.norm(theta)) <= radius


def test_projected_training_stays_in_the_ball_and_checks_finiteness() -> None:
    x, y = _data(50, 3, 9, "squared")
    config = DpGdConfig("squared", 0.1, 40, 1e6, 1.0, 0.5, radius=2.0)  # step size that diverges unprojected
    path = dp_gd_train(config, x, y, 50, Noise.seeded(0), return_iterates=True)
    assert np.all(np.isfinite(path))
    assert np.max(np.linalg.norm(path, axis=1)) <= 2.0 * (1 + 1e-12)
    assert finiteness_problem(config, 3, 50.0) is None
    assert finiteness_problem(DpGdConfig("squared", 0.1, 4, 1.0, 1.0, 1.0), 3, 50.0) is None  # no radius
    huge = DpGdConfig("squared", 0.1, 4, 1.0, 1.0, 1.0, radius=1e151)
    assert finiteness_problem(huge, 3, 50.0) == (
        "regularization",
        "the iterate ball radius 1e+151 is too large for finite floating point: raise regularization or give "
        "a smaller max_norm",
    )
    with pytest.raises(ValueError, match="too large"):
        dp_gd_train(huge, x, y, 50, Noise.seeded(0))
    steep = DpGdConfig("squared", 0.1, 4, 1e300, 1.0, 1.0, radius=1.0)
    assert finiteness_problem(steep, 3, 50.0) is not None
    assert finiteness_problem(steep, 3, 50.0)[0] == "step_size"  # type: ignore[index]
    with pytest.raises(ValueError, match="radius"):
        DpGdConfig("squared", 0.1, 4, 1.0, 1.0, 1.0, radius=0.0)


# ----- the exact grid construction (docs/privacy/finite_precision_learners.md#theorem-dpgd-grid) -----------
@pytest.mark.parametrize("std", [1, 3, 50])
def test_discrete_gaussian_std_pmf_chi_square(std: int) -> None:
    """Chi-square of ``discrete_gaussian_std`` against the exact pmf (fixed seed, false alarm 1e-3) and a
    power check: the same sample against the pmf of a 5 % larger standard deviation is rejected."""
    from mechanisms.noise.learners import discrete_gaussian_pmf, discrete_gaussian_std

    size = 200_000
    draws = discrete_gaussian_std(Noise.seeded(std), std, size)
    edges = np.arange(-4 * std, 4 * std + 1)
    groups = max(1, std // 5)

    def pvalue(scale: float) -> float:
        mass = discrete_gaussian_pmf(std, edges) if scale == 1.0 else _scaled_pmf(std * scale, edges)
        observed = np.array([np.sum(draws == e) for e in edges], dtype=float)
        m = len(edges) // groups * groups
        obs = np.append(observed[:m].reshape(-1, groups).sum(1), size - observed[:m].sum())
        exp = np.append((mass[:m] * size).reshape(-1, groups).sum(1), size * (1 - mass[:m].sum()))
        keep = exp > 5
        chi = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
        return float(stats.chi2.sf(chi, int(keep.sum()) - 1))

    assert pvalue(1.0) > FALSE_ALARM
    assert pvalue(1.05 if std > 1 else 1.3) < FALSE_ALARM


def _scaled_pmf(scale: float, support: np.ndarray) -> np.ndarray:
    grid = np.arange(-int(60 * scale) - 1, int(60 * scale) + 2, dtype=float)
    total = np.exp(-(grid**2) / (2 * scale * scale)).sum()
    result: np.ndarray = np.exp(-(support.astype(float) ** 2) / (2 * scale * scale)) / total
    return result


@pytest.mark.parametrize("loss", ["logistic", "squared"])
def test_clipped_sum_units_are_exact_position_free_and_within_the_sensitivity(loss: Loss) -> None:
    """The integer sum does not depend on the order of the records (every per-record term is computed from
    its own record only, and integer sums are exact), and neighbours differ by < Δ/ω exactly."""
    from mechanisms.learners.dp_gd import clipped_sum_units, grid_records

    x, y = _data(3001, 7, 31, loss)
    rng = np.random.default_rng(32)
    clip = 0.3
    for _ in range(20):
        theta = rng.normal(size=7) * rng.choice([0.1, 3.0, 100.0])
        base = grid_records(x, y, clip)
        units = clipped_sum_units(theta, base, loss)
        perm = rng.permutation(x.shape[0])
        assert np.array_equal(units, clipped_sum_units(theta, grid_records(x[perm], y[perm], clip), loss))
        shifted = clipped_sum_units(theta, grid_records(x[5:], y[5:], clip), loss)
        firsts = clipped_sum_units(theta, grid_records(x[:5], y[:5], clip), loss)
        assert np.array_equal(units, shifted + firsts)
        x2, y2 = x.copy(), y.copy()
        x2[17] = rng.normal(size=7) * 50
        y2[17] = -y2[17] * 7
        other = clipped_sum_units(theta, grid_records(x2, y2, clip), loss)
        exact = sum(int(v) ** 2 for v in (units - other))  # exact integer norm²
        assert exact * base.unit**2 < (2 * clip) ** 2
        removed = clipped_sum_units(theta, grid_records(x[1:], y[1:], clip), loss)
        assert sum(int(v) ** 2 for v in (units - removed)) * base.unit**2 < clip**2


def test_every_noisy_sum_is_a_multiple_of_the_published_granularity() -> None:
    """Exact support: with zero features the noisy sums are ω·Z; the iterates recover them exactly."""
    from mechanisms.learners.dp_gd import released_noise_std, term_unit

    d, n, tau, clip, z = 50, 10, 0.25, 0.7, 1.3
    config = DpGdConfig("logistic", 0.0, 3, tau, clip, z)
    path = dp_gd_train(config, np.zeros((n, d)), np.ones(n), n, Noise.seeded(4), return_iterates=True)
    unit = term_unit(clip, z)
    steps = np.diff(np.vstack([np.zeros(d), path]), axis=0)
    sums = -steps * n / tau  # exact: τ = 1/4 and n = 10 keep these exact enough to round-trip
    units = sums / unit
    np.testing.assert_allclose(units, np.rint(units), atol=1e-6)
    assert released_noise_std(config) >= z * 2 * clip
    assert released_noise_std(config) <= z * 2 * clip + unit


def test_grid_charge_is_the_old_charge_and_bounds_the_noise() -> None:
    """The charge T·α·Δ²/(2(zΔ)²) is unchanged and the noise actually added has std t·ω ≥ zΔ."""
    from mechanisms.learners.dp_gd import released_noise_std

    config = DpGdConfig("logistic", 0.1, 10, 0.5, 1.0, 1.1)
    curve = dp_gd_curve(config, "replace_one", DEFAULT_ORDERS)
    for alpha, value in zip(curve.orders, curve.values, strict=True):
        assert value >= 10 * alpha * 4.0 / (2 * released_noise_std(config) ** 2)
        assert value == pytest.approx(10 * alpha / (2 * 1.1**2), rel=1e-12)
