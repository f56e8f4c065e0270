"""Noise-reduction samplers and charges (mechanisms/reduction/noise_reduction.py) and Ligett et al.'s
InteractiveAboveThreshold (mechanisms/threshold/above_threshold.py, Lemma 2.8 section).

Distribution tests and privacy audits are in tests/statistical/test_noise_reduction_audit.py; here: shapes,
validation, the JSON state, exact charge values, closed-form test vectors (a shared-coin counterexample; the
calibrations of Ligett et al. 2017 and of their reference code).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from scipy import stats

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve
from mechanisms.base import PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Grid, Noise
from mechanisms.noise.reduction import (
    RATE_DENOMINATOR,
    dlap_nr_advance,
    exp_neg_coins,
    ratio_coins,
)
from mechanisms.reduction.accuracy_first import (
    ACCURACY_FIRST_GAUSSIAN,
    ACCURACY_FIRST_LAPLACE,
    NR_GAUSSIAN_SESSION,
    NR_LAPLACE_SESSION,
    AccuracyFirst,
)
from mechanisms.reduction.noise_reduction import (
    LazyBrownianNR,
    LazyLaplaceNR,
    brownian_cumulative_costs,
    brownian_grid,
    brownian_nr_charge,
    brownian_step,
    brownian_step_costs,
    brownian_step_variances,
    laplace_nr_charge,
    laplace_nr_level_epsilons,
    laplace_nr_path,
    laplace_nr_rates,
    laplace_nr_scales,
    units_to_values,
)
from mechanisms.threshold.interactive import (
    InteractiveAboveThreshold,
    iat_charge,
    iat_paper_calibration,
    iat_reference_calibration,
    iat_scales,
    interactive_above_threshold,
)

EPS = (0.1, 0.4, 1.0)
VARIANCES = (9.0, 4.0, 1.0)
D = RATE_DENOMINATOR


def _dlap_pmf(q: float, limit: int) -> np.ndarray:
    z = np.arange(-limit, limit + 1)
    result: np.ndarray = (1 - q) / (1 + q) * q ** np.abs(z)
    return result


# ----- the decomposition (exact pmf convolution) ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("x1", "x2"), [(0.5, 1.3), (0.05, 0.07), (2.0, 5.0), (0.01, 0.014)])
def test_discrete_laplace_decomposition_holds_exactly(x1: float, x2: float) -> None:
    """DLap(q₁) = DLap(q₂) + W, W = 0 w.p. c₂/c₁ else DLap(q₁) (c = q/(1−q)²): pmf convolution, and the
    characteristic function (1−q)²/(1 − 2q cos u + q²) = 1/(1 + c·2(1 − cos u))."""
    q1, q2 = math.exp(-x1), math.exp(-x2)
    c1, c2 = q1 / (1 - q1) ** 2, q2 / (1 - q2) ** 2
    rho = c2 / c1
    limit = int(60 / x1) + 10
    p1, p2 = _dlap_pmf(q1, limit), _dlap_pmf(q2, limit)
    mixture = rho * p2 + (1 - rho) * np.convolve(p2, p1)[limit : 3 * limit + 1]
    assert np.max(np.abs(mixture - p1)) < 1e-12 * max(1.0, float(np.max(p1)))
    for u in np.linspace(0.0, math.pi, 17):
        w = 2 * (1 - math.cos(u))
        assert (1 - q1) ** 2 / (1 - 2 * q1 * math.cos(u) + q1**2) == pytest.approx(1 / (1 + c1 * w), rel=1e-9)
    # The closed form of the stay probability used by the sampler: e^{−(x₂−x₁)}·R², R = (1−q₁)/(1−q₂).
    assert rho == pytest.approx(math.exp(-(x2 - x1)) * ((1 - q1) / (1 - q2)) ** 2, rel=1e-12)


def test_lazy_kernel_is_the_reverse_of_the_eager_chain_exactly() -> None:
    """P(stay | x) = ρ·P₂(x)/P₁(x) = e^{−(x₂−x₁)(1+|x|)}·(1 − q₁²)/(1 − q₂²), and the moved part is
    ∝ q₁^{|x−y|}·q₂^{|y|}: both sides of the joint law (eager construction) summed exactly."""
    x1, x2 = 0.4, 0.9
    q1, q2 = math.exp(-x1), math.exp(-x2)
    rho = (q2 / (1 - q2) ** 2) / (q1 / (1 - q1) ** 2)
    limit = 120
    z = np.arange(-limit, limit + 1)
    p1, p2 = _dlap_pmf(q1, limit), _dlap_pmf(q2, limit)
    for x in (-7, -1, 0, 1, 3, 12):
        ix = x + limit
        joint = p2 * (1 - rho) * (1 - q1) / (1 + q1) * q1 ** np.abs(x - z)
        joint[ix] += rho * p2[ix]
        conditional = joint / p1[ix]
        assert conditional.sum() == pytest.approx(1.0, abs=1e-12)
        stay = math.exp(-(x2 - x1) * (1 + abs(x))) * (1 - q1**2) / (1 - q2**2)
        assert conditional[ix] == pytest.approx(
            stay + (1 - stay) * (conditional[ix] - stay) / (1 - stay), rel=1e-12
        )
        moved = conditional.copy()
        moved[ix] -= stay
        shape = q1 ** np.abs(x - z) * q2 ** np.abs(z)
        assert np.allclose(moved / moved.sum(), shape / shape.sum(), rtol=1e-10, atol=1e-15)


# ----- eager samplers ------------------------------------------------------------------------------------
def test_laplace_path_shape_and_structure() -> None:
    path = laplace_nr_path(2.0, EPS, 1000, Noise.seeded(0))
    assert path.shape == (3, 1000)
    assert path.dtype == np.int64
    # Between adjacent levels a coordinate either stays exactly or moves; both happen.
    stays = path[:-1] == path[1:]
    assert stays.any()
    assert (~stays).any()
    assert laplace_nr_path(1.0, (0.5,), 7, Noise.seeded(0)).shape == (1, 7)


@pytest.mark.parametrize(
    "epsilons", [(), (1.0, 1.0), (2.0, 1.0), (0.0, 1.0), (-1.0, 1.0), (1.0, math.inf), (1.0, math.nan)]
)
def test_invalid_epsilon_grids_are_refused(epsilons: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match=r"ε-grid|ε of the grid"):
        laplace_nr_path(1.0, epsilons, 3, Noise.seeded(0))
    with pytest.raises(ValueError, match=r"ε-grid|ε of the grid"):
        LazyLaplaceNR.start(1.0, epsilons, 3, Noise.seeded(0))


@pytest.mark.parametrize("variances", [(), (1.0, 1.0), (1.0, 2.0), (1.0, 0.0), (math.inf, 1.0)])
def test_invalid_variance_grids_are_refused(variances: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="variance"):
        brownian_grid(1.0, variances, 3)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_invalid_dimension_and_sensitivity(bad: object) -> None:
    with pytest.raises(ValueError, match="dim"):
        laplace_nr_path(1.0, EPS, bad, Noise.seeded(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sensitivity"):
        laplace_nr_path(0.0, EPS, 3, Noise.seeded(0))
    with pytest.raises(ValueError, match="too small"):
        laplace_nr_rates(1e6, (1e-9, 1.0))


def test_laplace_rates_never_exceed_the_charged_epsilon() -> None:
    """Δ_g·n_t/D ≤ ε_t read as its shortest decimal (what the ledger charges), within 2^-40 relative."""
    grid_sensitivity = 3.0
    rates = laplace_nr_rates(grid_sensitivity, EPS)
    for n, eps in zip(rates, EPS, strict=True):
        actual = Fraction(grid_sensitivity) * n / D
        assert actual <= Fraction(repr(eps))
        assert actual >= Fraction(repr(eps)) * (1 - Fraction(1, 1 << 40))
    actual_eps = laplace_nr_level_epsilons(grid_sensitivity, EPS)
    assert all(a <= e for a, e in zip(actual_eps, EPS, strict=True))
    scales = laplace_nr_scales(grid_sensitivity, EPS)
    assert np.all(np.diff(scales) < 0)
    assert all(s >= grid_sensitivity / e for s, e in zip(scales, EPS, strict=True))


def test_exact_coin_helpers() -> None:
    noise = Noise.seeded(3)
    # Huge exponents (Python ints) are exp-coins that essentially never pass, but are drawn exactly.
    big = exp_neg_coins(noise, np.array([1 << 70, 0, D], dtype=object))
    assert not big[0]
    assert big[1]
    assert ratio_coins(noise, np.array([5]), np.array([5]))[0]
    assert not ratio_coins(noise, np.array([0]), np.array([5]))[0]
    with pytest.raises(ValueError, match="ratio_coins"):
        ratio_coins(noise, np.array([6]), np.array([5]))


def test_units_to_values_is_exact_on_the_grid() -> None:
    grid = Grid(-3)
    values = units_to_values([1, -7, 1 << 52], grid)
    assert list(values) == [0.125, -0.875, 2.0**49]
    assert all(
        Fraction(v) / Fraction(grid.granularity) == int(Fraction(v) / Fraction(grid.granularity))
        for v in values
    )


# ----- Brownian (grid) -------------------------------------------------------------------------------------
def test_brownian_grid_and_costs_are_the_continuous_curve_within_the_rounding_term() -> None:
    delta, dim = 1.7, 3
    grid = brownian_grid(delta, VARIANCES, dim)
    ratios = [0.0, 4 / 9, 1 / 4]
    assert grid.granularity <= 2.0**-11 * min(1 - r for r in ratios) * delta / math.sqrt(dim)
    assert 2 * grid.granularity > 2.0**-11 * min(1 - r for r in ratios) * delta / math.sqrt(dim) * 0.999
    m = math.floor(delta / grid.granularity + 1 / 64) + 1  # the integer unit shift of one coordinate
    cumulative = brownian_cumulative_costs(float(m), VARIANCES, dim, grid)
    for level, t in enumerate(VARIANCES):
        continuous = delta**2 / (2 * t)
        assert continuous / (1 + 2.0**-11) <= cumulative[level] <= continuous * (1 + 2.0**-10) ** 2
    step = brownian_step_costs(float(m), VARIANCES, dim, grid)
    assert Fraction(cumulative[-1]) >= sum(Fraction(c) for c in step)
    for t, r, s2 in zip(VARIANCES, ratios, brownian_step_variances(VARIANCES, grid), strict=True):
        nominal = Fraction(t) * (1 - Fraction(r)) / Fraction(grid.granularity) ** 2
        assert nominal <= s2 <= nominal * (1 + Fraction(1, 1 << 11))


def test_brownian_step_is_on_the_grid_and_centred_on_the_bridge_mean() -> None:
    grid = Grid(-4)
    noise = Noise.seeded(7)
    units = np.array([100, -50], dtype=np.int64)
    first = brownian_step(noise, units, None, 0, VARIANCES, grid)
    assert all(isinstance(u, int) for u in first)
    second = brownian_step(noise, units, first, 1, VARIANCES, grid)
    assert len(second) == 2
    with pytest.raises(ValueError, match="previous"):
        brownian_step(noise, units, None, 1, VARIANCES, grid)
    # Mean of many draws at level 1 given Y_0 = 0: (1 − r)·V with r = 4/9.
    many = np.array(brownian_step(noise, np.full(4000, 100), [0] * 4000, 1, VARIANCES, grid))
    sd = math.sqrt(4 * (1 - 4 / 9)) / grid.granularity
    assert abs(many.mean() - (5 / 9) * 100) < 5 * sd / math.sqrt(4000)


# ----- lazy samplers and their JSON state ------------------------------------------------------------------
def test_lazy_laplace_state_is_json_and_deterministic_given_the_noise() -> None:
    state = LazyLaplaceNR.start(1.5, EPS, 4, Noise.seeded(5))
    assert LazyLaplaceNR.level(state) == 0
    assert LazyLaplaceNR.noise(state).shape == (4,)
    restored = json.loads(json.dumps(state))
    a = LazyLaplaceNR.advance(state, Noise.seeded(9))
    b = LazyLaplaceNR.advance(restored, Noise.seeded(9))
    assert np.array_equal(LazyLaplaceNR.noise(a), LazyLaplaceNR.noise(b))
    assert LazyLaplaceNR.level(a) == 1
    last = LazyLaplaceNR.advance(a, Noise.seeded(10))
    assert LazyLaplaceNR.level(last) == 2
    with pytest.raises(ValueError, match="last level"):
        LazyLaplaceNR.advance(last, Noise.seeded(11))


def test_lazy_brownian_state_is_json() -> None:
    grid = brownian_grid(1.0, VARIANCES, 2)
    state = LazyBrownianNR.start(1.5, VARIANCES, 2, grid)
    units = np.array([3, 4], dtype=np.int64)
    released, state = LazyBrownianNR.step(json.loads(json.dumps(state)), units, Noise.seeded(1))
    assert state["previous"] == released
    for _ in range(2):
        released, state = LazyBrownianNR.step(json.loads(json.dumps(state)), units, Noise.seeded(2))
    with pytest.raises(ValueError, match="past the last level"):
        LazyBrownianNR.step(state, units, Noise.seeded(3))


def test_lazy_state_validation() -> None:
    state = LazyLaplaceNR.start(1.0, EPS, 2, Noise.seeded(0))
    for bad in (
        {**state, "sampler": "brownian_nr"},
        {**state, "noise": "secret"},
        {**state, "noise": [0.5, 0]},
        {**state, "noise": [True, 0]},
        {**state, "level": True},
        {**state, "level": -1},
        [],
    ):
        with pytest.raises(ValueError, match="not a laplace_nr sampler state"):
            LazyLaplaceNR.advance(bad, Noise.seeded(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a brownian_nr sampler state"):
        LazyBrownianNR.step(state, np.zeros(2, dtype=np.int64), Noise.seeded(0))


def test_lazy_laplace_move_edge_cases() -> None:
    noise = Noise.seeded(0)
    x = np.array([0, -3, 2, 10**6, -(10**6)], dtype=np.int64)
    a, c = D // 2, 6 * D // 10
    # Equal rates: the stay probability is 1, so nothing moves.
    assert np.array_equal(dlap_nr_advance(noise, x, a, a), x)
    moved = dlap_nr_advance(noise, np.tile(x, 400), a, c).reshape(400, 5)
    # Far-out coordinates almost surely move (stay probability e^{−(c−a)(1+|x|)}·… ≈ 0) towards 0.
    assert np.all(np.abs(moved[:, 3:]) < 10**6)
    # A coarse step (rate ratio 10^4) stays cheap and moves |x| towards the smaller scale.
    coarse = dlap_nr_advance(noise, np.full(200, 50_000, dtype=np.int64), D // 10_000, D)
    assert np.all(np.abs(coarse) < 50)


# ----- charges ---------------------------------------------------------------------------------------------
def test_laplace_charge_is_the_pure_level() -> None:
    for level, eps in enumerate(EPS):
        curve = laplace_nr_charge(EPS, level, DEFAULT_ORDERS)
        assert curve == RdpCurve.from_pure(eps, DEFAULT_ORDERS)
    for bad in (-1, 3, True):
        with pytest.raises(ValueError, match="stopped_level"):
            laplace_nr_charge(EPS, bad, DEFAULT_ORDERS)


def test_brownian_charge_is_alpha_times_the_cumulative_cost() -> None:
    delta, dim = 1.7, 1
    grid = brownian_grid(delta, VARIANCES, dim)
    m = float(math.floor(delta / grid.granularity + 1 / 64) + 1)
    cumulative = brownian_cumulative_costs(m, VARIANCES, dim, grid)
    for level, t in enumerate(VARIANCES):
        curve = brownian_nr_charge(m, VARIANCES, dim, grid, level, DEFAULT_ORDERS)
        assert curve.pure == math.inf
        for alpha, value in zip(DEFAULT_ORDERS, curve.values, strict=True):
            assert Fraction(value) >= Fraction(alpha) * Fraction(cumulative[level])
            assert value <= alpha * delta**2 / (2 * t) * (1 + 2.0**-10) ** 2 * (1 + 1e-12)
    # Monotone: a later (less noisy) level is charged more at every order.
    curves = [brownian_nr_charge(m, VARIANCES, dim, grid, j, DEFAULT_ORDERS) for j in range(3)]
    assert curves[0] <= curves[1] <= curves[2]


def test_shared_coin_counterexample_of_the_note() -> None:
    """Note P1/T7 (closed form): d = 10, ε = (0.1, 1), Δ = 1, output o = v at level 0: log p_v/p_{v+e1}.

    One shared coin: ≈ 0.99999999 ≫ 0.1; per-coordinate coins: exactly 0.1 (only coordinate 1 differs).
    """
    b0, b1, rho, d = 10.0, 1.0, 0.01, 10

    def lap(x: float, b: float) -> float:
        return math.exp(-abs(x) / b) / (2 * b)

    def mix(x: float) -> float:  # density of Lap(b1) + Lap(b0)
        return (b1 * math.exp(-abs(x) / b1) - b0 * math.exp(-abs(x) / b0)) / (2 * (b1**2 - b0**2))

    def shared(shift: float) -> float:
        return rho * lap(shift, b1) * lap(0, b1) ** (d - 1) + (1 - rho) * mix(shift) * mix(0) ** (d - 1)

    def per_coordinate(shift: float) -> float:
        return rho * lap(shift, b1) + (1 - rho) * mix(shift)

    assert math.log(shared(0.0) / shared(1.0)) == pytest.approx(0.99999999, abs=1e-8)
    assert math.log(per_coordinate(0.0) / per_coordinate(1.0)) == pytest.approx(0.1, abs=1e-12)


# ----- InteractiveAboveThreshold (Ligett et al. Lemma 2.8) -------------------------------------------------
N_PAPER, LAMBDA, T_LEVELS, GAMMA = 100_000, 0.005, 1000, 0.1
M_RIDGE = 1 / math.sqrt(LAMBDA)
M_LOGISTIC = math.sqrt(2 * math.log(2) / LAMBDA)
DQ_RIDGE = (M_RIDGE + 1) ** 2 / N_PAPER
DQ_LOGISTIC = 2 * M_LOGISTIC / N_PAPER


def test_calibrations_match_the_note_test_vectors() -> None:
    """Note T12 and §4.5: ε_0·α (paper theorem) and ε_A·α (reference code, C2 + C3), T = 1000, γ = 0.1."""
    alpha = 0.05
    paper_ridge = iat_paper_calibration(DQ_RIDGE, alpha, GAMMA, T_LEVELS, target=-alpha)
    assert paper_ridge.epsilon_a * alpha == pytest.approx(0.3633142, rel=1e-6)
    assert paper_ridge.threshold == pytest.approx(-alpha / 2)
    assert paper_ridge.calibration == "paper-theorem"
    paper_logistic = iat_paper_calibration(DQ_LOGISTIC, alpha, GAMMA, T_LEVELS)
    assert paper_logistic.epsilon_a * alpha == pytest.approx(0.0527692, rel=1e-5)
    ref_ridge = iat_reference_calibration(DQ_RIDGE, alpha, GAMMA, T_LEVELS, target=-alpha)
    assert ref_ridge.epsilon_a * alpha == pytest.approx(0.1111673, rel=1e-6)
    assert ref_ridge.epsilon_a == pytest.approx(2.2233, abs=1e-4)
    # Threshold on the excess s = 0.12007α, so W = −α + (α − s) = −s in the f = −excess form.
    assert ref_ridge.threshold == pytest.approx(-0.12007 * alpha, rel=1e-4)
    assert ref_ridge.calibration == "reference-code"
    ref_logistic = iat_reference_calibration(DQ_LOGISTIC, alpha, GAMMA, T_LEVELS)
    assert ref_logistic.epsilon_a * alpha == pytest.approx(0.0161464, rel=1e-5)
    # The paper's calibration is 3.27× the reference code's (Ligett et al. 2017).
    assert paper_ridge.epsilon_a / ref_ridge.epsilon_a == pytest.approx(3.27, abs=0.01)
    for bad in ((0.0, 1.0, 0.1, 10), (1.0, 0.0, 0.1, 10), (1.0, 1.0, 1.0, 10), (1.0, 1.0, 0.1, 0)):
        with pytest.raises(ValueError, match="must"):
            iat_paper_calibration(*bad)


def test_iat_scales_are_2_and_4_delta_over_eps_rounded_up() -> None:
    threshold_scale, query_scale = iat_scales(0.7, 3.0)
    assert Fraction(threshold_scale) >= Fraction(6.0) / Fraction(0.7)
    assert Fraction(query_scale) >= Fraction(12.0) / Fraction(0.7)


def test_iat_instance_draws_threshold_once_and_halts() -> None:
    rng = Noise.seeded(3)
    iat = InteractiveAboveThreshold(0.0, 1.0, 1.0, rng)
    state = iat.to_state()
    assert not iat.test(-1e9, rng)
    assert iat.to_state()["noisy_threshold"] == state["noisy_threshold"]  # never re-drawn
    assert iat.test(1e9, rng)
    assert iat.halted
    with pytest.raises(ValueError, match="halted"):
        iat.test(1e9, rng)
    # The repr never shows the noisy threshold.
    assert str(state["noisy_threshold"]) not in repr(iat)
    restored = InteractiveAboveThreshold.from_state(json.loads(json.dumps(state)))
    assert restored.to_state() == state
    for bad in ({**state, "halted": 1}, {k: v for k, v in state.items() if k != "threshold"}):
        with pytest.raises(ValueError, match="not an InteractiveAboveThreshold state"):
            InteractiveAboveThreshold.from_state(bad)
    with pytest.raises(ValueError, match="Noise"):
        InteractiveAboveThreshold(0.0, 1.0, 1.0)
    fresh = InteractiveAboveThreshold(0.0, 1.0, 1.0, rng)
    with pytest.raises(ValueError, match="finite"):
        fresh.test(math.nan, rng)


def test_interactive_above_threshold_queries_lazily_and_charges_lemma_2_8() -> None:
    levels = (0.1, 0.2, 0.4, 0.8)
    calls: list[int] = []

    def query(t: int) -> float:
        calls.append(t)
        return 1e9 if t == 2 else -1e9

    outcome = interactive_above_threshold(query, levels, 0.0, 0.5, 1.0, Noise.seeded(0))
    assert outcome.level == 2
    assert calls == [0, 1, 2]  # never evaluated beyond the first pass
    assert outcome.charge.is_pure
    assert Fraction(outcome.charge.pure) >= Fraction(0.5) + Fraction(0.4)  # rounded up, never down
    assert outcome.charge.pure == pytest.approx(0.9, rel=1e-14)
    assert set(outcome.charge.values) == {outcome.charge.pure}
    assert outcome.epsilon == outcome.charge.pure
    never = interactive_above_threshold(lambda t: -1e9, levels, 0.0, 0.5, 1.0, Noise.seeded(0))
    assert never.level is None
    assert never.charge.pure == pytest.approx(0.5 + 0.8, rel=1e-14)  # ⊥: ε_A + ε_{T−1}
    assert Fraction(never.charge.pure) >= Fraction(0.5) + Fraction(0.8)
    assert iat_charge(0.1, (0.2,), 0, DEFAULT_ORDERS).pure >= 0.1 + 0.2
    with pytest.raises(ValueError, match="outside"):
        iat_charge(0.1, levels, 4, DEFAULT_ORDERS)


# ===== Noise reduction and accuracy-first on the grid, against independent oracles =========================
# (docs/privacy/noise_reduction.md#noise-reduction,
# docs/privacy/finite_precision_reduction.md#fp-noise-reduction; each test at most a few seconds, fixed
# seeds):
# * The lazy discrete Laplace step at a FIXED current noise x (not only in law): stay probability
#   e^{−(b−a)(1+|x|)}·(1 − q_a²)/(1 − q_b²) and the move law ∝ q_a^{|x−y|}·q_b^{|y|}, chi-square against the
#   exact pmf, for negative, zero and positive x; power: the eager-direction law x + DLap(q_a) is rejected.
# * The Bayes-reversal identity behind Theorem NR-2 for the lazy kernel, exactly (sums over Z): for every
#   (y_0, y_1), the log-ratio of the two-level prefix pmf equals the level-1 discrete Laplace log-ratio.
# * The Laplace NR step is NOT per-step sound with telescoped charges (exact sum): the conditional Rényi
#   divergence of step 1 given an unlucky y_0 exceeds ε_1 − ε_0 at α = 8, so sessions stay on the pointwise
#   whole-session route and never commit/refund per step.
# * The released check is post-processing: the one-shot level/charge is a function of the released path and
#   public scales only, while the private check does read the data (control).
# * Grid Brownian ex-post RDP at α = 2 with two stopping rules other than those of the tests above (a rule on
#   two consecutive released values, and an AboveThreshold-like stop that reads the true value):
#   E[exp((α−1)(L_S − α·C_S))] ≤ 1 within 5 se. Control: a look-ahead rule gives ≫ 1.
# * Sessions: zero steps → zero; charges depend only on the transcript length; IAT over Brownian adds ε_A at
#   every order and keeps the pure slot +∞.


SCHEMA = DatasetSchema.model_validate(
    {
        "columns": [{"name": "thread", "type": "int", "min": 1, "max": 5}],
        "neighboring": "add_remove",
    }
)
CTX = PublicContext(SCHEMA, None, DEFAULT_ORDERS)
COUNT = {"kind": "count", "where": [{"column": "thread", "op": "eq", "value": 2}]}


def _table(twos: int, others: int = 50) -> dict[str, np.ndarray]:
    return {"thread": np.array([2] * twos + [3] * others, dtype=np.int64)}


# ----- lazy discrete Laplace kernel at a fixed current noise ------------------------------------------------
LIMIT = 200
Z = np.arange(-LIMIT, LIMIT + 1)


def _pmf(q: float) -> np.ndarray:
    result: np.ndarray = (1 - q) / (1 + q) * q ** np.abs(Z)
    return result


def _kernel(x: int, qa: float, qb: float) -> np.ndarray:
    """P(η_1 = y | η_0 = x) from the eager joint law: P_b(y)·[ρ·1(x = y) + (1 − ρ)·P_a(x − y)] / P_a(x)."""
    rho = (qb / (1 - qb) ** 2) / (qa / (1 - qa) ** 2)
    joint = _pmf(qb) * (1 - rho) * (1 - qa) / (1 + qa) * qa ** np.abs(x - Z)
    joint[x + LIMIT] += rho * _pmf(qb)[x + LIMIT]
    result: np.ndarray = joint / joint.sum()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("x", [-4, 0, 1, 9])
def test_lazy_laplace_step_law_at_fixed_noise(x: int) -> None:
    low, high = 4 * D // 10, 11 * D // 10  # rates a = 0.4, b = 1.1
    qa, qb = math.exp(-low / D), math.exp(-high / D)
    n = 60_000
    out = dlap_nr_advance(Noise.seeded(1000 + x), np.full(n, x, dtype=np.int64), low, high)
    stay = out == x
    p_stay = math.exp(-(high - low) / D * (1 + abs(x))) * (1 - qa**2) / (1 - qb**2)
    kernel = _kernel(x, qa, qb)
    # The move part of the kernel can also land on x (W = 0 is not "stay"): compare the whole law.
    assert kernel[x + LIMIT] >= p_stay
    assert stats.binomtest(int(stay.sum()), n, float(kernel[x + LIMIT])).pvalue > 1e-4
    counts = np.bincount(out + LIMIT, minlength=Z.size)
    big = kernel * n >= 5
    observed = np.append(counts[big], n - counts[big].sum())
    expected = np.append(kernel[big] * n, n - kernel[big].sum() * n)
    assert stats.chisquare(observed, expected).pvalue > 1e-4
    # power: the eager-direction (wrong) law "x + DLap(q_a)" is rejected
    wrong = np.roll(_pmf(qa), x)
    observed_w = np.append(counts[wrong * n >= 5], n - counts[wrong * n >= 5].sum())
    expected_w = np.append(wrong[wrong * n >= 5] * n, n - wrong[wrong * n >= 5].sum() * n)
    assert stats.chisquare(observed_w, expected_w).pvalue < 1e-6


def test_prefix_ratio_of_the_lazy_chain_is_the_last_level_ratio() -> None:
    """Theorem NR-2 through the lazy kernel, exactly: log p_v(y0, y1)/p_v′(y0, y1) = x_1(|y1 − v′| − |y1 − v|)
    (x_1 = 1.3, γ = 1)."""
    qa, qb = math.exp(-0.5), math.exp(-1.3)
    v, vp = 0, 1
    p0 = _pmf(qa)
    for y0 in (-2, 0, 1, 3):
        kernel_v, kernel_vp = _kernel(y0 - v, qa, qb), _kernel(y0 - vp, qa, qb)
        for y1 in (-1, 0, 1, 3):
            lhs = math.log(p0[y0 - v + LIMIT] * kernel_v[y1 - v + LIMIT]) - math.log(
                p0[y0 - vp + LIMIT] * kernel_vp[y1 - vp + LIMIT]
            )
            rhs = 1.3 * (abs(y1 - vp) - abs(y1 - v))
            assert lhs == pytest.approx(rhs, abs=1e-9)
            assert lhs <= 1.3 + 1e-9


def test_laplace_nr_step_is_not_per_step_sound() -> None:
    """Conditional D_α of step 1 given y_0 = 3 (v = 0 vs v′ = 1, ε = (0.5, 1), γ = 1) exceeds ε_1 − ε_0 at
    α = 8 (exact sum: ≈ 1.39 > 0.5). So a Laplace NR session must never be charged per step with telescoped
    increments: its soundness is the whole-session pointwise bound (prefix loss ≤ ε_j), only."""
    qa, qb, alpha, y0 = math.exp(-0.5), math.exp(-1.0), 8.0, 3
    p = _kernel(y0, qa, qb)  # y_1 = 0 + η_1
    q = np.zeros_like(p)
    q[1:] = _kernel(y0 - 1, qa, qb)[:-1]  # y_1 = 1 + η_1
    inside = (p > 0) & (q > 0)
    log_terms = alpha * np.log(p[inside]) + (1 - alpha) * np.log(q[inside])
    d_alpha = float(np.logaddexp.reduce(log_terms)) / (alpha - 1)
    assert d_alpha > 1.0 - 0.5 + 0.5
    assert d_alpha <= 0.5 + 1.0  # the pointwise bound of the two-level prefix (ε_0 + ε_1)


# ----- the released check is post-processing of the released path ------------------------------------------
def _fixed_path_run(
    monkeypatch: pytest.MonkeyPatch, mech: Any, params: Any, released: np.ndarray, twos: int
) -> Any:
    def walk(*_args: Any) -> Iterator[np.ndarray]:
        yield from released

    monkeypatch.setattr(mech.family, "walk", walk)
    return mech.run(params, CTX, _table(twos), Noise.seeded(5))


@pytest.mark.parametrize("family", ["laplace", "gaussian"])
def test_released_check_depends_only_on_released_values(monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    mech: AccuracyFirst
    if family == "laplace":
        mech = ACCURACY_FIRST_LAPLACE
        grid: dict[str, Any] = {"epsilons": (0.01, 0.03, 0.1, 0.3, 1.0)}
    else:
        mech = ACCURACY_FIRST_GAUSSIAN
        grid = {"variances": (1e4, 1e3, 100.0, 10.0, 1.0)}
    params = mech.params_model.model_validate({"query": COUNT, "target": {"relative": 0.2}, **grid})
    plan = mech._plan(params, CTX)  # type: ignore[arg-type]
    scales = plan.scales
    # Released values chosen so that the public rule σ(2 + r) ≤ r·ŷ first holds at level 2.
    released = np.array([[-5.0], [30.0], [float(math.ceil(11.0 * scales[2])) + 1.0], [60.0], [61.0]])
    levels = set()
    for twos in (40, 41, 7, 200):  # neighbours (40, 41) and far-apart truths
        release = _fixed_path_run(monkeypatch, mech, params, released, twos)
        levels.add(release.output["level"])
        assert release.output["value"] == released[2, 0]
        assert release.realized == mech.family.charge(plan, 2, DEFAULT_ORDERS)
    assert levels == {2}
    # Control: the private check reads the data, so the same released path gives different levels.
    private = mech.params_model.model_validate(
        {
            "query": COUNT,
            "target": {"relative": 0.2},
            "check": "private",
            "private": {"epsilon_a": 5.0, "threshold": 0.0},
            **grid,
        }
    )
    near = _fixed_path_run(monkeypatch, mech, private, released, round(released[2, 0]))
    far = _fixed_path_run(monkeypatch, mech, private, released, 10_000)
    assert near.output["level"] != far.output["level"]
    assert far.output["reached"] is False


# ----- grid Brownian ex-post RDP at α = 2, other stopping rules -------------------------------------------
VARS = (8.0, 4.0, 1.0, 0.5)  # ratios 1/2, 1/4, 1/2: exact in binary, so the test's float means are exact
GRID = Grid(-8)


def _chain(v_units: int, n: int, seed: int) -> list[np.ndarray]:
    """The session's step function (``brownian_step``) run forward: Y_j in grid units, shape (n,) each."""
    noise = Noise.seeded(seed)
    units = np.full(n, v_units, dtype=np.int64)
    rows: list[list[int]] = []
    for level in range(len(VARS)):
        rows.append(brownian_step(noise, units, rows[-1] if rows else None, level, VARS, GRID))
    return [np.asarray(r, dtype=np.int64) for r in rows]


