"""Sampler checks and a Monte Carlo privacy audit of ex-post tuning (mechanisms/tuning/select.py;
docs/privacy/tuning.md#tuning-verification).

Samplers (exact, ``mechanisms/noise/tuning.py``): the geometric latent's pmf (χ² at three ε′, including
ε′ = 1e-3 where k ~ 10³, and the mean), the law of the whole keep mask for both latents against its exact
inclusion–exclusion form (the exponential latent is never materialised: its mask comes from an exact race),
the keep frequency τ_i of every entry, P(⊥) and the expected number of runs against their closed forms; each
test has a false-alarm probability ≤ 1e-3 (stated per test) and a power check (a wrong ε′ or drop rate is
rejected by the same test). The enclosures of e^{−x} that decide every Bernoulli are checked against
mpmath at 400 bits.

Audit: Algorithm 3 (pure, geometric latent) on T copies of randomized response RR(ε), run on the
neighbouring pair Q_D(1) = e^ε/(1+e^ε) vs Q_D′(1) = 1/(1+e^ε). Outcomes: (1, i), (0, i), ⊥. For every
outcome a Clopper–Pearson lower confidence bound on |log P_D/P_D′| (Bonferroni over all intervals, total
false alarm ≤ 1e-3) must be ≤ the charge ``pure_charges`` claims (2ε + ε′; 0 for ⊥). The simulator uses the
module's own ``sample_kept`` (one shared latent per run) and is tied to ``algorithm3`` by a chi-square test.
Power: the broken variant that re-draws the latent per candidate (independent dropping, which the proof
does not cover) must be caught on the same instance.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from fractions import Fraction

import mpmath
import numpy as np
import pytest
from scipy import stats

from mechanisms.noise import Noise
from mechanisms.noise.tuning import (
    LazyUniform,
    _digit_table,
    _geometric_digit,
    _logistic_bounds,
    discrete_laplace_rows,
    exp_neg_bounds,
    exp_neg_multiple_bounds,
    geometric_by_inversion,
    keep_given_latent,
)
from mechanisms.tuning.charges import expected_runs, probability_bottom, pure_charges
from mechanisms.tuning.select import algorithm3, draw_latent, sample_kept

pytestmark = pytest.mark.statistical

FALSE_ALARM = 1e-3
CHUNK = 100_000

KeepSampler = Callable[[np.ndarray, float, Noise, int], np.ndarray]


def shared_latent(drop: np.ndarray, eps_prime: float, noise: Noise, size: int) -> np.ndarray:
    """The module's sampler: one latent k per run, shared by all candidates."""
    return sample_kept(drop, "geometric", eps_prime, noise, size=size)


def latent_per_candidate(drop: np.ndarray, eps_prime: float, noise: Noise, size: int) -> np.ndarray:
    """BROKEN: a fresh latent for every candidate (independent dropping), with the same exact samplers."""
    columns = []
    for c in drop:
        k = draw_latent(noise, "geometric", eps_prime, size)
        columns.append(keep_given_latent(noise, [Fraction(float(c))], np.zeros(1, dtype=np.int64), k)[:, 0])
    kept: np.ndarray = np.stack(columns, axis=1)
    return kept


def simulate_rr(
    copies: int,
    eps: float,
    eps_prime: float,
    q1: float,
    runs: int,
    seed: int,
    sampler: KeepSampler = shared_latent,
) -> np.ndarray:
    """Outcome counts of Algorithm 3 on ``copies`` × RR: cells (1, i) = i, (0, i) = T + i, ⊥ = 2T.

    The keep mask comes from ``Noise.seeded(seed)``; the simulated candidates' RR bits are test data from a
    numpy generator seeded alongside."""
    noise, rng = Noise.seeded(seed), np.random.default_rng(seed)
    drop = np.full(copies, eps)
    counts = np.zeros(2 * copies + 1, dtype=np.int64)
    index = np.arange(copies)
    for start in range(0, runs, CHUNK):
        size = min(CHUNK, runs - start)
        kept = sampler(drop, eps_prime, noise, size)
        ones = kept & (rng.uniform(size=(size, copies)) < q1)
        last_one = np.where(ones, index, -1).max(axis=1)
        last_kept = np.where(kept, index, -1).max(axis=1)
        cell = np.where(last_one >= 0, last_one, np.where(last_kept >= 0, copies + last_kept, 2 * copies))
        counts += np.bincount(cell, minlength=2 * copies + 1)
    return counts


