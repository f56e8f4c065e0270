"""Clipped Gaussian DP gradient descent (full batch): the standard baseline, pure numerics.

Algorithm (Abadi et al. 2016 with the full batch; Song, Chaudhuri, Sarwate 2013), on a design matrix X
(rows ‖x_i‖ ≤ 1 by ``mechanisms.learning.design_matrix``; not needed for privacy) and labels y:

    θ₀ = 0;  for t = 0 … T−1:
        g_t = Σ_i clip(∇ℓ_i(θ_t), C) + N(0, (z·Δ)² I_d),   clip(v, C) = v·min(1, C/‖v‖)
        θ_{t+1} = θ_t − τ·(g_t / n_norm + λθ_t)

with ℓ_i the **unregularised** per-record loss (logistic log(1 + e^{−y_i x_iᵀθ}) with y_i = ±1, or squared
½(x_iᵀθ − y_i)²), ridge λ applied outside the clipped sum (it does not depend on the data), z the noise
multiplier and Δ the ℓ2 sensitivity of the clipped sum: **2C under replace_one** (one clipped vector
replaced by another) and **C under add_remove** (one clipped vector added or removed).

Privacy (Mironov 2017, Prop. 7 and Prop. 1): each step is a Gaussian mechanism with sensitivity Δ and
standard deviation zΔ on a query chosen from the previous (public) iterate, so it is (α, α/(2z²))-RDP at
every order; T adaptive steps compose to (α, T·α/(2z²)). The division by ``n_norm`` and the ridge term are
post-processing, so the guarantee holds for any public ``n_norm`` and does not need ‖x_i‖ ≤ 1 or bounded
labels: clipping alone bounds the sensitivity. ``n_norm`` must be public: the row count under replace_one
(``PublicContext.n_rows``); under add_remove the row count is private, so the caller passes a public
estimate (the service mechanism asks for an ``n_hint`` parameter); a wrong hint only rescales the step.

``DpGdConfig.neighboring`` fixes the Δ the noise is calibrated to; ``dp_gd_curve`` charges the relation
asked for against the noise actually used, T·α·Δ_asked²/(2(zΔ_noise)²), so a mismatch can only over-charge
(replace_one noise is valid for both relations) and never under-charge.

Limitation (documented, not fixed): numpy's floating-point Gaussian sampler (as in ``mechanisms.gaussian``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

import numpy as np
from pydantic import BaseModel, Field, model_validator

from mechanisms.accounting.curve import RdpCurve, _pad_up
from mechanisms.accounting.orders import validate_orders
from mechanisms.base import ParamsError, ProgressFn, PublicContext, Release, Table, no_progress, params_as
from mechanisms.learning import FeatureSpec, Task, check_features, design_matrix
from mechanisms.schema import CategoricalColumn

Loss = Literal["logistic", "squared"]
Neighboring = Literal["replace_one", "add_remove"]


@dataclass(frozen=True)
class DpGdConfig:
    """Public hyper-parameters of clipped DP-GD (all checked in ``__post_init__``)."""

    loss: Loss
    reg: float
    steps: int
    step_size: float
    clip: float
    noise_multiplier: float
    neighboring: Neighboring = "replace_one"

    def __post_init__(self) -> None:
        if self.loss not in ("logistic", "squared"):
            raise ValueError(f"loss must be 'logistic' or 'squared', got {self.loss!r}")
        if self.neighboring not in ("replace_one", "add_remove"):
            raise ValueError(f"neighboring must be 'replace_one' or 'add_remove', got {self.neighboring!r}")
        if isinstance(self.steps, bool) or int(self.steps) != self.steps or self.steps < 1:
            raise ValueError(f"steps must be an integer ≥ 1, got {self.steps!r}")
        for name in ("reg", "step_size", "clip", "noise_multiplier"):
            value = float(getattr(self, name))
            low_ok = value >= 0.0 if name == "reg" else value > 0.0
            if not (math.isfinite(value) and low_ok):
                raise ValueError(
                    f"{name} must be finite and {'≥' if name == 'reg' else '>'} 0, got {value!r}"
                )


def sensitivity(clip: float, neighboring: Neighboring) -> float:
    """ℓ2 sensitivity of Σ_i clip(v_i, C): 2C under replace_one, C under add_remove."""
    if neighboring == "replace_one":
        return 2.0 * clip
    if neighboring == "add_remove":
        return clip
    raise ValueError(f"unknown neighbouring relation {neighboring!r}")


def noise_std(config: DpGdConfig) -> float:
    """Standard deviation z·Δ of the noise on the clipped gradient sum (Δ from ``config.neighboring``)."""
    return config.noise_multiplier * sensitivity(config.clip, config.neighboring)


def dp_gd_curve(config: DpGdConfig, neighboring: Neighboring, orders: Sequence[float]) -> RdpCurve:
    """RDP of the whole run under ``neighboring``: T·α·Δ²/(2s²), s = ``noise_std(config)``; no pure bound.

    With ``neighboring == config.neighboring`` this is T·α/(2z²) (Mironov 2017, Prop. 7, composed T times
    by Prop. 1). Values are padded upwards so rounding can only over-charge.
    """
    grid = validate_orders(orders)
    one_step = RdpCurve.gaussian(sensitivity(config.clip, neighboring), noise_std(config), grid)
    values = tuple(_pad_up(config.steps * v) for v in one_step.values)
    return RdpCurve(grid, values)


def noise_multiplier_for(target_epsilon: float, delta: float, steps: int, orders: Sequence[float]) -> float:
    """The smallest z (on the grid) with min_α [T·α/(2z²) + log(1/δ)/(α−1)] ≤ ε (Mironov 2017, Prop. 3).

    Per order the closed form is z² = Tα/(2(ε − log(1/δ)/(α−1))) where ε > log(1/δ)/(α−1); the result is
    raised slightly and re-checked so that ``epsilon_at_delta(dp_gd_curve(...), δ) ≤ ε`` holds in floats.
    Raises ValueError if no order of the grid can reach ε at δ.
    """
    grid = validate_orders(orders)
    if not (math.isfinite(target_epsilon) and target_epsilon > 0.0):
        raise ValueError(f"target_epsilon must be finite and > 0, got {target_epsilon!r}")
    if not (math.isfinite(delta) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer ≥ 1, got {steps!r}")
    log_term = math.log(1.0 / delta)
    best = math.inf
    for alpha in grid:
        room = target_epsilon - log_term / (alpha - 1.0)
        if room > 0.0:
            best = min(best, math.sqrt(steps * alpha / (2.0 * room)))
    if not math.isfinite(best):
        raise ValueError(f"no order of the grid reaches epsilon {target_epsilon!r} at delta {delta!r}")
    z = best * (1.0 + 1e-12)
    while _converted(z, steps, grid, log_term) > target_epsilon:  # float safety; at most a few rounds
        z = z * (1.0 + 1e-9)
    return z


def _converted(z: float, steps: int, grid: tuple[float, ...], log_term: float) -> float:
    """min_α [padded T·α/(2z²) + padded log(1/δ)/(α−1)]: the ε the charged curve converts to."""
    return min(_pad_up(steps * _pad_up(a / (2.0 * z * z))) + _pad_up(log_term / (a - 1.0)) for a in grid)


# ----- the learning numerics -------------------------------------------------------------------------------
def _check_data(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    features = np.asarray(x, dtype=float)
    labels = np.asarray(y, dtype=float)
    if features.ndim != 2 or labels.shape != (features.shape[0],):
        raise ValueError("x must be (n, d) and y must be (n,)")
    return features, labels


def _scalar_grad(margin: np.ndarray, labels: np.ndarray, loss: Loss) -> np.ndarray:
    """s_i with ∇ℓ_i(θ) = s_i·x_i: −y_i·sigmoid(−y_i x_iᵀθ) (logistic) or x_iᵀθ − y_i (squared)."""
    if loss == "logistic":
        # sigmoid(−m) = exp(−logaddexp(0, m)), stable for both signs of m.
        result: np.ndarray = -labels * np.exp(-np.logaddexp(0.0, labels * margin))
        return result
    residual: np.ndarray = margin - labels
    return residual


def clipped_gradient_sum(
    theta: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    loss: Loss,
    clip: float,
    row_norms: np.ndarray | None = None,
) -> np.ndarray:
    """Σ_i clip(∇ℓ_i(θ), C) in O(nd): ∇ℓ_i = s_i x_i, so ‖∇ℓ_i‖ = |s_i|·‖x_i‖ and each term is rescaled.

    ``row_norms`` (‖x_i‖, computed here when omitted) lets a training loop compute them once.
    """
    features, labels = _check_data(x, y)
    norms_x = np.linalg.norm(features, axis=1) if row_norms is None else row_norms
    scalars = _scalar_grad(features @ theta, labels, loss)
    norms = np.abs(scalars) * norms_x
    factor = np.minimum(1.0, clip / np.maximum(norms, np.finfo(float).tiny))
    total: np.ndarray = features.T @ (scalars * factor)
    return total


def objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, loss: Loss, reg: float) -> float:
    """Regularised empirical risk (1/n)Σ ℓ_i(θ) + (λ/2)‖θ‖² (non-private; for evaluation and tests)."""
    features, labels = _check_data(x, y)
    th = np.asarray(theta, dtype=float)
    margin = features @ th
    if loss == "logistic":
        risk = float(np.mean(np.logaddexp(0.0, -labels * margin)))
    elif loss == "squared":
        risk = float(np.mean(0.5 * (margin - labels) ** 2))
    else:
        raise ValueError(f"loss must be 'logistic' or 'squared', got {loss!r}")
    return risk + 0.5 * reg * float(th @ th)


def dp_gd_train(
    config: DpGdConfig,
    x: np.ndarray,
    y: np.ndarray,
    n_norm: float,
    rng: np.random.Generator,
    progress: ProgressFn = no_progress,
    *,
    return_iterates: bool = False,
) -> np.ndarray:
    """Run clipped DP-GD from θ₀ = 0 and return the final θ (shape (d,)).

    ``n_norm`` is a **public** normaliser (see the module docstring). With ``return_iterates=True`` the
    result is every released iterate θ₁ … θ_T, shape (T, d) (all are post-processing of the noisy sums).
    ``progress((t+1)/T)`` is called after every step.
    """
    features, labels = _check_data(x, y)
    if not (math.isfinite(n_norm) and n_norm > 0.0):
        raise ValueError(f"n_norm must be finite and > 0, got {n_norm!r}")
    d = features.shape[1]
    std = noise_std(config)
    theta = np.zeros(d)
    iterates = np.empty((config.steps, d)) if return_iterates else None
    row_norms = np.linalg.norm(features, axis=1)
    for t in range(config.steps):
        noisy_sum = clipped_gradient_sum(theta, features, labels, config.loss, config.clip, row_norms)
        noisy_sum = noisy_sum + std * rng.standard_normal(d)
        theta = theta - config.step_size * (noisy_sum / n_norm + config.reg * theta)
        if iterates is not None:
            iterates[t] = theta
        progress((t + 1) / config.steps)
    return iterates if iterates is not None else theta


# ----- the service mechanism "dp_gd" ------------------------------------------------------------------------
class DpGdParams(FeatureSpec):
    """Public parameters of clipped DP-GD (the columns come from ``FeatureSpec``)."""

    model: Literal["logistic", "ridge"] = Field(
        default="logistic",
        description="logistic regression (labels ±1) or ridge least squares (squared loss)",
    )
    task: Literal["regression", "classification"] | None = Field(
        default=None,
        description="label handling (mechanisms.learning); default: classification for logistic, "
        "regression for ridge. Logistic needs classification.",
    )
    regularization: float = Field(
        default=0.01, ge=0, le=1e6, allow_inf_nan=False, description="ridge λ ≥ 0"
    )
    steps: int = Field(ge=1, le=10_000, description="number of gradient steps T")
    step_size: float | None = Field(
        default=None,
        gt=0,
        le=1e6,
        allow_inf_nan=False,
        description="step τ; default 1/L, public smoothness bound L = X² + λ (ridge), X²/4 + λ (logistic)",
    )
    clip: float = Field(
        default=1.0, gt=0, le=1e6, allow_inf_nan=False, description="per-example gradient norm bound C"
    )
    noise_multiplier: float | None = Field(
        default=None,
        gt=0,
        le=1e6,
        allow_inf_nan=False,
        description="z: noise std z·Δ on the clipped sum (Δ = 2C replace-one, C add/remove). "
        "Give it, or target_epsilon and target_delta.",
    )
    target_epsilon: float | None = Field(
        default=None,
        gt=0,
        le=1e4,
        allow_inf_nan=False,
        description="total ε at target_delta (Mironov conversion)",
    )
    target_delta: float | None = Field(
        default=None, gt=0, lt=1, allow_inf_nan=False, description="δ of the total (ε, δ) target"
    )
    row_norm: float = Field(
        default=1.0,
        gt=0,
        le=1e6,
        allow_inf_nan=False,
        description="rows of the design matrix clipped to this ℓ2 norm",
    )
    n_hint: int | None = Field(
        default=None,
        ge=1,
        le=10**12,
        description="add_remove datasets only: a PUBLIC row-count estimate that normalises the gradient "
        "sum (the true count is private); affects utility only",
    )
    return_iterates: bool = Field(
        default=False, description="release every noisy iterate, not only the final one"
    )

    @model_validator(mode="after")
    def _one_noise_spec(self) -> Self:
        target = self.target_epsilon is not None or self.target_delta is not None
        if (self.noise_multiplier is None) == (not target):
            raise ValueError("give exactly one of: noise_multiplier, or target_epsilon with target_delta")
        if target and (self.target_epsilon is None or self.target_delta is None):
            raise ValueError("target_epsilon and target_delta go together")
        return self



def learner_task(model: str, task: str | None) -> Task:
    """The label handling of ``mechanisms.learning`` for a model."""
    if task is not None:
        return "classification" if task == "classification" else "regression"
    return "classification" if model == "logistic" else "regression"


def column_names(spec: FeatureSpec, ctx: PublicContext) -> list[str]:
    """Names of the design-matrix columns (public): numeric name, ``name=value`` one-hots, ``(intercept)``."""
    names: list[str] = []
    for name in spec.features:
        column = ctx.schema.column(name)
        if isinstance(column, CategoricalColumn):
            names.extend(f"{name}={value}" for value in column.values)
        else:
            names.append(name)
    if spec.intercept:
        names.append("(intercept)")
    return names


class DpGdMechanism:
    """Clipped Gaussian DP gradient descent (full batch), the baseline of issue 5."""

    name: ClassVar[str] = "dp_gd"
    summary: ClassVar[str] = (
        "Logistic or ridge regression by full-batch gradient descent with per-example clipping and Gaussian "
        "noise (Rényi DP, T·α/(2z²))."
    )
    params_model: ClassVar[type[BaseModel]] = DpGdParams
    cost_parameter: ClassVar[str] = "noise_multiplier"
    cost_increases_with_parameter: ClassVar[bool] = False
    long_running: ClassVar[bool] = True
    progress_is_public: ClassVar[bool] = True

    def check(self, params: BaseModel, ctx: PublicContext) -> None:
        p = params_as(params, DpGdParams)
        task = learner_task(p.model, p.task)
        if p.model == "logistic" and task != "classification":
            raise ParamsError("task", "logistic regression needs a classification label")
        check_features(p, ctx, task)
        if ctx.schema.neighboring == "replace_one":
            if p.n_hint is not None:
                raise ParamsError("n_hint", "only for add_remove datasets (the row count is public here)")
        elif p.n_hint is None:
            raise ParamsError(
                "n_hint", "required on add_remove datasets: a public row-count estimate (n is private)"
            )
        self._config(p, ctx)

    def _config(self, p: DpGdParams, ctx: PublicContext) -> DpGdConfig:
        if p.noise_multiplier is not None:
            z = p.noise_multiplier
        else:
            assert p.target_epsilon is not None
            assert p.target_delta is not None
            try:
                z = noise_multiplier_for(p.target_epsilon, p.target_delta, p.steps, ctx.orders)
            except ValueError as error:
                raise ParamsError("target_epsilon", str(error)) from error
        curvature = p.row_norm**2 if p.model == "ridge" else p.row_norm**2 / 4.0
        tau = p.step_size if p.step_size is not None else 1.0 / (curvature + p.regularization)
        loss: Loss = "squared" if p.model == "ridge" else "logistic"
        return DpGdConfig(loss, p.regularization, p.steps, tau, p.clip, z, ctx.schema.neighboring)

    def worst_case(self, params: BaseModel, ctx: PublicContext) -> RdpCurve:
        p = params_as(params, DpGdParams)
        return dp_gd_curve(self._config(p, ctx), ctx.schema.neighboring, ctx.orders)

    def run(
        self,
        params: BaseModel,
        ctx: PublicContext,
        table: Table,
        rng: np.random.Generator,
        progress: ProgressFn = no_progress,
    ) -> Release:
        p = params_as(params, DpGdParams)
        self.check(p, ctx)
        config = self._config(p, ctx)
        worst = dp_gd_curve(config, ctx.schema.neighboring, ctx.orders)
        public_n = ctx.n_rows if ctx.schema.neighboring == "replace_one" else p.n_hint
        if public_n is None:
            raise ParamsError("n_hint", "a public row count is needed to normalise the gradient")
        n_norm = float(public_n)
        x, y = design_matrix(p, ctx, table, learner_task(p.model, p.task), p.row_norm)
        path = dp_gd_train(config, x, y, n_norm, rng, progress, return_iterates=True)
        realized = worst  # every run spends all T steps: the ex-ante curve is the charge
        assert realized <= worst
        output: dict[str, Any] = {
            "model": p.model,
            "columns": column_names(p, ctx),
            "theta": path[-1].tolist(),
            "steps_run": config.steps,
            "step_size": config.step_size,
            "noise_multiplier": config.noise_multiplier,
            "noise_std": noise_std(config),
            "normaliser": n_norm,
            "scale": "coefficients are on the design matrix of mechanisms.learning (features divided by "
            "their declared magnitude, rows clipped to row_norm)",
        }
        if p.return_iterates:
            output["iterates"] = path.tolist()
        return Release(output=output, realized=realized)
