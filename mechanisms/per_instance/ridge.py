"""Per-instance DP (Wang 2019, "Per-instance differential privacy") of ridge regression releases.

Internal to the service: every value here is a function of the whole data set (leverages depend on every
row, residuals on the leave-one-out fit), so it is a **confidential certificate** (note seed_002 §5.1–§5.2:
returning it raw lets a prober recover XᵀX and θ̂). Nothing in this module is reachable from an endpoint; the
publishable reports are in ``mechanisms.per_instance.adaops`` (post-processing of DP releases only).

Conventions (note seed_002 §0): add/remove neighbours; for a record i of the data set the pair is
(Z_{-i}, z_i). H = XᵀX + λI, θ̂ = H⁻¹Xᵀy; for record i of the full fit h_i = x_iᵀH⁻¹x_i (hat diagonal),
e_i = y_i − x_iᵀθ̂, out-of-sample leverage μ_i = h_i/(1 − h_i) and leave-one-out (PRESS) residual
r_i = e_i/(1 − h_i). θ̂ − θ̂_{-i} = H⁻¹x_i r_i (Sherman–Morrison).

* Gaussian output perturbation with a **fixed** covariance Σ (§3.1, corrected Lemma 2.4): the privacy loss
  is N(η²/2, η²) in both directions with η = ‖Σ^{-1/2}(θ̂(Z) − θ̂(Z'))‖, so the tight (ε, δ)-pDP is the
  analytic Gaussian mechanism (Balle & Wang 2018) at η; RDP of order α is αη²/2.
* One posterior sample (OPS) θ̃ ~ N(θ̂, H⁻¹/γ) (§3.4): the loss depends on θ only through xᵀθ,
  L(θ) = c + (γ/2)(y − xᵀθ)², c = −½log(1+μ) − γr²/(2(1+μ)); the exact profile is that of two univariate
  Gaussians N(r, μ/γ) vs N(r/(1+μ), μ/(γ(1+μ))), evaluated in log space; ``ops_bound`` is the analytic bound
  B(μ, r; γ, δ) valid for both directions. The paper's (4.3) is **not** a valid bound and is not used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import linalg, special

_BISECT = 200


# ----- the analytic Gaussian mechanism ------------------------------------------------------------------


def _log_sub(log_a: np.ndarray, log_b: np.ndarray) -> np.ndarray:
    """exp(log_a) − exp(log_b), clipped at 0, computed as exp(log_a)(1 − exp(log_b − log_a))."""
    with np.errstate(invalid="ignore", over="ignore"):
        diff = log_b - log_a
        out = np.where(diff < 0.0, np.exp(log_a) * -np.expm1(np.minimum(diff, 0.0)), 0.0)
    return np.where(np.isneginf(log_a), 0.0, out)


def gaussian_delta(eta: np.ndarray | float, epsilon: np.ndarray | float) -> np.ndarray:
    """Hockey-stick δ(ε) of N(0, 1) vs N(η, 1): Φ(η/2 − ε/η) − e^ε Φ(−η/2 − ε/η) (η > 0)."""
    eta_a = np.asarray(eta, dtype=np.float64)
    eps_a = np.asarray(epsilon, dtype=np.float64)
    log_a = special.log_ndtr(eta_a / 2.0 - eps_a / eta_a)
    log_b = eps_a + special.log_ndtr(-eta_a / 2.0 - eps_a / eta_a)
    return _log_sub(log_a, log_b)


def _bisect(
    fn: Callable[[np.ndarray], np.ndarray], lo: np.ndarray, hi: np.ndarray, delta: float
) -> np.ndarray:
    """Smallest ε in [lo, hi] with fn(ε) ≤ δ for a non-increasing fn (vectorised bisection, hi side)."""
    for _ in range(_BISECT):
        mid = (lo + hi) / 2.0
        ok = fn(mid) <= delta
        hi = np.where(ok, mid, hi)
        lo = np.where(ok, lo, mid)
        if np.all(hi - lo <= 1e-13 * np.maximum(hi, 1e-300)):
            break
    return hi


def agm_epsilon(eta: np.ndarray | float, delta: float) -> np.ndarray:
    """The smallest ε ≥ 0 with δ_η(ε) ≤ δ (tight (ε, δ) of a Gaussian with Mahalanobis shift η); η = 0 gives
    0 and η = +∞ gives +∞. Vectorised over η."""
    if not 0.0 < delta < 1.0:
        raise ValueError("delta must be in (0, 1)")
    eta_a = np.atleast_1d(np.asarray(eta, dtype=np.float64))
    out = np.zeros_like(eta_a)
    out[np.isinf(eta_a)] = math.inf
    live = np.isfinite(eta_a) & (eta_a > 0.0)
    if np.any(live):
        e = eta_a[live]
        lo = np.zeros_like(e)
        hi = e * e / 2.0 + e * math.sqrt(2.0 * math.log(1.0 / delta)) + 1e-12  # P(L > hi) ≤ δ
        need = gaussian_delta(e, lo) > delta
        res = _bisect(lambda t: gaussian_delta(e, t), lo, hi, delta)
        out[live] = np.where(need, res, 0.0)
    return out if np.ndim(eta) else out.reshape(())


def classical_gaussian_epsilon(eta: np.ndarray | float, delta: float) -> np.ndarray:
    """η·sqrt(2 log(1.25/δ)) (Dwork–Roth Thm A.1): valid **only** where the result is ≤ 1; +∞ elsewhere so it
    is never mistaken for a bound (pitfall 2)."""
    value = np.asarray(eta, dtype=np.float64) * math.sqrt(2.0 * math.log(1.25 / delta))
    return np.where(value <= 1.0, value, math.inf)


def agm_sigma(sensitivity: float, epsilon: float, delta: float) -> float:
    """The smallest σ (to 1e-12 relative, rounded up) with AGM ε(sensitivity/σ, δ) ≤ ε."""
    lo, hi = 1e-6 * sensitivity, sensitivity * (1.0 + math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon) * 2.0
    while float(agm_epsilon(sensitivity / hi, delta)) > epsilon:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if float(agm_epsilon(sensitivity / mid, delta)) <= epsilon:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-13 * hi:
            break
    return math.nextafter(hi * (1.0 + 1e-12), math.inf)


# ----- ridge leave-one-out quantities --------------------------------------------------------------------


@dataclass(frozen=True)
class RidgeFit:
    """The full-data ridge fit and its per-record leave-one-out quantities (confidential)."""

    theta: np.ndarray  # θ̂ (full data)
    r_factor: np.ndarray  # R of the thin QR of [X; √λ I]: H = RᵀR
    leverage: np.ndarray  # h_i ∈ [0, 1]
    fitted_residual: np.ndarray  # e_i
    lam: float

    @property
    def singular(self) -> np.ndarray:
        """Records alone spanning a direction (h_i = 1, only possible for λ = 0): pDP +∞."""
        return np.asarray(self.leverage >= 1.0 - 1e-12)

    @property
    def mu(self) -> np.ndarray:
        """Out-of-sample leverage μ_i = h_i/(1 − h_i) (+∞ for singular records)."""
        with np.errstate(divide="ignore"):
            return np.where(self.singular, math.inf, self.leverage / np.maximum(1.0 - self.leverage, 1e-300))

    @property
    def loo_residual(self) -> np.ndarray:
        """PRESS residual r_i = e_i/(1 − h_i) (+∞ for singular records)."""
        return np.where(
            self.singular, math.inf, self.fitted_residual / np.maximum(1.0 - self.leverage, 1e-300)
        )

    def solve(self, v: np.ndarray) -> np.ndarray:
        """H⁻¹v for v of shape (d,) or (d, k)."""
        w = linalg.solve_triangular(self.r_factor, v, trans="T", lower=False)
        return np.asarray(linalg.solve_triangular(self.r_factor, w, lower=False))

    def loo_thetas(self, x: np.ndarray) -> np.ndarray:
        """θ̂_{-i} = θ̂ − H⁻¹x_i r_i for every record (rows)."""
        shift = self.solve(x.T).T * self.loo_residual[:, None]
        return np.asarray(self.theta[None, :] - shift)

    @property
    def lambda_min(self) -> float:
        """λ_min(H) (from the singular values of R)."""
        return float(linalg.svdvals(self.r_factor)[-1] ** 2)


def ridge_fit(x: np.ndarray, y: np.ndarray, lam: float) -> RidgeFit:
    """Leverages from the thin QR of [X; √λ I] (stable: H is never inverted), θ̂ from the same factor.
    Raises ValueError if H is singular (λ = 0 and X rank-deficient)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n, d = x.shape
    if lam < 0.0:
        raise ValueError("lambda must be ≥ 0")
    aug = np.vstack([x, math.sqrt(lam) * np.eye(d)])
    q, r = np.linalg.qr(aug, mode="reduced")
    diag = np.abs(np.diag(r))
    if diag.min() <= 1e-12 * max(diag.max(), 1.0):
        raise ValueError("H = XᵀX + λI is singular")
    q1 = q[:n]
    leverage = np.minimum(np.einsum("ij,ij->i", q1, q1), 1.0)
    theta = linalg.solve_triangular(r, q1.T @ y, lower=False)
    return RidgeFit(
        theta=np.asarray(theta),
        r_factor=np.asarray(r),
        leverage=np.asarray(leverage),
        fitted_residual=np.asarray(y - x @ theta),
        lam=float(lam),
    )