def _losses(rows: list[np.ndarray], v_units: int, vp_units: int) -> np.ndarray:
    """L_j = Σ_{i ≤ j} ((Y_i − m′_i)² − (Y_i − m_i)²)/(2σ_i²), exact means (binary ratios)."""
    variances = [float(s) for s in brownian_step_variances(VARS, GRID)]
    loss = np.zeros(rows[0].size)
    out = []
    for j, y in enumerate(rows):
        if j == 0:
            m, mp = np.full(y.size, float(v_units)), np.full(y.size, float(vp_units))
        else:
            r = VARS[j] / VARS[j - 1]
            previous = rows[j - 1].astype(float)
            m = np.floor((1 - r) * v_units + r * previous + 0.5)
            mp = np.floor((1 - r) * vp_units + r * previous + 0.5)
        loss = loss + ((y - mp) ** 2 - (y - m) ** 2) / (2 * variances[j])
        out.append(loss.copy())
    return np.vstack(out)


def _ex_post_mean(losses: np.ndarray, stop: np.ndarray, alpha: float = 2.0) -> tuple[float, float]:
    """E[exp((α−1)(L_S − α·C_S))] under D (v′ − v = 1, Δ₂ = 1 → 2^8 units)."""
    cumulative = np.asarray(brownian_cumulative_costs(float(2**8), VARS, 1, GRID))
    idx = np.arange(losses.shape[1])
    z = np.exp((alpha - 1.0) * (losses[stop, idx] - alpha * cumulative[stop]))
    return float(z.mean()), float(z.std() / math.sqrt(z.size))


