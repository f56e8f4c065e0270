"""Noise-reduction samplers and charges (mechanisms/reduction/noise_reduction.py) and Ligett et al.'s
InteractiveAboveThreshold (mechanisms/threshold/above_threshold.py, Lemma 2.8 section).

Distribution tests and privacy audits are in tests/statistical/test_noise_reduction_audit.py; here: shapes,
validation, the JSON state, exact charge values, the note's closed-form test vectors (T7, T12, §4.5).
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve
from mechanisms.noise import Grid, Noise
from mechanisms.noise.reduction import (
    RATE_DENOMINATOR,
    dlap_nr_advance,
    exp_neg_coins,
    ratio_coins,
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
from mechanisms.threshold.above_threshold import (
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
    # The paper's calibration is 3.27× the reference one (note P11).
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
