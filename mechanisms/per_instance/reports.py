"""Per-instance privacy reports for ``objpert.logistic`` releases (Redberg & Wang 2021;
Wang 2019, per-instance DP). Proofs: docs/privacy/objective_perturbation.md#objpert-data-dependent-report and
docs/privacy/objective_perturbation.md#objpert-per-instance-report.

A **reporting function** is published with the model: anyone evaluates it on their own record z = (x, y)
and gets an upper bound, holding with probability ≥ 1 − ρ over the mechanism's noise, on their ex-post
per-instance loss (ex-post pDP, Def 2.2.3 of Redberg 2023, PhD thesis, ch. 2: |log p_D(o)/p_{D±z}(o)| at the
realized output; add/remove of z, the pDP notion, whatever the dataset's neighbour relation). Evaluating it
reads only the release and public parameters, so it is post-processing and costs 0 (billboard lemma, Lemma
A.7.8 of Redberg 2023).

What is bounded, exactly
------------------------
Cor 2.3.2 of Redberg 2023 (Redberg & Wang 2021): the ex-post loss of **exact** ObjPert at its minimizer θ^P is
    ε₁ = | −log(1 ± f''μ(x)) + f'²‖x‖²/(2σ²) ± f'·bᵀx/σ² |,  μ(x) = xᵀH⁻¹x,  H = ∇²J(θ^P; D),
with f', f'' at (xᵀθ^P; y). The service releases AMP (``mechanisms.learners.objective_perturbation``):
out = θ̃ + w with ‖θ̃ − θ^P‖ ≤ τ/λ and w ~ N(0, σ_out² I). No ex-post formula exists for the marginal of
``out`` (Thm 2.3.1 needs the exact minimizer; the thesis gives no ex-post analysis of AMP), so the report
bounds the ex-post loss of the transcript (θ^P, out[, ĝ, Ĥ]), of which the release is a post-processing: ε₁ at
θ^P plus the Gaussian output step's ex-post loss (Thm A.6.1 of Redberg 2023: |‖v‖²/(2σ_out²) − vᵀw/σ_out²|
with ‖v‖ ≤ 2τ/λ). θ^P is unknown but lies in the ball ‖θ^P − out‖ ≤ r := τ/λ + σ_out(√d + √(2 log(1/ρ_ball)))
(Gaussian norm concentration, E‖w‖ ≤ σ_out√d), so f', f'' are replaced by their suprema over
u ∈ [xᵀout − r‖x‖, xᵀout + r‖x‖] (f'' is largest nearest 0, |f'(u; y)| = σ(−yu) is largest at the smallest
yu).

Bounds per term (Alg 2 of Redberg 2023, with absolute values in ḡ, which the thesis omits):
* leverage: −log(1 ± f''μ) ≤ −log(1 − f''μ̄) with μ̄ ≥ μ. Public: μ̄ = ‖x‖²/λ (H ⪰ λI; Thm 2.3.3).
  Data-dependent: Ĥ = H(out) + σ₃(Z + Zᵀ)/√2 (Alg 11, GOE); on ‖G‖ ≤ σ₃τ_GOE and λ ≥ 2σ₃τ_GOE,
  xᵀH(out)⁻¹x ≤ (3/2)xᵀĤ⁻¹x (Prop A.5.1); logistic is self-concordant with |f'''| ≤ f'' so
  ∇²ℓ_i(θ^P) ⪰ e^{−R r}∇²ℓ_i(out) (‖x_i‖ ≤ R), hence μ ≤ e^{R r}(3/2)xᵀĤ⁻¹x; μ̄ = min(that, ‖x‖²/λ).
* fit: f'²‖x‖²/(2σ²) with the supremum of |f'|.
* gradient: |f'|·|bᵀx|/σ². Public: bᵀx ~ N(0, σ²‖x‖²) for a fixed x, so |bᵀx| ≤ σ‖x‖z (Thm 2.3.4, the
  Φ⁻¹ form). Data-dependent: ĝ = ∇J(θ̃; D) + e, e ~ N(0, σ₂² I) (Alg 10 at θ̃), and
  ∇J(θ̃; D) = ∇L^P(θ̃) − b with ‖∇L^P(θ̃)‖ ≤ τ, so |bᵀx| ≤ |ĝᵀx| + σ₂‖x‖z + τ‖x‖; the min of both branches.
* output: (2τ/λ)²/(2σ_out²) + (2τ/λ)z/σ_out.
* released ĝ, Ĥ (data-dependent only; they are part of the transcript): a Gaussian release with shift v and
  iid N(0, s²) noise e has ex-post loss ‖v‖²/(2s²) + vᵀe/s², and vᵀe/(‖v‖s) ~ N(0, 1) given the past.
  ĝ: ‖v‖ ≤ Δ_g = sup_ball|f'|‖x‖ + 2τ, s = σ₂ → Δ_g²/(2σ₂²) + Δ_g z/σ₂. Ĥ (evaluated at the released out):
  in the GOE vector [diag/√2, upper] the noise is iid N(0, σ₃²) (diagonal entries of σ₃(Z + Zᵀ)/√2 have
  variance 2σ₃², off-diagonal σ₃²) and ‖v‖ = ‖f''(xᵀout)xxᵀ‖_F/√2 = Δ_H/√2, Δ_H = f''(xᵀout)‖x‖²
  → Δ_H²/(4σ₃²) + Δ_H z/(√2σ₃).
The failure probability ρ is split evenly over the events used (public: ball, b, w → ρ/3 each;
data-dependent: ball, b, e·x, GOE, w, e·v_g, G·v_H → ρ/7 each); z = Φ⁻¹(1 − ρ_i/2) for the two-sided
Gaussian events. The bound holds for a record fixed before the release (a record chosen after seeing the
model is not covered).

GOE quantile (Redberg 2023 §A.4.1's τ = 12 is in Chiani's normalization, not Alg 11's (Z + Zᵀ)/√2). Used here:
τ_GOE = 2√d + 2√(log(2/ρ_GOE)) for W = (Z + Zᵀ)/√2. Proof: E λ_max(W) ≤ 2√d by Sudakov–Fernique
(X_v = vᵀWv = √2 vᵀZv has increments E(X_u − X_v)² = 4(1 − (uᵀv)²) ≤ 8(1 − uᵀv) = E(Y_u − Y_v)² for
Y_v = 2gᵀv, E sup Y = 2E‖g‖ ≤ 2√d); λ_max is √2-Lipschitz in Z (‖W‖_F ≤ √2‖Z‖_F) so
P(λ_max ≥ 2√d + t) ≤ e^{−t²/4}; the same for −λ_min; a union bound gives ‖W‖ ≤ τ_GOE w.p. ≥ 1 − ρ_GOE.
Conservative versus Tracy–Widom (21.2 vs 17.1 at d = 50, ρ = 8.5e-6); checked by Monte Carlo in tests.

Charges: the public report costs 0. The data-dependent report adds Gaussian RDP (Mironov 2017, Prop. 7):
gradient sensitivity L + 2τ given θ^P (‖∇ℓ(θ^P; z)‖ ≤ L, and θ̃, θ̃′ each within τ of stationarity) — 2L + 2τ
under replace_one; Hessian at the released ``out`` through the GOE vector [diag/√2, upper] with iid N(0, σ₃²)
noise and sensitivity ‖ΔH‖_F/√2 ≤ β/√2 (add/remove) or β (replace_one: ‖A − B‖_F² ≤ ‖A‖_F² + ‖B‖_F² for
PSD A, B). Adaptive composition: θ^P, θ̃ are functions of (D, θ^P) and the AMP proof already composes
(θ^P, out) (Redberg, Koskela, Wang 2023, Remark 4.4.2 of Redberg 2023).

The personalized RDP curve ρ_z(α) (derived in docs/privacy/objective_perturbation.md#personalized-rdp from
the proof of Thm 4.3.2 of Redberg 2023; add/remove) depends on z's own record only:
−log(1 − β_z/λ) + αL_z²/(2σ²) + log(2Φ((α−1)L_z/σ))/(α−1) + AMP term (+ report terms with L_z, β_z),
L_z = ‖x‖, β_z = ‖x‖²/4.

**True per-record losses are never returned, stored or charged** (Example 2.2.4 of Redberg 2023: published
per-instance losses reveal the data; docs/privacy/rules.md#rule-public-charges).
``exact_ex_post_loss`` below needs the whole dataset; it exists only to verify the bounds in tests and
is not reachable from the service.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np
from scipy import linalg, special, stats

from mechanisms.accounting import RdpCurve
from mechanisms.learners.objective_perturbation import (
    OUTPUT_NOISE_FACTOR,
    Neighboring,
    ObjPertFit,
    ObjPertLogisticParams,
    amp_grid_rdp,
    effective_tolerance,
    logistic_d1,
    logistic_d2,
    output_grid,
    output_noise_units,
)
from mechanisms.noise import Grid, Noise, grid_l2_sensitivity
from mechanisms.noise.learners import discrete_gaussian_std

PUBLIC_EVENTS = 3
#: ball, b, e along x, GOE norm, w, e along ĝ's shift, GOE along Ĥ's shift
DATA_DEPENDENT_EVENTS = 7
#: the adaptive report (Alg 8/9) adds two: the lower confidence bound on λ_min(H) and λ̂_min's own loss
ADAPTIVE_EVENTS = 9
#: LAPACK's symmetric eigensolver is backward stable: the computed eigenvalues are exact for H + F with
#: ‖F‖ ≤ c·d·eps·‖H‖; c = 8 is a generous constant
#: (docs/privacy/objective_perturbation.md#objpert-adaptive-report)
EIGEN_BACKWARD_CONSTANT = 8.0
_EPS = float(np.finfo(np.float64).eps)


def one_sided_z(rho: float) -> float:
    """√(2 log(1/ρ)) ≥ Φ⁻¹(1 − ρ): P(X > z) ≤ ρ for every 1-subgaussian X (one-sided)."""
    return max(float(stats.norm.isf(rho)), math.sqrt(2.0 * math.log(1.0 / rho)))


def two_sided_z(rho: float) -> float:
    """√(2 log(2/ρ)) ≥ Φ⁻¹(1 − ρ/2): P(|X| > z) ≤ ρ for every 1-subgaussian X (a standard Gaussian, and a
    discrete Gaussian scaled by its parameter, CKS 2020 Cor. 23)."""
    return max(float(stats.norm.isf(rho / 2.0)), math.sqrt(2.0 * math.log(2.0 / rho)))


def goe_norm_bound(d: int, rho: float) -> float:
    """τ with P(‖G‖₂ > σ₃τ) ≤ ρ for the released Hessian's noise G (discrete GOE on the grid plus rounding):
    4√(d·log 9 + log(2/ρ)) + 2^−20 (ε-net bound for subgaussian entries,
    docs/privacy/finite_precision_learners.md#fp-per-instance-reports)."""
    return 4.0 * math.sqrt(d * math.log(9.0) + math.log(2.0 / rho)) + 2.0**-20


def ball_radius(tau: float, lam: float, sigma_out: float, d: int, rho_ball: float) -> float:
    """r ≥ ‖θ^P − out‖ w.p. ≥ 1 − ρ_ball, with τ the effective tolerance and σ_out the released noise's std:
    τ/λ + γ_o√d/2 (rounding; γ_o ≤ 2τ/λ·2^−22) + σ_out·√(2d + 4 log(1/ρ_ball)) (discrete Gaussian noise is
    subgaussian: P(‖w‖² > σ²s²) ≤ 2^{d/2}e^{−s²/4},
    docs/privacy/finite_precision_learners.md#fp-per-instance-reports)."""
    rounding = math.sqrt(d) * tau / lam * 2.0**-22
    return tau / lam + rounding + sigma_out * math.sqrt(2.0 * d + 4.0 * math.log(1.0 / rho_ball))


def is_adaptive(p: ObjPertLogisticParams) -> bool:
    """The adaptive data-dependent report (Alg 8/9 of Redberg 2023): λ̂_min is released too."""
    return p.report == "data_dependent" and p.report_lambda_min_sigma is not None


def _events(p: ObjPertLogisticParams) -> int:
    if is_adaptive(p):
        return ADAPTIVE_EVENTS
    return DATA_DEPENDENT_EVENTS if p.report == "data_dependent" else PUBLIC_EVENTS


def data_dependent_requirements(p: ObjPertLogisticParams, d: int) -> str | None:
    """Prop A.5.1 needs λ_min(H) ≥ 2σ₃τ_GOE; H ⪰ λI, so λ ≥ 2σ₃τ_GOE is required (public check) — unless
    the adaptive report is asked for (σ₄ given): its regularized estimator (Prop A.3.2) holds for any λ."""
    assert p.report_hessian_sigma is not None
    if is_adaptive(p):
        return None
    tau_goe = goe_norm_bound(d, p.report_rho / DATA_DEPENDENT_EVENTS)
    needed = 2.0 * p.report_hessian_sigma * tau_goe
    if p.regularization < needed:
        return f"needs regularization ≥ 2·σ₃·τ_GOE = {needed:.6g} (lower σ₃ or raise λ)"
    return None


def hessian_entry_bound(p: ObjPertLogisticParams, n_bound: int) -> float:
    """B ≥ |H_jk| and ≥ λ_min(H) for H = Σ_i f''(x_iᵀout)x_ix_iᵀ + λI on ≤ n̄ rows of norm ≤ R (public):
    |H_jk| ≤ Σ_i f''‖x_i‖² + λ ≤ n̄β + λ, padded for the float sum (n̄·eps ≤ 2.3·10⁻⁷ for n̄ ≤ 10⁹)."""
    beta = p.row_norm**2 / 4.0
    return math.nextafter((p.regularization + n_bound * beta) * (1.0 + 1e-6), math.inf)


def range_requirement(p: ObjPertLogisticParams, d: int, n_bound: int) -> tuple[str, str] | None:
    """(field, reason) if the data-dependent statistics could leave their grids' exact range (|units| < 2^50
    before the noise) on some dataset with ≤ n̄ rows: a public refusal instead of a data-dependent failure.
    At run time the statistics are also clamped to ±B (1-Lipschitz, so the sensitivities are unchanged and the
    run never fails on data, even with more rows than declared)."""
    if p.report != "data_dependent":
        return None
    bound = hessian_entry_bound(p, n_bound)
    _grid_g, grid_h = statistics_grids(p, d)
    limit = 2.0**50
    if bound / grid_h.granularity >= limit:
        return (
            "report_hessian_sigma",
            f"too small for the Hessian's range at these public bounds (λ + n̄·R²/4 = {bound:.6g} must be "
            f"< 2^50 grid steps of {grid_h.granularity:.3g}); raise σ₃ or lower max_rows",
        )
    if is_adaptive(p) and bound / lambda_min_grid(p).granularity >= limit:
        return (
            "report_lambda_min_sigma",
            f"too small for λ_min's range at these public bounds (λ + n̄·R²/4 = {bound:.6g} must be < 2^50 "
            f"grid steps of {lambda_min_grid(p).granularity:.3g}); raise σ₄ or lower max_rows",
        )
    return None


def report_sensitivities(p: ObjPertLogisticParams, neighboring: Neighboring) -> tuple[float, float]:
    """(gradient ℓ2 sensitivity, GOE-vector sensitivity) of the data-dependent report."""
    lipschitz, beta = p.row_norm, p.row_norm**2 / 4.0
    if neighboring == "replace_one":
        return 2.0 * lipschitz + 2.0 * p.tolerance, beta
    return lipschitz + 2.0 * p.tolerance, beta / math.sqrt(2.0)


def eigen_float_error(p: ObjPertLogisticParams, d: int, n_bound: int) -> float:
    """A bound on |computed λ_min(H) − exact λ_min(H)| for H = Σ_i f''(x_iᵀout)x_ix_iᵀ + λI on ≤ n̄ rows of
    norm ≤ R (public): the float sum of n̄ rank-one terms has entrywise error ≤ γ_{n̄+3}Σ_i w_i|x_ij||x_ik|,
    so a Frobenius (hence spectral) error ≤ (n̄+3)·eps·n̄β(1 + 1e-6); the eigensolver adds
    c·d·eps·‖H‖ ≤ c·d·eps·(n̄β + λ) (backward stability, Weyl). Doubled for safety."""
    beta = p.row_norm**2 / 4.0
    assembly = (n_bound + 3.0) * _EPS * n_bound * beta * (1.0 + 1e-6)
    solver = EIGEN_BACKWARD_CONSTANT * d * _EPS * (n_bound * beta + p.regularization)
    return math.nextafter(2.0 * (assembly + solver), math.inf)


def lambda_min_sensitivity(p: ObjPertLogisticParams, d: int, n_bound: int) -> float:
    """ℓ2 (= absolute) sensitivity of the computed λ_min(H(out)) given the released out: the neighbours'
    Hessians differ by f''(xᵀout)xxᵀ (add/remove) or by A − B with A, B ⪰ 0 of norm ≤ β (replace-one), so
    by Weyl λ_min moves by ≤ β = R²/4 either way (rows clipped to R up to a relative 10⁻¹², hence the pad);
    plus the float error of both computations. The clamp to [0, B] at run time is 1-Lipschitz."""
    beta = p.row_norm**2 / 4.0 * (1.0 + 3e-12)
    return math.nextafter(beta + 2.0 * eigen_float_error(p, d, n_bound), math.inf)


def lambda_min_grid(p: ObjPertLogisticParams) -> Grid:
    """γ_λ: the largest power of two ≤ σ₄·2^−20 (the release λ̂_min is a multiple of γ_λ)."""
    assert p.report_lambda_min_sigma is not None
    return Grid(math.frexp(p.report_lambda_min_sigma * 2.0**-20)[1] - 1)


def lambda_min_margin(p: ObjPertLogisticParams, d: int, n_bound: int) -> float:
    """λ̂_min − λ_min(H) ≤ margin with probability ≥ 1 − ρ/9: t_λγ_λ·z₁ (discrete Gaussian, 1-subgaussian
    after scaling, one-sided) + γ_λ/2 (rounding) + the float error of the computed λ_min."""
    grid = lambda_min_grid(p)
    assert p.report_lambda_min_sigma is not None
    std = _units(p.report_lambda_min_sigma, grid) * grid.granularity
    rho_i = p.report_rho / ADAPTIVE_EVENTS
    margin = std * one_sided_z(rho_i) + grid.granularity / 2.0 + eigen_float_error(p, d, n_bound)
    return math.nextafter(margin * (1.0 + 1e-12), math.inf)


def report_curve(
    p: ObjPertLogisticParams,
    neighboring: Neighboring,
    orders: Sequence[float],
    d: int | None = None,
    n_bound: int | None = None,
) -> RdpCurve:
    """Discrete Gaussian RDP of the data-dependent report on its grids (CKS 2020):
    α(Δ_g,units²/(2t_g²) + Δ_H,units²/(2t_H²) [+ Δ_λ,units²/(2t_λ²)]), Δ_units = Δ/γ + √(coordinates)
    (``grid_l2_sensitivity``). ``d`` (public, the design matrix's width) is required for the rounding term
    (ValueError if None); ``n_bound`` (the public row bound n̄) for the adaptive report's λ̂_min term."""
    assert p.report_gradient_sigma is not None
    assert p.report_hessian_sigma is not None
    if d is None:
        raise ValueError("the data-dependent report's charge needs the dimension d (rounding term)")
    grad_sens, hess_sens = report_sensitivities(p, neighboring)
    grid_g, grid_h = statistics_grids(p, d)
    g_units = grid_l2_sensitivity(grad_sens, d, grid_g, False)
    h_units = grid_l2_sensitivity(hess_sens, d * (d + 1) // 2, grid_h, False)
    t_g = float(_units(p.report_gradient_sigma, grid_g))
    t_h = float(_units(p.report_hessian_sigma, grid_h))
    per_alpha = g_units**2 / (2.0 * t_g**2) + h_units**2 / (2.0 * t_h**2)
    if is_adaptive(p):
        assert p.report_lambda_min_sigma is not None
        if n_bound is None:
            raise ValueError("the adaptive report's charge needs the public row bound n̄ (float error term)")
        grid_l = lambda_min_grid(p)
        l_units = grid_l2_sensitivity(lambda_min_sensitivity(p, d, n_bound), 1, grid_l, False)
        t_l = float(_units(p.report_lambda_min_sigma, grid_l))
        per_alpha += l_units**2 / (2.0 * t_l**2)
    values = np.asarray(orders, dtype=np.float64) * per_alpha
    padded = tuple(math.nextafter(float(v) * (1.0 + 1e-12), math.inf) for v in values)
    return RdpCurve(tuple(orders), padded)


def report_metadata(p: ObjPertLogisticParams, d: int, n_bound: int | None = None) -> dict[str, Any]:
    """The public constants of the reporting function (functions of the parameters only); ``n_bound`` (the
    public row bound) is needed for the adaptive report's λ_min margin."""

    events = _events(p)
    rho_i = p.report_rho / events
    nominal = (
        p.output_sigma
        if p.output_sigma is not None
        else OUTPUT_NOISE_FACTOR * p.tolerance / (p.regularization)
    )
    tau = effective_tolerance(p.tolerance, p.sigma)
    sigma_out = (
        output_noise_units(p.tolerance, p.regularization, p.sigma, nominal)
        * output_grid(p.tolerance, p.regularization, p.sigma, nominal).granularity
    )
    meta: dict[str, Any] = {
        "kind": p.report,
        "rho": p.report_rho,
        "events": events,
        "z": two_sided_z(rho_i),
        "radius": ball_radius(tau, p.regularization, sigma_out, d, rho_i),
        "effective_tolerance": tau,
        "output_noise_std": sigma_out,
        "neighbour_notion": "add_remove of the evaluated record (per-instance DP)",
    }
    if p.report == "data_dependent":
        meta["gradient_sigma"] = p.report_gradient_sigma
        meta["hessian_sigma"] = p.report_hessian_sigma
        meta["tau_goe"] = goe_norm_bound(d, rho_i)
    if is_adaptive(p):
        if n_bound is None:
            raise ValueError("the adaptive report needs the public row bound n̄")
        meta["estimator"] = "adaptive (Alg 8/9): standard and regularized, whichever applies and is smaller"
        meta["lambda_min_sigma"] = p.report_lambda_min_sigma
        meta["lambda_min_margin"] = lambda_min_margin(p, d, n_bound)
        # λ̂_min's mean moves by ≤ f''(xᵀout)‖x‖² + 2·float error, + one grid step of rounding
        meta["lambda_min_shift_extra"] = math.nextafter(
            lambda_min_grid(p).granularity + 2.0 * eigen_float_error(p, d, n_bound), math.inf
        )
    return meta


def statistics_grids(p: ObjPertLogisticParams, d: int) -> tuple[Grid, Grid]:
    """(γ_g, γ_H): the public grids of the released ĝ and of the GOE vector of Ĥ: the largest powers of two
    ≤ σ₂·2^−20/√d and ≤ σ₃·2^−20/d (so the Hessian's rounding has spectral norm ≤ σ₃·2^−20)."""
    assert p.report_gradient_sigma is not None
    assert p.report_hessian_sigma is not None
    g = math.frexp(p.report_gradient_sigma * 2.0**-20 / math.sqrt(d))[1] - 1
    h = math.frexp(p.report_hessian_sigma * 2.0**-20 / d)[1] - 1
    return Grid(g), Grid(h)


def _units(sigma: float, grid: Grid) -> int:
    return max(1, math.ceil(Fraction(sigma) / Fraction(grid.granularity)))


def data_dependent_statistics(
    p: ObjPertLogisticParams,
    x: np.ndarray,
    y: np.ndarray,
    fit: ObjPertFit,
    noise: Noise,
    n_bound: int | None = None,
) -> dict[str, Any]:
    """ĝ = ∇J(θ̃; D) and Ĥ = ∇²J(out; D) released on public grids with exact discrete Gaussian noise:
    ĝ = γ_g(round(∇J/γ_g) + Z), Z ~ N_Z(0, t_g²)^d; Ĥ through its GOE vector u = [H_ii/√2, H_ij (i<j)]:
    û = γ_H(round(u/γ_H) + Z′), Z′ ~ N_Z(0, t_H²) i.i.d., and Ĥ_ii = √2·û_i, Ĥ_ij = û_ij (post-processing).
    t_g = ⌈σ₂/γ_g⌉, t_H = ⌈σ₃/γ_H⌉ (standard deviations ≥ σ₂, σ₃). The GOE vector and λ_min are clamped to
    the public range ±B (``hessian_entry_bound``; inactive on every dataset with ≤ n̄ rows, 1-Lipschitz always)
    so rounding never fails on data. ``n_bound`` is the public row bound n̄ (default: ``max_rows``, else the
    row count, which is public under replace_one)."""
    assert p.report_gradient_sigma is not None
    assert p.report_hessian_sigma is not None
    d = x.shape[1]
    if n_bound is None:
        n_bound = p.max_rows if p.max_rows is not None else x.shape[0]
    entry_bound = hessian_entry_bound(p, n_bound)
    grid_g, grid_h = statistics_grids(p, d)
    theta = fit.approx_minimizer
    gradient = x.T @ logistic_d1(x @ theta, y) + p.regularization * theta
    g_noise = discrete_gaussian_std(noise, _units(p.report_gradient_sigma, grid_g), d)
    g_units = grid_g.to_units(gradient) + g_noise
    g_hat = grid_g.from_units(g_units)
    w = logistic_d2(x @ fit.released)
    hessian = (x * w[:, None]).T @ x + p.regularization * np.eye(d)
    upper = np.triu_indices(d, 1)
    vector = np.clip(
        np.concatenate([np.diag(hessian) / math.sqrt(2.0), hessian[upper]]), -entry_bound, entry_bound
    )
    units = _units(p.report_hessian_sigma, grid_h)
    v_hat = grid_h.from_units(grid_h.to_units(vector) + discrete_gaussian_std(noise, units, vector.size))
    h_hat = np.zeros((d, d))
    h_hat[upper] = v_hat[d:]
    h_hat = h_hat + h_hat.T
    h_hat[np.diag_indices(d)] = v_hat[:d] * math.sqrt(2.0)
    extra: dict[str, Any] = {}
    if is_adaptive(p):
        # Alg 8: λ̂_min = γ_λ(round(λ_min(H)/γ_λ) + Z), Z ~ N_Z(0, t_λ²), H = ∇²J(out; D) as for Ĥ
        assert p.report_lambda_min_sigma is not None
        grid_l = lambda_min_grid(p)
        smallest = np.clip(linalg.eigvalsh(hessian, subset_by_index=[0, 0])[:1], 0.0, entry_bound)
        l_noise = discrete_gaussian_std(noise, _units(p.report_lambda_min_sigma, grid_l), 1)
        extra["lambda_min"] = float(grid_l.from_units(grid_l.to_units(smallest) + l_noise)[0])
        extra["lambda_min_grid"] = grid_l.describe()
    return {
        **extra,
        "gradient": [float(v) for v in g_hat],
        "gradient_grid": grid_g.describe(),
        "hessian": [[float(v) for v in row] for row in h_hat],
        "hessian_vector": [float(v) for v in v_hat],
        "hessian_grid": {
            **grid_h.describe(),
            "note": "hessian_vector = [diag/√2, upper triangle] is on the grid; hessian is post-processing",
        },
    }


def lower_lambda(p: ObjPertLogisticParams, report: dict[str, Any]) -> float:
    """λ_lo = max(λ, λ̂_min − margin) (Alg 9, with λ_lo in the numerators as in the proof of Prop A.3.2;
    the algorithm box's λ̂_min is an erratum): a post-processing of the release."""
    return max(p.regularization, float(report["lambda_min"]) - float(report["lambda_min_margin"]))


def _quadratic(matrix: np.ndarray, x: np.ndarray) -> np.ndarray | None:
    """xᵢᵀ M⁻¹ xᵢ per row by Cholesky, or None if M is not positive definite."""
    try:
        factor = linalg.cholesky(np.asarray(matrix, dtype=np.float64), lower=True)
    except linalg.LinAlgError:
        return None
    solved = linalg.solve_triangular(factor, x.T, lower=True)
    result: np.ndarray = np.sum(solved * solved, axis=0)
    return result


def adaptive_leverage(h_hat: np.ndarray, x: np.ndarray, lambda_lo: float, spectral: float) -> np.ndarray:
    """An upper bound on xᵀH⁻¹x for every row x, valid whenever λ_min(H) ≥ λ_lo > 0 and ‖Ĥ − H‖ ≤ s
    (``spectral`` = σ₃τ_GOE) — Prop A.3.2 of Redberg 2023, re-proved in
    docs/privacy/objective_perturbation.md#objpert-adaptive-report:
    * always: ‖x‖²/λ_lo, and (regularized) ((λ_lo + 2s)/λ_lo)·xᵀ(Ĥ + sI)⁻¹x, since
      H ⪯ Ĥ + sI ⪯ (1 + 2s/λ_lo)H;
    * if λ_lo ≥ 2s (standard): ((λ_lo + s)/λ_lo)·xᵀĤ⁻¹x, since (1 − s/λ_lo)H ⪯ Ĥ ⪯ (1 + s/λ_lo)H.
    The minimum of the valid ones. A Cholesky failure means the event failed; that branch is skipped."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    d = x.shape[1]
    bound: np.ndarray = np.sum(x * x, axis=1) / lambda_lo
    regularized = _quadratic(np.asarray(h_hat) + spectral * np.eye(d), x)
    if regularized is not None:
        bound = np.minimum(bound, (1.0 + 2.0 * spectral / lambda_lo) * regularized)
    if lambda_lo >= 2.0 * spectral:
        standard = _quadratic(np.asarray(h_hat), x)
        if standard is not None:
            bound = np.minimum(bound, (1.0 + spectral / lambda_lo) * standard)
    return bound


def _sup_d2(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """sup of f''(u) = σ(u)σ(−u) over [lo, hi]: 1/4 if 0 is inside, else at the end nearest 0."""
    nearest = np.where((lo <= 0.0) & (hi >= 0.0), 0.0, np.minimum(np.abs(lo), np.abs(hi)))
    result: np.ndarray = logistic_d2(nearest)
    return result


def _sup_abs_d1(lo: np.ndarray, hi: np.ndarray, y: np.ndarray) -> np.ndarray:
    """sup of |f'(u; y)| = σ(−yu) over u ∈ [lo, hi] (y = ±1): at the smallest yu."""
    smallest = np.minimum(y * lo, y * hi)
    result: np.ndarray = special.expit(-smallest)
    return result


def ex_post_terms(
    theta: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    *,
    lam: float,
    sigma: float,
    z_b: float,
    radius: float = 0.0,
    row_norm: float = 1.0,
    tau: float = 0.0,
    sigma_out: float | None = None,
    z_out: float = 0.0,
    h_hat: np.ndarray | None = None,
    g_hat: np.ndarray | None = None,
    sigma_g: float | None = None,
    z_e: float = 0.0,
    sigma_h: float | None = None,
    z_g: float | None = None,
    z_h: float | None = None,
    lambda_lo: float | None = None,
    spectral: float | None = None,
    sigma_l: float | None = None,
    lambda_shift_extra: float = 0.0,
    z_l: float | None = None,
) -> dict[str, np.ndarray]:
    """The terms of the reported bound for rows ``x`` (m×d, already clipped) and labels ``y`` (±1).

    With radius = τ = 0 and no Ĥ/ĝ this is exactly Alg 2 DATA-INDEP of Redberg 2023.
    ``theta`` is the released ``out`` (the ball of radius ``radius`` around it holds θ^P).

    When ĝ (``g_hat``, std ``sigma_g``) and Ĥ (``h_hat``, GOE scale ``sigma_h``) were released, their own
    Gaussian ex-post losses are added (they are part of the transcript):
    * ĝ: shift Δ_g = sup_ball|f'|·‖x‖ + 2τ, std σ₂: Δ_g²/(2σ₂²) + Δ_g·z_g/σ₂;
    * Ĥ: in the GOE vector [diag/√2, upper] the noise is iid N(0, σ₃²) and the shift f''(xᵀout)xxᵀ
      (Ĥ is evaluated at the released out) has norm Δ_H/√2, Δ_H = f''(xᵀout)‖x‖²:
      Δ_H²/(4σ₃²) + Δ_H·z_h/(√2σ₃).
    ``z_g``, ``z_h`` default to ``z_e``.

    Adaptive report (Alg 9; ``lambda_lo`` = λ_lo from the released λ̂_min, ``spectral`` = σ₃τ_GOE, ``sigma_l``
    = σ₄): the leverage uses ``adaptive_leverage`` (any λ) instead of Prop A.5.1's 1.5·xᵀĤ⁻¹x, and λ̂_min's
    own Gaussian loss is added: shift Δ_λ = f''(xᵀout)‖x‖² (Weyl) + ``lambda_shift_extra`` (rounding and
    float error), Δ_λ²/(2σ₄²) + Δ_λ·z_l/σ₄.
    """
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    norms = np.linalg.norm(x, axis=1)
    u0 = x @ theta
    spread = radius * norms
    lo, hi = u0 - spread, u0 + spread
    f2 = _sup_d2(lo, hi)
    f1 = _sup_abs_d1(lo, hi, y)
    mu_bar = norms**2 / lam
    if h_hat is not None and lambda_lo is not None:
        if spectral is None:
            raise ValueError("the adaptive report needs the GOE spectral bound σ₃τ_GOE")
        # H(θ^P) ⪰ e^{−Rr}H(out) (self-concordance, as below) and H(θ^P) ⪰ λI
        adaptive = adaptive_leverage(np.asarray(h_hat, dtype=np.float64), x, lambda_lo, spectral)
        mu_bar = np.minimum(math.exp(row_norm * radius) * adaptive, mu_bar)
    elif h_hat is not None:
        try:
            factor = linalg.cholesky(np.asarray(h_hat, dtype=np.float64), lower=True)
            solved = linalg.solve_triangular(factor, x.T, lower=True)
            quad = np.sum(solved * solved, axis=0)
            mu_bar = np.minimum(math.exp(row_norm * radius) * 1.5 * quad, mu_bar)
        except linalg.LinAlgError:
            pass  # Ĥ not positive definite: outside the GOE event; ‖x‖²/λ is always valid
    leverage = -np.log1p(-f2 * mu_bar)
    fit = f1**2 * norms**2 / (2.0 * sigma**2)
    bx = sigma * norms * z_b
    if g_hat is not None:
        assert sigma_g is not None
        bx = np.minimum(bx, np.abs(x @ np.asarray(g_hat)) + sigma_g * norms * z_e + tau * norms)
    gradient = f1 * bx / sigma**2
    output = np.zeros_like(norms)
    if sigma_out is not None and tau > 0.0:
        shift = 2.0 * tau / lam
        output = output + shift**2 / (2.0 * sigma_out**2) + shift * z_out / sigma_out
    report_gradient = np.zeros_like(norms)
    if g_hat is not None:
        assert sigma_g is not None
        shift_g = f1 * norms + 2.0 * tau
        zg = z_e if z_g is None else z_g
        report_gradient = shift_g**2 / (2.0 * sigma_g**2) + shift_g * zg / sigma_g
    report_hessian = np.zeros_like(norms)
    if h_hat is not None:
        if sigma_h is None:
            raise ValueError("a released Ĥ needs its noise scale sigma_h (its loss is part of the bound)")
        shift_h = logistic_d2(u0) * norms**2
        zh = z_e if z_h is None else z_h
        report_hessian = shift_h**2 / (4.0 * sigma_h**2) + shift_h * zh / (math.sqrt(2.0) * sigma_h)
    report_lambda = np.zeros_like(norms)
    if lambda_lo is not None:
        if sigma_l is None:
            raise ValueError("a released λ̂_min needs its noise scale sigma_l (its loss is part of the bound)")
        shift_l = logistic_d2(u0) * norms**2 + lambda_shift_extra
        zl = z_e if z_l is None else z_l
        report_lambda = shift_l**2 / (2.0 * sigma_l**2) + shift_l * zl / sigma_l
    total = leverage + fit + gradient + output + report_gradient + report_hessian + report_lambda
    terms = {
        "leverage": leverage,
        "fit": fit,
        "gradient": gradient,
        "output": output,
        "report_gradient": report_gradient,
        "report_hessian": report_hessian,
    }
    if lambda_lo is not None:
        terms["report_lambda_min"] = report_lambda
    return {**terms, "total": total}


def personalized_rdp(
    norms: np.ndarray,
    p: ObjPertLogisticParams,
    sigma_out: float,
    orders: Sequence[float],
    lambda_shift_extra: float = 0.0,
) -> list[RdpCurve]:
    """ρ_z(α) per record (docs/privacy/objective_perturbation.md#personalized-rdp, derived; add/remove):
    the bound with L_z = ‖x‖, β_z = ‖x‖²/4.

    Vectorised over records (rows) and orders (columns) with the closed form of ``objpert_rdp``.
    """
    alphas = np.asarray(orders, dtype=np.float64)[None, :]
    norm = np.asarray(norms, dtype=np.float64)[:, None]
    lam, sigma = p.regularization, p.sigma
    s = norm / sigma
    values = (
        -np.log1p(-(norm**2 / 4.0) / lam)
        + alphas * s * s / 2.0
        + (math.log(2.0) + stats.norm.logcdf((alphas - 1.0) * s)) / (alphas - 1.0)
        + amp_grid_rdp(alphas, p.tolerance, lam, p.sigma, sigma_out)
    )
    if p.report == "data_dependent":
        assert p.report_gradient_sigma is not None
        assert p.report_hessian_sigma is not None
        values = values + alphas * (
            (norm + 2.0 * p.tolerance) ** 2 / (2.0 * p.report_gradient_sigma**2)
            + (norm**2 / 4.0) ** 2 / (4.0 * p.report_hessian_sigma**2)
        )
    if is_adaptive(p):
        assert p.report_lambda_min_sigma is not None
        # λ̂_min for z: its mean moves by ≤ f''‖x‖² ≤ ‖x‖²/4 (Weyl; Thm A.3.1 of Redberg 2023) plus the
        # release's rounding and float error (``lambda_shift_extra``, stored with the release)
        shift_l = norm**2 / 4.0 + lambda_shift_extra
        values = values + alphas * shift_l**2 / (2.0 * p.report_lambda_min_sigma**2)
    padded = np.nextafter(values * (1.0 + 1e-12) + 1e-15, np.inf)
    return [RdpCurve(tuple(orders), tuple(float(v) for v in row)) for row in padded]


def evaluate_report(
    p: ObjPertLogisticParams,
    output: dict[str, Any],
    x: np.ndarray,
    y: np.ndarray,
    orders: Sequence[float],
) -> list[dict[str, Any]]:
    """Evaluate a release's reporting function on records (rows already through ``design_matrix``).

    Reads only ``output`` (the release) and ``p`` (public parameters): post-processing, charged 0.
    """
    report = output.get("report")
    if not isinstance(report, dict):
        raise ValueError("this release has no reporting function (report = none)")
    theta = np.asarray(output["theta"], dtype=np.float64)
    sigma_out = float(output["output_sigma"])
    z = float(report["z"])
    dependent = report["kind"] == "data_dependent"
    adaptive = dependent and "lambda_min" in report
    adaptive_args: dict[str, Any] = {}
    if adaptive:
        adaptive_args = {
            "lambda_lo": lower_lambda(p, report),
            # ‖Ĥ − H‖ ≤ σ₃τ_GOE (noise and rounding) + the float error of assembling H (≤ e ≤ shift_extra/2)
            "spectral": float(report["hessian_sigma"]) * float(report["tau_goe"])
            + float(report["lambda_min_shift_extra"]) / 2.0,
            "sigma_l": float(report["lambda_min_sigma"]),
            "lambda_shift_extra": float(report["lambda_min_shift_extra"]),
            "z_l": z,
        }
    terms = ex_post_terms(
        theta,
        x,
        y,
        lam=p.regularization,
        sigma=p.sigma,
        z_b=z,
        radius=float(report["radius"]),
        row_norm=p.row_norm,
        tau=p.tolerance,
        sigma_out=sigma_out,
        z_out=z,
        h_hat=np.asarray(report["hessian"]) if dependent else None,
        g_hat=np.asarray(report["gradient"]) if dependent else None,
        sigma_g=p.report_gradient_sigma,
        z_e=z,
        sigma_h=p.report_hessian_sigma,
        **adaptive_args,
    )
    curves = personalized_rdp(
        np.linalg.norm(np.atleast_2d(x), axis=1),
        p,
        sigma_out,
        orders,
        float(report["lambda_min_shift_extra"]) if adaptive else 0.0,
    )
    # each event was given ρ/events at release; releases made before ĝ and Ĥ got their own events (5 events)
    # use the same z for the two new ones, so the union bound is over DATA_DEPENDENT_EVENTS events of ρ/events
    stored_events = int(report.get("events", _events(p)))
    used_events = ADAPTIVE_EVENTS if adaptive else DATA_DEPENDENT_EVENTS if dependent else PUBLIC_EVENTS
    if stored_events >= used_events:
        confidence = 1.0 - p.report_rho
    else:
        confidence = 1.0 - p.report_rho * used_events / stored_events
    results = []
    for i, curve in enumerate(curves):
        results.append(
            {
                "ex_post_epsilon_upper": float(terms["total"][i]),
                "confidence": confidence,
                "terms": {k: float(v[i]) for k, v in terms.items() if k != "total"},
                "personalized_rdp": curve.as_dict(),
            }
        )
    return results


# ----- verification only (never reachable from the service) ----------------------------------------------


def exact_ex_post_loss(
    theta: np.ndarray,
    data_x: np.ndarray,
    data_y: np.ndarray,
    x: np.ndarray,
    y: float,
    lam: float,
    sigma: float,
    member: bool,
) -> float:
    """Cor 2.3.2 of Redberg 2023: the true ex-post loss of exact ObjPert at its minimizer θ for record
    z=(x,y).

    D = (data_x, data_y) is the dataset actually used; ``member`` says whether z ∈ D (neighbour D \\ {z})
    or not (neighbour D ∪ {z}). Needs all of D: **for tests only**, never returned by any endpoint.
    """
    u = data_x @ theta
    hessian = (data_x * logistic_d2(u)[:, None]).T @ data_x + lam * np.eye(data_x.shape[1])
    grad_j = data_x.T @ logistic_d1(u, data_y) + lam * theta
    b_hat = -grad_j
    uz = float(x @ theta)
    f1 = float(logistic_d1(np.asarray(uz), np.asarray(y)))
    f2 = float(logistic_d2(np.asarray(uz)))
    g = f1 * np.asarray(x, dtype=np.float64)
    mu = float(x @ np.linalg.solve(hessian, x))
    sign = -1.0 if member else 1.0
    value = -math.log1p(sign * f2 * mu) + float(g @ g) / (2.0 * sigma**2) - sign * float(b_hat @ g) / sigma**2
    return abs(value)
