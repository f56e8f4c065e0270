"""Noise-reduction samplers and charges (mechanisms/noise_reduction.py) and Ligett et al.'s
InteractiveAboveThreshold (mechanisms/above_threshold.py, Lemma 2.8 section).

Distribution tests and privacy audits are in tests/statistical/test_noise_reduction_audit.py; here: shapes,
validation, the JSON state, exact charge values, the note's closed-form test vectors (T7, T12, §4.5).
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest

from mechanisms.above_threshold import (
    InteractiveAboveThreshold,
    iat_charge,
    iat_paper_calibration,
    iat_reference_calibration,
    iat_scales,
    interactive_above_threshold,
)
from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve, laplace_scale
from mechanisms.noise_reduction import (
    LazyBrownianNR,
    LazyLaplaceNR,
    _lazy_laplace_move,
    brownian_nr_charge,
    brownian_nr_path,
    laplace_nr_charge,
    laplace_nr_path,
    laplace_nr_scales,
)

EPS = (0.1, 0.4, 1.0)
VARIANCES = (9.0, 4.0, 1.0)


# ----- eager samplers ------------------------------------------------------------------------------------
def test_laplace_path_shape_and_structure() -> None:
    path = laplace_nr_path(2.0, EPS, 1000, np.random.default_rng(0))
    assert path.shape == (3, 1000)
    assert np.all(np.isfinite(path))
    # Between adjacent levels a coordinate either stays exactly or moves; both happen.
    stays = path[:-1] == path[1:]
    assert stays.any()
    assert (~stays).any()
    assert laplace_nr_path(1.0, (0.5,), 7, np.random.default_rng(0)).shape == (1, 7)


@pytest.mark.parametrize(
    "epsilons", [(), (1.0, 1.0), (2.0, 1.0), (0.0, 1.0), (-1.0, 1.0), (1.0, math.inf), (1.0, math.nan)]
)
def test_invalid_epsilon_grids_are_refused(epsilons: tuple[float, ...]) -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"ε-grid|ε of the grid"):
        laplace_nr_path(1.0, epsilons, 3, rng)
    with pytest.raises(ValueError, match=r"ε-grid|ε of the grid"):
        LazyLaplaceNR.start(1.0, epsilons, 3, rng)


@pytest.mark.parametrize("variances", [(), (1.0, 1.0), (1.0, 2.0), (1.0, 0.0), (math.inf, 1.0)])
def test_invalid_variance_grids_are_refused(variances: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="variance"):
        brownian_nr_path(variances, 3, np.random.default_rng(0))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_invalid_dimension_and_sensitivity(bad: object) -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="dim"):
        laplace_nr_path(1.0, EPS, bad, rng)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sensitivity"):
        laplace_nr_path(0.0, EPS, 3, rng)


def test_laplace_scales_are_rounded_up_and_non_increasing() -> None:
    scales = laplace_nr_scales(3.0, EPS)
    assert all(Fraction(float(b)) >= Fraction(3.0) / Fraction(e) for b, e in zip(scales, EPS, strict=True))
    assert np.all(np.diff(scales) < 0)
    assert list(scales) == [laplace_scale(3.0, e) for e in EPS]


def test_brownian_path_is_cumulative_from_the_smallest_variance() -> None:
    path = brownian_nr_path(VARIANCES, 50_000, np.random.default_rng(1))
    assert path.shape == (3, 50_000)
    # Increments B(t_j) − B(t_{j+1}) are independent of B(t_{j+1}) (Brownian motion); quick sanity check.
    assert abs(np.corrcoef(path[0] - path[1], path[1])[0, 1]) < 0.03


# ----- lazy samplers and their JSON state ------------------------------------------------------------------
@pytest.mark.parametrize("sampler", ["laplace", "brownian"])
def test_lazy_state_is_json_and_deterministic_given_the_rng(sampler: str) -> None:
    if sampler == "laplace":
        start, advance, noise, level = (
            lambda rng: LazyLaplaceNR.start(1.5, EPS, 4, rng),
            LazyLaplaceNR.advance,
            LazyLaplaceNR.noise,
            LazyLaplaceNR.level,
        )
    else:
        start, advance, noise, level = (
            lambda rng: LazyBrownianNR.start(VARIANCES, 4, rng),
            LazyBrownianNR.advance,
            LazyBrownianNR.noise,
            LazyBrownianNR.level,
        )
    state = start(np.random.default_rng(5))
    assert level(state) == 0
    assert noise(state).shape == (4,)
    restored = json.loads(json.dumps(state))
    a = advance(state, np.random.default_rng(9))
    b = advance(restored, np.random.default_rng(9))
    assert np.array_equal(noise(a), noise(b))
    assert level(a) == 1
    last = advance(a, np.random.default_rng(10))
    assert level(last) == 2
    with pytest.raises(ValueError, match="last level"):
        advance(last, np.random.default_rng(11))


def test_lazy_state_validation() -> None:
    state = LazyLaplaceNR.start(1.0, EPS, 2, np.random.default_rng(0))
    rng = np.random.default_rng(0)
    for bad in (
        {**state, "sampler": "brownian_nr"},
        {**state, "noise": "secret"},
        {**state, "noise": [math.nan, 0.0]},
        {**state, "level": True},
        {**state, "level": -1},
        [],
    ):
        with pytest.raises(ValueError, match="not a laplace_nr sampler state"):
            LazyLaplaceNR.advance(bad, rng)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a brownian_nr sampler state"):
        LazyBrownianNR.advance(state, rng)


def test_lazy_laplace_move_edge_cases() -> None:
    rng = np.random.default_rng(0)
    x = np.array([0.0, -3.0, 2.5, 1e6, -1e6])
    # Equal scales: the stay probability (a/c)·e^0 is 1, so nothing moves (and no 0/0).
    assert np.array_equal(_lazy_laplace_move(x, 2.0, 2.0, rng), x)
    moved = _lazy_laplace_move(np.tile(x, 2000), 0.5, 0.6, rng)
    assert np.all(np.isfinite(moved))
    # Far-out coordinates almost surely move (stay probability (a/c)e^{−(c−a)|x|} ≈ 0) towards 0.
    far = moved.reshape(2000, 5)[:, 3:]
    assert np.all(np.abs(far) < 1e6)


# ----- charges ---------------------------------------------------------------------------------------------
def test_laplace_charge_is_the_pure_level() -> None:
    for level, eps in enumerate(EPS):
        curve = laplace_nr_charge(EPS, level, DEFAULT_ORDERS)
        assert curve == RdpCurve.from_pure(eps, DEFAULT_ORDERS)
    for bad in (-1, 3, True):
        with pytest.raises(ValueError, match="stopped_level"):
            laplace_nr_charge(EPS, bad, DEFAULT_ORDERS)


def test_brownian_charge_is_alpha_delta_squared_over_2t_rounded_up() -> None:
    delta = 1.7
    for level, t in enumerate(VARIANCES):
        curve = brownian_nr_charge(delta, VARIANCES, level, DEFAULT_ORDERS)
        assert curve.pure == math.inf
        for alpha, value in zip(DEFAULT_ORDERS, curve.values, strict=True):
            exact = Fraction(alpha) * Fraction(delta) ** 2 / (2 * Fraction(t))
            assert Fraction(value) >= exact
            assert value <= float(exact) * (1 + 1e-13)
    # Monotone: a later (less noisy) level is charged more at every order.
    curves = [brownian_nr_charge(delta, VARIANCES, j, DEFAULT_ORDERS) for j in range(3)]
    assert curves[0] <= curves[1] <= curves[2]
    # A positive loss that underflows is never charged 0.
    tiny = brownian_nr_charge(1e-200, (1e200,), 0, DEFAULT_ORDERS)
    assert all(v > 0 for v in tiny.values)


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
    rng = np.random.default_rng(3)
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
    with pytest.raises(ValueError, match="rng"):
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

    outcome = interactive_above_threshold(query, levels, 0.0, 0.5, 1.0, np.random.default_rng(0))
    assert outcome.level == 2
    assert calls == [0, 1, 2]  # never evaluated beyond the first pass
    assert outcome.charge.is_pure
    assert Fraction(outcome.charge.pure) >= Fraction(0.5) + Fraction(0.4)  # rounded up, never down
    assert outcome.charge.pure == pytest.approx(0.9, rel=1e-14)
    assert set(outcome.charge.values) == {outcome.charge.pure}
    assert outcome.epsilon == outcome.charge.pure
    never = interactive_above_threshold(lambda t: -1e9, levels, 0.0, 0.5, 1.0, np.random.default_rng(0))
    assert never.level is None
    assert never.charge.pure == pytest.approx(0.5 + 0.8, rel=1e-14)  # ⊥: ε_A + ε_{T−1}
    assert Fraction(never.charge.pure) >= Fraction(0.5) + Fraction(0.8)
    assert iat_charge(0.1, (0.2,), 0, DEFAULT_ORDERS).pure >= 0.1 + 0.2
    with pytest.raises(ValueError, match="outside"):
        iat_charge(0.1, levels, 4, DEFAULT_ORDERS)
