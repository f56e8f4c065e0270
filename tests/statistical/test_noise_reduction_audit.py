"""Distribution tests and Monte Carlo privacy audits of noise reduction on a public grid.

Laplace: the discrete chain (``mechanisms.noise.reduction``) against its exact pmfs (chi-square), eager and
lazy. Brownian: the grid chain (discrete Gaussian bridge steps) against the continuous law it approximates,
and the ex-post RDP inequality of its charge. Every test uses a fixed seed and a stated false-alarm rate
(Bonferroni inside a test), and each family of checks has a power check: a deliberately wrong variant
(scale, stay probability, shared coin, under-charging accountant, float releases) that the same test, at the
same size, must reject.

Vectorisation: the coordinates of the samplers are independent chains, so N independent runs of a 1-D
chain are one call with ``dim = N`` (no Python loop over runs).

Sources: Ligett et al. 2017, Algorithm 1 and Theorem 2.7 (Laplace noise reduction, Koufogiannis et al.'s
lazy kernel); docs/privacy/noise_reduction.md#laplace-noise-reduction,
docs/privacy/noise_reduction.md#brownian-noise-reduction and
docs/privacy/finite_precision_reduction.md#fp-noise-reduction (the Laplace and Brownian chains and the ex-post
theorems audited here).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from scipy import stats

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Grid, Noise
from mechanisms.noise.reduction import RATE_DENOMINATOR, discrete_laplace_rates, stay_coins
from mechanisms.reduction.accuracy_first import (
    ACCURACY_FIRST_GAUSSIAN,
    ACCURACY_FIRST_LAPLACE,
    NR_GAUSSIAN_SESSION,
    NR_LAPLACE_SESSION,
    NextQuery,
    NoiseReductionSession,
    RelativeTarget,
    relative_pass,
)
from mechanisms.reduction.noise_reduction import (
    LazyLaplaceNR,
    brownian_cumulative_costs,
    brownian_step,
    brownian_step_variances,
    laplace_nr_path,
    laplace_nr_rates,
    laplace_nr_scales,
)
from mechanisms.threshold.interactive import InteractiveAboveThreshold, iat_scales

pytestmark = pytest.mark.statistical

FALSE_ALARM = 1e-3
"""Per test (Bonferroni across the checks inside it)."""
N = 200_000
EPS = (0.3, 0.5, 1.3, 2.0)
VARIANCES = (16.0, 8.0, 4.0, 2.0)
D = RATE_DENOMINATOR


# ----- exact pmfs ----------------------------------------------------------------------------------------
def _q(rate: int) -> float:
    return math.exp(-rate / D)


def _c(rate: int) -> float:
    q = _q(rate)
    return q / (1 - q) ** 2


def _dlap_pmf(rate: int, limit: int) -> np.ndarray:
    q = _q(rate)
    z = np.arange(-limit, limit + 1)
    result: np.ndarray = (1 - q) / (1 + q) * q ** np.abs(z)
    return result


def _chi_square_pvalue(samples: np.ndarray, pmf: np.ndarray, limit: int) -> float:
    """Chi-square of integer samples against a pmf on [−limit, limit] (bins with expectation < 5 pooled,
    together with everything outside)."""
    n = samples.size
    counts = np.bincount(np.clip(samples, -limit - 1, limit + 1) + limit + 1, minlength=2 * limit + 3)
    expected = np.concatenate([[0.0], pmf, [0.0]]) * n
    expected[0] = expected[-1] = 0.0
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], n - expected[big].sum())
    return float(stats.chisquare(observed, wanted).pvalue)


def _joint_pmf(low: int, high: int, limit: int) -> np.ndarray:
    """Exact P(η_s = x, η_t = y) on [−limit, limit]² for levels of rates low ≤ high (eager construction:
    η_s = η_t + W, W = 0 w.p. c_t/c_s else DLap(low), independent of η_t ~ DLap(high))."""
    rho = _c(high) / _c(low)
    pt = _dlap_pmf(high, limit)
    z = np.arange(-limit, limit + 1)
    q = _q(low)
    increment = (1 - q) / (1 + q) * q ** np.abs(z[:, None] - z[None, :])  # [x, y] = P_s(x − y)
    joint: np.ndarray = (1 - rho) * increment * pt[None, :]
    joint[np.arange(z.size), np.arange(z.size)] += rho * pt
    return joint


def _joint_pvalue(xs: np.ndarray, ys: np.ndarray, joint: np.ndarray, limit: int) -> float:
    n = xs.size
    inside = (np.abs(xs) <= limit) & (np.abs(ys) <= limit)
    counts = np.zeros_like(joint)
    np.add.at(counts, (xs[inside] + limit, ys[inside] + limit), 1)
    expected = joint * n
    big = expected >= 5
    observed = np.append(counts[big], n - counts[big].sum())
    wanted = np.append(expected[big], n - expected[big].sum())
    return float(stats.chisquare(observed, wanted).pvalue)


# ----- helpers -------------------------------------------------------------------------------------------
def _lazy_laplace_path(grid_sensitivity: float, eps: tuple[float, ...], n: int, seed: int) -> np.ndarray:
    noise = Noise.seeded(seed)
    state = LazyLaplaceNR.start(grid_sensitivity, eps, n, noise)
    rows = [LazyLaplaceNR.noise(state)]
    for _ in eps[1:]:
        state = LazyLaplaceNR.advance(state, noise)
        rows.append(LazyLaplaceNR.noise(state))
    return np.vstack(rows)


def _binomial_pvalues(counts: np.ndarray, n: int, p: np.ndarray) -> np.ndarray:
    return np.array([stats.binomtest(int(c), n, float(q)).pvalue for c, q in zip(counts, p, strict=True)])


def _pairs(k: int) -> list[tuple[int, int]]:
    return [(s, t) for s in range(k) for t in range(s + 1, k)]


_PATHS: dict[str, np.ndarray] = {}


def _path(sampler: str) -> np.ndarray:
    """One eager and one lazy path per session (Δ_g = 2, EPS), shared by the Laplace law tests."""
    if sampler not in _PATHS:
        _PATHS[sampler] = (
            laplace_nr_path(2.0, EPS, N, Noise.seeded(11))
            if sampler == "eager"
            else _lazy_laplace_path(2.0, EPS, N, 12)
        )
    return _PATHS[sampler]


# ----- Laplace: marginals, stay probabilities, eager vs lazy ---------------------------------------------
@pytest.mark.parametrize("sampler", ["eager", "lazy"])
def test_laplace_level_marginals_are_exact(sampler: str) -> None:
    """T2: every level's marginal is DLap(q_t) exactly (chi-square); power: a 1.3× scale is rejected."""
    path = _path(sampler)
    rates = laplace_nr_rates(2.0, EPS)
    limit = 60
    assert min(
        _chi_square_pvalue(row, _dlap_pmf(n, limit), limit) for row, n in zip(path, rates, strict=True)
    ) > (FALSE_ALARM / len(EPS))
    wrong = [int(n / 1.3) for n in rates]
    assert max(
        _chi_square_pvalue(row, _dlap_pmf(n, limit), limit) for row, n in zip(path, wrong, strict=True)
    ) < (FALSE_ALARM / len(EPS))


