"""Private full-batch gradient descent with the Relative Gaussian Mechanism on every step (RGM-GD).

Source: Hendrikx, Mangold, Bellet (AISTATS 2024), eq. (7); the RGM and its curves are
``mechanisms.learners.relative_gaussian``. The soundness argument is written out in docs/privacy.md §8.3.

Algorithm (replace-one neighbours, n public; K = {‖θ‖ ≤ r} a public ball)::

    θ₀ = Π_K(public start, 0 in the service);  for t = 0 … T−1:
        g̃_t = ∇f(θ_t; D) + N(0, (γ‖∇f(θ_t; D)‖² + σ²)·I_d)      (RGM_{γ,σ}, per-coordinate VARIANCE)
        θ_{t+1} = Π_K(θ_t − τ·g̃_t)                               (projection: post-processing of g̃_t)
        stop after step t if the stopping rule, evaluated on the released θ₀ … θ_{t+1} only, says so

f(θ; D) = (1/n)Σ ℓ(x_iᵀθ, y_i) + (λ/2)‖θ‖² on the design matrix of ``mechanisms.learners.features`` (rows
‖x_i‖ ≤ X, labels |y_i| ≤ Y = 1), with ℓ the squared loss ½(x_iᵀθ − y_i)² ("ridge") or the logistic loss
log(1 + e^{−y_i x_iᵀθ}) with y_i = ±1 ("logistic").

Projection and finite arithmetic (docs/privacy.md §8.3.2.1). The radius r = ``theta_bound``
is a public bound on ‖θ*‖ for every dataset (ridge: ``ridge_theta_bound``; logistic: X·Y/λ), so θ* ∈ K and
projected GD keeps Theorem 2's contraction (Π_K is non-expansive). Without it, floats overflowed at a
data-dependent step (γ‖∇f(θ_t; D)‖² = ∞ for D but not for D′ at the same public θ_t): a failure bit that
reads the secret gradient. With ‖θ_t‖ ≤ r, ‖x_i‖ ≤ X, |y_i| ≤ Y every float quantity of a step has a public
bound (``finiteness_problem``): ‖∇f‖ ≤ G = (X² + λ)r + XY (ridge) or XY + λr (logistic), variance
≤ γG² + σ², update ≤ r + τ(G + Z_MAX·√(γG² + σ²)); requests where one of them is not far below the float
range are refused at admission, so no step can overflow for any dataset. Privacy does not use the
projection at all: both relative sensitivities hold for every θ.

Relative sensitivity, uniformly in θ (so it holds at every public iterate θ_t), from public parameters:

* ridge: ``ridge_relative_sensitivity_split`` with κ = 3 (the paper's eq. (10) with the corrected scaling, C =
  I in Prop. 1, curvature A ⪰ λI from the public λ, no data-dependent test and no PTR; tightened in
  docs/privacy.md §8.3.4): η = 2X²/(λn), R_rel = (2/√3)·D/n with D = ``ridge_gradient_gap_bound`` the
  diameter of the per-record gradient set over the ball ‖θ‖ ≤ B = Y/(2√λ) ≥ ‖θ*‖ (for X ≥ √λ), at most
  the triangle inequality's 2X(XB + Y). The paper-faithful ``ridge_relative_sensitivity``
  (η = √6X²/(λn), R_rel = √12·X(XB′ + Y)/n, B′ = Y·min(X/λ, 1/√λ)) is looser in both.
* logistic: ``logistic_relative_sensitivity`` (App. B.2 of the paper, instantiated for the logistic
  GLM in Lemma LOG, docs/privacy.md §8.3.3): each per-record loss is convex
  and L = X²/4 smooth, f is λ-strongly convex, so η = √(6·L·(L/λ)/λ)/n = √(3/8)·X²/(λn) and
  R_rel = √12·X/n (‖∇ℓ_i‖ ≤ X). Checked on adversarial neighbours in tests/unit/test_rgm_gd.py.

Charge (docs/privacy.md §8.3.2). Each step is an RGM release of a query with (η, R_rel)-relative
sensitivity, so it is (α, ε_step(α))-RDP conditionally on the past (Theorem 1, or the exact curve of Lemma
EXACT, docs/privacy.md §8.3.1), with ε_step a function of (α, η, γ, d) only (σ² = γR_rel²/η² satisfies the σ²
condition at every α). The stopping time T_run is decided from released iterates only, so Π_{s≤t}
(p_s/q_s)^{α−1}e^{−(α−1)ε_step} is a non-negative supermartingale on the released filtration and optional
stopping at T_run ≤ T gives the ex-post RDP inequality with the realized charge T_run·ε_step(α). The worst
case is T·ε_step(α). Orders ≥ α_max(η) are +∞. The charge never depends on a true gradient norm or the secret
noise variance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

import numpy as np
from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, model_validator

from mechanisms.accounting.conversion import epsilon_at_delta
from mechanisms.accounting.curve import RdpCurve, pad_up
from mechanisms.accounting.orders import validate_orders
from mechanisms.base import ParamsChecked, ParamsError, ProgressFn, PublicContext, Release, Table, no_progress
from mechanisms.learners.dp_gd import safe_row_norms
from mechanisms.learners.features import (
    FeatureSpec,
    check_features,
    column_names,
    design_matrix,
    dimension,
    learner_task,
)
from mechanisms.learners.relative_gaussian import (
    Bound,
    RelativeSensitivity,
    grid_rgm_epsilon,
    project_to_ball,
    rgm_grid,
    rgm_grid_curve,
    rgm_release_grid,
    ridge_relative_sensitivity_split,
    ridge_theta_bound,
)
from mechanisms.noise import Noise

Model = Literal["ridge", "logistic"]
#: Y: the design matrix's labels are scaled to [−1, 1] or mapped to ±1 (mechanisms.learners.features)
LABEL_BOUND = 1.0

_UP = 1.0 + 1e-12
RIDGE_SPLIT = 3.0  # Young's κ of ``ridge_relative_sensitivity_split``: η = 2X²/(λn), R_rel = (2/√3)·D/n
FLOAT_CEILING = 1e300  # public bounds must stay below this: 1e8 of headroom under the float maximum 1.8e308
Z_MAX = 1030.0  # |Z|·γ_g ≤ 513·t·γ_g ≤ 1030·√v: the exact sampler never returns |Z| > 513·t (t ≤ √v/γ_g + 1)
MAX_UNITS = 2.0**50  # public bound on G/γ_g and (√γ·G + σ)/γ_g: means and noise scales stay in the int64 path


# ----- the query and its relative sensitivity --------------------------------------------------------------
def full_gradient(theta: np.ndarray, x: np.ndarray, y: np.ndarray, model: Model, reg: float) -> np.ndarray:
    """∇f(θ; D) = (1/n)Σ ∇ℓ_i(θ) + λθ (full batch), in O(nd)."""
    margin = x @ theta
    if model == "ridge":
        scalars = margin - y
    elif model == "logistic":
        scalars = -y * np.exp(-np.logaddexp(0.0, y * margin))  # −y·sigmoid(−y m), stable
    else:
        raise ValueError(f"model must be 'ridge' or 'logistic', got {model!r}")
    gradient: np.ndarray = x.T @ scalars / x.shape[0] + reg * theta
    return gradient


def model_objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, model: Model, reg: float) -> float:
    """f(θ; D) (non-private; for evaluation)."""
    margin = x @ theta
    if model == "ridge":
        risk = float(np.mean(0.5 * (margin - y) ** 2))
    else:
        risk = float(np.mean(np.logaddexp(0.0, -y * margin)))
    return risk + 0.5 * reg * float(theta @ theta)


def logistic_relative_sensitivity(n_rows: int, reg: float, feature_bound: float) -> RelativeSensitivity:
    """(η, R_rel) of the full-batch ridge-regularised logistic gradient, uniformly in θ (replace-one).

    Paper App. B.2 (general convex losses), instantiated and proved in
    docs/privacy.md §8.3.3: with ℓ_i convex and L-smooth (L = X²/4), f λ-strongly convex and
    D_{ℓ} ≤ (L/λ)·D_f (relative smoothness, L_rel = L/λ), θ* = argmin f(·; D),

        n(∇f − ∇f′)(θ) = [∇ℓ₀(θ) − ∇ℓ₀(θ*)] − [∇ℓ₀′(θ) − ∇ℓ₀′(θ*)] + [∇ℓ₀(θ*) − ∇ℓ₀′(θ*)],
        ‖∇ℓ(θ) − ∇ℓ(θ*)‖² ≤ 2L·D_ℓ(θ, θ*) ≤ 2L·L_rel·D_f(θ, θ*) ≤ (L·L_rel/λ)·‖∇f(θ)‖²,

    and (a+b+c)² ≤ 3(a²+b²+c²) give η² = 6L·L_rel/(λn²) = 3X⁴/(8λ²n²), R_rel² = 3(2X)²/n² = 12X²/n².
    """
    if isinstance(n_rows, bool) or int(n_rows) != n_rows or n_rows < 1:
        raise ValueError(f"n_rows must be an integer ≥ 1, got {n_rows!r}")
    if not (math.isfinite(reg) and reg > 0.0):
        raise ValueError("reg must be > 0: the ridge term is the public strong-convexity constant")
    if not (math.isfinite(feature_bound) and feature_bound >= 0.0):
        raise ValueError(f"feature_bound must be finite and ≥ 0, got {feature_bound!r}")
    n = float(n_rows)
    eta = pad_up(math.sqrt(3.0 / 8.0) * feature_bound * feature_bound / (reg * n))
    r_rel = pad_up(math.sqrt(12.0) * feature_bound / n)
    return RelativeSensitivity(eta=eta, r_rel=r_rel)


def relative_sensitivity(
    model: Model, n_rows: int, reg: float, feature_bound: float, label_bound: float = 1.0
) -> RelativeSensitivity:
    """(η, R_rel) of the model's full-batch gradient from public parameters only."""
    if model == "ridge":
        return ridge_relative_sensitivity_split(n_rows, reg, feature_bound, label_bound, RIDGE_SPLIT)
    if model == "logistic":
        return logistic_relative_sensitivity(n_rows, reg, feature_bound)
    raise ValueError(f"model must be 'ridge' or 'logistic', got {model!r}")