def _first(hit: np.ndarray) -> np.ndarray:
    stop: np.ndarray = np.where(hit.any(axis=0), hit.argmax(axis=0), hit.shape[0] - 1)
    return stop


@pytest.mark.slow
def test_brownian_ex_post_rdp_alpha2_with_other_stopping_rules() -> None:
    n = 300_000
    v = 5 * 2**8
    rows = _chain(v, n, 2026)
    losses = _losses(rows, v, v + 2**8)
    y = np.vstack(rows).astype(float) / 2**8
    # (a) released values only: stop at the first drop y_j − y_{j−1} < −0.8
    drop = np.zeros_like(y, dtype=bool)
    drop[1:] = (y[1:] - y[:-1]) < -0.8
    mean, se = _ex_post_mean(losses, _first(drop))
    assert mean < 1.0 + 5 * se, (mean, se)
    # (b) an AboveThreshold-like stop on f_j = 0.3·5 − |y_j − 5| (reads the truth), independent noise
    rng = np.random.default_rng(99)  # the stopping rule's own randomness (test-side)
    noisy_w = rng.laplace(0.0, 2.6, n)
    passed = 1.5 - np.abs(y - 5.0) + rng.laplace(0.0, 5.2, y.shape) >= noisy_w[None, :]
    stop_iat = _first(passed)
    assert 0.2 < np.mean(stop_iat == 0) < 0.8  # the rule really stops at several levels
    mean, se = _ex_post_mean(losses, stop_iat)
    assert mean < 1.0 + 5 * se, (mean, se)
    assert mean > 1.0 - 0.05  # and the charge is nearly tight (rounding term only)
    # control: a look-ahead rule (not a stopping time) breaks the inequality by far
    cumulative = np.asarray(brownian_cumulative_costs(float(2**8), VARS, 1, GRID))
    mean, se = _ex_post_mean(losses, (losses - 2.0 * cumulative[:, None]).argmax(axis=0))
    assert mean > 1.3
    assert mean - 1.0 > 20 * se


