"""AdaOPS for ridge regression (Wang 2019, Alg 1, corrected: note seed_002 §3.5 and errata 1–7), with
publishable per-instance reports. Proofs: docs/privacy/adaops.md#adaops,
docs/mechanisms/per_instance_ridge.md.

1. W = (λ̃, ñ). λ̃ = 2^−10·(m* + Y): m* = ⌈λ_min(XᵀX)/2^−10⌉ − 1 certified by exact elimination (it moves
   by ≤ 1024 units between neighbours, Weyl with ‖x‖ ≤ 1), Y ~ N_Z(0, t²) with the smallest integer t (from
   the analytic Gaussian σ up) whose **exact** discrete-Gaussian profile (Canonne–Kamath–Steinke 2020,
   Thm 7) meets (ε_λ, δ_λ). Under add/remove the row count is private: ñ = n + Y_n, Y_n ~ N_Z(0, t_n²)
   calibrated the same way to (ε_n, δ_n) at shift 1 (ε_λ + ε_n = ε₁); under replace-one n is public.
2. Margin m = 1 + 2^−10·k₃ with P(Y > k₃) ≤ δ₃ (exact tail); n_hi = max(ñ + k₄, n_floor) with
   P(Y_n < −k₄) ≤ δ₄ (n_hi = n under replace-one); h = n_hi/(dκ); λ_n = max(λ_floor, h − λ̃ + m). On the good
   event {Y·2^−10 ≤ m − 1, Y_n ≥ −k₄} (probability ≥ 1 − δ₃ − δ₄ under every data set) the smaller data set
   S of any neighbouring pair has λ_min(H) ≥ h and n_S ≤ n_hi, so μ ≤ μ̄ = 1/h and |r| ≤ R = 1 + √(2dκ)
   (Lemma A.1). No branch reads the private n.
3. γ from B(μ̄, R; γ, δ_post) = ε_post (B is the certified OPS bound, monotone in μ, |r|, γ): a function of
   the public plan and W; replace-one goes through the data set minus the row (2 steps: (2e, (1 + e^e)δ)).
   n_floor (public) keeps ½log(1 + μ̄) + μ̄·log(1/δ) ≤ ε_post/2, so γ always exists: no ⊥.
4. θ̃ ~ N(θ̂, H⁻¹/γ) drawn exactly as ``mechanisms.ptr.ops_linear`` does (discrete Gaussians coupled to the
   continuous ones, exact rationals, output on a public grid; the discretisation costs (ε_out, δ_out)).
Guarantee (Theorem GEN-PTR of docs/privacy/approximate.md#theorem-gen-ptr with W = (λ̃, ñ), δ′ = δ₃ + δ₄):
(ε₁ + ε₂, δ_λ + δ_n + δ₂ + δ₃ + δ₄)-DP = the declared (ε, δ), admitted through the δ-ledger
(approximate-DP path). With ``report = "data_dependent"`` a GOE-noised Gram matrix is released as well and
charged (ε_rep, δ_rep) on top.

Reports (``evaluate_report``) are functions of the release, the public parameters and the caller's own
record only: post-processing, charged 0. They bound, with probability ≥ 1 − ρ over the mechanism's noise,
the ex-post per-instance loss of the record (the λ̃ and ñ releases and the OPS step) and its (ε, δ₂)-pDP
in the OPS step including the output discretisation, as a member (pair (Z_{-i}, z_i)) and as an outsider
(pair (Z, [Z, z])).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt
from scipy import special

from mechanisms.accounting.approximate import ApproximateCharge
from mechanisms.base import ParamsError, PublicContext, Release, Table
from mechanisms.learners.features import FeatureSpec, check_features, design_matrix, dimension
from mechanisms.noise import Grid, Noise, dyadic_scale_up, grid_l2_sensitivity
from mechanisms.noise.learners import discrete_gaussian_std
from mechanisms.params import NoiseStd, OpenUnit, SmallDelta
from mechanisms.per_instance.ridge import agm_sigma, ops_bound
from mechanisms.ptr.ops_linear import (
    COUPLING_BITS,
    INPUT_BITS,
    OUTPUT_BITS,
    Neighbouring,
    lambda_min_floor_units,
    nudge_down,
    nudge_up,
    output_noise_std,
    output_step_cost,
    quantise,
    solve_exact,
)
from mechanisms.ptr.protocol import ApproximateBase

MAX_DIMENSION = 32
LAMBDA_BITS = 10  # λ̃ on the grid 2^−10
LAMBDA_SHIFT = 1 << LAMBDA_BITS  # λ_min moves by ≤ 1 = 1024 units between neighbours
REPORT_EVENTS = 4  # λ̃ margin, residual, output noise, λ̃ noise (public report); +1 ñ noise, +1 GOE
COUNT_SHARE = 0.2  # add/remove: share of ε₁ spent on the noisy row count ñ
_PAD = 1.0 + 1e-12


class AdaOpsRidgeParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    features: FeatureSpec
    epsilon: StrictFloat = Field(gt=0, le=20, allow_inf_nan=False, description="total ε of the call")
    delta: SmallDelta = Field(description="total δ of the call")
    kappa: StrictFloat = Field(
        gt=0, le=1e9, allow_inf_nan=False, description="κ: largest acceptable condition number (h = n̄/(dκ))"
    )
    max_rows: StrictInt | None = Field(
        default=None,
        ge=1,
        le=10**9,
        description="not accepted: the row count is public (replace_one) or released with noise (add_remove)",
    )
    lambda_share: OpenUnit = Field(
        default=0.5, description="share ε₁/ε of ε spent on releasing λ_min (and, add_remove, the row count)"
    )
    min_lambda: StrictFloat = Field(
        default=1.0, gt=0, le=1e9, allow_inf_nan=False, description="floor of the adaptive ridge λ_n"
    )
    report: Literal["public", "data_dependent"] = Field(
        default="public", description="public: free report from the release; data_dependent: also a noisy XᵀX"
    )
    report_sigma: NoiseStd | None = Field(
        default=None, description="σ of the Gram's GOE noise (data_dependent)"
    )
    report_delta: SmallDelta | None = Field(
        default=None, description="δ charged for the Gram (data_dependent)"
    )
    report_rho: StrictFloat = Field(
        default=0.05, gt=0, lt=0.5, allow_inf_nan=False, description="failure probability ρ of the report"
    )


# ----- exact discrete Gaussian profile ------------------------------------------------------------------


EXACT_SUM_STD = 20_000  # up to this std the tails are summed term by term (80·t floats); above, bounded


def _dg_tail(t: int, above: float, *, upper: bool = True) -> float:
    """A bound on P(Y > above), Y ~ N_Z(0, t²): an upper bound (``upper``) or a lower bound.

    Normaliser Z = Σ_k e^{−k²/(2t²)} = √(2π)t·(1 + 2Σ_{m≥1} e^{−2π²t²m²}) (Poisson summation), so
    √(2π)t ≤ Z ≤ √(2π)t·(1 + 3e^{−2π²t²}). For t ≤ ``EXACT_SUM_STD`` the terms on (above, 40t] are summed
    (beyond 40t the mass is < e^{−800}, covered by the caller's +1e-300); for larger t the sum over k > m,
    m = ⌊above⌋ ≥ 0, lies between the integrals ∫_{m+1}^∞ and ∫_m^∞ of the decreasing density."""
    tf = float(t)
    z_low = math.sqrt(2.0 * math.pi) * tf
    z_high = z_low * (1.0 + 3.0 * math.exp(-2.0 * math.pi**2 * tf * tf))
    start = math.floor(above) + 1
    if t <= EXACT_SUM_STD or start < 1:
        start = max(start, -40 * t)
        if start > 40 * t:
            return 0.0
        k = np.arange(start, 40 * t + 1, dtype=np.float64)
        total = float(np.sum(np.exp(-(k * k) / (2.0 * tf * tf))[::-1]))
        return total / z_low * (1.0 + 1e-12) if upper else total / z_high * (1.0 - 1e-12)
    m = start - 1
    if upper:
        return float(special.ndtr(-m / tf)) * (1.0 + 1e-12)
    return float(special.ndtr(-(m + 1) / tf)) * z_low / z_high * (1.0 - 1e-12)


def discrete_gaussian_delta(t: int, shift: int, epsilon: float) -> float:
    """δ(ε) of N_Z(0, t²) vs a shift by ≤ ``shift`` integers (CKS 2020, Thm 7), rounded up: an upper bound
    of the first tail minus e^ε times a lower bound of the second."""
    a = epsilon * t * t / shift
    first = _dg_tail(t, a - shift / 2.0, upper=True)
    second = _dg_tail(t, a + shift / 2.0, upper=False)
    return nudge_up(max(first - math.exp(epsilon) * second, 0.0)) + 1e-300


@lru_cache(maxsize=256)
def discrete_gaussian_std_for(shift: int, epsilon: float, delta: float) -> int:
    """The smallest integer t ≥ ⌈AGM σ⌉ (scanned upward by 0.1%) with discrete_gaussian_delta ≤ δ."""
    t = max(1, math.ceil(agm_sigma(float(shift), epsilon, delta)))
    while discrete_gaussian_delta(t, shift, epsilon) > delta:
        t = max(t + 1, math.ceil(t * 1.001))
    return t


@lru_cache(maxsize=256)
def discrete_gaussian_quantile(t: int, prob: float) -> int:
    """The smallest integer k ≥ 0 with P(Y > k) ≤ prob (tail bounded above as in ``_dg_tail``)."""
    lo, hi = 0, max(1, t)
    while _dg_tail(t, hi) > prob:
        hi *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _dg_tail(t, mid) <= prob else (mid, hi)
    return hi if _dg_tail(t, lo) > prob else lo


# ----- the public plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdaOpsPlan:
    """Everything public about one call (a function of the parameters and the public context only)."""

    dim: int
    kappa: float
    rows_public: int | None  # n under replace_one; None under add_remove (n is private)
    rows_floor: int  # n_floor: the public lower end of n_hi (add_remove); = n under replace_one
    neighbouring: Neighbouring
    eps_lambda: float
    eps_count: float
    eps_ops: float
    eps_post: float
    eps_out: float
    delta_lambda: float
    delta_count: float
    delta_ops: float
    delta_post: float
    delta_out: float
    delta_event: float
    delta_count_event: float
    lambda_std_units: int  # t: std of Y in units of 2^−10
    count_std: int  # t_n: std of Y_n (0 under replace_one: no count released)
    count_quantile: int  # k₄ with P(Y_n < −k₄) ≤ δ₄
    margin: float  # m = 1 + 2^−10·k₃
    gamma_target: float  # the per-add/remove-step target of B (ε_post, or ε_post/2 under replace_one)
    gamma_delta: float  # δ₀ of that target
    threshold: float  # h = n_hi/(dκ) at n_hi = rows_floor (the largest μ̄: the worst case)
    mu_bar: float
    r_bar: float
    gamma: float  # γ_B at n_hi = rows_floor
    min_lambda: float
    report_epsilon: float
    report_delta: float
    report_sigma: float | None

    @property
    def lambda_step(self) -> float:
        return math.ldexp(1.0, -LAMBDA_BITS)

    @property
    def lambda_sigma(self) -> float:
        return self.lambda_std_units * self.lambda_step

    @property
    def epsilon(self) -> float:
        return self.eps_lambda + self.eps_count + self.eps_ops + self.report_epsilon

    @property
    def delta(self) -> float:
        return (
            self.delta_lambda
            + self.delta_count
            + self.delta_ops
            + self.delta_event
            + self.delta_count_event
            + self.report_delta
        )

    def public(self) -> dict[str, Any]:
        return {
            "lambda_noise_sigma": self.lambda_sigma,
            "lambda_grid": self.lambda_step,
            "margin": self.margin,
            "threshold_h": self.threshold,
            "mu_bar": self.mu_bar,
            "residual_bar": self.r_bar,
            "gamma": self.gamma,
            "row_count_noise_std": self.count_std,
            "row_count_margin": self.count_quantile,
            "rows_floor": self.rows_floor,
            "epsilon_split": {
                "lambda": self.eps_lambda,
                "row_count": self.eps_count,
                "ops": self.eps_ops,
                "report": self.report_epsilon,
            },
            "delta_split": {
                "lambda": self.delta_lambda,
                "row_count": self.delta_count,
                "ops": self.delta_ops,
                "good_event": self.delta_event,
                "row_count_event": self.delta_count_event,
                "report": self.report_delta,
            },
        }


def solve_gamma(mu_bar: float, r_bar: float, target: float, delta: float) -> float | None:
    """The γ > 0 with B(μ̄, R; γ, δ) = target (quadratic in s = √γ), rounded down; None if B at γ → 0
    is already ≥ target."""
    ld = math.log(1.0 / delta)
    a = mu_bar * r_bar * r_bar / (2.0 * (1.0 + mu_bar))
    b = r_bar * math.sqrt(2.0 * mu_bar * ld)
    c = 0.5 * math.log1p(mu_bar) + mu_bar * ld - target
    if c >= 0.0:
        return None
    s = 2.0 * (-c) / (b + math.sqrt(b * b - 4.0 * a * c))
    gamma = nudge_down(s * s)
    while float(ops_bound(gamma, mu_bar, r_bar, delta)) > target:
        gamma = nudge_down(gamma * (1.0 - 1e-9))
    return gamma


def public_rows(p: AdaOpsRidgeParams, ctx: PublicContext) -> int | None:
    """The dataset's n under replace_one (public there); None under add_remove (n is private: the mechanism
    releases a noisy count instead). ``max_rows`` is refused: a declared bound would have to be checked
    against the private n, and any branch on that check leaks it."""
    if p.max_rows is not None:
        raise ParamsError(
            "max_rows",
            "not accepted: the row count is public on replace_one datasets and released with noise on "
            "add_remove datasets",
        )
    if ctx.schema.neighboring == "replace_one":
        assert ctx.n_rows is not None
        return ctx.n_rows
    return None


def ops_calibration(
    kappa: float, dim: int, rows_upper: int, target: float, delta0: float
) -> tuple[float, float, float, float | None]:
    """(h, μ̄, R, γ) for an upper bound ``rows_upper`` on the smaller set's n: h = n_hi/(dκ) rounded down,
    μ̄ = 1/h and R = 1 + √(2n_hi/h) rounded up, γ from B(μ̄, R; γ, δ₀) = target (None: infeasible)."""
    h = nudge_down(rows_upper / (dim * kappa))
    mu_bar = nudge_up(1.0 / h)
    r_bar = nudge_up(1.0 + math.sqrt(nudge_up(2.0 * rows_upper / h)))
    return h, mu_bar, r_bar, solve_gamma(mu_bar, r_bar, target, delta0)


def rows_floor(kappa: float, dim: int, target: float, delta0: float) -> int:
    """n_floor: the smallest N with ½log(1 + μ̄) + μ̄·log(1/δ₀) ≤ target/2 at μ̄ = μ̄(N) (so half the
    target is left for the residual term and γ exists). Public; any n_hi ≥ n_floor is sound (larger only
    adds ridge)."""
    ld = math.log(1.0 / delta0)

    def fixed(mu: float) -> float:
        return 0.5 * math.log1p(mu) + mu * ld

    lo, hi = 0.0, target / 2.0 / ld  # fixed(hi) ≥ target/2
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if fixed(mid) <= target / 2.0 else (lo, mid)
    n = max(1, math.ceil(dim * kappa / lo)) if lo > 0 else 1
    while True:
        _, mu_bar, _, gamma = ops_calibration(kappa, dim, n, target, delta0)
        if gamma is not None and fixed(mu_bar) <= target / 2.0:
            return n
        n = max(n + 1, math.ceil(n * 1.0001))


def rows_upper(pl: AdaOpsPlan, rows_noisy: int) -> int:
    """n_hi = max(ñ + k₄, n_floor) (post-processing of ñ); ≥ n_X except with probability ≤ δ₄."""
    return max(rows_noisy + pl.count_quantile, pl.rows_floor)


def gram_grid(sigma: float, d: int) -> Grid:
    """The grid of the released Gram's GOE vector: the largest power of two ≤ σ·2^−20/d."""
    return Grid(math.frexp(sigma * 2.0**-20 / d)[1] - 1)