def theta_bound(model: Model, reg: float, feature_bound: float, label_bound: float = 1.0) -> float:
    """Public r ≥ ‖θ*(D)‖ for every dataset with ‖x_i‖ ≤ X, |y_i| ≤ Y: the projection radius of rgm.gd.

    * ridge: ``ridge_theta_bound`` (same objective scale: (1/n)Σ½(x_iᵀθ − y_i)² + (λ/2)‖θ‖²);
    * logistic: X·Y/λ, since 0 = ∇f(θ*) = (1/n)Σ∇ℓ_i(θ*) + λθ* and ‖∇ℓ_i‖ = |y_i|σ(−y_ix_iᵀθ)‖x_i‖ ≤ XY.
    Rounded up. +∞ when X·Y/λ overflows (the finiteness check then refuses).
    """
    if model == "ridge":
        return ridge_theta_bound(reg, feature_bound, label_bound)
    if model == "logistic":
        if not (math.isfinite(reg) and reg > 0.0):
            raise ValueError("reg must be > 0")
        return pad_up(feature_bound * label_bound / reg)
    raise ValueError(f"model must be 'ridge' or 'logistic', got {model!r}")


def gradient_bound(
    model: Model, reg: float, feature_bound: float, label_bound: float, radius: float
) -> float:
    """Public G ≥ ‖∇f(θ; D)‖ for ‖θ‖ ≤ r: (X² + λ)r + XY (ridge), XY + λr (logistic); not rounded."""
    residual = feature_bound * radius + label_bound if model == "ridge" else label_bound
    return feature_bound * residual + reg * radius


