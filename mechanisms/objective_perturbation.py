"""Objective perturbation (ObjPert) for ℓ2-regularised logistic regression, with its Rényi-DP bound.

Source: Redberg's thesis, read through ``notes/seed_000_redberg_thesis.md`` (cited "note §x"): chapter 4
(Redberg, Koskela & Wang 2023) for the privacy bounds, chapter 2 for the per-instance reports
(``mechanisms.per_instance``).

Mechanism (note §3.2–3.3, Alg 7 with C = L, i.e. approximate minima perturbation without clipping)
-----------------------------------------------------------------------------------------------------
    L^P(θ) = Σ_i f(x_iᵀθ; y_i) + (λ/2)‖θ‖² + bᵀθ,   b ~ N(0, σ² I_d),   f(u; y) = log(1 + e^{−yu})
    θ̃  : any point with ‖∇L^P(θ̃)‖₂ ≤ τ (exact full gradient, float64, with a rounding margin)
    out = θ̃ + N(0, σ_out² I_d)

Assumptions, all enforced from public information (note §3.2): GLM loss; rows ‖x_i‖ ≤ R by per-row
clipping (``mechanisms.learning.design_matrix``, the intercept column included **before** clipping, so
the bias is inside the radius: the note's "β := sup f''·R², L := sup|f'|·R"); labels ±1; Θ = R^d
(unconstrained); logistic f is convex, |f'| ≤ 1, 0 ≤ f'' ≤ 1/4, so L = R and β = R²/4; **λ > β** strictly.
The logistic loss never needs clipping here (|f'|‖x‖ ≤ R = L), so Alg 7's ℓ_C = ℓ.

Privacy (add/remove neighbours, note §3.4)
------------------------------------------
* Thm 4.3.2 (RDP of exact ObjPert, GLM) in the closed form of the note (verified against quadrature in
  tests/unit/test_objective_perturbation.py): with a = −log(1 − β/λ),
      ε(α) = a + αL²/(2σ²) + log(2Φ((α − 1)L/σ))/(α − 1).
* Thm 4.4.1 / C.6.1 (approximate minimizer): given θ^P = argmin L^P, ‖θ̃ − θ^P‖ ≤ τ/λ by λ-strong
  convexity, so θ̃ moves by ≤ 2τ/λ between neighbours given θ^P; the output noise is a Gaussian mechanism
  of sensitivity 2τ/λ composed adaptively: + α(2τ/λ)²/(2σ_out²) = 2τ²α/(σ_out²λ²). (Erratum 8 of the
  note: the appendix's γ/λ sensitivity under-charges by 4×; 2τ/λ is used.)

Replace-one neighbours (D = D₀ + z vs D₀ + z′), derived here from the same change of variables:
``log p_D(θ)/p_D′(θ) = log det H_D/det H_D′ + (‖b′‖² − ‖b‖²)/(2σ²)`` with b′ = b + v,
v = ∇ℓ(θ; z) − ∇ℓ(θ; z′), ‖v‖ ≤ 2L. H_D = H₀ + f''_z xxᵀ, H_D′ = H₀ + f''_{z′}x′x′ᵀ with H₀ ⪰ λI, so the
log-det ratio is within ±log(1 + β/λ) ≤ a. The linear term is ≤ (|f'_z||bᵀx| + |f'_{z′}||bᵀx′|)/σ², a sum
of two (correlated) |N(0, s²)|-dominated variables, s = L/σ; Cauchy–Schwarz on the exponential moment
gives E e^{t(A+B)} ≤ E e^{2t s|Z|}. Altogether ε(α) ≤ a + 2αL²/σ² + log(2Φ(2(α − 1)L/σ))/(α − 1), i.e.
the add/remove formula with L → 2L. It is ≥ the Gaussian lower bound α(2L)²/(2σ²) (linear loss, Lemma
4.3.4) and the MC audit checks it on a replace-one pair. The output step is unchanged (θ̃ and θ̃′ are
both within τ/λ of θ^P).

Rules kept (note §3.7, §3.8): the charge is data-independent (realized = worst case; no iteration counts,
gradient norms, objective values or timings are released); b and the output noise are drawn once; the
solver is never restarted with a larger tolerance or smaller noise; if it cannot reach the tolerance
within a generous iteration cap it raises ``ObjPertDidNotConverge`` and the service commits the worst case.
Exact ObjPert (no output noise) is not offered: an iterative solver has no exact minimizer.
Huber-SVM is not offered: its f'' is discontinuous, and the change-of-variables proof needs a twice
differentiable f (the thesis leaves the piecewise-C² case "as an exercise", note §3.3).

Limitation (documented, not fixed): numpy's floating-point Gaussian sampler, as in ``mechanisms.gaussian``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, model_validator
from scipy import linalg, special, stats

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve
from mechanisms.accounting.orders import validate_orders
from mechanisms.base import ParamsError, ProgressFn, PublicContext, Release, Table, no_progress
from mechanisms.learning import FeatureSpec, check_features, design_matrix, dimension

Neighboring = Literal["replace_one", "add_remove"]
ReportKind = Literal["none", "public", "data_dependent"]

#: default output-noise factor: σ_out = OUTPUT_NOISE_FACTOR·τ/λ makes the AMP term 2α/factor² = 2e-6·α.
OUTPUT_NOISE_FACTOR = 1000.0
#: the stopping rule uses this fraction of τ (note §3.8 pitfall 3: "require ≤ 0.99τ"), minus rounding.
TOLERANCE_MARGIN = 0.99
_EPS = float(np.finfo(np.float64).eps)


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
    """Thm 4.3.2 (note §3.4), closed form: −log(1−β/λ) + αL²/(2σ²) + log(2Φ((α−1)L/σ))/(α−1).

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