def report_charge(p: AdaOpsRidgeParams, d: int, neighbouring: Neighbouring) -> tuple[float, float]:
    """(ε_rep, δ_rep) of the GOE-noised Gram: vector [diag/√2, upper] with iid N_Z noise of std ≥ σ₃;
    sensitivity ‖xxᵀ‖_F/√2 ≤ 1/√2 (add/remove), ≤ 1 (replace-one), plus the grid rounding; discrete Gaussians
    are ρ-zCDP with ρ = Δ²/(2σ²) (CKS 2020, Thm 4) and ε = ρ + 2√(ρ log(1/δ)) (Bun–Steinke 2016, Prop 1.3)."""
    if p.report != "data_dependent":
        return 0.0, 0.0
    if p.report_sigma is None or p.report_delta is None:
        raise ParamsError("report_sigma", "report = data_dependent needs report_sigma and report_delta")
    grid = gram_grid(p.report_sigma, d)
    size = d * (d + 1) // 2
    l2 = 1.0 if neighbouring == "replace_one" else 1.0 / math.sqrt(2.0)
    units = grid_l2_sensitivity(l2, size, grid, integer_valued=False)
    t = max(1, math.ceil(Fraction(p.report_sigma) / Fraction(grid.granularity)))
    rho = nudge_up(units * units / (2.0 * t * t))
    return nudge_up(rho + 2.0 * math.sqrt(rho * math.log(1.0 / p.report_delta))), float(p.report_delta)