# ----- how RGM-GD compares with clipped DP-GD (docs/privacy.md §8.3.8, Proposition NOGAIN) ---------------
def never_clipping_threshold(
    model: Model, reg: float, feature_bound: float, label_bound: float = 1.0
) -> float:
    """A public C ≥ ‖∇ℓ(θ; x, y)‖ for every record (‖x‖ ≤ X, |y| ≤ Y) and every θ in the ball of radius
    ``theta_bound``: X(XB + Y) for ridge (‖x(xᵀθ − y)‖ ≤ X(X‖θ‖ + Y)), X·Y for logistic
    (|y|σ(−y xᵀθ)‖x‖ ≤ XY, every θ). Clipped DP-GD with this threshold on that ball never clips. For logistic
    its replace-one sensitivity 2C/n is below ``relative_sensitivity(...).r_rel``, so it dominates
    logistic RGM-GD (Proposition NOGAIN (c)); for ridge that holds only when R_rel ≥ 2C/n.
    """
    if model == "ridge":
        return pad_up(
            feature_bound
            * (feature_bound * theta_bound(model, reg, feature_bound, label_bound) + label_bound)
        )
    if model == "logistic":
        return pad_up(feature_bound * label_bound)
    raise ValueError(f"model must be 'ridge' or 'logistic', got {model!r}")


def ridge_r_rel_floor(
    n_rows: int, reg: float, feature_bound: float, label_bound: float = 1.0, grid: int = 2001
) -> float:
    """A lower bound on R_rel of **every** pair (η, R_rel) satisfying Def. 2 for the full-batch ridge gradient
    over datasets of n ≥ 2 rows with ‖x_i‖ ≤ X, |y_i| ≤ Y, d ≥ 2 (Proposition NOGAIN (a)).

    Witnesses: D has n − 1 records (s·e₁, Y), s = min(√λ, X) (they pull ‖θ*‖ towards its supremum B), and
    record 0 = (x₀, y₀); D′ replaces it by (x₀′, y₀′). Since ∇f(θ*; D) = 0, Def. 2 at θ* = θ*(D) reads
    ‖∇f(θ*; D) − ∇f(θ*; D′)‖ = ‖x₀r₀ − x₀′r₀′‖/n ≤ R_rel, r = xᵀθ* − y. Two families, solved exactly
    (2×2 ridge): x₀ = (a, b), x₀′ = (a, −b), y₀ = y₀′ = −Y, b = √(X² − a²), a on a grid of [0, X]; and
    x₀ = X·e₁, y₀ = −Y, x₀′ = X·e₂, y₀′ = Y. Each is a valid witness, so their maximum is a lower bound
    (4.378/n at λ = 0.03, X = Y = 1, against the 2X(XB + Y)/n = 7.77/n of the triangle inequality).
    """
    if isinstance(n_rows, bool) or int(n_rows) != n_rows or n_rows < 2:
        raise ValueError(f"n_rows must be an integer ≥ 2, got {n_rows!r}")
    n, x_max, y_max = float(n_rows), float(feature_bound), float(label_bound)
    s = min(math.sqrt(reg), x_max)
    a = np.concatenate([np.linspace(0.0, x_max, grid), [x_max]])
    b = np.sqrt(np.maximum(x_max * x_max - a * a, 0.0))
    b[-1] = 0.0  # the last witness: x₀ = X·e₁ (its partner X·e₂ is handled below)
    y0 = -y_max
    # θ*(D) of the 2-D ridge problem, one per witness: A θ = c
    a11 = ((n - 1.0) * s * s + a * a) / n + reg
    a12 = a * b / n
    a22 = b * b / n + reg
    c1 = ((n - 1.0) * s * y_max + a * y0) / n
    c2 = b * y0 / n
    det = a11 * a22 - a12 * a12
    theta1 = (a22 * c1 - a12 * c2) / det
    theta2 = (a11 * c2 - a12 * c1) / det
    r0 = a * theta1 + b * theta2 - y0
    # symmetric pair: x₀r₀ − x₀′r₀′ = (a(r₀ − r₀′), b(r₀ + r₀′)) with r₀ ∓ r₀′ = 2bθ₂, 2(aθ₁ − y₀)
    along = a[:-1] * 2.0 * b[:-1] * theta2[:-1]
    across = b[:-1] * 2.0 * (a[:-1] * theta1[:-1] - y0)
    symmetric = np.hypot(along, across)
    orthogonal = x_max * math.hypot(float(r0[-1]), y_max)  # x₀′ = X·e₂ ⟂ θ*: r₀′ = −Y
    value = max(float(np.max(symmetric)), orthogonal) / n
    return value * (1.0 - 1e-9)