def gaussian_hockey_stick(sensitivity: float, sigma: float, eps: float) -> float:
    """H_{e^ε}(N(Δ,σ²)‖N(0,σ²)) = Φ(Δ/(2σ) − εσ/Δ) − e^ε Φ(−Δ/(2σ) − εσ/Δ) (note P1), in log space."""
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
    """Thm 4.3.1 (note §3.4, corrected signs): the privacy profile δ(ε) of exact ObjPert (add/remove).

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

    def __post_init__(self) -> None:
        for name in ("lam", "sigma", "tau", "row_norm"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0")
        if self.sigma_out is not None and not (math.isfinite(self.sigma_out) and self.sigma_out > 0):
            raise ValueError("sigma_out must be finite and > 0")
        if not self.lam > self.beta:
            raise ValueError(f"λ must exceed β = row_norm²/4 = {self.beta!r} (note §3.8 pitfall 2)")

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


def objpert_curve(config: ObjPertConfig, orders: Sequence[float]) -> RdpCurve:
    """The data-independent RDP charge of one run: Thm 4.3.2 (L → 2L under replace_one) + AMP term."""
    grid = validate_orders(orders)
    factor = 2.0 if config.neighboring == "replace_one" else 1.0
    values = objpert_rdp(grid, config.sigma, config.beta, config.lam, factor * config.lipschitz)
    values = values + amp_rdp(grid, config.tau, config.lam, config.output_sigma)
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


def certified_gradient_norm(
    theta: np.ndarray, x: np.ndarray, y: np.ndarray, lam: float, b: np.ndarray
) -> float:
    """An upper bound on the exact ‖∇L^P(θ)‖ (float64 rounding included): the stopping check.

    Each coordinate Σ_i f'(u_i; y_i)x_ij + λθ_j + b_j is summed with ``math.fsum`` (correctly rounded), so
    the only errors are in the terms: u_i = x_iᵀθ is off by ≤ γ_d·R‖θ‖ (R = max‖x_i‖), f' = −y·expit is
    1/4-Lipschitz with a few ulps of its own, so |Δ(f'x_ij)| ≤ |x_ij|(d·eps·R‖θ‖ + 6eps); summed over i and
    j this is ≤ n·R·eps·(d·R‖θ‖ + 6), doubled here for safety, plus an ulp for λθ_j, b_j and the norm.
    """
    n, d = x.shape
    terms = logistic_d1(x @ theta, y)[:, None] * x
    extra = lam * theta + b
    grad = np.array([math.fsum(np.append(terms[:, j], extra[j])) for j in range(d)])
    radius = float(np.max(np.linalg.norm(x, axis=1))) if n else 0.0
    norm_theta = float(np.linalg.norm(theta))
    slack = 2.0 * _EPS * (n * radius * (d * radius * norm_theta + 6.0) + lam * norm_theta + float(
        np.linalg.norm(b)
    ))
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
) -> np.ndarray:
    """θ̃ with ‖∇L^P(θ̃)‖ ≤ τ certified on the exact full gradient (note §3.8 pitfall 3).

    Damped Newton from θ = 0 with the exact Hessian (Cholesky by ``scipy.linalg.cho_factor``): a step is
    halved until the objective shows sufficient decrease or the gradient norm decreases (near the optimum
    the objective's rounding hides the decrease, the gradient does not). L^P is λ-strongly convex and
    smooth, so this converges; the check is ``certified_gradient_norm ≤ 0.99τ``. Never a larger τ, never
    less noise: if ``max_iterations`` pass, ``ObjPertDidNotConverge`` (the worst case is charged).
    """
    d = x.shape[1]
    theta = np.zeros(d)
    target = TOLERANCE_MARGIN * tau
    value, grad = perturbed_objective(theta, x, y, lam, b)
    for iteration in range(max_iterations):
        # the cheap float norm screens; only the certified (compensated) norm may stop the solver
        if float(np.linalg.norm(grad)) <= target and certified_gradient_norm(theta, x, y, lam, b) <= target:
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
    if certified_gradient_norm(theta, x, y, lam, b) <= target:
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
    x: np.ndarray, y: np.ndarray, config: ObjPertConfig, rng: np.random.Generator,
    progress: ProgressFn = no_progress,
) -> ObjPertFit:
    """Alg 7 (C = L): draw b once, solve to τ, add output noise once."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ValueError("x must be (n, d) and y (n,)")
    if np.any(np.linalg.norm(x, axis=1) > config.row_norm * (1.0 + 1e-12)):
        raise ValueError("every row must have ℓ2 norm ≤ row_norm (clip rows first)")
    if np.any(np.abs(y) != 1.0):
        raise ValueError("labels must be ±1")
    d = x.shape[1]
    b = np.asarray(rng.normal(0.0, config.sigma, size=d), dtype=np.float64)
    theta = solve_to_tolerance(x, y, config.lam, b, config.tau, config.max_iterations, progress)
    released = theta + rng.normal(0.0, config.output_sigma, size=d)
    return ObjPertFit(released=released, approx_minimizer=theta, b=b)


def train_objpert_logistic(
    x: np.ndarray,
    y: np.ndarray,
    config: ObjPertConfig,
    rng: np.random.Generator,
    orders: Sequence[float] | None = None,
    progress: ProgressFn = no_progress,
) -> tuple[np.ndarray, RdpCurve]:
    """A reusable DP base learner (e.g. for tuning): (released θ, its data-independent RDP curve).

    ``x`` rows must already satisfy ‖x_i‖ ≤ config.row_norm (``mechanisms.learning.design_matrix``) and
    ``y`` ∈ {±1}. The curve is the worst case (= the realized charge) on ``orders`` (default grid).
    """
    curve = objpert_curve(config, orders if orders is not None else DEFAULT_ORDERS)
    return fit_objpert(x, y, config, rng, progress).released, curve


# ----- the service mechanism -----------------------------------------------------------------------------


class ObjPertLogisticParams(FeatureSpec):
    """Public parameters of ``objpert.logistic`` (FeatureSpec fields plus the privacy knobs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    regularization: StrictFloat = Field(
        gt=0, le=1e9, allow_inf_nan=False,
        description="λ of (λ/2)‖θ‖² on the sum-scale objective; must exceed β = row_norm²/4",
    )
    sigma: StrictFloat = Field(
        gt=0, le=1e9, allow_inf_nan=False, description="standard deviation σ of the objective noise b"
    )
    tolerance: StrictFloat = Field(
        default=1e-6, gt=0, le=1e3, allow_inf_nan=False,
        description="τ: the solver stops when the exact full gradient norm is ≤ 0.99τ",
    )
    output_sigma: StrictFloat | None = Field(
        default=None, gt=0, le=1e9, allow_inf_nan=False,
        description="σ_out of the output noise (default 1000·τ/λ)",
    )
    row_norm: StrictFloat = Field(
        default=1.0, gt=0, le=1e3, allow_inf_nan=False,
        description="R: each design-matrix row (intercept included) is clipped to ℓ2 norm ≤ R",
    )
    report: ReportKind = Field(
        default="public",
        description="none | public (reporting function, charged 0) | data_dependent (noisy gradient and "
        "Hessian, Gaussian charge)",
    )
    report_rho: StrictFloat = Field(
        default=1e-6, gt=0, le=0.5, allow_inf_nan=False,
        description="ρ: each reported per-instance bound holds with probability ≥ 1 − ρ",
    )
    report_gradient_sigma: StrictFloat | None = Field(
        default=None, gt=0, le=1e9, allow_inf_nan=False,
        description="σ₂ of the noisy gradient (data_dependent report only)",
    )
    report_hessian_sigma: StrictFloat | None = Field(
        default=None, gt=0, le=1e9, allow_inf_nan=False,
        description="σ₃ of the GOE noise on the Hessian (data_dependent report only)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ObjPertLogisticParams:
        if self.regularization <= self.row_norm**2 / 4.0:
            raise ValueError("regularization λ must exceed β = row_norm²/4 (note §3.8 pitfall 2)")
        dependent = self.report == "data_dependent"
        given = (self.report_gradient_sigma is not None, self.report_hessian_sigma is not None)
        if dependent and not all(given):
            raise ValueError("report=data_dependent needs report_gradient_sigma and report_hessian_sigma")
        if not dependent and any(given):
            raise ValueError("report_gradient_sigma/report_hessian_sigma only apply to data_dependent")
        return self

    def config(self, neighboring: Neighboring) -> ObjPertConfig:
        return ObjPertConfig(
            lam=self.regularization,
            sigma=self.sigma,
            tau=self.tolerance,
            sigma_out=self.output_sigma,
            row_norm=self.row_norm,
            neighboring=neighboring,
        )


def _objpert_params(params: BaseModel) -> ObjPertLogisticParams:
    if not isinstance(params, ObjPertLogisticParams):
        raise TypeError(f"expected ObjPertLogisticParams, got {type(params).__name__}")
    return params


class ObjPertLogistic:
    """Objective perturbation (approximate minimizer + output noise) for logistic regression."""

    name: ClassVar[str] = "objpert.logistic"
    summary: ClassVar[str] = (
        "Logistic regression by objective perturbation (Rényi DP, Redberg et al. 2023) with an optional "
        "per-instance privacy report."
    )
    params_model: ClassVar[type[BaseModel]] = ObjPertLogisticParams
    cost_parameter: ClassVar[str] = "sigma"
    cost_increases_with_parameter: ClassVar[bool] = False
    long_running: ClassVar[bool] = True
    progress_is_public: ClassVar[bool] = False  # the number of solver rounds depends on the data

    def check(self, params: BaseModel, ctx: PublicContext) -> None:
        p = _objpert_params(params)
        check_features(p, ctx, "classification")
        if p.report == "data_dependent":
            from mechanisms.per_instance import data_dependent_requirements

            reason = data_dependent_requirements(p, dimension(p, ctx))
            if reason is not None:
                raise ParamsError("params.report_hessian_sigma", reason)

    def worst_case(self, params: BaseModel, ctx: PublicContext) -> RdpCurve:
        from mechanisms.per_instance import report_curve

        p = _objpert_params(params)
        config = p.config(ctx.schema.neighboring)
        curve = objpert_curve(config, ctx.orders)
        if p.report == "data_dependent":
            curve = curve + report_curve(p, ctx.schema.neighboring, ctx.orders)
        return curve

    def run(
        self,
        params: BaseModel,
        ctx: PublicContext,
        table: Table,
        rng: np.random.Generator,
        progress: ProgressFn = no_progress,
    ) -> Release:
        from mechanisms.per_instance import data_dependent_statistics, report_metadata

        p = _objpert_params(params)
        self.check(p, ctx)
        worst = self.worst_case(p, ctx)
        progress(0.0)
        x, y = design_matrix(p, ctx, table, "classification", row_norm=p.row_norm)
        config = p.config(ctx.schema.neighboring)
        fit = fit_objpert(x, y, config, rng, progress)
        output: dict[str, Any] = {
            "theta": [float(v) for v in fit.released],
            "loss": "logistic",
            "regularization": p.regularization,
            "sigma": p.sigma,
            "tolerance": p.tolerance,
            "output_sigma": config.output_sigma,
            "row_norm": p.row_norm,
            "lipschitz": config.lipschitz,
            "beta": config.beta,
        }
        if p.report != "none":
            output["report"] = report_metadata(p, fit.released.shape[0])
        if p.report == "data_dependent":
            output["report"].update(data_dependent_statistics(p, x, y, fit, rng))
        progress(1.0)
        realized = worst
        assert realized <= worst
        return Release(output=output, realized=realized)