@pytest.mark.parametrize("sampler", ["eager", "lazy"])
def test_laplace_stay_probability_is_the_c_ratio(sampler: str) -> None:
    """T3: P[η_s = η_t] = ρ + (1 − ρ)·P(DLap(q_s) = 0) with ρ = c_t/c_s (the "no new noise" coin, which
    telescopes over levels) for every pair s < t (exact binomial tests); power: a coin of √ρ is rejected."""
    path = _path(sampler)
    rates = laplace_nr_rates(2.0, EPS)
    pairs = _pairs(len(EPS))
    counts = np.array([np.count_nonzero(path[s] == path[t]) for s, t in pairs])
    coin = np.array([_c(rates[t]) / _c(rates[s]) for s, t in pairs])
    zero = np.array([(1 - _q(rates[s])) / (1 + _q(rates[s])) for s, _ in pairs])
    expected = coin + (1 - coin) * zero
    exact = np.array([float(np.trace(_joint_pmf(rates[s], rates[t], 80))) for s, t in pairs])
    assert np.allclose(expected, exact, rtol=1e-9)
    assert np.all(_binomial_pvalues(counts, N, expected) > FALSE_ALARM / counts.size)
    wrong = np.sqrt(coin) + (1 - np.sqrt(coin)) * zero
    assert np.all(_binomial_pvalues(counts, N, wrong) < FALSE_ALARM / counts.size)