def smoothness(model: Model, reg: float, feature_bound: float) -> float:
    """A public upper bound L on the smoothness of f: X² + λ (ridge), X²/4 + λ (logistic)."""
    curvature = feature_bound**2 if model == "ridge" else feature_bound**2 / 4.0
    return curvature + reg


def auto_step_size(model: Model, reg: float, feature_bound: float, gamma: float, d: int) -> float:
    """τ = 1/((1 + dγ)L): corrected Theorem 2 step condition (with the factor d of the
    per-coordinate variance; ``mechanisms.learners.relative_gaussian`` item 6), from public parameters."""
    return 1.0 / ((1.0 + d * gamma) * smoothness(model, reg, feature_bound))


def baseline_sigma(gamma: float, sens: RelativeSensitivity) -> float:
    """σ with σ² ≥ γR_rel²/η² (rounded up): Theorem 1's σ² condition then holds at every order."""
    return math.sqrt(gamma) * sens.r_rel / sens.eta * _UP * _UP


# ----- the per-step and total curves ------------------------------------------------------------------------
def step_curve(
    orders: Sequence[float], sens: RelativeSensitivity, gamma: float, sigma: float, d: int, bound: Bound
) -> RdpCurve:
    """RDP curve of one RGM-GD step on the public grid (``rgm_grid_curve``, Theorem RGM-GRID of
    docs/privacy.md §10.5): depends on public parameters only; needs σ ≥ √γ·R_rel/η (``baseline_sigma``)."""
    return rgm_grid_curve(orders, eta=sens.eta, gamma=gamma, sigma=sigma, r_rel=sens.r_rel, d=d, bound=bound)


def scale_curve(curve: RdpCurve, steps: int) -> RdpCurve:
    """``steps`` adaptive compositions of ``curve`` (Mironov 2017, Prop. 1): values × steps, padded up."""
    if isinstance(steps, bool) or int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be an integer ≥ 0, got {steps!r}")
    if steps == 0:
        return RdpCurve.zero(curve.orders)
    if steps == 1:
        return curve
    values = tuple(v if math.isinf(v) else pad_up(steps * v) for v in curve.values)
    pure = curve.pure if math.isinf(curve.pure) else pad_up(steps * curve.pure)
    return RdpCurve(curve.orders, values, pure)


# ----- calibration ------------------------------------------------------------------------------------------
def smallest_gamma(value: Callable[[float], float], epsilon: float, unreachable: str) -> float:
    """The smallest γ in [1e-30, 1e12] with ``value(γ) ≤ epsilon`` for a ``value`` decreasing in γ:
    bisection in log γ to 1e-9, returning the admissible end of the bracket. ValueError(``unreachable``)
    when even γ = 1e12 is not admissible (a NaN value counts as not admissible)."""
    hi = 1e12
    if not value(hi) <= epsilon:
        raise ValueError(unreachable)
    lo = 1e-30
    if value(lo) <= epsilon:
        return lo
    log_lo, log_hi = math.log(lo), math.log(hi)
    while log_hi - log_lo > 1e-9:
        mid = 0.5 * (log_lo + log_hi)
        if value(math.exp(mid)) <= epsilon:
            log_hi = mid
        else:
            log_lo = mid
    gamma = math.exp(log_hi)
    assert value(gamma) <= epsilon
    return gamma


def gamma_for_step(epsilon: float, alpha: float, eta: float, d: int, bound: Bound = "theorem1") -> float:
    """The smallest γ (up to 1e-9 relative, bisection in log γ) with the grid per-step bound
    ``grid_rgm_epsilon(α; η, γ, d) ≤ epsilon`` (σ² = γR_rel²/η²).

    The bound is (αη²/(2ρ_q))·(1/√γ + c)² + floor(α) with c, floor independent of γ (docs/privacy.md §10.5),
    decreasing in γ. Raises ValueError when ε ≤ its limit γ → ∞ or α is at or beyond the ceiling.
    """
    if not (math.isfinite(epsilon) and epsilon > 0.0):
        raise ValueError(f"epsilon must be finite and > 0, got {epsilon!r}")

    def value(gamma: float) -> float:
        return grid_rgm_epsilon(alpha, eta, gamma, d, bound)

    return smallest_gamma(
        value,
        epsilon,
        f"epsilon {epsilon!r} at order {alpha!r} is below the RGM floor (the norm-leak term "
        "αdη²K/(2ρ_α) of Theorem 1) or the order is at or beyond α_max: no γ up to 1e12 reaches it",
    )


def gamma_for_total(
    epsilon: float,
    delta: float,
    steps: int,
    sens: RelativeSensitivity,
    d: int,
    orders: Sequence[float],
    bound: Bound = "theorem1",
) -> float:
    """The smallest γ (bisection, 1e-9 relative) whose T-step curve converts to ≤ ε at δ on the grid.

    Conversion: ``epsilon_at_delta`` (Mironov 2017, Prop. 3, minimised over the grid). ε_step is
    decreasing in γ, so the converted ε is too. Raises ValueError if even γ → ∞ cannot reach ε.
    """
    grid = validate_orders(orders)

    def converted(gamma: float) -> float:
        one = step_curve(grid, sens, gamma, baseline_sigma(gamma, sens), d, bound)
        return epsilon_at_delta(scale_curve(one, steps), delta)

    return smallest_gamma(
        converted,
        epsilon,
        f"(epsilon, delta) = ({epsilon!r}, {delta!r}) over {steps} steps is unreachable with the RGM on "
        "this grid: the norm-leak floor and the α ceiling bound what any γ can give",
    )


