"""RGM gradient descent (mechanisms/learners/rgm_gd.py): sensitivity, calibration, charges, stopping, the
mechanisms.

The logistic relative-sensitivity bound (derived, docs/privacy/gradient_descent.md#lemma-log) is checked on
random and adversarially optimised neighbouring datasets; the ridge bound has its own tests in
test_relative_gaussian.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import optimize

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve, epsilon_at_delta
from mechanisms.base import ParamsError, PublicContext, best_affordable_cost
from mechanisms.catalog import MECHANISMS
from mechanisms.data.schema import DatasetSchema
from mechanisms.learners.dp_gd import (
    DpGdConfig,
    DpGdMechanism,
    DpGdParams,
    clipped_gradient_sum,
    default_radius,
    dp_gd_curve,
    noise_multiplier_for,
)
from mechanisms.learners.relative_gaussian import (
    RelativeSensitivity,
    alpha_max,
    clip_rows,
    grid_rgm_epsilon,
    project_to_ball,
    ridge_gradient,
    ridge_gradient_gap_bound,
    ridge_relative_sensitivity,
    ridge_relative_sensitivity_split,
    ridge_theta_bound,
    theorem1_epsilon,
)
from mechanisms.learners.rgm_calibration import (
    Model,
    auto_step_size,
    baseline_sigma,
    gamma_for_step,
    gamma_for_total,
    gradient_bound,
    logistic_relative_sensitivity,
    never_clipping_threshold,
    relative_sensitivity,
    ridge_r_rel_floor,
    scale_curve,
    step_curve,
    theta_bound,
)
from mechanisms.learners.rgm_gd import (
    RgmGdConfig,
    RgmGdMechanism,
    RgmGdParams,
    StopRule,
    bounded_records,
    finiteness_problem,
    full_gradient,
    model_objective,
    rgm_gd_train,
)
from mechanisms.noise import Noise
from tests.unit.conftest import pair_quantities, random_batch, sup_ratio_over_theta

SCHEMA = {
    "columns": [
        {"name": "a", "type": "float", "min": -2.0, "max": 2.0},
        {"name": "b", "type": "float", "min": 0.0, "max": 10.0},
        {"name": "g", "type": "categorical", "values": ["u", "v"]},
        {"name": "y", "type": "float", "min": -3.0, "max": 3.0},
        {"name": "c", "type": "categorical", "values": ["no", "yes"]},
    ],
    "neighboring": "replace_one",
}
N = 400


def _ctx(neighboring: str = "replace_one") -> PublicContext:
    schema = DatasetSchema.model_validate({**SCHEMA, "neighboring": neighboring})
    return PublicContext(schema, N if neighboring == "replace_one" else None, DEFAULT_ORDERS)


def _table(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.uniform(-2, 2, N)
    b = rng.uniform(0, 10, N)
    g = rng.integers(0, 2, N)
    y = np.clip(0.8 * a - 0.1 * b + 0.5 * g + 0.3 * rng.normal(size=N), -3, 3)
    c = (a + 0.3 * rng.normal(size=N) > 0).astype(int)
    return {"a": a, "b": b, "g": g, "y": y, "c": c}


def _logistic_grad(theta: np.ndarray, x: np.ndarray, y: np.ndarray, reg: float) -> np.ndarray:
    """Independent oracle: (1/n)Σ −y_i x_i/(1 + e^{y_i x_iᵀθ}) + λθ, batched over leading axes."""
    margin = np.einsum("...nd,...d->...n", x, theta)
    weights = -y / (1.0 + np.exp(y * margin))
    return np.einsum("...nd,...n->...d", x, weights) / x.shape[-2] + reg * theta


# ----- gradients ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["ridge", "logistic"])
def test_full_gradient_matches_finite_differences(model: str) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(60, 4)) / 2
    y = np.sign(rng.normal(size=60)) if model == "logistic" else rng.uniform(-1, 1, 60)
    theta = rng.normal(size=4)
    grad = full_gradient(theta, x, y, model, 0.1)  # type: ignore[arg-type]
    numeric = optimize.approx_fprime(theta, lambda t: model_objective(t, x, y, model, 0.1), 1e-7)  # type: ignore[arg-type]
    np.testing.assert_allclose(grad, numeric, atol=1e-6)
    if model == "ridge":
        np.testing.assert_allclose(grad, ridge_gradient(theta, x, y, 0.1), rtol=1e-12)
    else:
        np.testing.assert_allclose(grad, _logistic_grad(theta, x, y, 0.1), rtol=1e-12)


# ----- logistic relative sensitivity (derived bound) --------------------------------------------------------
def test_logistic_bound_formula() -> None:
    sens = logistic_relative_sensitivity(100, 0.1, 2.0)
    assert sens.eta == pytest.approx(math.sqrt(3 / 8) * 4 / (0.1 * 100), rel=1e-12)
    assert sens.r_rel == pytest.approx(math.sqrt(12) * 2 / 100, rel=1e-12)
    assert sens.eta >= math.sqrt(3 / 8) * 4 / (0.1 * 100)
    assert relative_sensitivity("ridge", 100, 0.1, 2.0) == ridge_relative_sensitivity_split(
        100, 0.1, 2.0, 1.0, 3.0
    )
    with pytest.raises(ValueError, match="reg"):
        logistic_relative_sensitivity(100, 0.0, 1.0)


def _ratio(x: np.ndarray, y: np.ndarray, x0: np.ndarray, y0: float, theta: np.ndarray, reg: float) -> float:
    """‖∇f − ∇f′‖² / (η²‖∇f‖² + R_rel²) for D = (x, y) and D′ = D with record 0 replaced."""
    n = x.shape[0]
    sens = logistic_relative_sensitivity(n, reg, 1.0)
    x2, y2 = x.copy(), y.copy()
    x2[0], y2[0] = x0, y0
    g = _logistic_grad(theta, x, y, reg)
    g2 = _logistic_grad(theta, x2, y2, reg)
    return float(np.sum((g - g2) ** 2) / (sens.eta**2 * np.sum(g**2) + sens.r_rel**2))


def _unit_ball(v: np.ndarray) -> np.ndarray:
    return v / np.maximum(1.0, np.linalg.norm(v, axis=-1, keepdims=True))


@pytest.mark.slow
@pytest.mark.parametrize(("n", "d", "reg"), [(1, 1, 0.05), (2, 2, 0.01), (5, 3, 0.1), (20, 4, 0.5)])
def test_logistic_relative_sensitivity_random_and_adversarial(n: int, d: int, reg: float) -> None:
    """The inequality on random neighbours (vectorised) and on neighbours optimised by Nelder–Mead."""
    rng = np.random.default_rng(n * 100 + d)
    trials = 4000
    x = _unit_ball(rng.normal(size=(trials, n, d)) * rng.choice([0.3, 1, 3], size=(trials, 1, 1)))
    y = rng.choice([-1.0, 1.0], size=(trials, n))
    x2, y2 = x.copy(), y.copy()
    x2[:, 0] = _unit_ball(rng.normal(size=(trials, d)) * 3)
    y2[:, 0] = rng.choice([-1.0, 1.0], size=trials)
    theta = rng.normal(size=(trials, d)) * rng.choice([0.01, 1, 10, 100], size=(trials, 1))
    sens = logistic_relative_sensitivity(n, reg, 1.0)
    g, g2 = _logistic_grad(theta, x, y, reg), _logistic_grad(theta, x2, y2, reg)
    lhs = np.sum((g - g2) ** 2, axis=1)
    rhs = sens.eta**2 * np.sum(g**2, axis=1) + sens.r_rel**2
    assert np.max(lhs / rhs) <= 1.0

    # adversarial: maximise the ratio over (D, replaced record, θ) from the best random starts
    def negative(z: np.ndarray) -> float:
        xs = _unit_ball(z[: n * d].reshape(n, d))
        x0 = _unit_ball(z[n * d : n * d + d])
        th = z[n * d + d :]
        return -_ratio(xs, ys, x0, -ys[0], th, reg)

    best = 0.0
    for start in np.argsort(lhs / rhs)[-6:]:
        ys = y[start]
        z0 = np.concatenate([x[start].ravel(), x2[start, 0], theta[start]])
        result = optimize.minimize(
            negative, z0, method="Nelder-Mead", options={"maxiter": 3000, "xatol": 1e-9}
        )
        best = max(best, -float(result.fun))
    assert best <= 1.0
    assert best > 0.02  # the search finds pairs that use a visible part of the bound


# ----- calibration ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("eps", "alpha", "eta", "d", "expected"),
    [
        (0.1, 2.0, 0.01, 10, 0.0010653179004563),
        (0.1, 2.0, 0.01, 22, 0.0011245668435575),
        (0.01, 2.0, 0.01, 22, 0.13658836557403),
    ],
)
def test_gamma_for_step_note_vectors(eps: float, alpha: float, eta: float, d: int, expected: float) -> None:
    gamma = gamma_for_step(eps, alpha, eta, d)
    # the grid curve (docs/privacy/finite_precision_learners.md#theorem-rgm-grid, Theorem RGM-GRID) is a hair
    # above Theorem 1: γ within 1e-5
    assert expected <= gamma <= expected * (1 + 1e-4)
    assert theorem1_epsilon(alpha, eta, gamma, d) <= eps
    assert grid_rgm_epsilon(alpha, eta, gamma, d, "theorem1") <= eps
    assert grid_rgm_epsilon(alpha, eta, gamma * (1 - 1e-6), d, "theorem1") > eps
    exact_gamma = gamma_for_step(eps, alpha, eta, d, "exact")
    assert exact_gamma < gamma  # the exact curve is tighter, so less noise is needed


def test_gamma_for_step_infeasible() -> None:
    with pytest.raises(ValueError, match="floor"):
        gamma_for_step(0.004, 2.0, 0.01, 10)  # floor ε_min = 0.00420584 (Hendrikx et al. 2024, Theorem 1)
    with pytest.raises(ValueError, match="floor"):
        gamma_for_step(10.0, 6.0, 0.1, 1)  # α ≥ α_max(0.1) = 5.76


def test_gamma_for_total_meets_target() -> None:
    sens = ridge_relative_sensitivity(100_000, 0.05, 1.0, 1.0)
    gamma = gamma_for_total(1.0, 1e-6, 50, sens, 8, DEFAULT_ORDERS)

    def converted(g: float) -> float:
        return epsilon_at_delta(
            scale_curve(step_curve(DEFAULT_ORDERS, sens, g, baseline_sigma(g, sens), 8, "theorem1"), 50), 1e-6
        )

    assert converted(gamma) <= 1.0
    assert converted(gamma * (1 - 1e-6)) > 1.0
    with pytest.raises(ValueError, match="unreachable"):
        gamma_for_total(1.0, 1e-6, 50, RelativeSensitivity(eta=0.05, r_rel=0.01), 8, DEFAULT_ORDERS)


# ----- curves -----------------------------------------------------------------------------------------------
def test_scale_curve_and_ceiling() -> None:
    sens = RelativeSensitivity(eta=0.01, r_rel=0.5)
    gamma = 1e-3
    one = step_curve(DEFAULT_ORDERS, sens, gamma, baseline_sigma(gamma, sens), 10, "theorem1")
    # the exact curve at α = 2, η = 1e-2 (0.1062570732, test_relative_gaussian.py), plus the grid's proven
    # correction (relative < 1e-5)
    assert 0.1062570732 <= one.at(2.0) <= 0.1062570732 * (1 + 1e-5)
    for alpha, value in zip(one.orders, one.values, strict=True):
        assert math.isinf(value) == (alpha >= alpha_max(0.01))
    forty = scale_curve(one, 40)
    for a, b in zip(one.values, forty.values, strict=True):
        assert (math.isinf(a) and math.isinf(b)) or 40 * a <= b <= 40 * a * (1 + 1e-12)
    assert scale_curve(one, 0) == RdpCurve.zero(DEFAULT_ORDERS)
    assert scale_curve(one, 3) <= scale_curve(one, 4)
    with pytest.raises(ValueError, match="steps"):
        scale_curve(one, -1)


# ----- the stopping rule and training -----------------------------------------------------------------------
def test_stop_rule_reads_released_iterates_only() -> None:
    rule = StopRule(tolerance=1.0, patience=2, min_steps=3)
    path = np.array([[0.0], [5.0], [5.1], [5.2], [5.3]])  # steps 5, 0.1, 0.1, 0.1 at τ = 1
    assert not rule.should_stop(path[:3], 1.0)  # only 2 steps done < min_steps
    assert rule.should_stop(path[:4], 1.0)
    assert not rule.should_stop(path[:4], 0.05)  # with τ = 0.05 the noisy gradient norm is 2 > 1
    assert not StopRule(1.0, patience=3).should_stop(path[:4], 1.0)  # the step 0 → 5 is in the window


def _ridge_data(seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2000, 5))
    x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
    y = np.clip(x @ rng.normal(size=5) * 0.4 + 0.1 * rng.normal(size=2000), -1, 1)
    return x, y


def test_training_converges_with_little_noise_and_reports_progress() -> None:
    x, y = _ridge_data()
    reg = 0.1
    a = x.T @ x / 2000 + reg * np.eye(5)
    exact = np.linalg.solve(a, x.T @ y / 2000)
    seen: list[float] = []
    config = RgmGdConfig("ridge", reg, 300, 1.0 / float(np.linalg.eigvalsh(a).max()), 1e-14, 1e-5)
    result = rgm_gd_train(config, x, y, Noise.seeded(0), seen.append)
    assert result.steps_run == 300
    assert not result.stopped_early
    assert len(seen) == 300
    assert seen[-1] == 1.0
    np.testing.assert_allclose(result.theta, exact, atol=1e-4)


def test_noise_follows_the_gradient() -> None:
    """From θ₀ far from the optimum the first released gradient's error is ~√(γ)‖∇f‖ per coordinate."""
    x, y = _ridge_data()
    reg, gamma, tau = 0.1, 0.04, 1.0
    errors = []
    for seed in range(200):
        config = RgmGdConfig("ridge", reg, 1, tau, gamma, 1e-6)
        theta1 = rgm_gd_train(config, x, y, Noise.seeded(seed)).theta
        errors.append(-theta1 / tau - full_gradient(np.zeros(5), x, y, "ridge", reg))
    per_coordinate_var = float(np.var(np.asarray(errors)))
    expected = gamma * float(np.sum(full_gradient(np.zeros(5), x, y, "ridge", reg) ** 2))
    assert per_coordinate_var == pytest.approx(expected, rel=0.15)  # 1000 draws: std of the ratio ≈ 0.045