# ----- charges ----------------------------------------------------------------------------------------------
def test_session_charges_depend_only_on_the_transcript_length() -> None:
    for session, grid in (
        (NR_LAPLACE_SESSION, {"epsilons": (0.1, 0.2, 0.4)}),
        (NR_GAUSSIAN_SESSION, {"variances": (9.0, 4.0, 1.0)}),
    ):
        params = session.params_model.model_validate({"query": COUNT, **grid})
        assert session.realized(params, CTX, [], False) == RdpCurve.zero(DEFAULT_ORDERS)
        for j in range(3):
            steps: list[tuple[dict[str, Any], dict[str, Any]]] = [
                ({}, {"level": i, "value": 123.0 * i}) for i in range(j + 1)
            ]
            expected = session.family.charge(session._plan(params, CTX), j, DEFAULT_ORDERS)
            assert session.realized(params, CTX, steps, j == 2) == expected
            assert expected <= session.worst_case(params, CTX)


def test_iat_over_brownian_adds_epsilon_a_at_every_order_and_no_pure_bound() -> None:
    variances = (9.0, 4.0, 1.0)
    params = ACCURACY_FIRST_GAUSSIAN.params_model.model_validate(
        {
            "query": COUNT,
            "variances": variances,
            "target": {"relative": 0.2},
            "check": "private",
            "private": {"epsilon_a": 0.7, "threshold": 0.0},
        }
    )
    worst = ACCURACY_FIRST_GAUSSIAN.worst_case(params, CTX)
    plan = ACCURACY_FIRST_GAUSSIAN._plan(params, CTX)  # type: ignore[arg-type]
    base = ACCURACY_FIRST_GAUSSIAN.family.charge(plan, 2, DEFAULT_ORDERS)
    assert worst.pure == math.inf
    for w, b in zip(worst.values, base.values, strict=True):
        assert w >= b + 0.7
    noise = Noise.seeded(3)
    for _ in range(20):
        release = ACCURACY_FIRST_GAUSSIAN.run(params, CTX, _table(40), noise)
        level_charge = ACCURACY_FIRST_GAUSSIAN.family.charge(plan, release.output["level"], DEFAULT_ORDERS)
        assert release.realized.pure == math.inf
        assert all(r >= b + 0.7 for r, b in zip(release.realized.values, level_charge.values, strict=True))