@pytest.mark.parametrize("sampler", ["eager", "lazy"])
def test_laplace_joint_law_of_every_pair_is_exact(sampler: str) -> None:
    """T4–T6: the joint pmf of (η_s, η_t) for every pair s < t against the exact one (chi-square), so the
    lazy (reverse-kernel) and the eager chain are the same law; power: a stay coin of √ρ is rejected."""
    path = _path(sampler)
    rates = laplace_nr_rates(2.0, EPS)
    limit = 40
    pairs = _pairs(len(EPS))
    pvalues = [
        _joint_pvalue(path[s], path[t], _joint_pmf(rates[s], rates[t], limit), limit) for s, t in pairs
    ]
    assert min(pvalues) > FALSE_ALARM / len(pairs)
    s, t = 0, 1
    rho = _c(rates[t]) / _c(rates[s])
    wrong = _joint_pmf(rates[s], rates[t], limit)
    pt = _dlap_pmf(rates[t], limit)
    diagonal = np.arange(2 * limit + 1)
    wrong = wrong * (1 - math.sqrt(rho)) / (1 - rho)
    wrong[diagonal, diagonal] += (math.sqrt(rho) - rho * (1 - math.sqrt(rho)) / (1 - rho)) * pt
    assert _joint_pvalue(path[s], path[t], wrong, limit) < FALSE_ALARM


def test_laplace_per_coordinate_coins_are_independent() -> None:
    """T7: the stay indicators of two coordinates of one chain are uncorrelated."""
    two = laplace_nr_path(1.0, EPS[:2], 2 * N, Noise.seeded(33)).reshape(2, N, 2)
    stay = (two[0] == two[1]).astype(float)
    assert abs(np.corrcoef(stay[:, 0], stay[:, 1])[0, 1]) < 5 / math.sqrt(N)