def test_early_stop_is_charged_for_steps_run() -> None:
    ctx = _ctx()
    params = RgmGdParams(
        features=("a", "b", "g"),
        label="y",
        regularization=0.1,
        steps=50,
        gamma=1e-3,
        stop_tolerance=1e9,
        stop_min_steps=4,
    )
    mechanism = RgmGdMechanism()
    release = mechanism.run(params, ctx, _table(), Noise.seeded(0))
    worst = mechanism.worst_case(params, ctx)
    assert release.output["steps_run"] == 4
    assert release.output["stopped_early"] is True
    one = scale_curve(worst, 1)  # identity
    assert one == worst
    d = 5
    sens = ridge_relative_sensitivity_split(N, 0.1, 1.0, 1.0)
    step = step_curve(DEFAULT_ORDERS, sens, 1e-3, baseline_sigma(1e-3, sens), d, "theorem1")
    assert release.realized == scale_curve(step, 4)
    assert worst == scale_curve(step, 50)
    assert release.realized <= worst
    assert release.realized != worst


# ----- the service mechanism --------------------------------------------------------------------------------
def test_rgm_mechanism_release_and_catalog() -> None:
    assert isinstance(MECHANISMS["rgm.gd"], RgmGdMechanism)
    assert isinstance(MECHANISMS["dp_gd"], DpGdMechanism)
    mechanism = RgmGdMechanism()
    assert mechanism.long_running
    assert mechanism.progress_is_public
    ctx = _ctx()
    params = RgmGdParams.model_validate(
        {
            "features": ["a", "b", "g"],
            "label": "y",
            "regularization": 0.1,
            "steps": 20,
            "target_epsilon": 1.0,
            "target_alpha": 2.0,
            "return_iterates": True,
        }
    )
    seen: list[float] = []
    release = mechanism.run(params, ctx, _table(), Noise.seeded(1), progress=seen.append)
    out = release.output
    assert out["columns"] == ["a", "b", "g=u", "g=v", "(intercept)"]
    assert len(out["theta"]) == 5
    assert len(out["iterates"]) == 20
    assert out["iterates"][-1] == out["theta"]
    assert len(seen) == 20
    assert release.realized == mechanism.worst_case(params, ctx)
    assert release.realized.at(2.0) == pytest.approx(20 * 1.0, rel=1e-6)  # per-step target ε = 1 at α = 2
    assert release.realized.at(2.0) <= 20 * 1.0 * (1 + 1e-12)
    # the noise level is not released
    assert not any("var" in key or "norm" in key for key in out)


def test_rgm_total_target_and_affordable_gamma() -> None:
    ctx = _ctx()
    params = RgmGdParams(
        features=("a", "b"), label="y", regularization=0.5, steps=10, target_epsilon=5.0, target_delta=1e-5
    )
    mechanism = RgmGdMechanism()
    worst = mechanism.worst_case(params, ctx)
    assert epsilon_at_delta(worst, 1e-5) <= 5.0
    assert epsilon_at_delta(worst, 1e-5) > 4.99
    by_gamma = RgmGdParams(features=("a", "b"), label="y", regularization=0.5, steps=10, gamma=0.02)
    cap = mechanism.worst_case(by_gamma, ctx).at(2.0)
    best = best_affordable_cost(mechanism, by_gamma, ctx, lambda c: c.at(2.0) <= cap)
    assert best is not None
    assert best == pytest.approx(0.02, rel=1e-4)


def test_rgm_logistic_runs() -> None:
    ctx = _ctx()
    params = RgmGdParams(
        features=("a", "b"), label="c", model="logistic", regularization=0.1, steps=30, gamma=1e-3
    )
    release = RgmGdMechanism().run(params, ctx, _table(), Noise.seeded(2))
    x_coef = release.output["theta"][0]
    assert x_coef > 0  # label c is driven by a
    sens = logistic_relative_sensitivity(N, 0.1, 1.0)
    assert release.output["eta"] == sens.eta


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"model": "logistic"}, "label"),  # label y is numeric, not a classification label
        ({"model": "logistic", "task": "regression"}, "task"),
        ({"features": ("zz",)}, "features[0]"),
        ({"gamma": None, "target_epsilon": 1e-9, "target_alpha": 2.0}, "target_epsilon"),
    ],
)
def test_rgm_check_errors(changes: dict[str, object], field: str) -> None:
    base = {"features": ("a", "b"), "label": "y", "regularization": 0.1, "steps": 5, "gamma": 1e-3}
    params = RgmGdParams.model_validate({**base, **changes})
    with pytest.raises(ParamsError) as info:
        RgmGdMechanism().check(params, _ctx())
    assert info.value.field == field


def test_rgm_refuses_add_remove() -> None:
    params = RgmGdParams(features=("a",), label="y", regularization=0.1, steps=5, gamma=1e-3)
    with pytest.raises(ParamsError, match="replace_one"):
        RgmGdMechanism().worst_case(params, _ctx("add_remove"))


