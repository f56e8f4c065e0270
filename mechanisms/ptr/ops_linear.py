"""OPS-PTR linear regression (Redberg, Zhu & Wang 2023, Alg 14 / Example 3.6.2) with exact noise.

One-Posterior-Sample: θ ~ N(θ*_λ, (γ(XᵀX + λI))⁻¹), θ*_λ = (XᵀX + λI)⁻¹Xᵀy, whose data-dependent (ε, δ)-DP
depends on λ_min(XᵀX) and on Δ = log(R_y + R‖θ*_λ‖). Gen-PTR releases a private lower bound λ^P and a
private upper bound Δ^P with one-sided margins, computes the bound ε̄(γ) from them, picks the largest γ with
ε̄(γ) ≤ ε (post-processing), and samples; ⊥ if no γ > 0 qualifies. docs/mechanisms/ptr.md has the proofs
(Lemma OPS-DD, LOGNORM, the discretisation) and docs/privacy/approximate.md#approximate-dp the filter path.

Data: the design matrix of ``mechanisms.learners.features`` (rows scaled to ‖x‖ ≤ R from declared bounds only,
labels |y| ≤ 1), then each entry truncated toward zero onto the public grid 2^−20·R (per-row maps, so
neighbours still differ in one row). Everything data-dependent is computed in exact integers and rationals:
XᵀX, Xᵀy, the certified grid floor of λ_min, θ*, and the sample θ̂ = θ* + H⁻¹s(XᵀG₁ + √λ·G₂)/T with
G ~ N_Z(0, T²) exact discrete Gaussians. The released coefficients are γ_o·(round(θ̂/γ_o) + Z_o),
Z_o ~ N_Z(0, t_o²): exact multiples of the published granularity. The true λ_min, ‖θ*‖ and ε_φ(X) are never
returned, stored or logged; λ^P, Δ^P and γ are DP outputs and are returned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat

from mechanisms.accounting.approximate import ApproximateCharge
from mechanisms.base import ParamsError, PublicContext, Release, Table
from mechanisms.learners.features import FeatureSpec, check_features, design_matrix, dimension
from mechanisms.noise import Noise, dyadic_scale_up
from mechanisms.noise.learners import discrete_gaussian_std
from mechanisms.ptr.generalized import (
    GenPtrBudget,
    laplace_scale_units,
    lower_bound_release,
    upper_bound_release,
)
from mechanisms.ptr.protocol import ApproximateBase

MAX_DIMENSION = 32
INPUT_BITS = 20  # data grid: 2^-20·R per entry
COUPLING_BITS = 34  # T = 2^34·(⌈√n⌉ + ⌈√d⌉): κ ≤ 3s/(2^34·√λ)
OUTPUT_BITS = 28  # γ_o ≤ s·2^-28/√λ
OUTPUT_NOISE_BITS = 12  # t_o = 2^12·⌈√d⌉
_U = 2.0**-52
_PAD = 1.0 + 1e-12
Neighbouring = Literal["replace_one", "add_remove"]


def nudge_up(x: float) -> float:
    """x·(1 + 10⁻¹²), one ulp up (x > 0; others as is): a bound padded above float error."""
    return math.nextafter(x * _PAD, math.inf) if x > 0 else x


def nudge_down(x: float) -> float:
    """x/(1 + 10⁻¹²), one ulp down (x > 0; others as is)."""
    return math.nextafter(x / _PAD, -math.inf) if x > 0 else x


class OpsLinearParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    features: FeatureSpec
    lam: StrictFloat = Field(gt=0, le=1e9, allow_inf_nan=False, description="proposed ridge regularisation λ")
    epsilon: StrictFloat = Field(gt=0, le=20, allow_inf_nan=False, description="total ε of the call")
    delta: StrictFloat = Field(gt=0, lt=0.01, allow_inf_nan=False, description="total δ of the call")
    test_fraction: StrictFloat = Field(default=0.5, gt=0, lt=1, description="share of ε spent on the test")
    row_norm: StrictFloat = Field(default=1.0, gt=0, le=1e6, allow_inf_nan=False, description="R: ‖x‖ ≤ R")


# ----- the budget split and the data-dependent bound (public) -----------------------------------------------


@dataclass(frozen=True)
class OpsPlan:
    """Everything public about one call: splits, grids, the output-step cost."""

    lam: float
    root_lam: Fraction  # dyadic r with r² = λ_eff ≥ λ
    row_norm: float
    label_norm: float
    dim: int
    neighbouring: Neighbouring
    eps_lambda: float
    eps_log: float
    eps_post: float
    eps_out: float
    delta_lambda: float  # δ′₁: λ^P above λ_min
    delta_log: float  # δ′₂: Δ^P below Δ
    delta_post: float
    delta_out: float
    budget: GenPtrBudget

    @property
    def lam_eff(self) -> float:
        return float(self.root_lam * self.root_lam)

    @property
    def input_grid(self) -> float:
        return math.ldexp(1.0, math.frexp(self.row_norm)[1] - 1 - INPUT_BITS)

    @property
    def label_grid(self) -> float:
        return math.ldexp(1.0, -INPUT_BITS)

    @property
    def lambda_grid(self) -> float:
        return math.ldexp(1.0, math.frexp(self.row_norm**2)[1] - 1 - 10)


def output_step_cost(dim: int, delta_out: float) -> float:
    """ε of the output discretisation step: centres within ρ = 3·2^−5 + √d/2 of θ/γ_o, discrete Gaussian of
    std t_o = 2^12⌈√d⌉: D_α ≤ αc/2 with c = (2ρ/t_o)², and min_α αc/2 + log(1/δ)/(α−1) = c/2 + √(2c·log(1/δ))
    (Mironov 2017 Prop. 3)."""
    rho = 3.0 * 2.0**-5 + math.sqrt(dim) / 2.0
    t_o = output_noise_std(dim)
    c = nudge_up((2.0 * rho / t_o) ** 2)
    return nudge_up(c / 2.0 + math.sqrt(2.0 * c * math.log(1.0 / delta_out)))


def output_noise_std(dim: int) -> int:
    """t_o = 2^12·⌈√d⌉: the output step's discrete-Gaussian std (ε_out is its cost)."""
    return (1 << OUTPUT_NOISE_BITS) * (math.isqrt(dim - 1) + 1)  # 2^12·⌈√d⌉