def outsider_terms(fit: RidgeFit, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(μ, r) for targets z = (x, y) not in the data: μ = xᵀH⁻¹x, r = y − xᵀθ̂ (pair (Z, [Z, z]))."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    w = linalg.solve_triangular(fit.r_factor, x.T, trans="T", lower=False)
    mu = np.einsum("ij,ij->j", w, w)
    return np.asarray(mu), np.asarray(np.atleast_1d(y) - x @ fit.theta)


# ----- Gaussian output perturbation with a fixed covariance (§3.1–§3.3) -----------------------------------


def output_perturbation_eta(fit: RidgeFit, x: np.ndarray, covariance: np.ndarray | float) -> np.ndarray:
    """η_i = ‖Σ^{-1/2}(θ̂ − θ̂_{-i})‖ = |r_i|·‖L⁻¹H⁻¹x_i‖ (Σ = LLᵀ fixed, or σ² I for a scalar σ given as
    ``covariance=σ²``). +∞ for singular records."""
    shift = fit.solve(np.asarray(x, dtype=np.float64).T)  # columns H⁻¹x_i
    cov = np.asarray(covariance, dtype=np.float64)
    if cov.ndim == 0:
        norms = np.linalg.norm(shift, axis=0) / math.sqrt(float(cov))
    else:
        chol = linalg.cholesky(cov, lower=True)
        norms = np.linalg.norm(linalg.solve_triangular(chol, shift, lower=True), axis=0)
    r = fit.loo_residual
    with np.errstate(invalid="ignore"):
        eta = np.abs(r) * norms
    return np.where(fit.singular, math.inf, eta)


def output_perturbation_pdp(
    x: np.ndarray, y: np.ndarray, lam: float, covariance: np.ndarray | float, delta: float
) -> np.ndarray:
    """Per-record (ε_i, δ)-pDP of θ̂(Z) + N(0, Σ) for the pairs (Z_{-i}, z_i): AGM ε at η_i (exact)."""
    fit = ridge_fit(x, y, lam)
    return agm_epsilon(output_perturbation_eta(fit, x, covariance), delta)


def isotropic_sensitivity(fit: RidgeFit, x: np.ndarray) -> np.ndarray:
    """Δ_i = |r_i|·‖H⁻¹x_i‖ (ℓ2 per-instance sensitivity of ridge, A = I)."""
    return output_perturbation_eta(fit, x, 1.0)


def certified_leverage_gain(lambda_min_h: float) -> float:
    """g(ℓ) ≥ sup_{‖x‖≤1} ‖H⁻¹x‖/(1 + xᵀH⁻¹x) for λ_min(H) = ℓ: 1/(2√ℓ) if ℓ ≤ 1, else 1/(1+ℓ)."""
    return 1.0 / (2.0 * math.sqrt(lambda_min_h)) if lambda_min_h <= 1.0 else 1.0 / (1.0 + lambda_min_h)


def pdp_for_all_sensitivity(fit: RidgeFit, x: np.ndarray) -> tuple[float, float]:
    """(heuristic sup, certified upper bound) of the isotropic sensitivity over all members and all additions
    ‖x‖ ≤ 1, |y| ≤ 1 (note §4.1 step 3). The heuristic evaluates (1+|xᵀθ̂|)‖H⁻¹x‖/(1+xᵀH⁻¹x) on the
    eigenvectors of H, θ̂/‖θ̂‖, the data rows and each eigenvector rotated toward θ̂ (a lower estimate of
    the sup); the certified value is (1+‖θ̂‖)·g(λ_min(H))."""
    d = fit.theta.size
    h = fit.r_factor.T @ fit.r_factor
    _, vecs = np.linalg.eigh(h)
    norm = float(np.linalg.norm(fit.theta))
    direction = fit.theta / norm if norm > 0 else vecs[:, -1]
    angles = np.linspace(0.0, np.pi, 65)
    # deterministic probes: every eigenvector rotated toward θ̂/‖θ̂‖ (the sup's two competing directions)
    probes = (np.cos(angles)[:, None, None] * vecs.T[None, :, :]) + (
        np.sin(angles)[:, None, None] * direction[None, None, :]
    )
    cands = [vecs.T, np.asarray(x, dtype=np.float64), probes.reshape(-1, d), direction[None, :]]
    c = np.vstack(cands)
    c = c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-300)
    mu, _ = outsider_terms(fit, c, np.zeros(c.shape[0]))
    hx = fit.solve(c.T)
    value = (1.0 + np.abs(c @ fit.theta)) * np.linalg.norm(hx, axis=0) / (1.0 + mu)
    best = float(value.max()) if value.size else 0.0
    members = isotropic_sensitivity(fit, x)
    certified = (1.0 + norm) * certified_leverage_gain(fit.lambda_min)
    return max(best, float(np.max(members))), max(certified, float(np.max(members)))


