"""The adaptive data-dependent report of ``objpert.logistic``: private λ_min (Redberg 2023, Alg 8) and the
adaptive leverage estimator (Alg 9, Prop A.3.2),
docs/privacy/objective_perturbation.md#objpert-adaptive-report."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import ParamsError, PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.learners.objective_perturbation import (
    ObjPertFit,
    ObjPertLogisticParams,
    logistic_d2,
    perturbed_hessian,
)
from mechanisms.noise import Noise
from mechanisms.per_instance.objpert_logistic import ObjPertLogistic
from mechanisms.per_instance.reports import (
    ADAPTIVE_EVENTS,
    adaptive_leverage,
    data_dependent_statistics,
    eigen_float_error,
    evaluate_report,
    ex_post_terms,
    lambda_min_grid,
    lambda_min_margin,
    lambda_min_sensitivity,
    lower_lambda,
    one_sided_z,
    personalized_rdp,
    report_curve,
    report_metadata,
    two_sided_z,
)

SCHEMA = DatasetSchema.model_validate(
    {
        "neighboring": "add_remove",
        "columns": [
            {"name": "a", "type": "float", "min": -1, "max": 1},
            {"name": "b", "type": "float", "min": -2, "max": 2},
            {"name": "label", "type": "categorical", "values": ["no", "yes"]},
        ],
    }
)


def _ctx(neighboring: str = "add_remove") -> PublicContext:
    schema = SCHEMA.model_copy(update={"neighboring": neighboring})
    return PublicContext(schema, 400 if neighboring == "replace_one" else None, DEFAULT_ORDERS)


def _table(n: int = 400, seed: int = 0, label_noise: float = 0.3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.uniform(-1, 1, n)
    b = rng.uniform(-2, 2, n)
    label = (a + 0.5 * b + label_noise * rng.normal(size=n) > 0).astype(np.int64)
    return {"a": a, "b": b, "label": label}


def _params(**extra: object) -> ObjPertLogisticParams:
    base: dict[str, object] = {
        "features": ["a", "b"],
        "label": "label",
        "regularization": 1.0,
        "sigma": 2.0,
        "max_rows": 400,
        "report": "data_dependent",
        "report_gradient_sigma": 2.0,
        "report_hessian_sigma": 0.5,
        "report_lambda_min_sigma": 0.5,
    }
    return ObjPertLogisticParams.model_validate({**base, **extra})


def _random_symmetric(rng: np.random.Generator, d: int, norm: float) -> np.ndarray:
    z = rng.normal(size=(d, d))
    g = (z + z.T) / 2
    return g * (norm / float(np.max(np.abs(np.linalg.eigvalsh(g)))))


def test_adaptive_leverage_sandwich_on_its_event() -> None:
    """Prop A.3.2 (re-proved in docs/privacy/objective_perturbation.md#objpert-adaptive-report): if λ_min(H) ≥
    λ_lo and ‖Ĥ − H‖ ≤ s, the bound is ≥ xᵀH⁻¹x for every x — for λ_lo both below and above 2s (the former
    requirement) — and the regularized estimate xᵀ(Ĥ + sI)⁻¹x is a lower bound (the other side of the
    sandwich)."""
    rng = np.random.default_rng(11)
    checked_below = 0
    for _ in range(400):
        d = int(rng.integers(1, 6))
        q, _ = np.linalg.qr(rng.normal(size=(d, d)))
        eigen = np.sort(rng.uniform(0.05, 5.0, size=d))
        h = (q * eigen) @ q.T
        s = float(rng.uniform(0.01, 3.0))
        g = _random_symmetric(rng, d, s * float(rng.uniform(0.0, 1.0)))
        h_hat = h + g
        lambda_lo = float(eigen[0] * rng.uniform(0.05, 1.0))
        x = rng.normal(size=(8, d)) * rng.uniform(0.1, 2.0)
        exact = np.einsum("ij,ij->i", x, np.linalg.solve(h, x.T).T)
        bound = adaptive_leverage(h_hat, x, lambda_lo, s)
        assert np.all(bound >= exact * (1 - 1e-9))
        assert np.all(bound <= np.sum(x * x, axis=1) / lambda_lo * (1 + 1e-12))
        lower = np.einsum("ij,ij->i", x, np.linalg.solve(h_hat + s * np.eye(d), x.T).T)
        assert np.all(lower <= exact * (1 + 1e-9))
        checked_below += lambda_lo < 2 * s
    assert checked_below > 100  # the regime the former requirement refused is exercised


def test_adaptive_leverage_is_tight_when_the_data_hessian_is_large() -> None:
    """λ small, λ_min(H) large: with λ_lo near λ_min(H) the bound is within (1 + s/λ_lo)² of xᵀH⁻¹x, far
    below the public ‖x‖²/λ."""
    rng = np.random.default_rng(2)
    d, lam, s = 3, 0.3, 0.5
    h = np.diag([8.0, 10.0, 12.0]) + lam * np.eye(d)
    x = rng.normal(size=(20, d))
    exact = np.einsum("ij,ij->i", x, np.linalg.solve(h, x.T).T)
    for _ in range(50):
        bound = adaptive_leverage(h + _random_symmetric(rng, d, s), x, 8.0, s)
        assert np.all(bound >= exact)
        assert np.all(bound <= exact * (1 + s / 8.0) ** 2 / (1 - s / 8.0))
        assert np.all(bound < 0.1 * np.sum(x * x, axis=1) / lam)


def test_printed_alg9_with_the_noisy_lambda_min_is_not_an_upper_bound() -> None:
    """Erratum 10 of the note: Alg 9 as printed uses λ̂_min, not λ_lo. With an upward noise draw,
    ‖x‖²/λ̂_min < xᵀH⁻¹x; λ_lo = max(λ, λ̂_min − margin) keeps the bound."""
    p = _params(regularization=0.3)
    h = np.diag([0.5, 4.0])
    x = np.array([[1.0, 0.0]])
    exact = 1.0 / 0.5
    margin = lambda_min_margin(p, 2, 400)
    lam_hat = 0.5 + 0.8 * margin  # an upward draw inside the margin
    assert float(x[0] @ x[0]) / lam_hat < exact  # the printed branch fails
    report = {"lambda_min": lam_hat, "lambda_min_margin": margin}
    lo = lower_lambda(p, report)
    assert p.regularization <= lo <= 0.5
    assert adaptive_leverage(h, x, lo, 1e-9)[0] >= exact


def test_lambda_min_sensitivity_is_weyl() -> None:
    """|λ_min(H_D) − λ_min(H_D′)| ≤ β = R²/4 at a fixed released out, for add/remove and replace-one
    neighbours; the charged sensitivity adds only the (tiny) float error."""
    rng = np.random.default_rng(4)
    p = _params()
    worst = 0.0
    for _ in range(300):
        n, d = int(rng.integers(1, 30)), int(rng.integers(1, 5))
        x = rng.normal(size=(n + 1, d))
        x /= np.maximum(1.0, np.linalg.norm(x, axis=1))[:, None]
        x[0] /= np.linalg.norm(x[0])
        theta = rng.normal(size=d) * 0.1  # f'' ≈ 1/4: the worst case
        lam = float(rng.uniform(0.3, 3.0))
        full = np.linalg.eigvalsh(perturbed_hessian(theta, x, lam))[0]
        removed = np.linalg.eigvalsh(perturbed_hessian(theta, x[1:], lam))[0]
        other = rng.normal(size=(1, d))
        other /= np.linalg.norm(other)
        replaced = np.linalg.eigvalsh(perturbed_hessian(theta, np.vstack([other, x[1:]]), lam))[0]
        worst = max(worst, abs(full - removed), abs(full - replaced))
    beta = 0.25
    assert worst <= beta + 1e-12
    assert worst > 0.9 * beta  # the Weyl bound is nearly attained by a row along the weak direction
    assert beta < lambda_min_sensitivity(p, 4, 400) <= beta * (1 + 1e-9)
    assert eigen_float_error(p, 4, 400) < 1e-9


def test_params_and_check() -> None:
    mech = ObjPertLogistic()
    ctx = _ctx()
    # the former requirement λ ≥ 2σ₃τ_GOE refuses this request without σ₄ ...
    without = _params(report_lambda_min_sigma=None)
    with pytest.raises(ParamsError, match="2·σ₃·τ_GOE") as info:
        mech.check(without, ctx)
    assert info.value.field == "report_hessian_sigma"
    # ... and the adaptive route admits it
    mech.check(_params(), ctx)
    with pytest.raises(ValidationError, match="only apply"):
        ObjPertLogisticParams.model_validate(
            {
                "features": ["a"],
                "label": "label",
                "regularization": 1.0,
                "sigma": 1.0,
                "report_lambda_min_sigma": 1.0,
            }
        )
    with pytest.raises(ValidationError):
        _params(report_lambda_min_sigma=0.0)
    with pytest.raises(ValueError, match="row bound"):
        report_curve(_params(), "add_remove", DEFAULT_ORDERS, 3)


@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
def test_lambda_min_release_is_charged_as_a_gaussian(neighboring: str) -> None:
    mech = ObjPertLogistic()
    ctx = _ctx(neighboring)
    rows = {"max_rows": 400} if neighboring == "add_remove" else {"max_rows": None}
    adaptive = _params(regularization=0.5, **rows)
    plain = _params(report_lambda_min_sigma=None, regularization=80.0, **rows)
    adaptive80 = _params(regularization=80.0, **rows)
    added = np.asarray(mech.worst_case(adaptive80, ctx).values) - np.asarray(
        mech.worst_case(plain, ctx).values
    )
    alphas = np.asarray(DEFAULT_ORDERS)
    gaussian = alphas * 0.25**2 / (2 * 0.5**2)  # α·β²/(2σ₄²), β = R²/4 (Weyl, both neighbour notions)
    assert np.all(added >= gaussian)
    assert np.allclose(added, gaussian, rtol=1e-5)  # the grid rounding and float error add ≈ 2^-20
    assert mech.worst_case(adaptive, ctx) <= mech.worst_case(_params(regularization=0.4, **rows), ctx)


def test_release_and_report() -> None:
    mech = ObjPertLogistic()
    ctx = _ctx()
    p = _params(regularization=0.5, report_rho=1e-3)
    release = mech.run(p, ctx, _table(label_noise=3.0), Noise.seeded(9))
    assert release.realized == mech.worst_case(p, ctx)
    report = release.output["report"]
    assert report["events"] == ADAPTIVE_EVENTS
    grid = lambda_min_grid(p)
    assert report["lambda_min_grid"] == grid.describe()
    assert report["lambda_min"] / grid.granularity == round(report["lambda_min"] / grid.granularity)
    assert report["lambda_lo"] == lower_lambda(p, report) >= p.regularization
    assert report["lambda_min_margin"] == pytest.approx(
        math.ceil(0.5 / grid.granularity) * grid.granularity * one_sided_z(1e-3 / 9), rel=1e-5
    )
    # λ_min(H) of 400 rows is far above λ: the release lets the report use it
    assert report["lambda_lo"] > 10 * p.regularization
    x = np.array([[0.3, 0.2, 1.0], [0.9, -0.4, 0.2]])
    x = x / np.maximum(1.0, np.linalg.norm(x, axis=1))[:, None]
    items = evaluate_report(p, release.output, x, np.array([1.0, -1.0]), DEFAULT_ORDERS)
    public_p = _params(
        regularization=0.5,
        report_rho=1e-3,
        report="public",
        report_gradient_sigma=None,
        report_hessian_sigma=None,
        report_lambda_min_sigma=None,
    )
    public_out = {**release.output, "report": report_metadata(public_p, 3)}
    public = evaluate_report(public_p, public_out, x, np.array([1.0, -1.0]), DEFAULT_ORDERS)
    for item, pub in zip(items, public, strict=True):
        assert item["confidence"] == 1.0 - 1e-3
        assert item["terms"]["report_lambda_min"] > 0
        # the adaptive leverage is far below the public ‖x‖²/λ bound at λ = 0.5
        assert item["terms"]["leverage"] < 0.2 * pub["terms"]["leverage"]


def test_lambda_min_term_is_its_gaussian_loss() -> None:
    """λ̂_min's ex-post loss for a shift v: v²/(2σ₄²) + vZ/σ₄; bounded with v = f''(xᵀout)‖x‖² + extra."""
    theta = np.array([0.3, -0.2])
    x = np.array([[0.6, 0.5]])
    z = two_sided_z(0.01)
    common = {
        "lam": 1.0,
        "sigma": 1.0,
        "z_b": z,
        "h_hat": np.eye(2) * 3,
        "g_hat": np.zeros(2),
        "sigma_g": 1.0,
        "z_e": z,
        "sigma_h": 1.0,
    }
    terms = ex_post_terms(
        theta,
        x,
        np.array([1.0]),
        **common,
        lambda_lo=2.0,
        spectral=0.1,
        sigma_l=0.4,
        lambda_shift_extra=1e-8,
        z_l=z,
    )
    v = float(logistic_d2(np.asarray(x[0] @ theta))) * float(x[0] @ x[0]) + 1e-8
    assert terms["report_lambda_min"][0] == pytest.approx(v**2 / (2 * 0.16) + v * z / 0.4, rel=1e-12)
    with pytest.raises(ValueError, match="sigma_l"):
        ex_post_terms(theta, x, np.array([1.0]), **common, lambda_lo=2.0, spectral=0.1)
    with pytest.raises(ValueError, match="spectral"):
        ex_post_terms(theta, x, np.array([1.0]), **common, lambda_lo=2.0, sigma_l=0.4)


def test_personalized_rdp_includes_the_lambda_min_release() -> None:
    p = _params()
    base = _params(report_lambda_min_sigma=None)
    norms = np.array([0.5, 1.0])
    with_l = personalized_rdp(norms, p, 1e-3, DEFAULT_ORDERS)
    without = personalized_rdp(norms, base, 1e-3, DEFAULT_ORDERS)
    alphas = np.asarray(DEFAULT_ORDERS)
    for norm, a, b in zip(norms, with_l, without, strict=True):
        extra = alphas * (norm**2 / 4) ** 2 / (2 * 0.5**2)
        assert np.allclose(np.asarray(a.values) - np.asarray(b.values), extra, rtol=1e-9, atol=1e-12)


def test_data_dependent_statistics_release_lambda_min_on_its_grid() -> None:
    rng = np.random.default_rng(6)
    xs = rng.normal(size=(50, 2))
    xs /= np.maximum(1.0, np.linalg.norm(xs, axis=1))[:, None]
    ys = np.where(xs[:, 0] > 0, 1.0, -1.0)
    p = _params(report_lambda_min_sigma=1e-3)
    theta = np.array([0.5, 0.1])
    fit = ObjPertFit(released=theta, approx_minimizer=theta, b=np.zeros(2))
    draws = [data_dependent_statistics(p, xs, ys, fit, Noise.seeded(k))["lambda_min"] for k in range(200)]
    truth = float(np.linalg.eigvalsh(perturbed_hessian(theta, xs, p.regularization))[0])
    assert np.mean(draws) == pytest.approx(truth, abs=4 * 1e-3 / math.sqrt(200))
    assert np.std(draws) == pytest.approx(1e-3, rel=0.2)
    plain = data_dependent_statistics(_params(report_lambda_min_sigma=None), xs, ys, fit, Noise.seeded(0))
    assert "lambda_min" not in plain


def test_lambda_min_is_taken_at_the_released_model() -> None:
    """Lemma LMIN needs H at the released out (public): at the unreleased approximate minimizer θ̃ every
    weight moves with D and the sensitivity is no longer β. The release's mean is λ_min(H(out))."""
    rng = np.random.default_rng(8)
    xs = rng.normal(size=(60, 2))
    xs /= np.maximum(1.0, np.linalg.norm(xs, axis=1))[:, None]
    ys = np.where(xs[:, 0] > 0, 1.0, -1.0)
    p = _params(report_lambda_min_sigma=1e-3)
    released, hidden = np.array([0.2, -0.1]), np.array([4.0, 3.0])
    fit = ObjPertFit(released=released, approx_minimizer=hidden, b=np.zeros(2))
    draws = [data_dependent_statistics(p, xs, ys, fit, Noise.seeded(k))["lambda_min"] for k in range(50)]
    at_out = float(np.linalg.eigvalsh(perturbed_hessian(released, xs, p.regularization))[0])
    at_hidden = float(np.linalg.eigvalsh(perturbed_hessian(hidden, xs, p.regularization))[0])
    assert abs(at_out - at_hidden) > 0.5
    assert np.mean(draws) == pytest.approx(at_out, abs=4 * 1e-3 / math.sqrt(50))


def test_statistics_ranges_are_public_and_clamped() -> None:
    """A σ₃ or σ₄ too small for λ + n̄β to fit its grid is refused before the run (naming the field); at run
    time the statistics are clamped to ±(λ + n̄β), so a dataset with more rows than declared never makes the
    release fail (a data-dependent failure would leak), and the clamp is 1-Lipschitz (sensitivity kept)."""
    mech = ObjPertLogistic()
    ctx = _ctx()
    with pytest.raises(ParamsError) as info:
        mech.check(_params(report_lambda_min_sigma=1e-8), ctx)
    assert info.value.field == "report_lambda_min_sigma"
    with pytest.raises(ParamsError) as info:
        mech.check(_params(report_hessian_sigma=1e-8), ctx)
    assert info.value.field == "report_hessian_sigma"
    # n̄ = 4 declared, 4000 rows given (add/remove: the row count is private): the clamp keeps the run going
    p = _params(report_lambda_min_sigma=1e-5, max_rows=4)
    mech.check(p, ctx)
    xs = np.tile(np.array([[0.0, 1.0], [1.0, 0.0]]), (2000, 1))
    ys = np.tile(np.array([1.0, -1.0]), 2000)
    theta = np.zeros(2)
    fit = ObjPertFit(released=theta, approx_minimizer=theta, b=np.zeros(2))
    stats_ = data_dependent_statistics(p, xs, ys, fit, Noise.seeded(1), n_bound=4)
    bound = (1.0 + 4 * 0.25) * (1 + 1e-6)
    assert stats_["lambda_min"] <= bound + 40 * 1e-5  # clamped (the truth is 1 + 500), plus the noise
    assert max(abs(v) for v in stats_["hessian_vector"]) <= bound + 40 * 0.5


def test_personalized_rdp_carries_the_rounding_and_float_shift() -> None:
    p = _params()
    norms = np.array([0.0, 1.0])
    plain = personalized_rdp(norms, p, 1e-3, DEFAULT_ORDERS)
    shifted = personalized_rdp(norms, p, 1e-3, DEFAULT_ORDERS, 1e-3)
    alphas = np.asarray(DEFAULT_ORDERS)
    extra0 = alphas * (1e-3) ** 2 / (2 * 0.5**2)
    assert np.all(np.asarray(shifted[0].values) - np.asarray(plain[0].values) >= extra0 * (1 - 1e-9))