# ----- training ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StopRule:
    """Stop once ‖θ_{t+1} − θ_t‖/τ (the released projected step over τ: the noisy gradient's norm while the
    iterates stay inside the ball) ≤ ``tolerance`` for ``patience`` consecutive steps, not before
    ``min_steps`` steps. Evaluated on released iterates only."""

    tolerance: float
    patience: int = 1
    min_steps: int = 1

    def should_stop(self, released: np.ndarray, step_size: float) -> bool:
        """``released`` holds θ₀ … θ_{t+1} (public). Post-processing only."""
        steps_done = released.shape[0] - 1
        if steps_done < max(self.min_steps, self.patience):
            return False
        recent = np.diff(released[-(self.patience + 1) :], axis=0)
        with np.errstate(over="ignore"):  # public values only; +inf simply does not stop
            norms = np.linalg.norm(recent, axis=1) / step_size
        return bool(np.all(norms <= self.tolerance))


@dataclass(frozen=True)
class RgmGdConfig:
    """Public parameters of one RGM-GD run (γ and σ already resolved).

    ``feature_bound`` X and ``label_bound`` Y are the declared data bounds (``rgm_gd_train`` clips to them);
    ``radius`` is the projection radius r, default ``theta_bound(model, reg, X, Y)``. Any public r > 0 is
    private (the sensitivity holds for every θ); r < sup‖θ*‖ only biases the result.
    """

    model: Model
    reg: float
    steps: int
    step_size: float
    gamma: float
    sigma: float
    stop: StopRule | None = None
    feature_bound: float = 1.0
    label_bound: float = 1.0
    radius: float | None = None

    def __post_init__(self) -> None:
        if self.model not in ("ridge", "logistic"):
            raise ValueError(f"model must be 'ridge' or 'logistic', got {self.model!r}")
        if isinstance(self.steps, bool) or int(self.steps) != self.steps or self.steps < 1:
            raise ValueError(f"steps must be an integer ≥ 1, got {self.steps!r}")
        names = ["reg", "step_size", "gamma", "sigma", "feature_bound", "label_bound"]
        for name in names if self.radius is None else [*names, "radius"]:
            value = float(getattr(self, name))
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")

    @property
    def projection_radius(self) -> float:
        """r: ``radius`` if given, else the public bound on ‖θ*‖ (``theta_bound``)."""
        if self.radius is not None:
            return float(self.radius)
        return theta_bound(self.model, self.reg, self.feature_bound, self.label_bound)


def finiteness_problem(config: RgmGdConfig, n_rows: int, d: int) -> tuple[str, str] | None:
    """``None`` if every float quantity of every step is finite for **every** dataset of n rows with
    ‖x_i‖ ≤ X, |y_i| ≤ Y and iterates in the ball; else (service field to blame, message).

    Public inputs only (config, n, d), so a refusal is the same for neighbouring datasets. Bounds (each
    must be ≤ ``FLOAT_CEILING``, which leaves 1e8 of headroom for rounding): the radius as a vector norm
    (d·(2r)²), the un-normalised gradient sum n·X·s (s = Xr + Y ridge, Y logistic, the per-record scalar),
    G = X·s + λr ≥ ‖∇f‖ (every partial sum of ‖∇f‖² is ≤ G²), the variance v = γG² + σ², and the update
    d·(2(r + τ(G + Z_MAX·√v)))² (coordinates of θ_t − τg̃_t, their squares and differences).
    """
    x_max, y_max, reg, tau = config.feature_bound, config.label_bound, config.reg, config.step_size
    radius = config.projection_radius
    if not (math.isfinite(radius) and d * (2.0 * radius) * (2.0 * radius) <= FLOAT_CEILING):
        return "regularization", (
            f"the iterate ball radius {radius!r} (the public bound on ‖θ*‖) is too large for finite floating "
            "point: raise regularization or lower row_norm"
        )
    scalar = x_max * radius + y_max if config.model == "ridge" else y_max
    big_g = gradient_bound(config.model, reg, x_max, y_max, radius)
    if not (n_rows * x_max * scalar <= FLOAT_CEILING and big_g <= FLOAT_CEILING):
        return "regularization", (
            f"the gradient bound {big_g!r} on the iterate ball could overflow: raise regularization or lower "
            "row_norm"
        )
    variance = config.gamma * big_g * big_g + config.sigma * config.sigma
    if not variance <= FLOAT_CEILING:
        return "gamma", (
            f"the RGM noise variance γG² + σ² (G = {big_g!r} bounds the gradient norm) could overflow: lower "
            "gamma (or raise regularization)"
        )
    coordinate = radius + tau * (big_g + Z_MAX * math.sqrt(variance))
    if not d * (2.0 * coordinate) * (2.0 * coordinate) <= FLOAT_CEILING:
        return "step_size", f"the step θ − τ·g̃ could overflow with step_size {tau!r}: lower step_size"
    granularity = rgm_grid(config.sigma, d).granularity
    scale_units = (math.sqrt(config.gamma) * big_g * (1.0 + 1e-9) + config.sigma) / granularity
    if not (big_g * (1.0 + 1e-9) / granularity <= MAX_UNITS and scale_units <= MAX_UNITS):
        return "gamma", (
            "the gradient or its RGM noise scale would leave the exact sampler's range on the release grid "
            "(2^50 grid units; the grid is σ·2^-24/√d): raise gamma (σ grows with it) or regularization"
        )
    return None


