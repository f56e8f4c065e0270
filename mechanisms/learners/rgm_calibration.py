"""RGM-GD, the public side: the relative sensitivity of the gradient query, the public bounds on θ and on
the gradient, the per-step and total curves, and the calibration of γ to a target. Every value is a function
of public parameters only; the training and the mechanism: ``mechanisms.learners.rgm_gd`` (its docstring
states the theorems and their conditions)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from mechanisms.accounting.conversion import epsilon_at_delta
from mechanisms.accounting.curve import RdpCurve, pad_up
from mechanisms.accounting.orders import validate_orders
from mechanisms.learners.relative_gaussian import (
    Bound,
    RelativeSensitivity,
    grid_rgm_epsilon,
    rgm_grid_curve,
    ridge_relative_sensitivity_split,
    ridge_theta_bound,
)

Model = Literal["ridge", "logistic"]
_UP = 1.0 + 1e-12
RIDGE_SPLIT = 3.0  # Young's κ of ``ridge_relative_sensitivity_split``: η = 2X²/(λn), R_rel = (2/√3)·D/n


# ----- the query's relative sensitivity -------------------------------------------------------------------
def logistic_relative_sensitivity(n_rows: int, reg: float, feature_bound: float) -> RelativeSensitivity:
    """(η, R_rel) of the full-batch ridge-regularised logistic gradient, uniformly in θ (replace-one).

    Paper App. B.2 (general convex losses), instantiated and proved in
    docs/privacy/gradient_descent.md#lemma-log: with ℓ_i convex and L-smooth (L = X²/4), f λ-strongly convex
    and D_{ℓ} ≤ (L/λ)·D_f (relative smoothness, L_rel = L/λ), θ* = argmin f(·; D),

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


# ----- how RGM-GD compares with clipped DP-GD (docs/privacy/gradient_descent.md#proposition-nogain) ---------
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
    docs/privacy/finite_precision_learners.md#theorem-rgm-grid): depends on public parameters only; needs σ ≥
    √γ·R_rel/η (``baseline_sigma``)."""
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

    The bound is (αη²/(2ρ_q))·(1/√γ + c)² + floor(α) with c, floor independent of γ
    (docs/privacy/finite_precision_learners.md#fp-rgm-gd),
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