@pytest.mark.parametrize(
    "changes",
    [
        {"gamma": None},
        {"target_epsilon": 1.0},
        {"gamma": None, "target_epsilon": 1.0},
        {"gamma": None, "target_epsilon": 1.0, "target_alpha": 2.0, "target_delta": 1e-6},
        {"regularization": 0.0},
        {"steps": 0},
        {"regularization": math.nan},
        {"unknown": 1},
    ],
)
def test_rgm_params_validation(changes: dict[str, object]) -> None:
    base = {"features": ["a"], "label": "y", "regularization": 0.1, "steps": 5, "gamma": 1e-3}
    with pytest.raises(ValidationError):
        RgmGdParams.model_validate({**base, **changes})


def test_auto_step_size() -> None:
    assert auto_step_size("ridge", 0.1, 1.0, 0.01, 10) == pytest.approx(1 / (1.1 * 1.1))
    assert auto_step_size("logistic", 0.1, 2.0, 0.0, 3) == pytest.approx(1 / 1.1)


# ----- the dp_gd mechanism ----------------------------------------------------------------------------------
def test_dp_gd_mechanism_charges_and_releases() -> None:
    ctx = _ctx()
    params = DpGdParams(features=("a", "b"), label="c", steps=25, noise_multiplier=4.0, return_iterates=True)
    mechanism = DpGdMechanism()
    seen: list[float] = []
    release = mechanism.run(params, ctx, _table(), Noise.seeded(0), progress=seen.append)
    expected = dp_gd_curve(
        DpGdConfig("logistic", 0.01, 25, 1 / 0.26, 1.0, 4.0), "replace_one", DEFAULT_ORDERS
    )
    assert release.realized == expected
    assert release.realized == mechanism.worst_case(params, ctx)
    assert release.realized.at(2.0) == pytest.approx(25 * 2.0 / 32)
    assert len(release.output["iterates"]) == 25
    assert len(seen) == 25
    assert release.output["noise_std"] == 8.0
    assert release.output["theta"][0] > 0


def test_dp_gd_mechanism_add_remove_needs_hint() -> None:
    ctx = _ctx("add_remove")
    mechanism = DpGdMechanism()
    params = DpGdParams(features=("a",), label="y", model="ridge", steps=5, noise_multiplier=2.0)
    with pytest.raises(ParamsError) as info:
        mechanism.check(params, ctx)
    assert info.value.field == "n_hint"
    hinted = params.model_copy(update={"n_hint": 390})
    mechanism.check(hinted, ctx)
    release = mechanism.run(hinted, ctx, _table(), Noise.seeded(0))
    assert release.output["normaliser"] == 390.0
    assert release.output["noise_std"] == 2.0  # Δ = C under add_remove
    assert release.realized.at(2.0) == pytest.approx(5 * 2.0 / (2 * 4.0))
    with pytest.raises(ParamsError):
        mechanism.check(hinted, _ctx())  # n_hint is refused where n is public


def test_dp_gd_mechanism_target() -> None:
    params = DpGdParams(features=("a",), label="c", steps=40, target_epsilon=1.0, target_delta=1e-6)
    worst = DpGdMechanism().worst_case(params, _ctx())
    assert epsilon_at_delta(worst, 1e-6) <= 1.0
    assert epsilon_at_delta(worst, 1e-6) > 0.999
    with pytest.raises(ValidationError):
        DpGdParams(
            features=("a",), label="c", steps=4, noise_multiplier=1.0, target_epsilon=1.0, target_delta=1e-6
        )
    with pytest.raises(ParamsError):
        DpGdMechanism().check(params.model_copy(update={"model": "logistic", "task": "regression"}), _ctx())


# ----- the tighter ridge bound (derived) ------------------------------------------------------------------
def test_theta_bound_is_the_supremum() -> None:
    """‖θ*‖ ≤ B on random and extreme datasets, and B is attained in 1-D (x = min(√λ, X), y = Y)."""
    rng = np.random.default_rng(0)
    for reg, x_max in [(0.03, 1.0), (4.0, 1.0), (0.5, 2.0)]:
        bound = ridge_theta_bound(reg, x_max, 1.0)
        x = _unit_ball(rng.normal(size=(3000, 3, 2)) * rng.uniform(0.01, 3, size=(3000, 1, 1))) * x_max
        y = rng.choice([-1.0, 1.0], size=(3000, 3))
        a = np.einsum("bni,bnj->bij", x, x) / 3 + reg * np.eye(2)
        theta = np.linalg.solve(a, np.einsum("bni,bn->bi", x, y)[..., None] / 3)[..., 0]
        assert np.max(np.linalg.norm(theta, axis=1)) <= bound
        s = min(math.sqrt(reg), x_max)
        assert s / (s * s + reg) == pytest.approx(bound, rel=1e-12)  # attained by x_i = s·e₁, y_i = 1
    assert ridge_theta_bound(0.03, 1.0, 1.0) <= 1.0 * min(1.0 / 0.03, 1 / math.sqrt(0.03))


def test_split_bound_formula_and_dominance() -> None:
    sens = ridge_relative_sensitivity_split(1000, 0.1, 2.0, 3.0, split=3.0)
    b = 3.0 / (2 * math.sqrt(0.1))
    assert sens.eta == pytest.approx(2 * 4 / (0.1 * 1000), rel=1e-12)
    gap = ridge_gradient_gap_bound(0.1, 2.0, 3.0)
    assert gap < 2 * 2.0 * (2.0 * b + 3.0)  # tighter than the triangle inequality 2X(XB + Y)
    assert sens.r_rel == pytest.approx(math.sqrt(4 / 3) * gap / 1000, rel=1e-12)
    for n, reg, x_max in [(141_691, 0.03, 1.0), (50, 1.0, 0.5), (10, 10.0, 2.0)]:
        old = ridge_relative_sensitivity(n, reg, x_max, 1.0)
        new = ridge_relative_sensitivity_split(n, reg, x_max, 1.0)
        assert new.eta < old.eta
        assert new.r_rel < old.r_rel
    with pytest.raises(ValueError, match="split"):
        ridge_relative_sensitivity_split(10, 1.0, 1.0, 1.0, split=0.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("n", "d", "reg", "split"), [(3, 2, 0.01, 3.0), (4, 2, 0.1, 1.0), (6, 3, 1.0, 3.0), (5, 2, 10.0, 10.0)]
)
def test_split_bound_random_and_adversarial(n: int, d: int, reg: float, split: float) -> None:
    """The exact sup over θ of ‖∇f − ∇f′‖²/(η²‖∇f‖² + R²) (spectral norm of [M/η, c/R], the oracle of
    test_relative_gaussian.py) on 3,000 random pairs, then Nelder–Mead from the worst ones and the structured
    worst case (other records 0, x₀ ⟂ x₀′ at full norm, labels ±Y)."""
    rng = np.random.default_rng(n + 100 * d)
    sens = ridge_relative_sensitivity_split(n, reg, 1.0, 1.0, split)
    features, labels, new_row, new_label = random_batch(rng, 3000, n, d, 1.0, 1.0)
    _, m, c = pair_quantities(features, labels, new_row, new_label, reg)
    random_ratio = sup_ratio_over_theta(m, c, sens)
    assert np.max(random_ratio) <= 1.0

    def ratio(z: np.ndarray) -> float:
        xs = clip_rows(z[: n * d].reshape(1, n, d), 1.0)
        ys = np.clip(z[n * d : n * d + n], -1, 1)[None]
        new_x = clip_rows(z[n * d + n : n * d + n + d][None], 1.0)
        new_y = np.clip(z[-1:], -1, 1)
        _, mm, cc = pair_quantities(xs, ys, new_x, new_y, reg)
        return float(sup_ratio_over_theta(mm, cc, sens)[0])

    starts = [
        np.concatenate([features[i].ravel(), labels[i], new_row[i], new_label[i : i + 1]])
        for i in np.argsort(random_ratio)[-6:]
    ]
    structured = np.zeros(n * d + n + d + 1)
    structured[0], structured[n * d], structured[n * d + n + 1], structured[-1] = 1.0, 1.0, 1.0, -1.0
    best = ratio(structured)
    for z0 in [*starts, structured + 0.01 * rng.normal(size=structured.size)]:
        result = optimize.minimize(lambda z: -ratio(z), z0, method="Nelder-Mead", options={"maxiter": 3000})
        best = max(best, -float(result.fun))
    assert best <= 1.0
    assert best > 0.05


# ----- the benchmark's smoke run ----------------------------------------------------------------------------
@pytest.mark.slow
def test_benchmark_quick_smoke(tmp_path: Path) -> None:
    """``benchmarks/rgm_gd.py --quick`` runs, writes its JSON, and compares the methods at equal privacy."""
    out = tmp_path / "rgm_gd.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "rgm_gd.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["quick"] is True
    per_step = result["levels"]["per_step_alpha2_eps0.1"]["methods"]
    total = result["levels"]["total_eps1_delta1e-6"]["methods"]
    steps = result["setting"]["steps"]
    uncharged = {"nonprivate", "rgm_at_floor (not private)"}
    assert uncharged <= set(per_step)
    assert "dpgd_C=C_pub (public, never clips)" in per_step
    for name, method in per_step.items():
        if name not in uncharged:
            assert method["rdp_alpha2_total"] <= steps * 0.1 * (1 + 1e-9)
            assert method["rdp_alpha2_total"] >= steps * 0.1 * (1 - 1e-6)
    for name, method in total.items():
        if name not in uncharged:
            assert 0.999 < method["epsilon_at_1e-6"] <= 1.0
    for level in result["levels"].values():
        assert set(level["nogain"]) == {
            "dpgd_c_pub_beats_rgm",
            "rgm_at_floor_beats_best_dpgd",
            "noise_std_near_optimum",
        }
    assert result["setting"]["r_rel_floor_every_valid"] < result["setting"]["r_rel"]
    assert set(result["targets"]) == {
        "rgm_lower_excess_risk_than_best_clipped_dpgd",
        "rgm_wall_time_at_most_1.5x_nonprivate",
    }