def plan(params: OpsLinearParams, dim: int, neighbouring: Neighbouring) -> OpsPlan:
    eps_test = params.epsilon * params.test_fraction
    eps_ops = params.epsilon - eps_test
    delta = params.delta
    delta_ops = delta / 2.0
    delta_out = delta_ops / 1024.0
    eps_out = output_step_cost(dim, delta_out)
    eps_post = nudge_down(eps_ops - eps_out)
    if eps_post <= 0.0:
        raise ParamsError("epsilon", "too small for the output discretisation step")
    root = dyadic_scale_up(math.sqrt(params.lam))
    while root * root < Fraction(params.lam):
        root += Fraction(1, root.denominator)
    budget = GenPtrBudget(
        test_epsilon=eps_test,
        test_delta=delta / 8.0,  # the Δ release's own PTR step fails w.p. ≤ δ′₁
        false_positive=delta / 8.0 + delta / 4.0,  # δ′₁ + δ′₂
        mechanism_epsilon=eps_ops,
        mechanism_delta=delta_ops,
    )
    return OpsPlan(
        lam=params.lam,
        root_lam=root,
        row_norm=params.row_norm,
        label_norm=1.0,
        dim=dim,
        neighbouring=neighbouring,
        eps_lambda=eps_test / 2.0,
        eps_log=eps_test / 2.0,
        eps_post=eps_post,
        eps_out=eps_out,
        delta_lambda=delta / 8.0,
        delta_log=delta / 4.0,
        delta_post=nudge_down(delta_ops - delta_out),
        delta_out=delta_out,
        budget=budget,
    )


