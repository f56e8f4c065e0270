"""Private full-batch gradient descent with the Relative Gaussian Mechanism on every step (RGM-GD).

Source: Hendrikx, Mangold, Bellet (AISTATS 2024), eq. (7); the RGM and its curves are
``mechanisms.learners.relative_gaussian``. The soundness argument is written out in
docs/privacy/gradient_descent.md#gradient-descent.

Algorithm (replace-one neighbours, n public; K = {‖θ‖ ≤ r} a public ball)::

    θ₀ = Π_K(public start, 0 in the service);  for t = 0 … T−1:
        g̃_t = ∇f(θ_t; D) + N(0, (γ‖∇f(θ_t; D)‖² + σ²)·I_d)      (RGM_{γ,σ}, per-coordinate VARIANCE)
        θ_{t+1} = Π_K(θ_t − τ·g̃_t)                               (projection: post-processing of g̃_t)
        stop after step t if the stopping rule, evaluated on the released θ₀ … θ_{t+1} only, says so

f(θ; D) = (1/n)Σ ℓ(x_iᵀθ, y_i) + (λ/2)‖θ‖² on the design matrix of ``mechanisms.learners.features`` (rows
‖x_i‖ ≤ X, labels |y_i| ≤ Y = 1), with ℓ the squared loss ½(x_iᵀθ − y_i)² ("ridge") or the logistic loss
log(1 + e^{−y_i x_iᵀθ}) with y_i = ±1 ("logistic").

Projection and finite arithmetic (docs/privacy/gradient_descent.md#rgm-gd-projection). The radius r =
``theta_bound`` is a public bound on ‖θ*‖ for every dataset (ridge: ``ridge_theta_bound``; logistic: X·Y/λ),
so θ* ∈ K and projected GD keeps Theorem 2's contraction (Π_K is non-expansive). Without it, floats overflowed
at a data-dependent step (γ‖∇f(θ_t; D)‖² = ∞ for D but not for D′ at the same public θ_t): a failure bit that
reads the secret gradient. With ‖θ_t‖ ≤ r, ‖x_i‖ ≤ X, |y_i| ≤ Y every float quantity of a step has a public
bound (``finiteness_problem``): ‖∇f‖ ≤ G = (X² + λ)r + XY (ridge) or XY + λr (logistic), variance
≤ γG² + σ², update ≤ r + τ(G + Z_MAX·√(γG² + σ²)); requests where one of them is not far below the float
range are refused at admission, so no step can overflow for any dataset. Privacy does not use the
projection at all: both relative sensitivities hold for every θ.

Relative sensitivity, uniformly in θ (so it holds at every public iterate θ_t), from public parameters:

* ridge: ``ridge_relative_sensitivity_split`` with κ = 3 (the paper's eq. (10) with the corrected scaling, C =
  I in Prop. 1, curvature A ⪰ λI from the public λ, no data-dependent test and no PTR; tightened in
  docs/privacy/gradient_descent.md#lemma-ridge-split): η = 2X²/(λn), R_rel = (2/√3)·D/n with D =
  ``ridge_gradient_gap_bound`` the diameter of the per-record gradient set over the ball ‖θ‖ ≤ B = Y/(2√λ) ≥
  ‖θ*‖ (for X ≥ √λ), at most the triangle inequality's 2X(XB + Y). The paper-faithful
  ``ridge_relative_sensitivity`` (η = √6X²/(λn), R_rel = √12·X(XB′ + Y)/n, B′ = Y·min(X/λ, 1/√λ)) is looser in
  both.
* logistic: ``logistic_relative_sensitivity`` (App. B.2 of the paper, instantiated for the logistic
  GLM in Lemma LOG, docs/privacy/gradient_descent.md#lemma-log): each per-record loss is convex
  and L = X²/4 smooth, f is λ-strongly convex, so η = √(6·L·(L/λ)/λ)/n = √(3/8)·X²/(λn) and
  R_rel = √12·X/n (‖∇ℓ_i‖ ≤ X). Checked on adversarial neighbours in tests/unit/test_rgm_gd.py.

Charge (docs/privacy/gradient_descent.md#theorem-rgd). Each step is an RGM release of a query with (η,
R_rel)-relative sensitivity, so it is (α, ε_step(α))-RDP conditionally on the past (Theorem 1, or the exact
curve of Lemma EXACT, docs/privacy/gradient_descent.md#lemma-exact), with ε_step a function of (α, η, γ, d)
only (σ² = γR_rel²/η² satisfies the σ² condition at every α). The stopping time T_run is decided from released
iterates only, so Π_{s≤t} (p_s/q_s)^{α−1}e^{−(α−1)ε_step} is a non-negative supermartingale on the released
filtration and optional stopping at T_run ≤ T gives the ex-post RDP inequality with the realized charge
T_run·ε_step(α). The worst case is T·ε_step(α). Orders ≥ α_max(η) are +∞. The charge never depends on a true
gradient norm or the secret noise variance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

import numpy as np
from pydantic import BaseModel, Field, StrictBool, StrictFloat, model_validator

from mechanisms.accounting.conversion import epsilon_at_delta
from mechanisms.accounting.curve import RdpCurve
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
    RelativeSensitivity,
    grid_rgm_epsilon,
    project_to_ball,
    rgm_grid,
    rgm_release_grid,
)
from mechanisms.learners.rgm_calibration import (
    Model,
    auto_step_size,
    baseline_sigma,
    gamma_for_step,
    gamma_for_total,
    gradient_bound,
    relative_sensitivity,
    scale_curve,
    step_curve,
    theta_bound,
)
from mechanisms.noise import Noise
from mechanisms.params import OpenUnit, PositiveUpTo1e12, Steps, StepSize, TargetEpsilon

#: Y: the design matrix's labels are scaled to [−1, 1] or mapped to ±1 (mechanisms.learners.features)
LABEL_BOUND = 1.0

FLOAT_CEILING = 1e300  # public bounds must stay below this: 1e8 of headroom under the float maximum 1.8e308
Z_MAX = 1030.0  # |Z|·γ_g ≤ 513·t·γ_g ≤ 1030·√v: the exact sampler never returns |Z| > 513·t (t ≤ √v/γ_g + 1)
MAX_UNITS = 2.0**50  # public bound on G/γ_g and (√γ·G + σ)/γ_g: means and noise scales stay in the int64 path


# ----- training ---------------------------------------------------------------------------------------------
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
    The noise variance γ‖∇f(θ_t)‖² + σ² is secret: it is neither returned nor logged
    (docs/privacy/rules.md#rule-secret-state:
    Theorem 1 covers the leak through the noisy output only). ``progress((t+1)/T)`` is called after every step
    (and ``progress(1.0)`` when stopping early).
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
        "(derived bound, docs/privacy/gradient_descent.md#lemma-log)",
    )
    task: Literal["regression", "classification"] | None = Field(
        default=None,
        description="label handling (mechanisms.learners.features): labels scaled to [-1, 1] or mapped to "
        "±1; default: regression for ridge, classification for logistic (which requires it)",
    )
    regularization: StrictFloat = Field(
        gt=0, le=1e6, allow_inf_nan=False, description="ridge λ > 0: the public curvature lower bound"
    )
    steps: Steps = Field(description="maximum number of gradient steps T (worst case)")
    step_size: StepSize | None = Field(
        default=None, description="step τ; default 1/((1 + dγ)L), L = X² + λ (ridge) or X²/4 + λ (logistic)"
    )
    row_norm: StrictFloat = Field(
        default=1.0, ge=1e-6, le=1e6, allow_inf_nan=False, description="rows clipped to this ℓ2 norm X"
    )
    gamma: PositiveUpTo1e12 | None = Field(
        default=None,
        description="RGM γ (noise variance γ‖∇f‖² + σ², σ² = γR_rel²/η²). Give it, or target_epsilon "
        "with target_alpha (per step) or with target_delta (total over T steps).",
    )
    target_epsilon: TargetEpsilon | None = Field(default=None, description="target ε (per step or total)")
    target_alpha: StrictFloat | None = Field(
        default=None, gt=1, le=1e4, allow_inf_nan=False, description="order of a per-step RDP target"
    )
    target_delta: OpenUnit | None = Field(default=None, description="δ of a total (ε, δ) target")
    bound: Literal["theorem1", "exact"] = Field(
        default="theorem1",
        description="per-step curve: Theorem 1 (paper) or the exact worst case "
        "(docs/privacy/gradient_descent.md#lemma-exact, derived)",
    )
    stop_tolerance: PositiveUpTo1e12 | None = Field(
        default=None,
        description="stop when the released noisy gradient norm ‖θ_{t+1} − θ_t‖/τ ≤ this for "
        "stop_patience consecutive steps (charged only for the steps run)",
    )
    stop_patience: Steps = Field(default=1, description="consecutive steps below tolerance")
    stop_min_steps: Steps = Field(default=1, description="never stop before this many steps")
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