def plan(p: AdaOpsRidgeParams, dim: int, rows: int | None, neighbouring: Neighbouring) -> AdaOpsPlan:
    """The public plan. ``rows``: n under replace_one (public), None under add_remove."""
    if (rows is None) != (neighbouring == "add_remove"):
        raise ValueError("rows must be given exactly for replace_one")
    eps_w = p.epsilon * p.lambda_share
    eps_ops = p.epsilon - eps_w
    if neighbouring == "add_remove":
        eps_count = eps_w * COUNT_SHARE
        eps_lambda = eps_w - eps_count
        delta_lambda = delta_count = delta_event = delta_count_event = p.delta / 5.0
    else:
        eps_count, eps_lambda = 0.0, eps_w
        delta_lambda = delta_event = p.delta / 3.0
        delta_count = delta_count_event = 0.0
    delta_ops = p.delta - delta_lambda - delta_count - delta_event - delta_count_event
    delta_out = delta_ops / 1024.0
    eps_out = output_step_cost(dim, delta_out)
    eps_post = nudge_down(eps_ops - eps_out)
    if eps_post <= 0.0:
        raise ParamsError("epsilon", "too small for the output discretisation step")
    delta_post = nudge_down(delta_ops - delta_out)
    t = discrete_gaussian_std_for(LAMBDA_SHIFT, eps_lambda, delta_lambda)
    k3 = discrete_gaussian_quantile(t, delta_event)
    margin = nudge_up(1.0 + k3 * math.ldexp(1.0, -LAMBDA_BITS))
    if neighbouring == "add_remove":
        target, d0 = eps_post, delta_post
        t_n = discrete_gaussian_std_for(1, eps_count, delta_count)
        k4 = discrete_gaussian_quantile(t_n, delta_count_event)  # symmetric: P(Y_n < −k₄) ≤ δ₄
        floor = rows_floor(p.kappa, dim, target, d0)
    else:  # two add/remove steps through the data set minus the row: (2e, (1 + e^e)δ₀)
        target = eps_post / 2.0
        d0 = delta_post / (1.0 + math.exp(target)) / _PAD
        t_n, k4 = 0, 0
        assert rows is not None
        floor = rows
    h, mu_bar, r_bar, gamma = ops_calibration(p.kappa, dim, floor, target, d0)
    if gamma is None:
        raise ParamsError(
            "kappa", "too large for this ε: need ε_ops > ½log(1+dκ/n̄) + (dκ/n̄)·log(1/δ) (lower κ or raise ε)"
        )
    rep_eps, rep_delta = report_charge(p, dim, neighbouring)
    return AdaOpsPlan(
        dim=dim,
        kappa=p.kappa,
        rows_public=rows,
        rows_floor=floor,
        neighbouring=neighbouring,
        eps_lambda=eps_lambda,
        eps_count=eps_count,
        eps_ops=eps_ops,
        eps_post=eps_post,
        eps_out=eps_out,
        delta_lambda=delta_lambda,
        delta_count=delta_count,
        delta_ops=delta_ops,
        delta_post=delta_post,
        delta_out=delta_out,
        delta_event=delta_event,
        delta_count_event=delta_count_event,
        lambda_std_units=t,
        count_std=t_n,
        count_quantile=k4,
        margin=margin,
        gamma_target=target,
        gamma_delta=d0,
        threshold=h,
        mu_bar=mu_bar,
        r_bar=r_bar,
        gamma=gamma,
        min_lambda=p.min_lambda,
        report_epsilon=rep_eps,
        report_delta=rep_delta,
        report_sigma=p.report_sigma if p.report == "data_dependent" else None,
    )


