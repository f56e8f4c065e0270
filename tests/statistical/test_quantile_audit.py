"""Monte Carlo privacy audit of the quantile mechanism (report-noisy-max with one-sided geometric noise
over public candidates; docs/mechanisms/analytics.md, docs/privacy/analytics.md#quantile).

The sampler is the module's own code path (``candidate_grid``, ``rank_counts``, ``noisy_max_select`` with
the mechanism's rate ``noise_rate`` ≤ ε_q/2, drawing from ``Noise.seeded``), vectorised over runs. On a
neighbouring pair (replace-one) chosen by search to make the loss large (the correct mechanism's exact law
reaches 0.957 of its ε = 1 there, by numerical summation over the noise), every outcome's |log P_D/P_D′|
gets a lower confidence bound from
Clopper–Pearson intervals, Bonferroni-corrected so that the whole audit has false-alarm probability ≤ 1e−6.
The correct mechanism must have every lower bound ≤ ε (its charge). Two known-broken variants must be caught
on the same instance with the same number of runs (power check):

* ``missing_half``: rate ε instead of ε/2 (the score's sensitivity counted once, not for both the winner
  and its best rival): truly 1.98-DP on this pair;
* ``data_candidates``: candidates taken from the data (the distinct observed values) instead of the public
  domain: an outcome possible on D is impossible on D′ (infinite loss).
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext
from mechanisms.data.schema import DatasetSchema, IntColumn
from mechanisms.noise import Noise
from mechanisms.queries.quantile import (
    Quantile,
    QuantileParams,
    candidate_grid,
    noise_rate,
    noisy_max_select,
    per_quantile_epsilon,
    rank_counts,
)

pytestmark = pytest.mark.statistical

FALSE_ALARM = 1e-6
RUNS = 300_000
SEED = 20261126
EPSILON = 1.0
K = 10
D = np.array([1, 1, 1, 1, 1, 4, 5, 7, 7], dtype=np.int64)
D_PRIME = np.array([0, 1, 1, 1, 1, 1, 4, 5, 7], dtype=np.int64)  # one 7 replaced by a 0

COLUMN = IntColumn(name="v", type="int", min=0, max=K - 1)
CTX = PublicContext(
    DatasetSchema.model_validate({"columns": [COLUMN.model_dump()], "neighboring": "replace_one"}),
    D.size,
    DEFAULT_ORDERS,
)
PARAMS = QuantileParams(column="v", quantiles=(0.5,), epsilon=EPSILON, candidates=K)

Sampler = Callable[[np.ndarray, Noise, int], np.ndarray]
"""(data, noise, runs) -> the released value per run (int array)."""


def _release(data: np.ndarray, candidates: np.ndarray, noise: Noise, runs: int, rate: Fraction) -> np.ndarray:
    counts = rank_counts(data, candidates)
    chosen = noisy_max_select(noise, counts, int(data.size), PARAMS.quantiles[0], rate, runs)
    return np.asarray(candidates[chosen])


def correct(data: np.ndarray, noise: Noise, runs: int) -> np.ndarray:
    return _release(data, candidate_grid(COLUMN, PARAMS.candidates), noise, runs, noise_rate(PARAMS))


def missing_half(data: np.ndarray, noise: Noise, runs: int) -> np.ndarray:
    return _release(data, candidate_grid(COLUMN, PARAMS.candidates), noise, runs, 2 * noise_rate(PARAMS))


def data_candidates(data: np.ndarray, noise: Noise, runs: int) -> np.ndarray:
    return _release(data, np.unique(data), noise, runs, noise_rate(PARAMS))


def lower_bounds(sampler: Sampler) -> np.ndarray:
    """Per outcome, a lower confidence bound on |log P_D(o)/P_D′(o)| (simultaneous, level 1 − FALSE_ALARM)."""
    noise = Noise.seeded(SEED)
    counts = np.stack([np.bincount(sampler(data, noise, RUNS), minlength=K) for data in (D, D_PRIME)])
    tests = 2 * 2 * K  # two sides of each of two proportions per outcome
    alpha = FALSE_ALARM / tests
    low = stats.beta.ppf(alpha, counts, RUNS - counts + 1)
    high = stats.beta.ppf(1 - alpha, counts + 1, RUNS - counts)
    low = np.where(counts == 0, 0.0, low)
    with np.errstate(divide="ignore"):
        forward = np.log(low[0]) - np.log(high[1])
        backward = np.log(low[1]) - np.log(high[0])
    return np.nan_to_num(np.maximum(forward, backward), nan=-np.inf, neginf=-np.inf)


def test_the_charge_is_the_requested_epsilon() -> None:
    assert Quantile().worst_case(PARAMS, CTX).pure == EPSILON
    assert per_quantile_epsilon(PARAMS) == Fraction(EPSILON)
    assert 2 * noise_rate(PARAMS) <= per_quantile_epsilon(PARAMS)


def test_correct_mechanism_passes() -> None:
    bounds = lower_bounds(correct)
    assert bounds.max() <= EPSILON, bounds
    assert bounds.max() > 0.75 * EPSILON  # the instance is tight: the audit could see a violation


@pytest.mark.parametrize("broken", [missing_half, data_candidates])
def test_broken_variant_is_caught(broken: Sampler) -> None:
    bounds = lower_bounds(broken)
    assert bounds.max() > EPSILON, bounds
