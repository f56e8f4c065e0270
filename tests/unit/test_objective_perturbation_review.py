"""Reviewer's regression tests for objective perturbation and the per-instance reports.

What is pinned here (passes): the replace-one bound (Theorem C) against exact 2-D divergences with adversarial
rows, including the claim that the log-det ratio needs β (not 2β); the AMP term; the report sensitivities.

What was demonstrated (formerly ``xfail(strict=True)``; now fixed, so the markers are removed and the tests
must pass):

* the solver's failure outcome (``ObjPertDidNotConverge`` → "failed_charged", visible to the analyst) was a
  function of the data that no theorem covers: ``certified_gradient_norm``'s rounding slack used the data's
  max row norm and n. A replace-one pair gave failure with probability 1 vs 0 (infinite loss); an
  add/remove pair with the default configuration (R = 1, intercept) leaked more than the charged curve.
  Fix: the slack uses public constants only (R, n̄ = n or ``max_rows``, θ̄, B_b) and τ below 10× that slack
  is refused at check time; the tests now pin both regimes;
* the data-dependent report's ``ex_post_epsilon_upper`` omitted the ex-post loss of the released ĝ, Ĥ
  although the docs say it bounds the transcript (θ^P, out, ĝ, Ĥ). Fix: their Gaussian terms are added.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import ParamsError, PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.learners.objective_perturbation import (
    Neighboring,
    ObjPertConfig,
    ObjPertDidNotConverge,
    ObjPertLogisticParams,
    StoppingBounds,
    amp_rdp,
    logistic_d1,
    logistic_d2,
    minimum_tolerance,
    noise_norm_bound,
    objpert_curve,
    objpert_rdp,
    solve_to_tolerance,
)
from mechanisms.noise import Noise
from mechanisms.per_instance.objpert_logistic import ObjPertLogistic
from mechanisms.per_instance.reports import (
    DATA_DEPENDENT_EVENTS,
    ex_post_terms,
    exact_ex_post_loss,
    goe_norm_bound,
    report_sensitivities,
    two_sided_z,
)

EPS = float(np.finfo(np.float64).eps)

# ----- 1. replace-one bound (Theorem C) against exact 2-D divergences ------------------------------------


def _log_density(
    grid: np.ndarray, x: np.ndarray, y: np.ndarray, lam: float, sigma: float
) -> tuple[np.ndarray, np.ndarray]:
    """log p_D(θ) = log φ_σ(−∇J(θ; D)) + log det ∇²J(θ; D) on a 2-D grid (change of variables)."""
    u = grid @ x.T
    d1 = -y[None, :] * special.expit(-y[None, :] * u)
    d2 = special.expit(u) * special.expit(-u)
    b = -(d1 @ x + lam * grid)
    h00 = (d2 * x[None, :, 0] ** 2).sum(1) + lam
    h11 = (d2 * x[None, :, 1] ** 2).sum(1) + lam
    h01 = (d2 * x[None, :, 0] * x[None, :, 1]).sum(1)
    logdet = np.log(h00 * h11 - h01**2)
    return -(b**2).sum(1) / (2 * sigma**2) - math.log(2 * math.pi * sigma**2) + logdet, logdet


E1, E2 = np.array([1.0, 0.0]), np.array([0.0, 1.0])
REPLACE_CASES = [
    # (D0 rows, D0 labels, z, z'): orthogonal rows whose |f'| can both be ≈ 1, a 135° pair (‖v‖ → 1.85L),
    # and a label flip (an exact Gaussian with Δ = L).
    (np.zeros((0, 2)), np.zeros(0), (E1, 1.0), (E2, -1.0)),
    (np.zeros((0, 2)), np.zeros(0), (E1, 1.0), ((E1 - E2) / math.sqrt(2), -1.0)),
    (np.array([[0.6, 0.8], [-0.6, 0.8]]), np.array([1.0, -1.0]), (E1, 1.0), (E2, -1.0)),
    (np.zeros((0, 2)), np.zeros(0), (E1, 1.0), (E1, -1.0)),
]


@pytest.mark.parametrize(("lam", "sigma"), [(0.3, 0.5), (0.26, 1.0), (1.0, 1.0)])
@pytest.mark.parametrize("case", range(len(REPLACE_CASES)))
def test_replace_one_bound_covers_exact_2d_divergences(lam: float, sigma: float, case: int) -> None:
    x0, y0, z, zp = REPLACE_CASES[case]
    xd, yd = np.vstack([x0, z[0][None]]), np.append(y0, z[1])
    xp, yp = np.vstack([x0, zp[0][None]]), np.append(y0, zp[1])
    half = (len(yd) + 9.0) / lam
    g = np.linspace(-half, half, 700)
    h = g[1] - g[0]
    grid = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
    lp, ldp = _log_density(grid, xd, yd, lam, sigma)
    lq, ldq = _log_density(grid, xp, yp, lam, sigma)
    assert abs(np.exp(lp).sum() * h * h - 1) < 1e-4
    assert abs(np.exp(lq).sum() * h * h - 1) < 1e-4
    # log-det ratio: bounded by log(1 + β/λ) ≤ a with β = R²/4 (one β, not 2β) ...
    beta = 0.25
    gap = float(np.max(np.abs(ldp - ldq)))
    assert gap <= math.log1p(beta / lam) + 1e-9
    if case != 3:  # ... and the bound is attained (so it cannot be improved below log(1 + β/λ))
        assert gap >= 0.99 * math.log1p(beta / lam)
    alphas = np.array([2.0, 4.0, 8.0])
    bound = objpert_rdp(alphas, sigma, beta, lam, 2.0)  # Theorem C: L → 2L
    for alpha, cap in zip(alphas, bound, strict=True):
        for a_, b_ in ((lp, lq), (lq, lp)):
            value = (special.logsumexp(alpha * a_ + (1 - alpha) * b_) + 2 * math.log(h)) / (alpha - 1)
            assert value <= cap
    if case == 3:  # label flip: exactly Gaussian with Δ = L, D_α = α/(2σ²)
        for alpha in alphas:
            value = (special.logsumexp(alpha * lp + (1 - alpha) * lq) + 2 * math.log(h)) / (alpha - 1)
            assert value == pytest.approx(alpha / (2 * sigma**2), rel=2e-3)


def test_amp_term_is_the_gaussian_rdp_of_sensitivity_two_tau_over_lambda() -> None:
    orders = (1.5, 2.0, 8.0, 64.0)
    tau, lam, sigma_out = 0.01, 3.0, 0.2
    expected = [a * (2 * tau / lam) ** 2 / (2 * sigma_out**2) for a in orders]
    assert np.allclose(amp_rdp(orders, tau, lam, sigma_out), expected, rtol=1e-14)
    assert np.allclose(expected, [2 * tau**2 * a / (sigma_out**2 * lam**2) for a in orders], rtol=1e-14)
    cases: tuple[tuple[Neighboring, float], ...] = (("add_remove", 1.0), ("replace_one", 2.0))
    for neighboring, factor in cases:
        config = ObjPertConfig(
            lam=lam, sigma=2.0, tau=tau, sigma_out=sigma_out, row_norm=math.sqrt(2), neighboring=neighboring
        )
        curve = objpert_curve(config, orders)
        base = objpert_rdp(orders, 2.0, 0.5, lam, factor * math.sqrt(2))
        assert np.all(np.asarray(curve.values) >= base + np.asarray(expected))
        assert np.allclose(curve.values, base + np.asarray(expected), rtol=1e-3)  # + grid rounding/coupling


def test_report_sensitivities_and_goe_vector_norm() -> None:
    p = ObjPertLogisticParams.model_validate(
        {
            "features": ["a"],
            "label": "y",
            "regularization": 5.0,
            "sigma": 1.0,
            "tolerance": 0.01,
            "row_norm": 2.0,
            "report": "data_dependent",
            "report_gradient_sigma": 1.0,
            "report_hessian_sigma": 0.1,
        }
    )
    assert report_sensitivities(p, "add_remove") == pytest.approx((2.0 + 0.02, 1.0 / math.sqrt(2)))
    assert report_sensitivities(p, "replace_one") == pytest.approx((4.0 + 0.02, 1.0))
    rng = np.random.default_rng(3)
    d, beta = 4, 1.0
    iu = np.triu_indices(d, 1)
    for _ in range(200):
        x, xp = rng.normal(size=d), rng.normal(size=d)
        x, xp = 2 * x / np.linalg.norm(x), 2 * xp / np.linalg.norm(xp) * rng.uniform()
        a = logistic_d2(np.asarray(rng.normal() * 3)) * np.outer(x, x)
        b = logistic_d2(np.asarray(rng.normal() * 3)) * np.outer(xp, xp)
        for delta, cap in ((a, beta / math.sqrt(2)), (a - b, beta)):
            vec = np.concatenate([np.diag(delta) / math.sqrt(2), delta[iu]])
            assert np.linalg.norm(vec) == pytest.approx(np.linalg.norm(delta) / math.sqrt(2))
            assert np.linalg.norm(vec) <= cap * (1 + 1e-12)
    # GOE bound: (Z + Zᵀ)/√2 exceeds τ_GOE at most at rate ρ (d = 6, ρ = 0.05, 2000 draws)
    tau_goe = goe_norm_bound(6, 0.05)
    z = rng.normal(size=(2000, 6, 6))
    w = (z + np.transpose(z, (0, 2, 1))) / math.sqrt(2)
    norms = np.max(np.abs(np.linalg.eigvalsh(w)), axis=1)
    assert np.mean(norms > tau_goe) <= 0.05


# ----- 2. the solver's failure outcome is a data-dependent release ---------------------------------------

SCHEMA = DatasetSchema.model_validate(
    {
        "neighboring": "replace_one",
        "columns": [
            {"name": "a", "type": "float", "min": -1, "max": 1},
            {"name": "label", "type": "categorical", "values": ["no", "yes"]},
        ],
    }
)


def test_failure_outcome_does_not_depend_on_one_row_replace_one() -> None:
    """Replace-one pair, default intercept, R = 2: all rows a = 0 (‖x‖ = 1) vs one row a = 1 (‖x‖ = √2).

    Before the fix the slack 2·eps·n·radius·(d·radius‖θ‖ + 6) used the data's max row norm, so it moved by
    ≈ 2·eps·6n(√2 − 1); the tolerance below, in between, made D always succeed and D' always fail (the
    charge is finite, ≈ 0.17 at α = 8, the loss of the ⊥ outcome ∞). Now the slack uses R, n and the public
    θ̄, B_b only, such a tolerance is refused at check time (public), and at the smallest admitted tolerance
    neither dataset fails.
    """
    n = 400
    ctx = PublicContext(SCHEMA, n, DEFAULT_ORDERS)
    tol = 2 * EPS * 6 * n * (1 + math.sqrt(2)) / 2 / 0.99
    base = {
        "features": ["a"],
        "label": "label",
        "regularization": 1e6,
        "sigma": 20.0,
        "row_norm": 2.0,
        "report": "none",
    }
    params = ObjPertLogisticParams.model_validate({**base, "tolerance": tol})
    curve = ObjPertLogistic().worst_case(params, ctx)
    # finite (at such a tiny τ the coupling slack κ of the lattice b dominates τ_eff and the AMP term grows:
    # the request is refused below anyway)
    assert math.isfinite(curve.values[curve.orders.index(8.0)])
    with pytest.raises(ParamsError, match="tolerance") as info:
        ObjPertLogistic().check(params, ctx)  # refused before the data is read
    assert info.value.field == "tolerance"
    needed = minimum_tolerance(1e6, 20.0, 2.0, 2, n)
    assert tol < needed < 1e-9
    params = ObjPertLogisticParams.model_validate({**base, "tolerance": needed})
    ObjPertLogistic().check(params, ctx)
    labels = np.array([0, 1] * (n // 2))
    d_table = {"a": np.zeros(n), "label": labels}
    dp_table = {"a": np.concatenate([[1.0], np.zeros(n - 1)]), "label": labels}

    def failed(table: dict[str, np.ndarray], seed: int) -> bool:
        try:
            ObjPertLogistic().run(params, ctx, table, Noise.seeded(seed))
        except ObjPertDidNotConverge:
            return True
        return False

    fails_d = sum(failed(d_table, s) for s in range(4))
    fails_dp = sum(failed(dp_table, s) for s in range(4))
    # any DP mechanism with a finite charge must give both outcomes positive probability under both datasets
    # (or none to ⊥ under both): at an admitted tolerance the certified stop is reachable on every dataset
    assert fails_d == fails_dp == 0


def test_failure_channel_is_covered_by_the_charge_add_remove() -> None:
    """Default shape (R = 1, intercept only, d = 1), balanced labels, D (n = 100) vs D' = D + (1, +1).

    b is scalar; the solver is deterministic given b, so P_D(⊥) = P(b ∈ F_D) is computed on a b grid (cells
    counted conservatively: F_D upper, F_D' lower). By data processing, D_α(M(D')‖M(D)) ≥ D_α of the
    Bernoulli(⊥) pair, which must not exceed the charged curve.

    Before the fix the slack used the actual n (effective sensitivity ≈ 3 b-units per row). Now it uses the
    public row bound n̄ = max_rows = 200, R, θ̄ and B_b: at the reviewer's tolerance (below the public
    minimum, refused at check time) ⊥ is certain on both datasets; at the smallest admitted tolerance ⊥
    never happens on the grid. Either way the ⊥ law is the same for D and D'.
    """
    n, lam, sigma, max_rows = 100, 1e6, 10.0, 200
    x, y = np.ones((n, 1)), np.array([1.0, -1.0] * (n // 2))
    xp, yp = np.ones((n + 1, 1)), np.append(y, 1.0)
    b_bound = noise_norm_bound(sigma, 1)
    reviewer_tau = 2 * EPS * (6 * n + 2 * 26.0) / 0.99
    admitted_tau = minimum_tolerance(lam, sigma, 1.0, 1, max_rows)
    assert reviewer_tau < admitted_tau < 1e-10

    schema = SCHEMA.model_copy(update={"neighboring": "add_remove"})
    ctx = PublicContext(schema, None, DEFAULT_ORDERS)
    # the service refuses the reviewer's tolerance before reading data (one feature + intercept: d = 2)
    spec = {"features": ["a"], "label": "label", "regularization": lam, "sigma": sigma, "max_rows": max_rows}
    refused = ObjPertLogisticParams.model_validate({**spec, "tolerance": reviewer_tau})
    with pytest.raises(ParamsError, match="tolerance"):
        ObjPertLogistic().check(refused, ctx)
    needed_d2 = minimum_tolerance(lam, sigma, 1.0, 2, max_rows)
    ObjPertLogistic().check(ObjPertLogisticParams.model_validate({**spec, "tolerance": needed_d2}), ctx)

    def fails(xx: np.ndarray, yy: np.ndarray, b: float, tau: float, cap: int = 30) -> bool:
        try:
            solve_to_tolerance(
                xx, yy, lam, np.array([b]), tau, max_iterations=cap, row_norm=1.0, n_bound=max_rows,
                b_bound=b_bound,
            )
        except ObjPertDidNotConverge:
            return True
        return False

    edges = np.arange(-60.0, 60.0 + 1e-9, 0.2)
    mass = np.diff(stats.norm.cdf(edges / sigma))
    orders = (8.0, 16.0, 32.0)
    for tau, always in ((reviewer_tau, True), (admitted_tau, False)):
        # the cap is not what decides: the same outcome with the production cap of 1000 iterations
        for b in (-30.0, 20.0, 26.0):
            assert fails(x, y, b, tau) == fails(x, y, b, tau, cap=1000) == always
        f_d = np.array([fails(x, y, b, tau) for b in edges])
        f_dp = np.array([fails(xp, yp, b, tau) for b in edges])
        assert np.all(f_d == always)
        assert np.all(f_dp == always)
        if always:  # the public slack alone exceeds 0.99τ: ⊥ on every dataset whenever ‖b‖ ≤ B_b
            bounds = StoppingBounds(max_rows, 1.0, lam, tau, b_bound)
            assert bounds.public_slack(1) > 0.99 * tau
            continue
        p = float(np.sum(mass[f_d[:-1] | f_d[1:]]) + 2 * stats.norm.cdf(-6.0))
        q = float(np.sum(mass[f_dp[:-1] & f_dp[1:]]))
        charged = objpert_curve(ObjPertConfig(lam=lam, sigma=sigma, tau=tau), orders).values
        for alpha, cap in zip(orders, charged, strict=True):
            mixed = q**alpha * p ** (1 - alpha) + (1 - q) ** alpha * (1 - p) ** (1 - alpha)
            lower = math.log(mixed) / (alpha - 1)
            assert lower <= cap


# ----- 3. the data-dependent report's ex-post bound omits ĝ and Ĥ ----------------------------------------


def test_data_dependent_report_covers_the_transcript_including_g_hat() -> None:
    """1-D, D = 20×(1, +1) ∪ {z = (1, −1)} (z a badly fit member), λ = 1, σ = 20, σ₂ = 0.2, σ₃ = 0.04.

    Transcript loss for D vs D \\ z at the exact minimiser (τ = 1e-10, so θ̃ = θ^P and out ≈ θ^P):
    signed ε₁ (Cor 2.3.2) + the Gaussian log-ratio of ĝ (sensitivity f'(θ^P; z)·x) + that of Ĥ.
    Its coverage by the reported bound must be ≥ 1 − ρ-ish; today it is ≈ 0 (ĝ alone costs ≈ 1/(2σ₂²)).
    """
    lam, sigma, s2, s3, tau, rho = 1.0, 20.0, 0.2, 0.04, 1e-10, 0.05
    x = np.ones((21, 1))
    y = np.array([1.0] * 20 + [-1.0])
    zx, zy = np.array([1.0]), -1.0
    events = DATA_DEPENDENT_EVENTS
    assert events == 7  # ball, b, e·x, GOE, w, and now e along ĝ's shift and G along Ĥ's shift
    zq = two_sided_z(rho / events)
    assert lam >= 2 * s3 * goe_norm_bound(1, rho / events)
    rng = np.random.default_rng(11)
    covered = covered_without_h = 0
    trials = 60
    for _ in range(trials):
        b = rng.normal(0.0, sigma, size=1)
        theta = solve_to_tolerance(x, y, lam, b, tau)
        u = x @ theta
        w = logistic_d2(u)
        hess = float(np.sum(w) + lam)
        f1 = logistic_d1(np.asarray(zx @ theta), np.asarray(zy)).item()
        f2 = logistic_d2(np.asarray(zx @ theta)).item()
        mu = float(zx @ zx) / hess
        # member: log p_D/p_{D\z} = −log(1 − f''μ) + f'²‖x‖²/(2σ²) + b̂ᵀg/σ², b̂ = b
        eps1 = -math.log1p(-f2 * mu) + f1**2 / (2 * sigma**2) + float(b[0]) * f1 / sigma**2
        grad_j = (x.T @ logistic_d1(u, y) + lam * theta).item()
        assert abs(eps1) == pytest.approx(
            exact_ex_post_loss(theta, x, y, zx, zy, lam, sigma, member=True), rel=1e-9, abs=1e-12
        )
        e = rng.normal(0.0, s2)
        g_hat = grad_j + e
        delta_g = f1  # ∇ℓ(θ^P; z)
        loss_g = ((g_hat - (grad_j - delta_g)) ** 2 - (g_hat - grad_j) ** 2) / (2 * s2**2)
        zz = rng.normal()
        h_hat = hess + s3 * math.sqrt(2) * zz
        delta_h = f2
        loss_h = ((h_hat - (hess - delta_h)) ** 2 - (h_hat - hess) ** 2) / (2 * 2 * s3**2)
        truth = abs(eps1 + loss_g + loss_h)
        terms = ex_post_terms(
            theta,
            zx[None, :],
            np.array([zy]),
            lam=lam,
            sigma=sigma,
            z_b=zq,
            radius=0.0,
            row_norm=1.0,
            h_hat=np.array([[h_hat]]),
            g_hat=np.array([g_hat]),
            sigma_g=s2,
            z_e=zq,
            sigma_h=s3,
            z_g=zq,
            z_h=zq,
        )
        covered += truth <= terms["total"][0]
        covered_without_h += truth <= terms["total"][0] - terms["report_hessian"][0]
    assert covered >= 0.9 * trials
    assert covered_without_h < 0.9 * trials  # power: Ĥ's own term is needed too, not only ĝ's


# ----- 4. intercept, L, β, λ > β --------------------------------------------------------------------------


def test_intercept_is_inside_the_radius_and_lambda_must_exceed_r_squared_over_four() -> None:
    from mechanisms.learners.features import design_matrix

    ctx = PublicContext(SCHEMA, 3, DEFAULT_ORDERS)
    base = {"features": ["a"], "label": "label", "sigma": 1.0}
    r = math.sqrt(2)
    p = ObjPertLogisticParams.model_validate({**base, "regularization": 0.5001, "row_norm": r})
    x, y = design_matrix(
        p, ctx, {"a": np.array([1.0, -1.0, 0.3]), "label": np.array([1, 0, 1])}, "classification", row_norm=r
    )
    assert x.shape == (3, 2)
    assert np.all(x[:, 1] > 0)  # the intercept column is part of every row
    assert np.all(np.linalg.norm(x, axis=1) <= r * (1 + 4 * EPS))
    assert np.array_equal(y, [1.0, -1.0, 1.0])
    config = p.config("add_remove")
    assert config.lipschitz == r
    assert config.beta == pytest.approx(0.5)
    with pytest.raises(ValueError, match="must exceed"):  # λ = β = R²/4 exactly
        ObjPertLogisticParams.model_validate({**base, "regularization": 0.5, "row_norm": r})
    # β = 1/4 (intercept left out of the radius) would have allowed λ = 0.3
    with pytest.raises(ValueError, match="must exceed"):
        ObjPertLogisticParams.model_validate({**base, "regularization": 0.3, "row_norm": r})