def calibrate(pl: AdaOpsPlan, n_hi: int) -> tuple[float, float, float]:
    """(h, μ̄, γ) at n_hi (post-processing of W; n_hi ≥ n_floor so γ exists)."""
    if n_hi < pl.rows_floor:
        raise ValueError("n_hi below the public floor")
    h, mu_bar, _, gamma = ops_calibration(pl.kappa, pl.dim, n_hi, pl.gamma_target, pl.gamma_delta)
    assert gamma is not None  # n_hi ≥ n_floor: the floor's γ exists and B is monotone in μ̄
    return h, mu_bar, gamma


def adaptive_lambda(pl: AdaOpsPlan, lambda_noisy: float, threshold: float | None = None) -> float:
    """λ_n = max(λ_floor, h − λ̃ + m) (post-processing of W; h = the plan's unless given)."""
    h = pl.threshold if threshold is None else threshold
    return max(pl.min_lambda, h - lambda_noisy + pl.margin)


def sample_scale(gamma: float) -> Fraction:
    """s ≥ 1/√γ dyadic (γ_eff = 1/s² ≤ γ: the covariance H⁻¹s² only grows)."""
    s = dyadic_scale_up(nudge_up(1.0 / math.sqrt(gamma)))
    while float(1 / (s * s)) > gamma:
        s = s * Fraction(1025, 1024)
    return s