def test_exact_bound_charges_less_for_the_same_gamma() -> None:
    ctx = _ctx()
    base = {"features": ("a", "b"), "label": "y", "regularization": 0.1, "steps": 7, "gamma": 1e-3}
    theorem1 = RgmGdMechanism().worst_case(RgmGdParams.model_validate(base), ctx)
    exact = RgmGdMechanism().worst_case(RgmGdParams.model_validate({**base, "bound": "exact"}), ctx)
    assert exact <= theorem1
    assert exact.at(2.0) < theorem1.at(2.0)
    finite = [a for a, v in zip(theorem1.orders, theorem1.values, strict=True) if math.isfinite(v)]
    assert finite == [a for a, v in zip(exact.orders, exact.values, strict=True) if math.isfinite(v)]


# ----- projection onto the public ball and the finiteness check ------------------------------------------
# (docs/privacy/gradient_descent.md#rgm-gd-projection)
def test_project_to_ball() -> None:
    rng = np.random.default_rng(12)
    for _ in range(500):
        d = int(rng.integers(1, 30))
        theta = rng.normal(size=d) * 10 ** rng.uniform(-300, 307)
        radius = float(10 ** rng.uniform(-5, 5))
        projected = project_to_ball(theta, radius)
        assert np.all(np.isfinite(projected))
        norm = float(np.linalg.norm(projected / np.max(np.abs(projected)))) * np.max(np.abs(projected))
        assert norm <= radius * (1 + (d + 4) * 2.0**-52)
        inside = float(np.max(np.abs(theta))) * float(np.linalg.norm(theta / np.max(np.abs(theta)))) <= radius
        if inside:
            np.testing.assert_array_equal(projected, theta)
        else:
            assert norm == pytest.approx(radius, rel=1e-12)
            cosine = float(projected @ (theta / np.max(np.abs(theta))))
            assert cosine > 0  # same direction
    np.testing.assert_array_equal(project_to_ball(np.zeros(3), 1.0), np.zeros(3))
    np.testing.assert_allclose(project_to_ball(np.array([1.7e308, 1.7e308]), 2.0), [2**0.5, 2**0.5])
    with pytest.raises(ValueError, match="finite"):
        project_to_ball(np.array([math.inf]), 1.0)


def test_theta_bound_contains_every_optimum() -> None:
    """r ≥ ‖θ*‖: ridge is ``ridge_theta_bound``; logistic X·Y/λ against solved optima (random and the
    separable extreme where every record pulls the same way) and the per-record gradient bound ‖∇ℓ_i‖ ≤ X."""
    assert theta_bound("ridge", 0.1, 2.0) == ridge_theta_bound(0.1, 2.0, 1.0)
    rng = np.random.default_rng(13)
    for reg, x_max in [(0.01, 1.0), (1.0, 2.0), (10.0, 0.5)]:
        bound = theta_bound("logistic", reg, x_max)
        assert bound >= x_max / reg
        worst = 0.0
        for trial in range(40):
            n, d = int(rng.integers(1, 6)), int(rng.integers(1, 4))
            x = _unit_ball(rng.normal(size=(n, d)) * 3) * x_max
            y = rng.choice([-1.0, 1.0], n)
            if trial % 4 == 0:  # every record pushes along e₁ at full norm
                x = np.zeros((n, d))
                x[:, 0] = x_max
                y = np.ones(n)
            best = optimize.minimize(
                lambda t, x=x, y=y, reg=reg: model_objective(t, x, y, "logistic", reg),
                np.zeros(d),
                jac=lambda t, x=x, y=y, reg=reg: full_gradient(t, x, y, "logistic", reg),
                method="BFGS",
                tol=1e-12,
            )
            worst = max(worst, float(np.linalg.norm(best.x)) / bound)
            theta = rng.normal(size=d) * 10 ** rng.uniform(-2, 3)
            scalars = -y / (1 + np.exp(y * (x @ theta)))
            assert np.max(np.abs(scalars) * np.linalg.norm(x, axis=1)) <= x_max * (1 + 1e-12)
        assert 0.01 < worst <= 1.0  # X·Y/λ is loose for small λ (θ* grows like log(1/λ) there)


@pytest.mark.parametrize("model", ["ridge", "logistic"])
def test_gradient_bound_on_the_ball(model: str) -> None:
    rng = np.random.default_rng(14)
    for reg, x_max in [(0.01, 1.0), (1.0, 3.0), (50.0, 0.2)]:
        radius = theta_bound(model, reg, x_max)  # type: ignore[arg-type]
        big_g = gradient_bound(model, reg, x_max, 1.0, radius)  # type: ignore[arg-type]
        worst = 0.0
        for _ in range(300):
            n, d = int(rng.integers(1, 5)), int(rng.integers(1, 4))
            u = rng.normal(size=d)
            theta = u / np.linalg.norm(u) * radius * rng.choice([1.0, rng.uniform()])
            x = np.outer(np.ones(n), u / np.linalg.norm(u)) * x_max  # rows aligned with θ: the extreme case
            if rng.random() < 0.5:
                x = _unit_ball(rng.normal(size=(n, d)) * 3) * x_max
            y = -np.ones(n) if model == "ridge" else rng.choice([-1.0, 1.0], n)
            g = full_gradient(theta, x, y, model, reg)  # type: ignore[arg-type]
            worst = max(worst, float(np.linalg.norm(g)) / big_g)
        assert 0.5 < worst <= 1.0 + 1e-12


def _service_params(**changes: object) -> RgmGdParams:
    base: dict[str, object] = {"features": ("a", "b"), "label": "y", "regularization": 0.1, "steps": 5}
    if not any(k in changes for k in ("target_epsilon", "gamma")):
        base["gamma"] = 1e-3
    return RgmGdParams.model_validate({**base, **changes})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"regularization": 1e-300}, "regularization"),  # r = 1/(2√λ) = 5e149: d·(2r)² > 1e300
        ({"model": "logistic", "label": "c", "regularization": 1e-296, "row_norm": 1.0}, "regularization"),
        ({"regularization": 1e-280, "row_norm": 1e6, "gamma": 1.0}, "gamma"),  # γG² = 2.5e303
        ({"regularization": 1e-250, "row_norm": 1e6, "gamma": 1e12, "step_size": 1e6}, "step_size"),
    ],
)
def test_admission_refuses_parameters_that_could_overflow(changes: dict[str, object], field: str) -> None:
    params = _service_params(**changes)
    with pytest.raises(ParamsError) as info:
        RgmGdMechanism().check(params, _ctx())
    assert info.value.field == field
    with pytest.raises(ParamsError):
        RgmGdMechanism().worst_case(params, _ctx())


def test_step_size_that_used_to_diverge_now_stays_in_the_ball() -> None:
    """The service-level path that used to diverge (step_size = 1e6 from θ₀ = 0): admitted, every released
    iterate in the public ball, all steps run; the radius is released (public)."""
    params = _service_params(step_size=1e6, steps=30, return_iterates=True)
    release = RgmGdMechanism().run(params, _ctx(), _table(), Noise.seeded(3))
    radius = release.output["radius"]
    assert radius == theta_bound("ridge", 0.1, 1.0)
    iterates = np.asarray(release.output["iterates"])
    assert iterates.shape == (30, 3)
    assert np.all(np.isfinite(iterates))
    assert np.max(np.linalg.norm(iterates, axis=1)) <= radius * (1 + 1e-12)


@pytest.mark.slow
def test_no_data_dependent_failure_at_extreme_admitted_parameters() -> None:
    """Random admitted configurations at the edges of the parameter ranges (X up to 1e6, λ down to 1e-250,
    γ up to 1e12, τ up to 1e6, huge public starts) on extreme neighbouring datasets (rows at full norm X,
    aligned with θ₀ or not, labels ±Y): every run completes, finite, inside the ball."""
    rng = np.random.default_rng(15)
    ran = 0
    for _ in range(400):
        model = "ridge" if rng.random() < 0.5 else "logistic"
        reg = float(10 ** rng.uniform(-250, 6))
        x_max = float(10 ** rng.uniform(-2, 6))
        gamma = float(10 ** rng.uniform(-8, 12))
        n, d = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        sens = relative_sensitivity(model, n, reg, x_max)  # type: ignore[arg-type]
        try:
            config = RgmGdConfig(
                model,
                reg,
                3,
                float(10 ** rng.uniform(-3, 6)),
                gamma,
                baseline_sigma(gamma, sens),  # type: ignore[arg-type]
                feature_bound=x_max,
            )
        except ValueError:
            continue  # σ overflowed or underflowed: refused at admission (gamma), data never read
        if finiteness_problem(config, n, d) is not None:
            continue
        unit = rng.normal(size=d)
        direction = unit / np.linalg.norm(unit)
        theta0 = direction * 10 ** rng.uniform(0, 300)
        for x in (np.outer(np.ones(n), direction) * x_max, -np.outer(np.ones(n), direction) * x_max):
            for label in (1.0, -1.0):
                result = rgm_gd_train(config, x, np.full(n, label), Noise.seeded(0), theta0=theta0)
                assert result.steps_run == 3
                assert np.all(np.isfinite(result.iterates))
                norms = np.linalg.norm(result.iterates, axis=1)
                assert np.max(norms) <= config.projection_radius * (1 + 1e-9)
        ran += 1
    assert ran > 5  # most random extremes are refused at admission (public), and none of the rest fails


