"""Distribution tests and Monte Carlo privacy audits of noise reduction (Laplace and Brownian).

Every test uses a fixed seed and a stated false-alarm rate (Bonferroni inside a test), and each family of
checks has a power check: a deliberately wrong variant (scale, stay probability, bridge variance, shared
coin, under-charging accountant) that the same test, at the same size, must reject.

Vectorisation: the coordinates of the samplers are independent chains, so N independent runs of a 1-D
chain are one call with ``dim = N`` (no Python loop over runs).

Sources: notes/seed_001_accuracy_first.md §2.1 (facts 1–4, lazy kernel), §5 P1, §6 T2–T8 (Laplace);
§2.10 (Brownian); docs/privacy.md §8.1 (the ex-post RDP theorem audited here).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from scipy import stats

from mechanisms.above_threshold import InteractiveAboveThreshold, iat_scales
from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.accuracy_first import (
    NR_GAUSSIAN_SESSION,
    NR_LAPLACE_SESSION,
    NextQuery,
    NoiseReductionSession,
    RelativeTarget,
    _relative_pass,
)
from mechanisms.base import PublicContext
from mechanisms.noise_reduction import (
    LazyBrownianNR,
    LazyLaplaceNR,
    brownian_nr_path,
    laplace_nr_path,
    laplace_nr_scales,
)
from mechanisms.schema import DatasetSchema

pytestmark = pytest.mark.statistical

FALSE_ALARM = 1e-3
"""Per test (Bonferroni across the checks inside it)."""
N = 200_000
EPS = (0.3, 0.5, 1.3, 2.0)
VARIANCES = (16.0, 8.0, 4.0, 2.0)


# ----- helpers -------------------------------------------------------------------------------------------
def _lazy_laplace_path(delta: float, eps: tuple[float, ...], n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    state = LazyLaplaceNR.start(delta, eps, n, rng)
    rows = [LazyLaplaceNR.noise(state)]
    for _ in eps[1:]:
        state = LazyLaplaceNR.advance(state, rng)
        rows.append(LazyLaplaceNR.noise(state))
    return np.vstack(rows)


def _lazy_brownian_path(variances: tuple[float, ...], n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    state = LazyBrownianNR.start(variances, n, rng)
    rows = [LazyBrownianNR.noise(state)]
    for _ in variances[1:]:
        state = LazyBrownianNR.advance(state, rng)
        rows.append(LazyBrownianNR.noise(state))
    return np.vstack(rows)


def _ks_pvalues(path: np.ndarray, cdfs: list[Callable[[np.ndarray], np.ndarray]]) -> np.ndarray:
    return np.array([stats.kstest(row, cdf).pvalue for row, cdf in zip(path, cdfs, strict=True)])


def _laplace_cdfs(scales: np.ndarray) -> list[Callable[[np.ndarray], np.ndarray]]:
    return [stats.laplace(scale=float(b)).cdf for b in scales]


def _binomial_pvalues(counts: np.ndarray, n: int, p: np.ndarray) -> np.ndarray:
    return np.array([stats.binomtest(int(c), n, float(q)).pvalue for c, q in zip(counts, p, strict=True)])


def _stay_counts(path: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(counts of η_s == η_t, expected (ε_s/ε_t)²) over all pairs s < t."""
    scales = laplace_nr_scales(1.0, EPS)
    pairs = [(s, t) for s in range(len(EPS)) for t in range(s + 1, len(EPS))]
    counts = np.array([np.count_nonzero(path[s] == path[t]) for s, t in pairs])
    expected = np.array([(scales[t] / scales[s]) ** 2 for s, t in pairs])
    return counts, expected


# ----- Laplace: marginals, stay probabilities, eager vs lazy ---------------------------------------------
@pytest.mark.parametrize("sampler", ["eager", "lazy"])
def test_laplace_level_marginals_are_exact(sampler: str) -> None:
    """T2: every level's marginal is Lap(Δ/ε_t) (KS); power: a 30%-wrong scale is rejected."""
    delta = 2.0
    path = (
        laplace_nr_path(delta, EPS, N, np.random.default_rng(11))
        if sampler == "eager"
        else _lazy_laplace_path(delta, EPS, N, 12)
    )
    scales = laplace_nr_scales(delta, EPS)
    assert np.all(_ks_pvalues(path, _laplace_cdfs(scales)) > FALSE_ALARM / len(EPS))
    # E|η_t| = b_t within 6 standard errors (Var|Lap(b)| = b²).
    assert np.all(np.abs(np.abs(path).mean(axis=1) - scales) < 6 * scales / math.sqrt(N))
    # Power: the same KS test rejects every level against a 1.3× scale.
    assert np.all(_ks_pvalues(path, _laplace_cdfs(1.3 * scales)) < FALSE_ALARM / len(EPS))


