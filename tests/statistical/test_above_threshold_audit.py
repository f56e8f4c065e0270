"""Monte Carlo privacy audits of the AboveThreshold sessions
(docs/privacy/noise_reduction.md#interactive-above-threshold;
docs/mechanisms/above_threshold.md).

``audit`` runs a vectorised sampler of a mechanism many times on each side of a neighbouring pair of
query-value sequences (no Python loop over runs), counts each outcome class (halt index with a bucketed
gap/value, or ⊥), and computes for every class a lower confidence bound on |log P_D/P_D′| from
Clopper–Pearson intervals (scipy.stats.beta), Bonferroni-corrected so that the whole audit has false-alarm
probability ≤ 1e−6. A correct mechanism must have every lower bound ≤ the charge the code claims for that
outcome (``realized`` on the outcome's transcript). Three known-broken variants of Algorithm 1 must each be
caught (some lower bound above the variant's claimed charge) on an instance chosen to make the violation
large; the correct algorithm passes on the same instance (power check: same test, same size, same seed).

The samplers reuse the module's own exact noise primitives (``geometric_array``, ``kept_array``, the
dropping candidates' ``laplace_plan`` grid and ``LAPLACE.grid``'s integer comparison, all drawing from
``Noise.seeded``) and the code's charges; unit tests tie the session ``step`` code to the exact
distributions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from scipy import stats

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Noise
from mechanisms.queries.language import CountQuery, laplace_plan
from mechanisms.threshold.above_threshold import (
    DROPPING,
    GEOMETRIC,
    LAPLACE,
    candidate_level,
    geometric_array,
    kept_array,
)

pytestmark = pytest.mark.statistical

FALSE_ALARM = 1e-6
RUNS = 1_000_000
SEED = 20240611
BUCKETS = 5  # gap 0, 1, 2, 3, ≥ 4 (geometric); value buckets above the threshold (dropping)

CTX = PublicContext(
    DatasetSchema.model_validate(
        {"columns": [{"name": "g", "type": "categorical", "values": ["a"]}], "neighboring": "add_remove"}
    ),
    None,
    DEFAULT_ORDERS,
)

Sampler = Callable[[Sequence[float], Noise, int], np.ndarray]
"""(query values on one dataset, noise, runs) -> outcome class per run (int array; 0 = ⊥)."""


# ----- the audit ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AuditResult:
    counts: np.ndarray  # (2, classes): outcome counts on D and on D′
    estimate: np.ndarray  # point estimate of |log P_D/P_D′| per class (nan when a count is 0)
    lower: np.ndarray  # lower confidence bound on |log P_D/P_D′| per class
    charges: np.ndarray  # the claimed charge per class

    @property
    def excess(self) -> float:
        """max over classes of (lower bound − charge): > 0 means a proven violation."""
        return float(np.max(self.lower - self.charges))

    @property
    def worst(self) -> int:
        return int(np.argmax(self.lower - self.charges))

    def summary(self) -> str:
        w = self.worst
        return (
            f"class {w}: counts {self.counts[:, w].tolist()}, estimate {self.estimate[w]:.4f}, "
            f"lower bound {self.lower[w]:.4f}, charge {self.charges[w]:.4f}"
        )


def clopper_pearson(counts: np.ndarray, runs: int, level: float) -> tuple[np.ndarray, np.ndarray]:
    """One-sided (level each) Clopper–Pearson lower and upper bounds on binomial proportions."""
    lower = np.where(counts > 0, stats.beta.ppf(level, counts, runs - counts + 1), 0.0)
    upper = np.where(counts < runs, stats.beta.isf(level, counts + 1, runs - counts), 1.0)
    return lower, upper


def audit(
    sample: Sampler,
    first: Sequence[float],
    second: Sequence[float],
    charges: np.ndarray,
    runs: int = RUNS,
    seed: int = SEED,
    false_alarm: float = FALSE_ALARM,
) -> AuditResult:
    """Audit ``sample`` on the neighbouring value sequences ``first`` ~ ``second`` against ``charges``.

    For each class c: P(lower_c > |log P_D(c)/P_D′(c)|) ≤ 4·level (two directions, each using one lower
    and one upper one-sided bound), and level = false_alarm/(4·classes), so with probability ≥ 1 − false_alarm
    no lower bound exceeds the true loss (Bonferroni).
    """
    classes = charges.size
    noise = Noise.seeded(seed)
    counts = np.array(
        [np.bincount(sample(values, noise, runs), minlength=classes) for values in (first, second)]
    )
    assert counts.shape == (2, classes), "the sampler produced an outcome class without a charge"
    level = false_alarm / (4 * classes)
    (low_d, low_e), (high_d, high_e) = zip(*(clopper_pearson(c, runs, level) for c in counts), strict=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lower = np.maximum(np.log(low_d) - np.log(high_e), np.log(low_e) - np.log(high_d))
        estimate = np.abs(np.log(counts[0] / counts[1]))
    estimate[(counts == 0).any(axis=0)] = np.nan
    return AuditResult(counts, estimate, lower, charges)


# ----- samplers (vectorised over runs; the loop is over the few queries) ----------------------------------
def geometric_sampler(
    epsilons: Sequence[float],
    eps_threshold: float,
    *,
    fresh_threshold: bool = False,
    query_noise: bool = True,
) -> Sampler:
    """Algorithm 1; classes 1 + i·BUCKETS + min(gap, BUCKETS − 1), and 0 for ⊥.

    Broken variants: ``fresh_threshold`` redraws k for every query (a); ``query_noise=False`` drops y_i (b).
    """

    def sample(values: Sequence[float], noise: Noise, runs: int) -> np.ndarray:
        cells = np.zeros(runs, dtype=np.int64)
        done = np.zeros(runs, dtype=bool)
        k = geometric_array(noise, eps_threshold, runs)
        for i, (f, eps) in enumerate(zip(values, epsilons, strict=True)):
            if fresh_threshold and i > 0:
                k = geometric_array(noise, eps_threshold, runs)
            y = geometric_array(noise, eps, runs) if query_noise else np.zeros(runs, dtype=np.int64)
            noisy = int(f) + y
            hit = ~done & (noisy >= k)
            cells[hit] = 1 + i * BUCKETS + np.minimum(noisy - k, BUCKETS - 1)[hit]
            done |= hit
        return cells

    return sample


def dropping_sampler(
    epsilons: Sequence[float], eps_threshold: float, threshold: float, width: float
) -> Sampler:
    """Algorithm 2 with grid Laplace candidates of a count (Δ = 1, γ = 1, as ``DROPPING.step``); classes
    1 + i·BUCKETS + value bucket, 0 for ⊥."""

    def sample(values: Sequence[float], noise: Noise, runs: int) -> np.ndarray:
        cells = np.zeros(runs, dtype=np.int64)
        done = np.zeros(runs, dtype=bool)
        k = geometric_array(noise, eps_threshold, runs)
        for i, (f, eps) in enumerate(zip(values, epsilons, strict=True)):
            plan, scale = laplace_plan(CountQuery(kind="count"), CTX, eps)
            keep = kept_array(noise, candidate_level(plan, scale), k)
            units = round(f / plan.grid.granularity)
            released = plan.grid.from_units(units + noise.discrete_laplace(scale, runs))
            hit = ~done & keep & (released >= threshold)
            bucket = np.minimum(np.floor((released - threshold) / width), BUCKETS - 1).astype(np.int64)
            cells[hit] = 1 + i * BUCKETS + bucket[hit]
            done |= hit
        return cells

    return sample


def laplace_sampler(params: Any) -> Sampler:
    """Laplace AboveThreshold on the session's grid (integer comparison, discrete Laplace of the session's
    scales); classes 1 + i (halt at i), 0 for ⊥."""
    grid = LAPLACE.grid(params)

    def sample(values: Sequence[float], noise: Noise, runs: int) -> np.ndarray:
        cells = np.zeros(runs, dtype=np.int64)
        done = np.zeros(runs, dtype=bool)
        noisy_threshold = grid.threshold_units(params.threshold) + noise.discrete_laplace(
            grid.threshold_scale, runs
        )
        for i, f in enumerate(values):
            noisy = grid.value_units(f) + noise.discrete_laplace(grid.query_scale, runs)
            hit = ~done & (noisy >= noisy_threshold)
            cells[hit] = 1 + i
            done |= hit
        return cells

    return sample


# ----- the code's charges per outcome class ----------------------------------------------------------------
def _steps(items: list[dict[str, Any]], halt: int | None, extra: dict[str, Any]) -> list[Any]:
    stop = len(items) if halt is None else halt + 1
    return [
        (item, {"above": i == halt, "index": i, **(extra if i == halt else {})})
        for i, item in enumerate(items[:stop])
    ]


def geometric_charges(epsilons: Sequence[float], eps_threshold: float, monotone: bool) -> np.ndarray:
    params = GEOMETRIC.params_model.model_validate(
        {
            "threshold": 0,
            "epsilon_threshold": eps_threshold,
            "max_query_epsilon": max(epsilons),
            "max_queries": len(epsilons),
            "require_monotone": monotone,
        }
    )
    items = [{"query": {"kind": "count"}, "epsilon": e} for e in epsilons]
    charges = [GEOMETRIC.realized(params, CTX, _steps(items, None, {}), True).pure]
    for i in range(len(epsilons)):
        charges += [
            GEOMETRIC.realized(params, CTX, _steps(items, i, {"gap": o}), True).pure for o in range(BUCKETS)
        ]
    return np.array(charges)


def dropping_charges(epsilons: Sequence[float], eps_threshold: float, threshold: float) -> np.ndarray:
    params = DROPPING.params_model.model_validate(
        {
            "threshold": threshold,
            "epsilon_threshold": eps_threshold,
            "max_query_epsilon": max(epsilons),
            "max_queries": len(epsilons),
        }
    )
    items = [{"query": {"kind": "count"}, "epsilon": e} for e in epsilons]
    charges = [DROPPING.realized(params, CTX, _steps(items, None, {}), True).pure]
    for i in range(len(epsilons)):
        value = {"value": threshold + 1.0}
        charges += [DROPPING.realized(params, CTX, _steps(items, i, value), True).pure] * BUCKETS
    return np.array(charges)


def laplace_charges(params: Any, queries: int) -> np.ndarray:
    items = [{"query": {"kind": "count"}}] * queries
    charges = [LAPLACE.realized(params, CTX, _steps(items, None, {}), True).pure]
    charges += [LAPLACE.realized(params, CTX, _steps(items, i, {}), True).pure for i in range(queries)]
    return np.array(charges)


# ----- audits of the correct mechanisms ------------------------------------------------------------------
NOTE_EPS, NOTE_EPS_THRESHOLD = (0.5, 0.3), 0.1  # Ghazi et al., Algorithm 1: f(D) = (3, 5)


def test_algorithm1_passes_and_the_audit_sees_the_tight_outcome() -> None:
    """(3, 5) ~ (4, 4): the exact loss of a halt at the second query with gap ≥ 1 is 0.7 = 2ε₂ + ε′."""
    charges = geometric_charges(NOTE_EPS, NOTE_EPS_THRESHOLD, monotone=False)
    result = audit(geometric_sampler(NOTE_EPS, NOTE_EPS_THRESHOLD), (3, 5), (4, 4), charges)
    assert result.excess <= 0, result.summary()
    tight = 1 + BUCKETS + 1  # second query, gap 1
    assert result.estimate[tight] == pytest.approx(0.7, abs=0.03)
    assert result.lower[tight] > 0.6  # the audit can see losses close to the charge: it has power


def test_algorithm1_monotone_charge_passes_on_monotone_pairs() -> None:
    charges = geometric_charges(NOTE_EPS, NOTE_EPS_THRESHOLD, monotone=True)
    for second in ((4, 5), (3, 6), (4, 6), (2, 4)):
        result = audit(geometric_sampler(NOTE_EPS, NOTE_EPS_THRESHOLD), (3, 5), second, charges, runs=500_000)
        assert result.excess <= 0, (second, result.summary())


def test_dropping_passes() -> None:
    epsilons, eps_threshold, threshold = (1.0, 0.5, 0.8), 0.2, 4.0
    charges = dropping_charges(epsilons, eps_threshold, threshold)
    sample = dropping_sampler(epsilons, eps_threshold, threshold, width=0.5)
    for second in ((4.0, 3.0, 4.0), (2.0, 5.0, 6.0), (4.0, 5.0, 4.0)):
        result = audit(sample, (3.0, 4.0, 5.0), second, charges)
        assert result.excess <= 0, (second, result.summary())
        assert np.nanmax(result.estimate) > 0.3  # the pair is distinguishable at all


def test_laplace_above_threshold_passes() -> None:
    params = LAPLACE.params_model.model_validate({"threshold": 4.0, "epsilon": 1.0, "max_queries": 3})
    charges = laplace_charges(params, 3)
    for second in ((1.0, 4.0, 3.5), (3.0, 4.0, 5.5), (1.0, 2.0, 3.5)):
        result = audit(laplace_sampler(params), (2.0, 3.0, 4.5), second, charges)
        assert result.excess <= 0, (second, result.summary())


# ----- known-broken variants must be caught ----------------------------------------------------------------
FRESH_EPS, FRESH_EPS_THRESHOLD = (0.5, 0.5, 0.5, 0.5), 0.5
NO_NOISE_EPS, NO_NOISE_EPS_THRESHOLD = (0.5, 0.5), 0.5


@pytest.mark.parametrize(
    ("variant", "first", "second", "correct", "broken", "claimed", "charged"),
    [
        pytest.param(
            "fresh threshold noise per query",
            (-1, -1, -1, -1),
            (0, 0, 0, 0),
            geometric_sampler(FRESH_EPS, FRESH_EPS_THRESHOLD),
            geometric_sampler(FRESH_EPS, FRESH_EPS_THRESHOLD, fresh_threshold=True),
            (FRESH_EPS, FRESH_EPS_THRESHOLD, False),
            (FRESH_EPS, FRESH_EPS_THRESHOLD, False),
            id="a-fresh-threshold",
        ),
        pytest.param(
            "no query noise",
            (0, 0),
            (0, 1),
            geometric_sampler(NO_NOISE_EPS, NO_NOISE_EPS_THRESHOLD),
            geometric_sampler(NO_NOISE_EPS, NO_NOISE_EPS_THRESHOLD, query_noise=False),
            (NO_NOISE_EPS, NO_NOISE_EPS_THRESHOLD, False),
            (NO_NOISE_EPS, NO_NOISE_EPS_THRESHOLD, False),
            id="b-no-query-noise",
        ),
        pytest.param(
            "monotone charge ε_i + ε′ for non-monotone queries",
            (3, 5),
            (4, 4),
            geometric_sampler(NOTE_EPS, NOTE_EPS_THRESHOLD),
            geometric_sampler(NOTE_EPS, NOTE_EPS_THRESHOLD),
            (NOTE_EPS, NOTE_EPS_THRESHOLD, False),
            (NOTE_EPS, NOTE_EPS_THRESHOLD, True),
            id="c-monotone-charge-on-non-monotone-pair",
        ),
    ],
)
def test_broken_variant_is_caught(
    variant: str,
    first: tuple[int, ...],
    second: tuple[int, ...],
    correct: Sampler,
    broken: Sampler,
    claimed: tuple[Sequence[float], float, bool],
    charged: tuple[Sequence[float], float, bool],
) -> None:
    """The correct algorithm with its correct charges passes; the variant with its claimed charges fails."""
    passed = audit(correct, first, second, geometric_charges(*claimed))
    assert passed.excess <= 0, f"correct algorithm on the {variant} instance: {passed.summary()}"
    caught = audit(broken, first, second, geometric_charges(*charged))
    assert caught.excess > 0, f"{variant} was not caught: {caught.summary()}"


def test_audit_false_alarm_level_is_bonferroni() -> None:
    """The helper's confidence bounds: a null pair (identical values) never shows a positive lower bound
    above 0 beyond what the level allows, and the Clopper–Pearson bounds bracket the truth."""
    charges = np.zeros(1 + 2 * BUCKETS)
    result = audit(geometric_sampler(NOTE_EPS, NOTE_EPS_THRESHOLD), (3, 5), (3, 5), charges, runs=200_000)
    assert result.excess <= 0, result.summary()  # identical distributions: every loss is exactly 0
    lo, hi = clopper_pearson(np.array([0, 10, 100]), 1000, 1e-3)
    assert lo[0] == 0.0
    assert np.all(lo[1:] < np.array([0.01, 0.1]))
    assert np.all(hi > np.array([0.0, 0.01, 0.1]))
    assert hi[0] == pytest.approx(1 - 1e-3 ** (1 / 1000), rel=1e-9)
    assert math.isclose(stats.beta.ppf(1e-3, 10, 991), lo[1])