def test_bounded_records_is_a_per_record_map_onto_the_declared_bounds() -> None:
    x = np.array([[3.0, 4.0], [0.3, 0.4], [1e300, 1e300], [math.inf, 0.0], [math.nan, 1.0], [0.0, 0.0]])
    y = np.array([2.0, -0.5, -math.inf, math.nan, 1.0, -3.0])
    rows, labels = bounded_records(x, y, 1.0, 1.0)
    np.testing.assert_allclose(rows[0], [0.6, 0.8], rtol=1e-15)
    np.testing.assert_array_equal(rows[1], x[1])
    np.testing.assert_allclose(rows[2], [2**-0.5, 2**-0.5], rtol=1e-15)
    np.testing.assert_array_equal(rows[3:], np.zeros((3, 2)))
    np.testing.assert_array_equal(labels, [1.0, -0.5, -1.0, 0.0, 1.0, -1.0])
    # non-finite records do not make training fail: the same run on D and on D with a broken record
    sens = relative_sensitivity("ridge", 6, 0.5, 1.0)
    config = RgmGdConfig("ridge", 0.5, 4, 0.5, 1e-2, baseline_sigma(1e-2, sens))
    result = rgm_gd_train(config, x, y, Noise.seeded(0))
    assert np.all(np.isfinite(result.iterates))


def test_dp_gd_mechanism_projection_radius_and_max_norm() -> None:
    ctx = _ctx()
    mechanism = DpGdMechanism()
    base = {"features": ("a", "b"), "label": "c", "steps": 10, "noise_multiplier": 2.0}
    default = mechanism.run(DpGdParams.model_validate(base), ctx, _table(), Noise.seeded(0))
    assert default.output["radius"] == default_radius("logistic", 0.01, 1.0, 1.0)
    assert default.output["radius"] >= 1.0 / 0.01
    unregularised = DpGdParams.model_validate({**base, "regularization": 0.0})
    with pytest.raises(ParamsError) as info:
        mechanism.check(unregularised, ctx)
    assert info.value.field == "max_norm"
    bounded = unregularised.model_copy(update={"max_norm": 3.0, "step_size": 1e6, "return_iterates": True})
    mechanism.check(bounded, ctx)
    release = mechanism.run(bounded, ctx, _table(), Noise.seeded(1))
    assert release.output["radius"] == 3.0
    iterates = np.asarray(release.output["iterates"])
    assert np.all(np.isfinite(iterates))
    assert np.max(np.linalg.norm(iterates, axis=1)) <= 3.0 * (1 + 1e-12)
    assert release.realized == mechanism.worst_case(bounded, ctx)  # projection changes no charge
    mechanism.check(unregularised.model_copy(update={"max_norm": 1e12, "step_size": 1e6}), ctx)  # finite
    tiny = DpGdParams.model_validate({**base, "model": "ridge", "label": "y", "regularization": 1e-300})
    with pytest.raises(ParamsError) as info:
        mechanism.check(tiny, ctx)
    assert info.value.field == "regularization"


# ----- Proposition NOGAIN (docs/privacy/gradient_descent.md#proposition-nogain) ---------------------------
# How far any RGM-GD can go against clipped DP-GD.
def _witness_gap(n: int, reg: float, x_max: float, y_max: float, a: float, orthogonal: bool) -> float:
    """n·‖∇f(θ*; D) − ∇f(θ*; D′)‖ on the explicit datasets of ``ridge_r_rel_floor``'s docstring, with θ*
    solved directly and ∇f(θ*; D) = 0 checked (an oracle independent of the closed form)."""
    s = min(math.sqrt(reg), x_max)
    x = np.zeros((n, 2))
    x[1:, 0] = s
    y = np.full(n, y_max)
    if orthogonal:
        x[0], y[0], new_row, new_label = (x_max, 0.0), -y_max, np.array([0.0, x_max]), y_max
    else:
        b = math.sqrt(max(x_max * x_max - a * a, 0.0))
        x[0], y[0], new_row, new_label = (a, b), -y_max, np.array([a, -b]), -y_max
    theta = np.linalg.solve(x.T @ x / n + reg * np.eye(2), x.T @ y / n)
    assert np.linalg.norm(ridge_gradient(theta, x, y, reg)) < 1e-12
    x2, y2 = x.copy(), y.copy()
    x2[0], y2[0] = new_row, new_label
    return n * float(np.linalg.norm(ridge_gradient(theta, x, y, reg) - ridge_gradient(theta, x2, y2, reg)))


@pytest.mark.parametrize(
    ("n", "reg", "x_max", "y_max"),
    [(50, 0.03, 1.0, 1.0), (2000, 0.1, 1.0, 1.0), (40, 4.0, 1.0, 1.0), (300, 0.03, 2.0, 0.5)],
)
def test_r_rel_floor_is_attained_by_explicit_neighbours(
    n: int, reg: float, x_max: float, y_max: float
) -> None:
    """Proposition NOGAIN (a): every witness is an explicit neighbouring pair whose gradient gap at θ*(D) is
    what the floor says (so any valid R_rel must be at least the floor), and rgm.gd's R_rel is above it."""
    floor = ridge_r_rel_floor(n, reg, x_max, y_max)
    gaps = [_witness_gap(n, reg, x_max, y_max, a, False) for a in np.linspace(0.0, x_max, 101)]
    gaps.append(_witness_gap(n, reg, x_max, y_max, x_max, True))
    assert max(gaps) <= n * floor * (1 + 1e-7)  # the floor is the max over a finer grid of the same family
    assert max(gaps) >= 0.995 * n * floor
    assert relative_sensitivity("ridge", n, reg, x_max, y_max).r_rel >= floor
    assert ridge_relative_sensitivity(n, reg, x_max, y_max).r_rel >= floor


def test_r_rel_floor_at_the_benchmark_scale() -> None:
    """At N = 141 691, λ = 0.03, X = Y = 1: n·R_floor = 4.378 > 2c = 2.97 (the best clipping threshold of the
    benchmark), so no valid relative sensitivity brings RGM-GD's noise floor down to DP-GD's with C = c."""
    n = 141_691
    floor = ridge_r_rel_floor(n, 0.03, 1.0, 1.0)
    assert n * floor == pytest.approx(4.3779, abs=1e-3)
    assert _witness_gap(n, 0.03, 1.0, 1.0, 0.626, False) == pytest.approx(n * floor, rel=1e-6)
    with pytest.raises(ValueError, match="n_rows"):
        ridge_r_rel_floor(1, 0.03, 1.0, 1.0)


@pytest.mark.parametrize("bound", ["theorem1", "exact"])
@pytest.mark.parametrize("model", ["ridge", "logistic"])
def test_rgm_step_costs_at_least_a_gaussian_with_sensitivity_r_rel(model: str, bound: str) -> None:
    """Proposition NOGAIN (b): with σ² ≥ γR_rel²/η² the RGM step curve is ≥ αR_rel²/(2σ²) at every order,
    the curve of a Gaussian mechanism with sensitivity R_rel and standard deviation σ."""
    for n, reg, x_max, d in [(141_691, 0.03, 1.0, 22), (500, 1.0, 1.0, 3), (10_000, 0.1, 2.0, 8)]:
        sens = relative_sensitivity(model, n, reg, x_max)  # type: ignore[arg-type]
        for epsilon, alpha in [(0.1, 2.0), (1.0, 8.0), (0.01, 1.5)]:
            try:
                gamma = gamma_for_step(epsilon, alpha, sens.eta, d, bound)  # type: ignore[arg-type]
            except ValueError:
                continue  # below the norm-leak floor: no RGM reaches this target at all
            sigma = baseline_sigma(gamma, sens)
            curve = step_curve(DEFAULT_ORDERS, sens, gamma, sigma, d, bound)  # type: ignore[arg-type]
            gaussian = RdpCurve.gaussian(sens.r_rel, sigma, DEFAULT_ORDERS)
            assert all(r >= g for r, g in zip(curve.values, gaussian.values, strict=True))


@pytest.mark.parametrize("model", ["ridge", "logistic"])
def test_never_clipping_threshold(model: str) -> None:
    """Proposition NOGAIN (c): on the ball of radius ``theta_bound`` no per-record gradient exceeds C_pub
    (attained for ridge by x = −X·θ/‖θ‖, y = Y at ‖θ‖ = B), clipped DP-GD with C_pub clips nothing there, and
    for logistic its replace-one sensitivity 2C_pub/n is below rgm.gd's R_rel."""
    rng = np.random.default_rng(21)
    for reg, x_max in [(0.03, 1.0), (1.0, 2.0), (10.0, 0.5)]:
        c_pub = never_clipping_threshold(model, reg, x_max)  # type: ignore[arg-type]
        radius = theta_bound(model, reg, x_max)  # type: ignore[arg-type]
        n, d = 200, 3
        for n_rows in (10, 141_691):
            r_rel = relative_sensitivity(model, n_rows, reg, x_max).r_rel  # type: ignore[arg-type]
            if model == "logistic":  # (c) holds for logistic; for ridge the diameter bound can beat 2C_pub/n
                assert 2 * c_pub / n_rows < r_rel
        worst = 0.0
        for _ in range(50):
            u = rng.normal(size=d)
            theta = u / np.linalg.norm(u) * radius * rng.choice([1.0, rng.uniform()])
            x = _unit_ball(rng.normal(size=(n, d)) * 3) * x_max
            x[0] = -x_max * theta / np.linalg.norm(theta)
            y = rng.choice([-1.0, 1.0], n)
            y[0] = 1.0
            loss = "squared" if model == "ridge" else "logistic"
            per_record = _per_record_gradients(theta, x, y, loss)
            norms = np.linalg.norm(per_record, axis=1)
            worst = max(worst, float(np.max(norms)) / c_pub)
            assert np.max(norms) <= c_pub
            clipped = clipped_gradient_sum(
                theta, x[1:], y[1:], loss, c_pub
            )  # the extreme row 0 sits on C_pub
            # the exact grid sum quantises rows (2^-14) and terms (C·2^-23): close, not bit-equal
            assert np.allclose(clipped, per_record[1:].sum(axis=0), rtol=1e-3, atol=1e-3 * c_pub)
        assert worst > (0.999 if model == "ridge" else 0.5)