@pytest.mark.parametrize("sampler", ["eager", "lazy"])
def test_laplace_stay_probability_is_ratio_squared(sampler: str) -> None:
    """T3: P[η_s = η_t] = (ε_s/ε_t)² for every pair s < t (exact binomial test); power: ε_s/ε_t rejected."""
    path = (
        laplace_nr_path(1.0, EPS, N, np.random.default_rng(21))
        if sampler == "eager"
        else _lazy_laplace_path(1.0, EPS, N, 22)
    )
    counts, expected = _stay_counts(path)
    assert np.all(_binomial_pvalues(counts, N, expected) > FALSE_ALARM / counts.size)
    assert np.all(_binomial_pvalues(counts, N, np.sqrt(expected)) < FALSE_ALARM / counts.size)


def test_laplace_eager_and_lazy_agree_in_law() -> None:
    """T6: two-sample tests of levels, increments and stay indicators; correlation ε_s/ε_t (T5); T4."""
    eager = laplace_nr_path(1.0, EPS, N, np.random.default_rng(31))
    lazy = _lazy_laplace_path(1.0, EPS, N, 32)
    pairs = [(s, t) for s in range(len(EPS)) for t in range(s + 1, len(EPS))]
    pvalues = [stats.ks_2samp(eager[t], lazy[t]).pvalue for t in range(len(EPS))]
    pvalues += [stats.ks_2samp(eager[s] - eager[t], lazy[s] - lazy[t]).pvalue for s, t in pairs]
    # Stay indicators: two-proportion z-test per pair.
    for s, t in pairs:
        p1, p2 = np.mean(eager[s] == eager[t]), np.mean(lazy[s] == lazy[t])
        pooled = (p1 + p2) / 2
        z = (p1 - p2) / math.sqrt(2 * pooled * (1 - pooled) / N)
        pvalues.append(2 * stats.norm.sf(abs(z)))
    # T4 on the lazy chain: given a move, the increment η_s − η_t is Lap(Δ/ε_s) (and independent of η_t).
    scales = laplace_nr_scales(1.0, EPS)
    for s, t in pairs:
        moved = lazy[s] != lazy[t]
        increments = lazy[s][moved] - lazy[t][moved]
        pvalues.append(stats.kstest(increments, stats.laplace(scale=scales[s]).cdf).pvalue)
    assert min(pvalues) > FALSE_ALARM / len(pvalues)
    # T5: corr(η_s, η_t) = ε_s/ε_t; the sample correlation's sd is below 2/√N here (Laplace kurtosis 6).
    for path in (eager, lazy):
        corr = np.corrcoef(path)
        for s, t in pairs:
            assert abs(corr[s, t] - EPS[s] / EPS[t]) < 12 / math.sqrt(N)
    # Per-coordinate independence (T7): the stay indicators of two coordinates are uncorrelated.
    two = laplace_nr_path(1.0, EPS[:2], 2 * N, np.random.default_rng(33)).reshape(2, N, 2)
    stay = (two[0] == two[1]).astype(float)
    assert abs(np.corrcoef(stay[:, 0], stay[:, 1])[0, 1]) < 5 / math.sqrt(N)


