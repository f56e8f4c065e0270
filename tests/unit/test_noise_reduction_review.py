"""Reviewer's regression tests for noise reduction / accuracy-first (independent of the engineer's tests).

What is pinned here (each test ≤ a few seconds, fixed seeds):

* The lazy Laplace step at a FIXED current noise x (not only in law): stay probability (a/c)·e^{−(c−a)|x|}
  and the move law ∝ e^{−a|x−y| − c|y|}, against closed-form CDFs (KS), for negative, zero and positive x.
* The Bayes-reversal identity behind Theorem NR-2 for the lazy kernel: for every (y_0, y_1), the log-ratio of
  the two-level prefix density equals the level-1 Laplace log-ratio (the stay atom and the continuous part).
* The Laplace NR step is NOT per-step sound with telescoped charges: the conditional Rényi divergence of
  step 1 given an unlucky y_0 exceeds ε_1 − ε_0 at α = 8 (so sessions must stay on the pointwise
  whole-session route of privacy.md §3 and never commit/refund per step).
* The released check is post-processing: the one-shot level/charge is a function of the released path and
  public scales only (same released path, different truths → same level and charge), while the private
  check does read the data (control).
* Brownian ex-post RDP at α = 2 (Theorem BR-2 / IAT-2), Monte Carlo through the LAZY (session) sampler with
  two stopping rules different from the engineer's: a rule on two consecutive released values, and an
  InteractiveAboveThreshold stop that reads the true value; E[exp((α−1)(L_S − αΔ²/(2t_S)))] = 1 within 5 se.
  Control: a look-ahead (non-stopping-time) rule gives ≫ 1, so the order "AT reads y_t before deciding"
  matters.
* Sessions: zero steps → zero; charges depend only on the transcript length; IAT over Brownian adds ε_A at
  every order and keeps the pure slot +∞.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from scipy import integrate, stats

from mechanisms.above_threshold import iat_scales
from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve
from mechanisms.accuracy_first import (
    ACCURACY_FIRST_GAUSSIAN,
    ACCURACY_FIRST_LAPLACE,
    NR_GAUSSIAN_SESSION,
    NR_LAPLACE_SESSION,
    AccuracyFirst,
)
from mechanisms.base import PublicContext
from mechanisms.noise_reduction import (
    LazyBrownianNR,
    _lazy_laplace_move,
    brownian_nr_charge,
    laplace_nr_scales,
)
from mechanisms.schema import DatasetSchema

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


# ----- lazy Laplace kernel at a fixed current noise ---------------------------------------------------------
def _move_cdf(y: np.ndarray, x: float, a: float, c: float) -> np.ndarray:
    """CDF of the move law ∝ e^{−a|x−y| − c|y|} (closed form; x < 0 by mirroring)."""
    if x < 0:
        return 1.0 - _move_cdf(-y, -x, a, c)
    g, s = c - a, a + c
    m1 = 1.0 / s
    m2 = -math.expm1(-g * x) / g
    m3 = math.exp(-g * x) / s
    total = m1 + m2 + m3
    low = np.exp(s * np.minimum(y, 0.0)) / s
    mid = np.where(y <= 0, 0.0, -np.expm1(-g * np.clip(y, 0.0, x)) / g)
    high = np.where(y <= x, 0.0, math.exp(-g * x) * -np.expm1(-s * (np.maximum(y, x) - x)) / s)
    cdf = np.where(y < 0, low, m1 + mid + high)
    return np.asarray(cdf / total)


@pytest.mark.parametrize("x", [-2.5, 0.0, 0.7, 4.0])
def test_lazy_laplace_step_law_at_fixed_noise(x: float) -> None:
    a, c = 0.4, 1.1  # 1/b_t, 1/b_{t+1}
    n = 60_000
    rng = np.random.default_rng(int(1000 + 10 * x))
    out = _lazy_laplace_move(np.full(n, x), a, c, rng)
    stay = out == x
    p_stay = (a / c) * math.exp(-(c - a) * abs(x))
    # exact binomial two-sided test at 1e-4
    assert stats.binomtest(int(stay.sum()), n, p_stay).pvalue > 1e-4
    moved = out[~stay]
    ks = stats.kstest(moved, lambda y: _move_cdf(np.asarray(y), x, a, c))
    assert ks.pvalue > 1e-4
    # power: the eager-direction (wrong) law "x + Lap(1/a)" is rejected
    wrong = stats.kstest(moved, lambda y: stats.laplace.cdf(np.asarray(y), loc=x, scale=1 / a))
    assert wrong.pvalue < 1e-6


def _lazy_two_level_logdensity(y0: float, y1: float, v: float, e0: float, e1: float, delta: float) -> float:
    """log p_v(y_0, y_1) (lazy chain): Lap(Δ/ε_0) at level 0, then the reverse kernel (continuous part)."""
    a, c = e0 / delta, e1 / delta
    x, y = y0 - v, y1 - v
    level0 = math.log(a / 2) - a * abs(x)
    stay = (a / c) * math.exp(-(c - a) * abs(x))
    z = integrate.quad(lambda t: math.exp(-a * abs(x - t) - c * abs(t)), -80, 80, points=[0.0, x], limit=200)[
        0
    ]
    return level0 + math.log(1 - stay) + (-a * abs(x - y) - c * abs(y)) - math.log(z)


def test_prefix_ratio_of_the_lazy_chain_is_the_last_level_ratio() -> None:
    """Theorem NR-2 through the lazy kernel: log p_v(y0,y1)/p_v'(y0,y1) = ε_1(|y1 − v'| − |y1 − v|)/Δ."""
    e0, e1, delta, v, vp = 0.5, 1.3, 1.0, 0.0, 1.0
    for y0 in (-2.0, 0.3, 0.9, 3.0):
        for y1 in (-1.0, 0.2, 0.8, 2.5):
            lhs = _lazy_two_level_logdensity(y0, y1, v, e0, e1, delta) - _lazy_two_level_logdensity(
                y0, y1, vp, e0, e1, delta
            )
            rhs = e1 * (abs(y1 - vp) - abs(y1 - v)) / delta
            assert lhs == pytest.approx(rhs, abs=1e-7)
            assert lhs <= e1 + 1e-9
        # the stay atom: p_v(y0) · P_v(stay | y0) ratio = level-1 ratio at y1 = y0
        a, c = e0 / delta, e1 / delta

        def atom(v_: float, y0: float = y0, a: float = a, c: float = c) -> float:
            x = y0 - v_
            return math.log(a / 2) - a * abs(x) + math.log(a / c) - (c - a) * abs(x)

        assert atom(v) - atom(vp) == pytest.approx(e1 * (abs(y0 - vp) - abs(y0 - v)) / delta, abs=1e-12)


def test_laplace_nr_step_is_not_per_step_sound() -> None:
    """Conditional D_α of step 1 given y_0 = 3 (v = 0 vs v' = 1, ε = (0.5, 1)) exceeds ε_1 − ε_0 at α = 8.

    So a Laplace NR session must never be charged per step with telescoped increments (e.g. commit-as-you-go
    or per-step refunds): its soundness is the whole-session pointwise bound (prefix loss ≤ ε_j), only.
    """
    e0, e1, alpha, y0 = 0.5, 1.0, 8.0, 3.0
    a, c = e0, e1

    def law(x: float) -> tuple[float, float]:
        stay = (a / c) * math.exp(-(c - a) * abs(x))
        z = integrate.quad(lambda t: math.exp(-a * abs(x - t) - c * abs(t)), -80, 80, points=[0.0, x])[0]
        return stay, math.log((1 - stay) / z)

    s_p, lz_p = law(y0 - 0.0)
    s_q, lz_q = law(y0 - 1.0)

    def log_ratio_integrand(y: float) -> float:
        lp = lz_p - a * abs(y0 - y) - c * abs(y)
        lq = lz_q - a * abs(y0 - 1.0 - y) - c * abs(y)
        return math.exp(alpha * lp + (1 - alpha) * lq)

    cont = integrate.quad(log_ratio_integrand, -80, 80, points=[-1.0, 0.0, 2.0, 3.0], limit=400)[0]
    atom = s_p**alpha * s_q ** (1 - alpha)
    d_alpha = math.log(atom + cont) / (alpha - 1)
    assert d_alpha > e1 - e0 + 0.1  # ≈ 0.619 > 0.5
    # while the whole-prefix loss stays ≤ ε_1 pointwise (previous test), i.e. the session's route is sound.


# ----- the released check is post-processing of the released path ------------------------------------------
def _fixed_path_run(
    monkeypatch: pytest.MonkeyPatch, mech: Any, params: Any, released: np.ndarray, twos: int
) -> Any:
    truth = float(twos)
    monkeypatch.setattr(mech.family, "path", lambda *_args: released - truth)
    return mech.run(params, CTX, _table(twos), np.random.default_rng(5))


@pytest.mark.parametrize("family", ["laplace", "gaussian"])
def test_released_check_depends_only_on_released_values(monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    mech: AccuracyFirst
    if family == "laplace":
        mech = ACCURACY_FIRST_LAPLACE
        grid = {"epsilons": (0.01, 0.03, 0.1, 0.3, 1.0)}
        scales = laplace_nr_scales(1.0, grid["epsilons"])
    else:
        mech = ACCURACY_FIRST_GAUSSIAN
        grid = {"variances": (1e4, 1e3, 100.0, 10.0, 1.0)}
        scales = np.sqrt(np.array(grid["variances"]))
    params = mech.params_model.model_validate({"query": COUNT, "target": {"relative": 0.2}, **grid})
    # Released values chosen so that the public rule σ(2 + r) ≤ r·ŷ first holds at level 2.
    released = np.array([[-5.0], [30.0], [11.0 * scales[2] + 1.0], [60.0], [61.0]])
    levels = set()
    for twos in (40, 41, 7, 200):  # neighbours (40, 41) and far-apart truths
        release = _fixed_path_run(monkeypatch, mech, params, released, twos)
        levels.add(release.output["level"])
        assert release.output["value"] == pytest.approx(released[2, 0], rel=1e-12)
        assert release.realized == mech.family.charge(1.0, mech.family.grid(params), 2, DEFAULT_ORDERS)
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


# ----- Brownian ex-post RDP at α = 2, lazy (session) sampler, other stopping rules -------------------------
VARS = (9.0, 4.0, 2.0, 1.0)


def _lazy_brownian(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    state = LazyBrownianNR.start(VARS, n, rng)
    rows = [LazyBrownianNR.noise(state)]
    for _ in VARS[1:]:
        state = LazyBrownianNR.advance(state, rng)
        rows.append(LazyBrownianNR.noise(state))
    return np.array(rows)


def _ex_post_mean(noise: np.ndarray, stop: np.ndarray, alpha: float = 2.0) -> tuple[float, float]:
    """E[exp((α−1)(L_S − charge_S))] under D, v − v' = −1 (Δ₂ = 1), charge from brownian_nr_charge."""
    t = np.asarray(VARS)[:, None]
    loss = -noise / t + 1.0 / (2.0 * t)
    charge = np.array([brownian_nr_charge(1.0, VARS, j, (alpha,)).values[0] for j in range(len(VARS))])
    idx = np.arange(noise.shape[1])
    z = np.exp((alpha - 1.0) * (loss[stop, idx] - charge[stop]))
    return float(z.mean()), float(z.std() / math.sqrt(z.size))


def _first(hit: np.ndarray) -> np.ndarray:
    stop: np.ndarray = np.where(hit.any(axis=0), hit.argmax(axis=0), hit.shape[0] - 1)
    return stop


def test_brownian_ex_post_rdp_alpha2_with_other_stopping_rules() -> None:
    n = 300_000
    noise = _lazy_brownian(n, 2026)
    v = 5.0
    y = v + noise
    # (a) released values only: stop at the first drop y_j − y_{j−1} < −0.8
    drop = np.zeros_like(y, dtype=bool)
    drop[1:] = (y[1:] - y[:-1]) < -0.8
    mean, se = _ex_post_mean(noise, _first(drop))
    assert abs(mean - 1.0) < 5 * se, (mean, se)
    # (b) InteractiveAboveThreshold on f_j = r|v| − |y_j − v| (reads the truth), scales from iat_scales
    rng = np.random.default_rng(99)
    threshold_scale, query_scale = iat_scales(1.0, 1.3)
    noisy_w = rng.laplace(0.0, threshold_scale, n)
    f = 0.3 * abs(v) - np.abs(y - v)
    passed = f + rng.laplace(0.0, query_scale, y.shape) >= noisy_w[None, :]
    stop_iat = _first(passed)
    assert 0.2 < np.mean(stop_iat == 0) < 0.8  # the rule really stops at several levels
    mean, se = _ex_post_mean(noise, stop_iat)
    assert abs(mean - 1.0) < 5 * se, (mean, se)
    # control: a look-ahead rule (not a stopping time) breaks the inequality by far
    t = np.asarray(VARS)[:, None]
    excess = (-noise / t + 1.0 / (2.0 * t)) - 2.0 / (2.0 * t)
    mean, se = _ex_post_mean(noise, excess.argmax(axis=0))
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
            expected = session.family.charge(1.0, session.family.grid(params), j, DEFAULT_ORDERS)
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
    base = brownian_nr_charge(1.0, variances, 2, DEFAULT_ORDERS)
    assert worst.pure == math.inf
    for w, b in zip(worst.values, base.values, strict=True):
        assert w >= b + 0.7
    rng = np.random.default_rng(3)
    for _ in range(20):
        release = ACCURACY_FIRST_GAUSSIAN.run(params, CTX, _table(40), rng)
        level_charge = brownian_nr_charge(1.0, variances, release.output["level"], DEFAULT_ORDERS)
        assert release.realized.pure == math.inf
        assert all(r >= b + 0.7 for r, b in zip(release.realized.values, level_charge.values, strict=True))