def clopper_pearson(count: np.ndarray, total: int, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Two-sided Clopper–Pearson interval at miss probability ``level`` (per interval)."""
    lower = np.where(count > 0, stats.beta.ppf(level / 2, count, total - count + 1), 0.0)
    upper = np.where(count < total, stats.beta.ppf(1 - level / 2, count + 1, total - count), 1.0)
    return lower, upper


def loss_lower_bounds(on_d: np.ndarray, on_d2: np.ndarray, runs: int) -> np.ndarray:
    """Lower confidence bounds on |log P_D/P_D′| per cell; all intervals hold together w.p. ≥ 1 − 1e-3."""
    level = FALSE_ALARM / (2 * on_d.size)
    lo_d, up_d = clopper_pearson(on_d, runs, level)
    lo_d2, up_d2 = clopper_pearson(on_d2, runs, level)
    with np.errstate(divide="ignore"):
        forward = np.log(lo_d) - np.log(up_d2)
        backward = np.log(lo_d2) - np.log(up_d)
    result: np.ndarray = np.maximum(0.0, np.maximum(forward, backward))
    return result


def audit(
    copies: int, eps: float, eps_prime: float, runs: int, seed: int, sampler: KeepSampler = shared_latent
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    q1 = math.exp(eps) / (1 + math.exp(eps))
    on_d = simulate_rr(copies, eps, eps_prime, q1, runs, seed, sampler)
    on_d2 = simulate_rr(copies, eps, eps_prime, 1 - q1, runs, seed + 1, sampler)
    charge = pure_charges(np.full(copies, eps), eps_prime)
    claimed = np.concatenate([charge, charge, [0.0]])
    return loss_lower_bounds(on_d, on_d2, runs), claimed, on_d, on_d2


# ----- sampler checks (§7.1) -------------------------------------------------------------------------------
def test_geometric_latent_distribution() -> None:
    """Chi-square of k against Geom_{e^{−ε′}} on bins {0..19, ≥20}; FA 1e-3; a 30%-wrong ε′ is rejected."""
    eps_prime, draws = 0.1, 1_000_000
    k = draw_latent(Noise.seeded(101), "geometric", eps_prime, draws)
    assert k.dtype == np.int64
    assert k.min() == 0

    def p_value(rate: float) -> float:
        m = np.arange(20)
        probs = np.append(-np.expm1(-rate) * np.exp(-rate * m), math.exp(-rate * 20))
        observed = np.bincount(np.minimum(k, 20).astype(int), minlength=21)
        return float(stats.chisquare(observed, probs * draws).pvalue)

    assert p_value(eps_prime) > FALSE_ALARM
    assert p_value(eps_prime * 1.3) < FALSE_ALARM
    assert k.mean() == pytest.approx(1 / math.expm1(eps_prime), rel=0.01)  # 9.508; sd of the mean 0.01


@pytest.mark.parametrize(("eps_prime", "draws", "wrong"), [(1e-3, 400_000, 1.02), (2.5, 1_000_000, 1.01)])
def test_geometric_latent_pmf_is_exact(eps_prime: float, draws: int, wrong: float) -> None:
    """The exact sampler's k against its pmf (1 − e^{−ε′})e^{−ε′k}, on 40 equal-probability bins of k
    (ε′ = 1e-3: k ~ 10³) or on {0..7, ≥8} (ε′ = 2.5: mostly 0); FA 1e-3. Power: an ε′ off by 2 % (1 %) is
    rejected by the same test. (Exactness is by construction; the test guards the construction.)"""
    k = draw_latent(Noise.seeded(111), "geometric", eps_prime, draws)
    assert k.dtype == np.int64
    assert k.min() == 0

    def p_value(rate: float) -> float:
        if eps_prime < 1:
            edges = np.unique(np.floor(-np.log1p(-np.arange(1, 40) / 40) / eps_prime).astype(np.int64))
        else:
            edges = np.arange(1, 9)
        tail = np.exp(-rate * edges.astype(float))  # P(k ≥ edge)
        probs = -np.diff(np.concatenate([[1.0], tail, [0.0]]))
        observed = np.bincount(np.searchsorted(edges, k, side="right"), minlength=edges.size + 1)
        return float(stats.chisquare(observed, probs * draws).pvalue)

    assert p_value(eps_prime) > FALSE_ALARM
    assert p_value(eps_prime * wrong) < FALSE_ALARM


def test_geometric_latent_scalar_path_pmf() -> None:
    """The path a request uses (one k per call, plain integers): 20 000 single draws at ε′ = 0.3 against
    the pmf on {0..11, ≥12} (χ², FA 1e-3); power: a 30 %-wrong ε′ is rejected. Wrong starting proposals
    give the same k (the exact comparisons, not the float estimate, decide)."""
    noise, draws, eps_prime = Noise.seeded(116), 20_000, 0.3
    k = np.array([draw_latent(noise, "geometric", eps_prime) for _ in range(draws)])

    def p_value(rate: float) -> float:
        m = np.arange(12)
        probs = np.append(-np.expm1(-rate) * np.exp(-rate * m), math.exp(-rate * 12))
        observed = np.bincount(np.minimum(k, 12), minlength=13)
        return float(stats.chisquare(observed, probs * draws).pvalue)

    assert p_value(eps_prime) > FALSE_ALARM
    assert p_value(eps_prime * 1.3) < FALSE_ALARM
    for seed in range(200):
        prefix = Noise.seeded(seed).random_bits(64)
        exact = geometric_by_inversion(LazyUniform(Noise.seeded(seed), prefix), Fraction(0.01), 0)
        for start in (exact + 50, max(0, exact - 37), 10**6):
            uniform = LazyUniform(Noise.seeded(seed), prefix)
            assert geometric_by_inversion(uniform, Fraction(0.01), start) == exact


def test_geometric_latent_at_the_smallest_epsilon_prime() -> None:
    """ε′ = 1e-6 (the parameter's minimum; k ~ 10⁶): mean and P(k ≥ 10⁶) within 4 sd (FA ≈ 1e-4 each)."""
    eps_prime, draws = 1e-6, 20_000
    k = draw_latent(Noise.seeded(112), "geometric", eps_prime, draws).astype(float)
    mean = 1 / math.expm1(eps_prime)
    assert abs(k.mean() - mean) < 4 * mean / math.sqrt(draws)
    tail = math.exp(-1.0)
    assert abs((k >= 1e6).mean() - tail) < 4 * math.sqrt(tail * (1 - tail) / draws)


def test_exp_neg_enclosures_are_rigorous() -> None:
    """lo ≤ e^{−x}·2^b ≤ hi, hi − lo ≤ 3, against mpmath at 400 bits on random and edge x."""
    mpmath.mp.prec = 400
    rng = np.random.default_rng(113)  # test data
    xs = [Fraction(0), Fraction(1), Fraction(63), Fraction(64), Fraction(1, 3), Fraction(2.5e-7)]
    xs += [Fraction(float(v)) for v in rng.uniform(0, 1, 300) * 10.0 ** rng.integers(-9, 3, 300)]
    for x in xs:
        for bits in (64, 128, 256):
            lo, hi = exp_neg_bounds(x.numerator, x.denominator, bits)
            exact = mpmath.exp(-mpmath.mpf(x.numerator) / x.denominator) * mpmath.mpf(2) ** bits
            assert lo <= exact <= hi
            assert hi - lo <= 3


def _mask_law(drop: list[float], eps_prime: float, latent: str) -> dict[tuple[bool, ...], float]:
    """P(mask = S) exactly, by inclusion–exclusion over the dropped set: E[Π_S q_i Π_{S^c}(1 − q_j)] with
    E[e^{−Cx}] = ε′/(ε′ + C) (exponential) or (1 − p)/(1 − p·e^{−C}), p = e^{−ε′} (geometric)."""
    law = {}
    for pattern in itertools.product([False, True], repeat=len(drop)):
        kept = sum(c for c, keep in zip(drop, pattern, strict=True) if keep)
        dropped = [c for c, keep in zip(drop, pattern, strict=True) if not keep]
        total = 0.0
        for size in range(len(dropped) + 1):
            for subset in itertools.combinations(dropped, size):
                rate = kept + sum(subset)
                if latent == "exponential":
                    moment = eps_prime / (eps_prime + rate)
                else:
                    moment = -math.expm1(-eps_prime) / -math.expm1(-eps_prime - rate)
                total += (-1) ** size * moment
        law[pattern] = total
    return law


@pytest.mark.parametrize(("latent", "runs"), [("geometric", 400_000), ("exponential", 60_000)])
def test_keep_mask_law_is_exact(latent: str, runs: int) -> None:
    """The joint law of the mask of a 4-entry list (16 patterns) against its exact form; χ², FA 1e-3.
    Power: the same counts are rejected against the law at a 30%-wrong ε′."""
    drop, eps_prime = [0.05, 0.3, 0.3, 1.5], 0.2
    kept = sample_kept(drop, latent, eps_prime, Noise.seeded(114), size=runs)  # type: ignore[arg-type]
    codes = kept.astype(np.int64) @ (1 << np.arange(len(drop)))
    observed = np.bincount(codes, minlength=16)

    def p_value(rate: float) -> float:
        law = _mask_law(drop, rate, latent)
        expected = np.array([law[tuple(bool(code >> i & 1) for i in range(len(drop)))] for code in range(16)])
        assert expected.sum() == pytest.approx(1.0, abs=1e-12)
        return float(stats.chisquare(observed, expected * runs).pvalue)

    assert p_value(eps_prime) > FALSE_ALARM
    assert p_value(eps_prime * 1.3) < FALSE_ALARM


def test_discrete_laplace_rows_pmf_per_scale() -> None:
    """The batched sampler (one call, rows of different scales, as ``predraw`` uses it) against
    P(z) ∝ e^{−|z|/t} for each scale: χ² on |z| ≤ 40 (cells with ≥ 5 expected), FA 1e-3 per scale.
    Power: the rows of scale 7/3 are rejected against the pmf at a 10 %-wrong scale."""
    scales = [Fraction(7, 3), Fraction(0.37), Fraction(1234567, 1 << 17)]
    per, rng = 60_000, np.random.default_rng(115)  # rng only shuffles the row order (test data)
    order = rng.permutation(per * len(scales))
    rows = [scales[int(i) // per] for i in order]
    draws = discrete_laplace_rows(Noise.seeded(115), rows)
    for scale in scales:
        part = draws[np.array([r == scale for r in rows])]

        def p_value(t: float, part: np.ndarray = part) -> float:
            q = math.exp(-1 / t)
            z = np.arange(-40, 41)
            probs = (1 - q) / (1 + q) * q ** np.abs(z)
            keep = probs * part.size >= 5
            observed = np.array([np.count_nonzero(part == v) for v in z[keep]])
            expected = probs[keep] * part.size
            return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)

        assert p_value(float(scale)) > FALSE_ALARM
        if scale == Fraction(7, 3):
            assert p_value(float(scale) * 1.1) < FALSE_ALARM


def test_discrete_laplace_rows_at_model_scales() -> None:
    """Scales as output perturbation uses them (t ~ 10⁴–10⁵ grid units, dyadic; 17–23 binary digits per
    geometric) and a tiny one (t = 1/60: every digit belongs to the tail G), mixed in one call: χ² of each
    scale's draws against the exact cdf on 40 equal-probability bins, FA 1e-3 per scale; power: the draws
    of t ≈ 12 500 are rejected at a 5 %-wrong scale."""
    scales = [Fraction(100_001, 8), Fraction(160_000_003, 1 << 10), Fraction(1, 60)]
    per, rng = 60_000, np.random.default_rng(117)  # rng only shuffles the row order (test data)
    order = rng.permutation(per * len(scales))
    rows = [scales[int(i) // per] for i in order]
    draws = discrete_laplace_rows(Noise.seeded(117), rows)
    for scale in scales:
        part = draws[np.array([r is scale for r in rows])]
        if scale < 1:
            assert np.all(part == 0)  # P(z ≠ 0) = 2q/(1+q) < 2e^{−60}
            continue

        edges = np.unique(np.round(np.linspace(-4, 4, 41) * float(scale)).astype(np.int64))

        def p_value(t: float, part: np.ndarray = part, edges: np.ndarray = edges) -> float:
            q, z = math.exp(-1 / t), edges.astype(float)
            cdf = np.where(z <= -1, q ** (-z) / (1 + q), 1 - q ** (z + 1) / (1 + q))  # P(Z ≤ z)
            observed = np.bincount(np.searchsorted(edges, part, side="left"), minlength=edges.size + 1)
            expected = np.diff(np.concatenate([[0.0], cdf, [1.0]])) * part.size
            return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)

        assert p_value(float(scale)) > FALSE_ALARM
        if scale == Fraction(100_001, 8):
            assert p_value(float(scale) * 1.05) < FALSE_ALARM


def test_digit_thresholds_enclose_the_digit_probabilities() -> None:
    """below_j ≤ 2^16·p_j ≤ above_j, p_j = q^{2^j}/(1 + q^{2^j}), q = e^{−1/t}, against mpmath at 400 bits;
    J is the least with 2^J/t ≥ 45, and the 64-bit logistic enclosures of the slow path hold too."""
    mpmath.mp.prec = 400
    for t in [
        Fraction(1, 60),
        Fraction(1, 44),
        Fraction(0.37),
        Fraction(7, 3),
        Fraction(100_001, 8),
        Fraction((1 << 52) - 1, 3),
        Fraction(1 << 52),
    ]:
        below, above = _digit_table(t.numerator, t.denominator)
        depth = below.size
        assert (1 << depth) >= 45 * t
        assert depth == 0 or (1 << (depth - 1)) < 45 * t
        for j in range(depth):
            q_j = mpmath.exp(-mpmath.mpf(1 << j) * t.denominator / t.numerator)
            p_j = q_j / (1 + q_j)
            assert int(below[j]) <= p_j * 2**16 <= int(above[j])
            assert int(above[j]) - int(below[j]) <= 2
            x = Fraction(1 << j) / t
            lo, hi = _logistic_bounds(x.numerator, x.denominator, 64)
            assert lo <= p_j * mpmath.mpf(2) ** 64 <= hi


def test_open_digits_and_the_tail_are_decided_exactly() -> None:
    """A digit whose first 16 bits leave it open is 1{U < p_j} for U rebuilt from the same seeded stream
    (the next words extend U's prefix); the tail G of a row whose first 16 bits are zero is
    max{m : U < e^{−m·2^J/t}} for that U (here at 2^J/t = 1, where it is ≥ 11)."""
    mpmath.mp.prec = 400
    t = Fraction(7, 3)
    below, _ = _digit_table(t.numerator, t.denominator)
    for seed in range(40):
        j = seed % below.size
        digit = int(below[j])  # below_j ≤ 2^16·p_j: open at 16 bits
        extension = Noise.seeded(seed)
        u = mpmath.mpf(digit) / 2**16 + sum(
            mpmath.mpf(extension.random_bits(64)) / mpmath.mpf(2) ** (16 + 64 * (i + 1)) for i in range(3)
        )
        q_j = mpmath.exp(-mpmath.mpf(1 << j) / (mpmath.mpf(t.numerator) / t.denominator))
        assert _geometric_digit(Noise.seeded(seed), digit, t, j) == bool(u < q_j / (1 + q_j))
        tail = geometric_by_inversion(LazyUniform(Noise.seeded(seed), 0, 16), Fraction(1), 0)
        v = mpmath.mpf(Noise.seeded(seed).random_bits(64)) / mpmath.mpf(2) ** 80  # U's first 80 bits
        assert tail >= 11
        assert tail == int(mpmath.floor(-mpmath.log(v)))


def test_exp_neg_multiple_bounds_are_rigorous() -> None:
    """lo ≤ e^{−k·x}·2^64 ≤ hi and hi − lo ≤ 3 (the power of a cached enclosure), against mpmath."""
    mpmath.mp.prec = 400
    for c in [0.05, 0.07, 0.8, 1e-3, 2.5, 1e-9, 7.0, 0.3, 44.0]:
        x = Fraction(c)
        for k in [*range(0, 70), 100, 500, 1279, 5000, 10**6]:
            lo, hi = exp_neg_multiple_bounds(x.numerator, x.denominator, k)
            exact = mpmath.exp(-mpmath.mpf(x.numerator) * k / x.denominator) * mpmath.mpf(2) ** 64
            assert lo <= exact <= hi
            assert hi - lo <= 3


def test_exponential_latent_is_not_materialised() -> None:
    with pytest.raises(ValueError, match="race"):
        draw_latent(Noise.seeded(1), "exponential", 0.05, 10)


@pytest.mark.parametrize(("latent", "runs"), [("geometric", 400_000), ("exponential", 100_000)])
def test_keep_frequencies_bottom_and_runs_match_closed_forms(latent: str, runs: int) -> None:
    """Per-entry keep rates vs τ_i, P(⊥) vs E_k[Π(1 − e^{−c_j k})], mean runs vs Σ τ_i (z-tests, FA 1e-3)."""
    drop = np.array([0.05, 0.1, 0.3, 1.0, 1.0, 3.0])
    eps_prime = 0.1
    kept = sample_kept(drop, latent, eps_prime, Noise.seeded(103), size=runs)  # type: ignore[arg-type]
    z_crit = stats.norm.isf(FALSE_ALARM / (2 * (drop.size + 2)))

    def z_scores(rate: float) -> list[float]:
        tau = expected_runs(drop, rate, latent)  # type: ignore[arg-type]
        rates = kept.mean(axis=0)
        scores = list((rates - tau) / np.sqrt(tau * (1 - tau) / runs))
        p_bottom = probability_bottom(drop, rate, latent)  # type: ignore[arg-type]
        bottom = float((~kept.any(axis=1)).mean())
        scores.append((bottom - p_bottom) / math.sqrt(p_bottom * (1 - p_bottom) / runs))
        n_runs = kept.sum(axis=1)
        scores.append((n_runs.mean() - tau.sum()) / (n_runs.std() / math.sqrt(runs)))
        return scores

    assert max(abs(z) for z in z_scores(eps_prime)) < z_crit
    assert max(abs(z) for z in z_scores(eps_prime * 1.3)) > z_crit  # power: 30%-wrong ε′


def test_drop_given_k_is_exactly_exp_minus_c_k() -> None:
    """Given the latent, the number kept of T copies is Binomial(T, e^{−ck}) (chi-square, FA 1e-3)."""
    noise = Noise.seeded(104)
    eps_prime, c, copies, runs = 0.2, 0.25, 8, 300_000
    k = draw_latent(noise, "geometric", eps_prime, runs)

    def p_value(drop_rate: float) -> float:
        """Chi-square p-value of the kept counts under drop rate ``drop_rate`` against the exact law at c."""
        kept = keep_given_latent(noise, [Fraction(drop_rate)], np.zeros(copies, dtype=np.int64), k).sum(
            axis=1
        )
        ks = np.arange(0, 400)  # exact mixture pmf of the count under the claimed c
        weights = -np.expm1(-eps_prime) * np.exp(-eps_prime * ks)
        binom = stats.binom.pmf(np.arange(copies + 1)[None, :], copies, np.exp(-c * ks)[:, None])
        expected = (weights[:, None] * binom).sum(axis=0) * runs
        observed = np.bincount(kept, minlength=copies + 1)
        return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)

    assert p_value(c) > FALSE_ALARM
    assert p_value(1.3 * c) < FALSE_ALARM  # power: a 30%-wrong drop rate is rejected


def test_bottom_is_data_independent() -> None:
    """Two-sample test of ⊥ frequencies on D and D′ (binomial z, FA 1e-3), and both match the closed form."""
    copies, eps, eps_prime, runs = 10, 1.0, 0.1, 400_000
    q1 = math.exp(eps) / (1 + math.exp(eps))
    on_d = simulate_rr(copies, eps, eps_prime, q1, runs, 105)
    on_d2 = simulate_rr(copies, eps, eps_prime, 1 - q1, runs, 106)
    p = probability_bottom([eps] * copies, eps_prime, "geometric")
    pooled = (on_d[-1] + on_d2[-1]) / (2 * runs)
    z = (on_d[-1] - on_d2[-1]) / runs / math.sqrt(2 * pooled * (1 - pooled) / runs)
    assert abs(z) < stats.norm.isf(FALSE_ALARM / 2)
    z_d = (on_d[-1] / runs - p) / math.sqrt(p * (1 - p) / runs)
    assert abs(z_d) < stats.norm.isf(FALSE_ALARM / 2)
    # power: the same z test tells apart a latent 30% off (ε′ = 0.13), whose P(⊥) differs
    wrong = simulate_rr(copies, eps, 1.3 * eps_prime, q1, runs, 107)
    z_wrong = (wrong[-1] / runs - p) / math.sqrt(p * (1 - p) / runs)
    assert abs(z_wrong) > stats.norm.isf(FALSE_ALARM / 2)


# ----- the simulator is the algorithm ----------------------------------------------------------------------
def test_simulator_matches_algorithm3() -> None:
    """``algorithm3`` with RR candidates and the vectorised simulator have one outcome law (chi-square)."""
    copies, eps, eps_prime, runs = 4, 1.0, 0.3, 20_000
    q1 = math.exp(eps) / (1 + math.exp(eps))
    rng = np.random.default_rng(107)  # the candidates' RR bits (test data)
    noise = Noise.seeded(107)
    drop = np.full(copies, eps)

    def rr(i: int) -> tuple[tuple[float, ...], int]:
        bit = int(rng.uniform() < q1)
        return (float(bit),), bit

    counts = np.zeros(2 * copies + 1, dtype=np.int64)
    for _ in range(runs):
        selection = algorithm3(drop, eps_prime, "geometric", rr, noise)
        if selection.index is None:
            counts[-1] += 1
        else:
            counts[selection.index + (0 if selection.output == 1 else copies)] += 1
    reference = simulate_rr(copies, eps, eps_prime, q1, 2_000_000, 108)
    expected = reference / reference.sum() * runs
    assert stats.chisquare(counts, expected).pvalue > FALSE_ALARM
    # power: the simulator of the broken sampler has a visibly different law on the same instance
    broken = simulate_rr(copies, eps, eps_prime, q1, 2_000_000, 109, latent_per_candidate)
    assert stats.chisquare(counts, broken / broken.sum() * runs).pvalue < FALSE_ALARM


# ----- the audit (§7.2 / §7.9) -----------------------------------------------------------------------------
@pytest.mark.parametrize(("copies", "eps", "eps_prime"), [(5, 1.0, 0.1), (40, 1.0, 0.1)])
def test_audit_every_outcome_within_its_charge(copies: int, eps: float, eps_prime: float) -> None:
    lower, claimed, on_d, on_d2 = audit(copies, eps, eps_prime, 1_000_000, seed=200 + copies)
    assert np.all(lower <= claimed), (lower - claimed).max()
    # the (0, T) cell approaches the bound (tightness, note §7.2): its point estimate is close to 2ε + ε′
    worst = 2 * copies - 1
    estimate = abs(math.log(on_d2[worst] / on_d[worst]))
    assert estimate > (1.5 if copies == 5 else 1.9)


def test_audit_catches_a_latent_redrawn_per_candidate() -> None:
    lower, claimed, _, _ = audit(40, 1.0, 0.1, 1_000_000, seed=300, sampler=latent_per_candidate)
    assert np.any(lower > claimed)
    assert (lower - claimed).max() > 0.5  # exact loss of (0, T) is ≈ 3.7 against the claimed 2.1