# ----- Brownian: marginals, covariances, bridge ----------------------------------------------------------
def _bad_bridge_path(variances: tuple[float, ...], n: int, seed: int) -> np.ndarray:
    """A wrong lazy step: the bridge variance t_{j+1} instead of t_{j+1}(t_j − t_{j+1})/t_j."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(n) * math.sqrt(variances[0])]
    for now, nxt in itertools.pairwise(variances):
        rows.append((nxt / now) * rows[-1] + math.sqrt(nxt) * rng.standard_normal(n))
    return np.vstack(rows)


@pytest.mark.parametrize("sampler", ["eager", "lazy"])
def test_brownian_marginals_and_covariances(sampler: str) -> None:
    """B(t_j) ~ N(0, t_j) (KS) and Cov(B(t_i), B(t_j)) = min(t_i, t_j) (z-tests); power: a wrong bridge."""
    path = (
        brownian_nr_path(VARIANCES, N, np.random.default_rng(41))
        if sampler == "eager"
        else _lazy_brownian_path(VARIANCES, N, 42)
    )
    k = len(VARIANCES)
    cdfs = [stats.norm(scale=math.sqrt(t)).cdf for t in VARIANCES]
    n_checks = k + k * (k + 1) // 2
    level = FALSE_ALARM / n_checks
    assert np.all(_ks_pvalues(path, cdfs) > level)
    var = np.asarray(VARIANCES)
    for i in range(k):
        for j in range(i, k):
            expected = min(var[i], var[j])
            se = math.sqrt((var[i] * var[j] + expected**2) / N)
            z = (np.mean(path[i] * path[j]) - expected) / se
            assert 2 * stats.norm.sf(abs(z)) > level, (i, j)
    # Power: the wrong bridge's later levels fail the same KS test.
    bad = _bad_bridge_path(VARIANCES, N, 43)
    assert np.all(_ks_pvalues(bad, cdfs)[1:] < level)


def test_brownian_eager_and_lazy_agree_in_law() -> None:
    eager = brownian_nr_path(VARIANCES, N, np.random.default_rng(51))
    k = len(VARIANCES)

    def smallest_pvalue(lazy: np.ndarray) -> float:
        pvalues = [stats.ks_2samp(eager[j], lazy[j]).pvalue for j in range(k)]
        steps = [(eager[j] - eager[j + 1], lazy[j] - lazy[j + 1]) for j in range(k - 1)]
        pvalues += [stats.ks_2samp(a, b).pvalue for a, b in steps]
        return float(min(pvalues)) * len(pvalues)  # Bonferroni

    assert smallest_pvalue(_lazy_brownian_path(VARIANCES, N, 52)) > FALSE_ALARM
    # power: a lazy chain whose second level is 30% off is told apart
    wrong = (VARIANCES[0], 1.3 * VARIANCES[1], *VARIANCES[2:])
    assert smallest_pvalue(_lazy_brownian_path(wrong, N, 53)) < FALSE_ALARM


# ----- privacy audits -----------------------------------------------------------------------------------
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
    """The service's own released check (``_relative_pass``, r = 0.1: ŷ > 0 and b ≤ ŷ/21), per level."""
    scales = laplace_nr_scales(1.0, AUDIT_EPS)
    columns = [_relative_pass(path[:, i : i + 1], scales, RelativeTarget(relative=0.1)) for i in range(3)]
    assert all(c.shape == (len(AUDIT_EPS),) for c in columns)  # the helper works level-wise on one run
    # Vectorised form of the same rule over all runs (checked equal on the first runs just above).
    result: np.ndarray = (path > 0) & (scales[:, None] * 2.1 <= 0.1 * path)
    assert all(np.array_equal(result[:, i], columns[i]) for i in range(3))
    return result