@dataclass(frozen=True)
class RgmGdResult:
    """Released iterates θ₁ … θ_{T_run} (shape (T_run, d)) and whether the stopping rule fired."""

    iterates: np.ndarray
    stopped_early: bool

    @property
    def steps_run(self) -> int:
        return int(self.iterates.shape[0])

    @property
    def theta(self) -> np.ndarray:
        final: np.ndarray = self.iterates[-1]
        return final


def rgm_gd_train(
    config: RgmGdConfig,
    x: np.ndarray,
    y: np.ndarray,
    noise: Noise,
    progress: ProgressFn = no_progress,
    *,
    theta0: np.ndarray | None = None,
) -> RgmGdResult:
    """Run projected RGM-GD from Π_K(θ₀) (θ₀ default 0; any **public** start is allowed: the relative
    sensitivity is uniform in θ), K = {‖θ‖ ≤ ``config.projection_radius``}.

    Rows of ``x`` are clipped to X = ``config.feature_bound`` and labels to [−Y, Y] (identity on the
    service's design matrix; per-record maps, so neighbours stay neighbours). Before reading the data,
    ``finiteness_problem(config, n, d)`` (public) must pass, else ValueError: then no step can overflow,
    whatever the data, and the only data-dependent quantities are the released values.
    The noise variance γ‖∇f(θ_t)‖² + σ² is secret: it is neither returned nor logged (docs/privacy.md §6 rule
    6: Theorem 1 covers the leak through the noisy output only).
    ``progress((t+1)/T)`` is called after every step (and ``progress(1.0)`` when stopping early).
    """
    features = np.asarray(x, dtype=float)
    labels = np.asarray(y, dtype=float)
    if features.ndim != 2 or labels.shape != (features.shape[0],):
        raise ValueError("x must be (n, d) and y must be (n,)")
    n, d = features.shape
    problem = finiteness_problem(config, n, d)
    if problem is not None:
        raise ValueError(f"{problem[0]}: {problem[1]}")
    radius = config.projection_radius
    features, labels = bounded_records(features, labels, config.feature_bound, config.label_bound)
    grid = rgm_grid(config.sigma, d)  # public: every noisy gradient is a multiple of its granularity
    released = np.zeros((config.steps + 1, d))  # θ₀ … θ_T (θ₀ is public)
    if theta0 is not None:
        released[0] = project_to_ball(np.asarray(theta0, dtype=float), radius)
    stopped = False
    t = 0
    for t in range(config.steps):
        gradient = full_gradient(released[t], features, labels, config.model, config.reg)
        noisy = rgm_release_grid(gradient, config.gamma, config.sigma, noise, grid=grid)
        released[t + 1] = project_to_ball(released[t] - config.step_size * noisy, radius)
        progress((t + 1) / config.steps)
        if config.stop is not None and config.stop.should_stop(released[: t + 2], config.step_size):
            stopped = t + 1 < config.steps
            break
    if stopped:
        progress(1.0)
    return RgmGdResult(iterates=released[1 : t + 2].copy(), stopped_early=stopped)


def bounded_records(
    x: np.ndarray, y: np.ndarray, feature_bound: float, label_bound: float
) -> tuple[np.ndarray, np.ndarray]:
    """The per-record map onto ‖x_i‖ ≤ X, |y_i| ≤ Y that the bounds assume: rows with norm > X scaled to
    norm X (norm from ``safe_row_norms``, no overflow), rows with a non-finite entry set to 0, labels
    clipped (NaN to 0). The identity on the service's design matrix (up to an ulp at the boundary)."""
    norms = safe_row_norms(x)
    usable = np.isfinite(norms)
    with np.errstate(all="ignore"):
        scale = np.where(usable & (norms > feature_bound), feature_bound / np.where(usable, norms, 1.0), 1.0)
    rows: np.ndarray = np.where(usable[:, None], x, 0.0) * scale[:, None]
    labels = np.nan_to_num(y, nan=0.0, posinf=label_bound, neginf=-label_bound)
    clipped: np.ndarray = np.clip(labels, -label_bound, label_bound)
    return rows, clipped