def _per_record_gradients(theta: np.ndarray, x: np.ndarray, y: np.ndarray, loss: str) -> np.ndarray:
    margin = x @ theta
    scalar = margin - y if loss == "squared" else -y / (1.0 + np.exp(y * margin))
    result: np.ndarray = x * scalar[:, None]
    return result


# ----- the gradient-gap bound of Lemma RIDGE-SPLIT step 4′ ------------------------------------------------
# (docs/privacy/gradient_descent.md#lemma-ridge-split)
def _symmetric_diameter(reg: float, x_max: float, y_max: float) -> float:
    """2·max_ψ R(ψ)·sin ψ, R(ψ) = X(Y + XB cos ψ): the distance between a point of the gradient set and its
    reflection, in closed form (cos ψ* = (−1 + √(1 + 8β²))/(4β), β = XB/Y). A lower bound on the diameter."""
    beta = x_max * ridge_theta_bound(reg, x_max, y_max) / y_max
    cos = (-1 + math.sqrt(1 + 8 * beta * beta)) / (4 * beta)
    return 2 * x_max * y_max * (1 + beta * cos) * math.sqrt(1 - cos * cos)


SETTINGS = [
    (0.03, 1.0, 1.0),
    (1.0, 1.0, 1.0),
    (10.0, 0.5, 1.0),
    (0.1, 2.0, 3.0),
    (1e-4, 1.0, 1.0),
    (0.5, 0.3, 2.0),
]


@pytest.mark.parametrize(("reg", "x_max", "y_max"), SETTINGS)
def test_gradient_gap_bound_is_tight_and_above_the_closed_form(
    reg: float, x_max: float, y_max: float
) -> None:
    """The certified grid bound sits between the symmetric closed form (a diameter that is attained) and that
    value plus the grid's Lipschitz pad: the pad is the only slack."""
    gap = ridge_gradient_gap_bound(reg, x_max, y_max)
    radius = ridge_theta_bound(reg, x_max, y_max)
    closed = max(_symmetric_diameter(reg, x_max, y_max), 2 * x_max * y_max)
    pad = (x_max * (y_max + x_max * radius) + x_max * x_max * radius) * math.pi / 2048
    assert closed <= gap <= closed + pad * (1 + 1e-6) + 1e-12
    assert gap <= 2 * x_max * (x_max * radius + y_max) * (1 + 1e-12)
    with pytest.raises(ValueError, match="grid"):
        ridge_gradient_gap_bound(reg, x_max, y_max, grid=4)


@pytest.mark.slow
@pytest.mark.parametrize(("reg", "x_max", "y_max"), SETTINGS)
def test_gradient_gap_bound_covers_every_pair_of_records(reg: float, x_max: float, y_max: float) -> None:
    """‖x r − x′r′‖ ≤ D for per-record gradients at θ anywhere in the ball: random records (inside the ball
    and on its sphere, labels in [−Y, Y] and at ±Y), records at the worst angle to θ, and θ of every norm up
    to B (the convexity step); the worst pair comes within 1% of D."""
    rng = np.random.default_rng(31)
    radius = ridge_theta_bound(reg, x_max, y_max)
    gap = ridge_gradient_gap_bound(reg, x_max, y_max)
    worst = 0.0
    for norm in [0.0, *np.linspace(0.05, 1.0, 20) * radius]:
        d = 3
        theta = np.zeros(d)
        theta[0] = norm
        x = _unit_ball(rng.normal(size=(1500, d)) * 2) * x_max
        x[:500] *= x_max / np.linalg.norm(x[:500], axis=1, keepdims=True)  # on the sphere
        psi = np.linspace(0, math.pi, 500)
        x[500:1000] = x_max * np.stack([np.cos(psi), np.sin(psi), np.zeros(500)], axis=1)  # every angle to θ
        y = rng.uniform(-y_max, y_max, size=1500)
        y[:1000] = -y_max * np.sign(rng.normal(size=1000))
        y[500:1000] = -y_max
        # the short records that maximise s(Y − s‖θ‖|cos ψ|) on the far side (they broke an earlier bound)
        if norm > 0:
            far = np.linspace(0.5 * math.pi, math.pi, 300)
            short = np.minimum(y_max / (2 * norm * np.maximum(-np.cos(far), 1e-12)), x_max)
            x[1000:1300] = short[:, None] * np.stack([np.cos(far), np.sin(far), np.zeros(300)], axis=1)
            y[1000:1300] = -y_max
        grads = x * (x @ theta - y)[:, None]
        flipped = grads.copy()
        flipped[:, 1] *= -1  # the mirror images are gradients too (x with its second coordinate negated)
        both = np.vstack([grads, flipped])
        sq = np.sum(both * both, axis=1)
        distances = np.sqrt(np.maximum(sq[:, None] + sq[None, :] - 2 * both @ both.T, 0.0))
        worst = max(worst, float(np.max(distances)))
    assert worst <= gap
    assert worst >= 0.99 * gap


def test_gradient_gap_bound_falls_back_to_the_triangle_inequality_on_overflow() -> None:
    """Squares of the grid points overflow (X²B ≈ 5e249): the bound is the (finite) triangle inequality, never
    a NaN or a value below it."""
    radius = ridge_theta_bound(1e-100, 1e100, 1.0)
    triangle = 2 * 1e100 * (1e100 * radius + 1.0)
    assert ridge_gradient_gap_bound(1e-100, 1e100, 1.0) == pytest.approx(triangle, rel=1e-12)
    assert ridge_gradient_gap_bound(0.03, 0.0, 1.0) == 0.0
    with pytest.raises(ValueError, match="normal float range"):
        ridge_gradient_gap_bound(1.0, 1e-162, 1e-162)  # X·Y underflows
    with pytest.raises(ValueError, match="grid"):
        ridge_gradient_gap_bound(1.0, 1.0, 1.0, grid=math.inf)  # type: ignore[arg-type]


def test_gradient_gap_bound_covers_short_records_on_the_far_side() -> None:
    """The counterexample to the first radial bound X(Y + X‖θ‖cos ψ)₊: at θ = B·e₁ (λ = 0.03,
    X = Y = 1) the record x = −(Y/(2B))·e₁, y = −Y has gradient −Y²/(4B)·e₁ ≠ 0 at ψ = π, where that bound
    is 0. Its distance to every extreme gradient stays ≤ D."""
    radius = ridge_theta_bound(0.03, 1.0, 1.0)
    theta = np.array([radius, 0.0])
    short = np.array([-1.0 / (2 * radius), 0.0])
    g_short = short * (short @ theta + 1.0)
    assert g_short[0] == pytest.approx(-1.0 / (4 * radius))
    psi = np.linspace(0, math.pi, 2001)
    full = np.stack([np.cos(psi), np.sin(psi)], axis=1)
    extremes = full * (full @ theta + 1.0)[:, None]  # records at full norm, y = −1
    assert float(np.max(np.linalg.norm(extremes - g_short, axis=1))) <= ridge_gradient_gap_bound(
        0.03, 1.0, 1.0
    )


# ===== RGM-GD / DP-GD privacy (docs/privacy/gradient_descent.md#gradient-descent) =========================
# With their own oracles and adversarial searches (independent of the helpers above):
# * Lemma RIDGE-SPLIT holds **uniformly in θ** (no ball restriction on the iterate is needed): the exact sup
#   over θ of ‖∇f_D(θ) − ∇f_D′(θ)‖²/(η²‖∇f_D(θ)‖² + R_rel²) is σ_max([M A⁻¹/(nη), c/(nR_rel)])², bounded by
#   ‖MA⁻¹‖²/(nη)² + ‖c‖²/(nR_rel)² ≤ 1/(1+κ) + κ/(1+κ) = 1; checked by Nelder–Mead over all records, labels
#   and the replacement (both branches of ``ridge_theta_bound``), and at huge θ directly.
# * Lemma LOG is valid, and trivially so: ‖∇ℓ_i‖ ≤ X for the logistic loss, so ‖∇f_D − ∇f_D′‖ ≤ 2X/n and the
#   ratio is ≤ 4/12 = 1/3 for every θ without the η term (the η term is never needed: the absolute
#   sensitivity 2X/n already gives the plain Gaussian mechanism).
# * DP-GD: curve T·α/(2z²) exactly (up to padding), calibration conservative on the converted grid.
# * realized ≤ worst case for every possible T_run; the stopping rule only sees released iterates.
# * No data-dependent failure (docs/privacy/gradient_descent.md#rgm-gd-projection). The RGM sampler used to
#   raise on a variance overflow, a decision that read the secret gradient norm ‖∇f(θ_t; D)‖: with the same
#   public θ_t, D failed and its neighbour D′ did not, and public progress showed the step. Likewise dp_gd's
#   clipped sum was NaN for D and finite for D′ at a huge public θ (∞ residual × 0 clip factor). Now iterates
#   are projected onto a public ball (post-processing), a public finiteness check runs at admission and in the
#   training loops, and the clipped sum's per-record terms are finite with norm ≤ C for every θ. The two
#   "demo" tests run the pairs that used to fail and pin that neither fails now.


# ----- ridge: exact sup over θ (own oracle) ------------------------------------------------------------
def _to_ball(u: np.ndarray, radius: float) -> np.ndarray:
    norms = np.linalg.norm(u, axis=-1, keepdims=True)
    result: np.ndarray = radius * np.tanh(norms) * u / np.maximum(norms, 1e-300)
    return result


