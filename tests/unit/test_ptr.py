"""Generalized PTR (mechanisms/ptr) and the approximate-DP charge (docs/privacy/approximate.md#approximate-dp,
ptr.md).

Fixed seeds throughout; Monte Carlo bounds use a 4.5-sigma binomial allowance (false alarm < 1e-5 per check).
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve
from mechanisms.accounting.approximate import (
    ApproximateCharge,
    delta_units_down,
    delta_units_up,
    fits_delta,
    remainder_delta,
)
from mechanisms.base import PublicContext
from mechanisms.data.table import load_csv
from mechanisms.learners.features import FeatureSpec
from mechanisms.noise import Noise
from mechanisms.ptr.classic import ClassicPtrPlan, classic_ptr, classic_via_gen_ptr, distance_test
from mechanisms.ptr.generalized import (
    GenPtrBudget,
    bernoulli_renyi,
    holder_rdp_bound,
    joint_renyi_two_point,
    laplace_scale_units,
    liu_talwar_per_call,
    liu_talwar_total,
    lower_bound_release,
    printed_rdp_bound,
    upper_bound_release,
)
from mechanisms.ptr.ops_linear import (
    OPS_LINEAR,
    OpsBound,
    OpsLinearParams,
    lambda_min_floor_units,
    ops_bound,
    ops_release,
    plan,
)
from mechanisms.ptr.protocol import ApproximateMechanism, is_approximate


def _binomial_upper(rate: float, trials: int) -> float:
    return rate + 4.5 * math.sqrt(max(rate * (1 - rate), 1e-4) / trials) + 1.0 / trials


# ----- the approximate charge ---------------------------------------------------------------------------


def test_approximate_charge_is_randomized_response_curve_plus_delta() -> None:
    charge = ApproximateCharge.from_epsilon_delta(1.0, 1e-7, DEFAULT_ORDERS)
    assert charge.epsilon == 1.0
    assert charge.delta == 1e-7
    alphas = np.asarray(DEFAULT_ORDERS)
    rr = np.log((np.exp(alphas) + np.exp(1 - alphas)) / (1 + math.e)) / (alphas - 1)
    assert all(rr[i] <= v <= 1.0 for i, v in enumerate(charge.curve.values))
    assert charge.curve.values[0] < 0.6  # RR_1.25(1) = 0.5526, well below the constant ε
    small = ApproximateCharge.from_epsilon_delta(0.1, 1e-7, DEFAULT_ORDERS)
    assert small.curve.values[3] <= 2 * 0.1**2 / 2 * (1 + 1e-9)  # ≤ αε²/2 at α = 2
    with pytest.raises(ValueError, match="0 < delta"):
        ApproximateCharge.from_epsilon_delta(1.0, 0.0, DEFAULT_ORDERS)
    with pytest.raises(ValueError, match="pure slot"):
        ApproximateCharge(RdpCurve.gaussian(1.0, 1.0, DEFAULT_ORDERS), 1e-7)  # no declared ε


def test_delta_units_round_charges_up_and_capacities_down() -> None:
    assert delta_units_up(1e-7) == 10**23
    assert 10**23 - 10**8 < delta_units_down(1e-7) <= 10**23
    assert 1_649_500_000 <= delta_units_up(1.6495e-21) <= 1_649_500_001
    tiny = 1e-31
    assert delta_units_up(tiny) == 1
    assert delta_units_down(tiny) == 0
    charge = ApproximateCharge.from_epsilon_delta(0.5, 4e-7, DEFAULT_ORDERS)
    assert fits_delta(0, delta_units_up(5.9e-7), charge, 1e-6)  # exact boundary: conservative
    assert not fits_delta(0, delta_units_up(6.1e-7), charge, 1e-6)
    rest = remainder_delta(1e-6, 5e-7)
    assert rest <= 5e-7
    assert Fraction(rest) <= Fraction(1, 10**6) - Fraction(5, 10**7)


def test_ops_linear_exposes_the_approximate_seam() -> None:
    assert isinstance(OPS_LINEAR, ApproximateMechanism)
    assert is_approximate(OPS_LINEAR)
    ctx = PublicContext(_schema_regression(), None, DEFAULT_ORDERS)
    params = OpsLinearParams(
        features=FeatureSpec(features=("x1", "x2"), label="y"), lam=5.0, epsilon=1.0, delta=1e-6
    )
    OPS_LINEAR.check(params, ctx)
    charge = OPS_LINEAR.approximate_charge(params, ctx)
    assert charge.epsilon >= 1.0
    assert 1e-6 <= charge.delta <= 1e-6 * (1 + 1e-12)
    assert OPS_LINEAR.worst_case(params, ctx) == charge.curve


# ----- Gen-PTR budget, classic PTR as a special case ----------------------------------------------------


def test_gen_ptr_budget_adds_the_three_deltas() -> None:
    budget = GenPtrBudget(0.5, 1e-7, 2e-7, 0.5, 3e-7)
    assert budget.epsilon >= 1.0
    assert budget.delta >= 6e-7
    assert budget.delta <= 6e-7 * (1 + 1e-15)


def test_classic_ptr_equals_gen_ptr_draw_for_draw() -> None:
    plan_ = ClassicPtrPlan.build(beta=2.0, epsilon=0.7, delta=1e-3)
    for seed in range(300):
        for distance in (0, 3, 9, 12, 40):
            a = classic_ptr(plan_, distance, 17.3, Noise.seeded(seed))
            b = classic_via_gen_ptr(plan_, distance, 17.3, Noise.seeded(seed))
            assert a == b


def _dlap_tail(scale: Fraction, k: int) -> float:
    """P[Z > k] for P(z) ∝ e^{−|z|/t}, k ≥ 0."""
    q = math.exp(-1.0 / float(scale))
    return q ** (k + 1) / (1 + q)


@pytest.mark.slow
def test_classic_ptr_output_distribution_matches_gen_ptr() -> None:
    """Independent seeds: pass rates match the exact P[D + Z > log(1/δ)/ε] in both forms, and the released
    values have the same law (two-sample comparison of the means and of a quantile)."""
    plan_ = ClassicPtrPlan.build(beta=1.0, epsilon=1.0, delta=0.05)
    distance, trials = 3, 6000
    direct = [classic_ptr(plan_, distance, 4.0, Noise.seeded(10_000 + i)) for i in range(trials)]
    via = [classic_via_gen_ptr(plan_, distance, 4.0, Noise.seeded(90_000 + i)) for i in range(trials)]
    k = math.floor(plan_.threshold) - distance
    exact = _dlap_tail(plan_.test_scale, k)
    for sample in (direct, via):
        rate = sum(v is not None for v in sample) / trials
        assert abs(rate - exact) < 4.5 * math.sqrt(exact * (1 - exact) / trials)
    a = np.asarray([v for v in direct if v is not None])
    b = np.asarray([v for v in via if v is not None])
    spread = float(plan_.release_scale) * plan_.grid.granularity * math.sqrt(2)
    assert abs(a.mean() - b.mean()) < 4.5 * spread * math.sqrt(1 / a.size + 1 / b.size)
    assert abs(float(np.mean(a > 4.0)) - float(np.mean(b > 4.0))) < 4.5 * math.sqrt(0.5 / a.size)


def test_classic_false_positive_rate_on_unstable_data() -> None:
    """Bad X (D_β = 0): the test passes with probability ≤ δ; a stable X passes almost surely (power)."""
    plan_ = ClassicPtrPlan.build(beta=1.0, epsilon=1.0, delta=0.05)
    trials = 20_000
    noise = Noise.seeded(7)
    bad = sum(distance_test(plan_, 0, noise) for _ in range(trials)) / trials
    assert bad <= _binomial_upper(0.05, trials)
    good = sum(distance_test(plan_, 20, noise) for _ in range(2000)) / 2000
    assert good > 0.99


# ----- one-sided margins and the OPS tests' false-positive rates ----------------------------------------


@pytest.mark.parametrize("delta_prime", [0.05, 0.2])
def test_one_sided_margins_hold_except_with_probability_delta_prime(delta_prime: float) -> None:
    scale = laplace_scale_units(3, 0.5)
    noise = Noise.seeded(11)
    trials = 20_000
    lower_fail = sum(lower_bound_release(noise, 100, scale, delta_prime) > 100 for _ in range(trials))
    upper_fail = sum(upper_bound_release(noise, 100, scale, delta_prime) < 100 for _ in range(trials))
    assert lower_fail / trials <= _binomial_upper(delta_prime, trials)
    assert upper_fail / trials <= _binomial_upper(delta_prime, trials)
    # power: without the margin the bound is on the wrong side about half the time
    unmargined = sum(100 + int(noise.discrete_laplace(scale, 1)[0]) > 100 for _ in range(2000)) / 2000
    assert unmargined > 0.3


def _bad_dataset() -> tuple[np.ndarray, np.ndarray]:
    """Small λ_min and a large ‖θ*‖: the released bounds decide whether γ is safe."""
    x = np.concatenate([np.full((30, 1), 0.2), np.ones((1, 1))])
    y = np.concatenate([np.zeros(30), np.ones(1)])
    return x, y


def test_ops_tests_false_positive_rates_on_a_bad_dataset() -> None:
    x, y = _bad_dataset()
    params = OpsLinearParams(
        features=FeatureSpec(features=("x",), label="y"), lam=1.0, epsilon=4.0, delta=1e-3
    )
    pl = replace(plan(params, 1, "add_remove"), delta_lambda=0.1, delta_log=0.1)
    lam_min = float(np.sum(x[:, 0] ** 2))
    theta = float(np.sum(x[:, 0] * y) / (lam_min + pl.lam_eff))
    log_true = math.log(1.0 + abs(theta))
    trials = 1500
    lam_fail = log_fail = 0
    noise = Noise.seeded(5)
    for _ in range(trials):
        out = ops_release(pl, x, y, noise)
        lam_fail += out["lambda_min_lower"] > lam_min
        log_fail += out["log_lipschitz_upper"] < log_true
    assert lam_fail / trials <= _binomial_upper(0.1, trials)
    assert log_fail / trials <= _binomial_upper(0.1, trials)
    broken = [ops_release(pl, x, y, noise, drop_margins=True) for _ in range(300)]
    assert sum(o["lambda_min_lower"] > lam_min for o in broken) / 300 > 0.25  # power


# ----- γ*, Lemma OPS-DD, λ_min certificate --------------------------------------------------------------


def test_gamma_star_solves_the_bound_and_bottom_iff_c0_reaches_target() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        bound = OpsBound(
            a=float(rng.uniform(0.01, 5)),
            b=float(rng.uniform(0.01, 5)),
            c0=float(rng.uniform(0, 1)),
            target=float(rng.uniform(0.1, 2)),
        )
        gamma = bound.gamma_star()
        if bound.c0 >= bound.target:
            assert gamma is None
            continue
        assert gamma is not None
        exact = bound.b * gamma + bound.a * math.sqrt(gamma) + bound.c0
        assert abs(exact - bound.target) <= 1e-12 * bound.target


def _normal_sf(x: float, mean: float, sd: float) -> float:
    return 0.5 * math.erfc((x - mean) / (sd * math.sqrt(2)))


def _tail(mean: float, var: float, threshold_sq: float) -> float:
    """P[u² > threshold_sq] for u ~ N(mean, var)."""
    if threshold_sq <= 0:
        return 1.0
    t, sd = math.sqrt(threshold_sq), math.sqrt(var)
    return _normal_sf(t, mean, sd) + _normal_sf(t, -mean, sd)


@pytest.mark.parametrize("seed", range(6))
def test_lemma_ops_dd_tail_bound_holds_both_ways(seed: int) -> None:
    """Exact tails of the OPS privacy loss (a function of u = y − xᵀθ) are ≤ δ at the derived e."""
    rng = np.random.default_rng(seed)
    d, n, lam, delta = 3, 12, float(rng.uniform(0.5, 5)), 1e-4
    x1 = rng.normal(size=(n, d)) / 3
    x1 /= np.maximum(1, np.linalg.norm(x1, axis=1))[:, None]
    y1 = np.clip(rng.normal(size=n), -1, 1)
    x = rng.normal(size=d)
    x /= np.linalg.norm(x)
    y = float(rng.choice([-1.0, 1.0]))
    h1 = x1.T @ x1 + lam * np.eye(d)
    mu1 = np.linalg.solve(h1, x1.T @ y1)
    v = float(x @ np.linalg.solve(h1, x))
    r = y - float(x @ mu1)
    for gamma in (0.1, 1.0, 10.0, 100.0):
        z2 = 2 * math.log(1 / delta)
        e = gamma * r * r * v / (2 * (1 + v)) + abs(r) * math.sqrt(z2 * gamma * v) + v * (1 + z2) / 2
        c = 0.5 * math.log1p(v) + gamma * r * r / (2 * (1 + v))
        # log p1/p2 = γu²/2 − c: > e  ⇔  u² > 2(e + c)/γ, u ~ N(r, v/γ) under p1
        assert _tail(r, v / gamma, 2 * (e + c) / gamma) <= delta
        # log p2/p1 = c − γu²/2 > e  ⇔  u² < 2(c − e)/γ, u ~ N(r/(1+v), v/(γ(1+v))) under p2
        inner = 2 * (c - e) / gamma
        if inner > 0:
            mean, sd = r / (1 + v), math.sqrt(v / (gamma * (1 + v)))
            t = math.sqrt(inner)
            assert _normal_sf(-t, mean, sd) - _normal_sf(t, mean, sd) <= delta


def test_lambda_min_certificate_is_the_exact_grid_floor() -> None:
    rng = np.random.default_rng(8)
    for _ in range(20):
        a = rng.integers(-50, 50, size=(9, 4))
        gram_int = a.T @ a
        gram = [[Fraction(int(gram_int[i, j])) for j in range(4)] for i in range(4)]
        step = Fraction(1, 4)
        lam = float(np.linalg.eigvalsh(gram_int.astype(float))[0])
        m = lambda_min_floor_units(gram, step, lam + float(rng.normal(0, 30)))
        assert m * step < Fraction(lam) + Fraction(1, 10**6)
        assert (m + 1) * step >= Fraction(lam) - Fraction(1, 10**6)


def test_ops_bound_is_monotone_in_the_released_statistics() -> None:
    params = OpsLinearParams(
        features=FeatureSpec(features=("x",), label="y"), lam=2.0, epsilon=1.0, delta=1e-6
    )
    pl = plan(params, 3, "add_remove")
    base = ops_bound(pl, 50.0, 0.5).value(1.0)
    assert ops_bound(pl, 20.0, 0.5).value(1.0) >= base  # smaller λ^P ⇒ larger bound
    assert ops_bound(pl, 50.0, 0.9).value(1.0) >= base  # larger Δ^P ⇒ larger bound
    replace_one = ops_bound(plan(params, 3, "replace_one"), 50.0, 0.5)
    assert replace_one.target < ops_bound(pl, 50.0, 0.5).target


# ----- §2.4 counterexample (route (b) helper) and Liu–Talwar -------------------------------------------


def test_printed_rdp_gen_ptr_is_unsound_and_the_corrected_bound_charges_20_nats() -> None:
    p, p_prime, worst, good, alpha = 1e-5, 1e-10, 20.0, 1.0, 2.0
    test2 = bernoulli_renyi(alpha, p, p_prime)
    assert abs(test2 - math.log(2)) < 1e-4
    true = joint_renyi_two_point(alpha, p, p_prime, worst)
    assert true >= 20.0 - 1e-9
    assert abs(printed_rdp_bound(alpha, test2, worst, good, 1e-5) - 9.18) < 0.01
    pure = holder_rdp_bound(alpha, test2, worst, good, 1e-5, test_pure=math.log(p / p_prime))
    holder = holder_rdp_bound(
        alpha, test2, worst, good, 1e-5, alpha_prime=3.0, test_rdp_prime=bernoulli_renyi(3.0, p, p_prime)
    )
    assert pure >= true
    assert holder >= true
    assert min(pure, holder) >= 20.0


def test_liu_talwar_numbers_of_the_regression_experiment() -> None:
    split = liu_talwar_per_call(1.0, 1e-6, 30)
    assert split["tau"] == pytest.approx(1 / 600)
    assert split["cutoff"] == pytest.approx(8705.2, abs=0.05)
    assert split["delta_star"] == pytest.approx(1.6495e-21, rel=1e-4)
    assert split["eps_star"] == pytest.approx(0.33333, abs=1e-5)
    assert split["delta_ops"] == pytest.approx(2.749e-22, rel=1e-3)
    assert split["delta_prime"] == pytest.approx(8.248e-22, rel=1e-3)
    assert split["delta_test"] == pytest.approx(5.498e-22, rel=1e-3)
    eps, delta = liu_talwar_total(split["eps_star"], split["delta_star"], split["tau"], split["delta2"])
    assert eps == pytest.approx(1.0, abs=1e-9)
    assert delta == pytest.approx(1e-6, rel=1e-9)


# ----- end to end through the seam ----------------------------------------------------------------------


def _schema_regression():  # type: ignore[no-untyped-def]
    return _schema_from(
        {
            "columns": [
                {"name": "x1", "type": "float", "min": -1, "max": 1},
                {"name": "x2", "type": "float", "min": -1, "max": 1},
                {"name": "y", "type": "float", "min": -1, "max": 1},
            ],
            "neighboring": "add_remove",
        }
    )


def _schema_from(data):  # type: ignore[no-untyped-def]
    from mechanisms.data.schema import DatasetSchema

    return DatasetSchema.model_validate(data)


def test_ops_linear_run_releases_on_its_grid_and_recovers_a_well_conditioned_fit() -> None:
    rng = np.random.default_rng(12)
    n = 4000
    x = rng.uniform(-1, 1, size=(n, 2))
    y = np.clip(0.5 * x[:, 0] - 0.3 * x[:, 1] + 0.05 * rng.normal(size=n), -1, 1)
    rows = "\n".join(f"{a},{b},{c}" for (a, b), c in zip(x, y, strict=True))
    schema = _schema_regression()
    table = load_csv(("x1,x2,y\n" + rows + "\n").encode(), schema)
    ctx = PublicContext(schema, None, DEFAULT_ORDERS)
    params = OpsLinearParams(
        features=FeatureSpec(features=("x1", "x2"), label="y", intercept=False),
        lam=5.0,
        epsilon=2.0,
        delta=1e-6,
    )
    release = OPS_LINEAR.run(params, ctx, table.columns, Noise.seeded(2))
    out = release.output
    assert out["released"] is True
    grid = out["granularity"]
    assert all(float(c / grid).is_integer() for c in out["coefficients"])
    assert release.realized == OPS_LINEAR.worst_case(params, ctx)
    assert abs(out["coefficients"][0] - 0.5) < 0.15
    assert abs(out["coefficients"][1] + 0.3) < 0.15
    assert "lambda_min" not in out
    assert "theta_star" not in out
