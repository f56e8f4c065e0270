"""Per-instance DP of ridge regression and AdaOPS (note seed_002 §6.2 test vectors, §6.3 invariants)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy import stats

from mechanisms.per_instance import adaops as A
from mechanisms.per_instance import ridge as R

DELTA = 1e-6
REL = 1e-6

X1 = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8], [0.8, -0.6]])
Y1 = np.array([0.5, -0.2, 0.3, 0.9])
X2 = np.tile(X1, (25, 1))
Y2 = np.tile(Y1, 25)


def close(actual: object, expected: object, rel: float = REL, printed: float = 5e-7) -> None:
    """|actual − expected| ≤ rel·|expected| + ``printed`` (the note prints 6 decimals: half a unit of the
    last digit is the table's own rounding)."""
    np.testing.assert_allclose(
        np.asarray(actual, dtype=float), np.asarray(expected, dtype=float), rtol=rel, atol=printed
    )


def paper_4_3(gamma: float, mu: np.ndarray, r: np.ndarray, delta: float) -> np.ndarray:
    """The paper's (4.3), which is NOT a valid bound (kept only to show that it is not what we compute)."""
    ld = math.log(2.0 / delta)
    return np.asarray(
        0.5 * np.abs(-np.log1p(mu) + gamma * mu * r * r / (1.0 + mu))
        + mu / 2.0 * ld
        + np.sqrt(gamma * mu * ld) * np.abs(r)
    )


# ----- §6.2 TV1 ----------------------------------------------------------------------------------------


def test_tv1_closed_form() -> None:
    fit = R.ridge_fit(X1, Y1, 1.0)
    close(fit.theta, [7 / 15, -1 / 6])
    close(fit.leverage, [1 / 3] * 4)
    close(fit.mu, [0.5] * 4)
    close(fit.fitted_residual, [1 / 30, -1 / 30, 0.153333333333, 0.426666666667])
    close(fit.loo_residual, [0.05, -0.05, 0.23, 0.64])
    close(fit.loo_thetas(X1), [[0.45, -1 / 6], [7 / 15, -0.15], [0.420667, -0.228], [0.296, -0.0386666667]])
    close(R.isotropic_sensitivity(fit, X1), [1 / 60, 1 / 60, 23 / 300, 16 / 75])
    fisher = fit.loo_residual * np.sqrt(fit.leverage)  # Δ with A = H_full: |r_i|·sqrt(h_i)
    close(np.abs(fisher), [0.028868, 0.028868, 0.132791, 0.369504], rel=2e-5)
    h = fit.r_factor.T @ fit.r_factor
    shift = fit.solve(X1.T)
    fisher_direct = np.abs(fit.loo_residual) * np.sqrt(np.einsum("ji,jk,ki->i", shift, h, shift))
    close(fisher_direct, np.abs(fisher))


def test_tv1_gaussian_output_perturbation() -> None:
    close(R.output_perturbation_pdp(X1, Y1, 1.0, 1.0, DELTA), [0.058348, 0.058348, 0.298744, 0.894081])
    close(R.output_perturbation_pdp(X1, Y1, 1.0, 0.01, DELTA), [0.685782, 0.685782, 3.620460, 11.892601])
    close(R.output_perturbation_pdp(X1, Y1, 1.0, 16.0, DELTA)[[0, 3]], [0.013047, 0.202723])
    fit = R.ridge_fit(X1, Y1, 1.0)
    eta = R.output_perturbation_eta(fit, X1, 1.0)
    classical = R.classical_gaussian_epsilon(eta, DELTA)
    close(classical[:3], [0.088313, 0.088313, 0.406242])
    assert math.isinf(classical[3])  # 1.130411 > 1: invalid, never returned as a bound (pitfall 2)
    assert math.isinf(float(R.classical_gaussian_epsilon(2.1333, DELTA)))
    close(R.agm_epsilon(2.1333 / 1.0, DELTA), 11.8926, rel=2e-5)
    # a full (non-isotropic) fixed covariance gives the Mahalanobis η
    cov = np.array([[2.0, 0.3], [0.3, 0.5]])
    direct = [float(np.sqrt(d @ np.linalg.solve(cov, d))) for d in fit.theta[None, :] - fit.loo_thetas(X1)]
    close(R.output_perturbation_eta(fit, X1, cov), direct, rel=1e-10)


OPS_TV1 = {
    1.0: ([5.266209, 5.266209, 5.690412, 7.086711], [7.296751, 7.296751, 7.974197, 9.557585]),
    10.0: ([5.480320, 5.480320, 7.395365, 12.288542], [7.702351, 7.702351, 9.902061, 15.315676]),
    100.0: ([6.597593, 6.597593, 13.405284, 33.027028], [9.010616, 9.010616, 16.541076, 37.725457]),
}
PAPER_TV1 = {1.0: [3.964150, 3.964150, 4.440559, 5.485397], 10.0: [4.251592, 4.251592, 5.700694, 9.558129]}


@pytest.mark.parametrize("gamma", [1.0, 10.0, 100.0])
def test_tv1_ops(gamma: float) -> None:
    exact, bound = OPS_TV1[gamma]
    close(R.ops_record_epsilons(X1, Y1, 1.0, gamma, DELTA), exact)
    fit = R.ridge_fit(X1, Y1, 1.0)
    close(R.ops_bound(gamma, fit.mu, fit.loo_residual, DELTA), bound)
    if gamma in PAPER_TV1:
        close(paper_4_3(gamma, fit.mu, fit.loo_residual, DELTA), PAPER_TV1[gamma])


def test_tv1_ops_profile_and_divergences() -> None:
    mu, r = np.full(6, 0.5), np.full(6, 0.64)
    eps = np.array([0.0, 0.25, 0.5, 1.0, 2.0, 3.0])
    close(
        R.ops_delta_forward(1.0, mu, r, eps),
        [0.155745716, 0.103064293, 0.068591333, 0.030440063, 0.005901785, 0.001114330],
    )
    back = R.ops_delta_backward(1.0, mu, r, eps)
    close(back[:2], [0.155745716, 0.024900466])
    assert np.all(back[2:] == 0.0)
    close(-R.ops_constant(1.0, np.array([0.5]), np.array([0.64])), [0.339266], rel=2e-6)
    kl_f, kl_b = R.ops_kl(1.0, np.array([0.5]), np.array([0.64]))
    close([kl_f[0], kl_b[0]], [0.115534, 0.081577], rel=5e-6)
    for alpha, fwd, bwd in [(1.5, 0.221483, 0.107096), (2.0, 0.416908, 0.127158), (2.9, 4.545085, 0.154427)]:
        f, b = R.ops_renyi(1.0, np.array([0.5]), np.array([0.64]), alpha)
        close([f[0], b[0]], [fwd, bwd], rel=5e-6)
    f3, b3 = R.ops_renyi(1.0, np.array([0.5]), np.array([0.64]), 3.0)
    assert math.isinf(f3[0])
    assert math.isfinite(b3[0])


def test_tv1_outsider() -> None:
    fit = R.ridge_fit(X1, Y1, 1.0)
    mu, r = R.outsider_terms(fit, np.array([[0.6, -0.8]]), np.array([-1.0]))
    close(mu, [1 / 3])
    close(r, [-1.413333333333])
    close(np.abs(r) * np.linalg.norm(fit.solve(np.array([0.6, -0.8]))) / (1 + mu), [0.353333])
    close(R.ops_epsilon(1.0, mu, r, DELTA), [7.205852])
    close(R.ops_epsilon(10.0, mu, r, DELTA), [17.722049])
    close(R.ops_bound(1.0, mu, r, DELTA), [9.287961])
    close(R.ops_bound(10.0, mu, r, DELTA), [20.809733])
    for gamma, back in [(1.0, 0.892567), (10.0, 6.899908)]:
        fwd_at = R.ops_delta_backward(gamma, mu, r, np.array([back * (1 - 1e-5)]))
        assert fwd_at[0] > DELTA  # the backward root is at `back`
        assert R.ops_delta_backward(gamma, mu, r, np.array([back * (1 + 1e-5)]))[0] <= DELTA


def test_tv1_pdp_for_all_vs_dp() -> None:
    fit = R.ridge_fit(X1, Y1, 1.0)
    heuristic, certified = R.pdp_for_all_sensitivity(fit, X1)
    close([heuristic, certified], [0.373884, 0.373884])
    lo, hi = R.dp_sensitivity_range(4, 1.0)
    close([lo, hi], [2 / 3, 1.0])
    for sigma, e_add, e_all, dp_lo, dp_hi in [
        (1.0, 1.542586, 1.640419, 3.097640, 4.886554),
        (4.0, 0.347569, 0.369220, 0.685782, 1.060702),
        (0.1, 22.406407, 24.118810, 53.158514, 96.717272),
    ]:
        close(R.agm_epsilon(0.353333333333 / sigma, DELTA), e_add)
        close(R.agm_epsilon(certified / sigma, DELTA), e_all)
        close(R.agm_epsilon(np.array([lo, hi]) / sigma, DELTA), [dp_lo, dp_hi])


# ----- TV2, scalar OPS, AGM table, singular edge ----------------------------------------------------------


def test_tv2() -> None:
    fit = R.ridge_fit(X2, Y2, 1.0)
    close(fit.theta, [35 / 51, -12.5 / 51])
    close(fit.leverage[:4], [1 / 51] * 4)
    close(fit.loo_residual[:4], [-0.19, 0.046, 0.086, 0.208])
    close(R.isotropic_sensitivity(fit, X2)[:4], [0.003725, 0.000902, 0.001686, 0.004078], rel=2e-4)
    close(R.output_perturbation_pdp(X2, Y2, 1.0, 1e-4, DELTA)[:4], [1.634045, 0.355409, 0.694443, 1.803450])
    for gamma, exact, paper in [
        (1.0, [0.251537, 0.167841, 0.190308, 0.262211], [0.256983, 0.179746, 0.201242, 0.266609]),
        (10.0, [0.499379, 0.225212, 0.300285, 0.534345], [0.475104, 0.233139, 0.300759, 0.505063]),
        (100.0, [1.327228, 0.413486, 0.659670, 1.446247], [1.194064, 0.400705, 0.610999, 1.298050]),
    ]:
        got = R.ops_epsilon(gamma, fit.mu[:4], fit.loo_residual[:4], DELTA)
        close(got, exact)
        pap = paper_4_3(gamma, fit.mu[:4], fit.loo_residual[:4], DELTA)
        close(pap, paper)
        if gamma == 100.0:
            assert np.all(pap < got)  # (4.3) under-reports: it must not be used as a bound
    close(R.ops_bound(1.0, fit.mu[:4], fit.loo_residual[:4], DELTA), [0.427808, 0.320428, 0.350215, 0.441260])
    kl_f, kl_b = R.ops_kl(10.0, fit.mu[3:4], fit.loo_residual[3:4])
    close([kl_f[0], kl_b[0]], [0.004340, 0.004256], rel=2e-4)


@pytest.mark.parametrize(
    ("gamma", "mu", "r", "exact", "paper", "bound"),
    [
        (1000.0, 0.01, 1.0, 19.479100, 17.063252, 21.716207),
        (100.0, 0.01, 1.0, 4.980936, 4.371641, 5.894702),
        (10.0, 0.01, 0.5, 0.734053, 0.682204, 0.986636),
        (1.0, 0.001, 1.0, 0.123079, 0.127706, 0.181041),
        (1e4, 1e-4, 1.0, 4.887496, 4.309649, 5.757903),
        (50.0, 0.02, 0.3, 1.473703, 1.322010, 1.907286),
    ],
)
def test_scalar_ops(gamma: float, mu: float, r: float, exact: float, paper: float, bound: float) -> None:
    close(R.ops_epsilon(gamma, mu, r, DELTA), exact)
    close(paper_4_3(gamma, np.array(mu), np.array(r), DELTA), paper)
    close(R.ops_bound(gamma, mu, r, DELTA), bound)


def test_ops_zero_residual() -> None:
    close(R.ops_epsilon(1.0, np.array([0.5, 0.02, 0.001]), 0.0, DELTA), [5.238682, 0.153288, 0.004850])
    close(R.ops_epsilon(100.0, np.array([0.5, 0.02]), 0.0, DELTA), [5.238682, 0.153288])  # independent of γ


def test_agm_table() -> None:
    etas = np.array([0.1, 0.5, 1.0, 2.0, 4.0])
    close(R.agm_epsilon(etas, 1e-6), [0.396857, 2.254085, 4.886554, 10.997151, 26.356964])
    close(R.agm_epsilon(etas, 1e-5), [0.340669, 1.993091, 4.377178, 9.997256, 24.381611])
    classical = etas * math.sqrt(2 * math.log(1.25 / 1e-6))
    close(classical, [0.529880, 2.649401, 5.298803, 10.597605, 21.195210])
    assert np.all(classical[3:] < R.agm_epsilon(etas[3:], 1e-6))
    assert float(R.agm_epsilon(0.0, DELTA)) == 0.0
    assert math.isinf(float(R.agm_epsilon(math.inf, DELTA)))


def test_singular_edge_case() -> None:
    xs = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    fit = R.ridge_fit(xs, np.array([0.3, 0.1, -0.2]), 0.0)
    close(fit.leverage, [1.0, 0.5, 0.5])
    assert math.isinf(fit.mu[0])
    close(fit.mu[1:], [1.0, 1.0])
    eps = R.ops_epsilon(1.0, fit.mu, fit.loo_residual, DELTA)
    assert math.isinf(eps[0])
    assert np.all(np.isfinite(eps[1:]))
    assert not np.any(np.isnan(eps))
    gauss = R.agm_epsilon(R.output_perturbation_eta(fit, xs, 1.0), DELTA)
    assert math.isinf(gauss[0])
    assert not np.any(np.isnan(gauss))
    with pytest.raises(ValueError, match="singular"):
        R.ridge_fit(np.array([[1.0, 0.0], [2.0, 0.0]]), np.zeros(2), 0.0)


# ----- §6.3 invariants ---------------------------------------------------------------------------------


def random_data(seed: int, n: int = 40, d: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    y = np.clip(x @ rng.normal(size=d) + 0.1 * rng.normal(size=n), -1, 1)
    return x, y


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loo_identities(seed: int) -> None:
    x, y = random_data(seed)
    lam = 0.7
    fit = R.ridge_fit(x, y, lam)
    h = x.T @ x + lam * np.eye(x.shape[1])
    brute = np.array(
        [np.linalg.solve(h - np.outer(xi, xi), x.T @ y - xi * yi) for xi, yi in zip(x, y, strict=True)]
    )
    close(fit.loo_thetas(x), brute, rel=1e-9)
    close(fit.loo_residual, y - np.einsum("ij,ij->i", x, brute), rel=1e-9)
    close(fit.mu, [xi @ np.linalg.solve(h - np.outer(xi, xi), xi) for xi in x], rel=1e-9)
    dets = [np.linalg.det(h - np.outer(xi, xi)) for xi in x]
    close(dets, (1 - fit.leverage) * np.linalg.det(h), rel=1e-9)
    sv = np.linalg.svd(x, compute_uv=False)
    close(fit.leverage.sum(), np.sum(sv**2 / (sv**2 + lam)), rel=1e-12)
    # θ̂ − θ̂_{-i} = H_{-i}⁻¹x_i e_i
    alt = np.array(
        [
            np.linalg.solve(h - np.outer(xi, xi), xi) * ei
            for xi, ei in zip(x, fit.fitted_residual, strict=True)
        ]
    )
    close(fit.theta[None, :] - brute, alt, rel=1e-8)


def test_sufficiency_and_kl_by_monte_carlo() -> None:
    rng = np.random.default_rng(7)
    x, y = random_data(3, n=12, d=3)
    lam, gamma = 1.0, 3.0
    small = R.ridge_fit(x[1:], y[1:], lam)
    big = R.ridge_fit(x, y, lam)
    mu, r = R.outsider_terms(small, x[:1], y[:1])
    h_s = x[1:].T @ x[1:] + lam * np.eye(3)
    h_b = h_s + np.outer(x[0], x[0])
    draws = rng.multivariate_normal(small.theta, np.linalg.inv(h_s) / gamma, size=200_000)
    log_s = stats.multivariate_normal(small.theta, np.linalg.inv(h_s) / gamma).logpdf(draws)
    log_b = stats.multivariate_normal(big.theta, np.linalg.inv(h_b) / gamma).logpdf(draws)
    formula = R.ops_loss(gamma, mu, r, y[0] - draws @ x[0])
    close(log_s - log_b, formula, rel=1e-7)
    kl_f, kl_b = R.ops_kl(gamma, mu, r)
    sem = float(np.std(formula) / math.sqrt(formula.size))
    assert abs(float(np.mean(formula)) - kl_f[0]) < 5 * sem
    draws_b = rng.multivariate_normal(big.theta, np.linalg.inv(h_b) / gamma, size=200_000)
    loss_b = R.ops_loss(gamma, mu, r, y[0] - draws_b @ x[0])
    assert abs(float(np.mean(-loss_b)) - kl_b[0]) < 5 * float(np.std(loss_b) / math.sqrt(loss_b.size))


def test_validity_ordering_and_profile_shape() -> None:
    rng = np.random.default_rng(11)
    mu = 10 ** rng.uniform(-4, 0.3, size=300)
    r = rng.uniform(-5, 5, size=300)
    for gamma in (0.1, 1.0, 30.0):
        exact = R.ops_epsilon(gamma, mu, r, DELTA)
        assert np.all(exact <= R.ops_bound(gamma, mu, r, DELTA) * (1 + 1e-9))
        grid = np.linspace(0.0, 5.0, 40)
        fwd = np.array([R.ops_delta_forward(gamma, mu[:20], r[:20], np.full(20, e)) for e in grid])
        bwd = np.array([R.ops_delta_backward(gamma, mu[:20], r[:20], np.full(20, e)) for e in grid])
        assert np.all(np.diff(fwd, axis=0) <= 1e-15)
        assert np.all(np.diff(bwd, axis=0) <= 1e-15)
        close(fwd[0], bwd[0], rel=1e-7)  # δ→(0) = δ←(0) = TV
        neg_c = -R.ops_constant(gamma, mu[:20], r[:20])
        assert np.all(R.ops_delta_backward(gamma, mu[:20], r[:20], neg_c) == 0.0)


def test_exact_profile_against_monte_carlo_hockey_stick() -> None:
    rng = np.random.default_rng(5)
    mu, r, gamma, eps = 0.5, 0.64, 1.0, 1.0
    s = rng.normal(r, math.sqrt(mu / gamma), size=2_000_000)
    loss = R.ops_loss(gamma, np.array(mu), np.array(r), s)
    est = np.mean(np.maximum(0.0, 1.0 - np.exp(eps - loss)))
    se = np.std(np.maximum(0.0, 1.0 - np.exp(eps - loss))) / math.sqrt(s.size)
    exact = float(R.ops_delta_forward(gamma, np.array([mu]), np.array([r]), np.array([eps]))[0])
    assert abs(est - exact) < 5 * se


def test_monotonicity() -> None:
    mus = np.geomspace(1e-4, 2.0, 25)
    rs = np.linspace(0.0, 5.0, 25)
    for gamma in (0.5, 5.0):
        by_mu = R.ops_epsilon(gamma, mus, 0.7, DELTA)
        by_r = R.ops_epsilon(gamma, np.full(25, 0.05), rs, DELTA)
        assert np.all(np.diff(by_mu) >= -1e-9)
        assert np.all(np.diff(by_r) >= -1e-9)
    by_g = [float(R.ops_epsilon(g, 0.05, 0.7, DELTA)) for g in np.geomspace(0.01, 100, 20)]
    assert np.all(np.diff(by_g) >= -1e-9)
    assert np.all(np.diff(R.agm_epsilon(np.linspace(0.01, 5, 50), DELTA)) > 0)


def test_rotation_and_permutation_invariance() -> None:
    x, y = random_data(4)
    q, _ = np.linalg.qr(np.random.default_rng(9).normal(size=(4, 4)))
    a, b = R.ridge_fit(x, y, 0.5), R.ridge_fit(x @ q, y, 0.5)
    close(a.leverage, b.leverage, rel=1e-10)
    close(a.loo_residual, b.loo_residual, rel=1e-9)
    close(R.isotropic_sensitivity(a, x), R.isotropic_sensitivity(b, x @ q), rel=1e-9)
    close(
        R.ops_epsilon(2.0, a.mu, a.loo_residual, DELTA),
        R.ops_epsilon(2.0, b.mu, b.loo_residual, DELTA),
        rel=1e-8,
    )
    perm = np.random.default_rng(1).permutation(x.shape[0])
    e = R.ops_record_epsilons(x, y, 0.5, 2.0, DELTA)
    close(R.ops_record_epsilons(x[perm], y[perm], 0.5, 2.0, DELTA), e[perm], rel=1e-9)
    # r = 0 ⇒ fixed-covariance Gaussian ε = 0
    assert float(R.agm_epsilon(0.0 * 3.0, DELTA)) == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_dominance_members_all_dp(seed: int) -> None:
    x, y = random_data(seed, n=30, d=3)
    fit = R.ridge_fit(x, y, 1.0)
    members = R.isotropic_sensitivity(fit, x)
    heuristic, certified = R.pdp_for_all_sensitivity(fit, x)
    lo, hi = R.dp_sensitivity_range(30, 1.0)
    assert members.max() <= heuristic <= certified * (1 + 1e-12) <= hi
    # the worst-case construction attains the lower end of the DP sensitivity
    n, lam = 30, 1.0
    xw = np.zeros((n, 3))
    xw[:, 0] = math.sqrt(lam / n)
    base = R.ridge_fit(xw, np.ones(n), lam)
    mu, r = R.outsider_terms(base, np.array([[1.0, 0.0, 0.0]]), np.array([-1.0]))
    delta_theta = np.abs(r) * np.linalg.norm(base.solve(np.array([1.0, 0.0, 0.0]))) / (1 + mu)
    close(delta_theta, [lo], rel=1e-9)


def test_ops_sampler_covariance_and_energy() -> None:
    rng = np.random.default_rng(2)
    x, y = random_data(6, n=30, d=3)
    lam, gamma = 1.0, 4.0
    fit = R.ridge_fit(x, y, lam)
    h = x.T @ x + lam * np.eye(3)
    xi = rng.normal(size=(200_000, 3))
    draws = fit.theta + np.linalg.solve(fit.r_factor, xi.T).T / math.sqrt(gamma)  # L⁻ᵀξ/√γ with H = RᵀR
    close(np.cov(draws.T), np.linalg.inv(h) / gamma, rel=0.03)
    diff = draws - fit.theta
    energy = 0.5 * np.einsum("ij,jk,ik->i", diff, h, diff)
    assert abs(energy.mean() - 3 / (2 * gamma)) < 5 * energy.std() / math.sqrt(energy.size)


# ----- AdaOPS calibration (§3.5, §6.3 item 9) -------------------------------------------------------------


def test_adaops_reference_values() -> None:
    close(R.agm_sigma(1.0, 0.5, 1e-6 / 3), 8.5149, rel=2e-5)
    close(R.agm_sigma(1.0, 0.25, 1e-6 / 3), 16.3534, rel=2e-5)
    close(A.solve_gamma(5e-4, 11.0, 0.5, 1e-6 / 3), 0.13213, rel=5e-5)
    close(A.solve_gamma(2e-4, 21.0, 0.25, 1e-6 / 3), 0.022984, rel=5e-5)
    close(R.ops_epsilon(0.13213, 5e-4, 11.0, 1e-6 / 3), 0.3787, rel=1e-4)
    close(R.ops_epsilon(0.022984, 2e-4, 21.0, 1e-6 / 3), 0.1823, rel=5e-4)  # printed to 4 digits
    m = 1 + 8.5149 * float(stats.norm.isf(1e-6 / 3))
    close(m, 43.326, rel=5e-5)


def test_adaops_paper_calibration_fails() -> None:
    paper_sigma = 2 * math.sqrt(math.log(4 / 1e-6)) / 1.0
    assert float(R.agm_epsilon(1.0 / paper_sigma, 5e-7)) > 0.5  # 0.5377: the paper's σ_λ misses ε₁
    close(float(R.agm_epsilon(1.0 / paper_sigma, 5e-7)), 0.5377, rel=2e-4)
    paper_margin = 2 * math.log(4 / 1e-6)
    tail = float(stats.norm.sf(paper_margin / paper_sigma))
    assert tail > 1e-5 > 5e-7  # ≈ 4.8e-5 ≫ δ/2


def _dg_brute_delta(t: int, shift: int, epsilon: float) -> float:
    """Brute-force hockey-stick of N_Z(0, t²) vs N_Z(shift, t²), both orders: the pmf summed term by term
    over ±60t (independent of ``A.discrete_gaussian_delta``'s tail bounds)."""
    k = np.arange(-60 * t, 60 * t + 1 + shift, dtype=np.float64)
    lw = -(k * k) / (2.0 * t * t)
    lp = lw - float(np.log(np.sum(np.exp(lw - lw.max())))) - lw.max()
    lq = -((k - shift) ** 2) / (2.0 * t * t) - (float(np.log(np.sum(np.exp(lw - lw.max())))) + lw.max())
    p, q = np.exp(lp), np.exp(lq)
    return float(
        max(
            np.sum(np.clip(p - math.exp(epsilon) * q, 0, None)),
            np.sum(np.clip(q - math.exp(epsilon) * p, 0, None)),
        )
    )


@pytest.mark.parametrize(
    ("shift", "epsilon", "delta"), [(A.LAMBDA_SHIFT, 0.5, 1e-6 / 3), (1, 0.2, 2e-7), (1, 1.5, 1e-9)]
)
def test_discrete_gaussian_calibration(shift: int, epsilon: float, delta: float) -> None:
    t = A.discrete_gaussian_std_for(shift, epsilon, delta)
    brute = _dg_brute_delta(t, shift, epsilon)
    assert brute <= delta  # the released noise meets (ε, δ) by a term-by-term pmf sum
    assert A.discrete_gaussian_delta(t, shift, epsilon) >= brute * (
        1 - 1e-9
    )  # the code's value is an upper bound
    assert (
        _dg_brute_delta(math.floor(t / 1.01), shift, epsilon) > delta
    )  # and t is within 1 % of the smallest
    k = A.discrete_gaussian_quantile(t, delta)
    j = np.arange(-60 * t, 60 * t + 1, dtype=np.float64)
    w = np.exp(-(j * j) / (2.0 * t * t))
    assert float(w[j > k].sum() / w.sum()) <= delta < float(w[j > k - 1].sum() / w.sum())


def test_discrete_gaussian_calibration_reference_and_paper_sigma() -> None:
    t = A.discrete_gaussian_std_for(A.LAMBDA_SHIFT, 0.5, 1e-6 / 3)
    close(t / A.LAMBDA_SHIFT, 8.5149, rel=2e-3)
    k = A.discrete_gaussian_quantile(t, 1e-6 / 3)
    close(k / t, float(stats.norm.isf(1e-6 / 3)), rel=1e-3)
    # the paper's σ_λ = 2√log(4/δ) = 7.80 (in units of the sensitivity) misses (0.5, δ/3): caught
    paper_t = round(2 * math.sqrt(math.log(4 / 1e-6)) * A.LAMBDA_SHIFT)
    assert _dg_brute_delta(paper_t, A.LAMBDA_SHIFT, 0.5) > 1e-6 / 3


# ----- the good event (the reviewer's construction: the worst pair is reached) -------------------------


def _edge_dataset(n_small: int, d: int, lam_min: float) -> tuple[np.ndarray, np.ndarray]:
    """S: n_small rows (divisible by 4), e₂ an eigenvector of SᵀS with eigenvalue ``lam_min`` (the smallest),
    y = +1 (θ̂_S as large as possible along e₂)."""
    v = math.sqrt(lam_min / n_small)
    rest = math.sqrt((1 - v * v) / (d - 1))
    signs = np.array([[a, b] for a in (1, -1) for b in (1, -1)] * (n_small // 4), dtype=float)
    xs = np.zeros((n_small, d))
    xs[:, 1] = v
    xs[:, 0] = rest * signs[:, 0]
    xs[:, 2] = rest * signs[:, 1]
    return xs, np.ones(n_small)


def _adaops_params(**extra: object) -> A.AdaOpsRidgeParams:
    from mechanisms.learners.features import FeatureSpec

    base: dict[str, object] = {"features": FeatureSpec(features=("a",), label="b"), "delta": 1e-6}
    return A.AdaOpsRidgeParams.model_validate({**base, **extra})


def _worst_pair_terms(
    margin_shift: float = 0.0, h_scale: float = 1.0, gamma_scale: float = 1.0
) -> tuple[A.AdaOpsPlan, float, float, float, float]:
    """The pair S vs X = S + (e₂, −1) with λ_min(SᵀS) = h − 1 along e₂, W drawn from X at the edge of the good
    event (Y = k₃, Y_n = −k₄: n_hi = n_X). Returns (plan, μ̄(n_hi), μ, r, γ) of the OPS step; the optional
    arguments break the calibration (the margin, the threshold h, γ)."""
    pl = A.plan(_adaops_params(epsilon=1.0, kappa=3.0, min_lambda=1e-3), 3, None, "add_remove")
    n_small = 600
    n_hi = A.rows_upper(pl, n_small + 1 - pl.count_quantile)
    assert n_hi == n_small + 1 > pl.rows_floor  # the count's edge is active
    h, mu_bar, gamma = A.calibrate(pl, n_hi)
    xs, ys = _edge_dataset(n_small, 3, h - 1.0)
    xl = np.vstack([xs, [0.0, 1.0, 0.0]])
    lam_min_x = float(np.linalg.eigvalsh(xl.T @ xl)[0])
    close(lam_min_x, h, rel=1e-9)
    lam_noisy = lam_min_x + (pl.margin - 1.0)  # Y = k₃: the edge of the good event
    broken = dataclasses.replace(pl, margin=pl.margin + margin_shift)
    lam_n = A.adaptive_lambda(broken, lam_noisy, threshold=h * h_scale)
    fit = R.ridge_fit(xs, ys, lam_n)
    mu, r = R.outsider_terms(fit, np.array([[0.0, 1.0, 0.0]]), np.array([-1.0]))
    return pl, mu_bar, float(mu[0]), float(r[0]), gamma * gamma_scale


def test_adaops_good_event_bounds_the_ops_step() -> None:
    """At the worst pair on the good event μ = μ̄ is reached, |r| ≤ R and B(μ, r) ≤ ε_post."""
    pl, mu_bar, mu, r, gamma = _worst_pair_terms()
    assert mu_bar * (1 - 1e-6) <= mu <= mu_bar  # the edge: λ_min(H_S) = h exactly
    assert abs(r) <= pl.r_bar
    assert abs(r) > 0.6 * pl.r_bar  # a large residual (θ̂_S maximal along e₂)
    assert float(R.ops_bound(gamma, mu, r, pl.delta_post)) <= pl.eps_post
    assert float(R.ops_epsilon(gamma, np.array([mu]), np.array([r]), pl.delta_post)[0]) <= pl.eps_post


@pytest.mark.parametrize(
    "broken",
    [{"margin_shift": -1.0}, {"h_scale": 0.1}, {"gamma_scale": 2.0}],
    ids=["no+1", "h/10", "gamma*2"],
)
def test_adaops_good_event_check_catches_broken_calibrations(broken: dict[str, float]) -> None:
    pl, mu_bar, mu, r, gamma = _worst_pair_terms(**broken)
    ok = (
        mu <= mu_bar and abs(r) <= pl.r_bar and float(R.ops_bound(gamma, mu, r, pl.delta_post)) <= pl.eps_post
    )
    assert not ok


def test_plan_floor_replaces_the_infeasible_kappa_refusal() -> None:
    """add_remove: a large κ only raises the public floor n_floor of n_hi (never ⊥, never a branch on n);
    replace_one (public n) still refuses an infeasible κ."""
    from mechanisms.base import ParamsError

    p = _adaops_params(epsilon=0.1, kappa=1e6)
    pl = A.plan(p, 3, None, "add_remove")
    fixed = 0.5 * math.log1p(pl.mu_bar) + pl.mu_bar * math.log(1 / pl.gamma_delta)
    assert fixed <= pl.gamma_target / 2
    assert A.calibrate(pl, pl.rows_floor)[2] > 0
    with pytest.raises(ValueError, match="floor"):
        A.calibrate(pl, pl.rows_floor - 1)
    with pytest.raises(ParamsError) as err:
        A.plan(p, 3, 100, "replace_one")
    assert err.value.field == "kappa"


# ----- the mechanism's own DP claim: exact joint hockey-stick -----------------------------------------------


def _dg_log_pmf(t: int, centre: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, float]:
    """log pmf of N_Z(centre, t²) on [lo, hi] (exact normaliser by a ±40t sum) and the mass outside."""
    k = np.arange(lo, hi + 1)
    z = np.arange(-40 * t, 40 * t + 1, dtype=np.float64)
    log_norm = math.log(float(np.sum(np.exp(-(z * z) / (2.0 * t * t)))))
    lp = -((k - centre).astype(np.float64) ** 2) / (2.0 * t * t) - log_norm
    return k, lp, max(0.0, 1.0 - float(np.exp(lp).sum()))


def _joint_delta(
    pl: A.AdaOpsPlan, xs: np.ndarray, ys: np.ndarray, x: np.ndarray, y: float, eps: float, t_lambda: int
) -> float:
    """max over both orders of the hockey-stick δ(ε) of W = (ñ, λ̃) and θ̃ (continuous OPS law, the
    mechanism's γ after its dyadic rounding) for S = (xs, ys) vs X = S + (x, y): Σ_w p(w)·δ_OPS(ε − L_W(w)),
    exact per w (ridge.ops_delta_*); W truncated at ±7 std with the mass outside added."""
    step, t, tn, big_k = pl.lambda_step, t_lambda, pl.count_std, 7
    n_small = xs.shape[0]
    xl = np.vstack([xs, x])
    u_s = math.ceil(float(np.linalg.eigvalsh(xs.T @ xs)[0]) / step) - 1
    u_x = math.ceil(float(np.linalg.eigvalsh(xl.T @ xl)[0]) / step) - 1
    lo, hi = min(u_s, u_x) - big_k * t, max(u_s, u_x) + big_k * t
    ks, lk_x, out_x = _dg_log_pmf(t, u_x, lo, hi)
    _, lk_s, out_s = _dg_log_pmf(t, u_s, lo, hi)
    ns, ln_x, on_x = _dg_log_pmf(tn, n_small + 1, n_small - big_k * tn, n_small + 1 + big_k * tn)
    _, ln_s, on_s = _dg_log_pmf(tn, n_small, n_small - big_k * tn, n_small + 1 + big_k * tn)
    ev, vecs = np.linalg.eigh(xs.T @ xs)
    a, b = vecs.T @ x, vecs.T @ (xs.T @ ys)
    d_xs, d_sx = out_x + on_x, out_s + on_s
    for j, rows_noisy in enumerate(ns):
        h, _, gamma_t = A.calibrate(pl, A.rows_upper(pl, int(rows_noisy)))
        s = A.sample_scale(gamma_t)
        gamma = float(1 / (s * s))
        lam = np.maximum(pl.min_lambda, h - ks * step + pl.margin)
        mu = ((a * a)[None, :] / (ev[None, :] + lam[:, None])).sum(1)
        r = y - ((a * b)[None, :] / (ev[None, :] + lam[:, None])).sum(1)
        loss_w = lk_x - lk_s + (ln_x[j] - ln_s[j])  # log p_X(w) − log p_S(w)
        d_xs += float(np.sum(np.exp(lk_x + ln_x[j]) * R.ops_delta_backward(gamma, mu, r, eps - loss_w)))
        d_sx += float(np.sum(np.exp(lk_s + ln_s[j]) * R.ops_delta_forward(gamma, mu, r, eps + loss_w)))
    return max(d_xs, d_sx)


@pytest.mark.slow
def test_adaops_joint_release_meets_its_claim_exactly() -> None:
    """The mechanism's own (ε, δ) claim on the adversarial pair (worst leverage and residual, the good event's
    edge reachable), by the exact joint hockey-stick of (ñ, λ̃, θ̃); the broken variant with σ_λ/4 is caught.
    Observed: δ ≈ 2e-12 against the claimed 1e-6 (the composition is loose), broken ≈ 0.11."""
    pl = A.plan(_adaops_params(epsilon=4.0, kappa=2.0, lambda_share=0.8), 3, None, "add_remove")
    n_small = 400
    h_edge = A.calibrate(pl, max(n_small + 1, pl.rows_floor))[0]
    xs, ys = _edge_dataset(n_small, 3, h_edge - 1.0)
    x = np.array([0.0, 1.0, 0.0])
    claimed_eps = pl.eps_lambda + pl.eps_count + pl.eps_post  # θ̃ continuous: the output step is not in it
    claimed_delta = pl.delta_lambda + pl.delta_count + pl.delta_event + pl.delta_count_event + pl.delta_post
    t = pl.lambda_std_units
    assert _joint_delta(pl, xs, ys, x, -1.0, claimed_eps, t) <= claimed_delta
    assert _joint_delta(pl, xs, ys, x, -1.0, claimed_eps, t // 4) > claimed_delta


# ----- the mechanism and its reports ---------------------------------------------------------------------


def _params(**extra: object) -> A.AdaOpsRidgeParams:
    return _adaops_params(**{"epsilon": 2.0, "kappa": 2.0, **extra})


def test_adaops_release_end_to_end() -> None:
    from mechanisms.noise import Noise

    x, y = random_data(21, n=400, d=3)
    pl = A.plan(_params(), 3, None, "add_remove")
    out = A.adaops_release(pl, x, y, Noise.seeded(4))
    assert out["released"] is True
    assert out["lambda"] >= 1.0
    assert out["rows_upper"] == A.rows_upper(pl, out["rows_noisy"])
    assert out["gamma"] <= A.calibrate(pl, out["rows_upper"])[2]
    for leaky in ("lambda_min", "theta_hat", "leverage", "gram", "rows", "n"):
        assert leaky not in out
    fit = R.ridge_fit(x, y, out["lambda"])
    spread = math.sqrt(float(np.trace(np.linalg.inv(fit.r_factor.T @ fit.r_factor))) / out["gamma"])
    assert np.linalg.norm(np.asarray(out["coefficients"]) - fit.theta) < 8 * spread
    # the same seed gives the same release (noise only from mechanisms.noise)
    assert A.adaops_release(pl, x, y, Noise.seeded(4)) == out
    # no ⊥ and no branch on the private n: tiny and large data sets are released alike
    for n in (3, 2000):
        xn, yn = random_data(23, n=n, d=3)
        other = A.adaops_release(pl, xn, yn, Noise.seeded(5))
        assert other["released"] is True
        assert other.keys() == out.keys()
        assert other["rows_upper"] >= pl.rows_floor


def test_max_rows_is_refused() -> None:
    from mechanisms.base import ParamsError
    from mechanisms.data.schema import DatasetSchema

    for relation, rows in (("add_remove", None), ("replace_one", 500)):
        schema = DatasetSchema.model_validate(
            {
                "columns": [
                    {"name": "a", "type": "float", "min": -1, "max": 1},
                    {"name": "b", "type": "float", "min": -1, "max": 1},
                ],
                "neighboring": relation,
            }
        )
        ctx = A.PublicContext(schema, rows, (2.0, 4.0))
        with pytest.raises(ParamsError) as err:
            A.ADAOPS_RIDGE.check(_params(max_rows=1000), ctx)
        assert err.value.field == "max_rows"


@pytest.mark.parametrize("relation", ["add_remove", "replace_one"])
@pytest.mark.parametrize("family", ["public", "data_dependent"])
def test_charge_is_pinned(relation: str, family: str) -> None:
    """approximate_charge is exactly (ε [+ ε_rep], δ [+ δ_rep]) rounded up (a few ulps), both relations."""
    from mechanisms.data.schema import DatasetSchema

    schema = DatasetSchema.model_validate(
        {
            "columns": [
                {"name": "a", "type": "float", "min": -1, "max": 1},
                {"name": "b", "type": "float", "min": -1, "max": 1},
            ],
            "neighboring": relation,
        }
    )
    ctx = A.PublicContext(schema, 500 if relation == "replace_one" else None, (2.0, 4.0, 8.0))
    extra = (
        {"report": "data_dependent", "report_sigma": 5.0, "report_delta": 1e-7} if family != "public" else {}
    )
    p = _params(**extra)
    charge = A.ADAOPS_RIDGE.approximate_charge(p, ctx)
    d = 2  # one feature and the intercept
    rep_eps, rep_delta = A.report_charge(p, d, relation)  # type: ignore[arg-type]
    if family == "public":
        assert (rep_eps, rep_delta) == (0.0, 0.0)
    else:
        assert rep_eps > 0.0
        assert rep_delta == 1e-7
    for got, want in ((charge.epsilon, 2.0 + rep_eps), (charge.delta, 1e-6 + rep_delta)):
        assert want <= got <= want * (1 + 1e-11)


def test_replace_one_and_data_dependent_plans() -> None:
    from mechanisms.base import ParamsError

    add = A.plan(_params(), 3, None, "add_remove")
    rep = A.plan(_params(), 3, 500, "replace_one")
    assert rep.count_std == 0  # n is public: no count released, no δ spent on it
    assert rep.delta_count == rep.delta_count_event == 0.0
    assert add.count_std > 0
    # two add/remove steps at half the target: smaller γ than an add/remove plan at the same n_hi
    assert rep.gamma < A.calibrate(add, 500)[2]
    dep = A.plan(_params(report="data_dependent", report_sigma=5.0, report_delta=1e-7), 3, None, "add_remove")
    assert dep.report_epsilon > 0.0
    assert dep.report_delta == 1e-7
    with pytest.raises(ParamsError):
        A.plan(_params(report="data_dependent"), 3, None, "add_remove")


def test_reports_are_functions_of_the_release_and_the_record() -> None:
    from mechanisms.noise import Noise

    x, y = random_data(22, n=400, d=3)
    pub = A.plan(_params(), 3, None, "add_remove")
    dep_p = A.plan(
        _params(report="data_dependent", report_sigma=2.0, report_delta=1e-7), 3, None, "add_remove"
    )
    out = A.adaops_release(dep_p, x, y, Noise.seeded(9))
    assert np.asarray(out["gram"]["matrix"]).shape == (3, 3)
    public_only = {k: v for k, v in out.items() if k != "gram"}
    rep_dep = A.evaluate_report(dep_p, out, x[:20], y[:20], 0.05)
    rep_pub = A.evaluate_report(pub, public_only, x[:20], y[:20], 0.05)
    for a, b in zip(rep_dep, rep_pub, strict=True):
        # the Gram only tightens μ (and the per-event share ρ/6 < ρ/5 costs a little)
        assert a["member"]["mu_upper"] <= b["member"]["mu_upper"] * (1 + 1e-9)
        # the output discretisation step is in both report values (ε_out), δ_out in pdp_delta
        assert b["member"]["pdp_epsilon"] >= pub.eps_out
        assert b["pdp_delta"] == pub.delta_ops
    # deterministic and per-record: a record alone gets the same report as inside a batch
    assert A.evaluate_report(pub, public_only, x[:1], y[:1], 0.05) == rep_pub[:1]
    with pytest.raises(ValueError, match="⊥"):
        A.evaluate_report(pub, {"released": False}, x[:1], y[:1], 0.05)


def test_service_never_imports_the_confidential_module() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "service"
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "per_instance.ridge" not in text, path
        assert "per_instance import ridge" not in text, path


@pytest.mark.parametrize("above", [0.0, 1.5, 30_000.5, 61_234.0])
def test_discrete_gaussian_tail_bounds_for_large_std(above: float) -> None:
    t = A.EXACT_SUM_STD + 7
    k = np.arange(-40 * t, 40 * t + 1, dtype=np.float64)
    mass = np.exp(-(k * k) / (2.0 * t * t))
    exact = float(mass[k > above].sum() / mass.sum())
    assert A._dg_tail(t, above, upper=False) <= exact <= A._dg_tail(t, above, upper=True)
    assert A._dg_tail(t, above, upper=True) - A._dg_tail(t, above, upper=False) < 1e-4