def _ridge_parts(
    x: np.ndarray, y: np.ndarray, xp: np.ndarray, yp: float, reg: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """P = (x₀x₀ᵀ − x₀′x₀′ᵀ)A⁻¹ and c = x₀r₀ − x₀′r₀′ with n(∇f − ∇f′)(θ) = P∇f(θ) + c."""
    n, d = x.shape
    a = x.T @ x / n + reg * np.eye(d)
    theta_star = np.linalg.solve(a, x.T @ y / n)
    p = (np.outer(x[0], x[0]) - np.outer(xp, xp)) @ np.linalg.inv(a)
    c = x[0] * (x[0] @ theta_star - y[0]) - xp * (xp @ theta_star - yp)
    return p, c, theta_star


def _ridge_sup_ratio(
    x: np.ndarray, y: np.ndarray, xp: np.ndarray, yp: float, reg: float, sens: RelativeSensitivity
) -> float:
    n = x.shape[0]
    p, c, _ = _ridge_parts(x, y, xp, yp, reg)
    k = np.hstack([p / (n * sens.eta), (c / (n * sens.r_rel))[:, None]])
    return float(np.linalg.norm(k, 2) ** 2)


def test_ridge_identity_against_direct_gradients() -> None:
    """The identity behind Lemma RIDGE-SPLIT, for arbitrary θ (including far outside any ball)."""
    rng = np.random.default_rng(11)
    for _ in range(50):
        n, d = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        x = _to_ball(rng.normal(size=(n, d)), 1.0)
        y = rng.uniform(-1, 1, n)
        xp, yp = _to_ball(rng.normal(size=d), 1.0), float(rng.uniform(-1, 1))
        x2, y2 = x.copy(), y.copy()
        x2[0], y2[0] = xp, yp
        theta = rng.normal(size=d) * 10 ** rng.uniform(-2, 6)
        g, g2 = (full_gradient(theta, a, b, "ridge", 0.3) for a, b in ((x, y), (x2, y2)))
        p, c, _ = _ridge_parts(x, y, xp, yp, 0.3)
        np.testing.assert_allclose(n * (g - g2), p @ g + c, rtol=1e-8, atol=1e-9 * (1 + np.abs(g).max()))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("n", "d", "reg", "x_max"),
    [
        (1, 1, 0.01, 1.0),
        (2, 2, 0.1, 1.0),
        (3, 2, 1.0, 1.0),
        (4, 1, 10.0, 1.0),
        (2, 2, 4.0, 0.5),
        (6, 2, 0.5, 3.0),
    ],
)
def test_ridge_split_adversarial(n: int, d: int, reg: float, x_max: float) -> None:
    """Nelder–Mead over every record, label and the replacement: the sup over θ stays ≤ 1 (and ≤ the
    analytic 1/(1+κ) + κ/(1+κ) decomposition)."""
    sens = ridge_relative_sensitivity_split(n, reg, x_max, 1.0, 3.0)
    bound_b = ridge_theta_bound(reg, x_max, 1.0)
    rng = np.random.default_rng(1000 * n + 10 * d + int(reg * 10))

    def unpack(z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        xs = _to_ball(z[: (n + 1) * d].reshape(n + 1, d), x_max)
        ys = np.tanh(z[(n + 1) * d :])
        return xs[:n], ys[:n], xs[n], float(ys[n])

    def objective(z: np.ndarray) -> float:
        return -_ridge_sup_ratio(*unpack(z), reg, sens)

    best = 0.0
    for _ in range(4):
        z0 = rng.normal(size=(n + 1) * (d + 1)) * rng.choice([0.5, 2.0, 5.0])
        res = optimize.minimize(objective, z0, method="Nelder-Mead", options={"maxiter": 800})
        x, y, xp, yp = unpack(res.x)
        p, c, theta_star = _ridge_parts(x, y, xp, yp, reg)
        assert np.linalg.norm(theta_star) <= bound_b * (1 + 1e-12)
        assert np.linalg.norm(p, 2) <= x_max**2 / reg * (1 + 1e-9)
        assert np.linalg.norm(c) <= 2 * x_max * (x_max * bound_b + 1.0) * (1 + 1e-9)
        best = max(best, -res.fun)
    assert 0.05 < best <= 1.0


def test_ridge_bound_holds_at_huge_theta() -> None:
    """No ‖θ‖ ≤ B restriction: the GD iterates may be anywhere (B bounds θ*, not θ_t)."""
    rng = np.random.default_rng(5)
    n, d, reg = 3, 2, 0.05
    sens = relative_sensitivity("ridge", n, reg, 1.0)
    worst = 0.0
    for _ in range(2000):
        x = _to_ball(rng.normal(size=(n, d)) * 3, 1.0)
        y = rng.uniform(-1, 1, n)
        x2, y2 = x.copy(), y.copy()
        x2[0], y2[0] = _to_ball(rng.normal(size=d) * 3, 1.0), rng.uniform(-1, 1)
        theta = rng.normal(size=d) * 10 ** rng.uniform(0, 8)
        g, g2 = full_gradient(theta, x, y, "ridge", reg), full_gradient(theta, x2, y2, "ridge", reg)
        worst = max(worst, float(np.sum((g - g2) ** 2) / (sens.eta**2 * np.sum(g**2) + sens.r_rel**2)))
    assert worst <= 1.0


# ----- logistic ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "d", "reg", "x_max"), [(1, 1, 0.01, 1.0), (2, 2, 1.0, 2.0), (5, 3, 100.0, 0.5)]
)
def test_logistic_difference_is_absolutely_bounded(n: int, d: int, reg: float, x_max: float) -> None:
    """‖∇f_D − ∇f_D′‖ ≤ 2X/n for every θ, hence ratio ≤ (2X/n)²/R_rel² = 1/3 whatever η is."""
    sens = logistic_relative_sensitivity(n, reg, x_max)
    rng = np.random.default_rng(n + d)
    worst = 0.0
    for _ in range(1500):
        x = _to_ball(rng.normal(size=(n, d)) * 3, x_max)
        y = rng.choice([-1.0, 1.0], n)
        x2, y2 = x.copy(), y.copy()
        x2[0], y2[0] = _to_ball(rng.normal(size=d) * 3, x_max), -y[0]
        theta = rng.normal(size=d) * 10 ** rng.uniform(-2, 4)
        g, g2 = full_gradient(theta, x, y, "logistic", reg), full_gradient(theta, x2, y2, "logistic", reg)
        diff = float(np.linalg.norm(g - g2))
        assert diff <= 2 * x_max / n * (1 + 1e-12)
        worst = max(worst, diff**2 / (sens.eta**2 * float(np.sum(g**2)) + sens.r_rel**2))
    assert worst <= 1 / 3 + 1e-12


# ----- DP-GD ------------------------------------------------------------------------------------------------
def test_dp_gd_calibration_is_conservative_on_the_charged_curve() -> None:
    rng = np.random.default_rng(2)
    grids = [DEFAULT_ORDERS, (1.5, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0), (1.01, 1.1, 256.0, 1000.0)]
    checked = 0
    for i in range(300):
        eps, delta = float(10 ** rng.uniform(-2, 3)), float(10 ** rng.uniform(-12, -1))
        steps, grid = int(rng.integers(1, 10_001)), grids[i % 3]
        try:
            z = noise_multiplier_for(eps, delta, steps, grid)
        except ValueError:
            continue
        for neighboring in ("replace_one", "add_remove"):
            config = DpGdConfig("logistic", 0.0, steps, 1.0, float(10 ** rng.uniform(-3, 3)), z, neighboring)
            curve = dp_gd_curve(config, neighboring, grid)
            assert epsilon_at_delta(curve, delta) <= eps
            for alpha, value in zip(curve.orders, curve.values, strict=True):
                assert value >= steps * alpha / (2 * z * z)
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("loss", ["logistic", "squared"])
def test_dp_gd_clipped_sum_neighbour_distance(loss: str) -> None:
    """Replace-one moves the clipped sum by ≤ 2C, add/remove by ≤ C, whatever the rows and labels."""
    rng = np.random.default_rng(4)
    clip = 0.7
    for _ in range(300):
        n, d = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        x = rng.normal(size=(n, d)) * 10 ** rng.uniform(-3, 3)
        y = rng.choice([-1.0, 1.0], n) if loss == "logistic" else rng.normal(size=n) * 100
        theta = rng.normal(size=d) * 10 ** rng.uniform(-2, 3)
        s = clipped_gradient_sum(theta, x, y, loss, clip)  # type: ignore[arg-type]
        x2, y2 = x.copy(), y.copy()
        x2[0], y2[0] = rng.normal(size=d) * 1e3, -y[0]
        s2 = clipped_gradient_sum(theta, x2, y2, loss, clip)  # type: ignore[arg-type]
        assert np.linalg.norm(s - s2) <= 2 * clip * (1 + 1e-12)
        if n > 1:
            s3 = clipped_gradient_sum(theta, x[1:], y[1:], loss, clip)  # type: ignore[arg-type]
            assert np.linalg.norm(s - s3) <= clip * (1 + 1e-12)


# ----- RGM-GD charges ------------------------------------------------------------------------------------
def test_realized_never_exceeds_worst_for_any_stopping_time() -> None:
    sens = relative_sensitivity("ridge", 1000, 0.1, 1.0)
    gamma = 0.01
    step = step_curve(DEFAULT_ORDERS, sens, gamma, baseline_sigma(gamma, sens), 3, "theorem1")
    assert any(math.isinf(v) for v in step.values) or all(math.isfinite(v) for v in step.values)
    for steps in (1, 2, 7, 100):
        worst = scale_curve(step, steps)
        for run in range(1, steps + 1):
            realized = scale_curve(step, run)
            assert realized <= worst
            for v1, vt in zip(step.values, realized.values, strict=True):
                assert vt >= run * v1 or math.isinf(v1)