def dp_sensitivity_range(n: int, lam: float) -> tuple[float, float]:
    """Global ℓ2 sensitivity of ridge (‖x‖ ≤ 1, |y| ≤ 1, add/remove, n records): [lower, upper] =
    [(1 + √n/(2√λ))/(2λ + 1), (1 + √n/(2√λ))·g(λ)] (note §4.1 step 4)."""
    base = 1.0 + math.sqrt(n) / (2.0 * math.sqrt(lam))
    return base / (2.0 * lam + 1.0), base * certified_leverage_gain(lam)


# ----- OPS (§3.4) ---------------------------------------------------------------------------------------


def _log_two_sided_tail(mean: np.ndarray, std: np.ndarray, rho: np.ndarray) -> np.ndarray:
    """log P(|N(mean, std²)| > ρ)."""
    return np.asarray(
        np.logaddexp(special.log_ndtr((-rho - mean) / std), special.log_ndtr((mean - rho) / std))
    )


def _log_interval_prob(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """log(Φ(hi) − Φ(lo)) for lo ≤ hi, accurate in both tails (log space)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        right = special.log_ndtr(-lo) + np.log1p(-np.exp(special.log_ndtr(-hi) - special.log_ndtr(-lo)))
        left = special.log_ndtr(hi) + np.log1p(-np.exp(special.log_ndtr(lo) - special.log_ndtr(hi)))
        mid = np.log1p(-(special.ndtr(lo) + special.ndtr(-hi)))
    return np.asarray(np.where(lo >= 0.0, right, np.where(hi <= 0.0, left, mid)))


def ops_constant(gamma: float | np.ndarray, mu: np.ndarray, r: np.ndarray) -> np.ndarray:
    """c = −½log(1+μ) − γr²/(2(1+μ)) < 0: L(θ) = c + (γ/2)(y − xᵀθ)²."""
    return np.asarray(-0.5 * np.log1p(mu) - gamma * r * r / (2.0 * (1.0 + mu)))


def ops_delta_forward(gamma: float, mu: np.ndarray, r: np.ndarray, epsilon: np.ndarray) -> np.ndarray:
    """δ→(ε): P_{A(Z)}(S) ≤ e^ε P_{A([Z,z])}(S) + δ→(ε)."""
    c = ops_constant(gamma, mu, r)
    rho = np.sqrt(2.0 * np.maximum(epsilon - c, 0.0) / gamma)
    s1 = np.sqrt(mu / gamma)
    s2 = np.sqrt(mu / (1.0 + mu) / gamma)
    log_a = _log_two_sided_tail(r, s1, rho)
    log_b = epsilon + _log_two_sided_tail(r / (1.0 + mu), s2, rho)
    return _log_sub(log_a, log_b)


def ops_delta_backward(gamma: float, mu: np.ndarray, r: np.ndarray, epsilon: np.ndarray) -> np.ndarray:
    """δ←(ε): P_{A([Z,z])}(S) ≤ e^ε P_{A(Z)}(S) + δ←(ε); 0 for ε ≥ −c."""
    c = ops_constant(gamma, mu, r)
    kappa = np.sqrt(2.0 * np.maximum(-c - epsilon, 0.0) / gamma)
    s1 = np.sqrt(mu / gamma)
    s2 = np.sqrt(mu / (1.0 + mu) / gamma)
    r2 = r / (1.0 + mu)
    log_with = _log_interval_prob((-kappa - r2) / s2, (kappa - r2) / s2)
    log_without = epsilon + _log_interval_prob((-kappa - r) / s1, (kappa - r) / s1)
    return np.where(epsilon >= -c, 0.0, _log_sub(log_with, log_without))


def ops_bound(gamma: float, mu: np.ndarray | float, r: np.ndarray | float, delta: float) -> np.ndarray:
    """B(μ, r; γ, δ) = ½log(1+μ) + γμr²/(2(1+μ)) + μ log(1/δ) + |r|·sqrt(2γμ log(1/δ)): a certified (ε, δ)
    bound for both directions, non-decreasing in μ, |r| and γ (note §3.4)."""
    mu_a = np.asarray(mu, dtype=np.float64)
    r_a = np.abs(np.asarray(r, dtype=np.float64))
    ld = math.log(1.0 / delta)
    with np.errstate(invalid="ignore"):
        value = (
            0.5 * np.log1p(mu_a)
            + gamma * mu_a * r_a * r_a / (2.0 * (1.0 + mu_a))
            + mu_a * ld
            + r_a * np.sqrt(2.0 * gamma * mu_a * ld)
        )
    return np.where(np.isinf(mu_a) | np.isinf(r_a), math.inf, value)


def ops_epsilon(gamma: float, mu: np.ndarray | float, r: np.ndarray | float, delta: float) -> np.ndarray:
    """Exact (ε, δ)-pDP of OPS: max(ε→(δ), ε←(δ)), each the smallest ε ≥ 0 with δ_dir(ε) ≤ δ.
    +∞ for μ = +∞."""
    if not 0.0 < delta < 1.0:
        raise ValueError("delta must be in (0, 1)")
    mu_a = np.atleast_1d(np.asarray(mu, dtype=np.float64))
    r_a = np.broadcast_to(np.atleast_1d(np.asarray(r, dtype=np.float64)), mu_a.shape).copy()
    out = np.full(mu_a.shape, math.inf)
    live = np.isfinite(mu_a) & np.isfinite(r_a)
    zero = live & (mu_a <= 0.0)
    out[zero] = 0.0
    live &= mu_a > 0.0
    if np.any(live):
        m, rr = mu_a[live], r_a[live]
        lo = np.zeros_like(m)
        hi = ops_bound(gamma, m, rr, delta) * 1.01 + 1e-9
        bad = ops_delta_forward(gamma, m, rr, hi) > delta
        while np.any(bad):
            hi = np.where(bad, hi * 2.0, hi)
            bad = ops_delta_forward(gamma, m, rr, hi) > delta
        fwd = _bisect(lambda t: ops_delta_forward(gamma, m, rr, t), lo, hi, delta)
        fwd = np.where(ops_delta_forward(gamma, m, rr, lo) <= delta, 0.0, fwd)
        hi_b = -ops_constant(gamma, m, rr)
        bwd = _bisect(lambda t: ops_delta_backward(gamma, m, rr, t), lo.copy(), hi_b, delta)
        bwd = np.where(ops_delta_backward(gamma, m, rr, lo) <= delta, 0.0, bwd)
        out[live] = np.maximum(fwd, bwd)
    return out if np.ndim(mu) or np.ndim(r) else out.reshape(())


def ops_record_epsilons(x: np.ndarray, y: np.ndarray, lam: float, gamma: float, delta: float) -> np.ndarray:
    """Exact per-record (ε_i, δ)-pDP of OPS(γ, λ) for the pairs (Z_{-i}, z_i) (confidential)."""
    fit = ridge_fit(x, y, lam)
    return ops_epsilon(gamma, fit.mu, fit.loo_residual, delta)


def ops_kl(gamma: float, mu: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(KL(A(Z)‖A([Z,z])), KL(A([Z,z])‖A(Z)))."""
    fwd = 0.5 * (mu - np.log1p(mu) + gamma * mu * r * r / (1.0 + mu))
    bwd = 0.5 * (np.log1p(mu) - mu / (1.0 + mu) + gamma * mu * r * r / (1.0 + mu) ** 2)
    return np.asarray(fwd), np.asarray(bwd)


def _renyi_normal(alpha: float, m1: np.ndarray, v1: np.ndarray, m2: np.ndarray, v2: np.ndarray) -> np.ndarray:
    va = alpha * v2 + (1.0 - alpha) * v1
    with np.errstate(invalid="ignore", divide="ignore"):
        value = (
            0.5 * np.log(v2 / v1)
            + np.log(v2 / va) / (2.0 * (alpha - 1.0))
            + alpha * (m1 - m2) ** 2 / (2.0 * va)
        )
    return np.where(va > 0.0, value, math.inf)


def ops_renyi(gamma: float, mu: np.ndarray, r: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) Rényi divergences of order α > 1; forward is +∞ for α ≥ 1 + 1/μ."""
    v1, v2 = mu / gamma, mu / (1.0 + mu) / gamma
    r2 = r / (1.0 + mu)
    return _renyi_normal(alpha, r, v1, r2, v2), _renyi_normal(alpha, r2, v2, r, v1)


def ops_loss(gamma: float, mu: np.ndarray, r: np.ndarray, residual_at_sample: np.ndarray) -> np.ndarray:
    """The privacy-loss random variable L(θ) = log p(θ|Z)/p(θ|[Z,z]) = c + (γ/2)(y − xᵀθ)²."""
    return np.asarray(ops_constant(gamma, mu, r) + 0.5 * gamma * residual_at_sample**2)
