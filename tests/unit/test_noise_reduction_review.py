"""Reviewer's regression tests for noise reduction / accuracy-first on the grid (independent of the
engineer's tests).

What is pinned here (each test ≤ a few seconds, fixed seeds):

* The lazy discrete Laplace step at a FIXED current noise x (not only in law): stay probability
  e^{−(b−a)(1+|x|)}·(1 − q_a²)/(1 − q_b²) and the move law ∝ q_a^{|x−y|}·q_b^{|y|}, chi-square against the
  exact pmf, for negative, zero and positive x; power: the eager-direction law x + DLap(q_a) is rejected.
* The Bayes-reversal identity behind Theorem NR-2 for the lazy kernel, exactly (sums over Z): for every
  (y_0, y_1), the log-ratio of the two-level prefix pmf equals the level-1 discrete Laplace log-ratio.
* The Laplace NR step is NOT per-step sound with telescoped charges (exact sum): the conditional Rényi
  divergence of step 1 given an unlucky y_0 exceeds ε_1 − ε_0 at α = 8, so sessions stay on the pointwise
  whole-session route and never commit/refund per step.
* The released check is post-processing: the one-shot level/charge is a function of the released path and
  public scales only, while the private check does read the data (control).
* Grid Brownian ex-post RDP at α = 2 with two stopping rules different from the engineer's (a rule on two
  consecutive released values, and an AboveThreshold-like stop that reads the true value):
  E[exp((α−1)(L_S − α·C_S))] ≤ 1 within 5 se. Control: a look-ahead rule gives ≫ 1.
* Sessions: zero steps → zero; charges depend only on the transcript length; IAT over Brownian adds ε_A at
  every order and keeps the pure slot +∞.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from scipy import stats

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve
from mechanisms.base import PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Grid, Noise
from mechanisms.noise.reduction import RATE_DENOMINATOR, dlap_nr_advance
from mechanisms.reduction.accuracy_first import (
    ACCURACY_FIRST_GAUSSIAN,
    ACCURACY_FIRST_LAPLACE,
    NR_GAUSSIAN_SESSION,
    NR_LAPLACE_SESSION,
    AccuracyFirst,
)
from mechanisms.reduction.noise_reduction import (
    brownian_cumulative_costs,
    brownian_step,
    brownian_step_variances,
)

D = RATE_DENOMINATOR


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