def test_stop_rule_sees_only_released_prefix() -> None:
    seen: list[np.ndarray] = []

    class Spy(StopRule):
        def should_stop(self, released: np.ndarray, step_size: float) -> bool:
            seen.append(released.copy())
            return super().should_stop(released, step_size)

    rng = np.random.default_rng(0)
    x = _to_ball(rng.normal(size=(30, 2)), 1.0)
    y = rng.uniform(-1, 1, 30)
    sens = relative_sensitivity("ridge", 30, 0.5, 1.0)
    config = RgmGdConfig("ridge", 0.5, 20, 0.5, 1e-3, baseline_sigma(1e-3, sens), Spy(0.3, 2, 3))
    result = rgm_gd_train(config, x, y, Noise.seeded(1))
    path = np.vstack([np.zeros((1, 2)), result.iterates])
    assert len(seen) == result.steps_run
    for k, arr in enumerate(seen):
        np.testing.assert_array_equal(arr, path[: k + 2])


# ----- no data-dependent failure on variance overflow ----------------------------------------------------
def _overflow_pair() -> tuple[RgmGdConfig, tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    x_d, x_p = np.array([[1.0], [1.0]]), np.array([[0.0], [1.0]])  # neighbours: record 0 replaced
    y = np.array([0.0, 0.0])
    sens = relative_sensitivity("ridge", 2, 1.0, 1.0)
    config = RgmGdConfig("ridge", 1.0, 1, 1e-3, 1.0, baseline_sigma(1.0, sens))
    return config, (x_d, y), (x_p, y)


def _fails(config: RgmGdConfig, data: tuple[np.ndarray, np.ndarray], theta0: np.ndarray) -> bool:
    try:
        rgm_gd_train(config, data[0], data[1], Noise.seeded(0), theta0=theta0)
    except ValueError:
        return True
    return False


def test_overflow_pair_no_longer_fails_demo() -> None:
    """Was: same public θ₀ = 8e153, D failed (γ‖∇f_D‖² = (1.6e154)² overflowed) and D′ did not. Now θ₀ is
    projected onto the public ball (r = ridge_theta_bound(1, 1, 1) = 0.5) and neither run fails."""
    config, d, d_prime = _overflow_pair()
    theta0 = np.array([8e153])
    assert config.projection_radius == pytest.approx(0.5)
    assert not _fails(config, d, theta0)
    assert not _fails(config, d_prime, theta0)


def test_failure_decision_must_not_depend_on_private_data() -> None:
    config, d, d_prime = _overflow_pair()
    theta0 = np.array([8e153])
    assert _fails(config, d, theta0) == _fails(config, d_prime, theta0)


def test_overflow_is_no_longer_reachable_from_theta0_zero_with_service_parameters() -> None:
    """θ₀ = 0 (the service's start) and step_size = 1e6 (allowed by RgmGdParams): the iterates used to blow
    up and the run failed after a data-dependent number of steps, which public progress reported. Now every
    iterate stays in the public ball and all 100 steps run, on D and on its neighbour."""
    sens = relative_sensitivity("ridge", 2, 1.0, 1.0)
    config = RgmGdConfig("ridge", 1.0, 100, 1e6, 1e-3, baseline_sigma(1e-3, sens))
    radius = config.projection_radius
    for x in (np.array([[1.0], [1.0]]), np.array([[0.0], [1.0]])):
        steps: list[float] = []
        result = rgm_gd_train(config, x, np.array([1.0, 1.0]), Noise.seeded(0), steps.append)
        assert len(steps) == 100
        assert result.steps_run == 100
        assert np.all(np.isfinite(result.iterates))
        assert np.max(np.linalg.norm(result.iterates, axis=1)) <= radius * (1 + 1e-12)


@pytest.mark.slow
def test_baseline_sigma_satisfies_the_sigma_condition_at_every_order() -> None:
    """σ² = γR_rel²/η² (rounded up) ⇒ α_lo = 1: no order is charged below Theorem 1's σ² condition."""
    from mechanisms.learners.relative_gaussian import alpha_lo

    rng = np.random.default_rng(9)
    for _ in range(100):  # 100 random sensitivities (40 ms each to compute) × 20 random γ: 2000 cases
        model: Model = "ridge" if rng.random() < 0.5 else "logistic"
        n = int(10 ** rng.uniform(0, 7))
        sens = relative_sensitivity(
            model, n, float(10 ** rng.uniform(-4, 4)), float(10 ** rng.uniform(-2, 2))
        )
        for gamma in (10 ** rng.uniform(-8, 12, size=20)).tolist():
            sigma = baseline_sigma(gamma, sens)
            assert sigma * sigma * sens.eta**2 >= gamma * sens.r_rel**2
            assert alpha_lo(sens.eta, gamma, sigma, sens.r_rel) == 1.0


def _gaussian_renyi(m1: np.ndarray, v1: float, m2: np.ndarray, v2: float, alpha: float) -> float:
    """D_α(N(m1, v1·I_d) ‖ N(m2, v2·I_d)) in closed form (+∞ when αv2 + (1−α)v1 ≤ 0)."""
    d = m1.size
    s = alpha * v2 + (1 - alpha) * v1
    if s <= 0:
        return math.inf
    log_term = math.log(s) - (1 - alpha) * math.log(v1) - alpha * math.log(v2)
    return alpha * float(np.sum((m1 - m2) ** 2)) / (2 * s) - d / (2 * (alpha - 1)) * log_term


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "n", "d", "reg", "gamma"),
    [("ridge", 1, 2, 20.0, 1e-3), ("ridge", 2, 1, 5.0, 0.1), ("logistic", 2, 2, 2.0, 1e-3)],
)
def test_one_step_divergence_below_charge_end_to_end(
    model: str, n: int, d: int, reg: float, gamma: float
) -> None:
    """The exact D_α of one RGM-GD step (the code's gradient, γ, baseline σ) on adversarially optimised
    (D, D′, θ_t) stays below the charged ε_step(α). Search over 6 configs × 3 γ × 2 bounds × 4 orders:
    max D_α/ε_step = 0.662 (ridge, n = 1, d = 2, λ = 20, γ = 1e-3, α = 1.25)."""
    sens = relative_sensitivity(model, n, reg, 1.0)  # type: ignore[arg-type]
    sigma = baseline_sigma(gamma, sens)
    orders = (1.25, 2.0)
    curve = step_curve(orders, sens, gamma, sigma, d, "exact")
    rng = np.random.default_rng(n * 7 + d)

    def unpack(
        z: np.ndarray,
    ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], np.ndarray]:
        xs = _to_ball(z[: (n + 1) * d].reshape(n + 1, d), 1.0)
        lab = z[(n + 1) * d : (n + 1) * d + n + 1]
        ys = np.tanh(lab) if model == "ridge" else np.where(lab >= 0, 1.0, -1.0)
        theta = z[-d:] * math.exp(min(max(z[-d - 1], -5.0), 15.0))
        x2, y2 = xs[:n].copy(), ys[:n].copy()
        x2[0], y2[0] = xs[n], ys[n]
        return (xs[:n], ys[:n]), (x2, y2), theta

    best = 0.0
    for alpha, eps in zip(curve.orders, curve.values, strict=True):
        assert math.isfinite(eps)

        def objective(z: np.ndarray, alpha: float = alpha, eps: float = eps) -> float:
            (x, y), (x2, y2), theta = unpack(z)
            g = full_gradient(theta, x, y, model, reg)  # type: ignore[arg-type]
            g2 = full_gradient(theta, x2, y2, model, reg)  # type: ignore[arg-type]
            v1, v2 = gamma * g @ g + sigma**2, gamma * g2 @ g2 + sigma**2
            return -_gaussian_renyi(g, v1, g2, v2, alpha) / eps

        for _ in range(3):
            z0 = np.concatenate(
                [
                    rng.normal(size=(n + 1) * d) * 2,
                    rng.normal(size=n + 1),
                    [rng.uniform(-2, 8)],
                    rng.normal(size=d),
                ]
            )
            res = optimize.minimize(objective, z0, method="Nelder-Mead", options={"maxiter": 800})
            best = max(best, -res.fun)
    assert 0.01 < best <= 1.0


# ----- the same for dp_gd: the clipped sum is finite for D exactly when it is for its neighbour ----------
def _nan_pair() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    s = 2**-0.5
    x_d = np.array([[s, s], [0.1, 0.1]])  # record 0 aligned with θ: its margin overflows to +inf
    x_p = np.array([[s, -s], [0.1, 0.1]])  # record 0 replaced: margin 0
    return x_d, x_p, np.zeros(2), np.array([1.3e308, 1.3e308])


def test_clipped_sum_finite_for_d_and_neighbour_demo() -> None:
    """Was: squared loss at a public θ_t with finite coordinates, D gave a NaN sum (inf residual × 0 clip
    factor) and D′ a finite one. Now the overflowing residual is clipped as its limit (±C along x₀/‖x₀‖):
    both sums are finite and the '‖sum − sum′‖ ≤ 2C' premise holds in floats."""
    x_d, x_p, y, theta = _nan_pair()
    a = clipped_gradient_sum(theta, x_d, y, "squared", 1.0)
    b = clipped_gradient_sum(theta, x_p, y, "squared", 1.0)
    assert np.all(np.isfinite(a))
    assert np.all(np.isfinite(b))
    assert np.linalg.norm(a - b) <= 2.0


def test_clipped_sum_finiteness_must_not_depend_on_private_data() -> None:
    x_d, x_p, y, theta = _nan_pair()
    with np.errstate(all="ignore"):
        a = clipped_gradient_sum(theta, x_d, y, "squared", 1.0)
        b = clipped_gradient_sum(theta, x_p, y, "squared", 1.0)
    assert bool(np.all(np.isfinite(a))) == bool(np.all(np.isfinite(b)))