@dataclass(frozen=True)
class OpsBound:
    """ε̄(γ) = Bγ + A√γ + C₀ per add/remove step (Lemma OPS-DD with v ≤ R²/λ̃, |r| ≤ L̃), its target."""

    a: float
    b: float
    c0: float
    target: float

    def value(self, gamma: float) -> float:
        """ε̄(γ), each term padded up (an upper bound on the exact expression)."""
        return nudge_up(nudge_up(self.b * gamma) + nudge_up(self.a * math.sqrt(gamma)) + self.c0)

    def gamma_star(self) -> float | None:
        """The γ* > 0 with Bγ* + A√γ* + C₀ = target (closed form in u = √γ), or None (⊥) if C₀ ≥ target."""
        room = self.target - self.c0
        if room <= 0.0:
            return None
        u = 2.0 * room / (self.a + math.sqrt(self.a * self.a + 4.0 * self.b * room))
        return u * u


def ops_bound(p: OpsPlan, lambda_lower: float, log_upper: float) -> OpsBound:
    """The private upper bound of the data-dependent loss from the released λ^P, Δ^P (public)."""
    r2 = p.row_norm**2
    lam_tilde = nudge_down(p.lam_eff + max(lambda_lower - r2, 0.0))
    v = nudge_up(r2 / lam_tilde)
    lipschitz = nudge_up(math.exp(log_upper) * nudge_up(1.0 + v))
    if p.neighbouring == "add_remove":
        target, delta0 = p.eps_post, p.delta_post
    else:  # two add/remove steps through X minus the row: (2e, (1 + e^e)δ₀)
        target = p.eps_post / 2.0
        delta0 = p.delta_post / (1.0 + math.exp(target)) / _PAD
    z2 = nudge_up(2.0 * math.log(1.0 / delta0))
    a = nudge_up(lipschitz * math.sqrt(z2) * math.sqrt(v))
    b = nudge_up(lipschitz * lipschitz * v / (2.0 * (1.0 + v)))
    c0 = nudge_up(v * (1.0 + z2) / 2.0)
    return OpsBound(a=a, b=b, c0=c0, target=target)


# ----- exact linear algebra -----------------------------------------------------------------------------


def _ldl_positive(matrix: list[list[Fraction]]) -> bool:
    """Whether a symmetric rational matrix is positive definite (exact elimination, all pivots > 0)."""
    m = [row[:] for row in matrix]
    n = len(m)
    for k in range(n):
        pivot = m[k][k]
        if pivot <= 0:
            return False
        for i in range(k + 1, n):
            factor = m[i][k] / pivot
            if factor:
                for j in range(k + 1, n):
                    m[i][j] -= factor * m[k][j]
    return True


def solve_exact(matrix: list[list[Fraction]], rhs: list[Fraction]) -> list[Fraction]:
    """Exact solution of a positive definite rational system (Gaussian elimination, no pivoting needed)."""
    n = len(matrix)
    m = [[*row[:], rhs[i]] for i, row in enumerate(matrix)]
    for k in range(n):
        for i in range(k + 1, n):
            factor = m[i][k] / m[k][k]
            if factor:
                for j in range(k, n + 1):
                    m[i][j] -= factor * m[k][j]
    x = [Fraction(0)] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum((m[i][j] * x[j] for j in range(i + 1, n)), Fraction(0))) / m[i][i]
    return x


def lambda_min_floor_units(gram: list[list[Fraction]], step: Fraction, estimate: float) -> int:
    """m* = max{m ∈ Z: G − m·step·I ≻ 0} = ⌈λ_min/step⌉ − 1, certified by exact elimination (the float
    ``estimate`` only seeds the search). m*·step < λ_min, and m* moves by ≤ ⌈R²/step⌉ between neighbours."""
    d = len(gram)

    def positive(m: int) -> bool:
        shifted = [[gram[i][j] - (m * step if i == j else 0) for j in range(d)] for i in range(d)]
        return _ldl_positive(shifted)

    m = math.ceil(estimate / float(step)) - 1 if math.isfinite(estimate) else 0
    jump = 1
    while not positive(m):
        m -= jump
        jump *= 2
    jump = 1
    while positive(m + jump):
        m += jump
        jump *= 2
    low, high = m, m + jump  # positive(low), not positive(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if positive(mid) else (low, mid)
    return low