# ----- the service mechanism "rgm.gd" ---------------------------------------------------------------------
class RgmGdParams(FeatureSpec):
    """Public parameters of RGM-GD (the columns come from ``FeatureSpec``)."""

    model: Literal["ridge", "logistic"] = Field(
        default="ridge",
        description="ridge least squares (the paper's eq. (9)) or ridge-regularised logistic regression "
        "(derived bound, docs/privacy.md §8.3.3)",
    )
    task: Literal["regression", "classification"] | None = Field(
        default=None,
        description="label handling (mechanisms.learners.features): labels scaled to [-1, 1] or mapped to "
        "±1; default: regression for ridge, classification for logistic (which requires it)",
    )
    regularization: StrictFloat = Field(
        gt=0, le=1e6, allow_inf_nan=False, description="ridge λ > 0: the public curvature lower bound"
    )
    steps: StrictInt = Field(ge=1, le=10_000, description="maximum number of gradient steps T (worst case)")
    step_size: StrictFloat | None = Field(
        default=None,
        gt=0,
        le=1e6,
        allow_inf_nan=False,
        description="step τ; default 1/((1 + dγ)L), L = X² + λ (ridge) or X²/4 + λ (logistic)",
    )
    row_norm: StrictFloat = Field(
        default=1.0, ge=1e-6, le=1e6, allow_inf_nan=False, description="rows clipped to this ℓ2 norm X"
    )
    gamma: StrictFloat | None = Field(
        default=None,
        gt=0,
        le=1e12,
        allow_inf_nan=False,
        description="RGM γ (noise variance γ‖∇f‖² + σ², σ² = γR_rel²/η²). Give it, or target_epsilon "
        "with target_alpha (per step) or with target_delta (total over T steps).",
    )
    target_epsilon: StrictFloat | None = Field(
        default=None, gt=0, le=1e4, allow_inf_nan=False, description="target ε (per step or total)"
    )
    target_alpha: StrictFloat | None = Field(
        default=None, gt=1, le=1e4, allow_inf_nan=False, description="order of a per-step RDP target"
    )
    target_delta: StrictFloat | None = Field(
        default=None, gt=0, lt=1, allow_inf_nan=False, description="δ of a total (ε, δ) target"
    )
    bound: Literal["theorem1", "exact"] = Field(
        default="theorem1",
        description="per-step curve: Theorem 1 (paper) or the exact worst case "
        "(docs/privacy.md §8.3.1, derived)",
    )
    stop_tolerance: StrictFloat | None = Field(
        default=None,
        gt=0,
        le=1e12,
        allow_inf_nan=False,
        description="stop when the released noisy gradient norm ‖θ_{t+1} − θ_t‖/τ ≤ this for "
        "stop_patience consecutive steps (charged only for the steps run)",
    )
    stop_patience: StrictInt = Field(
        default=1, ge=1, le=10_000, description="consecutive steps below tolerance"
    )
    stop_min_steps: StrictInt = Field(
        default=1, ge=1, le=10_000, description="never stop before this many steps"
    )
    return_iterates: StrictBool = Field(
        default=False, description="release every noisy iterate, not only the final one"
    )

    @model_validator(mode="after")
    def _one_noise_spec(self) -> Self:
        targets = (self.target_epsilon, self.target_alpha, self.target_delta)
        if self.gamma is not None:
            if any(t is not None for t in targets):
                raise ValueError("give gamma, or a target, not both")
        elif self.target_epsilon is None or (self.target_alpha is None) == (self.target_delta is None):
            raise ValueError("give gamma, or target_epsilon with exactly one of target_alpha, target_delta")
        return self


@dataclass(frozen=True)
class _Resolved:
    sens: RelativeSensitivity
    d: int
    config: RgmGdConfig
    step: RdpCurve