def _stopped_laplace_classes(
    value: float,
    seed: int,
    rule: Callable[[np.ndarray], np.ndarray] = _threshold_rule,
    edges: np.ndarray = BUCKETS,
) -> tuple[np.ndarray, np.ndarray]:
    """Run NR on a 1-D value, stop at the first level whose *released* ŷ_t passes ``rule`` (else the last).

    Outcome class = (stop level t, bucket of ŷ_t); returns (class per run, level per class).
    """
    path = value + laplace_nr_path(1.0, AUDIT_EPS, AUDIT_RUNS, np.random.default_rng(seed))
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

    Neighbouring pair: f(D) = 0, f(D′) = 1 (Δ = 1). False alarm ≤ 1e−6 (Clopper–Pearson, Bonferroni).
    """
    classes_d, class_level = _stopped_laplace_classes(0.0, 61)
    classes_dp, _ = _stopped_laplace_classes(1.0, 62)
    lower = _log_ratio_lower_bounds(classes_d, classes_dp, class_level.size)
    charges = np.asarray(AUDIT_EPS)[class_level]
    assert np.all(lower <= charges), np.max(lower - charges)
    # Power: the broken accountant "pay the first level" (ε_0 for every outcome) is caught.
    assert np.any(lower > AUDIT_EPS[0] + 0.2)


def test_laplace_nr_stopped_by_the_services_relative_check_never_exceeds_eps_t() -> None:
    """Same audit with the one-shot mechanism's released check (r = 0.1) as the stopping rule.

    f(D) = 20 vs f(D′) = 21 (a count, Δ = 1); levels b = 4, 2, 1, 0.5 pass when ŷ ≥ 84, 42, 21, 10.5.
    """
    classes_d, class_level = _stopped_laplace_classes(20.0, 63, _relative_rule, BUCKETS + 20.0)
    classes_dp, _ = _stopped_laplace_classes(21.0, 64, _relative_rule, BUCKETS + 20.0)
    lower = _log_ratio_lower_bounds(classes_d, classes_dp, class_level.size)
    charges = np.asarray(AUDIT_EPS)[class_level]
    assert np.all(lower <= charges), np.max(lower - charges)
    assert np.any(lower > AUDIT_EPS[1])  # power: charging ε_1 (or less) for every outcome is caught


def _shared_coin_level0(value: np.ndarray, eps: tuple[float, float], runs: int, seed: int) -> np.ndarray:
    """The broken variant of note P1: ONE coin for all coordinates. Returns the level-0 release (runs, d)."""
    rng = np.random.default_rng(seed)
    b0, b1 = 1.0 / eps[0], 1.0 / eps[1]
    d = value.size
    top = rng.laplace(0.0, b1, size=(runs, d))
    move = rng.random((runs, 1)) >= (b1 / b0) ** 2  # shared across the d coordinates
    released: np.ndarray = value + top + move * rng.laplace(0.0, b0, size=(runs, d))
    return released


def _per_coordinate_level0(value: np.ndarray, eps: tuple[float, float], runs: int, seed: int) -> np.ndarray:
    path = laplace_nr_path(1.0, eps, runs * value.size, np.random.default_rng(seed))
    released: np.ndarray = value + path[0].reshape(runs, value.size)
    return released


def _box_event(released: np.ndarray, width: float) -> np.ndarray:
    """Class 1: coordinates 2..d within ±width of 0 and coordinate 1 ≤ 0 (favours 'all coins stayed')."""
    inside = np.all(np.abs(released[:, 1:]) <= width, axis=1) & (released[:, 0] <= 0.0)
    result: np.ndarray = inside.astype(np.int64)
    return result


def test_shared_coin_variant_is_caught() -> None:
    """Note P1/T7: with one shared coin the level-0 release is not ε_0-DP; per-coordinate coins pass.

    d = 4, ε = (0.5, 1.5), Δ = 1 (D: v = 0, D′: v = e_1). Exact log-ratio of the event for the shared coin:
    ≈ 1.11 > ε_0 = 0.5; for per-coordinate coins it is exactly 0.5.
    """
    eps = (0.5, 1.5)
    d, width = 4, 0.5
    v, vp = np.zeros(d), np.eye(d)[0]
    broken = _log_ratio_lower_bounds(
        _box_event(_shared_coin_level0(v, eps, AUDIT_RUNS, 71), width),
        _box_event(_shared_coin_level0(vp, eps, AUDIT_RUNS, 72), width),
        2,
    )
    assert broken[1] > eps[0], broken
    correct = _log_ratio_lower_bounds(
        _box_event(_per_coordinate_level0(v, eps, AUDIT_RUNS, 73), width),
        _box_event(_per_coordinate_level0(vp, eps, AUDIT_RUNS, 74), width),
        2,
    )
    assert np.all(correct <= eps[0]), correct


def _brownian_audit_means(alpha: float, factor: float, runs: int, seed: int) -> tuple[float, float]:
    """Mean and standard error of exp((α−1)(L_S − factor·α·Δ²/(2 t_S))) on D, S a data-dependent stop.

    D: f = 0, D′: f = Δ = 1 (1-D). y_j = B(t_j); L_j = log N(y_j; 0, t_j)/N(y_j; 1, t_j) = (1 − 2y_j)/(2t_j).
    Stopping rule (adversarial, on released values only): stop at the first level where y_j ≤ −√t_j/2
    (large loss), else at the last level.
    """
    var = np.asarray(VARIANCES)
    path = brownian_nr_path(VARIANCES, runs, np.random.default_rng(seed))
    stop_now = path <= -0.5 * np.sqrt(var)[:, None]
    stop = np.where(stop_now.any(axis=0), np.argmax(stop_now, axis=0), var.size - 1)
    y = path[stop, np.arange(runs)]
    t = var[stop]
    loss = (1.0 - 2.0 * y) / (2.0 * t)
    x = np.exp((alpha - 1.0) * (loss - factor * alpha / (2.0 * t)))
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(runs))


@pytest.mark.parametrize("alpha", [1.5, 2.0, 3.0, 4.0])
def test_brownian_ex_post_rdp_inequality(alpha: float) -> None:
    """E_D[(P/Q)^{α−1}·e^{−(α−1)·αΔ²/(2t_S)}] ≤ 1 (it is exactly 1: optional stopping of a martingale).

    z-interval at false alarm 1e−3 per order (the mean of 10⁶ draws is normal to within far less than
    that here: the summand has all moments). Power: charging 70% of the curve gives a mean whose lower
    confidence bound is > 1 (caught).
    """
    z = stats.norm.isf(FALSE_ALARM / 2)
    mean, se = _brownian_audit_means(alpha, 1.0, AUDIT_RUNS, 81)
    assert mean - z * se <= 1.0 <= mean + z * se, (mean, se)
    under, under_se = _brownian_audit_means(alpha, 0.7, AUDIT_RUNS, 82)
    assert under - z * under_se > 1.0, (under, under_se)


# ----- InteractiveAboveThreshold stopping law (note T9) ------------------------------------------------
def _iat_stop_counts(runs: int, seed: int, equal_scales: bool) -> np.ndarray:
    """Stop index (1..5, or 6 = no stop in 5) of the module's IAT with every f_t equal to the threshold."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(6, dtype=np.int64)
    for _ in range(runs):
        iat = InteractiveAboveThreshold(0.0, 0.8, 1.0, rng)
        if equal_scales:  # the broken variant: query noise Lap(2Δ/ε_A) instead of Lap(4Δ/ε_A)
            iat.query_scale = iat_scales(0.8, 1.0)[0]
        stop = next((t for t in range(1, 6) if iat.test(0.0, rng)), 6)
        counts[stop - 1] += 1
    return counts


