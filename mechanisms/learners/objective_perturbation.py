"""Objective perturbation (ObjPert) for ℓ2-regularised logistic regression, with its Rényi-DP bound.

Source: Redberg 2023 (PhD thesis, UCSB; cited "thesis"): chapter 4 (Redberg, Koskela & Wang 2023, NeurIPS)
for the privacy bounds, chapter 2 (Redberg & Wang 2021) for the per-instance reports
(``mechanisms.per_instance.reports``). Proofs and corrections:
docs/privacy/objective_perturbation.md#objective-perturbation.

Mechanism (thesis §4.4, Alg 7 with C = L, i.e. approximate minima perturbation without clipping)
---------------------------------------------------------------------------------------------------
    L^P(θ) = Σ_i f(x_iᵀθ; y_i) + (λ/2)‖θ‖² + bᵀθ,   b ~ N(0, σ² I_d),   f(u; y) = log(1 + e^{−yu})
    θ̃  : any point with ‖∇L^P(θ̃)‖₂ ≤ τ (exact full gradient, float64, with a rounding margin)
    out = θ̃ + N(0, σ_out² I_d)

Assumptions, all enforced from public information (thesis §4.3,
docs/privacy/objective_perturbation.md#objpert-conditions): GLM loss; rows ‖x_i‖
≤ R by per-row clipping (``mechanisms.learners.features.design_matrix``, the intercept column included
**before** clipping, so the bias is inside the radius: β := sup f''·R², L := sup|f'|·R); labels ±1; Θ = R^d
(unconstrained); logistic f is convex, |f'| ≤ 1, 0 ≤ f'' ≤ 1/4, so L = R and β = R²/4; **λ > β** strictly.
The logistic loss never needs clipping here (|f'|‖x‖ ≤ R = L), so Alg 7's ℓ_C = ℓ.

Privacy (add/remove neighbours, thesis §4.3)
--------------------------------------------
* Thm 4.3.2 (RDP of exact ObjPert, GLM) in closed form
  (docs/privacy/objective_perturbation.md#objpert-rdp-charge; verified against quadrature in
  tests/unit/test_objective_perturbation.py): with a = −log(1 − β/λ),
      ε(α) = a + αL²/(2σ²) + log(2Φ((α − 1)L/σ))/(α − 1).
* Thm 4.4.1 / C.6.1 (approximate minimizer): given θ^P = argmin L^P, ‖θ̃ − θ^P‖ ≤ τ/λ by λ-strong
  convexity, so θ̃ moves by ≤ 2τ/λ between neighbours given θ^P; the output noise is a Gaussian mechanism
  of sensitivity 2τ/λ composed adaptively: + α(2τ/λ)²/(2σ_out²) = 2τ²α/(σ_out²λ²). (The thesis's
  App. C.7 uses sensitivity γ/λ, which under-charges by 4×; 2τ/λ, from Thm C.6.1, is used.)

Replace-one neighbours (D = D₀ + z vs D₀ + z′), derived here from the same change of variables:
``log p_D(θ)/p_D′(θ) = log det H_D/det H_D′ + (‖b′‖² − ‖b‖²)/(2σ²)`` with b′ = b + v,
v = ∇ℓ(θ; z) − ∇ℓ(θ; z′), ‖v‖ ≤ 2L. H_D = H₀ + f''_z xxᵀ, H_D′ = H₀ + f''_{z′}x′x′ᵀ with H₀ ⪰ λI, so the
log-det ratio is within ±log(1 + β/λ) ≤ a. The linear term is ≤ (|f'_z||bᵀx| + |f'_{z′}||bᵀx′|)/σ², a sum
of two (correlated) |N(0, s²)|-dominated variables, s = L/σ; Cauchy–Schwarz on the exponential moment
gives E e^{t(A+B)} ≤ E e^{2t s|Z|}. Altogether ε(α) ≤ a + 2αL²/σ² + log(2Φ(2(α − 1)L/σ))/(α − 1), i.e.
the add/remove formula with L → 2L. It is ≥ the Gaussian lower bound α(2L)²/(2σ²) (linear loss, Lemma
4.3.4) and the MC audit checks it on a replace-one pair. The output step is unchanged (θ̃ and θ̃′ are
both within τ/λ of θ^P).

Rules kept (docs/privacy/rules.md#rules, rules 1–4): the charge is data-independent (realized = worst case; no
iteration counts, gradient norms, objective values or timings are released); b and the output noise are drawn
once; the solver is never restarted with a larger tolerance or smaller noise; if it cannot reach the tolerance
within a generous iteration cap it raises ``ObjPertDidNotConverge`` and the service commits the worst case.

The failure outcome is visible to the analyst, so it must not depend on the data beyond an event of
negligible, data-independent probability (docs/privacy/objective_perturbation.md#objpert-failure-channel). The
stopping rule's rounding slack is therefore built from public constants only (``StoppingBounds``): the row
bound R (not max‖x_i‖), a public row count n̄ (n under replace_one, the declared ``max_rows`` under
add_remove), ‖θ‖ ≤ θ̄ = (n̄R + B_b + τ)/λ (stationarity of the sum-scale objective at any certified stop) and
‖b‖ ≤ B_b = σ(√d + 20) (fails with probability ≤ e^{−200}; then the actual ‖b‖ is used, still sound). The
request is refused at check time unless 0.99τ ≥ 10·S_pub (``minimum_tolerance``), so the certified stop is
reachable on every dataset.
Exact ObjPert (no output noise) is not offered: an iterative solver has no exact minimizer.
Huber-SVM is not offered: its f'' is discontinuous, and the change-of-variables proof needs a twice
differentiable f (the thesis leaves the piecewise-C² case "as an exercise", §4.4).

Finite precision (docs/privacy/finite_precision_learners.md#fp-learners, Lemma COUPLE and Theorem
OBJPERT-GRID): b is a discrete Gaussian on a fine public lattice (the quantile coupling of a continuous
Gaussian, within 3γ_b per coordinate, so the solver's certificate holds for the continuous b with τ + κ), and
the output is released on a public grid with exact discrete Gaussian noise (``mechanisms.noise``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import numpy as np
from pydantic import ConfigDict, Field, StrictFloat, StrictInt, model_validator
from scipy import linalg, special, stats

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve
from mechanisms.accounting.orders import validate_orders
from mechanisms.base import ParamsError, ProgressFn, PublicContext, no_progress
from mechanisms.learners.features import FeatureSpec
from mechanisms.noise import Grid, Noise
from mechanisms.noise.learners import discrete_gaussian_std
from mechanisms.params import NoiseStd

Neighboring = Literal["replace_one", "add_remove"]
ReportKind = Literal["none", "public", "data_dependent"]

#: default output-noise factor: σ_out = OUTPUT_NOISE_FACTOR·τ/λ makes the AMP term 2α/factor² = 2e-6·α.
OUTPUT_NOISE_FACTOR = 1000.0
#: the stopping rule uses this fraction of τ, minus rounding: a safety margin so that float error can never
#: certify a point outside the τ-ball that the τ/λ sensitivity of thesis Thm C.6.1 needs.
TOLERANCE_MARGIN = 0.99
#: ‖b‖ ≤ σ(√d + NOISE_NORM_T) except with probability ≤ e^{−T²/2} = e^{−200} (Gaussian concentration).
NOISE_NORM_T = 20.0
#: a request is admitted only if TOLERANCE_MARGIN·τ ≥ SLACK_FACTOR × the public rounding slack.
SLACK_FACTOR = 10.0
#: rows are checked against R·(1 + ROW_NORM_TOLERANCE) (``design_matrix`` clips to R up to rounding).
ROW_NORM_TOLERANCE = 1e-12
_EPS = float(np.finfo(np.float64).eps)
#: public bound on the dimension d (fit_objpert refuses larger): √d ≤ 2^8 in the d-free grid terms below.
D_MAX = 1 << 16
#: the objective noise b lives on γ_b = the largest power of two ≤ σ·2^−OBJECTIVE_GRID_BITS; b = float(Z)·γ_b
#: (exact while |Z| < 2^53; beyond, the float rounding ≤ 513·t_b·γ_b·2^−53 is part of the coupling slack).
OBJECTIVE_GRID_BITS = 50
#: the released output lives on γ_o = the largest power of two ≤ (2τ/λ)·2^−OUTPUT_GRID_BITS (coarser if the
#: output noise would exceed 2^50 grid units).
OUTPUT_GRID_BITS = 22
_MAX_OUTPUT_UNITS = 1 << 50


class ObjPertDidNotConverge(RuntimeError):
    """The solver did not reach ‖∇L^P‖ ≤ τ; the worst case is charged (message is data-independent)."""


# ----- logistic loss -------------------------------------------------------------------------------------


def logistic_loss(u: np.ndarray, y: np.ndarray) -> np.ndarray:
    """f(u; y) = log(1 + e^{−yu}), stable."""
    result: np.ndarray = np.logaddexp(0.0, -y * u)
    return result


def logistic_d1(u: np.ndarray, y: np.ndarray) -> np.ndarray:
    """f'(u; y) = −y·σ(−yu); |f'| ≤ 1 for |y| ≤ 1."""
    result: np.ndarray = -y * special.expit(-y * u)
    return result


def logistic_d2(u: np.ndarray) -> np.ndarray:
    """f''(u) = σ(u)σ(−u) ∈ (0, 1/4] (labels ±1)."""
    result: np.ndarray = special.expit(u) * special.expit(-u)
    return result


# ----- privacy bounds ------------------------------------------------------------------------------------


def _alphas(orders: Sequence[float] | np.ndarray) -> np.ndarray:
    return np.asarray(orders, dtype=np.float64)


def objpert_rdp(
    orders: Sequence[float] | np.ndarray, sigma: float, beta: float, lam: float, lipschitz: float
) -> np.ndarray:
    """Thm 4.3.2 of the thesis, closed form (docs/privacy/objective_perturbation.md#objpert-rdp-charge):
    −log(1−β/λ) + αL²/(2σ²) + log(2Φ((α−1)L/σ))/(α−1).

    Needs 0 ≤ β < λ, σ > 0, L ≥ 0, α > 1. log Φ by ``scipy.stats.norm.logcdf``.
    """
    if not (sigma > 0 and math.isfinite(sigma)):
        raise ValueError("sigma must be finite and > 0")
    if not (0.0 <= beta < lam and math.isfinite(lam)):
        raise ValueError("objective perturbation needs 0 ≤ β < λ (λ > β strictly)")
    if not (lipschitz >= 0 and math.isfinite(lipschitz)):
        raise ValueError("the Lipschitz constant must be finite and ≥ 0")
    alphas = _alphas(orders)
    if np.any(alphas <= 1.0):
        raise ValueError("orders must be > 1")
    a = -math.log1p(-beta / lam)
    s = lipschitz / sigma
    half_normal = (math.log(2.0) + stats.norm.logcdf((alphas - 1.0) * s)) / (alphas - 1.0)
    result: np.ndarray = a + alphas * s * s / 2.0 + half_normal
    return result


def amp_rdp(orders: Sequence[float] | np.ndarray, tau: float, lam: float, sigma_out: float) -> np.ndarray:
    """Thm 4.4.1 / C.6.1 output step: Gaussian RDP with sensitivity 2τ/λ, α(2τ/λ)²/(2σ_out²)."""
    result: np.ndarray = _alphas(orders) * (2.0 * tau / lam) ** 2 / (2.0 * sigma_out**2)
    return result


def objective_grid(sigma: float) -> Grid:
    """γ_b: the largest power of two ≤ σ·2^−50 (b = γ_b·Z, Z ~ N_Z(0, t_b²)^d, t_b = ⌈σ/γ_b⌉ ≤ 2^51)."""
    return Grid(math.frexp(sigma)[1] - 1 - OBJECTIVE_GRID_BITS)


def objective_noise_units(sigma: float) -> int:
    """t_b = ⌈σ/γ_b⌉: the integer standard deviation of b in grid units (t_b·γ_b ≥ σ)."""
    return math.ceil(Fraction(sigma) / Fraction(objective_grid(sigma).granularity))


def coupling_slack(sigma: float) -> float:
    """κ ≥ ‖b − b_c‖ for the coordinatewise quantile coupling of b (lattice) with b_c ~ N(0, (t_bγ_b)²I_d)
    (Lemma COUPLE, docs/privacy/finite_precision_learners.md#lemma-couple: ≤ 3γ_b per coordinate) plus the
    float conversion of b (≤ 514·σ_b·2^−53 per coordinate, the sampler's support being |Z| ≤ 513·t_b), for
    every d ≤ D_MAX: √D_MAX·(3γ_b + 514·σ_b·2^−53), σ_b = t_bγ_b ≤ σ + γ_b."""
    granularity = objective_grid(sigma).granularity
    per_coordinate = 3.0 * granularity + 514.0 * (sigma + granularity) * 2.0**-53
    return math.nextafter(per_coordinate * 256.0 * (1.0 + 2.0**-40), math.inf)


def effective_tolerance(tau: float, sigma: float) -> float:
    """τ_eff = τ + κ: θ̃ is a τ_eff-approximate minimiser of the objective with the continuous b_c."""
    return math.nextafter(tau + coupling_slack(sigma), math.inf)


def output_grid(tau: float, lam: float, sigma: float, sigma_out: float) -> Grid:
    """γ_o: the largest power of two ≤ (2τ_eff/λ)·2^−22, made coarser until σ_out/γ_o ≤ 2^50 (public)."""
    shift = 2.0 * effective_tolerance(tau, sigma) / lam
    exponent = math.frexp(shift)[1] - 1 - OUTPUT_GRID_BITS
    while sigma_out / math.ldexp(1.0, exponent) > _MAX_OUTPUT_UNITS:
        exponent += 1
    return Grid(exponent)


def output_noise_units(tau: float, lam: float, sigma: float, sigma_out: float) -> int:
    """t_o = ⌈σ_out/γ_o⌉ ≥ 1: the integer standard deviation of the output noise in grid units."""
    granularity = output_grid(tau, lam, sigma, sigma_out).granularity
    return max(1, math.ceil(Fraction(sigma_out) / Fraction(granularity)))


def amp_grid_rdp(
    orders: Sequence[float] | np.ndarray, tau: float, lam: float, sigma: float, sigma_out: float
) -> np.ndarray:
    """The output step on the grid: α·Δ_o²/(2t_o²), Δ_o = 2τ_eff/(λγ_o) + √D_MAX (rounded up) the ℓ2
    distance of round(θ̃/γ_o) and round(θ̃′/γ_o) given θ^P (CKS 2020, discrete Gaussian RDP)."""
    grid = output_grid(tau, lam, sigma, sigma_out)
    shift = 2.0 * effective_tolerance(tau, sigma) / lam
    units = math.nextafter(float(Fraction(shift) / Fraction(grid.granularity)) + 256.0, math.inf)
    t_o = float(output_noise_units(tau, lam, sigma, sigma_out))
    result: np.ndarray = _alphas(orders) * units * units / (2.0 * t_o * t_o)
    return result


def gaussian_hockey_stick(sensitivity: float, sigma: float, eps: float) -> float:
    """H_{e^ε}(N(Δ,σ²)‖N(0,σ²)) = Φ(Δ/(2σ) − εσ/Δ) − e^ε Φ(−Δ/(2σ) − εσ/Δ) (Balle & Wang 2018, Thm 8),
    in log space."""
    if sensitivity == 0.0:
        return 0.0
    u = sensitivity / (2.0 * sigma)
    v = eps * sigma / sensitivity
    log_a = float(stats.norm.logcdf(u - v))
    log_b = eps + float(stats.norm.logcdf(-u - v))
    if log_b >= log_a:
        return 0.0
    return math.exp(log_a) * -math.expm1(log_b - log_a)


def objpert_delta(eps: float, sigma: float, beta: float, lam: float, lipschitz: float) -> float:
    """Thm 4.3.1 of the thesis (signs corrected as in its App. C.4.5): the privacy profile δ(ε) of exact
    ObjPert (add/remove).

    ε̃ = ε − a, ε̂ = ε − a − c (a = −log(1−β/λ), c = L²/(2σ²)), P = N(L,σ²), Q = N(0,σ²):
    δ = 2H_{e^{ε̃}}(P‖Q) if ε̂ ≥ 0, else (1 − e^{ε̂}) + e^{ε̂}·2H_{e^c}(P‖Q).
    """
    a = -math.log1p(-beta / lam)
    c = lipschitz**2 / (2.0 * sigma**2)
    eps_hat = eps - a - c
    if eps_hat >= 0.0:
        return min(1.0, 2.0 * gaussian_hockey_stick(lipschitz, sigma, eps - a))
    profile = -math.expm1(eps_hat) + math.exp(eps_hat) * 2.0 * gaussian_hockey_stick(lipschitz, sigma, c)
    return min(1.0, profile)


def _pad(values: np.ndarray) -> tuple[float, ...]:
    """Round up: relative 1e-12 plus 1e-15 absolute covers the few ulps of logcdf/log1p/arithmetic."""
    padded = values * (1.0 + 1e-12) + 1e-15
    return tuple(float(math.nextafter(float(v), math.inf)) for v in padded)


# ----- configuration (public) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjPertConfig:
    """Public parameters of one ObjPert (AMP) training run on rows ‖x‖ ≤ ``row_norm``.

    ``sigma_out`` None ⇒ OUTPUT_NOISE_FACTOR·τ/λ.
    """

    lam: float
    sigma: float
    tau: float = 1e-6
    sigma_out: float | None = None
    row_norm: float = 1.0
    neighboring: Neighboring = "add_remove"
    max_iterations: int = 1000
    max_rows: int | None = None

    def __post_init__(self) -> None:
        for name in ("lam", "sigma", "tau", "row_norm"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError("max_rows must be ≥ 1")
        if self.sigma_out is not None and not (math.isfinite(self.sigma_out) and self.sigma_out > 0):
            raise ValueError("sigma_out must be finite and > 0")
        if not self.lam > self.beta:
            raise ValueError(f"λ must exceed β = row_norm²/4 = {self.beta!r} (thesis Thm 4.3.2 needs λ > β)")

    @property
    def lipschitz(self) -> float:
        """L = sup|f'|·R = R for the logistic loss."""
        return self.row_norm

    @property
    def beta(self) -> float:
        """β = sup f''·R² = R²/4 (largest eigenvalue of ∇²ℓ)."""
        return self.row_norm**2 / 4.0

    @property
    def output_sigma(self) -> float:
        return self.sigma_out if self.sigma_out is not None else OUTPUT_NOISE_FACTOR * self.tau / self.lam

    def stopping_bounds(self, n: int, d: int) -> StoppingBounds:
        """The public constants of the stopping rule for a run on n rows of dimension d.

        n̄ = max(n, max_rows): ``max_rows`` is the public row bound (the dataset's n under replace_one, the
        declared bound under add_remove). With ``max_rows`` None, n̄ = n, which is public only when the
        caller's row count is (replace_one). If the data has more rows than declared, n̄ = n keeps the
        certification sound but makes the slack, hence the failure channel, depend on n (documented).
        """
        n_bound = max(n, self.max_rows) if self.max_rows is not None else n
        return StoppingBounds(
            n_bound=n_bound,
            row_norm=self.row_norm,
            lam=self.lam,
            tau=self.tau,
            b_bound=noise_norm_bound(self.sigma, d),
        )


def objpert_curve(config: ObjPertConfig, orders: Sequence[float]) -> RdpCurve:
    """The data-independent RDP charge of one run: Thm 4.3.2 (L → 2L under replace_one) + AMP term."""
    grid = validate_orders(orders)
    factor = 2.0 if config.neighboring == "replace_one" else 1.0
    values = objpert_rdp(grid, config.sigma, config.beta, config.lam, factor * config.lipschitz)
    values = values + amp_grid_rdp(grid, config.tau, config.lam, config.sigma, config.output_sigma)
    return RdpCurve(grid, _pad(values))


# ----- solver --------------------------------------------------------------------------------------------


def perturbed_objective(
    theta: np.ndarray, x: np.ndarray, y: np.ndarray, lam: float, b: np.ndarray
) -> tuple[float, np.ndarray]:
    """L^P(θ) and its exact gradient Σ f'(x_iᵀθ; y_i)x_i + λθ + b."""
    u = x @ theta
    value = float(np.sum(logistic_loss(u, y)) + 0.5 * lam * theta @ theta + b @ theta)
    grad: np.ndarray = x.T @ logistic_d1(u, y) + lam * theta + b
    return value, grad


def perturbed_hessian(theta: np.ndarray, x: np.ndarray, lam: float) -> np.ndarray:
    """∇²L^P(θ) = Xᵀ diag(f''(Xθ)) X + λI (b does not enter)."""
    w = logistic_d2(x @ theta)
    hessian: np.ndarray = (x * w[:, None]).T @ x + lam * np.eye(x.shape[1])
    return hessian


def noise_norm_bound(sigma: float, d: int) -> float:
    """B_b = σ_b(√(2d) + 20), σ_b = t_bγ_b ≤ σ(1 + 2^−44): P(‖b‖ > B_b) ≤ e^{−100} for b = γ_b·Z,
    Z ~ N_Z(0, t_b²)^d. Each coordinate is σ_b²-subgaussian (CKS 2020, Cor. 23), so
    E e^{‖b‖²/(4σ_b²)} ≤ 2^{d/2} and Chernoff gives P(‖b‖² > σ_b²s²) ≤ 2^{d/2}e^{−s²/4} ≤ e^{−100} for
    s² ≥ 2d + 400."""
    return sigma * (1.0 + 2.0**-40) * (math.sqrt(2.0 * d) + NOISE_NORM_T)


def rounding_slack(
    n_bound: int, row_norm: float, d: int, lam: float, theta_norm: float, b_norm: float
) -> float:
    """2·eps·(n̄R(dR‖θ‖ + 6) + λ‖θ‖ + ‖b‖): the float64 error of the compensated gradient (see below).

    Valid for any data with ≤ n̄ rows of norm ≤ R(1 + 1e-12), any θ with norm ≤ ``theta_norm`` and any b with
    norm ≤ ``b_norm``; increasing in every argument.
    """
    radius = row_norm * (1.0 + ROW_NORM_TOLERANCE)
    return 2.0 * _EPS * (n_bound * radius * (d * radius * theta_norm + 6.0) + lam * theta_norm + b_norm)


@dataclass(frozen=True)
class StoppingBounds:
    """Public constants of the stopping rule: row count n̄, row norm R, λ, τ and the noise bound B_b.

    At any θ with ‖∇L^P(θ)‖ ≤ τ, stationarity of the sum-scale objective (λθ = ∇L^P(θ) − b − Σf'x_i,
    |f'| ≤ 1) gives ‖θ‖ ≤ θ̄ = (n̄R + B_b + τ)/λ when ‖b‖ ≤ B_b. On that event the slack is evaluated at
    (‖θ‖ ∨ θ̄, B_b): it equals the public constant S_pub at every certified stop (and at θ^P), and is a
    sound, larger bound at the other iterates. If ‖b‖ > B_b (probability ≤ e^{−200}), or ``b_bound`` = 0
    (no public noise bound: non-private callers and tests), the actual-value slack (‖θ‖, ‖b‖) is used,
    with n̄ and R still public.
    """

    n_bound: int
    row_norm: float
    lam: float
    tau: float
    b_bound: float = 0.0

    @property
    def theta_bound(self) -> float:
        """θ̄ = (n̄R + B_b + τ)/λ ≥ ‖θ‖ at any certified stop when ‖b‖ ≤ B_b."""
        radius = self.row_norm * (1.0 + ROW_NORM_TOLERANCE)
        return (self.n_bound * radius + self.b_bound + self.tau) / self.lam

    def slack(self, d: int, theta_norm: float, b_norm: float) -> float:
        if self.b_bound > 0.0 and b_norm <= self.b_bound:
            return rounding_slack(
                self.n_bound, self.row_norm, d, self.lam, max(theta_norm, self.theta_bound), self.b_bound
            )
        return rounding_slack(self.n_bound, self.row_norm, d, self.lam, theta_norm, b_norm)

    def public_slack(self, d: int) -> float:
        """S_pub: the slack at every certified stop on the event ‖b‖ ≤ B_b (a function of public values)."""
        return rounding_slack(self.n_bound, self.row_norm, d, self.lam, self.theta_bound, self.b_bound)


def minimum_tolerance(lam: float, sigma: float, row_norm: float, d: int, n_bound: int) -> float:
    """The smallest τ with 0.99τ ≥ 10·S_pub(τ) (S_pub is affine in τ through θ̄), rounded up.

    Then the certified stop is reachable on every dataset with ≤ n_bound rows: near θ^P the float gradient is
    within S_pub of the exact one (≈ 0), so the certified norm is ≲ 2S_pub ≤ 0.99τ
    (docs/privacy/objective_perturbation.md#objpert-rdp-charge).
    """
    bounds = StoppingBounds(n_bound, row_norm, lam, 0.0, noise_norm_bound(sigma, d))
    constant = bounds.public_slack(d)
    radius = row_norm * (1.0 + ROW_NORM_TOLERANCE)
    per_tau = 2.0 * _EPS * (n_bound * radius * d * radius / lam + 1.0)  # dS_pub/dτ
    denominator = TOLERANCE_MARGIN - SLACK_FACTOR * per_tau
    if not denominator > 0.0:
        return math.inf
    return math.nextafter(SLACK_FACTOR * constant / denominator * (1.0 + 1e-9), math.inf)


def certified_gradient_norm(
    theta: np.ndarray, x: np.ndarray, y: np.ndarray, lam: float, b: np.ndarray, bounds: StoppingBounds
) -> float:
    """An upper bound on the exact ‖∇L^P(θ)‖ (float64 rounding included): the stopping check.

    Each coordinate Σ_i f'(u_i; y_i)x_ij + λθ_j + b_j is summed with ``math.fsum`` (correctly rounded), so
    the only errors are in the terms: u_i = x_iᵀθ is off by ≤ γ_d·R‖θ‖, f' = −y·expit is 1/4-Lipschitz with
    a few ulps of its own, so the error vector of Σ_i f'_i x_i has norm ≤ Σ_i |δf'_i|‖x_i‖ + ulps
    ≤ n·R·eps·(d·R‖θ‖ + 6), doubled here for safety, plus an ulp for λθ_j, b_j and the norm.

    The slack uses **public constants only** (``bounds``: n̄ ≥ n, R ≥ max‖x_i‖, θ̄, B_b; see
    ``StoppingBounds``), never max‖x_i‖, n or the actual ‖θ‖, ‖b‖ except where they exceed the public bounds
    (then the certification stays sound). Rows must satisfy ‖x_i‖ ≤ R(1 + 1e-12) and n ≤ n̄.
    """
    n, d = x.shape
    if n > bounds.n_bound:
        raise ValueError("more rows than the row bound n̄ of the stopping rule")
    terms = logistic_d1(x @ theta, y)[:, None] * x
    extra = lam * theta + b
    grad = np.array([math.fsum(np.append(terms[:, j], extra[j])) for j in range(d)])
    slack = bounds.slack(d, float(np.linalg.norm(theta)), float(np.linalg.norm(b)))
    norm = float(np.linalg.norm(grad))
    return float(norm * (1.0 + 4.0 * _EPS * (d + 2)) + slack)


def solve_to_tolerance(
    x: np.ndarray,
    y: np.ndarray,
    lam: float,
    b: np.ndarray,
    tau: float,
    max_iterations: int = 1000,
    progress: ProgressFn = no_progress,
    *,
    row_norm: float | None = None,
    n_bound: int | None = None,
    b_bound: float = 0.0,
) -> np.ndarray:
    """θ̃ with ‖∇L^P(θ̃)‖ ≤ τ certified on the exact full gradient (thesis Thm C.6.1 needs it).

    The rounding slack uses the public constants ``row_norm`` R (rows must have ‖x_i‖ ≤ R(1 + 1e-12)),
    ``n_bound`` n̄ (None ⇒ the number of rows given, public only under replace_one) and ``b_bound`` B_b
    (0 ⇒ the actual ‖b‖): see ``StoppingBounds``. ``row_norm`` None uses the data's max‖x_i‖, which is
    not public: for non-private callers and tests only (``fit_objpert`` always passes R).

    Damped Newton from θ = 0 with the exact Hessian (Cholesky by ``scipy.linalg.cho_factor``): a step is
    halved until the objective shows sufficient decrease or the gradient norm decreases (near the optimum
    the objective's rounding hides the decrease, the gradient does not). L^P is λ-strongly convex and
    smooth, so this converges; the check is ``certified_gradient_norm ≤ 0.99τ``. Never a larger τ, never
    less noise: if ``max_iterations`` pass, ``ObjPertDidNotConverge`` (the worst case is charged).
    """
    n, d = x.shape
    largest = float(np.max(np.linalg.norm(x, axis=1))) if n else 0.0
    if row_norm is None:
        row_norm = largest if largest > 0.0 else 1.0
    elif largest > row_norm * (1.0 + ROW_NORM_TOLERANCE):
        raise ValueError("every row must have ℓ2 norm ≤ row_norm (clip rows first)")
    bounds = StoppingBounds(
        n_bound=max(n, n_bound) if n_bound is not None else n,
        row_norm=row_norm,
        lam=lam,
        tau=tau,
        b_bound=b_bound,
    )
    theta = np.zeros(d)
    target = TOLERANCE_MARGIN * tau
    value, grad = perturbed_objective(theta, x, y, lam, b)
    for iteration in range(max_iterations):
        # the cheap float norm screens; only the certified (compensated) norm may stop the solver
        if float(np.linalg.norm(grad)) <= target and (
            certified_gradient_norm(theta, x, y, lam, b, bounds) <= target
        ):
            return theta
        progress(min(0.95, iteration / max_iterations))
        step = -linalg.cho_solve(linalg.cho_factor(perturbed_hessian(theta, x, lam)), grad)
        slope = float(grad @ step)
        grad_norm = float(np.linalg.norm(grad))
        t = 1.0
        while t > 1e-12:
            candidate = theta + t * step
            new_value, new_grad = perturbed_objective(candidate, x, y, lam, b)
            if new_value <= value + 1e-4 * t * slope or float(np.linalg.norm(new_grad)) < grad_norm:
                theta, value, grad = candidate, new_value, new_grad
                break
            t /= 2.0
        else:
            break  # no progress possible in float64 at this point
    if certified_gradient_norm(theta, x, y, lam, b, bounds) <= target:
        return theta
    raise ObjPertDidNotConverge("the solver did not reach the gradient tolerance; the worst case is charged")


@dataclass(frozen=True)
class ObjPertFit:
    """Internal result of one run. Only ``released`` is public; ``approx_minimizer`` and ``b`` are secret
    (used by the data-dependent report computed before anything is released)."""

    released: np.ndarray
    approx_minimizer: np.ndarray
    b: np.ndarray


def fit_objpert(
    x: np.ndarray,
    y: np.ndarray,
    config: ObjPertConfig,
    noise: Noise,
    progress: ProgressFn = no_progress,
) -> ObjPertFit:
    """Alg 7 (C = L) on grids: b = γ_b·Z_b (exact discrete Gaussian, drawn once before the data is read),
    solve to τ, release γ_o·(round(θ̃/γ_o) + Z_o) (exact discrete Gaussian output noise, drawn once)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ValueError("x must be (n, d) and y (n,)")
    if np.any(np.linalg.norm(x, axis=1) > config.row_norm * (1.0 + ROW_NORM_TOLERANCE)):
        raise ValueError("every row must have ℓ2 norm ≤ row_norm (clip rows first)")
    if np.any(np.abs(y) != 1.0):
        raise ValueError("labels must be ±1")
    n, d = x.shape
    if d > D_MAX:
        raise ValueError("objpert supports d ≤ 2^16 (the public bound of its grid terms)")
    bounds = config.stopping_bounds(n, d)
    b_grid = objective_grid(config.sigma)
    b = discrete_gaussian_std(noise, objective_noise_units(config.sigma), d).astype(np.float64)
    b = b * b_grid.granularity  # exact while |Z| < 2^53; the rounding beyond is in the coupling slack
    out_grid = output_grid(config.tau, config.lam, config.sigma, config.output_sigma)
    out_units = output_noise_units(config.tau, config.lam, config.sigma, config.output_sigma)
    output_noise = discrete_gaussian_std(noise, out_units, d)
    theta = solve_to_tolerance(
        x,
        y,
        config.lam,
        b,
        config.tau,
        config.max_iterations,
        progress,
        row_norm=config.row_norm,
        n_bound=bounds.n_bound,
        b_bound=bounds.b_bound,
    )
    # θ̃ is clamped to the public box |θ_j| ≤ 2^51·γ_o (a projection: 1-Lipschitz, so the sensitivity given θ^P
    # is unchanged; it only matters for absurd τ/λ), so rounding never fails on any data; the integer release
    # is converted to float once (exact below 2^53, a multiple of γ_o in any case)
    limit = math.ldexp(out_grid.granularity, 51)
    released_units = out_grid.to_units(np.clip(theta, -limit, limit)) + output_noise
    released = np.ldexp(released_units.astype(np.float64), out_grid.exponent)
    return ObjPertFit(released=released, approx_minimizer=theta, b=b)


def train_objpert_logistic(
    x: np.ndarray,
    y: np.ndarray,
    config: ObjPertConfig,
    noise: Noise,
    orders: Sequence[float] | None = None,
    progress: ProgressFn = no_progress,
) -> tuple[np.ndarray, RdpCurve]:
    """A reusable DP base learner (e.g. for tuning): (released θ, its data-independent RDP curve).

    ``x`` rows must already satisfy ‖x_i‖ ≤ config.row_norm (``mechanisms.learners.features.design_matrix``)
    and ``y`` ∈ {±1}. The curve is the worst case (= the realized charge) on ``orders`` (default grid).
    """
    curve = objpert_curve(config, orders if orders is not None else DEFAULT_ORDERS)
    return fit_objpert(x, y, config, noise, progress).released, curve


# ----- the service mechanism -----------------------------------------------------------------------------


class ObjPertLogisticParams(FeatureSpec):
    """Public parameters of ``objpert.logistic`` (FeatureSpec fields plus the privacy knobs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    regularization: StrictFloat = Field(
        gt=0,
        le=1e9,
        allow_inf_nan=False,
        description="λ of (λ/2)‖θ‖² on the sum-scale objective; must exceed β = row_norm²/4",
    )
    sigma: NoiseStd = Field(description="standard deviation σ of the objective noise b")
    tolerance: StrictFloat = Field(
        default=1e-6,
        gt=0,
        le=1e3,
        allow_inf_nan=False,
        description="τ: the solver stops when the exact full gradient norm is ≤ 0.99τ; must be ≥ the public "
        "minimum (10× the float64 rounding slack at the public bounds, see the mechanism page)",
    )
    max_rows: StrictInt | None = Field(
        default=None,
        ge=1,
        le=10**9,
        description="add_remove datasets only (required there): a public upper bound on the number of rows, "
        "used for the solver's rounding slack",
    )
    output_sigma: NoiseStd | None = Field(
        default=None, description="σ_out of the output noise (default 1000·τ/λ)"
    )
    row_norm: StrictFloat = Field(
        default=1.0,
        ge=1e-6,
        le=1e3,
        allow_inf_nan=False,
        description="R: each design-matrix row (intercept included) is clipped to ℓ2 norm ≤ R",
    )
    report: ReportKind = Field(
        default="public",
        description="none | public (reporting function, charged 0) | data_dependent (noisy gradient and "
        "Hessian, Gaussian charge)",
    )
    report_rho: StrictFloat = Field(
        default=1e-6,
        gt=0,
        le=0.5,
        allow_inf_nan=False,
        description="ρ: each reported per-instance bound holds with probability ≥ 1 − ρ",
    )
    report_gradient_sigma: NoiseStd | None = Field(
        default=None, description="σ₂ of the noisy gradient (data_dependent report only)"
    )
    report_hessian_sigma: NoiseStd | None = Field(
        default=None, description="σ₃ of the GOE noise on the Hessian (data_dependent report only)"
    )
    report_lambda_min_sigma: NoiseStd | None = Field(
        default=None,
        description="σ₄: releases λ_min of the Hessian with Gaussian noise of this std and uses the adaptive "
        "report (Redberg's Alg 8/9), which works for any λ (no λ ≥ 2σ₃τ_GOE requirement); data_dependent "
        "report only, charged as one more Gaussian release",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ObjPertLogisticParams:
        if self.regularization <= self.row_norm**2 / 4.0:
            raise ValueError("regularization λ must exceed β = row_norm²/4 (thesis Thm 4.3.2 needs λ > β)")
        dependent = self.report == "data_dependent"
        given = (self.report_gradient_sigma is not None, self.report_hessian_sigma is not None)
        if dependent and not all(given):
            raise ValueError("report=data_dependent needs report_gradient_sigma and report_hessian_sigma")
        if not dependent and (any(given) or self.report_lambda_min_sigma is not None):
            raise ValueError(
                "report_gradient_sigma/report_hessian_sigma/report_lambda_min_sigma only apply to "
                "data_dependent"
            )
        return self

    def config(self, neighboring: Neighboring, n_rows: int | None = None) -> ObjPertConfig:
        """The run's configuration; the public row bound is ``n_rows`` (replace_one) or ``max_rows``."""
        return ObjPertConfig(
            lam=self.regularization,
            sigma=self.sigma,
            tau=self.tolerance,
            sigma_out=self.output_sigma,
            row_norm=self.row_norm,
            neighboring=neighboring,
            max_rows=self.max_rows if neighboring == "add_remove" else n_rows,
        )


def public_row_bound(p: ObjPertLogisticParams, ctx: PublicContext) -> int:
    """n̄: the dataset's n under replace_one (public there), the declared ``max_rows`` under add_remove."""
    if ctx.schema.neighboring == "replace_one":
        if p.max_rows is not None:
            raise ParamsError(
                "max_rows", "only for add_remove datasets (the row count is public under replace_one)"
            )
        assert ctx.n_rows is not None
        return ctx.n_rows
    if p.max_rows is None:
        raise ParamsError(
            "max_rows",
            "required on add_remove datasets: a public upper bound on the number of rows (the solver's "
            "rounding slack must not depend on the private row count)",
        )
    return p.max_rows


def round_up_shown(value: float, digits: int = 3) -> float:
    """``value`` rounded up to ``digits`` significant digits (a minimum shown in a message is admissible)."""
    if not (math.isfinite(value) and value > 0):
        return value
    scale = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    shown = float(f"{math.ceil(value / scale) * scale:.{digits}g}")
    return shown if shown >= value else math.nextafter(value, math.inf)