class RgmGdMechanism(ParamsChecked):
    """RGM gradient descent: noise that follows the gradient norm, charged T_run·ε_step (ex post)."""

    name: ClassVar[str] = "rgm.gd"
    summary: ClassVar[str] = (
        "Ridge (or logistic) regression by full-batch gradient descent with the Relative Gaussian Mechanism "
        "on each gradient (Rényi DP; early stopping on released iterates is charged per step run)."
    )
    params_model: ClassVar[type[BaseModel]] = RgmGdParams
    cost_parameter: ClassVar[str] = "gamma"
    cost_increases_with_parameter: ClassVar[bool] = False
    long_running: ClassVar[bool] = True
    progress_is_public: ClassVar[bool] = True

    def cost_knob(self, p: RgmGdParams) -> tuple[str, bool]:
        """What a refusal's ``affordable`` searches: the largest target_epsilon that fits when the request
        gives a target, else the smallest gamma."""
        return ("target_epsilon", True) if p.gamma is None else ("gamma", False)

    def cost_floor(self, p: RgmGdParams, ctx: PublicContext) -> float | None:
        """Target mode: the smallest target_epsilon reachable (the RGM floor at this λ and n, slightly
        raised), where a refusal's affordable search starts; None otherwise."""
        if p.gamma is not None or ctx.n_rows is None:
            return None
        floor = self._target_floor(p, ctx, dimension(p, ctx), p.regularization)
        return floor * (1.0 + 1e-6) if math.isfinite(floor) else None

    def check(self, p: RgmGdParams, ctx: PublicContext) -> None:
        check_features(p, ctx, learner_task(p.model, p.task))
        self._resolve(p, ctx)

    def _resolve(self, p: RgmGdParams, ctx: PublicContext) -> _Resolved:
        if ctx.schema.neighboring != "replace_one" or ctx.n_rows is None:
            raise ParamsError(
                "model",
                "rgm.gd needs replace_one neighbouring (public n): the relative sensitivity of the gradient "
                "is derived for replace-one only (Hendrikx et al. 2024, eqs. 9–10)",
            )
        d = dimension(p, ctx)
        sens = relative_sensitivity(p.model, ctx.n_rows, p.regularization, p.row_norm)
        try:
            if p.gamma is not None:
                gamma = p.gamma
            elif p.target_alpha is not None:
                assert p.target_epsilon is not None
                gamma = gamma_for_step(p.target_epsilon, p.target_alpha, sens.eta, d, p.bound)
            else:
                assert p.target_epsilon is not None
                assert p.target_delta is not None
                gamma = gamma_for_total(
                    p.target_epsilon, p.target_delta, p.steps, sens, d, ctx.orders, p.bound
                )
        except (ValueError, OverflowError) as error:
            raise ParamsError("target_epsilon", f"{error}. {self._feasible_range(p, ctx, d)}") from error
        sigma = baseline_sigma(gamma, sens)
        tau = p.step_size
        if tau is None:
            tau = auto_step_size(p.model, p.regularization, p.row_norm, gamma, d)
        stop = (
            StopRule(p.stop_tolerance, p.stop_patience, p.stop_min_steps)
            if p.stop_tolerance is not None
            else None
        )
        try:
            config = RgmGdConfig(
                p.model, p.regularization, p.steps, tau, gamma, sigma, stop, p.row_norm, LABEL_BOUND
            )
        except ValueError as error:
            raise ParamsError("gamma", str(error)) from error
        problem = finiteness_problem(config, ctx.n_rows, d)
        if problem is not None:
            raise ParamsError(*problem)
        try:
            step = step_curve(ctx.orders, sens, gamma, sigma, d, p.bound)
        except ValueError as error:
            raise ParamsError("gamma", str(error)) from error
        except OverflowError as error:  # (η, R_rel) outside the float range: λ far too small for this n, X
            raise ParamsError("regularization", f"the relative sensitivity overflows: {error}") from error
        return _Resolved(sens, d, config, step)

    def _target_floor(self, p: RgmGdParams, ctx: PublicContext, d: int, reg: float) -> float:
        """The smallest target ε reachable at regularization ``reg`` (γ = 1e12, the top of the γ range), in
        the request's own terms (per step at target_alpha, or total at target_delta); +∞ if none."""
        assert ctx.n_rows is not None
        try:
            sens = relative_sensitivity(p.model, ctx.n_rows, reg, p.row_norm)
            if p.target_alpha is not None:
                return float(grid_rgm_epsilon(p.target_alpha, sens.eta, 1e12, d, p.bound))
            assert p.target_delta is not None
            one = step_curve(ctx.orders, sens, 1e12, baseline_sigma(1e12, sens), d, p.bound)
            return float(epsilon_at_delta(scale_curve(one, p.steps), p.target_delta))
        except (ValueError, OverflowError):
            return math.inf

    def _feasible_range(self, p: RgmGdParams, ctx: PublicContext, d: int) -> str:
        """Why a target is infeasible, with the feasible range: the smallest reachable ε at this λ, and the
        smallest λ (bisection, 3 significant digits) at which the asked ε becomes reachable."""
        assert p.target_epsilon is not None
        floor = self._target_floor(p, ctx, d, p.regularization)
        where = (
            f"at order {p.target_alpha:g} per step"
            if p.target_alpha is not None
            else (f"at delta {p.target_delta:g} over {p.steps} steps")
        )
        text = (
            f"Feasible range: target_epsilon ≥ {floor:.4g} {where} at regularization {p.regularization:g} "
            f"and n = {ctx.n_rows} (the RGM floor shrinks with η = 2X²/(λn): more rows or a larger λ)"
            if math.isfinite(floor)
            else f"no target_epsilon is reachable {where} at regularization {p.regularization:g}"
        )
        lo, hi = math.log(p.regularization), math.log(1e6)
        if self._target_floor(p, ctx, d, 1e6) > p.target_epsilon:
            return text + "; no regularization up to 1e6 reaches the asked epsilon"
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            if self._target_floor(p, ctx, d, math.exp(mid)) <= p.target_epsilon:
                hi = mid
            else:
                lo = mid
        needed = float(f"{math.exp(hi):.3g}")
        if self._target_floor(p, ctx, d, needed) > p.target_epsilon:
            needed = math.exp(hi)
        return text + f"; or keep target_epsilon and set regularization ≥ {needed:.3g}"

    def worst_case(self, p: RgmGdParams, ctx: PublicContext) -> RdpCurve:
        resolved = self._resolve(p, ctx)
        return scale_curve(resolved.step, resolved.config.steps)

    def run(
        self,
        p: RgmGdParams,
        ctx: PublicContext,
        table: Table,
        noise: Noise,
        progress: ProgressFn = no_progress,
    ) -> Release:
        self.check(p, ctx)
        resolved = self._resolve(p, ctx)
        worst = scale_curve(resolved.step, resolved.config.steps)
        x, y = design_matrix(p, ctx, table, learner_task(p.model, p.task), p.row_norm)
        if x.shape[0] != ctx.n_rows:
            raise ValueError("the table's row count differs from the dataset's public row count")
        result = rgm_gd_train(resolved.config, x, y, noise, progress)
        realized = scale_curve(resolved.step, result.steps_run)  # ex post: T_run·ε_step (stopping time)
        assert realized <= worst
        config = resolved.config
        output: dict[str, Any] = {
            "model": p.model,
            "columns": column_names(p, ctx),
            "theta": result.theta.tolist(),
            "steps_run": result.steps_run,
            "steps_max": config.steps,
            "stopped_early": result.stopped_early,
            "step_size": config.step_size,
            "radius": config.projection_radius,
            "gamma": config.gamma,
            "sigma": config.sigma,
            "eta": resolved.sens.eta,
            "r_rel": resolved.sens.r_rel,
            "bound": p.bound,
            "noisy_gradient_grid": {
                **rgm_grid(config.sigma, resolved.d).describe(),
                "noise": "discrete Gaussian in grid units, standard deviation an integer ≥ √(γ‖∇f‖² + σ²)/"
                "granularity (secret, not released)",
                "note": "each noisy gradient is a multiple of the granularity; theta and the iterates are "
                "deterministic post-processing of them (projected steps)",
            },
            "scale": "coefficients are on the design matrix of mechanisms.learners.features "
            "(features divided by their declared magnitude, rows clipped to row_norm)",
        }
        if p.return_iterates:
            output["iterates"] = result.iterates.tolist()
        return Release(output=output, realized=realized)