def _ceil_units(value: Fraction) -> int:
    return math.ceil(value)


# ----- the mechanism ------------------------------------------------------------------------------------


class OpsLinear(ApproximateBase[OpsLinearParams]):
    """``ptr.ops_linear``: private ridge regression by one posterior sample, γ tuned by Gen-PTR."""

    name: ClassVar[str] = "ptr.ops_linear"
    summary: ClassVar[str] = (
        "Linear regression by one posterior sample with generalized propose-test-release "
        "(approximate DP: charged (ε, δ) on the δ-ledger)"
    )
    params_model: ClassVar[type[BaseModel]] = OpsLinearParams

    def check(self, p: OpsLinearParams, ctx: PublicContext) -> None:
        check_features(p.features, ctx, "regression", "features")
        d = dimension(p.features, ctx)
        if d > MAX_DIMENSION:
            raise ParamsError("features", f"dimension {d} exceeds {MAX_DIMENSION} (exact arithmetic)")
        plan(p, d, ctx.schema.neighboring)

    def approximate_charge(self, p: OpsLinearParams, ctx: PublicContext) -> ApproximateCharge:
        budget = plan(p, dimension(p.features, ctx), ctx.schema.neighboring).budget
        return ApproximateCharge.from_epsilon_delta(budget.epsilon, budget.delta, ctx.orders)

    def run(self, p: OpsLinearParams, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        x, y = design_matrix(p.features, ctx, table, "regression", row_norm=p.row_norm)
        pl = plan(p, x.shape[1], ctx.schema.neighboring)
        output = ops_release(pl, x, y, noise)
        return self.release(p, ctx, output)


def quantise(x: np.ndarray, grid: float) -> np.ndarray:
    """Entries truncated toward zero onto the grid (as integers): |entries| and row norms only shrink."""
    scaled = np.ldexp(np.asarray(x, dtype=np.float64), -math.frexp(grid)[1] + 1)
    return np.trunc(scaled).astype(np.int64)


def ops_release(
    pl: OpsPlan, x: np.ndarray, y: np.ndarray, noise: Noise, *, drop_margins: bool = False
) -> dict[str, Any]:
    """Alg 14 on clipped rows. ``drop_margins`` (tests only: the broken variant the audit must catch) releases
    the test statistics without their one-sided margins."""
    n, d = x.shape
    gx, gy = Fraction(pl.input_grid), Fraction(pl.label_grid)
    xi = quantise(x, pl.input_grid)
    yi = quantise(y, pl.label_grid)
    small = n < (1 << 21)
    xo = xi if small else xi.astype(object)
    gram_int = xo.T @ xo
    xty_int = xo.T @ (yi if small else yi.astype(object))
    gram = [[Fraction(int(gram_int[i, j])) * gx * gx for j in range(d)] for i in range(d)]
    xty = [Fraction(int(xty_int[i])) * gx * gy for i in range(d)]
    lam_eff = pl.root_lam * pl.root_lam
    r2 = Fraction(pl.row_norm) ** 2

    # 1. λ^P: certified floor of λ_min on the grid, DLap, minus the margin (pure ε_λ).
    step = Fraction(pl.lambda_grid)
    estimate = float(np.linalg.eigvalsh(np.asarray(gram_int, dtype=np.float64))[0]) * float(gx * gx)
    units = lambda_min_floor_units(gram, step, estimate)
    shift = math.ceil(r2 / step)
    scale1 = laplace_scale_units(shift, pl.eps_lambda)
    if drop_margins:
        lam_units = units + int(noise.discrete_laplace(scale1, 1)[0])
    else:
        lam_units = lower_bound_release(noise, units, scale1, pl.delta_lambda)
    lambda_lower = float(lam_units * step)

    # 2. Δ^P: Δ = log(R_y + R‖θ*‖) on a grid, sensitivity from λ^P (Lemma LOGNORM), DLap, plus the margin.
    hess = [[gram[i][j] + (lam_eff if i == j else 0) for j in range(d)] for i in range(d)]
    theta_star = solve_exact(hess, xty)
    norm = math.sqrt(math.fsum(float(t) ** 2 for t in theta_star))
    log_value = math.log(pl.label_norm + pl.row_norm * norm)
    lam_tilde = nudge_down(pl.lam_eff + max(lambda_lower - pl.row_norm**2, 0.0))
    sens = nudge_up(math.log1p(nudge_up(pl.row_norm**2 / lam_tilde)))
    if pl.neighbouring == "replace_one":
        sens = nudge_up(2.0 * sens)
    log_bound = math.log(pl.label_norm + pl.row_norm * pl.row_norm * pl.label_norm * 2.0**40 / pl.lam)
    err = (d + 8) * _U * (1.0 + max(abs(math.log(pl.label_norm)), abs(log_bound)))
    grid2 = Fraction(math.ldexp(1.0, math.frexp(sens)[1] - 1 - 10))
    units2 = _ceil_units((Fraction(log_value) + Fraction(err)) / grid2)
    shift2 = _ceil_units((Fraction(sens) + 2 * Fraction(err)) / grid2)
    scale2 = laplace_scale_units(shift2, pl.eps_log)
    if drop_margins:
        log_units = units2 + int(noise.discrete_laplace(scale2, 1)[0])
    else:
        log_units = upper_bound_release(noise, units2, scale2, pl.delta_log)
    log_upper = float(log_units * grid2)

    # 3. γ from the released bounds (post-processing), then ⊥ or the posterior sample.
    bound = ops_bound(pl, lambda_lower, log_upper)
    out: dict[str, Any] = {
        "lambda": pl.lam_eff,
        "lambda_min_lower": lambda_lower,
        "log_lipschitz_upper": log_upper,
        "released": False,
        "coefficients": None,
        "gamma": None,
    }
    gamma = bound.gamma_star()
    if gamma is None:
        return out
    s = dyadic_scale_up(nudge_up(1.0 / math.sqrt(gamma)))
    while bound.value(float(1 / (s * s))) > bound.target:
        s = s * Fraction(1025, 1024)
    coefficients, granularity = _posterior_sample(pl, xi, gram, xty, hess, s, noise)
    out.update(
        released=True,
        coefficients=coefficients,
        gamma=float(1 / (s * s)),
        granularity=granularity,
    )
    return out


def _posterior_sample(
    pl: OpsPlan,
    xi: np.ndarray,
    gram: list[list[Fraction]],
    xty: list[Fraction],
    hess: list[list[Fraction]],
    s: Fraction,
    noise: Noise,
) -> tuple[list[float], float]:
    """θ̂ = H⁻¹(Xᵀy + s(XᵀG₁ + √λ·G₂)/T) exactly, released as γ_o(round(θ̂/γ_o) + Z_o)."""
    n, d = xi.shape
    gx = Fraction(pl.input_grid)
    big_t = (1 << COUPLING_BITS) * (math.isqrt(max(n - 1, 0)) + 1 + math.isqrt(d - 1) + 1)
    if big_t > 1 << 52:
        raise ValueError("too many rows for the exact sampler (n > 2^34)")
    g1 = discrete_gaussian_std(noise, big_t, n).astype(object)
    g2 = discrete_gaussian_std(noise, big_t, d)
    xtg = xi.astype(object).T @ g1
    rhs = [xty[i] + s * (Fraction(int(xtg[i])) * gx + pl.root_lam * int(g2[i])) / big_t for i in range(d)]
    theta = solve_exact(hess, rhs)
    grid_o = math.ldexp(1.0, math.frexp(float(s / pl.root_lam))[1] - 1 - OUTPUT_BITS)
    limit = 1 << 50
    units = [max(-limit, min(limit, math.floor(t / Fraction(grid_o) + Fraction(1, 2)))) for t in theta]
    z = discrete_gaussian_std(noise, output_noise_std(d), d)
    released = [
        math.ldexp(float(u + int(zi)), math.frexp(grid_o)[1] - 1) for u, zi in zip(units, z, strict=True)
    ]
    return released, grid_o


OPS_LINEAR = OpsLinear()