def test_stay_coins_have_the_exact_probability_at_fine_and_coarse_steps() -> None:
    """The ρ = c_b/c_a coin at rate pairs from 1.001 to 10⁴ apart (binomial, Bonferroni)."""
    noise = Noise.seeded(34)
    cases = [
        (D // 1000, D // 1000 + D // 1_000_000),
        (D // 2, 13 * D // 10),
        (D // 10_000, D),
        (3 * D, 7 * D),
    ]
    pvalues = []
    for low, high in cases:
        coins = stay_coins(noise, np.full(N, low), np.full(N, high))
        pvalues.append(stats.binomtest(int(coins.sum()), N, _c(high) / _c(low)).pvalue)
    assert min(pvalues) > FALSE_ALARM / len(cases)


# ----- privacy audits: Laplace ----------------------------------------------------------------------------
AUDIT_RUNS = 1_000_000
AUDIT_FALSE_ALARM = 1e-6


def _log_ratio_lower_bounds(classes_d: np.ndarray, classes_dp: np.ndarray, n_classes: int) -> np.ndarray:
    """Per class, a lower confidence bound on |log P_D(class)/P_D′(class)| (Clopper–Pearson, Bonferroni)."""
    runs = classes_d.size
    counts = np.vstack([np.bincount(c, minlength=n_classes) for c in (classes_d, classes_dp)])
    level = AUDIT_FALSE_ALARM / (4 * n_classes)
    lower = np.where(counts > 0, stats.beta.ppf(level, counts, runs - counts + 1), 0.0)
    upper = np.where(counts < runs, stats.beta.isf(level, counts + 1, runs - counts), 1.0)
    with np.errstate(divide="ignore"):
        forward = np.log(lower[0]) - np.log(upper[1])
        backward = np.log(lower[1]) - np.log(upper[0])
    result: np.ndarray = np.maximum(np.maximum(forward, backward), 0.0)
    return result


BUCKETS = np.array([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0])
AUDIT_EPS = (0.25, 0.5, 1.0, 2.0)


def _threshold_rule(path: np.ndarray) -> np.ndarray:
    """Pass at the first released ŷ_t ≥ 0.5 (rows = levels, columns = runs)."""
    result: np.ndarray = path >= 0.5
    return result


def _relative_rule(path: np.ndarray) -> np.ndarray:
    """The service's own released check (``relative_pass``, r = 0.1: ŷ > 0 and b ≤ ŷ/21), per level."""
    scales = laplace_nr_scales(1.0, AUDIT_EPS)
    columns = [
        relative_pass(path[:, i : i + 1].astype(float), scales, RelativeTarget(relative=0.1))
        for i in range(3)
    ]
    result: np.ndarray = (path > 0) & (scales[:, None] * 2.1 <= 0.1 * path)
    assert all(np.array_equal(result[:, i], columns[i]) for i in range(3))
    return result


def _stopped_laplace_classes(
    value: int,
    seed: int,
    rule: Callable[[np.ndarray], np.ndarray] = _threshold_rule,
    edges: np.ndarray = BUCKETS,
) -> tuple[np.ndarray, np.ndarray]:
    """Run NR on a 1-D integer value (γ = 1, Δ_g = 1), stop at the first level whose *released* ŷ_t passes
    ``rule`` (else the last). Outcome class = (stop level t, bucket of ŷ_t)."""
    path = value + laplace_nr_path(1.0, AUDIT_EPS, AUDIT_RUNS, Noise.seeded(seed))
    k = len(AUDIT_EPS)
    passed = rule(path)
    level = np.where(passed.any(axis=0), np.argmax(passed, axis=0), k - 1)
    released = path[level, np.arange(AUDIT_RUNS)]
    bucket = np.searchsorted(edges, released)
    n_buckets = edges.size + 1
    class_level = np.repeat(np.arange(k), n_buckets)
    classes: np.ndarray = level * n_buckets + bucket
    return classes, class_level


def test_laplace_nr_stopped_by_a_data_dependent_rule_never_exceeds_eps_t() -> None:
    """The empirical loss of every outcome (t, ŷ_t bucket) is ≤ ε_t; an accountant charging ε_0 is caught.

    Neighbouring pair: f(D) = 0, f(D′) = 1 (Δ = 1, γ = 1). False alarm ≤ 1e−6 (Clopper–Pearson, Bonferroni).
    """
    classes_d, class_level = _stopped_laplace_classes(0, 61)
    classes_dp, _ = _stopped_laplace_classes(1, 62)
    lower = _log_ratio_lower_bounds(classes_d, classes_dp, class_level.size)
    charges = np.asarray(AUDIT_EPS)[class_level]
    assert np.all(lower <= charges), np.max(lower - charges)
    assert np.any(lower > AUDIT_EPS[0] + 0.2)  # power: "pay the first level" is caught


def test_laplace_nr_stopped_by_the_services_relative_check_never_exceeds_eps_t() -> None:
    """Same audit with the one-shot mechanism's released check (r = 0.1) as the stopping rule.

    f(D) = 20 vs f(D′) = 21 (a count, Δ = 1); levels of scale ≈ 4, 2, 1, 0.5 pass when ŷ ≥ 84, 42, 21, 10.5.
    """
    classes_d, class_level = _stopped_laplace_classes(20, 63, _relative_rule, BUCKETS + 20.0)
    classes_dp, _ = _stopped_laplace_classes(21, 64, _relative_rule, BUCKETS + 20.0)
    lower = _log_ratio_lower_bounds(classes_d, classes_dp, class_level.size)
    charges = np.asarray(AUDIT_EPS)[class_level]
    assert np.all(lower <= charges), np.max(lower - charges)
    assert np.any(lower > AUDIT_EPS[1])  # power: charging ε_1 (or less) for every outcome is caught


def _level0(value: np.ndarray, eps: tuple[float, float], runs: int, seed: int, shared: bool) -> np.ndarray:
    """The level-0 release (runs, d) of a 2-level chain; ``shared``: the broken shared-coin variant (ONE
    stay coin for all coordinates)."""
    d = value.size
    if not shared:
        path = laplace_nr_path(1.0, eps, runs * d, Noise.seeded(seed))
        released: np.ndarray = value + path[0].reshape(runs, d)
        return released
    noise = Noise.seeded(seed)
    low, high = laplace_nr_rates(1.0, eps)
    top = discrete_laplace_rates(noise, np.full(runs * d, high)).reshape(runs, d)
    move = ~stay_coins(noise, np.full(runs, low), np.full(runs, high))[:, None]
    increments = discrete_laplace_rates(noise, np.full(runs * d, low)).reshape(runs, d)
    released = value + top + move * increments
    return released


def _box_event(released: np.ndarray) -> np.ndarray:
    """Class 1: coordinates 2..d exactly 0 and coordinate 1 ≤ 0 (favours 'all coins stayed')."""
    inside = np.all(released[:, 1:] == 0, axis=1) & (released[:, 0] <= 0)
    result: np.ndarray = inside.astype(np.int64)
    return result


def test_shared_coin_variant_is_caught() -> None:
    """Note P1/T7 on the grid: with one shared coin the level-0 release is not ε_0-DP; per-coordinate coins
    pass. d = 4, ε = (0.5, 1.5), Δ = 1 (D: v = 0, D′: v = e_1)."""
    eps = (0.5, 1.5)
    d = 4
    runs = AUDIT_RUNS // 4  # ample: the broken variant's bound is ≈ 0.99 against ε_0 = 0.5 at this size
    v, vp = np.zeros(d, dtype=np.int64), np.eye(d, dtype=np.int64)[0]
    broken = _log_ratio_lower_bounds(
        _box_event(_level0(v, eps, runs, 71, True)),
        _box_event(_level0(vp, eps, runs, 72, True)),
        2,
    )
    assert broken[1] > eps[0], broken
    correct = _log_ratio_lower_bounds(
        _box_event(_level0(v, eps, runs, 73, False)),
        _box_event(_level0(vp, eps, runs, 74, False)),
        2,
    )
    assert np.all(correct <= eps[0]), correct


# ----- Brownian: the grid chain ------------------------------------------------------------------------
AUDIT_GRID = Grid(-10)
"""A coarser grid than ``brownian_grid`` would pick (2^-12 here), so the discrete Gaussians stay on the
sampler's int64 path at 10⁶ runs; the construction and the charge formula are the same for every γ."""


def _brownian_chain(value_units: int, runs: int, seed: int, grid: Grid = AUDIT_GRID) -> list[np.ndarray]:
    noise = Noise.seeded(seed)
    units = np.full(runs, value_units, dtype=np.int64)
    rows: list[list[int]] = []
    for level in range(len(VARIANCES)):
        rows.append(brownian_step(noise, units, rows[-1] if rows else None, level, VARIANCES, grid))
    return [np.asarray(r, dtype=np.int64) for r in rows]


BROWNIAN_RUNS = 400_000
_BROWNIAN_CACHE: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def _brownian_stopped_losses() -> tuple[np.ndarray, np.ndarray]:
    """(L_S, C_S) per run on D, S a data-dependent stop; one sample shared by every order and factor.

    D: f = 0, D′: f = 1 (1-D, Δ = 1 → V′ = 1/γ units). L_S = Σ_{j ≤ S} ((Y_j − m′_j)² − (Y_j − m_j)²)/(2σ_j²)
    (the discrete Gaussian's normaliser is shift invariant at integer means). Stopping rule (adversarial, on
    released values only): the first level with γ·Y_j ≤ −√t_j/2, else the last.
    """
    if "stopped" in _BROWNIAN_CACHE:
        return _BROWNIAN_CACHE["stopped"]
    runs = BROWNIAN_RUNS
    grid = AUDIT_GRID
    inverse = 2**-grid.exponent
    rows = _brownian_chain(0, runs, 81)
    variances = brownian_step_variances(VARIANCES, grid)
    ratios = [0.0] + [VARIANCES[j] / VARIANCES[j - 1] for j in range(1, len(VARIANCES))]
    loss = np.zeros(runs)
    losses = []
    for j, y in enumerate(rows):
        if j == 0:
            m, mp = np.zeros(runs), np.full(runs, float(inverse))
        else:
            previous = rows[j - 1].astype(float)
            r = ratios[j]  # exact in binary here (1/2): the means below are the sampler's exactly
            m = np.floor(r * previous + 0.5)
            mp = np.floor((1 - r) * inverse + r * previous + 0.5)
        s2 = float(variances[j])
        loss = loss + ((y - mp) ** 2 - (y - m) ** 2) / (2 * s2)
        losses.append(loss.copy())
    released = np.vstack([r.astype(float) / inverse for r in rows])
    stop_now = released <= -0.5 * np.sqrt(np.asarray(VARIANCES))[:, None]
    stop = np.where(stop_now.any(axis=0), np.argmax(stop_now, axis=0), len(VARIANCES) - 1)
    stopped_loss = np.vstack(losses)[stop, np.arange(runs)]
    m_shift = float(inverse)  # the unit shift of the answer: exactly 1/γ (an integer answer)
    cumulative = np.asarray(brownian_cumulative_costs(m_shift, VARIANCES, 1, grid))
    _BROWNIAN_CACHE["stopped"] = (stopped_loss, cumulative[stop])
    return _BROWNIAN_CACHE["stopped"]


def _brownian_audit_means(alpha: float, factor: float) -> tuple[float, float]:
    """Mean and standard error of exp((α−1)(L_S − factor·α·C_S)) on D."""
    stopped_loss, cost = _brownian_stopped_losses()
    x = np.exp((alpha - 1.0) * (stopped_loss - factor * alpha * cost))
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


@pytest.mark.parametrize("alpha", [1.5, 2.0, 3.0, 4.0])
def test_brownian_ex_post_rdp_inequality(alpha: float) -> None:
    """E_D[(P/Q)^{α−1}·e^{−(α−1)·α·C_S}] ≤ 1 for the grid chain stopped adversarially (per-step composition:
    a supermartingale; here ≈ 1 because the rounding term is small). z-interval at false alarm 1e−3 per
    order, 4·10⁵ runs. Power: charging 70% of the curve gives a mean whose lower bound is > 1 (caught)."""
    z = stats.norm.isf(FALSE_ALARM / 2)
    mean, se = _brownian_audit_means(alpha, 1.0)
    assert mean - z * se <= 1.0, (mean, se)
    assert mean + z * se >= 0.99, (mean, se)  # and nearly tight (the rounding term is ≈ 0.2 %)
    under, under_se = _brownian_audit_means(alpha, 0.7)
    assert under - z * under_se > 1.0, (under, under_se)


def test_brownian_grid_chain_has_the_brownian_law() -> None:
    """Y_j − V ≈ N(0, t_j) (KS) and Cov(Y_j, Y_{j+1}) = t_{j+1} (z-tests): the grid chain is the bridge up
    to roundings of order γ; power: a bridge with fresh noise t_j instead of t_j(1 − r_j) is rejected."""
    runs = N
    rows = _brownian_chain(7 * 2**10, runs, 91)
    gamma = AUDIT_GRID.granularity
    values = [r.astype(float) * gamma - 7.0 for r in rows]
    k = len(VARIANCES)
    level = FALSE_ALARM / (2 * k)
    for j, t in enumerate(VARIANCES):
        assert stats.kstest(values[j], stats.norm(scale=math.sqrt(t)).cdf).pvalue > level
    for j in range(k - 1):
        expected = VARIANCES[j + 1]
        se = math.sqrt((VARIANCES[j] * VARIANCES[j + 1] + expected**2) / runs)
        zscore = (np.mean(values[j] * values[j + 1]) - expected) / se
        assert 2 * stats.norm.sf(abs(zscore)) > level
    # Power: the wrong bridge (fresh variance t_j) makes level 1's variance t_1 + r²t_0 = 24, not 8.
    wrong = values[1] * math.sqrt(24 / 8)
    assert stats.kstest(wrong, stats.norm(scale=math.sqrt(VARIANCES[1])).cdf).pvalue < level


# ----- exact-support attack on the releases -------------------------------------------------------------
ATTACK_SCHEMA = DatasetSchema.model_validate(
    {
        "columns": [
            {"name": "k", "type": "int", "min": 0, "max": 9},
            {"name": "x", "type": "float", "min": 0.0, "max": 3.0},
        ],
        "neighboring": "add_remove",
    }
)
ATTACK_CTX = PublicContext(ATTACK_SCHEMA, None, DEFAULT_ORDERS)


def _table(count: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(count)  # test data only
    return {
        "k": np.r_[np.zeros(count, dtype=np.int64), np.ones(5, dtype=np.int64)],
        "x": rng.uniform(0, 3, count + 5),
    }


def _excluded(releases: list[float], granularity: float) -> int:
    """Releases that the neighbour cannot produce: its support is γ·(round(v′/γ) + Z) = γZ (the rounded
    answer is an integer number of units, the noise discrete with full support on the integers), so a
    release rules the neighbour out iff it is not an exact multiple of γ."""
    return sum(1 for y in releases if not (math.isfinite(y) and (y / granularity).is_integer()))


def _one_shot_releases(
    mechanism: Any, params: dict[str, Any], table: dict[str, np.ndarray], n: int
) -> tuple[list[float], float]:
    model = mechanism.params_model.model_validate(params)
    noise = Noise.seeded(len(params) + n)
    out, gamma = [], 0.0
    for _ in range(n):
        release = mechanism.run(model, ATTACK_CTX, table, noise)
        out.append(release.output["value"])
        gamma = release.output["noise"]["granularity"]
    return out, gamma


@pytest.mark.parametrize(
    ("mechanism", "params"),
    [
        (
            ACCURACY_FIRST_LAPLACE,
            {
                "query": {"kind": "count", "where": [{"column": "k", "op": "eq", "value": 0}]},
                "epsilons": (0.01, 0.05, 0.1),
                "target": {"relative": 0.1},
            },
        ),
        (
            ACCURACY_FIRST_LAPLACE,
            {
                "query": {"kind": "sum", "column": "x"},
                "epsilons": (0.01, 0.05, 0.1),
                "target": {"relative": 0.1},
            },
        ),
        (
            ACCURACY_FIRST_GAUSSIAN,
            {
                "query": {"kind": "count", "where": [{"column": "k", "op": "eq", "value": 0}]},
                "variances": (400.0, 100.0, 25.0),
                "target": {"relative": 0.1},
            },
        ),
    ],
)
def test_one_shot_releases_are_on_the_published_grid(mechanism: Any, params: dict[str, Any]) -> None:
    """Every release is a multiple of the published γ, so each is reachable from the neighbour (count 100
    vs 101): 0 of 2000 releases exclude it. The float construction of the same counts is caught below."""
    releases, gamma = _one_shot_releases(mechanism, params, _table(100), 2000)
    assert gamma > 0
    assert _excluded(releases, gamma) == 0


def test_session_releases_are_on_the_published_grid() -> None:
    count = {"kind": "histogram", "column": "k"}
    excluded = 0
    total = 0
    for session, grid in (
        (NR_LAPLACE_SESSION, {"epsilons": (0.05, 0.1, 0.5)}),
        (NR_GAUSSIAN_SESSION, {"variances": (100.0, 10.0, 1.0)}),
    ):
        params = session.params_model.model_validate({"query": count, **grid})
        noise = Noise.seeded(5)
        for _ in range(100):
            state = session.start(params, ATTACK_CTX, noise)
            halted = False
            while not halted:
                result = session.step(params, ATTACK_CTX, state, NextQuery(), _table(100), noise)
                state, halted = result.state, result.halted
                values = list(result.answer["values"].values())
                excluded += _excluded(values, result.answer["noise"]["granularity"])
                total += len(values)
    assert total >= 5000
    assert excluded == 0


def test_the_float_construction_is_caught_by_the_same_attack() -> None:
    """Negative control: the pre-grid release (value + numpy's float Laplace) is almost never on the
    grid, and the exact-support attack of the old sampler (issue: 8 % at ε = 0.1) rules the neighbour out."""
    rng = np.random.default_rng(0)  # the old float sampler, test-side only
    releases = list(100.0 + rng.laplace(0.0, 10.0, 2000))
    assert _excluded(releases, 1.0) > 1900


# ----- InteractiveAboveThreshold stopping law (Ligett et al. 2017, Algorithm 2) ----------------------------
def _iat_stop_counts(runs: int, seed: int, equal_scales: bool) -> np.ndarray:
    """Stop index (1..5, or 6 = no stop in 5) of the module's IAT with every f_t equal to the threshold."""
    noise = Noise.seeded(seed)
    counts = np.zeros(6, dtype=np.int64)
    for _ in range(runs):
        iat = InteractiveAboveThreshold(0.0, 0.8, 1.0, noise)
        if equal_scales:  # the broken variant: query noise of the threshold's scale instead of twice it
            iat.query_scale = iat_scales(0.8, 1.0)[0]
        stop = next((t for t in range(1, 6) if iat.test(0.0, noise)), 6)
        counts[stop - 1] += 1
    return counts


def test_iat_stopping_law_with_queries_at_the_threshold() -> None:
    """T9: P[not halted after t] = (4 − 2^{1−t})/((t+1)(t+2)) for continuous noise; the grid IAT's noises
    are discrete Laplace of scales ≥ 2Δ/ε_A·2^10 units, so the law is the same within the test's power.
    Power: equal threshold and query scales (S(t) = 1/(t+1)) are rejected by the same test."""
    t = np.arange(0, 6)
    survival = (4 - 2.0 ** (1 - t)) / ((t + 1) * (t + 2))  # S(0) = 1
    probabilities = np.append(-np.diff(survival), survival[-1])
    assert probabilities[:3] == pytest.approx([1 / 2, 5 / 24, 5 / 48])
    runs = 12_000
    good = _iat_stop_counts(runs, 91, equal_scales=False)
    assert stats.chisquare(good, runs * probabilities).pvalue > FALSE_ALARM
    bad = _iat_stop_counts(runs, 92, equal_scales=True)
    assert stats.chisquare(bad, runs * probabilities).pvalue < FALSE_ALARM


# ----- the session code itself (one histogram session = many independent coordinates) -------------------
BINS = 10_000
SESSION_SCHEMA = DatasetSchema.model_validate(
    {"columns": [{"name": "b", "type": "int", "min": 0, "max": BINS - 1}], "neighboring": "add_remove"}
)
SESSION_CTX = PublicContext(SESSION_SCHEMA, None, DEFAULT_ORDERS)
SESSION_TABLE = {"b": np.zeros(10, dtype=np.int64)}  # bin 0 has count 10, every other bin 0


def _session_noise(
    session: NoiseReductionSession, grid: dict[str, Any], sessions: int, seed: int
) -> np.ndarray:
    """Released value − truth per level (rows) for every bin of ``sessions`` sessions (columns)."""
    params = session.params_model.model_validate({"query": {"kind": "histogram", "column": "b"}, **grid})
    noise = Noise.seeded(seed)
    truth = np.zeros(BINS)
    truth[0] = 10.0
    blocks = []
    for _ in range(sessions):
        state = session.start(params, SESSION_CTX, noise)
        rows = []
        halted = False
        while not halted:
            result = session.step(params, SESSION_CTX, state, NextQuery(), SESSION_TABLE, noise)
            state, halted = result.state, result.halted
            rows.append(np.array(list(result.answer["values"].values())) - truth)
        blocks.append(np.vstack(rows)[:, 1:])  # drop bin 0 (its truth differs; keeps columns identical)
    return np.hstack(blocks)


def test_laplace_session_releases_the_noise_reduction_law() -> None:
    """The session code (start/step) gives DLap(q_t) per level and the exact stay probabilities."""
    noise = _session_noise(NR_LAPLACE_SESSION, {"epsilons": EPS}, 20, 101).astype(np.int64)
    n = noise.shape[1]
    rates = laplace_nr_rates(1.0, EPS)  # histogram, add_remove: γ = 1, Δ_g = 1
    limit = 40
    assert min(
        _chi_square_pvalue(row, _dlap_pmf(r, limit), limit) for row, r in zip(noise, rates, strict=True)
    ) > (FALSE_ALARM / (2 * len(EPS)))
    pairs = _pairs(len(EPS))
    counts = np.array([np.count_nonzero(noise[s] == noise[t]) for s, t in pairs])
    expected = np.array([float(np.trace(_joint_pmf(rates[s], rates[t], 80))) for s, t in pairs])
    assert np.all(_binomial_pvalues(counts, n, expected) > FALSE_ALARM / (2 * len(pairs)))
    wrong = [int(r / 1.3) for r in rates]
    assert max(
        _chi_square_pvalue(row, _dlap_pmf(r, limit), limit) for row, r in zip(noise, wrong, strict=True)
    ) < (FALSE_ALARM / (2 * len(EPS)))


def test_gaussian_session_releases_the_brownian_law() -> None:
    noise = _session_noise(NR_GAUSSIAN_SESSION, {"variances": VARIANCES}, 5, 102)
    n = noise.shape[1]
    cdfs = [stats.norm(scale=math.sqrt(t)).cdf for t in VARIANCES]
    assert all(
        stats.kstest(row, cdf).pvalue > FALSE_ALARM / (2 * len(VARIANCES))
        for row, cdf in zip(noise, cdfs, strict=True)
    )
    for j in range(len(VARIANCES) - 1):  # Cov(B(t_j), B(t_{j+1})) = t_{j+1}
        expected = VARIANCES[j + 1]
        se = math.sqrt((VARIANCES[j] * VARIANCES[j + 1] + expected**2) / n)
        z = (np.mean(noise[j] * noise[j + 1]) - expected) / se
        assert 2 * stats.norm.sf(abs(z)) > FALSE_ALARM / (2 * len(VARIANCES))
    wrong = [stats.norm(scale=1.3 * math.sqrt(t)).cdf for t in VARIANCES]
    assert all(
        stats.kstest(row, cdf).pvalue < FALSE_ALARM / (2 * len(VARIANCES))
        for row, cdf in zip(noise, wrong, strict=True)
    )