def test_iat_stopping_law_with_queries_at_the_threshold() -> None:
    """T9: P[not halted after t] = (4 − 2^{1−t})/((t+1)(t+2)): stops at 1, 2, 3 w.p. 1/2, 5/24, 5/48.

    Chi-square at false alarm 1e−3 on 30 000 runs through the module's class; power: equal threshold
    and query scales (S(t) = 1/(t+1)) are rejected by the same test.
    """
    t = np.arange(0, 6)
    survival = (4 - 2.0 ** (1 - t)) / ((t + 1) * (t + 2))  # S(0) = 1
    probabilities = np.append(-np.diff(survival), survival[-1])
    assert probabilities[:3] == pytest.approx([1 / 2, 5 / 24, 5 / 48])
    runs = 30_000
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
    rng = np.random.default_rng(seed)
    truth = np.zeros(BINS)
    truth[0] = 10.0
    blocks = []
    for _ in range(sessions):
        state = session.start(params, SESSION_CTX, rng)
        rows = []
        halted = False
        while not halted:
            result = session.step(params, SESSION_CTX, state, NextQuery(), SESSION_TABLE, rng)
            state, halted = result.state, result.halted
            rows.append(np.array(list(result.answer["values"].values())) - truth)
        blocks.append(np.vstack(rows)[:, 1:])  # drop bin 0 (its truth differs; keeps columns identical)
    return np.hstack(blocks)


def test_laplace_session_releases_the_noise_reduction_law() -> None:
    """The session code (start/step) gives Lap(Δ/ε_t) per level and stay probabilities (ε_s/ε_t)²."""
    noise = _session_noise(NR_LAPLACE_SESSION, {"epsilons": EPS}, 20, 101)
    n = noise.shape[1]
    scales = laplace_nr_scales(1.0, EPS)
    assert np.all(_ks_pvalues(noise, _laplace_cdfs(scales)) > FALSE_ALARM / len(EPS))
    pairs = [(s, t) for s in range(len(EPS)) for t in range(s + 1, len(EPS))]
    counts = np.array([np.count_nonzero(noise[s] == noise[t]) for s, t in pairs])
    expected = np.array([(scales[t] / scales[s]) ** 2 for s, t in pairs])
    assert np.all(_binomial_pvalues(counts, n, expected) > FALSE_ALARM / len(pairs))
    assert np.all(_ks_pvalues(noise, _laplace_cdfs(1.3 * scales)) < FALSE_ALARM / len(EPS))  # power


def test_gaussian_session_releases_the_brownian_law() -> None:
    noise = _session_noise(NR_GAUSSIAN_SESSION, {"variances": VARIANCES}, 20, 102)
    n = noise.shape[1]
    cdfs = [stats.norm(scale=math.sqrt(t)).cdf for t in VARIANCES]
    assert np.all(_ks_pvalues(noise, cdfs) > FALSE_ALARM / (2 * len(VARIANCES)))
    for j in range(len(VARIANCES) - 1):  # Cov(B(t_j), B(t_{j+1})) = t_{j+1}
        expected = VARIANCES[j + 1]
        se = math.sqrt((VARIANCES[j] * VARIANCES[j + 1] + expected**2) / n)
        z = (np.mean(noise[j] * noise[j + 1]) - expected) / se
        assert 2 * stats.norm.sf(abs(z)) > FALSE_ALARM / (2 * len(VARIANCES))
    wrong = [stats.norm(scale=1.3 * math.sqrt(t)).cdf for t in VARIANCES]
    assert np.all(_ks_pvalues(noise, wrong) < FALSE_ALARM / (2 * len(VARIANCES)))  # power