# ----- the mechanism -----------------------------------------------------------------------------------


class AdaOpsRidge(ApproximateBase[AdaOpsRidgeParams]):
    """``adaops.ridge``: ridge regression by one posterior sample with a privately released λ_min."""

    name: ClassVar[str] = "adaops.ridge"
    summary: ClassVar[str] = (
        "Ridge regression by AdaOPS (one posterior sample, ridge adapted to a DP release of λ_min), with "
        "per-instance privacy reports (approximate DP: charged (ε, δ) on the δ-ledger)"
    )
    params_model: ClassVar[type[BaseModel]] = AdaOpsRidgeParams

    def plan_for(self, p: AdaOpsRidgeParams, ctx: PublicContext) -> AdaOpsPlan:
        d = dimension(p.features, ctx)
        return plan(p, d, public_rows(p, ctx), ctx.schema.neighboring)

    def check(self, p: AdaOpsRidgeParams, ctx: PublicContext) -> None:
        check_features(p.features, ctx, "regression", "features")
        d = dimension(p.features, ctx)
        if d > MAX_DIMENSION:
            raise ParamsError("features", f"dimension {d} exceeds {MAX_DIMENSION} (exact arithmetic)")
        self.plan_for(p, ctx)

    def approximate_charge(self, p: AdaOpsRidgeParams, ctx: PublicContext) -> ApproximateCharge:
        pl = self.plan_for(p, ctx)
        return ApproximateCharge.from_epsilon_delta(nudge_up(pl.epsilon), nudge_up(pl.delta), ctx.orders)

    def run(self, p: AdaOpsRidgeParams, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        x, y = design_matrix(p.features, ctx, table, "regression", row_norm=1.0)
        pl = self.plan_for(p, ctx)
        output = adaops_release(pl, x, y, noise)
        return self.release(p, ctx, output)


def _exact_gram(
    x: np.ndarray, y: np.ndarray
) -> tuple[np.ndarray, list[list[Fraction]], list[Fraction], Fraction]:
    """Rows truncated toward zero on the grid 2^−20 (‖x‖ ≤ 1, |y| ≤ 1 kept); exact XᵀX and Xᵀy."""
    d = x.shape[1]
    grid = math.ldexp(1.0, -INPUT_BITS)
    g = Fraction(grid)
    xi = quantise(x, grid)
    yi = quantise(y, grid)
    xo = xi.astype(object)
    gram_int = xo.T @ xo
    xty_int = xo.T @ yi.astype(object)
    gram = [[Fraction(int(gram_int[i, j])) * g * g for j in range(d)] for i in range(d)]
    xty = [Fraction(int(xty_int[i])) * g * g for i in range(d)]
    return xi, gram, xty, g


def adaops_release(
    pl: AdaOpsPlan, x: np.ndarray, y: np.ndarray, noise: Noise, *, drop_margin: bool = False
) -> dict[str, Any]:
    """Corrected Alg 1 with W = (λ̃, ñ). ``drop_margin`` (tests only: the broken variant an audit must catch)
    uses m = 0. Never ⊥ and no branch on the private n: n enters only through ñ (add/remove)."""
    n, d = x.shape
    out: dict[str, Any] = {"released": False, "coefficients": None, **pl.public()}
    xi, gram, xty, g = _exact_gram(x, y)
    step = Fraction(pl.lambda_step)
    estimate = float(np.linalg.eigvalsh(np.asarray(xi, dtype=np.float64).T @ xi)[0]) * float(g * g)
    units = lambda_min_floor_units(gram, step, estimate)
    lam_units = units + int(discrete_gaussian_std(noise, pl.lambda_std_units, 1)[0])
    lambda_noisy = float(lam_units * step)
    out["lambda_min_noisy"] = lambda_noisy
    if pl.count_std > 0:  # add/remove: ñ = n + N_Z(0, t_n²); n_hi from ñ only
        rows_noisy = n + int(discrete_gaussian_std(noise, pl.count_std, 1)[0])
        n_hi = rows_upper(pl, rows_noisy)
        out["rows_noisy"] = rows_noisy
    else:  # replace-one: n is public
        n_hi = pl.rows_floor
    h, mu_bar, gamma = calibrate(pl, n_hi)
    out.update(rows_upper=n_hi, threshold_h=h, mu_bar=mu_bar, gamma_target=gamma)
    margin = 0.0 if drop_margin else pl.margin
    lam_n = max(pl.min_lambda, h - lambda_noisy + margin)
    root = dyadic_scale_up(math.sqrt(lam_n))
    while root * root < Fraction(lam_n):
        root += Fraction(1, root.denominator)
    lam_eff = root * root
    hess = [[gram[i][j] + (lam_eff if i == j else 0) for j in range(d)] for i in range(d)]
    s = sample_scale(gamma)
    coefficients, granularity = _posterior_sample(xi, g, gram, xty, hess, root, s, noise)
    out.update(
        released=True,
        coefficients=coefficients,
        granularity=granularity,
        output_noise_std=output_noise_std(d),
        **{"lambda": float(lam_eff), "gamma": float(1 / (s * s))},
    )
    if pl.report_sigma is not None:
        out["gram"] = _noisy_gram(gram, pl.report_sigma, noise)
    return out


def _posterior_sample(
    xi: np.ndarray,
    g: Fraction,
    gram: list[list[Fraction]],
    xty: list[Fraction],
    hess: list[list[Fraction]],
    root_lam: Fraction,
    s: Fraction,
    noise: Noise,
) -> tuple[list[float], float]:
    """θ̂ = H⁻¹(Xᵀy + s(XᵀG₁ + √λ·G₂)/T) exactly (G ~ N_Z(0, T²): Cov → s²H⁻¹ = H⁻¹/γ), released as
    γ_o(round(θ̂/γ_o) + Z_o) — the sampler of ``mechanisms.ptr.ops_linear``
    (docs/privacy/approximate.md#gen-ptr-and-ops-ptr)."""
    del gram
    n, d = xi.shape
    big_t = (1 << COUPLING_BITS) * (math.isqrt(max(n - 1, 0)) + 1 + math.isqrt(d - 1) + 1)
    if big_t > 1 << 52:
        raise ValueError("too many rows for the exact sampler (n > 2^34)")
    g1 = discrete_gaussian_std(noise, big_t, n).astype(object)
    g2 = discrete_gaussian_std(noise, big_t, d)
    xtg = xi.astype(object).T @ g1
    rhs = [xty[i] + s * (Fraction(int(xtg[i])) * g + root_lam * int(g2[i])) / big_t for i in range(d)]
    theta = solve_exact(hess, rhs)
    grid_o = math.ldexp(1.0, math.frexp(float(s / root_lam))[1] - 1 - OUTPUT_BITS)
    limit = 1 << 50
    units = [max(-limit, min(limit, math.floor(t / Fraction(grid_o) + Fraction(1, 2)))) for t in theta]
    z = discrete_gaussian_std(noise, output_noise_std(d), d)
    released = [
        math.ldexp(float(u + int(zi)), math.frexp(grid_o)[1] - 1) for u, zi in zip(units, z, strict=True)
    ]
    return released, grid_o


def _noisy_gram(gram: list[list[Fraction]], sigma: float, noise: Noise) -> dict[str, Any]:
    """Ĝ = XᵀX + GOE noise on a public grid: vector u = [G_ii/√2, G_ij (i<j)], û = γ(round(u/γ) + Z),
    Z ~ N_Z(0, t²) iid, t = ⌈σ/γ⌉; Ĝ_ii = √2·û_i, Ĝ_ij = û_ij (post-processing)."""
    d = len(gram)
    grid = gram_grid(sigma, d)
    mat = np.array([[float(v) for v in row] for row in gram])
    upper = np.triu_indices(d, 1)
    vector = np.concatenate([np.diag(mat) / math.sqrt(2.0), mat[upper]])
    t = max(1, math.ceil(Fraction(sigma) / Fraction(grid.granularity)))
    v_hat = grid.from_units(grid.to_units(vector) + discrete_gaussian_std(noise, t, vector.size))
    g_hat = np.zeros((d, d))
    g_hat[upper] = v_hat[d:]
    g_hat = g_hat + g_hat.T
    g_hat[np.diag_indices(d)] = v_hat[:d] * math.sqrt(2.0)
    return {
        "matrix": [[float(v) for v in row] for row in g_hat],
        "grid": grid.describe(),
        "std": t * grid.granularity,
    }


# ----- reports (post-processing of the release) -----------------------------------------------------------


def goe_norm_bound(d: int, rho: float) -> float:
    """τ with P(‖W‖ > τ) ≤ ρ for W = (Z + Zᵀ)/√2 (Sudakov–Fernique + Gaussian concentration; the bound of
    ``mechanisms.per_instance.reports``): 2√d + 2√(log(2/ρ))."""
    return 2.0 * math.sqrt(d) + 2.0 * math.sqrt(math.log(2.0 / rho))


def _z(prob: float) -> float:
    """Φ⁻¹(1 − prob/2): P(|N(0,1)| > z) = prob."""
    return float(special.ndtri(1.0 - prob / 2.0))


def evaluate_report(
    pl: AdaOpsPlan,
    release: dict[str, Any],
    x: np.ndarray,
    y: np.ndarray,
    rho: float,
    *,
    drop_margins: bool = False,
) -> list[dict[str, Any]]:
    """Per-record bounds from the release and the records themselves (rows of x, entries of y; already
    clipped to ‖x‖ ≤ 1, |y| ≤ 1 as in training). Vectorised over records. For each record:
    ``member``/``outsider``: {``ex_post``, ``pdp_epsilon``, ``mu_upper``, ``residual_upper``}, all holding
    together with probability ≥ 1 − ρ over the mechanism's noise, for a record fixed before the release.
    ``drop_margins`` (tests only): the broken variant without confidence margins."""
    if not release.get("released"):
        raise ValueError("the release is ⊥: there is no model to report on")
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    y = np.atleast_1d(np.asarray(y, dtype=np.float64))
    grid = math.ldexp(1.0, -INPUT_BITS)
    x = quantise(x, grid) * grid
    y = quantise(y, grid) * grid
    data_dep = "gram" in release
    counted = pl.count_std > 0
    events = REPORT_EVENTS + (1 if data_dep else 0) + (1 if counted else 0)
    beta = rho / events
    gamma = float(release["gamma"])
    lam = float(release["lambda"])
    theta = np.asarray(release["coefficients"], dtype=np.float64)
    d = theta.size
    sq = np.einsum("ij,ij->i", x, x)
    t = pl.lambda_std_units
    step = pl.lambda_step
    # (1) λ_min(XᵀX) > λ̃ − m_β with probability ≥ 1 − β.
    m_beta = 0.0 if drop_margins else discrete_gaussian_quantile(t, beta) * step
    lam_full = lam + max(float(release["lambda_min_noisy"]) - m_beta, 0.0)
    mu_out = sq / lam_full
    h_mem = sq / lam_full
    if data_dep:  # XᵀX ⪰ Ĝ − σ₃τ I with probability ≥ 1 − β; H ⪰ M = Ĝ + (λ − σ₃τ)I
        gram = release["gram"]
        # noise ‖G‖ ≤ t·γ_G·τ_GOE, plus the rounding onto the grid: ‖E‖ ≤ ‖E‖_F ≤ d·γ_G (entries ≤ γ_G/√2)
        rounding = d * float(gram["grid"]["granularity"]) * _PAD
        tau = 0.0 if drop_margins else float(gram["std"]) * goe_norm_bound(d, beta) + rounding
        m = np.asarray(gram["matrix"], dtype=np.float64) + (lam - tau) * np.eye(d)
        ev = np.linalg.eigvalsh(m)
        if ev[0] > 0.0:
            quad = np.einsum("ij,ij->i", x @ np.linalg.inv(m), x) * _PAD
            mu_out = np.minimum(mu_out, quad)
            h_mem = np.minimum(h_mem, quad)
    lam_member = np.maximum(lam_full - sq, lam)
    mu_mem = sq / lam_member
    with np.errstate(divide="ignore"):
        mu_mem = np.minimum(mu_mem, np.where(h_mem < 1.0, h_mem / np.maximum(1.0 - h_mem, 1e-300), np.inf))
    # (3) the output step: ‖out − θ̃‖ ≤ γ_o(1 + √d/2 + ‖Z_o‖), ‖Z_o‖ ≤ t_o(√d + √(2 log(1/β))).
    t_o = float(release["output_noise_std"])
    slack_out = (
        0.0
        if drop_margins
        else float(release["granularity"])
        * (1.0 + math.sqrt(d) / 2.0 + t_o * (math.sqrt(d) + math.sqrt(2.0 * math.log(1.0 / beta))))
    )
    s_hat = np.abs(y - x @ theta) + np.sqrt(sq) * slack_out  # ≥ |y − xᵀθ̃|
    # (2) xᵀ(θ̃ − θ̂) ~ N(0, xᵀH⁻¹x/γ).
    z2 = 0.0 if drop_margins else _z(beta)
    r_out = s_hat + z2 * np.sqrt(mu_out / gamma)
    r_mem = (1.0 + mu_mem) * (s_hat + z2 * np.sqrt(mu_mem / gamma))
    # (4) the λ̃ release: shift v ≤ ‖x‖² (≤ ⌈‖x‖²·1024⌉ units), loss |(v² ± 2vY)/(2t²)|, |Y| ≤ k_β.
    k4 = 0.0 if drop_margins else float(discrete_gaussian_quantile(t, beta / 2.0))
    v = np.ceil(sq * LAMBDA_SHIFT)
    lam_loss = (v * v + 2.0 * v * k4) / (2.0 * float(t) * float(t))
    # (6, add/remove) the ñ release: shift 1, loss |(1 ± 2Y_n)/(2t_n²)|, |Y_n| ≤ k_β.
    if counted:
        k6 = 0.0 if drop_margins else float(discrete_gaussian_quantile(pl.count_std, beta / 2.0))
        lam_loss = lam_loss + (1.0 + 2.0 * k6) / (2.0 * float(pl.count_std) ** 2)
    # the output discretisation step: (ε_out, δ_out) by composition
    # (docs/privacy/approximate.md#gen-ptr-and-ops-ptr, docs/privacy/adaops.md#adaops-reports)
    eps_out = 0.0 if drop_margins else pl.eps_out

    def side(mu: np.ndarray, r: np.ndarray) -> dict[str, np.ndarray]:
        neg_c = 0.5 * np.log1p(mu) + gamma * r * r / (2.0 * (1.0 + mu))
        ops_loss = np.maximum(0.5 * gamma * s_hat * s_hat, neg_c)
        return {
            "ex_post": lam_loss + ops_loss + eps_out,
            "pdp_epsilon": ops_bound(gamma, mu, r, pl.delta_post) + eps_out,
            "mu_upper": mu,
            "residual_upper": r,
        }

    mem, outs = side(mu_mem, r_mem), side(mu_out, r_out)
    results = []
    for i in range(x.shape[0]):
        results.append(
            {
                "member": {k: float(v[i]) for k, v in mem.items()},
                "outsider": {k: float(v[i]) for k, v in outs.items()},
                "confidence": 1.0 - rho,
                "pdp_delta": pl.delta_ops,  # δ_post + δ_out
                "lambda_release_loss": float(lam_loss[i]),
            }
        )
    return results


ADAOPS_RIDGE = AdaOpsRidge()
