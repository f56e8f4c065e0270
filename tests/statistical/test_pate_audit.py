"""Monte Carlo audit of ``pate.labels``'s release (Gen-PTR + GNMax, ``gen_ptr_labels``, the function ``run``
calls on the teachers' vote histogram; docs/privacy/pate.md#theorem-pate-ptr).

**Setting** (public): C = 2 labels, k = 61 teachers, one query, σ = 0.5, ε = 2 (test ε̂ = 0.5, mechanism
ε_m = 1.5), δ = 10⁻³ (δ′ = δ_m = 5·10⁻⁴), add/remove (m = 1). The test's scale is t = 2, its threshold
K = ⌈t·log(1/δ′)⌉ = 16. A neighbour moves one teacher's vote, so histograms (a, 61 − a) and (a − 1, 62 − a)
are neighbours (the teachers' partition makes this the only effect of a neighbour: tests/unit/test_pate.py).

**Pairs.** *Edge*: X = (58, 3) (gap 55, h(X) = 16 = K: the test passes about half the time) and
Y = (57, 4) (gap 53, h = 15): the release probability changes as much as the test allows. *Bad*:
X = (31, 30), Y = (30, 31): the top class flips, GNMax with σ = 0.5 separates the two (P_X[label 1] ≈ 0.014,
P_Y[label 1] ≈ 0.83) and both have h = 0, so the real test passes w.p. ≤ δ′.

**Statistic.** Outputs are ⊥, label 0 or label 1. For each pair, direction and outcome o, the lower
confidence bound of P_X(o) − e^ε·P_Y(o) (Clopper–Pearson lower bound of P_X(o) minus e^ε times the upper
bound of P_Y(o), each at level 10⁻⁵) must stay ≤ δ for the real mechanism: 12 checks, false alarm
≤ 2.4·10⁻⁴ if the mechanism is (ε, δ)-DP. Broken variants, which must be caught (lower bound > δ on the bad
pair): *no test* (GNMax released always: Gen-PTR's test skipped) and *no margin* (threshold K = 0: the test
passes on a bad X half the time). Measured with these seeds (N = 3000 per world): real mechanism on the edge
pair releases 61.5 % / 37.4 % of the time, on the bad pair 0 and 1 times; lower bounds −0.028 (below 0).
No test: P_X(1) = 41/3000, P_Y(1) = 2481/3000, lower bound 0.61; no margin: 15 vs 1584 of 3000, lower
bound 0.39. Power: at those rates the chance that either broken variant escapes is below 10⁻³⁰ (binomial
tails), so the power check cannot fail by chance.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import pytest
from scipy import stats

from mechanisms.noise import Noise
from mechanisms.ptr.pate import PateLabelsParams, PatePlan, gen_ptr_labels, gnmax, pate_plan
from mechanisms.ptr.pate_analysis import envelope, instability_distance, top_two_gaps

pytestmark = [pytest.mark.statistical, pytest.mark.slow]

N = 3000
LEVEL = 1e-5
PARAMS = PateLabelsParams.model_validate(
    {
        "features": {"features": ["a"], "label": "c"},
        "labels": ["x", "y"],
        "teachers": 61,
        "queries": [[0.0]],
        "sigma": 0.5,
        "epsilon": 2.0,
        "delta": 1e-3,
    }
)
PLAN = pate_plan(PARAMS, "add_remove")
EDGE = ((58, 3), (57, 4))
BAD = ((31, 30), (30, 31))
BOTTOM = 2  # outcome index of ⊥
Release = Callable[[PatePlan, np.ndarray, Noise], np.ndarray | None]


def no_test(plan: PatePlan, histogram: np.ndarray, noise: Noise) -> np.ndarray | None:
    return gnmax(histogram, plan.sigma, noise)


def no_margin(plan: PatePlan, histogram: np.ndarray, noise: Noise) -> np.ndarray | None:
    return gen_ptr_labels(dataclasses.replace(plan, pass_units=0), histogram, noise)


def outcome_counts(release: Release, counts: tuple[int, int], seed: int) -> np.ndarray:
    histogram = np.asarray([counts], dtype=np.int64)
    noise = Noise.seeded(seed)
    tally = np.zeros(3, dtype=np.int64)
    for _ in range(N):
        out = release(PLAN, histogram, noise)
        tally[BOTTOM if out is None else int(out[0])] += 1
    return tally


def hockey_lower_bound(hits_x: int, hits_y: int) -> float:
    """Lower confidence bound of P_X(o) − e^ε·P_Y(o) (Clopper–Pearson on each, level LEVEL)."""
    low = stats.beta.ppf(LEVEL, hits_x, N - hits_x + 1) if hits_x > 0 else 0.0
    high = stats.beta.ppf(1 - LEVEL, hits_y + 1, N - hits_y) if hits_y < N else 1.0
    return float(low - math.exp(PARAMS.epsilon) * high)


def worst_lower_bound(tally_x: np.ndarray, tally_y: np.ndarray) -> float:
    bounds = [hockey_lower_bound(int(a), int(b)) for a, b in zip(tally_x, tally_y, strict=True)]
    bounds += [hockey_lower_bound(int(b), int(a)) for a, b in zip(tally_x, tally_y, strict=True)]
    return max(bounds)


def test_the_pairs_sit_where_the_docstring_says() -> None:
    table = envelope(PLAN.teachers, PLAN.sigma, PLAN.sensitivity, PLAN.classes)
    budget = PLAN.budget

    def h(counts: tuple[int, int]) -> int:
        gaps = top_two_gaps(np.asarray([counts]))
        return instability_distance(
            table, gaps, 1, budget.mechanism_epsilon, budget.mechanism_delta, PLAN.cap
        )

    assert PLAN.pass_units == 16
    assert [h(c) for c in EDGE] == [16, 15]
    assert [h(c) for c in BAD] == [0, 0]


@pytest.mark.parametrize("pair", [EDGE, BAD], ids=["edge", "bad"])
def test_the_real_release_stays_within_the_charge(pair: tuple[tuple[int, int], tuple[int, int]]) -> None:
    tally_x = outcome_counts(gen_ptr_labels, pair[0], seed=101)
    tally_y = outcome_counts(gen_ptr_labels, pair[1], seed=202)
    assert worst_lower_bound(tally_x, tally_y) <= PARAMS.delta
    if pair == EDGE:  # at the edge the test is a coin flip in both worlds
        assert 0.3 * N < N - tally_x[BOTTOM] < 0.8 * N
        assert 0.2 * N < N - tally_y[BOTTOM] < 0.7 * N
    else:
        assert tally_x[BOTTOM] + tally_y[BOTTOM] >= 2 * N - 10  # P[pass] ≤ δ′ = 5·10⁻⁴ on a bad X


@pytest.mark.parametrize("broken", [no_test, no_margin], ids=["no-test", "no-margin"])
def test_a_broken_variant_is_caught(broken: Release) -> None:
    tally_x = outcome_counts(broken, BAD[0], seed=303)
    tally_y = outcome_counts(broken, BAD[1], seed=404)
    assert worst_lower_bound(tally_x, tally_y) > PARAMS.delta
