"""Per-instance reports: the exact ex-post loss (Redberg 2023, Cor 2.3.2) and the published bounds (Redberg &
Wang 2021, Algorithm 2; docs/privacy/objective_perturbation.md#objpert-per-instance-report)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.learners.objective_perturbation import (
    ObjPertConfig,
    ObjPertLogisticParams,
    amp_grid_rdp,
    fit_objpert,
    logistic_d1,
    logistic_d2,
    objpert_curve,
    objpert_rdp,
    perturbed_hessian,
    perturbed_objective,
    solve_to_tolerance,
)
from mechanisms.noise import Noise
from mechanisms.per_instance.reports import (
    evaluate_report,
    ex_post_terms,
    exact_ex_post_loss,
    goe_norm_bound,
    personalized_rdp,
    report_metadata,
    two_sided_z,
)

FALSE_ALARM = 1e-3  # every binomial coverage test below rejects a correct bound with probability ≤ 1e-3

D1_X = np.array([[0.5], [-0.3], [0.8]])
D1_Y = np.array([1.0, -1.0, 1.0])
D2_X = np.array([[0.6, 0.0], [0.0, -0.7], [0.3, 0.4], [-0.5, 0.5]])
D2_Y = np.array([1.0, -1.0, 1.0, -1.0])

# test vectors of the exact loss (Redberg 2023, Cor 2.3.2; logistic, λ=1, σ=2): (D, θ, z, member, ε₁)
VECTORS = [
    (D1_X, D1_Y, [0.3], [0.6], -1.0, False, 0.0909170973),
    (D1_X, D1_Y, [0.3], [0.8], 1.0, True, 0.1136952656),
    (D2_X, D2_Y, [0.2, -0.1], [0.1, 0.9], 1.0, False, 0.0722856577),
    (D2_X, D2_Y, [0.2, -0.1], [0.6, 0.0], 1.0, True, 0.0568794918),
]


def _log_density(theta: np.ndarray, xs: np.ndarray, ys: np.ndarray, lam: float, sigma: float) -> float:
    """log p_D(θ) of exact ObjPert: log N(−∇J(θ;D); 0, σ²I) + log det ∇²J(θ;D) (change of variables)."""
    u = xs @ theta
    grad = xs.T @ logistic_d1(u, ys) + lam * theta
    hess = (xs * logistic_d2(u)[:, None]).T @ xs + lam * np.eye(xs.shape[1])
    sign, logdet = np.linalg.slogdet(hess)
    assert sign > 0
    return float(np.sum(stats.norm.logpdf(-grad, scale=sigma)) + logdet)


def _direct_ratio(
    theta: np.ndarray,
    xs: np.ndarray,
    ys: np.ndarray,
    x: np.ndarray,
    y: float,
    member: bool,
    lam: float,
    sigma: float,
) -> float:
    if member:
        first = int(np.flatnonzero(np.all(xs == x, axis=1) & (ys == y))[0])  # remove one copy only
        other = (np.delete(xs, first, axis=0), np.delete(ys, first))
    else:
        other = (np.vstack([xs, x]), np.append(ys, y))
    return abs(_log_density(theta, xs, ys, lam, sigma) - _log_density(theta, *other, lam, sigma))


@pytest.mark.parametrize(("xs", "ys", "theta", "x", "y", "member", "expected"), VECTORS)
def test_exact_loss_matches_the_note_and_direct_density_ratio(
    xs: np.ndarray,
    ys: np.ndarray,
    theta: list[float],
    x: list[float],
    y: float,
    member: bool,
    expected: float,
) -> None:
    value = exact_ex_post_loss(np.asarray(theta), xs, ys, np.asarray(x), y, 1.0, 2.0, member)
    assert value == pytest.approx(expected, abs=1e-9)
    direct = _direct_ratio(np.asarray(theta), xs, ys, np.asarray(x), y, member, 1.0, 2.0)
    assert value == pytest.approx(direct, abs=1e-10)


def test_exact_loss_matches_direct_ratio_on_random_problems() -> None:
    rng = np.random.default_rng(4)
    for _ in range(30):
        n, d = int(rng.integers(3, 12)), int(rng.integers(1, 5))
        xs = rng.normal(size=(n, d))
        xs /= np.maximum(1, np.linalg.norm(xs, axis=1))[:, None]
        ys = rng.choice([-1.0, 1.0], size=n)
        theta = rng.normal(size=d)
        lam, sigma = float(rng.uniform(0.3, 3)), float(rng.uniform(0.5, 5))
        member = bool(rng.integers(2))
        x, y = (xs[0], float(ys[0])) if member else (rng.normal(size=d) / math.sqrt(d), 1.0)
        exact = exact_ex_post_loss(theta, xs, ys, x, y, lam, sigma, member)
        assert exact == pytest.approx(_direct_ratio(theta, xs, ys, x, y, member, lam, sigma), abs=1e-9)


def test_data_independent_report_vector_of_the_note() -> None:
    """Data-independent report (docs/privacy/objective_perturbation.md#objpert-per-instance-report):
    z=([0.1,0.9],+1), θ=[0.2,−0.1], σ=2, λ=1, ρ=1e-6: 0.229098 + 0.027449 + 1.146135."""
    terms = ex_post_terms(
        np.array([0.2, -0.1]),
        np.array([[0.1, 0.9]]),
        np.array([1.0]),
        lam=1.0,
        sigma=2.0,
        z_b=float(stats.norm.isf(0.5e-6)),  # b is the continuous Gaussian of the coupling: Φ⁻¹ is valid
    )
    assert two_sided_z(1e-6) >= float(stats.norm.isf(0.5e-6))  # discrete noises use the subgaussian z
    assert terms["leverage"][0] == pytest.approx(0.229098, abs=1e-6)
    assert terms["fit"][0] == pytest.approx(0.027449, abs=1e-6)
    assert terms["gradient"][0] == pytest.approx(1.146135, abs=1e-6)
    assert terms["total"][0] == pytest.approx(1.402682, abs=1e-6)


def test_radius_only_enlarges_the_bound() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 3)) / 2
    y = rng.choice([-1.0, 1.0], size=50)
    theta = rng.normal(size=3)
    base = ex_post_terms(theta, x, y, lam=1.0, sigma=1.0, z_b=3.0)["total"]
    wide = ex_post_terms(theta, x, y, lam=1.0, sigma=1.0, z_b=3.0, radius=0.3)["total"]
    assert np.all(wide >= base)
    assert np.any(wide > base)


def _exact_minimizer(
    x: np.ndarray, y: np.ndarray, lam: float, b: np.ndarray, start: np.ndarray
) -> np.ndarray:
    theta = start.copy()
    for _ in range(12):
        _, g = perturbed_objective(theta, x, y, lam, b)
        theta = theta - np.linalg.solve(perturbed_hessian(theta, x, lam), g)
    assert np.linalg.norm(perturbed_objective(theta, x, y, lam, b)[1]) < 1e-9
    return theta


def _rejects(failures: int, trials: int, rho: float) -> bool:
    """One-sided binomial test: is the failure rate above ρ? (false alarm ≤ FALSE_ALARM)"""
    return bool(stats.binom.sf(failures - 1, trials, rho) < FALSE_ALARM)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("z", "member"), [((np.array([0.1, 0.9]), 1.0), False), ((np.array([0.6, 0.0]), 1.0), True)]
)
def test_coverage_of_public_and_data_dependent_reports(z: tuple[np.ndarray, float], member: bool) -> None:
    """Over draws of the noise, P[ε₁ > reported bound] ≤ ρ
    (docs/privacy/objective_perturbation.md#objpert-per-instance-report), exact minimizer,
    ρ = 0.05.

    Power: a report that drops the gradient term (treats b as 0) fails far more often.
    """
    rho, lam, sigma, sigma2, sigma3 = 0.05, 1.0, 0.7, 0.3, 0.04
    trials = 1500
    rng = np.random.default_rng(2024)
    x, y = z
    xs, ys = D2_X, D2_Y
    z_pub = two_sided_z(rho)
    z_dep = two_sided_z(rho / 3)  # events: b branch, e, GOE
    assert lam >= 2 * sigma3 * goe_norm_bound(2, rho / 3)
    fail_pub = fail_dep = fail_broken = 0
    for _ in range(trials):
        b = rng.normal(0, sigma, size=2)
        theta = _exact_minimizer(xs, ys, lam, b, np.zeros(2))
        exact = exact_ex_post_loss(theta, xs, ys, x, y, lam, sigma, member)
        pub = ex_post_terms(theta, x[None, :], np.array([y]), lam=lam, sigma=sigma, z_b=z_pub)["total"][0]
        grad = xs.T @ logistic_d1(xs @ theta, ys) + lam * theta
        g_hat = grad + rng.normal(0, sigma2, size=2)
        noise = rng.normal(size=(2, 2))
        h_hat = perturbed_hessian(theta, xs, lam) + sigma3 * (noise + noise.T) / math.sqrt(2)
        dep = ex_post_terms(
            theta,
            x[None, :],
            np.array([y]),
            lam=lam,
            sigma=sigma,
            z_b=z_dep,
            h_hat=h_hat,
            g_hat=g_hat,
            sigma_g=sigma2,
            z_e=z_dep,
            sigma_h=sigma3,
        )["total"][0]
        # broken: the realized noise b treated as if it were 0 (no gradient term at all)
        broken = ex_post_terms(theta, x[None, :], np.array([y]), lam=lam, sigma=sigma, z_b=0.0)["total"][0]
        fail_pub += exact > pub
        fail_dep += exact > dep
        fail_broken += exact > broken
    assert not _rejects(fail_pub, trials, rho)
    assert not _rejects(fail_dep, trials, rho)
    assert _rejects(fail_broken, trials, rho)


def test_goe_norm_bound_by_monte_carlo() -> None:
    """P(‖(Z+Zᵀ)/√2‖ > τ_GOE(d, ρ)) ≤ ρ; and it is conservative vs the empirical quantile."""
    rng = np.random.default_rng(7)
    rho, trials = 0.05, 3000
    for d in (2, 10, 30):
        z = rng.normal(size=(trials, d, d))
        w = (z + np.transpose(z, (0, 2, 1))) / math.sqrt(2)
        norms = np.max(np.abs(np.linalg.eigvalsh(w)), axis=1)
        bound = goe_norm_bound(d, rho)
        assert not _rejects(int(np.sum(norms > bound)), trials, rho)
        assert bound >= float(np.quantile(norms, 1 - rho))
        # power: the thesis's Chiani-normalised constant (≈ √(2d)-scale) would be exceeded most of the time
        assert _rejects(int(np.sum(norms > math.sqrt(2 * d))), trials, rho)


def _params(**extra: object) -> ObjPertLogisticParams:
    base: dict[str, object] = {
        "features": ["a", "b"],
        "label": "label",
        "regularization": 2.0,
        "sigma": 1.0,
        "tolerance": 1e-4,
        "report_rho": 0.05,
    }
    return ObjPertLogisticParams.model_validate({**base, **extra})


def test_personalized_rdp_is_below_the_worst_case() -> None:
    p = _params()
    config = p.config("add_remove")
    worst = objpert_curve(config, DEFAULT_ORDERS)
    curves = personalized_rdp(np.array([0.0, 0.3, 0.999, 1.0]), p, config.output_sigma, DEFAULT_ORDERS)
    for curve in curves:
        assert curve <= worst
    assert curves[0] <= curves[1] <= curves[2]
    assert curves[0].values[0] < curves[1].values[0] < curves[2].values[0]
    assert np.allclose(curves[3].values, worst.values, rtol=1e-11)
    for norm, curve in zip([0.3, 0.999], curves[1:3], strict=True):
        reference = objpert_rdp(DEFAULT_ORDERS, p.sigma, norm**2 / 4, p.regularization, norm)
        reference = reference + amp_grid_rdp(
            DEFAULT_ORDERS, p.tolerance, p.regularization, p.sigma, config.output_sigma
        )
        assert np.all(np.asarray(curve.values) >= reference)
        assert np.allclose(curve.values, reference, rtol=1e-11)


@pytest.mark.slow
def test_amp_release_coverage_with_the_ball() -> None:
    """AMP releases: the reported leverage+fit+gradient terms at ``out`` cover ε₁ at the exact θ^P, through
    the ball ‖θ^P − out‖ ≤ r (ρ = 0.05 split over 3 events), over repeated runs of the real learner."""
    rng = np.random.default_rng(99)
    noise = Noise.seeded(99)
    n, d = 40, 2
    xs = rng.normal(size=(n, d))
    xs /= np.maximum(1, np.linalg.norm(xs, axis=1))[:, None]
    ys = np.where(xs[:, 0] + 0.5 * rng.normal(size=n) > 0, 1.0, -1.0)
    # a large σ_out makes the ball matter: r ≈ 0.6
    p = _params(tolerance=1e-3, output_sigma=0.15, sigma=0.8)
    config = p.config("add_remove")
    meta = report_metadata(p, d)
    trials, failures, broken_failures = 600, 0, 0
    member_x, member_y = xs[0], float(ys[0])
    for _ in range(trials):
        fit = fit_objpert(xs, ys, config, noise)
        theta_p = _exact_minimizer(xs, ys, config.lam, fit.b, fit.approx_minimizer)
        assert np.linalg.norm(theta_p - fit.approx_minimizer) <= config.tau / config.lam
        exact = exact_ex_post_loss(theta_p, xs, ys, member_x, member_y, config.lam, config.sigma, True)
        terms = ex_post_terms(
            fit.released,
            member_x[None, :],
            np.array([member_y]),
            lam=config.lam,
            sigma=config.sigma,
            z_b=meta["z"],
            radius=meta["radius"],
            row_norm=1.0,
        )
        no_ball = ex_post_terms(
            fit.released, member_x[None, :], np.array([member_y]), lam=config.lam, sigma=config.sigma, z_b=0.0
        )
        failures += exact > terms["total"][0]
        broken_failures += exact > no_ball["total"][0]
    assert not _rejects(failures, trials, 0.05)
    assert _rejects(broken_failures, trials, 0.05)


def test_evaluate_report_reads_only_the_release() -> None:
    rng = np.random.default_rng(3)
    noise = Noise.seeded(3)
    xs = rng.normal(size=(200, 3))
    xs /= np.maximum(1, np.linalg.norm(xs, axis=1))[:, None]
    ys = np.where(xs[:, 0] > 0, 1.0, -1.0)
    p = _params(
        report="data_dependent",
        regularization=60.0,
        report_gradient_sigma=1.0,
        report_hessian_sigma=1.0,
        report_rho=1e-6,
    )
    fit = fit_objpert(xs, ys, p.config("add_remove"), noise)
    from mechanisms.per_instance.reports import data_dependent_statistics

    output = {
        "theta": list(fit.released),
        "output_sigma": p.config("add_remove").output_sigma,
        "report": {**report_metadata(p, 3), **data_dependent_statistics(p, xs, ys, fit, noise)},
    }
    records = xs[:5]
    first = evaluate_report(p, output, records, ys[:5], DEFAULT_ORDERS)
    second = evaluate_report(p, output, records, ys[:5], DEFAULT_ORDERS)
    assert first == second
    for item in first:
        assert set(item) == {"ex_post_epsilon_upper", "confidence", "terms", "personalized_rdp"}
        assert item["ex_post_epsilon_upper"] > 0
    public = _params(regularization=60.0, report_rho=1e-6)
    public_output = {**output, "report": report_metadata(public, 3)}
    pub = evaluate_report(public, public_output, records, ys[:5], DEFAULT_ORDERS)
    # the data-dependent leverage uses the min with the public ‖x‖²/λ
    for dep_item, pub_item in zip(first, pub, strict=True):
        assert dep_item["terms"]["leverage"] <= pub_item["terms"]["leverage"] * (1 + 1e-2)
    with pytest.raises(ValueError, match="no reporting function"):
        evaluate_report(public, {"theta": [0.0] * 3, "output_sigma": 1.0}, records, ys[:5], DEFAULT_ORDERS)


def test_solver_used_by_reports_is_the_production_one() -> None:
    b = np.array([0.3, -0.2])
    theta = solve_to_tolerance(D2_X, D2_Y, 1.0, b, 1e-9)
    assert np.linalg.norm(perturbed_objective(theta, D2_X, D2_Y, 1.0, b)[1]) <= 1e-9
    config = ObjPertConfig(lam=1.0, sigma=1.0)
    assert config.output_sigma == pytest.approx(1000 * 1e-6)


def test_hessian_transcript_term_is_the_goe_gaussian_loss() -> None:
    """Ĥ = H + σ₃(Z + Zᵀ)/√2: diagonal noise N(0, 2σ₃²), off-diagonal N(0, σ₃²). For the rank-one shift
    ΔH = f''·xxᵀ the exact log-density ratio is Δ_H²/(4σ₃²) + (Gaussian of std Δ_H/(√2σ₃)), Δ_H = f''‖x‖²,
    which is what ``ex_post_terms`` charges (with z) as ``report_hessian``."""
    rng = np.random.default_rng(5)
    d, s3 = 3, 0.3
    x = rng.normal(size=d)
    x /= np.linalg.norm(x)
    theta = rng.normal(size=d)
    f2 = float(logistic_d2(np.asarray(x @ theta)))
    delta = f2 * np.outer(x, x)
    iu = np.triu_indices(d, 1)

    def log_ratio(h_hat: np.ndarray, mean: np.ndarray, other: np.ndarray) -> float:
        def log_density(m: np.ndarray) -> float:
            r = h_hat - m
            return float(-np.sum(np.diag(r) ** 2) / (4 * s3**2) - np.sum(r[iu] ** 2) / (2 * s3**2))

        return log_density(mean) - log_density(other)

    mean = np.eye(d) * 2.0
    draws = []
    for _ in range(4000):
        z = rng.normal(size=(d, d))
        h_hat = mean + s3 * (z + z.T) / math.sqrt(2)
        draws.append(log_ratio(h_hat, mean, mean - delta))
    delta_h = f2 * float(x @ x)
    se = delta_h / (math.sqrt(2) * s3) / math.sqrt(len(draws))
    assert np.mean(draws) == pytest.approx(delta_h**2 / (4 * s3**2), abs=5 * se)
    assert np.std(draws) == pytest.approx(delta_h / (math.sqrt(2) * s3), rel=0.05)
    z = two_sided_z(0.01)
    terms = ex_post_terms(
        theta,
        x[None, :],
        np.array([1.0]),
        lam=1.0,
        sigma=1.0,
        z_b=z,
        h_hat=mean + 0.0,
        g_hat=np.zeros(d),
        sigma_g=0.5,
        z_e=z,
        sigma_h=s3,
    )
    expected = delta_h**2 / (4 * s3**2) + delta_h * z / (math.sqrt(2) * s3)
    assert terms["report_hessian"][0] == pytest.approx(expected, rel=1e-12)
    assert np.mean(np.abs(draws) > expected) <= 0.01 * 1.5
    with pytest.raises(ValueError, match="sigma_h"):
        ex_post_terms(theta, x[None, :], np.array([1.0]), lam=1.0, sigma=1.0, z_b=z, h_hat=mean)


def test_report_events_and_confidence_for_new_and_legacy_releases() -> None:
    """ĝ and Ĥ have their own events: data-dependent reports split ρ over 7 events. A release stored with the
    former 5-event split keeps its stored z, so its honest confidence is 1 − 7ρ/5."""
    rng = np.random.default_rng(8)
    noise = Noise.seeded(8)
    xs = rng.normal(size=(100, 3))
    xs /= np.maximum(1, np.linalg.norm(xs, axis=1))[:, None]
    ys = np.where(xs[:, 0] > 0, 1.0, -1.0)
    p = _params(
        report="data_dependent",
        regularization=60.0,
        report_gradient_sigma=1.0,
        report_hessian_sigma=1.0,
        report_rho=1e-3,
    )
    fit = fit_objpert(xs, ys, p.config("add_remove"), noise)
    from mechanisms.per_instance.reports import DATA_DEPENDENT_EVENTS, data_dependent_statistics

    meta = report_metadata(p, 3)
    assert meta["events"] == DATA_DEPENDENT_EVENTS == 7
    assert meta["z"] == pytest.approx(two_sided_z(1e-3 / 7))
    output = {
        "theta": list(fit.released),
        "output_sigma": p.config("add_remove").output_sigma,
        "report": {**meta, **data_dependent_statistics(p, xs, ys, fit, noise)},
    }
    item = evaluate_report(p, output, xs[:1], ys[:1], DEFAULT_ORDERS)[0]
    assert item["confidence"] == 1.0 - 1e-3
    assert item["terms"]["report_gradient"] > 0
    assert item["terms"]["report_hessian"] > 0
    legacy = {**output, "report": {**output["report"], "events": 5, "z": two_sided_z(1e-3 / 5)}}
    old = evaluate_report(p, legacy, xs[:1], ys[:1], DEFAULT_ORDERS)[0]
    assert old["confidence"] == pytest.approx(1.0 - 7 * 1e-3 / 5)
    public = _params(regularization=60.0, report_rho=1e-3)
    public_output = {**output, "report": report_metadata(public, 3)}
    pub = evaluate_report(public, public_output, xs[:1], ys[:1], DEFAULT_ORDERS)
    assert pub[0]["confidence"] == 1.0 - 1e-3
    assert pub[0]["terms"]["report_gradient"] == pub[0]["terms"]["report_hessian"] == 0.0
